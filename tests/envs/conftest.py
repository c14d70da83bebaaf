import pytest

from mosaic.envs.deepsearch import SearchIndex, WorldConfig, generate_world, make_tasks


@pytest.fixture(scope="session")
def world():
    return generate_world(WorldConfig(seed=7, n_entities=400))


@pytest.fixture(scope="session")
def tasks(world):
    return make_tasks(world, 200, seed=3, split="train")


@pytest.fixture(scope="session")
def index(world, tmp_path_factory):
    return SearchIndex(world, cache_dir=tmp_path_factory.mktemp("cache"))
