"""The HTML page: the template, the style, the script and the data, in one file.

The data goes in a ``<script type="application/json">`` block (parsed once by the script) with every
``<``, ``>`` and ``&`` (and U+2028/U+2029) written as a JSON ``\\u`` escape, so no text inside it can
end the block or open a comment that would swallow the next one (``<!--<script>``). The page's
Content-Security-Policy allows exactly its own script and style sheet (by their SHA-256), no
inline event handler or injected ``<script>``, and no fetch: images are data URIs. The script
builds every piece of HTML from escaped text (see viewer.js) and sets colours through the DOM.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import os
from importlib import resources
from pathlib import Path

__all__ = ["embed_json", "render_page", "write_page"]


def _asset(name: str) -> str:
    return resources.files("mosaic.view").joinpath("assets", name).read_text(encoding="utf-8")


_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def embed_json(obj) -> str:
    """``obj`` as JSON that is inert inside a ``<script type="application/json">`` block: the characters
    HTML reads in a script (``<``, ``>``, ``&``) and the line separators are ``\\u`` escapes."""
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return data.translate({ord(k): v for k, v in _JSON_ESCAPES.items()})


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"


def render_page(view: dict) -> str:
    """The page for ``view`` (a :func:`mosaic.view.data.load_view` dict) as one HTML string."""
    css, js = _asset("viewer.css"), _asset("viewer.js")
    # one pass, so a placeholder inside a replacement (the data) is never replaced again
    parts = {"__TITLE__": html.escape(view.get("title", "mosaic view")), "__CSS__": css, "__JS__": js,
             "__DATA__": embed_json(view), "__SCRIPT_HASH__": _sha256(js), "__STYLE_HASH__": _sha256(css)}
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
    """Write the page whole under a temporary name and rename it over ``out``: a failure (a value
    that is not JSON, a full disk) leaves no partial page and keeps an earlier one."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = render_page(view).encode("utf-8")  # before any file is opened
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(text)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
