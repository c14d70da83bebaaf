"""The documentation holds together: every relative link of README.md and docs/*.md resolves (file and
heading), every ``docs/algorithm.md §N`` reference in the repository names a section of that page,
nothing points at a specification outside the repository, and the generated reference is current."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
SECTION_REF = re.compile(r"algorithm\.md §(\d+(?:\.\d+)?)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return LINK.findall(text)


def test_pages_exist():
    names = {p.name for p in PAGES}
    for need in ("algorithm.md", "session-graph.md", "cli.md", "reference.md", "experiments.md",
                 "integrations.md", "capture.md", "limits.md", "benchmarks.md"):  # fmt: skip
        assert need in names, f"docs/{need} is missing"


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or heading does not exist."""
    bad = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{target}: no heading #{frag} in {dest.name}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    bad = broken_links(page)
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_broken_links_are_found(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section) [gone](missing.md) [bad anchor](other.md#nope) [web](https://x.org)\n"
                    "`[code](missing.md)`\n```\n[fenced](missing.md)\n```\n")  # fmt: skip
    assert broken_links(page) == ["missing.md: no such file", "other.md#nope: no heading #nope in other.md"]


def test_slug_rules():
    assert slug("Training: `mosaic train`, `mosaic sft`") == "training-mosaic-train-mosaic-sft"
    assert slug("4.4 Session level — information gain") == "44-session-level--information-gain"
    assert slug("See [cli](cli.md)") == "see-cli"


def _repo_text_files():
    """The repository's text files: git's list, or (no git, e.g. an unpacked archive) a walk that skips
    virtual environments, caches and run outputs."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        names = [ROOT / n for n in out.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        skip = re.compile(r"^(\.venv|\.git|\.mosaic-cache|runs|build|\.pytest_cache|\.hypothesis)")
        names = [p for p in ROOT.rglob("*") if not skip.match(p.relative_to(ROOT).parts[0])]
    for p in names:
        if p.suffix in (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt") and p.is_file():
            yield p


def test_section_references_resolve():
    """``docs/algorithm.md §4.4`` in a docstring, comment or page names a numbered heading there."""
    numbered = set()
    for line in (ROOT / "docs" / "algorithm.md").read_text().splitlines():
        m = re.match(r"^#{2,3}\s+§?(\d+(?:\.\d+)?)[.\s]", line)
        if m:
            numbered.add(m.group(1))
    assert {"1", "2", "3", "4.1", "4.3", "4.4", "4.7", "4.8", "5", "7", "8", "9"} <= numbered
    bad = []
    for p in _repo_text_files():
        for ref in SECTION_REF.findall(p.read_text(errors="replace")):
            if ref not in numbered:
                bad.append(f"{p.relative_to(ROOT)}: §{ref}")
    assert not bad, "references to sections docs/algorithm.md does not have: " + ", ".join(bad)


def test_no_reference_outside_the_repository():
    """The math lives in docs/algorithm.md; no file cites a SPEC.md users never see."""
    pat = re.compile(r"\bSPEC(\.md)?\b(?!IAL|_)")
    bad = [str(p.relative_to(ROOT)) for p in _repo_text_files()
           if p.name != "test_docs.py" and pat.search(p.read_text(errors="replace"))]  # fmt: skip
    assert not bad, "files citing SPEC instead of docs/algorithm.md: " + ", ".join(bad)


def test_worked_example_is_the_codes_output():
    """The numbers of docs/algorithm.md §4.6 are what ``mosaic.core.advantages`` computes."""
    torch = pytest.importorskip("torch")
    from mosaic.core.advantages import mosaic, normalized_session_gains

    text = (ROOT / "docs" / "algorithm.md").read_text()
    shown = {}
    for name in ("z", "Mosaic"):
        m = re.search(rf"^\s+{name}\s+= \[([^\]]*)\]", text, re.M)
        assert m, f"docs/algorithm.md §4.6 lost its {name} line"
        shown[name] = torch.tensor([float(x.replace("−", "-")) for x in m.group(1).split(",")])
    r, g = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long)
    st = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 3])
    kinds = torch.tensor([0, 1, 0, 0, 1, 0, 1, 0, 0, 0])
    gains = torch.tensor([0.5, -0.2, 9.0, -0.1, -1.0, 0.3, -0.4, 7.0, 5.0, 0.2])
    fin = torch.tensor([0, 0, 1, 0, 0, 0, 0, 1, 1, 1], dtype=torch.bool)
    z = normalized_session_gains(gains, kinds, fin)
    out = mosaic(r, g, torch.tensor([3, 5, 1, 1]), r == 1, st, gains, kinds, fin, rho=0.2, delta=0.1, lam=0.1)
    torch.testing.assert_close(z, shown["z"], atol=1e-4, rtol=0)
    torch.testing.assert_close(out, shown["Mosaic"], atol=1e-4, rtol=0)


def test_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = (ROOT / "docs" / "reference.md").read_text()
    fresh = gen.render()
    if committed != fresh:
        diff = [f"{a!r} != {b!r}" for a, b in zip(committed.splitlines(), fresh.splitlines()) if a != b][:3]
        pytest.fail(f"docs/reference.md is stale ({sys.executable} docs/gen_reference.py rewrites it); first "
                    f"differences: {diff or 'length'}")
