from mosaic.envs.calibrate import CalibrationConfig, calibration_table, format_table, proxy_count


def test_proxy_count():
    assert proxy_count("Port Osk, founder.") == 5
    assert proxy_count("<answer>X</answer>") == 8


def test_table_rows_and_monotone_in_budget(index, tasks):
    small = calibration_table(index, tasks, CalibrationConfig(context_budget=512))
    large = calibration_table(index, tasks, CalibrationConfig(context_budget=2048))
    assert [r["hops"] for r in small] == [2, 3, 4, 5]
    for s, l in zip(small, large):
        assert s["searches"] == s["hops"]  # expert: one search per hop
        assert s["sessions_mean"] >= l["sessions_mean"]
        assert l["sessions_mean"] == 1
    assert "| hops |" in format_table(small)


def test_default_budget_forces_two_sessions_for_most_3_to_5_hop(index, tasks):
    rows = calibration_table(index, tasks, CalibrationConfig())
    for r in rows:
        if r["hops"] >= 3:
            assert r["share_ge2_sessions"] >= 0.5, r


def test_more_searches_per_hop_means_more_sessions(index, tasks):
    one = calibration_table(index, tasks[:40], CalibrationConfig(searches_per_hop=1))
    two = calibration_table(index, tasks[:40], CalibrationConfig(searches_per_hop=2))
    assert sum(r["sessions_mean"] for r in two) > sum(r["sessions_mean"] for r in one)


def test_bpe_tokenizer_runs(index, tasks):
    rows = calibration_table(index, tasks[:20], CalibrationConfig(tokenizer="bpe", bpe_vocab=512))
    assert rows and all(r["tokens_per_search"] > 0 for r in rows)
