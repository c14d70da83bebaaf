"""``mosaic experiment report WORK_DIR``: a grid's results as ``report.md``, ``results.json`` and plots.

Per arm (and setting): accuracy over seeds and questions with a 95 % interval (two-stage bootstrap),
its paired difference to the warm start (hierarchical bootstrap interval, exact sign-flip test over
seeds), sessions per trajectory by kind, the positive-gain share by kind, sampled tokens per trajectory
and seconds per training step. Per pair of arms on the same questions, with **the training seed as the
unit** (``mosaic.train.seedstats``): the difference with a hierarchical bootstrap interval (seeds, then
questions), a permutation test over seeds (the headline p; exact up to 200,000 splits), Welch's test
over seeds, the power of the seed test to detect the paper's +3.5 points from the measured seed-to-seed
SD and the seeds per arm for 80 %; the question-level exact sign test stays, labelled conditional on the
trained models. Every p is Holm-corrected across the pairs shown. Every table ends with an A/A calibration: each arm with
>= 4 seeds against itself over every split of its seeds into halves, the share of splits where each
test gives p < 0.05. With a ``baseline`` setting and two or more arms, a table of whether an arm's lead
changes with the setting (:mod:`mosaic.experiment.interactions`); on the service family its outcomes arm
against arm (:mod:`mosaic.experiment.outcomes`). The evaluations named ``pool`` (default: every ``test`` evaluation) are also
pooled into one headline table (questions of every world together).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from statistics import median

import numpy as np

from mosaic.experiment.runner import DONE, REUSED, adopt, warm_dir
from mosaic.config.loader import dump_config
from mosaic.experiment.spec import Grid, load_grid
from mosaic.experiment.mechanism import (
    finite_number as _num, md_contrast, md_mechanism, mechanism_contrast, mechanism_series, mechanism_table,
)
from mosaic.train.runlog import read_metrics
from mosaic.train.seedstats import PAPER_EFFECT, aa_calibration, compare_seeds, hierarchical_bootstrap, vs_reference
from mosaic.train.stats import detectable_difference, holm, seed_question_ci, sign_test
from mosaic.experiment.plots import make_plots
from mosaic.experiment.interactions import baseline_ablations, interaction_table, md_interactions, setting_contrasts
from mosaic.experiment.outcomes import md_outcomes, outcome_pairs

__all__ = ["collect", "write_report"]

PAPER = {  # docs/algorithm.md §8 (Qwen3.5-4B, BrowseComp; one run, no intervals)
    "compaction": {"mosaic - broadcast (points)": 3.5, "broadcast - grpo (points)": 0.6,
                   "sessions per trajectory": "about 25 % fewer with mosaic",
                   "positive-gain share": "47.7 % -> 59.9 %"},
    "forks": {"mosaic - broadcast (points)": 1.0, "mosaic - grpo (points)": 0.55,
              "broadcast - grpo": "below single-session"},
}


def _json(path: Path, problems: list[str]):
    """``path``'s JSON; None (and a line in ``problems``) when it cannot be read: a file cut by a kill, edited
    or overwritten is left out of the report, said, not a traceback."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        problems.append(f"{path}: unreadable ({type(exc).__name__}: {str(exc)[:80]})")
        return None


def _eval_record(d: Path, name: str, problems: list[str]
                 ) -> tuple[dict[str, float], dict, list[str | None]] | None:
    """An evaluation's per-question mean outcomes, its metrics file and every sample's answer (one read
    of its JSONL); None when it has not run, or (said in ``problems``) when either file is damaged."""
    j, m = d / "evals" / f"{name}.jsonl", d / "evals" / f"{name}.json"
    if not (j.exists() and m.exists()):
        return None
    per: dict[str, list[float]] = {}
    answers: list[str | None] = []
    try:
        for line in j.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                per.setdefault(str(r["question_id"]), []).append(float(r["correct"]))
                answers.append(r.get("answer"))
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
        problems.append(f"{j}: unreadable ({type(exc).__name__}: {str(exc)[:80]}); this evaluation is left out")
        return None
    meta = _json(m, problems)
    return None if not isinstance(meta, dict) else ({q: float(np.mean(v)) for q, v in per.items()}, meta, answers)


