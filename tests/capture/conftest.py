from __future__ import annotations

import pytest

from mosaic.agent.tokenizer import load_tokenizer, save_tokenizer
from mosaic.capture.proxy import ProxyConfig, create_proxy_app
from mosaic.serving import ServerThread
from mosaic.capture.scripted import build_tokenizer
from mosaic.capture.scripted_server import ScriptedConfig, create_scripted_app


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(build_tokenizer(), d)
    return d


@pytest.fixture(scope="session")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.fixture
def upstream(tok):
    app = create_scripted_app(tok)
    with ServerThread(app) as srv:
        srv.app = app
        yield srv


@pytest.fixture
def make_proxy(tmp_path):
    started = []

    def make(upstream_url: str, **kw):
        out = kw.pop("out_dir", str(tmp_path / f"rec{len(started)}"))
        tokenizer = kw.pop("tokenizer_obj", None)
        cfg = ProxyConfig(upstream=upstream_url, out_dir=out, **kw)
        app = create_proxy_app(cfg, tokenizer=tokenizer)
        srv = ServerThread(app).start()
        srv.out_dir, srv.app = out, app
        started.append(srv)
        return srv

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def scripted_app_factory(tok):
    def make(**kw):
        return create_scripted_app(tok, ScriptedConfig(**kw))

    return make
