"""The SVG drawings of the HTML report (:mod:`.html_page`): the lane timeline,
the memory arena, the subgraph boxes and the annotated graph node by node.

Each function takes one :class:`~apollo_compile.plan.GraphPlan` and returns one ``<svg>``
element; ``gname`` (``slug(graph name)``) prefixes the element ids so that several graphs share a
page. Every subgraph's shapes carry ``data-sg`` for the page's hover highlighting.
"""

from __future__ import annotations

import html
import math
import operator
import re
from collections import Counter

import torch
import torch.fx

from . import dump
from ..annotations import info
from ..plan import GraphPlan
from .stats import (dominant_modality, format_bytes, format_flops, largest_ops, op_cost, predicted_timeline)

__all__ = ["GREY", "arena_svg", "is_drawn", "node_layout", "node_svg", "slug", "subgraph_svg", "timeline_svg"]

_esc = html.escape
GREY = "#b8bec6"  # a subgraph or node without a modality


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


def _num(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".") if abs(x - round(x)) > 1e-9 else str(int(round(x)))


def _ticks(hi: float, n: int = 6) -> list[float]:
    """Round tick values from 0 up to about `hi`."""
    if hi <= 0:
        return [0.0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(hi / step + 1e-9) + 1)]


def _text(x: float, y: float, s: str, cls: str = "", anchor: str = "start", extra: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{c}{extra}>{_esc(s)}</text>'


def _node_title(n: torch.fx.Node) -> str:
    a = info(n)
    where = "-" if a.subgraph is None else f"lane {a.lane}, subgraph {a.subgraph}"
    marks = [m for m in ("recomputed in the backward" if a.recomputed else "",
                         f"cast to {a.cast}" if a.cast else "", "saved for the backward" if a.saved else "",
                         f"copy {a.transfer} (offloaded)" if a.transfer else "") if m]
    return (f"{n.name}: {dump.format_target(n)} {dump.format_value(n.meta.get('val'))}\n{a.modality} · {where}\n"
            f"{a.bound}-bound · {a.flops} FLOP · {a.bytes} B · {a.est_us:.2f} µs"
            + (f"\n{'; '.join(marks)}" if marks else ""))


def _glyph(n: torch.fx.Node, x: float, y: float, r: float, color: str, gname: str) -> str:
    """One node: a square outlined in dark for compute-bound ops, a circle for memory-bound ones."""
    a = info(n)
    bound = a.bound if a.bound in ("compute", "memory") else "other"
    classes = ["node", bound] + (["recomputed"] if a.recomputed else []) + (["cast"] if a.cast else [])
    attrs = (f'class="{" ".join(classes)}" data-sg="{a.subgraph if a.subgraph is not None else ""}" '
             f'id="node-{gname}-{slug(n.name)}" fill="{color}"')
    title = f"<title>{_esc(_node_title(n))}</title>"
    if bound == "compute":
        return (f'<rect {attrs} x="{x - r:.1f}" y="{y - r:.1f}" width="{2 * r:.1f}" height="{2 * r:.1f}" '
                f'rx="1.5">{title}</rect>')
    return f'<circle {attrs} cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}">{title}</circle>'


def _lane_label(lane: int) -> str:
    return f"lane {lane}{' (main)' if lane == 0 else ''}"


def _sg_colors(gp: GraphPlan, colors: dict[str, str]) -> dict[int, str]:
    lp = gp.lanes
    if lp is None:
        return {}
    return {sg.id: colors.get(dominant_modality(sg.nodes) or "", GREY) for sg in lp.subgraphs}


# ----------------------------------------------------------------------------------------------
# (b) lane timeline
# ----------------------------------------------------------------------------------------------


def timeline_svg(gp: GraphPlan, gname: str, measured: dict[int, tuple[float, float]] | None,
                  colors: dict[str, str]) -> str:
    lp = gp.lanes
    pred = predicted_timeline(lp)
    serial, concurrent = lp.predicted_us()
    sg_color = _sg_colors(gp, colors)
    lanes = sorted(lp.lanes)
    rows: list[tuple[str, str, int | None, dict[int, tuple[float, float]]]] = []
    for lane in lanes:
        rows.append(("predicted", _lane_label(lane), lane, pred))
    if measured:
        for lane in lanes:
            rows.append(("measured", _lane_label(lane), lane, measured))
    # one stream: every subgraph back to back in launch order, for comparison
    t, serial_times = 0.0, {}
    for sg_id in lp.order:
        serial_times[sg_id] = (t, t + lp.subgraphs[sg_id].est_us)
        t = serial_times[sg_id][1]
    rows.append(("serial", "1 stream", None, serial_times))

    hi = max([serial] + [e for _, e in (measured or {}).values()]) or 1.0
    left, width, row_h, top = 150, 1010, 30, 26
    scale = width / hi
    height = top + row_h * len(rows) + 30
    out = [f'<svg class="lane-timeline-svg" viewBox="0 0 {left + width + 30} {height}" '
           f'width="{left + width + 30}" height="{height}" role="img" aria-label="lane timeline of {_esc(gp.name)}">']
    ticks = _ticks(hi)
    for tk in ticks:
        x = left + tk * scale
        out.append(f'<line class="grid" x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{top + row_h * len(rows)}"/>')
        out.append(_text(x, top - 10, f"{_num(tk)} µs" if tk == ticks[-1] else _num(tk), "tick", "middle"))
    y_of: dict[tuple[str, int | None], float] = {}
    for i, (kind, label, lane, _) in enumerate(rows):
        y = top + i * row_h
        y_of[(kind, lane)] = y
        band = "band-alt" if i % 2 else "band"
        out.append(f'<rect class="{band}" x="0" y="{y}" width="{left + width + 30}" height="{row_h}"/>')
        mods = ", ".join(lp.lanes[lane]) if lane is not None else "serial sum"
        suffix = " · measured" if kind == "measured" else ""
        out.append(_text(8, y + 13, label + suffix, "lane-name"))
        out.append(_text(8, y + 25, mods, "lane-mods"))
    # cross-lane dependencies of the predicted schedule
    for a, b in sorted(lp.dag.edges):
        if lp.lane_of(a) == lp.lane_of(b):
            continue
        x1, x2 = left + pred[a][1] * scale, left + pred[b][0] * scale
        y1 = y_of[("predicted", lp.lane_of(a))] + row_h / 2
        y2 = y_of[("predicted", lp.lane_of(b))] + row_h / 2
        out.append(f'<path class="dep" d="M{x1:.1f},{y1:.1f} C{x1 + 18:.1f},{y1:.1f} {x2 - 18:.1f},{y2:.1f} '
                   f'{x2:.1f},{y2:.1f}" marker-end="url(#arrow-{gname})"/>')
    for kind, label, lane, times in rows:
        for sg_id, (start, end) in sorted(times.items()):
            sg = lp.subgraphs[sg_id]
            if lane is not None and sg.lane != lane:
                continue
            y = y_of[(kind, lane)] + 5
            x, w = left + start * scale, max((end - start) * scale, 1.5)
            title = (f"subgraph {sg_id} · lane {sg.lane} · {dominant_modality(sg.nodes)}\n"
                     f"{kind}: {start:.1f} → {end:.1f} µs ({end - start:.1f} µs) · {len(sg.nodes)} nodes")
            out.append(f'<rect class="sg-bar {kind}" id="bar-{gname}-{kind}-sg{sg_id}" data-sg="{sg_id}" '
                       f'x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 10}" rx="3" '
                       f'fill="{sg_color.get(sg_id, GREY)}"><title>{_esc(title)}</title></rect>')
            if w > 34:
                out.append(_text(x + w / 2, y + 14, f"sg {sg_id}", "bar-label", "middle"))
    for value, cls, label in ((concurrent, "mark-concurrent", "concurrent"), (serial, "mark-serial", "serial")):
        x = left + value * scale
        y_end = top + row_h * len(rows)
        out.append(f'<line class="{cls}" x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{y_end + 4}"/>')
        anchor = "end" if cls == "mark-serial" else "middle"
        out.append(_text(x, y_end + 16, f"{label} {value:.1f} µs", cls + "-label", anchor))
    out.append(f'<defs><marker id="arrow-{gname}" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="6" '
               f'markerHeight="6" orient="auto"><path d="M0,0 L8,4 L0,8 z" class="arrowhead"/></marker></defs>')
    out.append("</svg>")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# (c) memory arena
# ----------------------------------------------------------------------------------------------


def arena_svg(gp: GraphPlan, gname: str, colors: dict[str, str]) -> str:
    lp, mem = gp.lanes, gp.memory
    order = list(lp.order)
    pos = {sg_id: i for i, sg_id in enumerate(order)}
    n_cols = len(order) + 1  # + the graph's outputs
    sg_color = _sg_colors(gp, colors)
    left, width, top, plot_h = 64, 420, 22, 240
    col_w = width / n_cols
    arena = max(mem.arena_bytes, 1)
    scale = plot_h / arena
    height = top + plot_h + 44
    out = [f'<svg class="memory-arena-svg" viewBox="0 0 {left + width + 16} {height}" '
           f'width="{left + width + 16}" height="{height}" role="img" aria-label="memory arena of {_esc(gp.name)}">']
    for i in range(n_cols):
        x = left + i * col_w
        out.append(f'<rect class="{"band-alt" if i % 2 else "band"}" x="{x:.1f}" y="{top}" width="{col_w:.1f}" '
                   f'height="{plot_h}"/>')
        if i < len(order):
            sg_id = order[i]
            label = f"sg {sg_id}" if col_w > 30 else str(sg_id)
            out.append(f'<rect x="{x + 2:.1f}" y="{top + plot_h + 4}" width="{col_w - 4:.1f}" height="4" rx="2" '
                       f'fill="{sg_color.get(sg_id, GREY)}"/>')
        else:
            label = "out"
        if col_w > 14 or i == n_cols - 1:
            out.append(_text(x + col_w / 2, top + plot_h + 20, label, "tick", "middle"))
    unit, div = next(((u, d) for u, d in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
                      if arena >= 2 * d), ("B", 1))
    for tk in _ticks(arena / div, 4):
        y = top + plot_h - tk * div * scale
        out.append(f'<line class="grid" x1="{left}" y1="{y:.1f}" x2="{left + width}" y2="{y:.1f}"/>')
        out.append(_text(left - 6, y + 4, f"{_num(tk)} {unit}" if tk else "0", "tick", "end"))
    placements = sorted(mem.placements, key=lambda p: (-p.buffer.nbytes, p.buffer.name))
    for p in placements:
        b = p.buffer
        if b.nbytes <= 0 or b.producer not in pos:
            continue
        ends = [pos[c] + 1 if c in pos else n_cols for c in b.consumers] or [pos[b.producer] + 1]
        x0 = left + pos[b.producer] * col_w
        x1 = left + max(ends) * col_w
        y = top + plot_h - (p.offset + b.nbytes) * scale
        h = max(b.nbytes * scale, 0.8)
        consumers = ", ".join(map(str, mem.last_consumers.get(b.name, b.consumers))) or "-"
        title = (f"{b.name}: {format_bytes(b.nbytes)} at offset {p.offset}\n"
                 f"produced by sg {b.producer} (lane {b.lane}), last read by {consumers}")
        out.append(f'<rect class="buffer" data-sg="{b.producer}" x="{x0 + 1:.1f}" y="{y:.1f}" '
                   f'width="{max(x1 - x0 - 2, 1):.1f}" height="{h:.1f}" fill="{sg_color.get(b.producer, GREY)}">'
                   f'<title>{_esc(title)}</title></rect>')
    y_top = top + plot_h - mem.arena_bytes * scale
    out.append(f'<line class="arena-top" x1="{left}" y1="{y_top:.1f}" x2="{left + width}" y2="{y_top:.1f}"/>')
    out.append(_text(left + width, top - 6, f"arena {format_bytes(mem.arena_bytes)}", "arena-label", "end"))
    out.append(_text(left, height - 4, "schedule position (launch order) → buffers live from producer to last reader",
                     "axis-label"))
    out.append("</svg>")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# (a) the annotated graph: subgraph boxes, then nodes one by one
# ----------------------------------------------------------------------------------------------


def subgraph_svg(gp: GraphPlan, gname: str, colors: dict[str, str]) -> str:
    """Subgraphs as boxes (columns = longest-path layer of the DAG, rows = lanes), with their
    node counts and top ops (:func:`~.stats.largest_ops`, each with the FLOPs or
    bytes that set its roofline time); arrows are DAG edges, dashed where they cross lanes (a wait)."""
    lp = gp.lanes
    order, edges = list(lp.order), sorted(lp.dag.edges)
    preds: dict[int, list[int]] = {sg_id: [] for sg_id in order}
    for a, b in edges:
        preds[b].append(a)
    layer: dict[int, int] = {}
    for sg_id in order:
        layer[sg_id] = 1 + max((layer[p] for p in preds[sg_id]), default=-1)
    lanes = sorted(lp.lanes)
    cells: dict[tuple[int, int], list[int]] = {}
    for sg_id in order:
        cells.setdefault((lanes.index(lp.lane_of(sg_id)), layer[sg_id]), []).append(sg_id)
    per_row = {r: max((len(v) for (rr, _), v in cells.items() if rr == r), default=1) for r in range(len(lanes))}
    box_w, box_h, gap_x, gap_y, left, top, k = 216, 90, 50, 10, 112, 6, 3
    row_y, y = {}, top
    for r in range(len(lanes)):
        row_y[r] = y
        y += per_row[r] * (box_h + gap_y)
    n_layers = max(layer.values(), default=0) + 1
    width, height = left + n_layers * (box_w + gap_x), y + 4
    sg_color = _sg_colors(gp, colors)
    xy: dict[int, tuple[float, float]] = {}
    for (r, c), ids in cells.items():
        for j, sg_id in enumerate(ids):
            xy[sg_id] = (left + c * (box_w + gap_x), row_y[r] + j * (box_h + gap_y))
    out = [f'<svg class="subgraph-view-svg" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="subgraphs of {_esc(gp.name)}">']
    for r, lane in enumerate(lanes):
        y0 = row_y[r]
        out.append(_text(6, y0 + 16, _lane_label(lane), "lane-name"))
        for i, m in enumerate(lp.lanes[lane][:4]):
            out.append(_text(6, y0 + 32 + 13 * i, m, "lane-mods"))
    for a, b in edges:
        (xa, ya), (xb, yb) = xy[a], xy[b]
        x1, y1, x2, y2 = xa + box_w, ya + box_h / 2, xb, yb + box_h / 2
        cross = lp.lane_of(a) != lp.lane_of(b)
        out.append(f'<path class="sg-edge{" cross" if cross else ""}" '
                   f'd="M{x1:.1f},{y1:.1f} C{x1 + gap_x / 2:.1f},{y1:.1f} '
                   f'{x2 - gap_x / 2:.1f},{y2:.1f} {x2 - 2:.1f},{y2:.1f}" marker-end="url(#arrow-sg-{gname})"/>')
    for sg in (lp.subgraphs[i] for i in order):
        x, y = xy[sg.id]
        bounds = Counter(info(n).bound for n in sg.nodes)
        mod = dominant_modality(sg.nodes) or "-"
        color = sg_color.get(sg.id, GREY)
        out.append(f'<g class="sg-box" id="sg-{gname}-{sg.id}" data-sg="{sg.id}">')
        out.append(f'<rect class="sg-frame" x="{x}" y="{y}" width="{box_w}" height="{box_h}" rx="7" '
                   f'style="stroke:{color}"/>')
        out.append(f'<rect x="{x}" y="{y}" width="{box_w}" height="22" rx="7" fill="{color}"/>'
                   f'<rect x="{x}" y="{y + 12}" width="{box_w}" height="10" fill="{color}"/>')
        out.append(_text(x + 8, y + 15, f"sg {sg.id} · {mod}", "sg-title"))
        out.append(_text(x + box_w - 8, y + 15, f"{sg.est_us:.1f} µs", "sg-title", "end"))
        out.append(_text(x + 8, y + 36, f"{len(sg.nodes)} nodes · {bounds.get('compute', 0)} compute · "
                                        f"{bounds.get('memory', 0)} memory", "sg-sub"))
        for i, n in enumerate(largest_ops(sg.nodes, k)):
            yy = y + 52 + 15 * i
            out.append(_glyph(n, x + 14, yy - 4, 4.5, colors.get(info(n).modality or "", GREY), gname + "-box"))
            op = dump.format_target(n)
            op = op if len(op) <= 19 else op[:18] + "…"
            out.append(_text(x + 24, yy, op, "sg-op"))
            # est_us reads the launch floor on a small model: show what ranks the op (largest_ops)
            cost = format_flops(info(n).flops) if info(n).bound == "compute" else format_bytes(info(n).bytes)
            out.append(_text(x + box_w - 8, yy, cost, "sg-op num", "end", f' data-cost="{_esc(op_cost(n))}"'))
        out.append("</g>")
    out.append(f'<defs><marker id="arrow-sg-{gname}" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="6" '
               f'markerHeight="6" orient="auto"><path d="M0,0 L8,4 L0,8 z" class="arrowhead"/></marker></defs>')
    out.append("</svg>")
    return "\n".join(out)


def is_drawn(n: torch.fx.Node) -> bool:
    """Nodes drawn one by one: real work. Views, getitems, placeholders and outputs collapse
    into their users' edges."""
    return n.op == "call_function" and n.target is not operator.getitem and info(n).bound in ("compute", "memory")


def node_layout(gm: torch.fx.GraphModule
                ) -> tuple[list[torch.fx.Node], dict[torch.fx.Node, set], dict[torch.fx.Node, int]]:
    """(drawn nodes, their drawn inputs through collapsed nodes, layer): longest-path layers from
    the sources; a source is then pushed right to just before its first user, so the inputs of a
    backward graph do not pile up in column 0."""
    reps: dict[torch.fx.Node, set] = {}
    drawn, inputs = [], {}
    for n in gm.graph.nodes:
        ins: set = set()
        for a in n.all_input_nodes:
            ins |= reps.get(a, set())
        if is_drawn(n):
            drawn.append(n)
            inputs[n] = ins
            reps[n] = {n}
        else:
            reps[n] = ins if len(ins) <= 8 else set()
    layer: dict[torch.fx.Node, int] = {}
    for n in drawn:
        layer[n] = 1 + max((layer[i] for i in inputs[n]), default=-1)
    users: dict[torch.fx.Node, list] = {n: [] for n in drawn}
    for n in drawn:
        for i in inputs[n]:
            users[i].append(n)
    for n in reversed(drawn):
        if not inputs[n] and users[n]:
            layer[n] = max(min(layer[u] for u in users[n]) - 1, 0)
    return drawn, inputs, layer


def node_svg(gp: GraphPlan, gname: str, colors: dict[str, str]) -> str:
    drawn, inputs, layer = node_layout(gp.gm)
    lanes = sorted({info(n).lane if info(n).lane is not None else 0 for n in drawn})
    slot: dict[torch.fx.Node, int] = {}
    count: Counter = Counter()
    for n in drawn:
        key = (info(n).lane or 0, layer[n])
        slot[n] = count[key]
        count[key] += 1
    band = {lane: max((c for (l, _), c in count.items() if l == lane), default=1) for lane in lanes}
    dx, dy, r, left, top = 20, 15, 4.6, 96, 10
    band_y, y = {}, top
    for lane in lanes:
        band_y[lane] = y
        y += band[lane] * dy + 18
    n_layers = max(layer.values(), default=0) + 1
    width, height = left + n_layers * dx + 10, y
    pos = {n: (left + layer[n] * dx + dx / 2, band_y[info(n).lane or 0] + slot[n] * dy + dy / 2) for n in drawn}
    out = [f'<svg class="node-graph-svg" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="nodes of {_esc(gp.name)}">']
    for i, lane in enumerate(lanes):
        y0 = band_y[lane] - 9 if i else 0
        out.append(f'<rect class="{"band-alt" if i % 2 else "band"}" x="0" y="{y0}" width="{width}" '
                   f'height="{band[lane] * dy + 18 + (band_y[lane] - y0) - 9}"/>')
        out.append(_text(6, band_y[lane] + 12, f"lane {lane}", "lane-name"))
    edges = []
    for n in drawn:
        x2, y2 = pos[n]
        for i in inputs[n]:
            x1, y1 = pos[i]
            mid = (x1 + x2) / 2
            edges.append(f"M{x1:.1f},{y1:.1f} C{mid:.1f},{y1:.1f} {mid:.1f},{y2:.1f} {x2:.1f},{y2:.1f}")
    if edges:
        out.append(f'<path class="edges" d="{" ".join(edges)}"/>')
    for n in drawn:
        out.append(_glyph(n, *pos[n], r, colors.get(info(n).modality or "", GREY), gname))
    out.append("</svg>")
    return "\n".join(out)
