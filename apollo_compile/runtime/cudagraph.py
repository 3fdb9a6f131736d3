"""Replay a graph's whole runtime — every lane — as one CUDA graph.

The forward and backward of one Dynamo graph share a :class:`GraphFamily`: one memory pool (so
the backward reuses the forward's freed intermediates, as ``make_graphed_callables`` does) and
the forward's saved outputs, which the backward reads in place instead of copying.

Call 1 runs the runtime eagerly (Inductor/Triton compile their kernels lazily, which must not
happen under capture); call 2 captures and replays; later calls replay. Inputs the graph was
told are static (parameters) and the forward's saved outputs are used in place; other inputs are
copied into static buffers.

[NOTE] Outputs and the next replay::

    fw replay 1 ─► saved acts A (pool)      bw 1 reads A            fw replay 2 overwrites A
                   loss L (pool) ─clone─► user keeps L               the user's L is a clone: safe
    bw replay 1 ─► grads G (pool) ─lent─► AccumulateGrad keeps G     replay 2 (fw or bw): G still held?
                                                                     yes: G's holder moves to a copy

The forward's user-visible outputs (the loss) are copied out: a user keeps ``loss`` across the
next forward call as a matter of course, and they are small. The backward's gradients are *lent*:
handed out in the pool's own memory as fresh aliases that AccumulateGrad can steal as ``.grad``
(a copy would hold every gradient twice: 0.56 GiB and 0.3 ms a step for the benchmark model).
Before any replay of the family (the forward's temporaries share the pool with them too), the
lent storages' use counts are compared with their counts at capture, as CUDA-graph trees check
their outputs' liveness. Dropped (``zero_grad(set_to_none=True)``): nothing to do. Held as the
``.grad`` of a parameter or of an input that requires grad (gradient accumulation,
``set_to_none=False``, saliency maps), or as the alias we lent (``torch.autograd.grad``'s
results): that tensor is moved to a copy first (``t.data = t.clone()``), the cost the copy-out
used to pay every step. Held through anything else (a view of a ``.grad``): that call runs
without the CUDA graph, so nothing is overwritten.

Saved activations are returned in place, one of them as a fresh alias whose liveness we track
(they are all held by one autograd context): if the previous forward's is still alive when the
forward runs again (two forwards before one backward, ``retain_graph=True``), that call runs
without the CUDA graph, so nothing the pending backward needs is overwritten. A backward whose
saved inputs are not where the captured one read them runs without the CUDA graph too. A graph
with symbolic sizes (``dynamic=True``, or Dynamo's automatic dynamic shapes after a second batch
size) is captured at the shapes of its second call; a call at other shapes runs without the
CUDA graph (`input_shapes`): the captured kernels and static buffers hold the captured sizes.
A graph with CPU tensor inputs (a Python float Dynamo has seen change) is not captured at all
(`host_values`). Every such path is correct and warns once.

[NOTE] Donation: the backward reuses its saved activations' memory::

    fw capture ─► saved act A in the pool, owned by family.owners; static outputs borrow A
    bw capture ─► A's owner goes into the capture's input list only: freed at A's last reader,
                  so the backward's later temporaries and gradients are placed over A
    replays    ─► fw writes A, bw reads A then overwrites it; the next fw writes A again

Inside a CUDA graph nothing is freed during a replay: the capture decides where everything
lives. Captured with the family's owners of the saved activations alive, the backward held every
one of them to its end beside its own temporaries: on the H200 (base CLIP, batch 64, budgets 0.4
and 0.5) the capture step set the whole-run peak, 0.8-0.9 GiB above the un-graphed first step,
which frees each at its last reader; with donation it stays at the first step's (RESULTS.md,
session 6: 0.31x and 0.35x of eager fp32 instead of 0.39x and 0.44x). So the forward's outputs are owned by the family
alone (the runner's static outputs, and every alias handed to autograd, borrow their memory:
non-owning storages at the same address, as CUDA-graph trees reconstruct their outputs), and the
backward's capture takes the owners of the saved activations AOTAutograd lists as donated
(``bw_donated_idxs``: saved for backward only, aliasing no input or output) into the list it
runs on, whose boxed subgraphs free each input after its last use. The allocator hands the bytes
to what the capture allocates next in the same pool *and stream*: a backward on one lane reuses
what a forward on one lane saved; a side lane holds what it reads from the main lane to the join
(codegen's NOTE: Freeing across lanes). So under a memory budget both graphs replay one lane
(`_memory_first_one_lane`; H200, batch 64, budget 0.5: 3.72 instead of 4.55 GiB reserved, the
step 28.45 instead of 27.96 ms). Without a budget time decides; a two-lane backward after a
two-lane forward reused little while both towers ran on side lanes (batch 128: the family's pool
13.1 GB against 11.6 for one lane), hence the costliest tower runs on the main lane in both graphs
(lanes.py, NOTE: The costliest branch runs on the caller's stream; batch 128: 12.2 against 11.6).

[NOTE] Donation on side lanes::

    fw lane 1 (stream S1) ─► text act T       bw lane 1 (S1) reads T, frees it: S1 reuses it
    fw lane 1 (stream S1) ─► text act U       bw lane 0 reads U: not donated (see below)

The forward and backward of a family run each side lane on the same stream (``side_streams``),
so the backward's side lane can take over what the forward's same lane saved: the backward's
capture looks up which stream made each donated activation (the allocator's segments,
`allocation_streams`) and `donations_safe_on_lanes` decides. Made on the capture stream, or on a
stream this backward does not allocate on: donated as above. Made on side lane k's stream and read
only on lane k: donated, and lane k frees it at its last reader instead of holding it to the join
(``LaneRuntime.free_at_last_reader``). Made on lane k's stream but read on another lane: not
donated; the block would go back to stream k, whose next allocation could overwrite it while the
other lane still reads it. Unknown stream: not donated. The un-graphed path runs one lane, so
this only ever concerns a capture.

A donated saved activation is read once: AOTAutograd already refuses a second backward through a
graph compiled with donated buffers (``retain_graph=True``), and compiles none when the first
backward retains the graph. A gradient placed over a saved activation is lent like any other:
the forward's replay moves a held one out first (NOTE above). Only CUDA memory is donated: the
pool keeps the freed bytes reserved for the graph; on the CPU (fake graphs in tests) they would
go back to the heap.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
import warnings
import weakref
from typing import Callable, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..fallback import ApolloFallbackWarning

log = logging.getLogger("apollo_compile")


def is_non_overlapping(x: torch.Tensor) -> bool:
    """No two elements share memory (gaps allowed), so copy_ into an empty_strided twin works."""
    reach = 0  # elements spanned by the dims seen so far, smallest stride first
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.size()) if sz != 1):
        if stride <= reach:
            return False
        reach = stride * (size - 1) + reach
    return True


class OutputCopier:
    """Copies of a fixed list of tensors (a graph's static outputs) in new memory, same sizes and
    strides, planned once.

    Used for what a graph hands out that the next replay would overwrite and that is not lent
    (the NOTE above): a forward's user-visible outputs, all outputs of an inference graph. There
    may be many, and at small batches a step is bound by the host (profile_step.py: 7.9 ms to issue
    an 8.2 ms step at batch 8), so the contiguous ones of each dtype are copied by one ``cat`` into
    one allocation and handed out as views made in C++ (``_flatten/_unflatten_dense_tensors``): no
    Python work per tensor. The views keep the shared allocation alive until the last of them
    dies. Other layouts are cloned one by one (``clone`` keeps a dense layout's strides)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        groups: dict[tuple, list[int]] = {}
        self.singles: list[int] = []
        for k, t in enumerate(tensors):
            if t.is_contiguous():
                groups.setdefault((t.dtype, t.device), []).append(k)
            else:
                self.singles.append(k)
        for ks in list(groups.values()):
            if len(ks) == 1:  # flattening one tensor returns a view of it, not a copy
                self.singles += ks
        self.groups = [ks for ks in groups.values() if len(ks) > 1]

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = list(tensors)
        for k in self.singles:
            out[k] = tensors[k].clone()
        for ks in self.groups:
            src = [tensors[k] for k in ks]
            for k, view in zip(ks, _unflatten_dense_tensors(_flatten_dense_tensors(src), src)):
                out[k] = view
        return out


def fastest(measured_ms: dict[str, float], min_gain: float, pool_bytes: dict[str, int | None] | None = None,
            max_memory_ratio: float | None = None, base_bytes: int = 0) -> str:
    """The candidate to replay: the fastest, unless it beats the one-stream schedule by less than
    `min_gain`. Concurrency that does not pay still costs memory (both towers' temporaries live
    at once: the two-lane capture set the whole-run peak of a budgeted batch-64 step on the H200,
    1.11x the one-stream call's, for a backward 0.01% faster than one lane).

    With `pool_bytes` (each candidate's capture pool) and `max_memory_ratio`, a candidate whose
    peak (`base_bytes`, what was allocated beside the graph, plus its pool) exceeds the one-stream
    candidate's by more than that ratio is not replayed, however fast: multi-lane peak memory must
    stay within 1.1x of one lane's (issue 3). Pools alone overstated it: the lanes' backward pool
    of a budgeted batch-64 step was 1.21x one lane's, its step peak 1.07x (RESULTS.md, session 6).
    A candidate whose pool is unknown is judged on time alone."""
    if max_memory_ratio is not None and pool_bytes and pool_bytes.get("one_lane"):
        limit = (base_bytes + pool_bytes["one_lane"]) * max_memory_ratio - base_bytes
        measured_ms = {k: v for k, v in measured_ms.items()
                       if k == "one_lane" or pool_bytes.get(k) is None or pool_bytes[k] <= limit}
    best = min(measured_ms, key=measured_ms.get)
    single = measured_ms.get("one_lane")
    if single is not None and measured_ms[best] > single * (1 - min_gain):
        return "one_lane"
    return best


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


def in_graph_pool(t: torch.Tensor) -> bool:
    """Whether `t`'s memory is a CUDA-graph pool's, which keeps freed bytes reserved for its
    graphs: only such memory is donated (NOTE: Donation). Tests on the CPU stand in for it."""
    return t.is_cuda


def borrowed(t: torch.Tensor, storage) -> torch.Tensor:
    """`t` (same dtype, offset, sizes, strides) over `storage` instead of its own."""
    with torch.no_grad():
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())


def unowned(storage):
    """A storage at `storage`'s address that does not own it: freeing it frees nothing (NOTE:
    Donation). CUDA-graph trees build their outputs' storages the same way."""
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
    reuses its block once freed (NOTE: Donation on side lanes). Pointers the allocator cannot
    place, or all of them without CUDA, are left out."""
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
    safe to free under its side lanes (NOTE: Donation on side lanes), and per side lane the input
    positions it frees at their last reader. `made_on`: data_ptr -> the stream that allocated it;
    `lane_streams`: side lane -> its stream; `input_lanes`: per input, the lanes that read it."""
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
# (NOTE: Donation): it cannot borrow the pool's free memory without risking them, and the step is
# lost. Then, once that step's saved activations are dead, the forward lets its graph go
# (`_let_go`), so the pool can return to the allocator and later steps run as the first did
# (measured at 1152 with cudagraphs=True: step 2 lost, steps 3-5 at step 1's peak, session 11;
# benchmarks/capture_recovery.py). Measured on the H200 (budgeted CLIP in 20 GiB; the first step's
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


class GraphFamily:
    """State shared by the CUDA graphs of one Dynamo graph (forward + backward)."""

    def __init__(self) -> None:
        self.pool = None
        self.saved_ptrs: set[int] = set()  # data_ptrs of the forward's captured outputs
        self.pending: list[weakref.ref] = []  # aliases handed out by the last forward replay
        self.lent: LentOutputs | None = None  # the backward's gradients, handed out in the pool
        self.grad_owners: list[weakref.ref] = []  # the forward's parameters, whose .grad they become
        self.input_owners: list[weakref.ref] = []  # the last forward replay's inputs that require grad
        self.owners: dict[int, torch.UntypedStorage] = {}  # data_ptr -> the forward's outputs' memory (NOTE: Donation)
        self.backward_donates = False  # the backward may reuse saved activations (set when it is compiled)
        self.forward_chosen: str | None = None  # the candidate the forward replays, once captured
        self.capture_refused: str | None = None  # why the forward was not captured (NOTE: A capture needs headroom)
        self.backward_capture_failed: str | None = None  # why; the forward then lets its graph go (`_let_go`)
        # side lane -> its stream, the same in every graph of the family (NOTE: Donation on side lanes)
        self.side_streams: dict[int, torch.cuda.Stream] = {}

    def forward_outputs_alive(self) -> bool:
        return any(ref() is not None for ref in self.pending)


# all(tensors[i].data_ptr() == ptrs[i] for i in indices), in C++; CUDA builds only
_data_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
_use_count = torch._C._storage_Use_Count  # what CUDA-graph trees read to tell a storage's liveness


def host_values(args: Sequence) -> list[int]:
    """Positions of the inputs a CUDA graph would read only once, at capture: CPU tensors holding
    data beside device ones. A kernel takes a CPU scalar's value as a launch argument, so a replay
    keeps the captured value whatever the static buffer holds: a Python float that Dynamo has seen
    change becomes such a 0-dim tensor (on the H200 a replayed ``loss * t`` kept the captured
    ``t``: gradients 44% off; benchmarks/scalar_input_probe.py). Empty CPU tensors (compiled
    autograd's size carriers) hold no value. All-CPU inputs are the tests' fake graphs."""
    host = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.numel()]
    on_device = any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in args)
    return host if on_device else []


