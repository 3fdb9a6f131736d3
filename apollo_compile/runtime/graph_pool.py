"""The memory a CUDA graph lives in: its private pool, the allocator's segments and streams, the
storages a capture borrows, and when a capture is too close to the memory limit to try.

Helpers of the runner (``cudagraph.py``), which reads its NOTEs on donation for why the backward
takes over saved activations and why only on the stream that made them; NOTE: A capture needs
headroom is here, with the rule it explains.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from typing import Iterator, Sequence

import torch

log = logging.getLogger("apollo_compile")

__all__ = [
    "CAPTURE_HEADROOM", "allocating_in", "allocation_streams", "allocator_segments", "borrowed",
    "clear_cublas_workspaces", "donations_safe_on_lanes", "first_step_pool", "in_graph_pool", "memory_pressure",
    "pool_bytes", "release_cached_segments", "too_close_to_the_limit", "unowned",
]


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces, as CUDA-graph trees do around each capture
    (``torch._inductor.cudagraph_trees.clear_cublas_manager``).

    cuBLAS keeps one workspace per (handle, stream), allocated on first use and held for the
    process. Cleared before a capture, the workspaces the graph needs are allocated in the graph's
    own pool (not reused eager memory that could be handed out again); cleared after it, the pool
    holds them for the graph alone. Without this, each candidate's workspaces (its streams' own)
    stayed allocated after the candidate died: measuring left 0.23 and 0.32 GiB allocated for the
    forward and backward of a base CLIP at batch 64 on the H200 (``measuring_left_bytes``,
    session 5), whose capture step peaked 0.71 GiB above its first step (2.92 vs 2.21 GiB). That
    those bytes are all workspaces is inferred, not yet measured with the clearing in place."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def release_cached_segments() -> None:
    """Return the allocator's wholly free cached segments to the driver, once, before a family's
    first capture.

    [NOTE] The first, un-graphed step leaves its cache behind. A family's first call runs
    un-graphed in the default pool; its activations and temporaries are freed when it ends, and the
    allocator keeps their segments cached for later eager work. The graphs then allocate from their
    own pool, so what the first step cached serves only the optimizer's first step (whose state
    fills some of it) and stays reserved for the rest of training: apollo's default pool kept 0.31
    GiB (HF CLIP B/16) and 0.70 GiB (SigLIP base) free between steps at batch 8 on the H200, against
    reduce-overhead's 0.12 and 0.24, whose warm-up runs in its graph pool (RESULTS.md, session 28).
    Running the first call in the graph pool instead (branch wip/first-call-in-pool) made it worse:
    the pool kept the first call's blocks fragmented beside the captures, reserved 1.42x reduce-
    overhead's against 1.11x (session 29). Releasing what is wholly free before capturing lets the
    graph pool's segments come from the same memory; blocks still split around the optimizer's
    state stay cached (module-compiled HF CLIP B/16 at batch 8 still reserved 1.10x reduce-
    overhead's, session 41), hence NOTE: The first step in a pool of its own, whose memory this
    releases too. cuBLAS's workspaces, which the first step allocated and the capture would drop a
    moment later (:func:`clear_cublas_workspaces`), are dropped first, so that their segments go
    too."""
    torch.cuda.synchronize()
    clear_cublas_workspaces()
    torch.cuda.empty_cache()


# [NOTE] The first step in a pool of its own. The first, un-graphed step's activations, temporaries
# and gradients are allocated in a memory pool that serves that step alone (first_step_pool): the
# forward's first call opens it, the backward's first call runs in it too and closes it when it ends;
# any later call of the family closes it as well. A closed pool takes no new allocations; what the
# step left alive in it (gradients until zero_grad(set_to_none=True), a loss the user keeps) stays
# valid, and once freed its segments are returned to the driver by the next empty_cache
# (release_cached_segments, before the family's first capture) or by the allocator itself when an
# allocation would fail. So the optimizer's state, created by the first optimizer.step() after that
# step, is allocated in the default pool's fresh segments rather than among the first step's freed
# blocks, where it left them split and cached for the rest of training (NOTE: The first, un-graphed
# step leaves its cache behind). Unlike the first call in the graph pool (session 29, worse), nothing
# of that step shares a pool with the captures. Where this torch has no user memory pools
# (torch.cuda.MemPool, torch.cuda.use_mem_pool), the first step runs in the default pool as before.
#
# Which graphs open it (FIRST_STEP_POOL, the kinds whose first call does): a forward, whose family
# trains on the module path, where it takes reserved memory from 1.12x to 1.04x of reduce-overhead's
# (HF CLIP B/16, batch 8, H100, session 47, both orders). Not a whole step's one graph (an
# "inference" graph, compile_step): with the optimizer inside, its state is laid out before the
# first call (optimizer_step.InGraphAdam.prepare), so there is nothing to keep apart, and the
# pool changed no memory (SigLIP base, session 47); without it, the user's optimizer.step() makes
# the state after the first call as on the module path, but that case was not measured and keeps
# the default pool too. Its time: sessions 44 and 47 timed the pool's
# variants one after the other in one process and found the step 7-8% slower (module) and 3-6%
# (compile_step); session 48 found that order unreadable at that size (one variant ran 9.15 and
# 13.07 ms in two processes of one call, and whichever ran second in a process 15% slower with
# identical GPU kernels) and timed the module path interleaved in one process, with the default
# twice as a control (benchmarks/probes/interleaved_ab.py): the pool ran 0.985x the default's
# speed per round with the loss read every step and 1.008x back to back, within the control's own
# 1.048x and 1.033x. A whole step's first call opens it where "inference" is added (bench_whole_step
# variant apollo-step-opt-first-step-pool; `h200_session.sh first-step-pool-interleaved siglip`
# times it the same way, not yet run).

FIRST_STEP_POOL: frozenset[str] = frozenset({"forward"})  # NOTE: The first step in a pool of its own


def first_step_pool(device: torch.device | None, kind: str) -> tuple[object, torch.device] | None:
    """A new memory pool for a family's first, un-graphed step on `device`, opened by a graph of
    `kind` (NOTE: The first step in a pool of its own), with its device; None where that kind opens
    none (FIRST_STEP_POOL), off CUDA, or where this torch cannot make one."""
    if kind not in FIRST_STEP_POOL or device is None or device.type != "cuda" or not hasattr(torch.cuda, "MemPool") \
            or not hasattr(torch.cuda, "use_mem_pool"):
        return None
    try:
        with torch.cuda.device(device):
            return torch.cuda.MemPool(), device
    except Exception as e:  # an allocator without user pools (a custom one, say): the default pool, as before
        log.debug("apollo: the first step runs in the default memory pool: %s", e)
        return None


@contextlib.contextmanager
def allocating_in(pool: tuple[object, torch.device] | None) -> Iterator[None]:
    """Route this thread's allocations to `pool` (from :func:`first_step_pool`) while the block
    runs; with None, to wherever they went."""
    routing = None
    if pool is not None:
        try:
            routing = torch.cuda.use_mem_pool(pool[0], pool[1])
            routing.__enter__()
        except Exception as e:  # the step runs in the default pool, as it did before the pool
            log.debug("apollo: the first step runs in the default memory pool: %s", e)
            routing = None
    try:
        yield
    finally:
        if routing is not None:
            routing.__exit__(None, None, None)


def in_graph_pool(t: torch.Tensor) -> bool:
    """Whether `t`'s memory is a CUDA-graph pool's, which keeps freed bytes reserved for its
    graphs: only such memory is donated (cudagraph.py, NOTE: Donation). Tests on the CPU stand in
    for it."""
    return t.is_cuda


def borrowed(t: torch.Tensor, storage) -> torch.Tensor:
    """`t` (same dtype, offset, sizes, strides) over `storage` instead of its own."""
    with torch.no_grad():
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())


def unowned(storage):
    """A storage at `storage`'s address that does not own it: freeing it frees nothing (cudagraph.py,
    NOTE: Donation). CUDA-graph trees build their outputs' storages the same way."""
    return torch._C._construct_storage_from_data_pointer(storage.data_ptr(), storage.device, storage.nbytes())


