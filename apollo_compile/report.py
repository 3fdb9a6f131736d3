"""Explain what apollo decides for a model: a text table, one HTML page, a Chrome trace.

    report = apollo_compile.explain(model, *example_inputs, subgraph_compiler="eager")
    print(report)                       # one row per compiled graph
    report.save_html("report.html")     # graphs, lane timelines, memory arenas; one file, no network
    report.save_trace("trace.json")     # the predicted timeline for ui.perfetto.dev / chrome://tracing

or from a shell: ``python -m apollo_compile report examples/clip.py:build --out report.html``.

Everything here reads the plans the backend recorded (:mod:`apollo_compile.plan`): the node
annotations, the :class:`~apollo_compile.passes.lanes.LanePlan` and the
:class:`~apollo_compile.passes.memory_plan.MemoryPlan`. Nothing is re-planned.

Predicted times come from the cost labels the same way :meth:`LanePlan.predicted_us` computes
them: a subgraph starts when the last of its DAG predecessors ends (same-lane program order is
part of the DAG). Measured times can be attached with :meth:`Report.add_measured`.
"""

from __future__ import annotations

import html
import json
import math
import operator
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.fx

from . import dump
from . import plan as plan_store
from .annotations import info
from .backend import ApolloFallbackWarning
from .plan import GraphPlan, ModelPlan

__all__ = ["Report", "explain", "predicted_timeline"]

_GRAPH_KINDS = ("forward", "backward", "inference")


# ----------------------------------------------------------------------------------------------
# explain()
# ----------------------------------------------------------------------------------------------


