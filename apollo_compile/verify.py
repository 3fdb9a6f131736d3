"""Invariants every pass keeps; checked after each pass of every stage when ``pipeline.VERIFY`` is on (tests).

:func:`verify` returns the list of violations (empty when the graph is sound), so a test can
also check that a deliberately broken pass is caught.

- after every pass of every stage: the graph is well formed (``torch.fx.Graph.lint``);
- after ``modality``: every node has a modality label;
- after ``cost``: every node has a bound in {"compute", "memory", "-"} and non-negative costs;
- after ``lanes``: every compute node is in exactly one subgraph, no subgraph is empty (codegen
  would launch it and another lane wait for it), subgraph inputs come from placeholders or
  earlier subgraphs, and the subgraph DAG is acyclic and ordered by ``order``;
- after ``memory``: buffers that may be live at the same time never share bytes.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import torch.fx

from .annotations import KEY, info
from .lane_plan import COMPUTE_OPS


def verify(gm: torch.fx.GraphModule, decisions: dict[str, Any]) -> list[str]:
    errors: list[str] = []
    try:
        gm.graph.lint()
    except Exception as e:
        errors.append(f"graph: {type(e).__name__}: {e}")
    nodes = list(gm.graph.nodes)
    if "modality" in decisions:
        errors += [f"{n.name}: no modality" for n in nodes if KEY not in n.meta or info(n).modality is None]
    if "cost" in decisions:
        for n in nodes:
            a = info(n)
            if a.bound not in ("compute", "memory", "-") or a.flops < 0 or a.bytes < 0 or a.est_us < 0:
                errors.append(f"{n.name}: bad cost {a.bound}/{a.flops}/{a.bytes}/{a.est_us}")
    plan = decisions.get("lanes")
    if plan is not None:
        errors += _check_lanes(nodes, plan)
    memory = decisions.get("memory")
    if memory is not None and plan is not None:
        from .passes.memory import OUTPUT
        from .passes.memory_plan import check_plan

        dag = plan.dag.copy()
        dag.add_edges_from((sg.id, OUTPUT) for sg in plan.subgraphs)
        errors += [f"memory: {e}" for e in check_plan(memory, dag)]
    return errors


def _check_lanes(nodes: list[torch.fx.Node], plan) -> list[str]:
    errors = []
    members: dict[torch.fx.Node, int] = {}
    for sg in plan.subgraphs:
        if not sg.nodes:
            errors.append(f"subgraph {sg.id}: no nodes")
        for n in sg.nodes:
            if n in members:
                errors.append(f"{n.name}: in subgraphs {members[n]} and {sg.id}")
            members[n] = sg.id
            if info(n).subgraph != sg.id or info(n).lane != sg.lane:
                errors.append(f"{n.name}: annotation says {info(n).lane}/{info(n).subgraph}, plan {sg.lane}/{sg.id}")
    errors += [f"{n.name}: in no subgraph" for n in nodes if n.op in COMPUTE_OPS and n not in members]
    if not nx.is_directed_acyclic_graph(plan.dag):
        errors.append("subgraph DAG has a cycle")
        return errors
    pos = {sg_id: i for i, sg_id in enumerate(plan.order)}
    if sorted(pos) != sorted(sg.id for sg in plan.subgraphs):
        errors.append("launch order does not list every subgraph once")
        return errors
    errors += [f"edge {a}->{b} against launch order" for a, b in plan.dag.edges if pos[a] >= pos[b]]
    for sg in plan.subgraphs:
        for n in sg.inputs:
            src = members.get(n)
            if src is None:
                if n.op in COMPUTE_OPS:
                    errors.append(f"subgraph {sg.id}: input {n.name} is made by no subgraph")
            elif src == sg.id or not nx.has_path(plan.dag, src, sg.id):
                errors.append(f"subgraph {sg.id}: input {n.name} from subgraph {src} is not ordered before it")
    return errors
