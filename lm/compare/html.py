"""The report as one self-contained HTML page: tables as HTML, images inlined as base64 data URIs, styles inline, no
link to anything outside the file, so it opens offline and survives being mailed around."""

import base64
from html import escape
from pathlib import Path

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin-bottom: 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; }
td:first-child, th:first-child { text-align: left; }
tr.best { background: #eaf6ea; }
figure { display: inline-block; margin: 0 1em 1em 0; }
figcaption { font-size: 0.9em; color: #555; }
img { max-width: 100%; }
"""


def html_table(header: list[str], rows: list[list[str]], highlight: list[bool] | None = None) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    marks = ['<tr class="best">' if highlight and highlight[i] else "<tr>" for i in range(len(rows))]
    body = "".join(mark + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>\n"
                   for mark, row in zip(marks, rows))
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>\n"


def inline_png(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def html_page(title: str, intro: str, tables: list[tuple[str, str]], images: list[tuple[str, Path]],
              notes: list[str]) -> str:
    """`tables`: (heading, the table's HTML); `images`: (caption, PNG path)."""
    sections = "".join(f"<h2>{escape(heading)}</h2>\n{table}" for heading, table in tables)
    figures = "".join(f'<figure><img alt="{escape(caption)}" src="{inline_png(path)}">'
                      f"<figcaption>{escape(caption)}</figcaption></figure>\n" for caption, path in images)
    items = "".join(f"<li>{escape(note)}</li>" for note in notes)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{escape(title)}</title>\n'
            f"<style>{STYLE}</style>\n</head>\n<body>\n<h1>{escape(title)}</h1>\n<p>{escape(intro)}</p>\n"
            f"{sections}<h2>Plots</h2>\n{figures}<h2>Notes</h2>\n<ul>{items}</ul>\n</body>\n</html>\n")
