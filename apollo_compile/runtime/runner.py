"""Build the callable for one graph: compile its subgraphs, exec the generated runtime.

The program that runs is exactly ``RuntimeSource.text`` (dumped as ``*.runtime.py``): the runner
``exec``s it in a namespace holding the compiled subgraphs and the lane runtime ``rt``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx

from ..passes.codegen import RuntimeSource
from ..passes.lanes import LanePlan
from .streams import LaneRuntime
from .subgraphs import compile_subgraph, example_inputs, extract


def build_runtime(
    gm: torch.fx.GraphModule,
    plan: LanePlan,
    source: RuntimeSource,
    name: str,
    kind: str,
    compiler: str,
    device: torch.device,
) -> Callable[[list], list]:
    """A boxed callable (takes a list of inputs, clears it) that runs the graph's plan."""
    namespace: dict = {}
    for sg in plan.subgraphs:
        sub = extract(gm, sg)
        namespace[f"subgraph_{sg.id}"] = compile_subgraph(sub, example_inputs(sg), compiler, kind)
    recorded = sorted({op.subgraph for op in source.ops if op.kind in ("wait", "join")})
    namespace["rt"] = LaneRuntime(source.side_lanes, recorded, device)
    code = compile(source.text, f"<apollo runtime {name}>", "exec")
    exec(code, namespace)
    run = namespace["run"]
    run._boxed_call = True  # type: ignore[attr-defined]
    run.apollo_lanes = namespace["rt"]  # type: ignore[attr-defined]
    return run