def allocator_segments() -> list[dict] | None:
    """The caching allocator's segments (``torch.cuda.memory_snapshot``), or None where it cannot
    say (no CUDA)."""
    try:
        return torch.cuda.memory_snapshot()
    except (AttributeError, RuntimeError, AssertionError):
        return None


def pool_bytes(pool) -> int | None:
    """Bytes the caching allocator holds for the private pool `pool`: a captured graph's memory,
    temporaries included (a pool keeps every segment its capture needed), so the memory a
    candidate costs, which a replay's ``max_memory_allocated`` does not show. None where the
    allocator cannot say (no CUDA)."""
    segments = allocator_segments()
    if segments is None:
        return None
    key = tuple(pool) if isinstance(pool, (tuple, list)) else pool
    return sum(seg["total_size"] for seg in segments if tuple(seg.get("segment_pool_id") or ()) == key)


def allocation_streams(ptrs) -> dict[int, int]:
    """data_ptr -> the stream (handle) whose allocator segment holds it: the only stream that
    reuses its block once freed (cudagraph.py, NOTE: Donation on side lanes). Pointers the
    allocator cannot place, or all of them without CUDA, are left out."""
    spans = sorted((seg["address"], seg["address"] + seg["total_size"], seg["stream"])
                   for seg in allocator_segments() or ())
    starts = [start for start, _, _ in spans]
    out = {}
    for ptr in ptrs:
        k = bisect.bisect_right(starts, ptr) - 1
        if k >= 0 and ptr < spans[k][1]:
            out[ptr] = spans[k][2]
    return out


