import pyarrow.parquet as pq

from mosaic.envs.export import export_parquet, load_parquet, read_rows


def test_round_trip_and_verl_layout(tasks, tmp_path):
    path = export_parquet(tasks, tmp_path / "out" / "train.parquet")
    assert load_parquet(path) == tasks
    names = pq.read_schema(path).names
    assert names == ["data_source", "agent_name", "prompt", "ability", "reward_model", "extra_info"]
    row = read_rows(path)[7]
    t = tasks[7]
    assert row["data_source"] == "mosaic/deepsearch" and row["ability"] == "deep-search"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][1]["content"] == t.question
    assert "<answer>" in row["prompt"][0]["content"]
    assert row["reward_model"] == {"style": "rule", "ground_truth": t.answer}
    info = row["extra_info"]
    assert (info["index"], info["split"], info["hops"]) == (7, "train", t.hops)
    assert [h["doc_id"] for h in info["gold_chain"]] == [h.doc_id for h in t.gold_chain]
    assert info["gold_chain"][-1]["target"] == t.answer


def test_rows_carry_the_verl_agent_loop_fields_and_rebuild_their_world(tmp_path):
    from mosaic.envs.export import split_config_from_json
    from mosaic.envs.splits import split_config

    cfg = split_config("validation", "cpu", seed=3)
    from mosaic.envs.export import task_to_row
    from mosaic.envs.questions import Task

    task = Task(id="t0", question="q?", answer="A B", hops=2, split="validation", gold_chain=[], start="s", style="x")
    row = task_to_row(task, 0, cfg)
    assert row["agent_name"] == "mosaic_agent"
    back = split_config_from_json(row["extra_info"]["tools_kwargs"]["split_config"])
    assert back.key == cfg.key and back.world.seed == cfg.world.seed and back.hop_mix == cfg.hop_mix
    assert task_to_row(task, 0)["extra_info"]["tools_kwargs"] == {"split_config": ""}
