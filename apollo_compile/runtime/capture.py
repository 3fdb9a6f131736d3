"""Capturing a graph's runtime as a CUDA graph: its static inputs, the saved activations a
backward takes over (donation), the capture itself into the family's pool, and the
:class:`Capturer` seam that does the capturing and timing.

:func:`static_inputs` reads the caller's inputs and makes the graph's own (parameters and saved
activations aliased in place, the rest copied into buffers); the capture runs on a copy of that
list, never on the caller's, so a capture that raises leaves the caller's inputs for the
un-graphed retry. :func:`capture_graph` captures the chosen candidate and returns the
:class:`replay.CapturedGraph`; it writes the family (the owners of the forward's outputs, the
lent gradients, where its saved outputs live). Why the forward's outputs are owned by the family
and what a backward takes over: docs/design/cuda-graphs.md#donation and
docs/design/cuda-graphs.md#donation-on-side-lanes.

A :class:`Capturer` captures a runtime into a pool and times a captured graph's replays;
:class:`CudaCapture` is the real one. A runner uses its config's capturer, else the one
:func:`in_effect` (``with using(capturer):``, else :data:`DEFAULT`): tests give a fake one (the
CPU has no CUDA graphs) or one that raises, to check that a failed capture loses no step.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .config import Capturer, RunnerConfig
from .graph_io import LentOutputs, is_non_overlapping
from .graph_pool import (allocation_streams, borrowed, clear_cublas_workspaces, donations_safe_on_lanes, in_graph_pool,
                         pool_bytes, unowned)
from .instances import GraphFamily
from .process_wide import ProcessWide
from .replay import CapturedGraph

__all__ = ["Capturer", "CudaCapture", "DEFAULT", "Donation", "StaticInputs", "capture_graph", "donatable",
           "donating_inputs", "in_effect", "static_inputs", "using"]

log = logging.getLogger("apollo_compile")


class CudaCapture:
    """The real capture: ``torch.cuda.graph`` into the pool, with cuBLAS's workspaces cleared
    before and after (graph_pool.clear_cublas_workspaces), and CUDA events to time replays."""

    def capture(self, fn: Callable[[list], list], inputs: list, pool: Any, name: str,
                written_state: Sequence[torch.Tensor] = ()) -> tuple[Any, list]:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        clear_cublas_workspaces()  # the workspaces the capture needs are allocated in `pool`
        try:
            with torch.cuda.graph(graph, pool=pool):  # a runtime that raises joins its lanes first (abandon)
                outputs = fn(inputs)
        finally:
            clear_cublas_workspaces()  # ... and stay the graph's: later eager matmuls get their own
        return graph, outputs

    def time(self, graph: Any, replays: int) -> float:
        graph.replay()  # the first replay pays one-time costs (lazy module loads, page faults)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / replays


DEFAULT: Capturer = CudaCapture()
_capturers: ProcessWide[Capturer] = ProcessWide()


def in_effect() -> Capturer:
    """The capturer a runner whose config names none uses: the innermost :func:`using`'s, else
    :data:`DEFAULT`."""
    return _capturers.innermost(DEFAULT)


def using(capturer: Capturer) -> contextlib.AbstractContextManager[Capturer]:
    """Runners without a capturer of their own capture and time with `capturer` inside this block,
    on every thread."""
    return _capturers.using(capturer)


@dataclass
class StaticInputs:
    """The graph's own inputs: `values` (aliases of what is read in place, buffers for the rest),
    the positions copied in before each replay, and the addresses of those read in place."""

    values: list
    copy_idxs: list[int]
    fixed_ptrs: dict[int, int]


def static_inputs(args: Sequence, config: RunnerConfig, family: GraphFamily) -> StaticInputs:
    """Parameters (`config.static_input_idxs`) and the forward's saved outputs are read in place,
    through fresh aliases (holding the caller's own tensors would keep the saved activations'
    aliases alive); other tensors are copied into buffers of the same layout."""
    values, copy_idxs, fixed_ptrs = [], [], {}
    for i, x in enumerate(args):
        if not isinstance(x, torch.Tensor):
            values.append(x)
        elif i in config.static_input_idxs or x.data_ptr() in family.saved_ptrs:
            values.append(x.detach())
            fixed_ptrs[i] = x.data_ptr()
        else:
            if not is_non_overlapping(x):
                raise RuntimeError(f"input {i} overlaps itself (stride {tuple(x.stride())})")
            buf = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
            buf.copy_(x)
            values.append(buf)
            copy_idxs.append(i)
    return StaticInputs(values, copy_idxs, fixed_ptrs)


def donatable(static: StaticInputs, config: RunnerConfig, family: GraphFamily) -> dict[int, list[int]]:
    """The family-owned storages a backward may take over (every input of ours reading one is
    donated), each with the positions of those inputs."""
    if config.kind != "backward" or not config.donated_idxs or not family.owners:
        return {}
    readers: dict[int, list[int]] = {}
    for i in static.fixed_ptrs:
        readers.setdefault(static.values[i].untyped_storage().data_ptr(), []).append(i)
    return {ptr: idxs for ptr, idxs in readers.items()
            if ptr in family.owners and all(i in config.donated_idxs for i in idxs)}


@dataclass
class Donation:
    """The list a backward's final capture runs on, and what it took over."""

    inputs: list
    donated: set[int]  # data_ptrs of the saved activations whose memory the capture takes over
    local: dict[int, list[int]]  # side lane -> the input positions it frees at their last reader
    donated_bytes: int = 0
    side_lane_donated_bytes: int = 0
    withheld_bytes: int = 0  # donatable, but not safe to free under the runtime's lanes


