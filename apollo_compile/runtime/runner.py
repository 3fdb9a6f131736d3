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
) -> dict[str, Callable[[list], list]]:
    """Boxed callables (take a list of inputs, clear it) that run the graph's plan: "lanes", and
    "one_lane" when the plan has side lanes. Both call the same compiled subgraphs."""
    compiled = {}
    for sg in plan.subgraphs:
        sub = extract(gm, sg)
        compiled[f"subgraph_{sg.id}"] = compile_subgraph(sub, example_inputs(sg), compiler, kind)
    runtimes = {"lanes": _load(source, compiled, name, device)}
    if source.one_lane is not None:
        runtimes["one_lane"] = _load(source.one_lane, compiled, f"{name} (one lane)", device)
    return runtimes


def _load(source: RuntimeSource, compiled: dict, name: str, device: torch.device) -> Callable[[list], list]:
    """exec the generated program in a namespace of compiled subgraphs and a lane runtime."""
    recorded = sorted({op.subgraph for op in source.ops if op.kind in ("wait", "join")})
    namespace = dict(compiled, rt=LaneRuntime(source.side_lanes, recorded, device))
    exec(compile(source.text, f"<apollo runtime {name}>", "exec"), namespace)
    run = namespace["run"]
    run._boxed_call = True  # type: ignore[attr-defined]
    return run