def input_shapes(args: Sequence) -> tuple:
    """What a graph with symbolic sizes was called at: each tensor's shape, each other input
    itself (a SymInt input arrives as an int)."""
    return tuple(x.shape if isinstance(x, torch.Tensor) else x for x in args)


class LentOutputs:
    """Static outputs handed out in the pool's own memory, and the check that lets a replay
    overwrite them (see the NOTE above).

    Built once at capture, when only the runner's static outputs hold the storages: their use
    counts then are the baseline. Each replay lends fresh aliases, which AccumulateGrad can steal
    (it keeps a detached alias of its own as ``.grad``): a held gradient is therefore found through
    the tensors it is the ``.grad`` of, not through what we handed out."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        storages = {}  # cdata -> storage, held so that the counts we compare never lose a holder of ours
        for t in tensors:
            storage = t.untyped_storage()
            storages.setdefault(storage._cdata, storage)
        self.storages = list(storages.values())
        self.cdatas = list(storages)
        self.baseline = list(map(_use_count, self.cdatas))
        self.moved = 0  # gradients moved to a copy because they were still held at a later replay
        self.aliases: list[weakref.ref] = []  # the last replay's, held by whoever took them as they are

    def lend(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        aliases = list(map(torch.Tensor.detach, tensors))
        self.aliases = list(map(weakref.ref, aliases))  # torch.autograd.grad hands these out unchanged
        return aliases

    def reclaim(self, *owners: list[weakref.ref]) -> bool:
        """Make the storages safe to overwrite: move the ``.grad`` of `owners` (parameters, inputs
        that require grad), and the aliases we lent that are still alive (``torch.autograd.grad``'s
        results), out of them. False if something else still holds one (a view of a gradient)."""
        counts = list(map(_use_count, self.cdatas))
        if counts == self.baseline:
            return True
        held = {c for c, n, base in zip(self.cdatas, counts, self.baseline) if n != base}
        grads = (None if (p := ref()) is None else p.grad for ref in itertools.chain(*owners))
        with torch.no_grad():
            for t in itertools.chain(grads, (ref() for ref in self.aliases)):
                if t is not None and t.untyped_storage()._cdata in held:
                    t.data = t.clone()  # every reference to this tensor follows it to the copy
                    self.moved += 1
        return list(map(_use_count, self.cdatas)) == self.baseline


class CudaGraphRunner:
    """A boxed callable: warm up, capture once, then replay the wrapped runtime."""

    timing_replays = 5
    min_gain = 0.01  # concurrency must beat one stream by this much to be replayed (see `fastest`)

    def __init__(self, candidates: dict[str, Callable[[list], list]], name: str, kind: str, family: GraphFamily,
                 static_input_idxs: set[int], user_visible_outputs: set[int] | None,
                 on_measured: Callable[[dict[str, float]], None] | None = None,
                 max_memory_ratio: float | None = None, donated_idxs: set[int] | None = None,
                 capture_near_limit: bool = False, symbolic: bool = False) -> None:
        self.candidates, self.name, self.kind, self.family = candidates, name, kind, family
        # sizes that vary between calls (dynamic shapes): replayed only at the captured ones
        self.symbolic = symbolic
        self.captured_shapes: tuple | None = None
        self.capture_near_limit = capture_near_limit  # cudagraphs=True: no headroom check before capture
        self.on_measured = on_measured  # gets {candidate: ms} once measured (the model calibrates from it)
        self.max_memory_ratio = max_memory_ratio  # concurrency within this much of one stream's pool (`fastest`)
        self.donated_idxs = donated_idxs or set()  # a backward's inputs AOTAutograd lets it reuse (NOTE: Donation)
        self.donated_bytes = 0  # saved-activation memory the backward's capture took over
        self.side_lane_donated_bytes = 0  # ... of which a side lane frees (NOTE: Donation on side lanes)
        self.withheld_bytes = 0  # donatable, but not safe to free under this backward's lanes
        if kind == "backward" and self.donated_idxs:
            family.backward_donates = True  # compiled at the first backward, before the forward captures
        # without the CUDA graph, launching from Python is the bottleneck and extra streams only
        # add launch work (DESIGN.md: 68 vs 48 ms), so the un-graphed path is single-stream
        self.fn = candidates.get("one_lane", candidates["lanes"])
        self.measured_ms: dict[str, float] = {}  # candidate -> ms per replay, once measured
        self.measuring_left_bytes = 0  # memory still allocated after the candidates were measured
        self.candidate_pool_bytes: dict[str, int | None] = {}  # candidate -> its capture's pool (pool_bytes)
        self.family_pool_bytes: int | None = None  # the family's pool once this graph is captured into it
        self.captured_bytes = 0  # allocated by the winner's capture and held: its outputs
        self.peak_after_capture = 0  # max_memory_allocated once captured: did capture set the peak?
        self.lent: LentOutputs | None = None  # a backward's gradients, once captured
        self.ungraphed_calls = 0  # calls after the first that ran without the CUDA graph
        self.chosen: str | None = None
        self.static_input_idxs = static_input_idxs
        self.user_visible_outputs = user_visible_outputs  # None: all outputs
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.disabled: str | None = None
        self.capture_refused: str | None = None  # not captured by design (NOTE: A capture needs headroom)
        self._warned: set[str] = set()
        self._boxed_call = True
        self._fixed_check: tuple | None = None  # fixed_ptrs laid out for `_inputs_in_place` (per capture's dict)
        self.replays = 0
        # host time of the replayed calls (checks, input copies, launch, handing out outputs) and of
        # their launches alone: where a small step's time goes (benchmarks/host_split.py)
        self.replay_host_s = 0.0
        self.launch_host_s = 0.0

    # -- helpers -------------------------------------------------------------------------
    def _warn_once(self, key: str, why: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"apollo: {self.name} runs without its CUDA graph because {why} "
                          "(correct, but slower)", ApolloFallbackWarning, stacklevel=3)

    def _eager(self, args: list) -> list:
        if self.calls > 1:
            self.ungraphed_calls += 1
        try:
            return self.fn(args)
        except torch.OutOfMemoryError as e:
            if self.disabled is not None and self.capture_refused is None and hasattr(e, "add_note"):
                e.add_note(f"apollo: {self.name} runs without its CUDA graph because its capture failed "
                           f"({self.disabled[:120]}), beside the graph pool its family keeps, whose free memory "
                           "this run cannot use (cudagraph.py, NOTE: A capture needs headroom). Once this "
                           "step's tensors are gone the family runs without its graphs; cudagraphs=False "
                           "trains this size that way from the start.")
            raise

    def summary(self) -> dict:
        return {"replays": self.replays, "chosen": self.chosen, "measured_ms": dict(self.measured_ms),
                "replay_host_ms": round(1e3 * self.replay_host_s / self.replays, 4) if self.replays else None,
                "launch_host_ms": round(1e3 * self.launch_host_s / self.replays, 4) if self.replays else None,
                "measuring_left_bytes": self.measuring_left_bytes, "captured_bytes": self.captured_bytes,
                "candidate_pool_bytes": dict(self.candidate_pool_bytes), "family_pool_bytes": self.family_pool_bytes,
                "peak_after_capture": self.peak_after_capture, "donated_bytes": self.donated_bytes,
                "side_lane_donated_bytes": self.side_lane_donated_bytes, "withheld_bytes": self.withheld_bytes,
                "ungraphed_calls": self.ungraphed_calls, "disabled": self.disabled,
                "capture_refused": self.capture_refused,
                "lent_moved": self.lent.moved if self.lent is not None else 0}

    def _is_user_visible(self, i: int) -> bool:
        return self.user_visible_outputs is None or i in self.user_visible_outputs

    # -- capture ---------------------------------------------------------------------------
    def _capture(self, args: list) -> None:
        self.static_inputs: list = []
        self.copy_idxs: list[int] = []
        self.fixed_ptrs: dict[int, int] = {}
        for i, x in enumerate(args):
            if not isinstance(x, torch.Tensor):
                self.static_inputs.append(x)
            elif i in self.static_input_idxs or x.data_ptr() in self.family.saved_ptrs:
                # a fresh alias: holding the caller's own tensor object would keep the forward's
                # saved-activation aliases alive forever (see the NOTE on liveness)
                self.static_inputs.append(x.detach())
                self.fixed_ptrs[i] = x.data_ptr()
            else:
                if not is_non_overlapping(x):
                    raise RuntimeError(f"input {i} overlaps itself (stride {tuple(x.stride())})")
                buf = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
                buf.copy_(x)
                self.static_inputs.append(buf)
                self.copy_idxs.append(i)
        self.chosen = self._choose_candidate()
        if self.kind == "forward":
            self.family.forward_chosen = self.chosen
        if self.family.pool is None:
            self.family.pool = torch.cuda.graph_pool_handle()
        allocated_before = torch.cuda.memory_allocated()
        fn = self.candidates[self.chosen]
        # donated: data_ptrs of the saved activations whose memory the capture takes over
        inputs, donated, local = self._donating_inputs()
        rt = getattr(fn, "lane_runtime", None)
        if local:  # only weak references: the list stays the inputs' one holder
            rt.free_at_last_reader({lane: [inputs[i] for i in idxs] for lane, idxs in local.items()})
        try:
            graph, outputs = self._capture_one(fn, self.family.pool, inputs)
        finally:
            if local:
                rt.free_at_last_reader({})
        self.captured_bytes = torch.cuda.memory_allocated() - allocated_before
        self.peak_after_capture = torch.cuda.max_memory_allocated()  # since the caller's last reset
        self.family_pool_bytes = pool_bytes(self.family.pool)
        self.static_outputs = list(outputs)
        del outputs
        # an output that *is* a fixed input (a parameter saved for backward) is returned as the
        # caller's own tensor, not the capture-time one
        ids = {id(x): i for i, x in enumerate(self.static_inputs) if i in self.fixed_ptrs}
        self.output_is_input = {j: ids[id(o)] for j, o in enumerate(self.static_outputs) if id(o) in ids}
        inputs = {x.untyped_storage().data_ptr() for x in self.static_inputs if isinstance(x, torch.Tensor)}
        if self.kind == "forward":
            self._borrow_outputs(inputs)
        tensors = [j for j, o in enumerate(self.static_outputs)
                   if isinstance(o, torch.Tensor) and j not in self.output_is_input]
        user_visible = [j for j in tensors if self._is_user_visible(j)]
        # a backward's gradients are lent, in place (see the NOTE); an output sharing memory with
        # an input (a static buffer the next call refills, a saved activation still read) is copied;
        # one placed over a donated saved activation is lent: the next forward replay reclaims it
        still_read = inputs - donated
        lend = [j for j in user_visible if self.kind == "backward"
                and self.static_outputs[j].untyped_storage().data_ptr() not in still_read]
        self.lent_idxs = lend
        lent = set(lend)
        self.copied_out_idxs = [j for j in user_visible if j not in lent]
        self.copy_out = OutputCopier([self.static_outputs[j] for j in self.copied_out_idxs])
        self.lent = LentOutputs([self.static_outputs[j] for j in lend]) if lend else None
        if self.lent is not None:
            self.family.lent = self.lent
        saved = [j for j in tensors if not self._is_user_visible(j)]
        self.sentinel_idx = saved[0] if saved else None
        if self.kind == "forward":
            self.family.saved_ptrs = {o.data_ptr() for o in self.static_outputs if isinstance(o, torch.Tensor)}
            self.family.grad_owners = [weakref.ref(args[i]) for i in sorted(self.fixed_ptrs)
                                       if i in self.static_input_idxs and args[i].requires_grad]
        self.graph = graph
        log.info("apollo: captured %s as a CUDA graph, runtime %r (%d inputs copied, %d used in place)",
                 self.name, self.chosen, len(self.copy_idxs), len(self.fixed_ptrs))

    def _borrow_outputs(self, inputs: set[int]) -> None:
        """Hand the ownership of the forward's outputs in the pool to the family; the static
        outputs (and so every alias a replay hands out) borrow their memory (NOTE: Donation).
        `inputs`: the static inputs' storage data_ptrs (an output on one is not the pool's)."""
        views: dict[int, torch.UntypedStorage] = {}
        for j, o in enumerate(self.static_outputs):
            if not isinstance(o, torch.Tensor) or not in_graph_pool(o) or j in self.output_is_input:
                continue
            storage = o.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in inputs:  # empty, or a view of an input: not the pool's
                continue
            if ptr not in views:
                self.family.owners[ptr] = storage
                views[ptr] = unowned(storage)
            self.static_outputs[j] = borrowed(o, views[ptr])

    def _donatable(self) -> dict[int, list[int]]:
        """The family-owned storages a backward may take over (every input of ours reading one is
        donated), each with the positions of those inputs."""
        if self.kind != "backward" or not self.donated_idxs or not self.family.owners:
            return {}
        readers: dict[int, list[int]] = {}
        for i in self.fixed_ptrs:
            readers.setdefault(self.static_inputs[i].untyped_storage().data_ptr(), []).append(i)
        return {ptr: idxs for ptr, idxs in readers.items()
                if ptr in self.family.owners and all(i in self.donated_idxs for i in idxs)}

    def _will_donate(self) -> bool:
        return bool(self._donatable())

    def _donating_inputs(self) -> tuple[list, set[int], dict[int, list[int]]]:
        """The list the final capture runs on: the static inputs, except that a backward gets the
        owners of the saved activations it may reuse (`_donatable`, as far as the chosen runtime's
        side lanes allow: `_safe_on_lanes`), which the family then lets go of. Also returned: their
        data_ptrs, and side lane -> the positions it frees at their last reader."""
        inputs = list(self.static_inputs)
        donated: set[int] = set()
        donatable = self._donatable()
        safe, local = self._safe_on_lanes(donatable)
        freed_on_side_lanes = {i for idxs in local.values() for i in idxs}
        for ptr, idxs in donatable.items():
            if ptr not in safe:
                self.withheld_bytes += self.family.owners[ptr].nbytes()
                continue
            owner = self.family.owners.pop(ptr)
            for i in idxs:
                inputs[i] = borrowed(self.static_inputs[i], owner)
            self.donated_bytes += owner.nbytes()
            if freed_on_side_lanes.intersection(idxs):
                self.side_lane_donated_bytes += owner.nbytes()
            donated.add(ptr)
        return inputs, donated, local

    def _safe_on_lanes(self, donatable: dict[int, list[int]]
                       ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """`donations_safe_on_lanes` for the chosen runtime: its side lanes' streams, which inputs
        each lane reads, and the stream that made each saved activation."""
        fn = self.candidates.get(self.chosen)
        rt = getattr(fn, "lane_runtime", None)
        lane_streams = {lane: s.cuda_stream for lane, s in rt.streams.items()} if rt is not None else {}
        if not lane_streams or not donatable:
            return donatable, {}
        return donations_safe_on_lanes(donatable, allocation_streams(donatable), lane_streams,
                                       getattr(fn, "input_lanes", ()))

    def _capture_one(self, fn: Callable[[list], list], pool, inputs: list | None = None
                     ) -> tuple[torch.cuda.CUDAGraph, list]:
        """Capture `fn` on `inputs` (default: a copy of the static inputs) into `pool`. The list
        is handed over: a boxed runtime clears it, so what only it held is freed during capture."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        clear_cublas_workspaces()  # the workspaces the capture needs are allocated in `pool`
        if inputs is None:
            inputs = list(self.static_inputs)
        try:
            with torch.cuda.graph(graph, pool=pool):  # a runtime that raises joins its lanes first (abandon)
                outputs = fn(inputs)
        finally:
            clear_cublas_workspaces()  # ... and stay the graph's: later eager matmuls get their own
        return graph, outputs

    def _choose_candidate(self) -> str:
        """Capture every candidate runtime (lanes, one lane), time its replays, keep the fastest
        (concurrency only where it beats one stream by `min_gain`: see :func:`fastest`).

        Concurrency is a prediction until measured (DESIGN.md: a fixed split was slower than
        two plain streams), so the single-stream schedule of the same subgraphs is always a
        candidate. Candidates are captured one at a time, each into a pool of its own that dies
        with it after timing (a pool outlives no graph: capturing into the pool of a deleted
        graph trips the allocator), so memory never holds two of them; the winner is captured
        again into the family's pool. Replays advance the CUDA RNG: a graph with dropout draws
        other masks afterwards than an untimed run would (still random).

        Under a memory budget, a backward that will reuse its saved activations' memory (NOTE:
        Donation) replays one lane, unmeasured, and so does its forward (`_memory_first_one_lane`)."""
        if len(self.candidates) == 1:
            return next(iter(self.candidates))
        why = self._memory_first_one_lane()
        if why is not None:
            log.info("apollo: %s replays 'one_lane' unmeasured: %s", self.name, why)
            return "one_lane"
        torch.cuda.synchronize()
        allocated_before = torch.cuda.memory_allocated()
        for name, fn in self.candidates.items():
            pool = torch.cuda.graph_pool_handle()
            graph, outputs = self._capture_one(fn, pool)
            self.candidate_pool_bytes[name] = pool_bytes(pool)  # lanes hold both towers' temporaries at once
            graph.replay()  # first replay pays one-time costs (lazy module loads, page faults)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(self.timing_replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            self.measured_ms[name] = start.elapsed_time(end) / self.timing_replays
            del graph, outputs
            torch.cuda.synchronize()
        # a candidate's graph, pool and outputs die with it, its cuBLAS workspaces too (they were
        # in its pool: _capture_one); anything left would be a leak
        self.measuring_left_bytes = torch.cuda.memory_allocated() - allocated_before
        best = fastest(self.measured_ms, self.min_gain, self.candidate_pool_bytes, self.max_memory_ratio,
                       allocated_before)
        if self.on_measured is not None:
            self.on_measured(dict(self.measured_ms))
        log.info("apollo: %s measured %s; replaying %r", self.name,
                 ", ".join(f"{k} {v:.3f} ms" + (f" ({self.candidate_pool_bytes[k] / 2**30:.2f} GiB pool)"
                                                 if self.candidate_pool_bytes.get(k) else "")
                           for k, v in self.measured_ms.items()), best)
        return best

    def _memory_first_one_lane(self) -> str | None:
        """Why this graph replays one lane unmeasured under a memory budget, or None.

        The caching allocator hands a freed block only to a tensor allocated on the stream that
        allocated it. On one lane in both graphs the backward's capture reuses every saved
        activation; with side lanes it reuses only those made and read by the same lane, and a
        side lane cannot take what the main lane freed (NOTE: Donation on side lanes). Measuring
        also sets the whole run's peak, each candidate's pool held beside every saved activation:
        with side lanes reusing their own, measuring both graphs under budget 0.5 still raised a
        batch-64 CLIP step's whole-run peak from 3.33 to 4.18 GiB for a 3% faster step (RESULTS.md,
        session 9).
        The forward learns of the donation from the family: its backward is compiled at the first
        backward, before the forward's second call captures."""
        if self.max_memory_ratio is None or "one_lane" not in self.candidates:
            return None
        if self._will_donate():
            return "under a memory budget the backward reuses its saved activations' memory on one stream"
        if self.kind == "forward" and self.family.backward_donates:
            return ("under a memory budget the backward reuses the saved activations' memory, which only "
                    "a forward on the capture stream makes reusable")
        return None

    def _capture_refused(self) -> str | None:
        """Why this graph is not captured, or None (NOTE: A capture needs headroom). The forward
        decides for its family, at the memory its first step used; its backward follows, since a
        backward run un-graphed beside the forward's pool, or captured after an un-graphed
        forward, needs memory the first step did not."""
        if self.kind == "backward":
            return self.family.capture_refused
        why = None
        if not self.capture_near_limit and (pressure := memory_pressure()) is not None:
            why = too_close_to_the_limit(*pressure)
        if self.kind == "forward":
            self.family.capture_refused = why
        return why

    # -- replay ----------------------------------------------------------------------------
    def _inputs_in_place(self, args: list) -> bool:
        # hundreds of parameters and saved activations per call, before the launch: at batch 8 on
        # the H200 everything the host does before the forward's launch is step time. CUDA builds
        # have the check CUDA-graph trees use on their hot path, in C++; elsewhere one list
        # comparison rather than a Python test each
        if self._fixed_check is None or self._fixed_check[0] is not self.fixed_ptrs:
            positions = sorted(self.fixed_ptrs)
            ptrs: list[int | None] = [None] * (positions[-1] + 1 if positions else 0)
            for i in positions:
                ptrs[i] = self.fixed_ptrs[i]
            self._fixed_check = (self.fixed_ptrs, ptrs, positions, list(self.fixed_ptrs.values()))
        _, ptrs, positions, values = self._fixed_check
        try:
            if _data_ptrs_equal is not None:
                return _data_ptrs_equal(args, ptrs, positions)
            return [args[i].data_ptr() for i in self.fixed_ptrs] == values
        except (AttributeError, TypeError, RuntimeError):  # no longer a tensor
            return False

    def _replay(self, args: list) -> list:
        for i in self.copy_idxs:
            self.static_inputs[i].copy_(args[i])
        if self.kind == "forward":  # a user input's .grad is the backward's memory too (saliency, say)
            self.family.input_owners = [weakref.ref(args[i]) for i in self.copy_idxs if args[i].requires_grad]
        launch = time.perf_counter()
        self.graph.replay()
        self.launch_host_s += time.perf_counter() - launch
        self.replays += 1
        outs = list(self.static_outputs)
        for j, i in self.output_is_input.items():
            outs[j] = args[i]
        for j, fresh in zip(self.copied_out_idxs, self.copy_out([outs[j] for j in self.copied_out_idxs])):
            outs[j] = fresh
        if self.lent is not None:
            for j, alias in zip(self.lent_idxs, self.lent.lend([outs[j] for j in self.lent_idxs])):
                outs[j] = alias
        if self.sentinel_idx is not None:
            # the saved activations live and die together (one autograd context holds them
            # all): one fresh alias among them tells when the last forward's are released
            alias = outs[self.sentinel_idx].detach()
            outs[self.sentinel_idx] = alias
            if self.kind == "forward":
                self.family.pending = [weakref.ref(alias)]
        args.clear()
        return outs

    def _let_go(self) -> None:
        """A forward whose backward failed to capture stops replaying and drops its graph and the
        memory it owns in the family's pool: un-graphed, the backward cannot use that pool's free
        memory (NOTE: A capture needs headroom), and near the limit it would run out at every step.
        With no graph left the pool goes back to the allocator once the last step's tensors die,
        and the family runs as its first step did. Called only once the last forward's saved
        activations are dead, so nothing still reads what the owners held."""
        self.disabled = f"its backward's CUDA-graph capture failed ({self.family.backward_capture_failed[:200]})"
        self.graph = None
        self.static_inputs, self.static_outputs = [], []
        self.family.owners.clear()
        self._warn_once("capture", self.disabled)

    def __call__(self, args: list) -> list:
        start = time.perf_counter()
        self.calls += 1
        if (self.kind == "forward" and self.graph is not None and self.family.backward_capture_failed is not None
                and not self.family.forward_outputs_alive()):
            self._let_go()
        if self.disabled is not None or self.calls == 1:
            return self._eager(args)
        if self.kind == "forward" and self.family.forward_outputs_alive():
            self._warn_once("pending", "the previous forward's saved activations are still alive "
                                       "(two forwards before a backward, or retain_graph=True)")
            return self._eager(args)
        if self.symbolic:
            shapes = input_shapes(args)
            if self.graph is None:
                self.captured_shapes = shapes
            elif shapes != self.captured_shapes:
                self._warn_once("shape", "it was called at input shapes other than those it was captured at "
                                         "(dynamic shapes); calls at the captured shapes replay it")
                return self._eager(args)
        if self.graph is None:
            if host := host_values(args):
                x = args[host[0]]
                self.disabled = (f"its input {host[0]} is a CPU tensor ({x.dtype}, shape {tuple(x.shape)}; a Python "
                                 "float that changes between calls is passed so), whose value a replay would not "
                                 "read again; pass it as a CUDA tensor to keep the graph")
                self._warn_once("host", self.disabled)
                return self._eager(args)
            self.capture_refused = self.disabled = self._capture_refused()
            if self.disabled is not None:
                self._warn_once("memory", self.disabled)
                return self._eager(args)
            try:
                self._capture(args)
            except Exception as e:  # capture unsupported here: run the runtime as it is
                self.disabled = f"{type(e).__name__}: {e}"
            if self.disabled is not None:
                # outside the except block: the exception's traceback holds the failed capture's
                # frames, and so its temporaries, for as long as the block runs (a fallback at the edge
                # of memory needs those bytes)
                self._warn_once("capture", f"CUDA-graph capture failed ({self.disabled})")
                if self.kind == "backward":
                    self.family.backward_capture_failed = self.disabled
                torch.cuda.synchronize()
                return self._eager(args)
            start = time.perf_counter()  # capturing and measuring took seconds: not a replay's host time
        if not self._inputs_in_place(args):
            self._warn_once("moved", "an input captured in place (a parameter or a saved activation) "
                                     "now lives at another address: parameters replaced (p.data = ...), "
                                     "or another model instance running this compiled code, which "
                                     "torch._dynamo.reset() before compiling it would give graphs of its own")
            return self._eager(args)
        if self.family.lent is not None and not self.family.lent.reclaim(self.family.grad_owners,
                                                                           self.family.input_owners):
            self._warn_once("lent", "a gradient the previous backward handed out in the graph's memory is "
                                    "still referenced through a view or another tensor")
            return self._eager(args)
        outs = self._replay(args)
        self.replay_host_s += time.perf_counter() - start
        return outs