def donating_inputs(static: StaticInputs, config: RunnerConfig, family: GraphFamily, fn: Callable,
                    made_on: Callable[[Sequence[int]], dict[int, int]] = allocation_streams) -> Donation:
    """The static inputs, except that a backward gets the owners of the saved activations it may
    reuse (:func:`donatable`, as far as the side lanes of `fn`, the chosen runtime, allow), which
    the family then lets go of. `made_on`: data_ptr -> the stream that allocated it (the
    allocator's segments; a seam for tests without CUDA)."""
    inputs = list(static.values)
    out = Donation(inputs, set(), {})
    candidates = donatable(static, config, family)
    rt = getattr(fn, "lane_runtime", None)
    lane_streams = {lane: s.cuda_stream for lane, s in rt.streams.items()} if rt is not None else {}
    safe, out.local = candidates, {}
    if lane_streams and candidates:
        safe, out.local = donations_safe_on_lanes(candidates, made_on(candidates), lane_streams,
                                                  getattr(fn, "input_lanes", ()))
    freed_on_side_lanes = {i for idxs in out.local.values() for i in idxs}
    for ptr, idxs in candidates.items():
        if ptr not in safe:
            out.withheld_bytes += family.owners[ptr].nbytes()
            continue
        owner = family.owners.pop(ptr)
        for i in idxs:
            inputs[i] = borrowed(static.values[i], owner)
        out.donated_bytes += owner.nbytes()
        if freed_on_side_lanes.intersection(idxs):
            out.side_lane_donated_bytes += owner.nbytes()
        out.donated.add(ptr)
    return out


def _borrow_outputs(outputs: list, output_is_input: dict[int, int], inputs: set[int], family: GraphFamily) -> None:
    """Hand the ownership of the forward's outputs in the pool to the family; the static outputs
    (and so every alias a replay hands out) borrow their memory. `inputs`: the static inputs'
    storage data_ptrs (an output on one is not the pool's)."""
    views: dict[int, Any] = {}
    for j, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor) or not in_graph_pool(o) or j in output_is_input:
            continue
        storage = o.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in inputs:  # empty, or a view of an input: not the pool's
            continue
        if ptr not in views:
            family.owners[ptr] = storage
            views[ptr] = unowned(storage)
        outputs[j] = borrowed(o, views[ptr])


