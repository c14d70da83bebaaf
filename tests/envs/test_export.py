import pyarrow.parquet as pq

from mosaic.envs.export import export_parquet, load_parquet, read_rows


def test_round_trip_and_verl_layout(tasks, tmp_path):
    path = export_parquet(tasks, tmp_path / "out" / "train.parquet")
    assert load_parquet(path) == tasks
    names = pq.read_schema(path).names
    assert names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
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
