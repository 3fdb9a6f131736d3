"""The HTML page of a report (:class:`~.model.ReportData`): one self-contained file (inline CSS,
JS and SVG; nothing is fetched). :meth:`Report.to_html` and :meth:`Report.save_html` call
:func:`render_page`; the drawings are :mod:`.svg`'s. The notes that hold for every graph (how top
ops rank, what the runtime candidates are, why a CPU plan shows no measurement) are printed once,
after the graphs, not under each graph.
"""

from __future__ import annotations

import html

from ..plan import GraphPlan
from . import dump
from .model import ReportData
from .stats import (CANDIDATE_NAMES, MEASURED_NOTE, TOP_OPS_RANKING, GraphStats, candidate_rows, describe_candidate,
                    device_notes, format_bytes)
from .svg import GREY, arena_svg, is_drawn, node_svg, slug, subgraph_svg, timeline_svg

__all__ = ["NODE_CAP", "render_page"]

_esc = html.escape
NODE_CAP = 900  # most nodes drawn one by one; larger graphs show subgraph boxes and the table only


def _node_table(gp: GraphPlan, gname: str, colors: dict[str, str]) -> str:
    head = ("node", "op", "value", "modality", "lane/sg", "FLOPs", "bytes", "AI", "bound", "est µs", "mark")
    out = [f'<table class="node-table" id="nodes-{gname}"><thead><tr>'
           + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for row in dump.rows(gp.gm):
        where = "-" if row["subgraph"] is None else f"{row['lane']}/{row['subgraph']}"
        color = colors.get(row["modality"] or "", GREY)
        mod = f'<span class="swatch" style="background:{color}"></span>{_esc(str(row["modality"]))}' \
              + ("*" if row["recomputed"] else "")
        mark = ", ".join(m for m in (f"cast→{row['cast']}" if row["cast"] else "", "saved" if row["saved"] else "",
                                      "recomputed" if row["recomputed"] else "", row["transfer"] or "") if m)
        cells = (_esc(row["node"]), _esc(row["op"]), _esc(row["value"]), mod, where, f"{row['flops']:,}",
                 f"{row['bytes']:,}", f"{row['intensity']:.1f}" if row["bytes"] else "-",
                 f'<span class="bound-{_esc(row["bound"])}">{_esc(row["bound"])}</span>',
                 f"{row['est_us']:.2f}", _esc(mark))
        out.append(f'<tr data-sg="{"" if row["subgraph"] is None else row["subgraph"]}">'
                   + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# HTML: the page
# ----------------------------------------------------------------------------------------------


def _legend(colors: dict[str, str]) -> str:
    items = [f'<span class="legend-item"><span class="swatch" style="background:{c}"></span>{_esc(m)}</span>'
             for m, c in colors.items()]
    items.append('<span class="legend-item"><svg width="12" height="12"><rect class="node compute" x="1.5" y="1.5" '
                 'width="9" height="9" rx="1.5" fill="#999"/></svg>compute-bound</span>')
    items.append('<span class="legend-item"><svg width="12" height="12"><circle class="node memory" cx="6" cy="6" '
                 'r="4.5" fill="#999"/></svg>memory-bound</span>')
    items.append('<span class="legend-item"><svg width="12" height="12"><circle class="node memory recomputed" cx="6" '
                 'cy="6" r="4.5" fill="#999"/></svg>recomputed</span>')
    return '<div class="legend">' + "".join(items) + "</div>"


def _chip(label: str, value: str, cls: str = "") -> str:
    return (f'<div class="chip {cls}"><span class="chip-value">{_esc(value)}</span>'
            f'<span class="chip-label">{_esc(label)}</span></div>')


def _graph_section(report: ReportData, gp: GraphPlan, s: GraphStats) -> str:
    gname = slug(gp.name)
    colors = dump.modality_colors(gp.gm)
    out = [f'<section class="graph" id="graph-{gname}" data-kind="{_esc(gp.kind)}">',
           f'<h2><span class="kind kind-{_esc(gp.kind)}">{_esc(gp.kind)}</span>{_esc(gp.name)}'
           f'<span class="device">planned for {_esc(gp.device)}</span></h2>']
    chips = [_chip("lanes", str(len(s.lanes))), _chip("subgraphs", str(s.subgraphs)),
             _chip("serial", f"{s.serial_us:.1f} µs"), _chip("concurrent", f"{s.concurrent_us:.1f} µs", "accent"),
             _chip("predicted speedup", f"{s.speedup:.2f}x" if s.speedup else "-", "accent"),
             _chip("cross-lane waits", str(s.waits)),
             _chip("arena / no reuse", f"{format_bytes(s.arena_bytes)} / {format_bytes(s.total_bytes)}"),
             _chip("compute / memory nodes", f"{s.compute} / {s.memory}"),
             _chip("recomputed", str(s.recomputed)), _chip("casts", str(s.casts))]
    out.append('<div class="chips">' + "".join(chips) + "</div>")
    if s.fallback:
        out.append(f'<p class="fallback">Fallback: this graph runs without apollo\'s runtime because '
                   f'{_esc(s.fallback)}</p>')
    out.append(_legend(colors))
    lp = gp.lanes
    if lp is None or not lp.subgraphs:
        out.append('<p class="note">No lane plan for this graph.</p>')
    else:
        if lp.reason:
            out.append(f'<p class="note">Lanes: {_esc(lp.reason)}. ' + " · ".join(
                f"<b>lane {k}</b> {_esc(', '.join(v))}" for k, v in sorted(lp.lanes.items())) + "</p>")
        measured = report.measured.get(gp.name)
        out.append('<div class="panel lane-timeline"><h3>Lane timeline <small>predicted from the cost model'
                   + (", with measured rows" if measured else "") + "</small></h3>"
                   + timeline_svg(gp, gname, measured, colors) + "</div>")
        out.append('<div class="row">')
        out.append('<div class="panel graph-view"><h3>Subgraphs <small>boxes per lane in dependency order; '
                   'dashed arrows are cross-lane waits; top ops ranked as the notes at the end say</small></h3>'
                   '<div class="scroll">'
                   + subgraph_svg(gp, gname, colors) + "</div></div>")
        if gp.memory is not None:
            m = gp.memory
            out.append('<div class="panel memory-arena"><h3>Memory arena <small>'
                       f'{format_bytes(m.arena_bytes)} vs {format_bytes(m.total_bytes)} without reuse '
                       f'({100 * m.saved_fraction:.0f}% saved), {len(m.placements)} buffers</small></h3>'
                       + arena_svg(gp, gname, colors) + "</div>")
        out.append("</div>")
    cands = candidate_rows(gp)
    if cands:
        calibrated = gp.decisions["quotas"].calibrated
        out.append('<div class="panel candidates"><h3>Runtime candidates <small>predicted by the performance '
                   'model; measured as CUDA-graph replays on a GPU (see the notes at the end)'
                   + (f"; refitted from them: {_esc(', '.join(f'{k} {v:.3f}' for k, v in calibrated.items()))}"
                      if calibrated else "") + '</small></h3><table class="summary"><thead><tr>'
                   + "".join(f"<th>{h}</th>" for h in ("runtime", "predicted µs", "measured ms (GPU)",
                                                       "graph pool (GPU)", "", "what it runs"))
                   + "</tr></thead><tbody>"
                   + "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row)
                             + f'<td class="what">{_esc(describe_candidate(row[0]))}</td></tr>' for row in cands)
                   + "</tbody></table></div>")
    drawn = sum(is_drawn(n) for n in gp.gm.graph.nodes)
    total = len(gp.gm.graph.nodes)
    if drawn <= NODE_CAP:
        out.append(f'<details class="panel node-graph" id="nodegraph-{gname}" open><summary><h3>Annotated graph '
                   f'<small>{drawn} of {total} '
                   'nodes; views, getitems, inputs and outputs folded into edges; hover a node for its '
                   'annotation</small></h3></summary><div class="scroll">' + node_svg(gp, gname, colors)
                   + "</div></details>")
    else:
        out.append(f'<p class="note node-graph" id="nodegraph-{gname}">{drawn} nodes are too many to draw one by '
                   'one; the subgraph '
                   'boxes above and the table below show them.</p>')
    out.append(f'<details class="panel node-details"><summary><h3>Nodes <small>{total} rows, the '
               'annotated listing</small></h3></summary><input class="filter" type="search" '
               f'placeholder="filter rows (node, op, modality, bound…)" data-table="nodes-{gname}">'
               '<div class="scroll table-scroll">' + _node_table(gp, gname, colors) + "</div></details>")
    out.append("</section>")
    return "\n".join(out)


def _summary_table(report: ReportData, stats: list[GraphStats]) -> str:
    head = ("graph", "kind", "lanes (modalities)", "subgraphs", "serial µs", "concurrent µs", "speedup", "waits",
            "arena", "no reuse", "compute", "memory", "recomputed", "casts", "fallback")
    out = ['<table class="summary"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"]
    for s in stats:
        lanes = "<br>".join(f"<b>{k}</b> {_esc(', '.join(v))}" for k, v in s.lanes.items()) or "-"
        cells = (f'<a href="#graph-{slug(s.name)}">{_esc(s.name)}</a>', _esc(s.kind), lanes, str(s.subgraphs),
                 f"{s.serial_us:.1f}", f"{s.concurrent_us:.1f}", f"{s.speedup:.2f}x" if s.speedup else "-",
                 str(s.waits), format_bytes(s.arena_bytes), format_bytes(s.total_bytes), str(s.compute),
                 str(s.memory), str(s.recomputed), str(s.casts),
                 f'<span class="fallback">{_esc(s.fallback)}</span>' if s.fallback else "-")
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


_CSS = """
:root { --ink:#1d2430; --muted:#667085; --line:#e3e7ee; --bg:#f5f7fa; --card:#fff; --accent:#0b6bcb; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font:13px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif; }
header { background:#18202c; color:#fff; padding:14px 24px 12px; }
header h1 { margin:0; font-size:19px; font-weight:650; letter-spacing:.2px; }
header h1 span { color:#8fb8ff; font-weight:500; }
header p { margin:3px 0 0; color:#b9c3d3; font-size:12.5px; }
main { padding:14px 24px 40px; }
h2 { font-size:17px; margin:0 0 8px; display:flex; align-items:center; gap:10px; }
h2 .device { color:var(--muted); font-weight:400; font-size:12.5px; }
h3 { font-size:13.5px; margin:0 0 6px; }
summary > h3 { display:inline; } .panel svg { display:block; }
h3 small { color:var(--muted); font-weight:400; margin-left:6px; }
.kind { text-transform:uppercase; font-size:10.5px; letter-spacing:.6px; padding:2px 7px; border-radius:10px;
  background:#e7eefb; color:#1e4e9c; }
.kind-backward { background:#fbeee3; color:#9a4a0f; } .kind-inference { background:#e6f4ea; color:#1d6b35; }
section.graph { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:14px 16px;
  margin:14px 0; box-shadow:0 1px 2px rgba(16,24,40,.04); }
.panel { border:1px solid var(--line); border-radius:8px; padding:8px 10px; margin-top:10px; background:#fff; }
.row { display:flex; gap:10px; align-items:flex-start; flex-wrap:wrap; }
.row > .graph-view { flex:1 1 auto; max-width:100%; } .row > .memory-arena { flex:0 0 auto; }
.scroll { overflow:auto; max-width:100%; } .table-scroll { max-height:520px; }
.chips { display:flex; flex-wrap:wrap; gap:6px; margin:4px 0 8px; }
.chip { border:1px solid var(--line); border-radius:7px; padding:3px 9px; display:flex; flex-direction:column;
  min-width:78px; background:#fbfcfe; }
.chip-value { font-weight:650; font-size:14px; font-variant-numeric:tabular-nums; }
.chip-label { color:var(--muted); font-size:10.5px; }
.chip.accent .chip-value { color:var(--accent); }
.legend { display:flex; flex-wrap:wrap; gap:12px; color:#344054; font-size:12px; margin:2px 0 2px; }
.legend-item { display:inline-flex; align-items:center; gap:5px; }
.swatch { display:inline-block; width:10px; height:10px; border-radius:3px; margin-right:4px; vertical-align:-1px; }
.note { color:#475467; margin:6px 0 0; }
.fallback { color:#b42318; }
table { border-collapse:collapse; font-variant-numeric:tabular-nums; }
table.summary { background:#fff; border:1px solid var(--line); border-radius:8px; width:100%; font-size:12.5px; }
table.summary th, table.summary td { padding:5px 8px; border-bottom:1px solid var(--line); text-align:right;
  vertical-align:top; white-space:nowrap; }
table.summary th:nth-child(-n+3), table.summary td:nth-child(-n+3) { text-align:left; }
table.summary th { background:#f0f3f8; font-weight:600; color:#344054; }
table.summary td.what { text-align:left; color:#475467; }
table.node-table { font-size:11.5px; width:100%; }
table.node-table th { position:sticky; top:0; background:#f0f3f8; text-align:left; padding:3px 6px; }
table.node-table td { padding:2px 6px; border-bottom:1px solid #eef1f5; white-space:nowrap; }
.bound-compute { font-weight:650; } .bound-memory { color:#475467; } .bound-- { color:#98a2b3; }
input.filter { margin:6px 0; padding:4px 8px; width:320px; border:1px solid #d0d5dd; border-radius:6px; }
summary { cursor:pointer; } details > summary::marker { color:var(--muted); }
svg text { font-family:inherit; }
.tick { font-size:10.5px; fill:#667085; } .axis-label { font-size:10.5px; fill:#98a2b3; }
.lane-name { font-size:12px; font-weight:600; fill:#1d2430; } .lane-mods { font-size:10.5px; fill:#667085; }
.band { fill:#fafbfc; } .band-alt { fill:#f2f4f7; }
.grid { stroke:#e4e7ec; stroke-width:1; }
.sg-bar { stroke:rgba(0,0,0,.25); stroke-width:.8; }
.sg-bar.measured { opacity:.75; stroke-dasharray:3 2; } .sg-bar.serial { opacity:.55; }
.bar-label { font-size:10.5px; fill:#fff; font-weight:600; pointer-events:none; }
.dep { fill:none; stroke:#b42318; stroke-width:1.2; stroke-dasharray:3 2; opacity:.8; }
.arrowhead { fill:#7a8699; }
.mark-concurrent { stroke:#0b6bcb; stroke-width:1.6; }
.mark-serial { stroke:#98a2b3; stroke-width:1.2; stroke-dasharray:4 3; }
.mark-concurrent-label { font-size:11px; fill:#0b6bcb; font-weight:650; }
.mark-serial-label { font-size:11px; fill:#667085; }
.sg-frame { fill:#fff; stroke-width:1.6; }
.sg-title { font-size:11.5px; font-weight:650; fill:#fff; }
.sg-sub { font-size:10.5px; fill:#475467; } .sg-op { font-size:10.5px; fill:#1d2430; } .sg-op.num { fill:#667085; }
.sg-edge { fill:none; stroke:#98a2b3; stroke-width:1.4; } .sg-edge.cross { stroke:#b42318; stroke-dasharray:5 3; }
.buffer { stroke:#fff; stroke-width:.5; opacity:.9; } .arena-top { stroke:#1d2430; stroke-dasharray:4 3; }
.arena-label { font-size:11px; font-weight:600; fill:#1d2430; }
.node { stroke:#fff; stroke-width:.8; } .node.compute { stroke:#101828; stroke-width:1.6; }
.node.recomputed { stroke:#101828; stroke-dasharray:2 1.2; stroke-width:1.1; }
.node.cast { stroke:#f79009; stroke-width:2; }
.edges { fill:none; stroke:#98a2b3; stroke-width:.6; opacity:.45; }
.hl { filter:drop-shadow(0 0 2px #0b6bcb); } .dim { opacity:.18; }
footer { color:var(--muted); font-size:11.5px; padding:0 24px 24px; }
"""

_JS = """
(function () {
  document.querySelectorAll('input.filter').forEach(function (box) {
    box.addEventListener('input', function () {
      var q = box.value.toLowerCase(), table = document.getElementById(box.dataset.table);
      table.querySelectorAll('tbody tr').forEach(function (tr) {
        tr.style.display = tr.textContent.toLowerCase().indexOf(q) >= 0 ? '' : 'none';
      });
    });
  });
  // hovering a subgraph (bar, box or buffer) highlights it in every view of its graph
  document.querySelectorAll('section.graph').forEach(function (sec) {
    sec.querySelectorAll('svg [data-sg]').forEach(function (el) {
      el.addEventListener('mouseenter', function () {
        var sg = el.getAttribute('data-sg');
        if (sg === '') return;
        sec.querySelectorAll('svg [data-sg]').forEach(function (o) {
          o.classList.toggle('dim', o.getAttribute('data-sg') !== sg);
        });
      });
      el.addEventListener('mouseleave', function () {
        sec.querySelectorAll('svg .dim').forEach(function (o) { o.classList.remove('dim'); });
      });
    });
  });
  document.documentElement.setAttribute('data-ready', '1');
})();
"""


def _notes(report: ReportData, stats: list[GraphStats]) -> str:
    """What the graphs' panels have in common, said once for the page rather than under each graph."""
    out = [f'<p class="note top-ops-ranking">Each subgraph box lists its top 3 ops, {_esc(TOP_OPS_RANKING)}; '
           'beside each, the FLOPs (compute-bound, square) or bytes (memory-bound, circle) that set its time. '
           'Hover a glyph for its estimate.</p>']
    if any(candidate_rows(gp) for gp in report.graphs):
        out.append(f'<p class="note candidate-names">Runtime candidates: {_esc(CANDIDATE_NAMES)}.</p>')
        out.append(f'<p class="note measured-note">{_esc(MEASURED_NOTE[0].upper() + MEASURED_NOTE[1:])}.</p>')
    out += [f'<p class="note device-note">{_esc(n[0].upper() + n[1:])}.</p>'
            for n in device_notes(s.device for s in stats)]
    return ('<div class="panel notes" id="notes"><h3>Notes <small>for every graph above</small></h3>'
            + "".join(out) + "</div>")


def render_page(report: ReportData) -> str:
    stats = report.stats()
    devices = ", ".join(sorted({s.device for s in stats})) or "-"
    options = ", ".join(f"{k}={v!r}" for k, v in report.options.items()) or "defaults"
    sections = [_graph_section(report, gp, s) for gp, s in zip(report.graphs, stats)]
    notes = [f'<p class="fallback">{_esc(w)}</p>' for w in report.fallback_warnings]
    notes += [f'<p class="fallback">{_esc(mp.name)}: no ATen graph was planned (the Dynamo graph runs as traced)</p>'
              for mp in report.plans if not mp.graphs]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>apollo_compile report</title>
<style>{_CSS}</style></head>
<body>
<header><h1>apollo_compile <span>report</span></h1>
<p>{len(stats)} graph(s) from {len(report.plans)} Dynamo graph(s) · planned for {_esc(devices)} ·
ran {_esc(report.ran_text())} · options: {_esc(options)} ·
times are roofline predictions from the cost model</p></header>
<main>
{_summary_table(report, stats) if stats else '<p class="note">No graph was planned.</p>'}
{''.join(notes)}
{''.join(sections)}
{_notes(report, stats) if stats else ''}
</main>
<footer>Generated by apollo_compile.report. Hover bars, boxes, buffers and nodes for details.</footer>
<script>{_JS}</script>
</body></html>
"""
