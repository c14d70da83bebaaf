"""``mosaic view``: one self-contained HTML page to read a run's rollouts and their credit.

:func:`~mosaic.view.data.load_view` reads a run directory, a ``samples.jsonl`` or a rollouts
file; :func:`~mosaic.view.page.render_page` writes the page (data, style and script inline, no
network: its Content-Security-Policy forbids any fetch).
"""
