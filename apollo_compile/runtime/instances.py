"""One compiled graph, several model instances: which family of CUDA graphs a call replays.

[NOTE] One graph, several model instances. Dynamo keys compiled graphs by code object, not by
module instance, so one compiled graph serves every instance of a class that reaches it:

- the repeated blocks of a model compiled block by block (regional compilation, accelerate's
  ``compile_regions``), or of a model with a graph break inside its decoder layer, whose forward
  then becomes a frame of its own, called once per layer with that layer's parameters;
- a second model of the class: an ensemble, a sweep's next run, a notebook cell run again;
- one instance twice before its backward: two views through one encoder, two forwards first.

A CUDA graph reads the parameters of the instance it was captured for in place, and its saved
activations stay valid only until its next replay. So the runner Dynamo calls dispatches. A
forward (or a whole step's graph) replays the family (``cudagraph.GraphFamily``: a forward, its
backward, a pool) bound to the parameters at this call's addresses whose last forward's saved
activations are dead; where there is none, it binds a free family or a new one and captures it at
that call (no un-graphed warm-up: the graph's first call compiled the kernels). A backward finds
its family by its saved activations, which the family's forward wrote at addresses only it uses
(``GraphInstances.backward_runner``), and is captured at its first call (its second where the
graph's backward has never run); where its forward ran un-graphed, it runs un-graphed too.
The first family keeps its runners (the ones Dynamo calls); the others get copies of them
(``CudaGraphRunner.for_family``), which replay the first one's choice of candidate unmeasured.

A family whose instance is gone (every parameter it reads is dead: weak references, whose callback
releases it at once where it can, NOTE: A gone instance's memory goes at once) or whose parameters
now live elsewhere (``p.data = ...``, found at the graph's next dispatch) is released: its graphs and
pool go, and the family serves the next new instance. Limits,
past which a call runs without the CUDA graph, with one warning that says which: MAX_FAMILIES per
graph; MAX_PER_INSTANCE forwards of one instance awaiting their backwards; and no new captures once
MAX_SHORT_LIVED families were released before replaying MIN_REPLAYS times (a new instance every
step would make every step a capture).

[NOTE] A gone instance's memory goes at once. Released only at the graph's next dispatch, a family
outlived its model wherever that graph was never called again: a notebook that compiles a new model
with other options, a sweep whose runs differ in their options (Dynamo compiles anew for another
backend configuration). The family's static inputs (aliases of the old parameters), graphs and pool
then stayed allocated until ``torch._dynamo.reset()``: measured on the H200 (session 51, HF SigLIP
base at batch 8, probes/whole_step_memory.py running variants one after another), the deleted
model's 0.76 GiB of parameters and its 1.45 GiB graph pool held through the next variant, which
reduce-overhead's model did not. So the parameters' weak-reference callback releases the family
itself once every parameter it reads is dead and its last forward's saved activations are too (a
callback on their alias tries again when they die). Not while an apollo graph is being called or
captured on any thread, nor while this thread's stream captures: a collection can run inside a
call, whose families it would change under it, and a capture cannot free a graph. Then the
family is released at the graph's next dispatch, as before.

CUDA-graph trees record a graph per parameter set as well (a static input at another address
re-records without counting to their limit), all in one pool whose liveness the tree tracks; here
each family has a pool of its own, so each family's graphs hold their own temporaries. Measured
before this (session 48, H100): three live copies of HF CLIP B/16 at batch 8, the copies after the
first ran un-graphed at 56-59 ms a step against 15.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Sequence

import torch

from .graph_io import Addresses

if TYPE_CHECKING:
    from .cudagraph import CudaGraphRunner, GraphFamily

__all__ = ["GraphInstances", "MAX_FAMILIES", "MAX_PER_INSTANCE", "MAX_SHORT_LIVED", "MIN_REPLAYS", "call_began",
           "call_ended"]

log = logging.getLogger("apollo_compile")

MAX_FAMILIES = 128  # NOTE: One graph, several model instances
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


_calls_underway = 0  # apollo graph calls in progress, on any thread (NOTE: A gone instance's memory goes at once)
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


class GraphInstances:
    """The families one compiled graph is captured for (NOTE: One graph, several model instances),
    shared by them, and the choice of which one a call replays."""

    def __init__(self, first: GraphFamily) -> None:
        self.families: list[GraphFamily] = [first]
        self.copies: dict[tuple[int, str], CudaGraphRunner] = {}  # (id(family), kind) -> its runner, beyond the first's
        # the bound families by the address of their first parameter (None: a graph without any), so
        # that a call checks the few bound to it, not all: a model compiled layer by layer has one per layer
        self.by_address: dict[int | None, list[GraphFamily]] = {}
        self.saved_by: dict[int, GraphFamily] = {}  # data_ptr of a captured forward's saved output -> its family
        # un-graphed forwards' saved outputs while alive, and whether that forward was its runner's first call
        self.eager_saved: list[tuple[weakref.ref, set[int], bool]] = []
        self.warm_up_backward = False  # the backward last sent un-graphed belongs to a first call's forward
        self.chosen: dict[str, str] = {}  # graph kind -> the candidate its first capture replays
        self.warm: set[str] = set()  # graph kinds whose runtime has run once (its kernels are compiled)
        self.released = 0
        self.short_lived = 0
        self.some_gone = False  # a parameter a family reads died since the last check
        self.releasing = False  # a weak-reference callback is releasing families (`_died`)
        self.refused: str | None = None  # why the last call found no family to replay

    # -- which family ----------------------------------------------------------------------
    def runner(self, family: GraphFamily, first: CudaGraphRunner) -> CudaGraphRunner:
        """`family`'s runner of `first`'s graph (`first`: the first family's, which Dynamo calls)."""
        if family is first.family:
            return first
        key = (id(family), first.kind)
        runner = self.copies.get(key)
        if runner is None:
            runner = self.copies[key] = first.for_family(family, warm=first.kind in self.warm)
        return runner

    def forward_runner(self, first: CudaGraphRunner, args: Sequence) -> CudaGraphRunner | None:
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

    def backward_runner(self, first: CudaGraphRunner, args: Sequence) -> CudaGraphRunner | None:
        """The runner a backward call replays: its forward's family's, found by the first saved
        activation whose address a family's forward wrote; None where its forward ran un-graphed."""
        self.eager_saved = [record for record in self.eager_saved if record[0]() is not None]
        for i in first.saved_idxs if first.saved_idxs is not None else range(len(args)):
            x = args[i]
            if not isinstance(x, torch.Tensor):
                continue
            ptr = x.data_ptr()
            family = self.saved_by.get(ptr)
            if family is not None:
                return self.runner(family, first)
            for _, ptrs, warm_up in self.eager_saved:
                if ptr in ptrs:
                    self.warm_up_backward = warm_up
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
        release what is gone now where that is safe (NOTE: A gone instance's memory goes at once),
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
        which waited for them is released now (NOTE: A gone instance's memory goes at once)."""
        if self.some_gone:
            self._died(ref)

    def captured(self, family: GraphFamily, saved: list[torch.Tensor]) -> None:
        """A forward of `family` was captured: its saved outputs live at these addresses."""
        for t in saved:
            self.saved_by[t.data_ptr()] = family

    def ran_eagerly(self, saved: list[torch.Tensor], warm_up: bool) -> None:
        """A forward ran un-graphed (`warm_up`: as its runner's first call): its backward must too.
        Held while its saved outputs live."""
        self.eager_saved = [record for record in self.eager_saved if record[0]() is not None]
        if saved:
            self.eager_saved.append((weakref.ref(saved[0]), {t.data_ptr() for t in saved}, warm_up))
