"""The HTML page: the template, the style, the script and the data, in one file.

The data goes in a ``<script type="application/json">`` block (parsed once by the script); ``</``
is escaped so no string inside it can close the block. Nothing is fetched: images are data URIs,
and the page's Content-Security-Policy forbids any other source.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path

__all__ = ["render_page", "write_page"]


def _asset(name: str) -> str:
    return resources.files("mosaic.view").joinpath("assets", name).read_text(encoding="utf-8")


def render_page(view: dict) -> str:
    """The page for ``view`` (a :func:`mosaic.view.data.load_view` dict) as one HTML string."""
    data = json.dumps(view, separators=(",", ":"), ensure_ascii=False, allow_nan=False).replace("</", "<\\/")
    # one pass, so a placeholder inside a replacement (the data) is never replaced again
    parts = {"__TITLE__": html.escape(view.get("title", "mosaic view")), "__CSS__": _asset("viewer.css"),
             "__JS__": _asset("viewer.js"), "__DATA__": data}  # fmt: skip
    out, rest = [], _asset("viewer.html")
    while True:
        hits = [(rest.find(k), k) for k in parts if rest.find(k) >= 0]
        if not hits:
            out.append(rest)
            return "".join(out)
        i, k = min(hits)
        out += [rest[:i], parts[k]]
        rest = rest[i + len(k):]


def write_page(view: dict, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_page(view), encoding="utf-8")
    return out
