"""Replay a graph's whole runtime — every lane — as one CUDA graph.

The forward and backward of one Dynamo graph, for one model instance, share a
:class:`GraphFamily`: one memory pool (so the backward reuses the forward's freed intermediates,
as ``make_graphed_callables`` does) and the forward's saved outputs, which the backward reads in
place instead of copying.

Call 1 runs the runtime eagerly (Inductor/Triton compile their kernels lazily, which must not
happen under capture); call 2 captures and replays; later calls replay. Inputs the graph was
told are static (parameters) and the forward's saved outputs are used in place; other inputs are
copied into static buffers. On call 2 the runner's strategy picks the candidate runtime (lanes, one
lane, SM quotas) that replays, unmeasured or after capturing and timing each (``choice.py``).

This module is the runner and the state a family shares; beside it ``graph_io.py`` (which inputs a
graph can take, its output copies, the gradients it lends), ``graph_pool.py`` (pools, the
allocator's segments and streams, borrowed storages, the memory-limit rule: NOTE: A capture needs
headroom), ``choice.py`` (the strategies) and ``instances.py`` (which family a call replays where
one compiled graph serves several model instances: a family each).

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
forward runs again (two forwards before one backward, ``retain_graph=True``), that call replays
another family's graph, in memory of its own (``instances.py``, NOTE: One graph, several model
instances), so nothing the pending backward needs is overwritten. A backward whose
saved inputs are not where the captured one read them runs without the CUDA graph too. A graph
with symbolic sizes (``dynamic=True``, or Dynamo's automatic dynamic shapes after a second batch
size) is captured at the shapes of its second call; a call at other shapes runs without the
CUDA graph (`graph_io.input_shapes`): the captured kernels and static buffers hold the captured sizes.
A graph with CPU tensor inputs (a Python float Dynamo has seen change) is not captured at all
(`graph_io.host_values`). Every such path is correct and warns once.

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
(`choice.memory_first_reason`; H200, batch 64, budget 0.5: 3.72 instead of 4.55 GiB reserved, the
step 28.45 instead of 27.96 ms). Without a budget the forward's timing decides for both (a
donating backward does not time its own candidates: choice.py, NOTE: A donating backward follows
its forward); a two-lane backward after a two-lane forward reused little while both towers ran on
side lanes (batch 128: the family's pool 13.1 GB against 11.6 for one lane), hence the costliest
tower runs on the main lane in both graphs (lanes.py, NOTE: The costliest branch runs on the
caller's stream; batch 128: 12.2 against 11.6).

[NOTE] Donation on side lanes::

    fw lane 1 (stream S1) ─► text act T       bw lane 1 (S1) reads T, frees it: S1 reuses it
    fw lane 1 (stream S1) ─► text act U       bw lane 0 reads U: not donated (see below)

The forward and backward of a family run each side lane on the same stream (``side_streams``),
so the backward's side lane can take over what the forward's same lane saved: the backward's
capture looks up which stream made each donated activation (the allocator's segments,
`graph_pool.allocation_streams`) and `graph_pool.donations_safe_on_lanes` decides. Made on the
capture stream, or on a stream this backward does not allocate on: donated as above. Made on side
lane k's stream and read only on lane k: donated, and lane k frees it at its last reader instead
of holding it to the join (``LaneRuntime.free_at_last_reader``). Made on lane k's stream but read
on another lane: not donated; the block would go back to stream k, whose next allocation could
overwrite it while the other lane still reads it. Unknown stream: not donated. The un-graphed
path runs one lane, so this only ever concerns a capture.

A donated saved activation is read once: AOTAutograd already refuses a second backward through a
graph compiled with donated buffers (``retain_graph=True``), and compiles none when the first
backward retains the graph. A gradient placed over a saved activation is lent like any other:
the forward's replay moves a held one out first (NOTE above). Only CUDA memory is donated: the
pool keeps the freed bytes reserved for the graph; on the CPU (fake graphs in tests) they would
go back to the heap.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from typing import Callable

import torch

from ..fallback import ApolloFallbackWarning
from .choice import GraphFacts, Strategy, in_effect, memory_first_reason
from .graph_io import Addresses, LentOutputs, OutputCopier, WrittenInputs, host_values, input_shapes, is_non_overlapping
from .graph_pool import (allocating_in, allocation_streams, borrowed, clear_cublas_workspaces, donations_safe_on_lanes,
                         first_step_pool, in_graph_pool, memory_pressure, pool_bytes, release_cached_segments,
                         too_close_to_the_limit, unowned)
from .instances import GraphInstances, call_began, call_ended

__all__ = ["CudaGraphRunner", "GraphFamily"]

log = logging.getLogger("apollo_compile")

# NOTE: A capture needs headroom: graph_pool.py, with CAPTURE_HEADROOM and the rule it explains.

# [NOTE] A graph that writes its inputs: with the optimizer inside a whole step
# (``compile_step(..., optimizer=)``) AOTAutograd keeps the updates in the graph as ``copy_`` into
# the parameters and the step counters, which the replay reads and writes in place (they are static:
# parameters by Dynamo, the counters by ``optimizer_step``); the update ops write Adam's moments
# too, which they find by name, not as inputs (``fused_update.py``, NOTE: The moments are not graph
# inputs). Any other written input is copied into the graph's buffer before a replay and back out
# after it. Each replay that times a candidate applies the update once more, so the inputs it writes
# in place and the moments (``fused_update.written_state``) are copied to the host before the
# candidates are timed and put back after (``graph_io.WrittenInputs``: on the host, since a second
# device copy of the parameters and the optimizer's state would set the run's peak). Where that copy
# would not fit in a quarter of the host's free memory, the graph is not timed and replays the
# planner's fastest plain candidate (lanes or one lane), never an SM quota: a quota is only ever
# replayed once measured (DESIGN.md measured every fixed split slower than plain streams). Until
# session 30 such a graph was never timed and replayed the planner's overall prediction: HF CLIP
# B/16's whole step with AdamW inside then replayed "quota:1=56" unmeasured on the H200, 8.05 ms
# back to back where lanes had run 7.56 in session 29.


class GraphFamily:
    """State shared by the CUDA graphs of one Dynamo graph (forward + backward) for one model
    instance (instances.py)."""

    def __init__(self, instances: GraphInstances | None = None) -> None:
        self.pool = None
        self.saved_ptrs: set[int] = set()  # data_ptrs of the forward's captured outputs
        self.pending: list[weakref.ref] = []  # aliases handed out by the last forward replay
        self.lent: LentOutputs | None = None  # the backward's gradients, handed out in the pool
        self.grad_owners: list[weakref.ref] = []  # the forward's parameters, whose .grad they become
        self.input_owners: list[weakref.ref] = []  # the last forward replay's inputs that require grad
        self.owners: dict[int, torch.UntypedStorage] = {}  # data_ptr -> the forward's outputs' memory (NOTE: Donation)
        self.backward_donates = False  # the backward may reuse saved activations (set when it is compiled)
        self.forward_chosen: str | None = None  # the candidate the forward replays, once captured
        self.forward_measured = False  # ... chosen by timing its candidates (choice.py, NOTE: A donating backward ...)
        self.capture_refused: str | None = None  # why the forward was not captured (NOTE: A capture needs headroom)
        self.backward_capture_failed: str | None = None  # why; the forward then lets its graph go (`_let_go`)
        # side lane -> its stream, the same in every graph of the family (NOTE: Donation on side lanes)
        self.side_streams: dict[int, torch.cuda.Stream] = {}
        # the first step's own memory pool while that step runs (graph_pool.py, NOTE: The first step in a pool
        # of its own); opened once, by the family's first call
        self.first_step_pool: tuple[object, torch.device] | None = None
        self.first_step_opened = False
        # the model instance it serves (instances.py, NOTE: One graph, several model instances): its
        # parameters' addresses (None: free), weak references to them, its forward's replays since bound
        self.instances = instances if instances is not None else GraphInstances(self)
        self.key: Addresses | None = None
        self.served: list[weakref.ref] = []
        self.replays = 0
        self.runners: list[weakref.ref] = []  # its graphs' runners, which drop their captures when it is released

    def open_first_step(self, args: list, kind: str) -> tuple[object, torch.device] | None:
        """The first step's pool: opened by the family's first call, a graph of `kind` (on the
        device of its first CUDA tensor), the same pool for the first calls after it; None once it
        was closed, or where that kind opens none."""
        if not self.first_step_opened:
            self.first_step_opened = True
            device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
            self.first_step_pool = first_step_pool(device, kind)
        return self.first_step_pool

    def close_first_step(self) -> None:
        """No more allocations in the first step's pool; what lives in it stays valid."""
        self.first_step_opened, self.first_step_pool = True, None

    def forward_outputs_alive(self) -> bool:
        return any(ref() is not None for ref in self.pending)

    def sibling(self) -> GraphFamily:
        """A new family of the same graph, for another model instance."""
        other = GraphFamily(self.instances)
        other.side_streams = self.side_streams  # the runtimes' lanes run on these streams in every family
        other.backward_donates = self.backward_donates
        return other

    def unused(self) -> bool:
        """Whether the instance it serves is gone (every parameter dead) or its parameters moved
        (``p.data = ...``): no call will replay it again."""
        if not self.served:
            return False
        alive = [(i, ref()) for i, ref in zip(self.key.positions, self.served)]
        return all(p is None for _, p in alive) or any(
            p is not None and p.data_ptr() != self.key.ptrs[i] for i, p in alive)

    def release(self) -> None:
        """Forget what the family's captures shared and every graph's capture: free, it serves the
        next new instance, captured at its first call. The pool goes back to the driver with the
        old graphs and tensors (release_cached_segments, before the next capture)."""
        self.pool = None
        self.saved_ptrs, self.pending, self.lent = set(), [], None
        self.grad_owners, self.input_owners, self.owners = [], [], {}
        self.forward_chosen, self.forward_measured = None, False
        self.capture_refused = self.backward_capture_failed = None
        self.key, self.served, self.replays = None, [], 0
        for ref in self.runners:
            if (runner := ref()) is not None:
                runner._drop_capture()