def _health(answers: list[str | None], names: set[str] | None) -> dict[str, float]:
    """How intact the policy is: the share of trajectories that answered at all, and the share of given
    answers that are an exact entity name of the world (the tiny model's multi-token name copying is the
    first thing that breaks when RL steps are too large); NaN where the family has no entity names."""
    given = [a for a in answers if a]
    exact = float("nan") if names is None else sum(a in names for a in given) / max(1, len(given))
    return {"answered": len(given) / max(1, len(answers)), "exact_name": exact}


def _world_names(grid: Grid, setting: str, e) -> set[str] | None:
    """The entity names of an evaluation's deep-search world; None for a family without one (service)."""
    from mosaic.train import setup  # torch: only when a report is written
    from mosaic.config.loader import load_config

    cfg = load_config(grid.preset, overrides=[*grid.eval_overrides(setting), *e.overrides()])
    world = getattr(setup.load_split(cfg, e.split), "world", None)
    return None if world is None else world.names()


def _metrics(d: Path, done: dict, problems: list[str]) -> list[dict]:
    """A finished run's per-step metrics; none (and a line in ``problems``) when ``metrics.jsonl`` lacks steps
    its ``done.json`` counts (cut by a kill, edited): its evaluations still count, its series are left out."""
    metrics = [m for m in read_metrics(d) if "step" not in m or _num(m["step"])]
    want, got = done.get("steps") if isinstance(done, dict) else None, {m["step"] for m in metrics if "step" in m}
    if isinstance(want, int) and not isinstance(want, bool) and len(got) < want:
        problems.append(f"{d / 'metrics.jsonl'}: unreadable ({len(got)} of the {want} steps in done.json: its "
                        "per-step series are left out, its evaluations kept)")
        return []
    return metrics


def collect(grid: Grid, work: Path) -> dict:
    """Everything finished in ``work``: per (arm, setting) the per-seed outcomes of each evaluation, metrics;
    ``problems``: the damaged files left out."""
    groups: dict[str, dict] = {}
    problems: list[str] = []
    for r in grid.runs:
        d = adopt(work, r, dump_config(r.config), rename=False)
        g = groups.setdefault(f"{r.arm}/{r.setting}", {"arm": r.arm, "setting": r.setting, "seeds": {}})
        if not (d / DONE).exists() or (done := _json(d / DONE, problems)) is None:
            continue
        evals = {e.name: rec for e in grid.evals if (rec := _eval_record(d, e.name, problems)) is not None}
        metrics = _metrics(d, done, problems)
        curve = [(m["step"], m["critic/score/mean"]) for m in metrics
                 if "step" in m and _num(m.get("critic/score/mean"))]
        ent = [m["actor/entropy"] for m in metrics if _num(m.get("actor/entropy"))]
        steps = [m["timing_s/step"] for m in metrics if _num(m.get("timing_s/step"))]
        reused = _json(d / REUSED, problems) if (d / REUSED).exists() else None
        g["seeds"][r.seed] = {"evals": {k: v[:2] for k, v in evals.items()}, "curve": curve,
                              "series": mechanism_series(metrics),
                              "step_s": median(steps) if steps else float("nan"),
                              "entropy": (float(np.mean(ent[:3])), float(np.mean(ent[-3:]))) if ent else None,
                              "answers": {k: v[2] for k, v in evals.items()}, "done": done,
                              "reused_from": reused.get("from") if isinstance(reused, dict) else None}  # fmt: skip
    warm, warm_answers, read = {}, {}, {}
    for setting in grid.settings:
        d = warm_dir(work, grid, setting)
        shared = d in read  # settings may share one warm-start evaluation: read it once
        if not shared:
            read[d] = {e.name: rec for e in grid.evals if (rec := _eval_record(d, e.name, problems)) is not None}
        warm[setting] = {k: v[:2] for k, v in read[d].items()}
        if not shared:
            warm_answers[setting] = (str(d), {k: v[2] for k, v in read[d].items()})
    return {"groups": groups, "warm": warm, "warm_answers": warm_answers, "problems": problems}


