"""The pass pipeline, written down in one place. Reading this file tells the whole story.

Every ATen graph AOTAutograd hands us (forward, backward, or inference) goes through
``GRAPH_PASSES`` in order. Each pass is ``run(gm, ctx) -> decision``: it reads and writes
``node.meta["apollo"]`` and returns what it decided, which lands in ``ctx.decisions[name]``.
A failing pass is re-raised as :class:`PassError` naming it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx

from .devices import DeviceSpec
from .options import ApolloOptions
from .passes import casts, checkpoint, codegen, cost, gradients, lanes, memory, modality, offload, quotas

log = logging.getLogger("apollo_compile")

Pass = Callable[[torch.fx.GraphModule, "GraphContext"], Any]

# On the Dynamo graph (torch-level), before AOTAutograd: whatever is inserted here is traced
# through autograd, so gradients flow through it.
PRE_GRAD_PASSES: list[tuple[str, Pass]] = [
    ("casts", casts.run),        # mixed precision: compute-bound ops in bf16/fp16, sensitive ops fp32
]

# On the joint forward+backward graph, before the min-cut partitioner splits it.
JOINT_PASSES: list[tuple[str, Pass]] = [
    ("checkpoint", checkpoint.run),  # memory_budget: tag what the backward recomputes instead of saving
    ("offload", offload.mark),  # offload_activations: mark what the partition may keep on the host
]

# On each forward, backward or inference ATen graph.
GRAPH_PASSES: list[tuple[str, Pass]] = [
    ("gradients", gradients.run),  # whole step: a new .grad is the gradient itself, not a copy
    ("modality", modality.run),  # label every node by tower: vision, text, ..., fusion for joins
    ("saved", checkpoint.mark_saved),  # forward values handed to the backward (with a memory_budget)
    ("offload", offload.label),  # the copies of offloaded saved values, to the host and back
    ("cost", cost.run),          # FLOPs, bytes, compute/memory bound, roofline time per node
    ("lanes", lanes.run),        # concurrent subgraphs, one lane per independent branch
    ("quotas", quotas.run),      # candidate runtimes (one lane, lanes, SM quotas) the CUDA runner measures
    ("memory", memory.run),      # arena offsets from lifetimes over the concurrent schedule
    ("codegen", codegen.run),    # the readable Python runtime that launches the subgraphs
]


@dataclass
class GraphContext:
    name: str  # e.g. "frame0_0_forward": Dynamo frame/compile id and graph kind
    kind: str  # "forward" | "backward" | "inference"
    options: ApolloOptions
    device: DeviceSpec
    decisions: dict[str, Any] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)
    # backward only: the forward graph's labels by node name (saved values, recomputed ops)
    forward_modalities: dict[str, str] | None = None
    # backward only: the labels of the forward's inputs, in order (output i is input i's gradient)
    forward_inputs: list[str | None] | None = None


# Tests turn this on: after every pass, verify.verify() checks the invariants and a violation
# fails the pass that caused it.
VERIFY = False


class PassError(RuntimeError):
    def __init__(self, pass_name: str, graph: str, cause: BaseException) -> None:
        super().__init__(f"apollo pass '{pass_name}' failed on graph {graph}: {type(cause).__name__}: {cause}")
        self.pass_name = pass_name


def run_passes(gm: torch.fx.GraphModule, ctx: GraphContext, passes: list[tuple[str, Pass]] | None = None
               ) -> GraphContext:
    """Run `passes` (default: GRAPH_PASSES) in order, recording each decision in `ctx`."""
    for name, fn in GRAPH_PASSES if passes is None else passes:
        start = time.perf_counter()
        try:
            ctx.decisions[name] = fn(gm, ctx)
            if VERIFY and passes is None:
                from .verify import verify

                if errors := verify(gm, ctx.decisions):
                    raise AssertionError("invariants broken: " + "; ".join(errors[:5]))
        except Exception as e:
            raise PassError(name, ctx.name, e) from e
        ctx.timings_ms[name] = (time.perf_counter() - start) * 1e3
        log.debug("%s: pass %s (%.1f ms) decided: %s", ctx.name, name, ctx.timings_ms[name],
                  _describe(ctx.decisions[name]))
    return ctx


def _describe(decision: Any) -> Any:
    """A one-line view of a pass decision for the log."""
    summary = getattr(decision, "summary", None)
    if callable(summary):
        return summary()
    if hasattr(decision, "arena_bytes"):
        return {"arena_bytes": decision.arena_bytes, "total_bytes": decision.total_bytes}
    if hasattr(decision, "text"):
        return f"{len(decision.text.splitlines())} lines of runtime"
    return decision
