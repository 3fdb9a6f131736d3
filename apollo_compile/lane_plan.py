"""The plan's data model: what the passes decide and the runtime, performance model and report read.

- :class:`Subgraph`: a run of nodes one lane launches as one compiled unit, with its inputs and
  outputs (written by ``passes/lanes.py`` and ``passes/main_allocated.py``);
- :class:`LanePlan`: the subgraphs, their happens-before DAG and launch order (``passes/lanes.py``);
- :class:`Op` and :class:`RuntimeSource`: the program the codegen pass prints for a plan, which
  ``runtime/runner.py`` ``exec``s (``passes/codegen.py``);
- :data:`COMPUTE_OPS`: the FX node kinds that compute, and so belong to a subgraph.

This module imports no pass, so the floors below the passes (runtime, performance model) read the
plan without reaching up into ``passes/``. See docs/design/lanes.md for how the plan is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch.fx

from .annotations import info

__all__ = ["COMPUTE_OPS", "LanePlan", "Op", "RuntimeSource", "Subgraph"]

COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass
class Subgraph:
    id: int
    lane: int
    nodes: list[torch.fx.Node] = field(default_factory=list)
    # values from outside, first-use order, then the binders of symbols they leave unbound
    # (docs/design/lanes.md#symbols)
    inputs: list[torch.fx.Node] = field(default_factory=list)
    outputs: list[torch.fx.Node] = field(default_factory=list)  # values used outside, graph order
    # outputs written in place into buffers the main lane allocated (passes/main_allocated.py), in this order
    main_allocated: list[torch.fx.Node] = field(default_factory=list)
    allocate_after: int | None = None  # ... allocated right after this main-lane subgraph

    @property
    def est_us(self) -> float:
        return sum(info(n).est_us for n in self.nodes)


@dataclass
class LanePlan:
    lanes: dict[int, list[str]]  # lane -> modalities on it
    subgraphs: list[Subgraph]
    dag: nx.DiGraph  # subgraph id -> subgraph id: happens-before
    order: list[int]  # launch order: a topological order of `dag`
    reason: str = ""  # why this many lanes
    recomputed: dict = field(default_factory=dict)  # values recomputed where read, not handed across (passes/boundary.py)

    def lane_of(self, sg_id: int) -> int:
        return self.subgraphs[sg_id].lane

    def predicted_us(self) -> tuple[float, float]:
        """(serial sum, critical path through the DAG) from the cost labels."""
        serial = sum(sg.est_us for sg in self.subgraphs)
        finish: dict[int, float] = {}
        for sg_id in self.order:
            start = max((finish[p] for p in self.dag.predecessors(sg_id)), default=0.0)
            finish[sg_id] = start + self.subgraphs[sg_id].est_us
        return serial, max(finish.values(), default=0.0)

    def summary(self) -> dict:
        serial, critical = self.predicted_us()
        return {
            "lanes": {str(k): v for k, v in sorted(self.lanes.items())},
            "subgraphs": len(self.subgraphs),
            "cross_lane_edges": sum(self.lane_of(a) != self.lane_of(b) for a, b in self.dag.edges),
            "predicted_serial_us": round(serial, 1),
            "predicted_concurrent_us": round(critical, 1),
            "reason": self.reason,
            "recomputed_at_cuts": self.recomputed,
        }


@dataclass(frozen=True)
class Op:
    """One symbolic step of a generated runtime (``passes/codegen.py`` schedules, then prints them)."""
    kind: str  # "launch" | "wait" | "record" | "keep" | "join" | "release"
    lane: int
    subgraph: int | None = None
    names: tuple[str, ...] = ()  # launch: its outputs; keep: the values held
    last_read: tuple[str, ...] = ()  # launch: inputs read for the last time, handed over (docs/design/lanes.md#freeing)


@dataclass
class RuntimeSource:
    """A generated runtime: ``text`` is exactly the program the runner ``exec``s."""
    text: str
    ops: list[Op] = field(default_factory=list)
    side_lanes: list[int] = field(default_factory=list)
    waits: int = 0
    one_lane: "RuntimeSource | None" = None  # the same subgraphs on one stream, when there are lanes
    input_lanes: tuple[frozenset[int], ...] = ()  # per graph input: the lanes whose subgraphs read it
