"""Replaying a captured CUDA graph: the inputs copied into its static buffers, its outputs copied
out or lent in the pool's memory, and the liveness checks that let the next replay overwrite them.

A :class:`CapturedGraph` is what one capture left (``capture.py`` builds it): the graph, its
static inputs and outputs and how each is handed in and out. :meth:`CapturedGraph.replay` reads the
caller's inputs and writes the family's liveness records (``instances.GraphFamily``: the pending
saved activations, the owners of lent gradients). Which outputs are copied and which are lent:
docs/design/cuda-graphs.md#outputs-and-the-next-replay.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from .graph_io import Addresses, LentOutputs, OutputCopier
from .instances import GraphFamily

__all__ = ["CapturedGraph"]


@dataclass
class CapturedGraph:
    """One capture of a graph and how its replays take inputs and hand out outputs."""

    graph: Any  # torch.cuda.CUDAGraph, or what a test's capturer returns
    kind: str
    static_inputs: list
    static_outputs: list
    copy_idxs: list[int]  # inputs copied into the graph's buffers before each replay
    fixed_ptrs: dict[int, int]  # inputs read in place: their addresses at capture
    written_copied: list[int]  # inputs copied in that the graph writes: copied back after each replay
    output_is_input: dict[int, int]  # output -> the fixed input it is (returned as the caller's tensor)
    lent_idxs: list[int]  # outputs lent in the pool's memory
    copied_out_idxs: list[int]  # outputs copied out after each replay
    lent: LentOutputs | None
    sentinel_idx: int | None  # a saved activation handed out as a fresh alias whose liveness is tracked
    chosen: str  # the candidate runtime captured
    captured_shapes: tuple | None = None  # a graph with symbolic sizes replays at these only
    captured_bytes: int = 0  # allocated by the capture and held: its outputs
    family_pool_bytes: int | None = None
    peak_after_capture: int = 0
    donated: frozenset[int] = frozenset()  # data_ptrs of the saved activations a backward's capture took over
    donated_bytes: int = 0  # ... their bytes
    side_lane_donated_bytes: int = 0  # ... of which a side lane frees
    withheld_bytes: int = 0  # donatable, but not safe to free under this backward's lanes
    launch_host_s: float = 0.0  # host time of the launches alone
    copy_out: OutputCopier = field(init=False)
    fixed: Addresses = field(init=False)

    def __post_init__(self) -> None:
        self.copy_out = OutputCopier([self.static_outputs[j] for j in self.copied_out_idxs])
        self.fixed = Addresses(self.fixed_ptrs)

    def inputs_in_place(self, args: list) -> bool:
        """Whether every input captured in place is still at its captured address."""
        return self.fixed.hold(args)

    def replay(self, args: list, family: GraphFamily) -> list:
        """Copy the inputs in, replay, hand the outputs out; clears `args` (boxed convention)."""
        for i in self.copy_idxs:
            self.static_inputs[i].copy_(args[i])
        if self.kind == "forward":  # a user input's .grad is the backward's memory too (saliency, say)
            family.input_owners = [weakref.ref(args[i]) for i in self.copy_idxs if args[i].requires_grad]
        launch = time.perf_counter()
        self.graph.replay()
        self.launch_host_s += time.perf_counter() - launch
        if self.kind != "backward":
            family.replays += 1
        for i in self.written_copied:
            args[i].copy_(self.static_inputs[i])
        outs = list(self.static_outputs)
        for j, i in self.output_is_input.items():
            outs[j] = args[i]
        for j, fresh in zip(self.copied_out_idxs, self.copy_out([outs[j] for j in self.copied_out_idxs])):
            outs[j] = fresh
        if self.lent is not None:
            for j, alias in zip(self.lent_idxs, self.lent.lend([outs[j] for j in self.lent_idxs])):
                outs[j] = alias
        if self.sentinel_idx is not None:
            # the saved activations live and die together (one autograd context holds them all):
            # one fresh alias among them tells when the last forward's are released
            alias = outs[self.sentinel_idx].detach()
            outs[self.sentinel_idx] = alias
            if self.kind == "forward":
                family.pending = [weakref.ref(alias, family.instances.saved_died)]
        args.clear()
        return outs