def capture_graph(fn: Callable, chosen: str, args: Sequence, static: StaticInputs, config: RunnerConfig,
                  family: GraphFamily, capturer: Capturer) -> CapturedGraph:
    """Capture `fn` (the candidate `chosen`) into the family's pool, on a copy of the static
    inputs (a backward's holding the owners it takes over), and lay out its replays. The family is
    written only once the capture returned, except for the donated owners, which the capture's
    list held alone (a failed capture recorded nothing: the saved activations' bytes are as the
    forward left them, in the pool the forward's graph keeps)."""
    if family.pool is None:
        family.pool = torch.cuda.graph_pool_handle()
    allocated_before = torch.cuda.memory_allocated()
    donation = donating_inputs(static, config, family, fn)
    rt = getattr(fn, "lane_runtime", None)
    if donation.local:  # only weak references: the list stays the inputs' one holder
        rt.free_at_last_reader({lane: [donation.inputs[i] for i in idxs] for lane, idxs in donation.local.items()})
    written = config.written_state() if config.written_state is not None else []
    try:
        graph, outputs = capturer.capture(fn, donation.inputs, family.pool, f"{config.name} ({chosen})", written)
    finally:
        if donation.local:
            rt.free_at_last_reader({})
    captured_bytes = torch.cuda.memory_allocated() - allocated_before
    static_outputs = list(outputs)
    del outputs
    # an output that *is* a fixed input (a parameter saved for backward) is returned as the caller's own tensor
    ids = {id(x): i for i, x in enumerate(static.values) if i in static.fixed_ptrs}
    output_is_input = {j: ids[id(o)] for j, o in enumerate(static_outputs) if id(o) in ids}
    input_ptrs = {x.untyped_storage().data_ptr() for x in static.values if isinstance(x, torch.Tensor)}
    if config.kind == "forward":
        _borrow_outputs(static_outputs, output_is_input, input_ptrs, family)
    tensors = [j for j, o in enumerate(static_outputs) if isinstance(o, torch.Tensor) and j not in output_is_input]
    user_visible = [j for j in tensors if config.is_user_visible(j)]
    # a backward's gradients are lent (cuda-graphs.md#outputs-and-the-next-replay); an output sharing
    # memory with an input still read (a static buffer the next call refills) is copied; one placed
    # over a donated saved activation is lent: the next forward replay reclaims it
    still_read = input_ptrs - donation.donated
    lent_idxs = [j for j in user_visible if (config.kind == "backward" or j in config.lent_outputs)
                 and static_outputs[j].untyped_storage().data_ptr() not in still_read]
    saved = [j for j in tensors if not config.is_user_visible(j)]
    lent = LentOutputs([static_outputs[j] for j in lent_idxs]) if lent_idxs else None
    captured = CapturedGraph(
        graph, config.kind, static.values, static_outputs, static.copy_idxs, static.fixed_ptrs,
        written_copied=[i for i in static.copy_idxs if i in config.written_idxs], output_is_input=output_is_input,
        lent_idxs=lent_idxs, copied_out_idxs=[j for j in user_visible if j not in set(lent_idxs)], lent=lent,
        sentinel_idx=saved[0] if saved else None, chosen=chosen, captured_bytes=captured_bytes,
        family_pool_bytes=pool_bytes(family.pool), peak_after_capture=torch.cuda.max_memory_allocated(),
        donated=frozenset(donation.donated), donated_bytes=donation.donated_bytes,
        side_lane_donated_bytes=donation.side_lane_donated_bytes,
        withheld_bytes=donation.withheld_bytes)
    if lent is not None:
        family.lent = lent
    if config.kind == "forward":
        family.saved_ptrs = {o.data_ptr() for o in static_outputs if isinstance(o, torch.Tensor)}
    if config.kind == "forward" or config.lent_outputs:  # the parameters whose .grad they become
        family.grad_owners = [weakref.ref(args[i]) for i in sorted(static.fixed_ptrs)
                              if i in config.static_input_idxs and args[i].requires_grad]
    if config.kind != "backward":  # the instance whose parameters it reads
        family.instances.bind(family, args, config.static_input_idxs)
    if config.kind == "forward":  # where its backward's saved inputs will be, in this family alone
        family.instances.captured(family, [static_outputs[j] for j in saved])
    log.info("apollo: captured %s as a CUDA graph, runtime %r (%d inputs copied, %d used in place)",
             config.name, chosen, len(static.copy_idxs), len(static.fixed_ptrs))
    return captured