def explain(model: torch.nn.Module, *example_inputs: Any, **options: Any) -> "Report":
    """Compile `model` with apollo, run it once on `example_inputs`, and report what was planned.

    ``options`` are apollo's options (``subgraph_compiler="eager"``, ``device="H200"``, ...),
    passed to ``torch.compile(model, backend="apollo", options=options)`` as given.

    ``torch._dynamo.reset()`` runs first so that graphs cached by an earlier compilation are
    compiled (and planned) again. One forward runs on the example inputs; if its output is a
    scalar tensor that requires grad (a loss), one backward runs too, so that the backward graph
    is planned as well. The gradients that backward computes are discarded: every parameter's
    ``.grad`` is restored to what it was before the call. The report holds every plan
    (:func:`apollo_compile.plans`) made during the call, and the fallback warnings raised
    (they are re-issued to the caller as well).
    """
    before = {id(p) for p in plan_store.plans()}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="apollo", options=dict(options) or None)
    saved_grads = {p: (None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()}
    ran_backward = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = compiled(*example_inputs)
            if isinstance(out, torch.Tensor) and out.requires_grad and out.numel() == 1:
                out.backward()
                ran_backward = True
    finally:
        for p, g in saved_grads.items():
            p.grad = g
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    messages = [str(w.message) for w in caught if issubclass(w.category, ApolloFallbackWarning)]
    new = [p for p in plan_store.plans() if id(p) not in before]
    return Report(new, dict(options), ran_backward, messages)


# ----------------------------------------------------------------------------------------------
# Numbers per graph
# ----------------------------------------------------------------------------------------------


def predicted_timeline(lanes) -> dict[int, tuple[float, float]]:
    """Predicted (start_us, end_us) of every subgraph of a LanePlan, in launch order.

    The recurrence of ``LanePlan.predicted_us``: a subgraph starts when its last DAG predecessor
    ends, and runs for the sum of its nodes' roofline estimates.
    """
    times: dict[int, tuple[float, float]] = {}
    for sg_id in lanes.order:
        start = max((times[p][1] for p in lanes.dag.predecessors(sg_id)), default=0.0)
        times[sg_id] = (start, start + lanes.subgraphs[sg_id].est_us)
    return times


@dataclass(frozen=True)
class GraphStats:
    """What the text table shows for one graph."""

    name: str
    kind: str
    device: str
    lanes: dict[int, list[str]]
    subgraphs: int
    serial_us: float
    concurrent_us: float
    waits: int
    arena_bytes: int | None
    total_bytes: int | None
    compute: int
    memory: int
    recomputed: int
    casts: int
    fallback: str | None

    @property
    def speedup(self) -> float | None:
        return self.serial_us / self.concurrent_us if self.concurrent_us > 0 else None


def graph_stats(gp: GraphPlan) -> GraphStats:
    nodes = list(gp.gm.graph.nodes)
    bounds = Counter(info(n).bound for n in nodes)
    lanes = gp.lanes
    serial = concurrent = 0.0
    waits = 0
    if lanes is not None:
        serial, concurrent = lanes.predicted_us()
        codegen = gp.decisions.get("codegen")
        waits = codegen.waits if codegen is not None else sum(
            lanes.lane_of(a) != lanes.lane_of(b) for a, b in lanes.dag.edges)
    mem = gp.memory
    return GraphStats(
        name=gp.name, kind=gp.kind, device=gp.device,
        lanes=dict(sorted(lanes.lanes.items())) if lanes is not None else {},
        subgraphs=len(lanes.subgraphs) if lanes is not None else 0,
        serial_us=serial, concurrent_us=concurrent, waits=waits,
        arena_bytes=mem.arena_bytes if mem is not None else None,
        total_bytes=mem.total_bytes if mem is not None else None,
        compute=bounds.get("compute", 0), memory=bounds.get("memory", 0),
        recomputed=sum(info(n).recomputed for n in nodes), casts=sum(bool(info(n).cast) for n in nodes),
        fallback=gp.fallback,
    )


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _lanes_text(lanes: dict[int, list[str]]) -> str:
    return " | ".join(f"lane {k}: {', '.join(v)}" for k, v in lanes.items()) or "-"


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


@dataclass
class Report:
    """The plans of one :func:`explain` call; ``str(report)`` is the text table."""

    plans: list[ModelPlan]
    options: dict[str, Any] = field(default_factory=dict)
    ran_backward: bool = False
    fallback_warnings: list[str] = field(default_factory=list)
    measured: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)

    @property
    def graphs(self) -> list[GraphPlan]:
        """Every planned ATen graph: per Dynamo graph, forward, backward, inference."""
        out = []
        for mp in self.plans:
            out += [mp.graphs[k] for k in _GRAPH_KINDS if k in mp.graphs]
            out += [g for k, g in mp.graphs.items() if k not in _GRAPH_KINDS]
        return out

    def graph(self, name: str) -> GraphPlan:
        for gp in self.graphs:
            if gp.name == name:
                return gp
        raise KeyError(f"no graph named {name!r} in this report; graphs: {', '.join(g.name for g in self.graphs)}")

    def stats(self) -> list[GraphStats]:
        return [graph_stats(gp) for gp in self.graphs]

    def add_measured(self, graph_name: str, timings: dict[int, tuple[float, float]]) -> None:
        """Attach measured (start_us, end_us) per subgraph id of graph `graph_name`.

        They are drawn under the predicted lanes in :meth:`save_html` and written as a second set
        of threads by :meth:`save_trace`. Times are relative to the graph's start.
        """
        gp = self.graph(graph_name)
        n_sg = len(gp.lanes.subgraphs) if gp.lanes is not None else 0
        clean: dict[int, tuple[float, float]] = {}
        for sg_id, (start, end) in timings.items():
            if not 0 <= int(sg_id) < n_sg:
                raise KeyError(f"graph {graph_name} has no subgraph {sg_id} (it has {n_sg})")
            if end < start:
                raise ValueError(f"graph {graph_name} subgraph {sg_id}: end {end} is before start {start}")
            clean[int(sg_id)] = (float(start), float(end))
        self.measured[graph_name] = clean

    # -- text -------------------------------------------------------------------------------

    def __str__(self) -> str:
        stats = self.stats()
        devices = sorted({s.device for s in stats})
        head = (f"apollo explain: {len(stats)} graph(s) from {len(self.plans)} Dynamo graph(s), planned for "
                f"{', '.join(devices) or '-'}; ran forward{' + backward' if self.ran_backward else ' only'}")
        if not stats:
            return head + "\n(no graph was planned)\n" + "".join(f"warning: {w}\n" for w in self.fallback_warnings)
        rows = [("graph", "kind", "lanes", "subgraphs", "serial µs", "concurrent µs", "speedup", "waits",
                 "arena", "no reuse", "compute", "memory", "recomputed", "casts", "fallback")]
        for s in stats:
            rows.append((s.name, s.kind, str(len(s.lanes)), str(s.subgraphs), f"{s.serial_us:.1f}",
                         f"{s.concurrent_us:.1f}", f"{s.speedup:.2f}x" if s.speedup else "-", str(s.waits),
                         format_bytes(s.arena_bytes), format_bytes(s.total_bytes), str(s.compute), str(s.memory),
                         str(s.recomputed), str(s.casts), "yes" if s.fallback else "-"))
        lines = [head, *_table(rows, right={2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13})]
        width = max(len(s.name) for s in stats)
        lines.append("lanes (modalities):")
        lines += [f"  {s.name.ljust(width)}  {_lanes_text(s.lanes)}" for s in stats]
        for name, timings in self.measured.items():
            if timings:
                span = max(e for _, e in timings.values()) - min(s for s, _ in timings.values())
                lines.append(f"measured: {name}: {span:.1f} µs over {len(timings)} subgraph(s)")
        for gp in self.graphs:
            rows = candidate_rows(gp)
            if rows:
                lines.append(f"candidates: {gp.name}: " + ", ".join(
                    f"{name} {pred} µs" + (f" / measured {ms} ms" if ms != "-" else "") + (f" ({note})" if note else "")
                    for name, pred, ms, note in rows))
        for s in stats:
            if s.fallback:
                lines.append(f"fallback: {s.name}: {s.fallback}")
        for mp in self.plans:
            if not mp.graphs:
                lines.append(f"fallback: {mp.name}: no ATen graph was planned (the Dynamo graph runs as traced)")
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return f"Report(graphs={[g.name for g in self.graphs]})"

    # -- trace ------------------------------------------------------------------------------

    def to_trace(self) -> dict[str, Any]:
        """Chrome/Perfetto trace: one process per graph, one thread per lane, ph "X" per subgraph."""
        events: list[dict[str, Any]] = []
        for pid, gp in enumerate(self.graphs, start=1):
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{gp.name} ({gp.kind})"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
            lp = gp.lanes
            if lp is None:
                continue
            rows = [("predicted", predicted_timeline(lp), 0)]
            if self.measured.get(gp.name):
                rows.append(("measured", self.measured[gp.name], 1000))
            for cat, times, tid_base in rows:
                for lane, mods in sorted(lp.lanes.items()):
                    events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid_base + lane,
                                   "args": {"name": f"lane {lane} {cat}: {', '.join(mods)}"}})
                for sg_id, (start, end) in sorted(times.items(), key=lambda kv: kv[1]):
                    sg = lp.subgraphs[sg_id]
                    events.append({
                        "name": f"sg {sg_id} {_dominant_modality(sg.nodes) or ''}".strip(), "cat": cat, "ph": "X",
                        "pid": pid, "tid": tid_base + sg.lane, "ts": round(start, 3), "dur": round(end - start, 3),
                        "args": {"subgraph": sg_id, "lane": sg.lane, "nodes": len(sg.nodes),
                                 "est_us": round(sg.est_us, 3),
                                 "waits_for": sorted(lp.dag.predecessors(sg_id)),
                                 "largest_ops": [f"{n.name} ({dump.format_target(n)}, {info(n).est_us:.2f} µs)"
                                                 for n in _largest(sg.nodes, 5)]},
                    })
        return {"traceEvents": events,
                "otherData": {"producer": "apollo_compile.report",
                              "options": {k: repr(v) for k, v in self.options.items()}}}

    def save_trace(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.to_trace(), f, indent=1)
        return path

    # -- html -------------------------------------------------------------------------------

    def to_html(self) -> str:
        return _page(self)

    def save_html(self, path: str) -> str:
        """Write one self-contained HTML page (inline CSS, JS and SVG; nothing is fetched)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_html())
        return path


# ----------------------------------------------------------------------------------------------
# HTML: helpers
# ----------------------------------------------------------------------------------------------

_esc = html.escape
GREY = "#b8bec6"
_NODE_CAP = 900  # most nodes drawn one by one; larger graphs show subgraph boxes and the table only


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


def _largest(nodes: Iterable[torch.fx.Node], k: int) -> list[torch.fx.Node]:
    nodes = [n for n in nodes if info(n).bound in ("compute", "memory")]
    # ties (many small ops sit at the launch-overhead floor) go to the op with more FLOPs
    return sorted(nodes, key=lambda n: (-round(info(n).est_us, 1), -info(n).flops))[:k]


def _dominant_modality(nodes: Iterable[torch.fx.Node]) -> str | None:
    weight: Counter = Counter()
    for n in nodes:
        m = info(n).modality
        if m:
            weight[m] += info(n).est_us + 1e-6
    return weight.most_common(1)[0][0] if weight else None


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
             f'id="node-{gname}-{_slug(n.name)}" fill="{color}"')
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
    return {sg.id: colors.get(_dominant_modality(sg.nodes) or "", GREY) for sg in lp.subgraphs}


# ----------------------------------------------------------------------------------------------
# HTML: (b) lane timeline
# ----------------------------------------------------------------------------------------------


def _timeline_svg(gp: GraphPlan, gname: str, measured: dict[int, tuple[float, float]] | None,
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
    for a, b in lp.dag.edges:
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
            title = (f"subgraph {sg_id} · lane {sg.lane} · {_dominant_modality(sg.nodes)}\n"
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
# HTML: (c) memory arena
# ----------------------------------------------------------------------------------------------


def _arena_svg(gp: GraphPlan, gname: str, colors: dict[str, str]) -> str:
    lp, mem = gp.lanes, gp.memory
    pos = {sg_id: i for i, sg_id in enumerate(lp.order)}
    n_cols = len(lp.order) + 1  # + the graph's outputs
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
        if i < len(lp.order):
            sg_id = lp.order[i]
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
# HTML: (a) the annotated graph: subgraph boxes, then nodes one by one
# ----------------------------------------------------------------------------------------------


def _subgraph_svg(gp: GraphPlan, gname: str, colors: dict[str, str]) -> str:
    """Subgraphs as boxes (columns = longest-path layer of the DAG, rows = lanes), with their
    node counts and largest ops; arrows are DAG edges, dashed where they cross lanes (a wait)."""
    lp = gp.lanes
    layer: dict[int, int] = {}
    for sg_id in lp.order:
        layer[sg_id] = 1 + max((layer[p] for p in lp.dag.predecessors(sg_id)), default=-1)
    lanes = sorted(lp.lanes)
    cells: dict[tuple[int, int], list[int]] = {}
    for sg_id in lp.order:
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
    for a, b in lp.dag.edges:
        (xa, ya), (xb, yb) = xy[a], xy[b]
        x1, y1, x2, y2 = xa + box_w, ya + box_h / 2, xb, yb + box_h / 2
        cross = lp.lane_of(a) != lp.lane_of(b)
        out.append(f'<path class="sg-edge{" cross" if cross else ""}" '
                   f'd="M{x1:.1f},{y1:.1f} C{x1 + gap_x / 2:.1f},{y1:.1f} '
                   f'{x2 - gap_x / 2:.1f},{y2:.1f} {x2 - 2:.1f},{y2:.1f}" marker-end="url(#arrow-sg-{gname})"/>')
    for sg in lp.subgraphs:
        x, y = xy[sg.id]
        bounds = Counter(info(n).bound for n in sg.nodes)
        mod = _dominant_modality(sg.nodes) or "-"
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
        for i, n in enumerate(_largest(sg.nodes, k)):
            yy = y + 52 + 15 * i
            out.append(_glyph(n, x + 14, yy - 4, 4.5, colors.get(info(n).modality or "", GREY), gname + "-box"))
            op = dump.format_target(n)
            op = op if len(op) <= 22 else op[:21] + "…"
            out.append(_text(x + 24, yy, op, "sg-op"))
            out.append(_text(x + box_w - 8, yy, f"{info(n).est_us:.1f} µs", "sg-op num", "end"))
        out.append("</g>")
    out.append(f'<defs><marker id="arrow-sg-{gname}" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="6" '
               f'markerHeight="6" orient="auto"><path d="M0,0 L8,4 L0,8 z" class="arrowhead"/></marker></defs>')
    out.append("</svg>")
    return "\n".join(out)


def _drawn(n: torch.fx.Node) -> bool:
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
        if _drawn(n):
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


def _node_svg(gp: GraphPlan, gname: str, colors: dict[str, str]) -> str:
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


def candidate_rows(gp: GraphPlan) -> list[tuple[str, str, str, str]]:
    """(runtime, predicted µs, measured ms, note) for each candidate the quotas pass proposed; the
    measured column and the replayed mark come from the CUDA-graph runner while the graph lives."""
    decision = gp.decisions.get("quotas")
    if decision is None or not decision.candidates:
        return []
    runner = gp.runner.summary() if gp.runner is not None else {}
    measured = runner.get("measured_ms") or {}
    rows = []
    for c in decision.candidates:
        note = "replayed" if runner.get("chosen") == c.name else ("not captured" if measured and c.name not in measured else "")
        ms = measured.get(c.name)
        rows.append((c.name, f"{c.predicted_us:.1f}", f"{ms:.3f}" if ms is not None else "-", note))
    return rows


def _graph_section(report: Report, gp: GraphPlan, s: GraphStats) -> str:
    gname = _slug(gp.name)
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
                   + _timeline_svg(gp, gname, measured, colors) + "</div>")
        out.append('<div class="row">')
        out.append('<div class="panel graph-view"><h3>Subgraphs <small>boxes per lane in dependency order; '
                   'dashed arrows are cross-lane waits</small></h3><div class="scroll">'
                   + _subgraph_svg(gp, gname, colors) + "</div></div>")
        if gp.memory is not None:
            m = gp.memory
            out.append('<div class="panel memory-arena"><h3>Memory arena <small>'
                       f'{format_bytes(m.arena_bytes)} vs {format_bytes(m.total_bytes)} without reuse '
                       f'({100 * m.saved_fraction:.0f}% saved), {len(m.placements)} buffers</small></h3>'
                       + _arena_svg(gp, gname, colors) + "</div>")
        out.append("</div>")
    cands = candidate_rows(gp)
    if cands:
        calibrated = gp.decisions["quotas"].calibrated
        out.append('<div class="panel candidates"><h3>Runtime candidates <small>predicted by the performance '
                   'model; measured as CUDA-graph replays on the GPU'
                   + (f"; refitted from them: {_esc(', '.join(f'{k} {v:.3f}' for k, v in calibrated.items()))}"
                      if calibrated else "") + '</small></h3><table class="summary"><thead><tr>'
                   + "".join(f"<th>{h}</th>" for h in ("runtime", "predicted µs", "measured ms", ""))
                   + "</tr></thead><tbody>"
                   + "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in cands)
                   + "</tbody></table></div>")
    drawn = sum(_drawn(n) for n in gp.gm.graph.nodes)
    total = len(gp.gm.graph.nodes)
    if drawn <= _NODE_CAP:
        out.append(f'<details class="panel node-graph" id="nodegraph-{gname}" open><summary><h3>Annotated graph '
                   f'<small>{drawn} of {total} '
                   'nodes; views, getitems, inputs and outputs folded into edges; hover a node for its '
                   'annotation</small></h3></summary><div class="scroll">' + _node_svg(gp, gname, colors)
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


def _summary_table(report: Report, stats: list[GraphStats]) -> str:
    head = ("graph", "kind", "lanes (modalities)", "subgraphs", "serial µs", "concurrent µs", "speedup", "waits",
            "arena", "no reuse", "compute", "memory", "recomputed", "casts", "fallback")
    out = ['<table class="summary"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"]
    for s in stats:
        lanes = "<br>".join(f"<b>{k}</b> {_esc(', '.join(v))}" for k, v in s.lanes.items()) or "-"
        cells = (f'<a href="#graph-{_slug(s.name)}">{_esc(s.name)}</a>', _esc(s.kind), lanes, str(s.subgraphs),
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


def _page(report: Report) -> str:
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
ran forward{' + backward' if report.ran_backward else ' only'} · options: {_esc(options)} ·
times are roofline predictions from the cost model</p></header>
<main>
{_summary_table(report, stats) if stats else '<p class="note">No graph was planned.</p>'}
{''.join(notes)}
{''.join(sections)}
</main>
<footer>Generated by apollo_compile.report. Hover bars, boxes, buffers and nodes for details.</footer>
<script>{_JS}</script>
</body></html>
"""
