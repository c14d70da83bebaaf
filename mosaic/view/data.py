"""What the page shows, read from a run directory, a ``samples.jsonl`` or a rollouts file.

Sources:

- a ``mosaic train`` run directory: ``samples.jsonl`` (lines of :mod:`mosaic.train.samples`: token
  ids, loss masks, gains and every estimator's advantages, computed by the trainer on the whole
  step's batch), ``vocab.json`` (token texts), ``metrics.jsonl`` and ``plots/*.png``;
- a ``samples.jsonl`` on its own (its ``vocab.json`` beside it, or ``--tokenizer``);
- a rollouts file (``mosaic.trajectory`` JSONL, e.g. from ``mosaic rollout``): no gains were
  scored, so the advantages are computed here from the recorded graphs, all trajectories as
  one batch, with default estimator knobs; estimators that need gains are listed as unavailable.

The result is one JSON-able dict (:func:`load_view`); token texts are kept only for the ids used.

Bad input: a sample line whose structure the page needs (sessions, token ids, masks, parent links,
advantages) is wrong is a :class:`ViewError` naming ``file:line`` and the field. Text and numbers the
page only shows may be anything (the page escapes them); a lone surrogate (no UTF-8 form) becomes
U+FFFD and a NaN or infinite number becomes null, counted in ``view["sanitized"]`` (issue 33).
"""

from __future__ import annotations

import base64
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable

__all__ = ["ViewError", "check_sample", "load_view", "make_safe", "read_samples"]


class ViewError(ValueError):
    """A path the viewer cannot read; the message says what it expected."""


def _jsonl(path: Path) -> Iterable[tuple[int, dict]]:
    """The JSON-object lines of ``path``. A cut last line (a killed writer) is skipped, as the trainer's
    own readers do (said on stderr); a line that is not a JSON object anywhere else, or bytes that are not
    UTF-8, is a :class:`ViewError` naming the line."""
    try:
        data = path.read_bytes()
        lines = data.split(b"\n")
    except IsADirectoryError:
        raise ViewError(f"{path}: is a directory, not a JSONL file") from None
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        n = i + 1
        try:
            rec = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ViewError(f"{path}:{n}: not UTF-8 text (expected a JSONL file of samples or trajectories)") from None
        except (json.JSONDecodeError, RecursionError):
            if i == last and not data.rstrip(b" \t\r").endswith(b"\n"):  # cut by a kill (no newline after it):
                # skipped, as the trainer's readers do; a whole line that is not JSON is an error below
                print(f"mosaic view: {path}:{n}: the last line is cut ({len(raw)} bytes, a writer killed mid-line?); "
                      f"skipped", file=sys.stderr)
                continue
            raise ViewError(f"{path}:{n}: not a JSON line (expected a JSONL file of samples or trajectories)") from None
        if not isinstance(rec, dict):
            raise ViewError(f"{path}:{n}: a JSON {type(rec).__name__}, not an object (expected samples or trajectories)")
        yield n, rec


def _ints(v, what: str, *, lo: int = 0) -> None:
    if not isinstance(v, list) or not all(type(x) is int and x >= lo for x in v):
        raise ViewError(f"{what}: must be a list of integers >= {lo}")


DOWNSTREAM_HOW = ("direct", "propagated", "missing", "none", "no_reference")
"""How a session's downstream credit was obtained (``mosaic.train.downstream``)."""


def _numbers(v) -> bool:
    def num(x) -> bool:
        return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))
    return isinstance(v, list) and all(num(x) for x in v)