def health_table(grid: Grid, data: dict) -> list[dict]:
    """Per (arm, setting) and the warm start: entropy at the start and end of training (mean of the first
    and last 3 steps), the answer rate and the exact-name share of answers, pooled over evaluations."""
    names: dict[tuple[str, str], set[str]] = {}

    def pooled(per_eval: dict[str, list], setting: str) -> dict[str, float]:
        got = []
        for e in grid.evals:
            if per_eval.get(e.name):
                if (setting, e.name) not in names:
                    names[(setting, e.name)] = _world_names(grid, setting, e)
                got.append((len(per_eval[e.name]), _health(per_eval[e.name], names[(setting, e.name)])))
        n = sum(k for k, _ in got)
        return {k: sum(c * h[k] for c, h in got) / n for k in ("answered", "exact_name")} if n else {}

    rows = []
    shared = len(data.get("warm_answers", {})) == 1 and len(grid.settings) > 1
    for setting, (_, per_eval) in data.get("warm_answers", {}).items():
        if h := pooled(per_eval, setting):
            rows.append({"arm": "warm start", "setting": "(every setting)" if shared else setting, "seeds": 1, **h})
    for g in data["groups"].values():
        seeds = [s for s in g["seeds"].values() if any(s["answers"].values())]
        if not seeds:
            continue
        hs = [pooled(s["answers"], g["setting"]) for s in seeds]
        ent = [s["entropy"] for s in seeds if s.get("entropy")]
        rows.append({"arm": g["arm"], "setting": g["setting"], "seeds": len(seeds),
                     "answered": float(np.mean([h["answered"] for h in hs])),
                     "exact_name": float(np.mean([h["exact_name"] for h in hs])),
                     "exact_name_min": float(min((h["exact_name"] for h in hs), key=lambda x: (x != x, x))),
                     "entropy_start": float(np.mean([a for a, _ in ent])) if ent else float("nan"),
                     "entropy_end": float(np.mean([b for _, b in ent])) if ent else float("nan")})  # fmt: skip
    return rows


def _md_health(rows: list[dict]) -> list[str]:
    out = ["### Policy health (is anything collapsing?)", "",
           "Pooled over every evaluation; entropy is the mean token entropy of the rollouts in the first and last "
           "3 training steps. *Exact names*: the share of given answers that are an exact entity name of the world "
           "(the copying of multi-token names is what breaks first when steps are too large).", "",
           "| arm | setting | seeds | answered % | exact names % (worst seed) | entropy start → end |",
           "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        ent = (f"{r['entropy_start']:.3f} → {r['entropy_end']:.3f}" if "entropy_end" in r and r["entropy_end"] == r["entropy_end"]
               else "–")  # fmt: skip
        worst = f" ({_pct(r['exact_name_min'])})" if "exact_name_min" in r else ""
        out.append(f"| {r['arm']} | {r['setting']} | {r['seeds']} | {_pct(r['answered'])} | "
                   f"{_pct(r['exact_name'])}{worst} | {ent} |")
    return out + [""]


def _matrix(seeds: dict, evals: list[str]) -> tuple[np.ndarray, list[str]] | None:
    """(S, Q) per-question means over the seeds that finished every evaluation in ``evals`` (questions
    of several evaluations concatenated, ids prefixed by the evaluation's name)."""
    rows, qids = [], None
    for s in sorted(seeds):
        ev = seeds[s]["evals"]
        if not all(e in ev for e in evals):
            continue
        ids = [f"{e}:{q}" for e in evals for q in sorted(ev[e][0])]
        vals = [ev[e][0][q] for e in evals for q in sorted(ev[e][0])]
        if qids is None:
            qids = ids
        elif ids != qids:
            raise ValueError(f"seed {s} was evaluated on other questions than the others ({evals})")
        rows.append(vals)
    return (np.array(rows), qids) if rows else None


