"""The memory a CUDA graph lives in: its private pool, the allocator's segments and streams, the
storages a capture borrows, and when a capture is too close to the memory limit to try.

Helpers of the runner's capture (``capture.py``) and calls (``cudagraph.py``). Why the backward
takes over saved activations, and only on the stream that made them, why the first step runs in
a pool of its own and why a capture needs headroom: docs/design/cuda-graphs.md.
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
    "near_the_limit", "pool_bytes", "release_cached_segments", "too_close_to_the_limit", "unowned",
]


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces, as CUDA-graph trees do around each capture
    (``torch._inductor.cudagraph_trees.clear_cublas_manager``).

    cuBLAS keeps one workspace per (handle, stream), allocated on first use and held for the
    process. Cleared before a capture, the workspaces the graph needs are allocated in the graph's
    own pool (not reused eager memory that could be handed out again); cleared after it, the pool
    holds them for the graph alone, and they die with a timed candidate instead of staying
    allocated (docs/design/cuda-graphs.md#choosing-by-timing)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def release_cached_segments() -> None:
    """Return the allocator's wholly free cached segments to the driver: before a family's first
    capture, so the graph pool's segments come from what the un-graphed first step cached
    (docs/design/cuda-graphs.md#the-first-step-pool), and after a failed capture, before the
    un-graphed retry (docs/design/cuda-graphs.md#a-failed-capture). cuBLAS's workspaces are
    dropped first, so that their segments go too."""
    torch.cuda.synchronize()
    clear_cublas_workspaces()
    torch.cuda.empty_cache()


# The kinds of graph whose first call opens the first step's own pool: a forward (the module path,
# where the optimizer's state is made after that step), not a whole step's one graph, whose state
# exists before its first call (docs/design/cuda-graphs.md#the-first-step-pool).
FIRST_STEP_POOL: frozenset[str] = frozenset({"forward"})


def first_step_pool(device: torch.device | None, kind: str) -> tuple[object, torch.device] | None:
    """A new memory pool for a family's first, un-graphed step on `device`, opened by a graph of
    `kind` (docs/design/cuda-graphs.md#the-first-step-pool), with its device; None where that kind opens
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
    graphs: only such memory is donated (docs/design/cuda-graphs.md#donation). Tests on the CPU
    stand in for it."""
    return t.is_cuda


def borrowed(t: torch.Tensor, storage) -> torch.Tensor:
    """`t` (same dtype, offset, sizes, strides) over `storage` instead of its own."""
    with torch.no_grad():
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())


def unowned(storage):
    """A storage at `storage`'s address that does not own it: freeing it frees nothing
    (docs/design/cuda-graphs.md#donation). CUDA-graph trees build their outputs' storages the same way."""
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
    reuses its block once freed (docs/design/cuda-graphs.md#donation-on-side-lanes). Pointers the
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
    safe to free under its side lanes (docs/design/cuda-graphs.md#donation-on-side-lanes), and per side
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


# A family is not captured where its first step used more than this share of the memory the process
# may hold: a capture cannot release cached memory, and near the limit it runs out where the
# un-graphed step fits (docs/design/cuda-graphs.md#capture-headroom; the batch search behind the
# share is in benchmarks/RESULTS.md).
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


def near_the_limit(peak: int, limit: int, headroom: float = CAPTURE_HEADROOM) -> str | None:
    """Where a first step's `peak` bytes pass `headroom` of `limit`, how far; else None."""
    if limit <= 0 or peak <= headroom * limit:
        return None
    return (f"its first step peaked at {peak / 2**30:.2f} GiB, {peak / limit:.0%} of the {limit / 2**30:.2f} GiB "
            f"this process may hold (over {headroom:.0%})")


def too_close_to_the_limit(peak: int, limit: int, headroom: float = CAPTURE_HEADROOM) -> str | None:
    """Why a family is not captured at `peak` bytes of `limit` (docs/design/cuda-graphs.md#capture-headroom)."""
    near = near_the_limit(peak, limit, headroom)
    if near is None:
        return None
    return (f"{near}: a capture cannot release cached memory, and near the limit it can run out where the "
            "un-graphed step fits; cudagraphs=True captures regardless")