def _texts(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _check_session(s, k: int) -> None:
    """The fields the page computes with (the others are only shown, escaped)."""
    if not isinstance(s, dict):
        raise ViewError(f"sessions[{k}]: must be an object")
    if s.get("parent") is not None and not (type(s["parent"]) is int and 0 <= s["parent"] < k):
        raise ViewError(f"sessions[{k}].parent: must be null or an earlier session's index, got {s['parent']!r}")
    for name in ("prompt", "completion", "mask"):
        _ints(s.get(name), f"sessions[{k}].{name}")
    p = s.get("prefix")
    if p is not None and not (isinstance(p, list) and len(p) == 2 and type(p[0]) is int and 0 <= p[0] < k
                              and type(p[1]) is int and p[1] >= 0):  # fmt: skip
        raise ViewError(f"sessions[{k}].prefix: must be [an earlier session's index, a length], got {p!r}")
    if not isinstance(s.get("adv", {}), dict) or not all(_numbers([v]) for v in s.get("adv", {}).values()):
        raise ViewError(f"sessions[{k}].adv: must map estimator names to numbers")
    if not isinstance(s.get("turn_adv", {}), dict) or not all(_numbers(v) for v in s.get("turn_adv", {}).values()):
        raise ViewError(f"sessions[{k}].turn_adv: must map estimator names to lists of numbers")
    if "turn_gains" in s and s["turn_gains"] is not None and not _numbers(s["turn_gains"]):
        raise ViewError(f"sessions[{k}].turn_gains: must be a list of numbers")
    r = s.get("role")
    if r is not None and not (isinstance(r, dict) and type(r.get("index")) is int and isinstance(r.get("text", ""), str)
                              and (r.get("partner") is None or isinstance(r.get("partner"), str))):  # fmt: skip
        raise ViewError(f"sessions[{k}].role: must be {{index: int, text: str, partner: str or null}}, got {r!r}")
    n = s.get("notes")
    if n is not None and not (isinstance(n, dict) and _texts(n.get("before", [])) and _texts(n.get("after", []))):
        raise ViewError(f"sessions[{k}].notes: must be {{before: [text], after: [text]}} (a reset session's notes), "
                        f"got {str(n)[:80]}")
    if s.get("downstream") is not None and not _numbers([s["downstream"]]):
        raise ViewError(f"sessions[{k}].downstream: must be a number or null")
    if s.get("downstream_how") is not None and s["downstream_how"] not in DOWNSTREAM_HOW:
        raise ViewError(f"sessions[{k}].downstream_how: must be one of {', '.join(DOWNSTREAM_HOW)}")


def check_sample(rec: dict) -> None:
    """A :class:`ViewError` naming the first field of a sample record the page cannot compute with."""
    ss = rec.get("sessions")
    if not isinstance(ss, list) or not ss:
        raise ViewError("sessions: must be a non-empty list")
    for k, s in enumerate(ss):
        _check_session(s, k)
    for name, kind in (("unavailable", dict), ("estimators", list)):
        if name in rec and not isinstance(rec[name], kind):
            raise ViewError(f"{name}: must be a JSON {'object' if kind is dict else 'list'}")
    if not all(isinstance(e, str) for e in rec.get("estimators", [])):
        raise ViewError("estimators: must be a list of names")
    env = rec.get("env")  # the environment's outcome (the service family), optional
    if env is not None and not (isinstance(env, dict) and all(
            isinstance(v, (bool, int, float, str)) for v in env.values())):
        raise ViewError("env: must be a JSON object of numbers, booleans and strings")


def make_safe(obj, counts: dict[str, int]):
    """``obj`` with every lone surrogate replaced by U+FFFD (``counts["text"]`` strings) and every NaN or
    infinite number by None (``counts["numbers"]``): what the page's JSON and UTF-8 can hold."""
    from mosaic.agent.tools import safe_text

    if isinstance(obj, str):
        text, changed = safe_text(obj)
        counts["text"] += changed
        return text
    if isinstance(obj, float) and not math.isfinite(obj):
        counts["numbers"] += 1
        return None
    if isinstance(obj, list):
        if all(type(v) is int for v in obj):  # token ids: nothing to do (fast path)
            return obj
        return [make_safe(v, counts) for v in obj]
    if isinstance(obj, dict):
        return {make_safe(k, counts): make_safe(v, counts) for k, v in obj.items()}
    return obj


def read_samples(path: str | Path) -> list[dict]:
    """The ``mosaic.sample`` lines of a ``samples.jsonl``; a line of another kind is an error naming it."""
    from mosaic.train.samples import SAMPLE_SCHEMA, SAMPLE_SCHEMA_VERSION

    out = []
    for n, rec in list(_jsonl(Path(path))):  # every line parsed first: a broken one is named before a bad field
        if rec.get("schema") != SAMPLE_SCHEMA:
            raise ViewError(f"{path}:{n}: not a {SAMPLE_SCHEMA} record (a samples.jsonl from an older trainer "
                            f"holds decoded text only; rerun `mosaic train` to record token ids and credit)")
        if type(rec.get("schema_version", 0)) is not int:
            raise ViewError(f"{path}:{n}: schema_version must be an integer, got {rec['schema_version']!r}")
        if rec.get("schema_version", 0) > SAMPLE_SCHEMA_VERSION:
            raise ViewError(f"{path}:{n}: schema_version {rec['schema_version']} is newer than this viewer's "
                            f"{SAMPLE_SCHEMA_VERSION}")
        try:
            check_sample(rec)
        except ViewError as exc:
            raise ViewError(f"{path}:{n}: {exc}") from None
        out.append(rec)
    return out


def _is_trajectory_file(path: Path) -> bool:
    from mosaic.trace.storage import SCHEMA

    with open(path, "rb") as fh:  # its first record only: the reader that follows reads the file whole
        first = next((raw for raw in fh if raw.strip()), b"")
    try:
        rec = json.loads(first)
    except (ValueError, RecursionError):  # (not UTF-8, not JSON, cut: the samples reader names the line)
        return False
    return isinstance(rec, dict) and rec.get("schema") == SCHEMA


def _pieces_from(vocab: Path | None, tokenizer: str | None) -> list[str]:
    if tokenizer:
        from mosaic.agent.tokenizer import load_tokenizer

        if not (Path(tokenizer) / "tokenizer.json").is_file() and not (Path(tokenizer) / "tokenizer_config.json").is_file():
            raise ViewError(f"--tokenizer {tokenizer}: " + ("no tokenizer files in this directory (tokenizer.json)"
                                                           if Path(tokenizer).is_dir() else "no such directory"))
        from mosaic.train.samples import vocab_pieces

        return vocab_pieces(load_tokenizer(tokenizer))
    if vocab is None or not vocab.is_file():
        raise ViewError(f"no vocab.json beside the samples ({vocab}); pass --tokenizer DIR to print the token ids: "
                        "a run's checkpoints/*/model; for a `mosaic rollout` file, the model it sampled with (e.g. "
                        "mosaic/assets/models/tiny-svc), or with --policy expert/openai the directory its "
                        "--save-tokenizer wrote (the tokenizer trained on the split: rerun the rollout with it)")
    try:
        pieces = json.loads(vocab.read_text(encoding="utf-8"))["pieces"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ViewError(f"{vocab}: not a vocab.json written by `mosaic train` ({type(exc).__name__}: "
                        f"{str(exc)[:120]})") from None
    if not isinstance(pieces, list) or not all(isinstance(x, str) for x in pieces):
        raise ViewError(f"{vocab}: 'pieces' must be a list of strings")
    return pieces


def _rollout_samples(path: Path) -> list[dict]:
    """A trajectory file as sample records: advantages from the graph, one batch, default knobs."""
    from mosaic.core.estimators import EstimatorParams
    from mosaic.trace import TornLineWarning, load_trajectories
    from mosaic.train.samples import all_estimator_advantages, sample_records

    with warnings.catch_warnings(record=True) as caught:  # a torn last line: one line on stderr, as for samples
        warnings.simplefilter("always", TornLineWarning)
        trajs = load_trajectories(path)
    for w in caught:
        print(f"mosaic view: {w.message}", file=sys.stderr)
    if not trajs:
        raise ViewError(f"{path}: no trajectories")
    advs, why = all_estimator_advantages(trajs, EstimatorParams())
    if "fold" in why:
        why["fold"] = "needs the context budget (not recorded in a rollouts file)"
    recs = sample_records(trajs, range(len(trajs)), step=0, estimator=None, advantages=advs, unavailable=why)
    for i, r in enumerate(recs):
        for s in r["sessions"]:
            s["gain"] = None
        try:
            check_sample(r)
        except ViewError as exc:
            raise ViewError(f"{path}: trajectory {i + 1} ({trajs[i].id}): {exc}") from None
    return recs


def _plots(run_dir: Path) -> list[dict[str, str]]:
    d = run_dir / "plots"
    if not d.is_dir():
        return []
    return [{"name": p.stem, "src": "data:image/png;base64," + base64.b64encode(p.read_bytes()).decode()}
            for p in sorted(d.glob("*.png"))]  # fmt: skip


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    from mosaic.train.runlog import read_metrics

    rows = read_metrics(run_dir)
    keep = []
    for r in rows:  # finite numbers only (NaN is not JSON)
        keep.append({k: v for k, v in r.items() if isinstance(v, (int, float)) and v == v and abs(v) != float("inf")})
    return keep


def _estimator_names(samples: list[dict]) -> list[str]:
    """The estimators the records name, in the registry's order (as the trainer recorded it)."""
    names: list[str] = []
    for r in samples:
        for n in r.get("estimators", []) + list(r.get("unavailable", {})) \
                + [k for s in r["sessions"] for k in list(s["adv"]) + list(s["turn_adv"])]:  # fmt: skip
            if n not in names:
                names.append(n)
    return names


def load_view(path: str | Path, *, tokenizer: str | None = None, max_trajectories: int | None = None) -> dict:
    """Everything the page shows, as one JSON-able dict (see :mod:`mosaic.view.page` for its use).

    A run dir or a samples file needs no torch (the trainer recorded every number); a rollouts
    file or ``tokenizer`` does."""
    path = Path(path)
    run_dir: Path | None = None
    if path.is_dir():
        run_dir = path
        samples_path = path / "samples.jsonl"
        if not samples_path.is_file():
            raise ViewError(f"{path}: no samples.jsonl (is it a `mosaic train` run dir?)")
        samples = read_samples(samples_path)
        pieces = _pieces_from(path / "vocab.json", tokenizer) if samples else []  # nothing to print: no vocab needed
        source = "run"
    elif path.is_file():
        if _is_trajectory_file(path):
            samples = _rollout_samples(path)
            pieces = _pieces_from(path.with_name("vocab.json") if not tokenizer else None, tokenizer)
            source = "rollouts"
        else:
            samples = read_samples(path)
            if not samples:
                raise ViewError(f"{path}: no sample or trajectory record in it (expected a run's samples.jsonl or a "
                                f"`mosaic rollout` file)")
            pieces = _pieces_from(path.with_name("vocab.json"), tokenizer)
            run_dir = path.parent if (path.parent / "metrics.jsonl").is_file() else None
            source = "samples"
    else:
        raise ViewError(f"{path}: no such file or directory")
    if max_trajectories is not None:
        samples = samples[-max_trajectories:]  # the latest steps
    used: set[int] = set()
    for r in samples:
        for s in r["sessions"]:
            used.update(s["prompt"])
            used.update(s["completion"])
    bad = [i for i in used if not 0 <= i < len(pieces)]
    if bad:
        raise ViewError(f"token id {min(bad)} is outside the vocabulary of {len(pieces)} pieces: wrong tokenizer?")
    cfg_file = run_dir / "config.yaml" if run_dir else None
    config = cfg_file.read_text(errors="replace") if cfg_file and cfg_file.is_file() else ""
    counts = {"text": 0, "numbers": 0}
    view = {
        "title": f"mosaic view: {path.name}",
        "source": source,
        "estimators": _estimator_names(samples),
        "pieces": {str(i): pieces[i] for i in sorted(used)},
        "samples": samples,
        "metrics": _metrics(run_dir) if run_dir else [],
        "plots": _plots(run_dir) if run_dir else [],
        "config": config,
    }
    view = make_safe(view, counts)
    view["sanitized"] = counts
    return view
