"""One compiled graph, several model instances: the state a family of CUDA graphs shares and
which family a call replays.

Dynamo keys compiled graphs by code object, not by module instance, so one compiled graph serves
every instance of a class that reaches it (regional compilation, an ensemble, two forwards of one
instance before its backward). A CUDA graph reads the parameters it was captured for in place, so
each model instance gets a :class:`GraphFamily` (a forward, its backward, a pool) and
:class:`GraphInstances` picks the family a call replays: by the addresses of its parameters for a
forward, by those of its saved activations for a backward. A family whose instance is gone is
released, at once where that is safe. Why, and the limits past which a call runs un-graphed:
docs/design/cuda-graphs.md#one-graph-several-model-instances and
docs/design/cuda-graphs.md#a-gone-instances-memory-goes-at-once.

Reads the calls' inputs; writes the families' bindings. The runner (``cudagraph.py``) depends on
this module, never the other way: what it needs of a runner is the :class:`FamilyRunner` protocol.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from .graph_io import Addresses, LentOutputs
from .graph_pool import first_step_pool

__all__ = ["FamilyRunner", "GraphFamily", "GraphInstances", "MAX_FAMILIES", "MAX_PER_INSTANCE", "MAX_SHORT_LIVED",
           "MIN_REPLAYS", "call_began", "call_ended"]

log = logging.getLogger("apollo_compile")

MAX_FAMILIES = 128  # docs/design/cuda-graphs.md#one-graph-several-model-instances
# forwards of one instance awaiting their backwards, each in a family of its own: a multi-view step
# (SimCLR, DINO's global crops) has 2, gradient accumulation with every forward first a few, a layer
# shared across depth (ALBERT) 12 when it is compiled on its own or breaks the graph; past this,
# more likely a loop that keeps every step's loss and so its activations (a family per step)
MAX_PER_INSTANCE = 32
# a family released before replaying this often (its capture call included) was short-lived, and
# once this many were, new instances are not captured: a new instance every step would make every
# step a capture, while a fresh model per evaluation of a few batches still gets its graphs
MIN_REPLAYS = 3
MAX_SHORT_LIVED = 3


# apollo graph calls in progress, on any thread (docs/design/cuda-graphs.md#a-gone-instances-memory-goes-at-once)
_calls_underway = 0
# held while a call begins or ends, and while a callback releases families, so that no call begins
# under a release on another thread; reentrant: a release frees tensors, whose callbacks come back here
_calls_lock = threading.RLock()


def call_began() -> None:
    """A runner's call (its capture included) began: no family is released until `call_ended`."""
    global _calls_underway
    with _calls_lock:
        _calls_underway += 1


def call_ended() -> None:
    global _calls_underway
    with _calls_lock:
        _calls_underway -= 1


def releasable_now() -> bool:
    """Whether a gone instance's family may be released here and now: no apollo graph call or
    capture underway, and this thread's stream not capturing (someone else's CUDA graph). Asked
    holding `_calls_lock`."""
    if _calls_underway:
        return False
    try:
        return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:  # CUDA in a state that cannot say: leave it to the next dispatch
        return False


class FamilyRunner(Protocol):
    """What the families need of a graph's runner (``cudagraph.FamilyRunner``)."""

    kind: str
    family: GraphFamily
    first_static: int | None  # where a call's first parameter is (by_address's key)
    static_input_idxs: frozenset[int]
    saved_idxs: tuple[int, ...] | None

    def for_family(self, family: GraphFamily, warm: bool) -> FamilyRunner:
        """This graph's runner for another family; `warm`: the runtime ran once."""

    def drop_capture(self) -> None:
        """Forget the capture, to capture again at the next call (its family was released)."""


class GraphFamily:
    """State shared by the CUDA graphs of one Dynamo graph (forward + backward) for one model
    instance: one pool, so the backward reuses the forward's freed intermediates, and the
    forward's saved outputs, which the backward reads in place."""

    def __init__(self, instances: GraphInstances | None = None) -> None:
        self.pool = None
        self.saved_ptrs: set[int] = set()  # data_ptrs of the forward's captured outputs
        self.pending: list[weakref.ref] = []  # aliases handed out by the last forward replay
        self.lent: LentOutputs | None = None  # the backward's gradients, handed out in the pool
        self.grad_owners: list[weakref.ref] = []  # the forward's parameters, whose .grad they become
        self.input_owners: list[weakref.ref] = []  # the last forward replay's inputs that require grad
        # data_ptr -> the forward's outputs' memory (docs/design/cuda-graphs.md#donation)
        self.owners: dict[int, torch.UntypedStorage] = {}
        self.backward_donates = False  # the backward may reuse saved activations (set when it is compiled)
        self.forward_chosen: str | None = None  # the candidate the forward replays, once captured
        self.forward_measured = False  # ... chosen by timing its candidates (choice.py)
        self.capture_refused: str | None = None  # why the forward was not captured (capture headroom)
        self.near_limit: str | None = None  # why it is captured memory first (cudagraphs=True past the headroom)
        self.backward_capture_failed: str | None = None  # why; the forward then lets its graph go
        # side lane -> its stream, the same in every graph of the family (cuda-graphs.md#donation-on-side-lanes)
        self.side_streams: dict[int, torch.cuda.Stream] = {}
        # the first step's own memory pool while that step runs (cuda-graphs.md#the-first-step-pool)
        self.first_step_pool: tuple[object, torch.device] | None = None
        self.first_step_opened = False
        # the model instance it serves: its parameters' addresses (None: free), weak references to
        # them, its forward's replays since bound
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
                runner.drop_capture()


