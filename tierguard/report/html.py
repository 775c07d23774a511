"""report.html: one self-contained file (inline CSS, plots as base64 PNG, no network).

A tiny inline script marks the page once loaded: `data-plots-total` and
`data-plots-rendered` on <body> (images decoded with a non-zero size) and
`data-errors` (script errors seen). The headless-Chromium test reads them; a person
sees nothing of it.
"""

from __future__ import annotations

import base64
import html
import json

from tierguard.report.load import RunData
from tierguard.report.tables import Table

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1280px;
color:#1b1f24;padding:0 16px}
h1{font-size:1.6em;margin-bottom:4px}h2{font-size:1.2em;margin-top:32px;border-bottom:1px solid #d0d7de}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.miss{color:#b42318}td.pass{color:#067647}
figure{margin:12px 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:13px;color:#57606a}.note{font-size:13px;color:#57606a}
pre{background:#f6f8fa;padding:8px;overflow-x:auto;font-size:12px}
ul.rec li{margin:4px 0}
"""

CHECK_SCRIPT = """
(function(){
  var errors = 0;
  window.addEventListener('error', function(){ errors++; document.body.setAttribute('data-errors', errors); });
  window.addEventListener('load', function(){
    var imgs = document.querySelectorAll('figure img');
    var ok = 0;
    imgs.forEach(function(i){ if (i.complete && i.naturalWidth > 0 && i.naturalHeight > 0) ok++; });
    document.body.setAttribute('data-plots-total', imgs.length);
    document.body.setAttribute('data-plots-rendered', ok);
    document.body.setAttribute('data-errors', errors);
  });
})();
"""


def _esc(x: object) -> str:
    return html.escape(str(x))


def table_html(t: Table) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in t.header)
    body = []
    for row in t.rows:
        cells = []
        for cell in row:
            cls = (
                ' class="miss"'
                if cell.startswith(("MISS", "none", "failed"))
                else (' class="pass"' if cell.startswith("pass") else "")
            )
            cells.append(f"<td{cls}>{_esc(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    note = f'<p class="note">{_esc(t.note)}</p>' if t.note else ""
    if not t.rows:
        return f"<h2>{_esc(t.title)}</h2>{note or '<p class=note>nothing recorded</p>'}"
    return f"<h2>{_esc(t.title)}</h2><table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{note}"


def render_html(
    data: RunData, tables: dict[str, Table], plots: dict[str, tuple[str, bytes]], recs: list[str]
) -> str:
    parts = [
        f"<h1>tierguard {'prediction' if data.predicted else 'sweep'}: {_esc(data.matrix.name)}</h1>",
        f'<p class="note">run directory {_esc(data.run_dir)}</p>',
    ]
    # The boundary first, then what to do about it: the decision rests on the table.
    parts.append(table_html(tables["boundary"]))
    if "predicted" in tables:
        parts.append(table_html(tables["predicted"]))
    if recs:
        parts.append(
            "<h2>Recommendation</h2><ul class=rec>" + "".join(f"<li>{_esc(r)}</li>" for r in recs) + "</ul>"
        )
    if "boundary" in plots:
        parts.append(_figure("boundary", *plots["boundary"]))
    parts.append(table_html(tables["single"]))
    if "prefix" in tables and tables["prefix"].rows:
        parts.append(table_html(tables["prefix"]))
    if "kvcheck" in tables:
        parts.append(table_html(tables["kvcheck"]))
        parts.append(_figure("kvcheck", *plots["kvcheck"]))
    parts.append("<h2>Latency vs concurrency</h2>")
    for name in ("p99_ttft", "p99_itl"):
        if name in plots:
            parts.append(_figure(name, *plots[name]))
    parts.append("<h2>Distributions</h2>")
    for name in ("cdf_ttft", "cdf_itl", "stalls"):
        if name in plots:
            parts.append(_figure(name, *plots[name]))
    for key in ("cells", "mixed", "counters", "engines", "environment"):
        if key in tables and (tables[key].rows or key == "counters"):
            parts.append(table_html(tables[key]))
    topo = data.environment.get("topology") or {}
    if topo:
        parts.append("<h2>Topology</h2>")
        for name, text in topo.items():
            parts.append(f"<h3>{_esc(name)}</h3><pre>{_esc(text)}</pre>")
    else:
        parts.append(
            '<h2>Topology</h2><p class="note">nvidia-smi, numactl and lspci were not available '
            "on the machine that ran the sweep.</p>"
        )
    parts.append(
        f'<h2>Boundary data</h2><pre id="boundary-json">{_esc(json.dumps(data.boundary, indent=1))}</pre>'
    )
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        f"<title>tierguard report: {_esc(data.matrix.name)}</title><style>{CSS}</style>"
        f"<script>{CHECK_SCRIPT}</script></head><body>{''.join(parts)}</body></html>"
    )


def _figure(name: str, caption: str, png: bytes) -> str:
    b64 = base64.b64encode(png).decode("ascii")
    return (
        f'<figure data-plot="{_esc(name)}"><img alt="{_esc(caption)}" src="data:image/png;base64,{b64}">'
        f"<figcaption>{_esc(caption)}</figcaption></figure>"
    )
