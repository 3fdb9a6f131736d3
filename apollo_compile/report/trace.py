"""The predicted (and any measured) timeline of a report as a Chrome/Perfetto trace.

One process per graph, one thread per lane (measured lanes from thread 1000 up), one ``"X"``
event per subgraph with its lane, node count, estimate, the subgraphs it waits for and its
costliest ops. Open the JSON in ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

from typing import Any

from . import dump
from .model import ReportData
from .stats import dominant_modality, largest_ops, op_cost, predicted_timeline

__all__ = ["render_trace"]


def render_trace(report: ReportData) -> dict[str, Any]:
    """Chrome/Perfetto trace: one process per graph, one thread per lane, ph "X" per subgraph."""
    events: list[dict[str, Any]] = []
    for pid, gp in enumerate(report.graphs, start=1):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{gp.name} ({gp.kind})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        lp = gp.lanes
        if lp is None:
            continue
        rows = [("predicted", predicted_timeline(lp), 0)]
        if report.measured.get(gp.name):
            rows.append(("measured", report.measured[gp.name], 1000))
        waits_for: dict[int, list[int]] = {}
        for a, b in sorted(lp.dag.edges):
            waits_for.setdefault(b, []).append(a)
        for cat, times, tid_base in rows:
            for lane, mods in sorted(lp.lanes.items()):
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid_base + lane,
                               "args": {"name": f"lane {lane} {cat}: {', '.join(mods)}"}})
            for sg_id, (start, end) in sorted(times.items(), key=lambda kv: kv[1]):
                sg = lp.subgraphs[sg_id]
                events.append({
                    "name": f"sg {sg_id} {dominant_modality(sg.nodes) or ''}".strip(), "cat": cat, "ph": "X",
                    "pid": pid, "tid": tid_base + sg.lane, "ts": round(start, 3), "dur": round(end - start, 3),
                    "args": {"subgraph": sg_id, "lane": sg.lane, "nodes": len(sg.nodes),
                             "est_us": round(sg.est_us, 3),
                             "waits_for": sorted(waits_for.get(sg_id, ())),
                             "largest_ops": [f"{n.name} ({dump.format_target(n)}, {op_cost(n)})"
                                             for n in largest_ops(sg.nodes, 5)]},
                })
    return {"traceEvents": events,
            "otherData": {"producer": "apollo_compile.report",
                          "options": {k: repr(v) for k, v in report.options.items()}}}
