"""The text table of a report: ``print(report)``.

One row per planned graph (lanes, subgraphs, predicted serial and concurrent times, waits,
memory, node counts), then each graph's lanes and modalities, its costliest ops, its runtime
candidates, what a memory budget re-runs in its backward, and the notes that explain them, each
note once.
"""

from __future__ import annotations

import textwrap

from ..annotations import info
from .model import ReportData
from .stats import (TOP_OPS_RANKING, candidate_rows, candidates_note, device_notes, format_bytes, format_flops,
                    largest_ops)

__all__ = ["recomputed_text", "render_text"]


def _lanes_text(lanes: dict[int, list[str]]) -> str:
    return " | ".join(f"lane {k}: {', '.join(v)}" for k, v in lanes.items()) or "-"


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, width=110, initial_indent="  ", subsequent_indent="  ")


def recomputed_text(decision) -> str:
    """What a memory budget re-runs in a graph's backward (a forward's joint-graph checkpoint
    decision, or a whole step's recompute decision), and the predicted peak it buys."""
    copies = getattr(decision, "copies", None)
    made = f" ({len(copies)} nodes copied into the backward)" if copies else ""
    return (f"{len(decision.recomputed)} forward ops re-run in the backward{made}; predicted peak activations "
            f"{format_bytes(decision.peak_before)} -> {format_bytes(decision.peak_after)} "
            f"(memory_budget {decision.budget!r}, {'met' if decision.met else 'not met'})")


def render_text(report: ReportData) -> str:
    """The text table and its notes, as ``print(report)`` shows them."""
    stats = report.stats()
    devices = sorted({s.device for s in stats})
    head = (f"apollo explain: {len(stats)} graph(s) from {len(report.plans)} Dynamo graph(s), planned for "
            f"{', '.join(devices) or '-'}; ran {report.ran_text()}")
    if not stats:
        return head + "\n(no graph was planned)\n" + "".join(f"warning: {w}\n" for w in report.fallback_warnings)
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
    for name, timings in report.measured.items():
        if timings:
            span = max(e for _, e in timings.values()) - min(s for s, _ in timings.values())
            lines.append(f"measured: {name}: {span:.1f} µs over {len(timings)} subgraph(s)")
    tops = [(gp.name, largest_ops(gp.gm.graph.nodes, 5)) for gp in report.graphs if gp.lanes is not None]
    if any(ops for _, ops in tops):
        lines.append(f"top ops ({TOP_OPS_RANKING}):")
        lines += [f"  {name.ljust(width)}  " + ", ".join(
            f"{n.name} [sg {info(n).subgraph}] {format_flops(info(n).flops)} {format_bytes(info(n).bytes)}"
            for n in ops) for name, ops in tops if ops]
    any_candidates = False
    for gp in report.graphs:
        rows = candidate_rows(gp)
        if rows:
            any_candidates = True
            lines.append(f"candidates: {gp.name}: " + ", ".join(
                f"{name} {pred} µs" + (f" / measured {ms} ms" if ms != "-" else "")
                + (f", pool {pool}" if pool != "-" else "") + (f" ({note})" if note else "")
                for name, pred, ms, pool, note in rows))
    if any_candidates:
        lines += _wrap(candidates_note())
    for note in device_notes(devices):
        lines.append("note:")
        lines += _wrap(note)
    for gp in report.graphs:
        if gp.checkpoint is not None and gp.checkpoint.tagged:
            lines.append(f"recomputed: {gp.name}: {recomputed_text(gp.checkpoint)}")
    for s in stats:
        if s.fallback:
            lines.append(f"fallback: {s.name}: {s.fallback}")
    for mp in report.plans:
        if not mp.graphs:
            lines.append(f"fallback: {mp.name}: no ATen graph was planned (the Dynamo graph runs as traced)")
    return "\n".join(lines) + "\n"
