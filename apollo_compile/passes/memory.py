"""Memory pass: place every buffer that crosses a subgraph boundary in one arena.

Reads the :class:`~apollo_compile.lane_plan.LanePlan` and ``meta["val"]``; returns a
:class:`~apollo_compile.passes.memory_plan.MemoryPlan`. A buffer's lifetime runs from its
producing subgraph to the last of its consumers in happens-before order over the concurrent
schedule (``memory_plan`` explains why program order is not enough). Graph outputs are consumed
by a sink, ``"output"``, ordered after every subgraph, so they never share bytes with anything.
A buffer another lane reads is consumed by the sink too: the runtime holds such values until the
main lane has joined every side lane (``rt.keep_alive`` ... ``rt.release()``, see codegen), and
the plan describes that lifetime, not a shorter one the runtime does not keep.
"""

from __future__ import annotations

import torch
import torch.fx

from ..annotations import info
from ..lane_plan import LanePlan
from ..shapes import concrete_numel
from .memory_plan import Buffer, MemoryPlan, plan_memory

OUTPUT = "output"


def value_nbytes(node: torch.fx.Node) -> int:
    """Bytes a node's value owns on the device: 0 for views (they alias their base), non-tensors
    and the offload pass's copies to the host."""
    val = node.meta.get("val")
    target = getattr(node, "target", None)
    if isinstance(target, torch._ops.OpOverload) and target.is_view:
        return 0
    if info(node).transfer == "to host":
        return 0
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(concrete_numel(v) * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def buffers_of(plan: LanePlan) -> list[Buffer]:
    buffers = []
    for sg in plan.subgraphs:
        for n in sg.outputs:
            consumers = sorted({info(u).subgraph for u in n.users if info(u).subgraph not in (None, sg.id)})
            read_across = any(plan.lane_of(c) != sg.lane for c in consumers)
            if read_across or any(u.op == "output" for u in n.users):
                consumers.append(OUTPUT)
            buffers.append(Buffer(n.name, value_nbytes(n), sg.id, tuple(consumers), sg.lane))
    return buffers


def run(gm: torch.fx.GraphModule, ctx) -> MemoryPlan:
    plan: LanePlan = ctx.decisions["lanes"]
    dag = plan.dag.copy()
    dag.add_node(OUTPUT)
    dag.add_edges_from((sg.id, OUTPUT) for sg in plan.subgraphs)
    return plan_memory(dag, buffers_of(plan))
