"""The report's data: the plans of one :func:`~apollo_compile.explain` call and what was measured.

:class:`ReportData` reads the plans the backend recorded (:mod:`apollo_compile.plan`) and holds
the measured subgraph times a caller attaches; it renders nothing. The text table, the HTML page
and the trace (:mod:`.text`, :mod:`.html_page`, :mod:`.trace`) import it, never the reverse, and
:class:`~apollo_compile.report.explain.Report` puts the data and its renderings together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..plan import GraphPlan, ModelPlan
from .stats import GraphStats, graph_stats

__all__ = ["GRAPH_KINDS", "ReportData"]

GRAPH_KINDS = ("forward", "backward", "inference")


@dataclass
class ReportData:
    """The plans of one :func:`~apollo_compile.explain` call, in the order they were made."""

    plans: list[ModelPlan]
    options: dict[str, Any] = field(default_factory=dict)
    ran_backward: bool = False
    fallback_warnings: list[str] = field(default_factory=list)
    measured: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    backward_from: str | None = None  # where explain() found the loss it ran the backward from

    @property
    def graphs(self) -> list[GraphPlan]:
        """Every planned ATen graph: per Dynamo graph, forward, backward, inference."""
        out = []
        for mp in self.plans:
            out += [mp.graphs[k] for k in GRAPH_KINDS if k in mp.graphs]
            out += [g for k, g in mp.graphs.items() if k not in GRAPH_KINDS]
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

        They are drawn under the predicted lanes in the HTML page and written as a second set of
        threads in the trace. Times are relative to the graph's start.
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

    def ran_text(self) -> str:
        """What explain() ran: "forward only" or "forward + backward (from output.loss)"."""
        if not self.ran_backward:
            return "forward only"
        return "forward + backward" + (f" (from {self.backward_from})" if self.backward_from else "")
