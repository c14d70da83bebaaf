"""``mosaic view`` on hostile samples, in a real browser (issue 33, item 4).

Every text and number of a ``samples.jsonl`` can be anything a model, a harness or an edited file
put there. The page must render every row, show the text as text, and run no script but its own:
an answer holding ``<!--<script>`` used to swallow the page's script (nothing rendered), and a
``step`` or ``group.size`` holding markup was inserted as HTML under a policy that allowed inline
script. Chromium is Debian's package (see conftest.py).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

from mosaic.core.estimators import EstimatorParams
from mosaic.cli import main
from mosaic.train.samples import all_estimator_advantages, sample_records
from mosaic.view.browser import Browser
from tests.train.trajs import compaction_chain, fork

PWN = "window.__pwned = (window.__pwned || 0) + 1"
HOSTILE_TEXT = [
    "<!--<script>",  # the issue's: opens a comment that turns the next </script> into data
    "</script><script>" + PWN + "</script>",
    f'<img src=x onerror="{PWN}">',
    "a\u2028b\u2029c",  # line separators: a JavaScript string literal cannot hold them raw
    """nested "quotes" 'and' `ticks` ${1+1} \\" \\' """,
    "<!-- unclosed comment",
    "]]></svg><svg onload=\"" + PWN + "\">",
    "&lt;already escaped&gt; &amp; &#x3c;",
]


def _records() -> list[dict]:
    rng = random.Random(7)
    trajs = [compaction_chain(rng, 1, tid="a"), fork(rng, tid="b"), compaction_chain(rng, 0, tid="c", reward=0.0)]
    advs, why = all_estimator_advantages(trajs, EstimatorParams())
    base = sample_records(trajs, range(len(trajs)), step=1, estimator="broadcast", advantages=advs, unavailable=why)
    out = []
    for i, text in enumerate(HOSTILE_TEXT):
        r = json.loads(json.dumps(base[i % len(base)]))
        r["answer"], r["ground_truth"], r["trajectory"] = text, text, f"{text} #{i}"
        r["group_id"] = text
        r["end_reason"] = text
        r["sessions"][0]["end"] = text
        out.append(r)
    # numbers that are not numbers, or too large
    odd = [('<img src=x onerror="' + PWN + '">', '<img src=x onerror="' + PWN + '">'),
           ("step one", "many"), (10**30, 10**30), (-1, None), ({"nested": "</script>"}, [1, "<b>"]),
           (1e308, 1.5)]
    for j, (step, size) in enumerate(odd):
        r = json.loads(json.dumps(base[j % len(base)]))
        r["step"] = step
        r["group"]["size"] = size
        r["group"]["successes"] = step
        r["group"]["mean_reward"] = "<i>x</i>"
        r["reward"] = step if j != 1 else 1e308
        r["trajectory"] = f"odd-{j}"
        r["sessions"][0]["turns"] = step
        r["sessions"][-1]["kind"] = ["__proto__", "constructor", "<b>kind</b>", "main", "toString", "x"][j]
        out.append(r)
    return out


def test_hostile_samples_render_every_row_as_text_and_run_no_script(chromium, tmp_path):
    recs = _records()
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    pieces = ["<!--<script>", "</script><script>" + PWN + "</script>", "\u2028"] + [f"w{i} " for i in range(3, 400)]
    (tmp_path / "vocab.json").write_text(json.dumps({"pieces": pieces}))
    page = tmp_path / "view.html"
    assert main(["view", str(tmp_path / "samples.jsonl"), "-o", str(page)]) == 0
    html = page.read_text()
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', html).group(1)
    assert "unsafe-inline" not in csp and "'sha256-" in csp
    with Browser(chromium) as b:
        b.open(page)
        assert b.page_errors() == []
        b.eval("(() => { const s = document.getElementById('f-step'); s.value = 'all';"
               " s.dispatchEvent(new Event('change')); })()")
        assert b.eval("document.querySelectorAll('article.traj').length") == len(recs)
        text = b.eval("document.getElementById('list').innerText")
        for t in HOSTILE_TEXT[:3] + HOSTILE_TEXT[5:]:
            assert t in text, t
        assert "a\u2028b\u2029c" in b.eval("document.getElementById('list').textContent")
        assert "step one" in text and "many" in text and "group of" in text
        # no element came from the data: the list holds the page's own tags only
        tags = set(b.eval("[...document.querySelectorAll('#list *')].map(e => e.tagName.toLowerCase())"))
        assert tags <= {"h3", "article", "header", "span", "b", "q", "div", "svg", "defs", "marker", "path", "g",
                        "title", "rect", "text", "table", "tbody", "tr", "th", "td", "button", "br"}, tags
        # open every session of every row: the transcripts render too
        for ti, r in enumerate(recs):
            for k in range(len(r["sessions"])):
                b.eval(f"document.querySelector(\"article[data-traj='{ti}'] g.node[data-s='{k}']\")"
                       f".dispatchEvent(new MouseEvent('click', {{bubbles: true}}))")
                b.wait_for("!document.getElementById('transcript').hidden")
        b.click("article[data-traj='0'] g.node[data-s='0']")
        b.wait_for("!document.getElementById('transcript').hidden")
        assert "<!--<script>" in b.eval("document.getElementById('transcript').innerText")
        assert b.eval("window.__pwned === undefined") is True
        assert b.page_errors() == []
        if os.environ.get("MOSAIC_VIEW_SCREENSHOTS"):
            b.screenshot(Path(os.environ["MOSAIC_VIEW_SCREENSHOTS"]) / "hostile.png")


def test_every_variant_of_the_field_sweep_renders_in_the_browser(chromium, tmp_path):
    # every sample the field sweep (tests/view/test_view.py) lets through, one field set to a hostile
    # value each, on one page: every row renders and every session's transcript opens, no error
    from mosaic.view.data import ViewError, read_samples
    from tests.view.test_view import HOSTILE, _run_dir

    d, _ = _run_dir(tmp_path)
    base = json.loads((d / "samples.jsonl").read_text().splitlines()[0])
    keep = []
    for where, key in [("top", k) for k in base if k != "schema"] + [("session", k) for k in base["sessions"][0]]:
        for value in HOSTILE:
            r = json.loads(json.dumps(base))
            (r if where == "top" else r["sessions"][0])[key] = value
            (tmp_path / "one.jsonl").write_text(json.dumps(r) + "\n")
            try:
                read_samples(tmp_path / "one.jsonl")
            except ViewError:
                continue
            keep.append(r)
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in keep))
    assert main(["view", str(d), "-o", str(tmp_path / "sweep.html")]) == 0
    with Browser(chromium) as b:
        b.open(tmp_path / "sweep.html")
        b.eval("(() => { const s = document.getElementById('f-step'); s.value = 'all';"
               " s.dispatchEvent(new Event('change')); })()")
        while b.eval("!!document.getElementById('more')"):
            b.click("#more")
        assert b.eval("document.querySelectorAll('article.traj').length") == len(keep)
        nodes = b.eval("document.querySelectorAll('g.node').length")
        opened = b.eval("""(() => { let k = 0; for (const g of document.querySelectorAll('g.node')) {
            document.getElementById('transcript').hidden = true;
            g.dispatchEvent(new MouseEvent('click', {bubbles: true}));
            if (!document.getElementById('transcript').hidden) k++; } return k; })()""")
        assert opened == nodes >= len(keep)
        assert b.page_errors() == [] and b.eval("window.__pwned === undefined")
    print(f"\nbrowser sweep: {len(keep)} hostile samples on one page, {nodes} transcripts opened")