def _mean_metric(seeds: dict, evals: list[str], prefix: str) -> dict[str, float]:
    vals: dict[str, list[float]] = {}
    for s in seeds.values():
        for e in evals:
            if e in s["evals"]:
                for k, v in s["evals"][e][1]["metrics"].items():
                    if k.startswith(prefix):
                        vals.setdefault(k[len(prefix):], []).append(v)
    return {k: float(np.mean(v)) for k, v in sorted(vals.items())}


def _table(grid: Grid, data: dict, evals: list[str], label: str) -> dict:
    """Arms and pairs on the evaluations ``evals`` (pooled when several)."""
    arms, mats, qsets = {}, {}, {}
    for key, g in data["groups"].items():
        got = _matrix(g["seeds"], evals)
        if got is None:
            continue
        x, qids = got
        qsets[key] = qids
        ci = seed_question_ci(x)
        w = data["warm"].get(g["setting"], {})
        row = {"arm": g["arm"], "setting": g["setting"], **asdict(ci)}
        if all(e in w for e in evals):
            wq = np.array([w[e][0][q.split(":", 1)[1]] for e in evals for q in qids if q.startswith(f"{e}:")])
            row["warm_start"] = float(wq.mean())
            lo, hi = hierarchical_bootstrap(x, wq[None, :], questions="shared")  # one fixed model: paired questions
            row["vs_warm_start"] = {"diff": float(x.mean() - wq.mean()), "lo": lo, "hi": hi,
                                    "p_seeds": vs_reference(x, wq), "p_sign": sign_test(x.mean(0) - wq)}  # fmt: skip
            row["seeds_improving"] = int((x.mean(1) > wq.mean()).sum())
        row["sessions"] = _mean_metric(g["seeds"], evals, "session/count/")
        row["pos_gain_share"] = _mean_metric(g["seeds"], evals, "session/pos_gain_share/")
        row["tokens_per_traj"] = _mean_metric(g["seeds"], evals, "response_length/").get("mean", float("nan"))
        if env := _mean_metric(g["seeds"], evals, "env/"):  # the service family's outcome (docs/service.md)
            row["env"] = env
        reach = _mean_metric(g["seeds"], evals, "session/subagent_result_in_final")
        if reach:  # (evaluations since issue 32 log it: helpers whose result is still in the final state)
            row["results_in_final"] = reach[""]
        row["step_s"] = float(np.nanmedian([s["step_s"] for s in g["seeds"].values()]))
        arms[key], mats[key] = row, x
    keys = list(arms)
    pairs = []
    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            a, b = keys[i], keys[j]
            if arms[a]["setting"] != arms[b]["setting"] or qsets[a] != qsets[b]:
                continue
            pairs.append({"a": a, "b": b, **asdict(compare_seeds(mats[a], mats[b]))})
    ablations = baseline_ablations(arms, mats, qsets, grid.baseline)  # each setting vs the baseline, arm by arm
    contrasts = setting_contrasts(arms, mats, qsets, grid.contrasts)  # the grid's own pairs of settings
    for family in (pairs, ablations, contrasts):  # Holm within each table: arms, settings vs baseline, contrasts
        for name in ("p_sign", "p_seeds", "p_welch"):
            for p, adj in zip(family, holm([p[name] for p in family])):
                p[f"{name}_holm"] = adj
    power = None
    by_setting: dict[str, list[np.ndarray]] = {}
    for k, x in mats.items():
        by_setting.setdefault(arms[k]["setting"], []).append(x)
    # arms with at least two seeds (an arm still at one seed has no seed-to-seed variance to offer)
    seeded = [[x for x in v if x.shape[0] >= 2] for v in by_setting.values()]
    cand = [v for v in seeded if len(v) >= 2]
    if cand:
        power = asdict(detectable_difference(max(cand, key=len)))
    aa = {k: asdict(aa_calibration(x)) for k, x in mats.items() if x.shape[0] >= 4}
    return {"label": label, "evals": evals, "arms": arms, "pairs": pairs, "ablations": ablations, "power": power,
            "aa": aa, "contrasts": contrasts, "interactions": interaction_table(arms, mats, qsets, grid.baseline),
            "outcomes": outcome_pairs(data["groups"], [(p["a"], p["b"]) for p in pairs], evals)}