def donations_safe_on_lanes(donatable: dict[int, list[int]], made_on: dict[int, int],
                            lane_streams: dict[int, int], input_lanes: Sequence[frozenset[int]]
                            ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Of the saved activations a backward may take over (data_ptr -> its input positions), those
    safe to free under its side lanes (cudagraph.py, NOTE: Donation on side lanes), and per side
    lane the input positions it frees at their last reader. `made_on`: data_ptr -> the stream
    that allocated it; `lane_streams`: side lane -> its stream; `input_lanes`: per input, the
    lanes that read it."""
    if not lane_streams:
        return donatable, {}
    lane_of = {stream: lane for lane, stream in lane_streams.items()}
    safe: dict[int, list[int]] = {}
    local: dict[int, list[int]] = {}
    for ptr, idxs in donatable.items():
        if ptr not in made_on:
            continue
        lane = lane_of.get(made_on[ptr])
        if lane is None:
            safe[ptr] = idxs
        elif input_lanes and all(input_lanes[i] <= {lane} for i in idxs):
            safe[ptr] = idxs
            local.setdefault(lane, []).extend(idxs)
    return safe, local


# [NOTE] A capture needs headroom: it cannot release cached memory (eager code that runs out frees
# the allocator's cached segments and retries; a capture may not), and a graph pool's free blocks
# serve only its graphs. When a backward's capture runs out, its un-graphed fallback runs beside
# the forward's pool, with the saved activations it reads already handed over to the capture
# (cudagraph.py, NOTE: Donation): it cannot borrow the pool's free memory without risking them,
# and the step is lost. Then, once that step's saved activations are dead, the forward lets its
# graph go (`CudaGraphRunner._let_go`), so the pool can return to the allocator and later steps
# run as the first did (measured at 1152 with cudagraphs=True: step 2 lost, steps 3-5 at step
# 1's peak, session 11; benchmarks/probes/capture_recovery.py). Measured on the H200 (budgeted CLIP in 20 GiB; the first step's
# peak as a share of it, measured at 1024 and 1152, the others read off the line through them;
# RESULTS.md, sessions 7 and 10): batches 896 (~69%) and 960 (~74%) captured; 1024 (79%), 1088
# (~83%) and 1152 (88%) ran out capturing their backward, then in the fallback. The edge moves
# with the allocation order (1024 captured in session 7, before the lanes changed, and in a fresh
# process in session 11). So a family is not captured where its first step used more than
# CAPTURE_HEADROOM of the memory the process may hold, a little under the last share that fit: the
# un-graphed path it keeps is the one the first step already ran at that size. Graphs save little
# on large steps (batch 128: Inductor without them took 1.10x reduce-overhead's step, session 7).
# cudagraphs=True captures regardless.
CAPTURE_HEADROOM = 0.75


def memory_pressure() -> tuple[int, int] | None:
    """(this process's peak allocated bytes so far, the bytes it may hold) on the current device:
    the per-process fraction of the device, or what is free plus what the allocator already holds
    if less (other processes). None where the allocator cannot say. The peak counts since the last
    ``reset_peak_memory_stats``: work before training can only make it larger (more cautious)."""
    try:
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        fraction = torch.cuda.get_per_process_memory_fraction() if hasattr(
            torch.cuda, "get_per_process_memory_fraction") else 1.0
        return peak, int(min(total * fraction, free + torch.cuda.memory_reserved()))
    except (AttributeError, RuntimeError, AssertionError):
        return None


def too_close_to_the_limit(peak: int, limit: int, headroom: float = CAPTURE_HEADROOM) -> str | None:
    """Why a family is not captured at `peak` bytes of `limit` (NOTE: A capture needs headroom)."""
    if limit <= 0 or peak <= headroom * limit:
        return None
    return (f"its first step peaked at {peak / 2**30:.2f} GiB, {peak / limit:.0%} of the {limit / 2**30:.2f} GiB "
            f"this process may hold (over {headroom:.0%}): a capture cannot release cached memory, and near the "
            "limit it can run out where the un-graphed step fits; cudagraphs=True captures regardless")