def _saved_tensors(first: FamilyRunner, args: Sequence):
    """The tensors among a backward call's saved values (all of its arguments where the runner
    does not know which are saved)."""
    for i in first.saved_idxs if first.saved_idxs is not None else range(len(args)):
        if isinstance(args[i], torch.Tensor):
            yield args[i]


@dataclass
class EagerSaved:
    """One saved output of a forward that ran un-graphed: its backward runs un-graphed too."""

    ref: weakref.ref
    warm_up: bool  # the forward was its runner's first call (its backward's un-graphed run is not counted)
    borrowed: bool  # an input saved as-is, not written by the forward: it may outlive the step


class GraphInstances:
    """The families one compiled graph is captured for (docs/design/cuda-graphs.md#one-graph-several-model-instances),
    shared by them, and the choice of which one a call replays."""

    def __init__(self, first: GraphFamily) -> None:
        self.families: list[GraphFamily] = [first]
        self.copies: dict[tuple[int, str], FamilyRunner] = {}  # (id(family), kind) -> its runner, beyond the first's
        # the bound families by the address of their first parameter (None: a graph without any), so
        # that a call checks the few bound to it, not all: a model compiled layer by layer has one per layer
        self.by_address: dict[int | None, list[GraphFamily]] = {}
        self.saved_by: dict[int, GraphFamily] = {}  # data_ptr of a captured forward's saved output -> its family
        # the address of each saved output of an un-graphed forward -> its records there (a view and its
        # base alike): an address counts only while a tensor saved at it lives, since a freed one's
        # address is soon another tensor's; one that is an input saved as-is counts until its backward
        self.eager_saved: dict[int, list[EagerSaved]] = {}
        self.warm_up_backward = False  # the backward last sent un-graphed belongs to a first call's forward
        self.chosen: dict[str, str] = {}  # graph kind -> the candidate its first capture replays
        self.warm: set[str] = set()  # graph kinds whose runtime has run once (its kernels are compiled)
        self.released = 0
        self.short_lived = 0
        self.some_gone = False  # a parameter a family reads died since the last check
        self.releasing = False  # a weak-reference callback is releasing families (`_died`)
        self.refused: str | None = None  # why the last call found no family to replay

    # -- which family ----------------------------------------------------------------------
    def runner(self, family: GraphFamily, first: FamilyRunner) -> FamilyRunner:
        """`family`'s runner of `first`'s graph (`first`: the first family's, which Dynamo calls)."""
        if family is first.family:
            return first
        key = (id(family), first.kind)
        runner = self.copies.get(key)
        if runner is None:
            runner = self.copies[key] = first.for_family(family, warm=first.kind in self.warm)
        return runner

    def forward_runner(self, first: FamilyRunner, args: Sequence) -> FamilyRunner | None:
        """The runner a forward (or whole-step) call replays: that of the family bound to its
        parameters whose last forward's saved activations are dead, else of a family bound to them
        here (free or new: captured at this call); None where a limit stops that (`refused` says
        which)."""
        awaiting = 0
        for family in self.by_address.get(self._address(args, first.first_static), ()):
            if family.key.hold(args):
                if not family.forward_outputs_alive():
                    return self.runner(family, first)
                awaiting += 1
        self.release_unused()
        free = next((f for f in self.families if f.key is None), None)
        self.refused = self._refusal(awaiting if first.static_input_idxs else 0, free is None)
        if self.refused is not None:
            return None
        if free is None:
            free = first.family.sibling()
            self.families.append(free)
        self.bind(free, args, first.static_input_idxs)
        return self.runner(free, first)

    @staticmethod
    def _address(args: Sequence, position: int | None) -> int | None:
        """The address of the call's first parameter, at `position` (by_address's key)."""
        return args[position].data_ptr() if position is not None and isinstance(args[position], torch.Tensor) else None

    def _refusal(self, awaiting: int, new: bool) -> str | None:
        if awaiting >= MAX_PER_INSTANCE:
            return (f"{awaiting + 1} forwards of one model instance await their backwards (at most "
                    f"{MAX_PER_INSTANCE} are captured, a family each: runtime/instances.py)")
        if self.short_lived >= MAX_SHORT_LIVED:
            return (f"{self.short_lived} model instances it served were replaced within {MIN_REPLAYS} calls, so new "
                    "ones are not captured (each would cost a capture for a replay or two: runtime/instances.py)")
        if new and len(self.families) >= MAX_FAMILIES:
            return (f"it is captured for {MAX_FAMILIES} model instances already, the most one graph keeps "
                    "(runtime/instances.py)")
        return None

    def backward_runner(self, first: FamilyRunner, args: Sequence) -> FamilyRunner | None:
        """The runner a backward call replays: its forward's family's, found by the first saved
        activation whose address a family's forward wrote; None where its forward ran un-graphed."""
        self._forget_dead_eager_saved()
        for x in _saved_tensors(first, args):
            ptr = x.data_ptr()
            family = self.saved_by.get(ptr)
            if family is not None:
                return self.runner(family, first)
            if (eager := self.eager_saved.get(ptr)) is not None:
                self.warm_up_backward = eager[-1].warm_up
                self.backward_takes(first, args)
                return None
        return first

    # -- what each family serves -------------------------------------------------------------
    def bind(self, family: GraphFamily, args: Sequence, static_idxs: set[int]) -> None:
        """`family` now serves the parameters (static inputs) of this call, at their addresses."""
        self._unindex(family)
        positions = sorted(i for i in static_idxs if isinstance(args[i], torch.Tensor))
        family.key = Addresses({i: args[i].data_ptr() for i in positions})
        family.served = [weakref.ref(args[i], self._died) for i in positions]
        self.by_address.setdefault(self._address(args, min(static_idxs, default=None)), []).append(family)

    def _unindex(self, family: GraphFamily) -> None:
        for bound in self.by_address.values():
            if family in bound:
                bound.remove(family)

    def _died(self, ref: weakref.ref) -> None:
        """A parameter a family reads died (or the alias of its last forward's saved activations):
        release what is gone now where that is safe (docs/design/cuda-graphs.md#a-gone-instances-memory-goes-at-once),
        else at the graph's next dispatch."""
        self.some_gone = True
        if self.releasing:  # a tensor this release freed: the release under way sees to it
            return
        with _calls_lock:  # no call begins on another thread while this releases
            if not releasable_now():
                return
            self.releasing = True
            try:
                self.release_unused()
            except Exception as e:  # an interpreter shutting down, say: the next dispatch (if any) tries again
                self.some_gone = True
                log.debug("apollo: a gone model instance's family is released later: %s", e)
            finally:
                self.releasing = False

    def release_unused(self) -> None:
        """Release every family whose instance is gone or whose parameters moved, once the
        activations its last forward saved are dead."""
        self.some_gone = False
        for family in self.families:
            if family.key is None or not family.unused():
                continue
            if family.forward_outputs_alive():
                self.some_gone = True  # checked again when they die (`saved_died`) or at the next dispatch
                continue
            if family.replays < MIN_REPLAYS:
                self.short_lived += 1
            self.saved_by = {ptr: f for ptr, f in self.saved_by.items() if f is not family}
            self._unindex(family)
            family.release()
            self.released += 1

    def saved_died(self, ref: weakref.ref) -> None:
        """The alias of a forward's saved activations died: a family whose instance is gone and
        which waited for them is released now (docs/design/cuda-graphs.md#a-gone-instances-memory-goes-at-once)."""
        if self.some_gone:
            self._died(ref)

    def captured(self, family: GraphFamily, saved: list[torch.Tensor]) -> None:
        """A forward of `family` was captured: its saved outputs live at these addresses."""
        for t in saved:
            self.saved_by[t.data_ptr()] = family

    def ran_eagerly(self, saved: list[torch.Tensor], warm_up: bool, inputs: set[int]) -> None:
        """A forward ran un-graphed (`warm_up`: as its runner's first call): its backward must too.
        Each saved output's address is held while that output lives; one whose storage is among
        `inputs` (the forward's inputs' storages: saved as-is, say a reused batch's token ids, which
        can outlive the step) only until a backward reads it (`backward_takes`)."""
        self._forget_dead_eager_saved()
        for t in saved:
            record = EagerSaved(weakref.ref(t), warm_up, t.untyped_storage().data_ptr() in inputs)
            self.eager_saved.setdefault(t.data_ptr(), []).append(record)

    def backward_takes(self, first: FamilyRunner, args: Sequence) -> None:
        """A backward reads its saved values `args` (routed, or its runner's first call): the inputs
        its forward saved as-is route no later backward."""
        for x in _saved_tensors(first, args):
            if records := self.eager_saved.get(x.data_ptr()):
                borrowed = next((r for r in records if r.borrowed), None)
                if borrowed is not None:
                    records.remove(borrowed)
                    if not records:
                        del self.eager_saved[x.data_ptr()]

    def _forget_dead_eager_saved(self) -> None:
        alive = ((ptr, [r for r in records if r.ref() is not None]) for ptr, records in self.eager_saved.items())
        self.eager_saved = {ptr: records for ptr, records in alive if records}