def _pct(x: float) -> str:
    return "–" if x != x else f"{100 * x:.1f}"


def _md_table(t: dict) -> list[str]:
    service = any("env" in r for r in t["arms"].values())
    resets = any(r["sessions"].get("reset", 0) > 0 for r in t["arms"].values())  # (context-reset sessions)
    items = "episodes" if service else "questions"
    out = [f"### {t['label']}", "", f"| arm | setting | seeds | {items} | accuracy % [95 % CI] | warm start % | "
           "Δ vs warm start [95 % CI], sign-flip p over seeds | seeds > warm | sessions/traj (main, compaction, "
           f"subagent{', reset' if resets else ''}) | "
           "positive-gain share | sampled tokens/traj | s/step |"
           + (" stale-action rate % (visits handled right %) |" if service else ""),
           "|" + " --- |" * (13 if service else 12)]  # fmt: skip
    for r in t["arms"].values():
        env = r.get("env") or {}
        stale = (f" {_pct(env['stale_rate'])} ({_pct(env.get('visits_correct', float('nan')))}) |"
                 if "stale_rate" in env else " – |") if service else ""
        s = r["sessions"]
        vw = r.get("vs_warm_start")
        out.append(
            f"| {r['arm']} | {r['setting']} | {r['seeds']} | {r['questions']} | {_pct(r['accuracy'])} "
            f"[{_pct(r['lo'])}, {_pct(r['hi'])}] | {_pct(r['warm_start']) if 'warm_start' in r else '–'} | "
            + (f"{float(vw['diff']) * 100:+.1f} [{float(vw['lo']) * 100:+.1f}, {float(vw['hi']) * 100:+.1f}]"
               + (f", seeds p {vw['p_seeds']:.2g}" if "p_seeds" in vw else "") if vw else "–")
            + f" | {r.get('seeds_improving', '–')}/{r['seeds']} | {s.get('main', 0):.2f}, {s.get('compaction', 0):.2f}, "
            f"{s.get('subagent', 0):.2f}" + (f", {s.get('reset', 0):.2f}" if resets else "")
            + (f" ({_pct(r['results_in_final'])} % of helpers' results in the final context)" if "results_in_final" in r else "")
            + f" | {r['pos_gain_share'].get('all', float('nan')):.3f} | "
            f"{r['tokens_per_traj']:.0f} | {r['step_s']:.1f} |{stale}")  # fmt: skip
    if service:
        out += ["", "Stale-action rate: mutating actions whose arguments rely on a field an event changed after the "
                "agent last saw it, per mutating action, pooled over each evaluation's trajectories, then averaged "
                "over the seeds' evaluations (those that logged it; docs/service.md)."]
        out += md_outcomes(t.get("outcomes") or [])
    explain = True
    for family, title in ((t["pairs"], "Arms against each other within a setting"),
                          (t.get("ablations") or [], "Each setting against the baseline setting, arm by arm"),
                          (t.get("contrasts") or [], "The grid's pairs of settings (`contrasts`), arm by arm")):
        if family:
            out += _md_pairs(family, title, explain, side="arm" if family is t["pairs"] else "setting")
            explain = False
    out += md_interactions(t.get("interactions"))
    out += _md_aa(t.get("aa") or {})
    if t["power"]:
        pw = t["power"]
        out += ["", f"With questions counted as a second source of noise (for new questions as well; normal "
                f"approximation), the smallest difference detectable at 80 % power (two-sided 5 %) with this grid "
                f"({pw['seeds']} seeds × {pw['questions']} questions): **{100 * pw['mde']:.1f} points** "
                f"(seed-to-seed variance {pw['seed_var']:.2e}, per-question difference variance "
                f"{pw['question_var']:.2e}). Other sizes: "
                + "; ".join(f"{k}: {100 * v:.1f}" for k, v in pw["table"].items()) + "."]  # fmt: skip
    return out + [""]