class CudaGraphRunner:
    """A boxed callable: warm up, capture once, then replay the wrapped runtime.

    Which candidate runtime replays is `strategy`'s choice (choice.py); without one, the strategy in
    effect when it captures (``choice.using``, else apollo's own rule, ``choice.ChooseFastest``)."""

    timing_replays = 5

    def __init__(self, candidates: dict[str, Callable[[list], list]], name: str, kind: str, family: GraphFamily,
                 static_input_idxs: set[int], user_visible_outputs: set[int] | None,
                 on_measured: Callable[[dict[str, float]], None] | None = None,
                 max_memory_ratio: float | None = None, donated_idxs: set[int] | None = None,
                 capture_near_limit: bool = False, symbolic: bool = False, strategy: Strategy | None = None,
                 lent_outputs: set[int] | None = None, written_idxs: set[int] | None = None,
                 predicted: str | None = None,
                 written_state: Callable[[], list[torch.Tensor]] | None = None,
                 saved_idxs: list[int] | None = None) -> None:
        # what a runner of the same graph for another model instance is built from (`for_family`)
        self._config = dict(candidates=candidates, name=name, kind=kind, static_input_idxs=static_input_idxs,
                            user_visible_outputs=user_visible_outputs, max_memory_ratio=max_memory_ratio,
                            donated_idxs=donated_idxs, capture_near_limit=capture_near_limit, symbolic=symbolic,
                            strategy=strategy, lent_outputs=lent_outputs, written_idxs=written_idxs,
                            predicted=predicted, written_state=written_state, saved_idxs=saved_idxs)
        self.first: CudaGraphRunner | None = None  # for another instance: the first family's runner, else None
        self.candidates, self.name, self.kind, self.family = candidates, name, kind, family
        # a backward's inputs that are its forward's saved outputs (the rest: gradients of its outputs);
        # None: unknown, all may be (instances.py finds a backward's family by them)
        self.saved_idxs = saved_idxs
        self.strategy = strategy  # which candidate replays; None: `choice.in_effect()` at capture
        # sizes that vary between calls (dynamic shapes): replayed only at the captured ones
        self.symbolic = symbolic
        self.captured_shapes: tuple | None = None
        self.capture_near_limit = capture_near_limit  # cudagraphs=True: no headroom check before capture
        self.on_measured = on_measured  # gets {candidate: ms} once measured (the model calibrates from it)
        self.max_memory_ratio = max_memory_ratio  # concurrency within this much of one stream's pool (`choice.fastest`)
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
        self.first_static = min(static_input_idxs, default=None)  # where instances.py looks a call's family up
        self.copy_idxs: list[int] = []  # inputs copied into the graph's buffers before each replay
        self.fixed_ptrs: dict[int, int] = {}  # inputs read in place: their addresses at capture
        self.lent_idxs: list[int] = []  # outputs lent in the pool's memory
        self.copied_out_idxs: list[int] = []  # outputs copied out after each replay
        self.user_visible_outputs = user_visible_outputs  # None: all outputs
        # outputs lent in the pool's memory like a backward's (a whole step's gradients); a backward lends all
        self.lent_outputs = lent_outputs or set()
        # inputs the graph writes (a whole step's optimizer update: NOTE: A graph that writes its inputs)
        self.written_idxs = written_idxs or set()
        self.written_copied: list[int] = []  # ... of them copied in: copied back after each replay
        # what else it writes in place, not an input (an optimizer's moments, found by name): a function
        # that gives those tensors now (fused_update.written_state)
        self.written_state = written_state
        self.predicted = predicted  # the planner's fastest plain candidate, replayed where timing cannot be
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.disabled: str | None = None
        self.capture_refused: str | None = None  # not captured by design (NOTE: A capture needs headroom)
        self._warned: set[str] = set()
        self._boxed_call = True
        self._fixed_check: Addresses | None = None  # fixed_ptrs, for `_inputs_in_place` (per capture's dict)
        family.runners.append(weakref.ref(self))
        self.replays = 0
        # host time of the replayed calls (checks, input copies, launch, handing out outputs) and of
        # their launches alone: where a small step's time goes (benchmarks/probes/host_split.py)
        self.replay_host_s = 0.0
        self.launch_host_s = 0.0

    def for_family(self, family: GraphFamily, warm: bool) -> CudaGraphRunner:
        """This graph's runner for another model instance's `family` (instances.py, NOTE: One graph,
        several model instances). `warm`: the runtime ran once, so it captures at its first call."""
        other = CudaGraphRunner(**self._config, family=family)
        other.first = self
        other.calls = 1 if warm else 0
        return other

    # -- helpers -------------------------------------------------------------------------
    def _warn_once(self, key: str, why: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"apollo: {self.name} runs without its CUDA graph because {why} "
                          "(correct, but slower)", ApolloFallbackWarning, stacklevel=3)

    def _eager(self, args: list, warm_up: bool = False) -> list:
        """Run the runtime un-graphed; `warm_up`: as part of the graph's first step, not counted."""
        if self.calls > 1 and not warm_up:
            self.ungraphed_calls += 1
        # a first call runs in the first step's pool: the forward's opens it, the backward's closes it
        # (graph_pool.py, NOTE: The first step in a pool of its own)
        first_call = self.calls == 1
        pool = self.family.open_first_step(args, self.kind) if first_call else None
        # an un-graphed forward of a graph that captures: its backward runs un-graphed too (instances.py)
        inputs = {args[i].data_ptr() for i in self.static_input_idxs if isinstance(args[i], torch.Tensor)} \
            if self.kind == "forward" and self.disabled is None else None
        try:
            with allocating_in(pool):
                outs = self.fn(args)
            self.family.instances.warm.add(self.kind)
            if inputs is not None:
                self.family.instances.ran_eagerly([o for j, o in enumerate(outs) if isinstance(o, torch.Tensor)
                                                   and not self._is_user_visible(j) and o.data_ptr() not in inputs],
                                                  warm_up=first_call)
            return outs
        except torch.OutOfMemoryError as e:
            if self.disabled is not None and self.capture_refused is None and hasattr(e, "add_note"):
                e.add_note(f"apollo: {self.name} runs without its CUDA graph because its capture failed "
                           f"({self.disabled[:120]}), beside the graph pool its family keeps, whose free memory "
                           "this run cannot use (runtime/graph_pool.py, NOTE: A capture needs headroom). Once this "
                           "step's tensors are gone the family runs without its graphs; cudagraphs=False "
                           "trains this size that way from the start.")
            raise
        finally:
            if first_call and self.kind != "forward":
                self.family.close_first_step()

    def summary(self) -> dict:
        """What it did; `replays` and `ungraphed_calls` add up those of its runners for the other
        model instances it served (instances.py: `instances` families, `instances_released` freed)."""
        instances = self.family.instances
        others = [r for (_, kind), r in instances.copies.items() if kind == self.kind] if self.first is None else []
        return {"replays": self.replays + sum(r.replays for r in others), "chosen": self.chosen,
                "instances": len(instances.families), "instances_released": instances.released,
                "measured_ms": dict(self.measured_ms),
                "replay_host_ms": round(1e3 * self.replay_host_s / self.replays, 4) if self.replays else None,
                "launch_host_ms": round(1e3 * self.launch_host_s / self.replays, 4) if self.replays else None,
                "measuring_left_bytes": self.measuring_left_bytes, "captured_bytes": self.captured_bytes,
                "candidate_pool_bytes": dict(self.candidate_pool_bytes), "family_pool_bytes": self.family_pool_bytes,
                "peak_after_capture": self.peak_after_capture, "donated_bytes": self.donated_bytes,
                "side_lane_donated_bytes": self.side_lane_donated_bytes, "withheld_bytes": self.withheld_bytes,
                "ungraphed_calls": self.ungraphed_calls + sum(r.ungraphed_calls for r in others),
                "disabled": self.disabled,
                "capture_refused": self.capture_refused,
                "lent_moved": self.lent.moved if self.lent is not None else 0,
                # per replay: inputs copied into the graph's buffers / read in place, outputs lent / copied
                "inputs_copied": len(self.copy_idxs), "inputs_in_place": len(self.fixed_ptrs),
                "outputs_lent": len(self.lent_idxs), "outputs_copied": len(self.copied_out_idxs)}

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
        if self.family.pool is None:  # the family's first capture (NOTE: The first, un-graphed step ...)
            release_cached_segments()
        self.written_copied = [i for i in self.copy_idxs if i in self.written_idxs]
        self.chosen = self._choose_candidate()
        if self.kind == "forward":
            self.family.forward_chosen, self.family.forward_measured = self.chosen, bool(self.measured_ms)
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
        lend = [j for j in user_visible if (self.kind == "backward" or j in self.lent_outputs)
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
        if self.kind == "forward" or self.lent_outputs:  # the parameters whose .grad they become
            self.family.grad_owners = [weakref.ref(args[i]) for i in sorted(self.fixed_ptrs)
                                       if i in self.static_input_idxs and args[i].requires_grad]
        if self.kind != "backward":  # the instance whose parameters it reads (instances.py)
            self.family.instances.bind(self.family, args, self.static_input_idxs)
        if self.kind == "forward":  # where its backward's saved inputs will be, in this family alone
            self.family.instances.captured(self.family, [self.static_outputs[j] for j in saved])
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
        """The candidate to replay: the strategy's choice (choice.py), unmeasured or from every
        candidate captured and timed (`_measure`). A strategy's choice the graph lacks raises
        (the capture then fails and the graph runs without it, with one warning). A runner for
        another model instance replays what the graph's first capture of its kind chose, unmeasured."""
        if len(self.candidates) == 1:
            return next(iter(self.candidates))
        chosen = self.family.instances.chosen
        if self.first is not None and chosen.get(self.kind) in self.candidates:  # another instance's graph
            log.info("apollo: %s replays %r for another model instance, as for the first", self.name, chosen[self.kind])
            return chosen[self.kind]
        pick = self._choose_anew()
        chosen.setdefault(self.kind, pick)
        return pick

    def _choose_anew(self) -> str:
        strategy = self.strategy if self.strategy is not None else in_effect()
        graph = self.facts()
        pick = strategy.unmeasured(graph)
        written: WrittenInputs | None = None
        in_place = [] if pick is not None else (  # what timing replays would write: inputs, and moments
            [self.static_inputs[i] for i in sorted(self.written_idxs.intersection(self.fixed_ptrs))]
            + (self.written_state() if self.written_state is not None else []))
        if in_place:
            written = WrittenInputs.keep(in_place)
            if written is None:
                chosen = self.predicted if self.predicted in self.candidates else (
                    "lanes" if "lanes" in self.candidates else next(iter(self.candidates)))
                pick = chosen, ("it writes inputs in place (an optimizer's update) too large to keep a copy of on "
                                "the host while its candidates are timed, so it replays the planner's prediction")
        if pick is not None:
            chosen, why = pick
            log.info("apollo: %s replays %r unmeasured: %s", self.name, chosen, why)
            return self._offered(chosen)
        try:
            allocated_before = self._measure()
        finally:
            if written is not None:  # what the timing replays wrote: as before them
                written.restore()
        best = strategy.choose(graph, dict(self.measured_ms), dict(self.candidate_pool_bytes), allocated_before)
        if self.on_measured is not None:
            self.on_measured(dict(self.measured_ms))
        log.info("apollo: %s measured %s; replaying %r", self.name,
                 ", ".join(f"{k} {v:.3f} ms" + (f" ({self.candidate_pool_bytes[k] / 2**30:.2f} GiB pool)"
                                                 if self.candidate_pool_bytes.get(k) else "")
                           for k, v in self.measured_ms.items()), best)
        return self._offered(best)

    def _offered(self, chosen: str) -> str:
        if chosen not in self.candidates:
            raise ValueError(f"the strategy chose {chosen!r}, which {self.name} does not have "
                             f"({', '.join(self.candidates)})")
        return chosen

    def facts(self) -> GraphFacts:
        """What its strategy is told of this graph when it chooses (at its capture)."""
        return GraphFacts(self.name, self.kind, tuple(self.candidates), self.max_memory_ratio,
                          will_donate=self._will_donate(), forward_chosen=self.family.forward_chosen,
                          forward_measured=self.family.forward_measured,
                          memory_first=self._memory_first_one_lane())

    def _measure(self) -> int:
        """Capture every candidate runtime (lanes, one lane, quota splits) and time its replays
        (`measured_ms`, `candidate_pool_bytes`); return the bytes allocated beside them.

        Concurrency is a prediction until measured (DESIGN.md: a fixed split was slower than
        two plain streams), so the single-stream schedule of the same subgraphs is always a
        candidate. Candidates are captured one at a time, each into a pool of its own that dies
        with it after timing (a pool outlives no graph: capturing into the pool of a deleted
        graph trips the allocator), so memory never holds two of them; the winner is captured
        again into the family's pool. Replays advance the CUDA RNG: a graph with dropout draws
        other masks afterwards than an untimed run would (still random)."""
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
        return allocated_before

    def _memory_first_one_lane(self) -> str | None:
        """Why this graph replays one lane unmeasured under a memory budget, or None
        (`choice.memory_first_reason`; apollo's strategy honours it)."""
        budget = self.max_memory_ratio is not None and "one_lane" in self.candidates
        return memory_first_reason(self.kind, tuple(self.candidates), self.max_memory_ratio,
                                   budget and self._will_donate(), self.family.backward_donates)

    def _capture_refused(self) -> str | None:
        """Why this graph is not captured, or None (graph_pool.py, NOTE: A capture needs headroom).
        The forward decides for its family, at the memory its first step used; its backward
        follows, since a backward run un-graphed beside the forward's pool, or captured after an
        un-graphed forward, needs memory the first step did not."""
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
        if self._fixed_check is None or self._fixed_check.ptrs is not self.fixed_ptrs:
            self._fixed_check = Addresses(self.fixed_ptrs)
        return self._fixed_check.hold(args)

    def _replay(self, args: list) -> list:
        for i in self.copy_idxs:
            self.static_inputs[i].copy_(args[i])
        if self.kind == "forward":  # a user input's .grad is the backward's memory too (saliency, say)
            self.family.input_owners = [weakref.ref(args[i]) for i in self.copy_idxs if args[i].requires_grad]
        launch = time.perf_counter()
        self.graph.replay()
        self.launch_host_s += time.perf_counter() - launch
        self.replays += 1
        if self.kind != "backward":
            self.family.replays += 1
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
            # the saved activations live and die together (one autograd context holds them
            # all): one fresh alias among them tells when the last forward's are released
            alias = outs[self.sentinel_idx].detach()
            outs[self.sentinel_idx] = alias
            if self.kind == "forward":
                self.family.pending = [weakref.ref(alias, self.family.instances.saved_died)]
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

    def _drop_capture(self) -> None:
        """Forget this graph's capture, to capture again at its next call: its family was released
        (instances.py, NOTE: One graph, several model instances)."""
        self.graph, self.chosen, self.lent = None, None, None
        self.static_inputs, self.static_outputs = [], []
        self.copy_idxs, self.fixed_ptrs, self.lent_idxs, self.copied_out_idxs = [], {}, [], []
        self.output_is_input, self.sentinel_idx, self.captured_shapes = {}, None, None
        self.donated_bytes = self.side_lane_donated_bytes = self.withheld_bytes = 0  # counted again at the capture

    def _route(self, args: list) -> tuple[CudaGraphRunner | None, bool | None]:
        """Which runner takes this call (instances.py, NOTE: One graph, several model instances):
        this one, another family's, or None (it runs un-graphed); and whether this one's inputs were
        found in place (None: not checked, or no longer known)."""
        instances = self.family.instances
        if instances.some_gone:  # a model instance died: release its family now, not at the next new one
            instances.release_unused()
        if self.kind == "backward":
            if len(instances.families) == 1 and not instances.eager_saved:
                return self, None
            return instances.backward_runner(self, args), None
        in_place = self.graph is not None and self._inputs_in_place(args)
        if in_place and not (self.kind == "forward" and self.family.forward_outputs_alive()):
            return self, True
        return instances.forward_runner(self, args), None

    def _unrouted(self, args: list) -> list:
        """A call no family's graph takes: a limit on instances (one warning says which), or a
        backward whose forward ran un-graphed (not counted where that was its graph's first call)."""
        self.calls += 1
        if self.kind != "backward":
            self._warn_once("instances", self.family.instances.refused)
            return self._eager(args)
        return self._eager(args, warm_up=self.family.instances.warm_up_backward)

    def __call__(self, args: list) -> list:
        call_began()  # no family is released under a call (instances.py, NOTE: A gone instance's memory ...)
        try:
            return self._call(args)
        finally:
            call_ended()

    def _call(self, args: list) -> list:
        in_place = None
        # the runner Dynamo calls; a backward finds its family's runner even where its own is disabled
        if self.first is None and self.calls > 0 and (self.disabled is None or self.kind == "backward"):
            runner, in_place = self._route(args)
            if runner is not self:
                return runner(args) if runner is not None else self._unrouted(args)
        start = time.perf_counter()
        self.calls += 1
        if self.calls > 1 and self.family.first_step_pool is not None:  # a second step began
            self.family.close_first_step()
        if (self.kind == "forward" and self.graph is not None and self.family.backward_capture_failed is not None
                and not self.family.forward_outputs_alive()):
            self._let_go()
        if self.disabled is not None or self.calls == 1:
            return self._eager(args)
        # a guard where `_route` did not check it (it found the inputs in place only for a dead forward)
        if in_place is None and self.kind == "forward" and self.family.forward_outputs_alive():
            self._warn_once("pending", "the previous forward's saved activations are still alive "
                                       "(two forwards before a backward, or retain_graph=True)")
            return self._eager(args)
        moved = self.graph is not None and not (in_place if in_place is not None else self._inputs_in_place(args))
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
            moved = not self._inputs_in_place(args)
        if moved:
            self._warn_once("moved", "an input captured in place (a parameter or a saved activation) now lives "
                                     "at another address: parameters replaced (p.data = ...), or saved "
                                     "activations of a forward that ran without its CUDA graph")
            return self._eager(args)
        if self.family.lent is not None and not self.family.lent.reclaim(self.family.grad_owners,
                                                                           self.family.input_owners):
            self._warn_once("lent", "a gradient the previous backward handed out in the graph's memory is "
                                    "still referenced through a view or another tensor")
            return self._eager(args)
        outs = self._replay(args)
        self.replay_host_s += time.perf_counter() - start
        return outs
