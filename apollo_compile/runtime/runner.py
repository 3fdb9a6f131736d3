"""Build the callable for one graph: compile its subgraphs, exec the generated runtime.

The program that runs is exactly ``RuntimeSource.text`` (dumped as ``*.runtime.py``): the runner
``exec``s it in a namespace holding the compiled subgraphs and the lane runtime ``rt``.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.fx

from ..fallback import ApolloFallbackWarning
from ..lane_plan import LanePlan, RuntimeSource
from .first_call import WriteWatch, writes_state
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
    quotas: dict[str, dict[int, int]] | None = None,
    side_streams: dict[int, torch.cuda.Stream] | None = None,
    free_at_last_use: bool = False,
    watch: WriteWatch | None = None,
) -> dict[str, Callable[[list], list]]:
    """Boxed callables (take a list of inputs, clear it) that run the graph's plan: "lanes", and
    "one_lane" when the plan has side lanes, and one per SM-quota candidate in `quotas` (name ->
    lane -> SMs: the lane program with its side lanes on green-context streams). All call the same
    compiled subgraphs. `side_streams` (lane -> stream, filled as needed) is shared with the other
    graphs of the family, so a lane runs on the same stream in the forward and the backward.
    `free_at_last_use`: the subgraphs free each buffer at its last use (subgraphs.inductor_config).
    `watch`: told when a subgraph that writes state starts (first_call.WriteWatch)."""
    compiled = {}
    for sg in plan.subgraphs:
        sub = extract(gm, sg)
        fn = compile_subgraph(sub, example_inputs(sg), compiler, kind, free_at_last_use)
        if watch is not None and any(writes_state(n) for n in sg.nodes):
            fn = watch.watching(fn)
        compiled[f"subgraph_{sg.id}"] = fn
    runtimes = {"lanes": load_runtime(source, compiled, name, device, shared_streams=side_streams)}
    if source.one_lane is not None:
        runtimes["one_lane"] = load_runtime(source.one_lane, compiled, f"{name} (one lane)", device)
    for candidate, lane_sms in (quotas or {}).items():
        try:
            runtimes[candidate] = load_runtime(source, compiled, f"{name} ({candidate})", device, lane_sms)
        except Exception as e:  # a green context the driver refuses: that candidate is not measured
            warnings.warn(f"apollo: {name} is measured without candidate {candidate}: {type(e).__name__}: {e}",
                          ApolloFallbackWarning, stacklevel=2)
    return runtimes


def load_runtime(source: RuntimeSource, compiled: dict, name: str, device: torch.device,
          quotas: dict[int, int] | None = None,
          shared_streams: dict[int, torch.cuda.Stream] | None = None) -> Callable[[list], list]:
    """exec the generated program in a namespace of compiled subgraphs and a lane runtime: the
    boxed callable that runs it (tests load a program with stand-in subgraphs through it)."""
    recorded = sorted({op.subgraph for op in source.ops if op.kind in ("wait", "join")})
    namespace = dict(compiled, rt=LaneRuntime(source.side_lanes, recorded, device, quotas, shared_streams))
    exec(compile(source.text, f"<apollo runtime {name}>", "exec"), namespace)
    program, rt = namespace["run"], namespace["rt"]

    def run(args: list) -> list:
        try:
            return program(args)
        except BaseException:
            rt.abandon()  # join the lanes, drop what the failed run held across them
            raise

    run._boxed_call = True  # type: ignore[attr-defined]
    run.lane_runtime = rt  # type: ignore[attr-defined]
    run.input_lanes = source.input_lanes  # type: ignore[attr-defined]
    return run