def _md_pairs(family: list[dict], title: str, explain: bool = True, side: str = "arm") -> list[str]:
    """A table of pairs; the training seed is the unit of the headline test and of the interval."""
    eff = 100 * (family[0].get("effect") or PAPER_EFFECT)
    out = ["", f"{title} (same questions; Holm within this table)" + (". **The unit is the training seed**: the "
           "interval is a hierarchical bootstrap (each arm's seeds resampled, then the questions) and the "
           "headline p a permutation test over the per-seed accuracies (exact: every split of the pooled seeds; "
           "past 200,000 splits, 100,000 random ones, so p ≥ 1e-05). Power: of that test, from the "
           f"pair's pooled seed-to-seed SD, to detect ±{eff:.1f} points (the paper's compaction figure), and the "
           "seeds per arm it would need for 80 %. The question-level sign test is **conditional on the trained "
           "models**: it asks whether these particular checkpoints differ on these questions, not whether the "
           "two training settings do." if explain else ":"), "",
           "| A − B | seeds | Δ points [95 % CI] | seed permutation p (Holm) | Welch p over seeds (Holm) | "
           f"seed SD (points) | power (seeds/{side} for 80 %) | sign test on questions, conditional p (Holm) | "
           "wins/losses/ties |", "|" + " --- |" * 9]  # fmt: skip
    for p in family:
        welch = f"{p['p_welch']:.3g} ({p['p_welch_holm']:.3g})" if p["p_welch"] == p["p_welch"] else "–"
        power = (f"{p['power']:.2f} ({p['seeds_needed'] if p['seeds_needed'] > 0 else '> 10,000'})"
                 if p["power"] == p["power"] else "–")  # fmt: skip
        floor = " †" if p["min_p_seeds"] >= 0.05 else ""
        out.append(f"| {p['a']} − {p['b']} | {p['seeds_a']} + {p['seeds_b']} | {100 * p['diff']:+.1f} "
                   f"[{100 * p['lo']:+.1f}, {100 * p['hi']:+.1f}] | {p['p_seeds']:.3g} ({p['p_seeds_holm']:.3g}){floor} | "
                   f"{welch} | {100 * p['sd']:.1f} | {power} | {p['p_sign']:.3g} ({p['p_sign_holm']:.3g}) | "
                   f"{p['wins']}/{p['losses']}/{p['ties']} |")  # fmt: skip
    if any(p["min_p_seeds"] >= 0.05 for p in family):
        out += ["", "† with so few seeds the exact permutation test cannot give p < 0.05 (its smallest p is "
                "2 / C(S_a + S_b, S_a), or 1 / C when the arms differ in size); its power there is 0."]  # fmt: skip
    return out


def _md_aa(aa: dict[str, dict]) -> list[str]:
    """The A/A calibration: each arm with >= 4 seeds against itself (a line saying so when none has)."""
    if not aa:
        return ["", "A/A calibration: none here (it needs an arm with at least 4 seeds: halves of 2)."]
    out = ["", "A/A calibration: each arm against itself, its seeds split into two equal halves every possible "
           "way (with an odd count, each seed left out in turn). Share of splits where each test gives "
           "p < 0.05 (for the interval: where it excludes 0); a valid test stays near 5 %, below it when the "
           "halves are too small for the test to reach 0.05.", "",
           "| arm | seeds | splits (halves) | seed permutation | Welch over seeds | sign test on questions "
           "(conditional) | bootstrap interval excludes 0 |", "|" + " --- |" * 7]  # fmt: skip
    tot = {k: 0.0 for k in ("splits", "rate_seeds", "rate_welch", "rate_sign", "rate_interval")}
    for key, c in aa.items():
        h = c["halves"]
        note = f", smallest p {c['min_p_seeds']:.2g}" if c["min_p_seeds"] >= c["alpha"] else ""
        out.append(f"| {key} | {c['seeds']} | {c['splits']} ({h[0]} v {h[1]}) | {_pct(c['rate_seeds'])} %{note} | "
                   f"{_pct(c['rate_welch'])} % | {_pct(c['rate_sign'])} % | {_pct(c['rate_interval'])} % |")
        tot["splits"] += c["splits"]
        for k in ("rate_seeds", "rate_welch", "rate_sign", "rate_interval"):
            tot[k] += c[k] * c["splits"]  # (the interval's rate: on up to 50 splits per arm, weighted alike)
    if len(aa) > 1:
        n = tot["splits"]
        out.append(f"| every arm | – | {int(n)} | {_pct(tot['rate_seeds'] / n)} % | {_pct(tot['rate_welch'] / n)} % | "
                   f"{_pct(tot['rate_sign'] / n)} % | {_pct(tot['rate_interval'] / n)} % |")
    return out


def write_report(work: Path, out: Path) -> list[Path]:
    """Write ``report.md``, ``results.json`` and ``plots/*.png`` for the grid in ``work``."""

    grid = load_grid(work / "grid.yaml")
    data = collect(grid, work)
    tests = [e.name for e in grid.evals if e.split == "test"]
    tables = [_table(grid, data, [e.name], f"{e.name} ({e.split}, data seed {e.data_seed}, {e.n_tasks} questions "
                                           f"× {e.samples} samples at T {e.temperature})") for e in grid.evals]
    if len(tests) > 1:
        tables.insert(0, _table(grid, data, tests, f"pooled over {', '.join(tests)} (headline)"))
    out.mkdir(parents=True, exist_ok=True)
    results = {"grid": grid.name, "work": str(work), "tables": tables,
               "paper": PAPER.get(grid.name.split("-")[0]), "runs_done": sum(len(g["seeds"]) for g in data["groups"].values()),
               "runs": len(grid.runs)}  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    health = health_table(grid, data)
    results["health"] = health
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    plots = make_plots(grid, data, out / "plots")
    md = [f"# Grid `{grid.name}`", "", f"{results['runs_done']} of {results['runs']} runs finished. Arms: "
          + ", ".join(f"`{a}` ({' '.join(ov) or 'preset'})" for a, ov in grid.arms.items()) + f"; seeds {list(grid.seeds)}; "
          f"common overrides: `{' '.join(grid.common) or '-'}`.", ""]  # fmt: skip
    for line in data["problems"]:
        print(f"[mosaic] {line}", file=sys.stderr, flush=True)
    if data["problems"]:
        md += [f"**{len(data['problems'])} damaged file(s) left out** (a run without a readable `done.json` counts "
               "as unfinished, one whose `metrics.jsonl` lacks steps keeps its evaluations but not its per-step "
               "series; delete a damaged evaluation or `done.json` and rerun the grid to redo that piece):", ""]
        md += [f"- `{Path(p).relative_to(work) if Path(p).is_relative_to(work) else p}`" for p in
               (x.split(": unreadable")[0] for x in data["problems"])] + [""]
    reused = sorted({s["reused_from"] for g in data["groups"].values() for s in g["seeds"].values() if s.get("reused_from")})
    if reused:
        md += [f"{len(reused)} run(s) were trained once, by another grid with the same config, and copied here "
               f"(`reuse:`); only their evaluations ran in this grid: " + ", ".join(f"`{r}`" for r in reused) + ".", ""]
    for t in tables:
        md += _md_table(t)
    if health:
        md += _md_health(health)
    mech = mechanism_table(data)
    if mech:
        results["mechanism"] = mech
        results["mechanism_contrast"] = contrast = mechanism_contrast(data)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
        md += md_mechanism(mech) + md_contrast(contrast)
    if results["paper"]:
        md += ["### The paper (docs/algorithm.md §8; one run, no intervals)", ""] + [f"- {k}: {v}" for k, v in results["paper"].items()] + [""]
    md += ["### Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    (out / "report.md").write_text("\n".join(md))
    return [out / "report.md", out / "results.json", *plots]
