"""Replay a graph's whole runtime, every lane, as one CUDA graph: the runner Dynamo calls.

Call 1 runs the runtime un-graphed (Inductor and Triton compile their kernels lazily, which must
not happen under capture); call 2 chooses a candidate runtime (``candidates.py``), captures it
(``capture.py``) and replays it (``replay.py``); later calls replay. A call the graph cannot take
runs un-graphed and warns once, naming why: its family's instance has other parameters, the
previous forward's saved activations are still alive, an input moved, a lent gradient is still
held, the shapes differ from the captured ones, a CPU value is read, the family is too close to the
memory limit, or the capture failed. A failed capture loses no step: that call runs un-graphed on
the caller's inputs after what the capture held is released (docs/design/cuda-graphs.md#a-failed-capture).

Reads the graph's :class:`config.RunnerConfig` and its family (``instances.py``, which also says
which family a call replays); writes the family's records and its own counters (:meth:`summary`).
The design, with the reasons for each rule: docs/design/cuda-graphs.md.
"""

from __future__ import annotations

import time
import warnings
import weakref
from typing import Callable

import torch

from ..fallback import ApolloFallbackWarning
from . import capture
from .candidates import CandidateChoice
from .capture import capture_graph, donatable, static_inputs
from .config import MemoryPolicy, RunnerConfig
from .graph_io import host_values, input_shapes
from .graph_pool import allocating_in, memory_pressure, near_the_limit, release_cached_segments, too_close_to_the_limit
from .instances import GraphFamily, call_began, call_ended
from .replay import CapturedGraph

__all__ = ["CudaGraphRunner", "GraphFamily", "MemoryPolicy", "RunnerConfig"]


class CudaGraphRunner:
    """A boxed callable: run the runtime once, capture it, then replay it (one family's graph)."""

    def __init__(self, candidates: dict[str, Callable[[list], list]], family: GraphFamily, config: RunnerConfig,
                 first: CudaGraphRunner | None = None) -> None:
        self.candidates, self.family, self.config = candidates, family, config
        self.first = first  # for another model instance: the first family's runner, else None
        self.name, self.kind = config.name, config.kind
        self.static_input_idxs, self.saved_idxs = config.static_input_idxs, config.saved_idxs
        self.first_static = min(config.static_input_idxs, default=None)  # where instances.py looks a family up
        if self.kind == "backward" and config.donated_idxs:
            family.backward_donates = True  # compiled at the first backward, before the forward captures
        # un-graphed, launching from Python is the bottleneck and extra streams only add launch work
        # (docs/design/cuda-graphs.md#un-graphed-calls-run-one-lane)
        self.fn = candidates.get("one_lane", candidates["lanes"])
        self.chooser = CandidateChoice(candidates, config, family, another_instance=first is not None)
        self.captured: CapturedGraph | None = None
        self.calls = self.replays = self.ungraphed_calls = 0
        self.disabled: str | None = None  # why it runs un-graphed from now on
        self.capture_refused: str | None = None  # not captured by design (capture headroom)
        # host time of the replayed calls (checks, input copies, launch, outputs) and of their launches
        self.replay_host_s = self.launch_host_s = 0.0
        self._warned: set[str] = set()
        self._boxed_call = True
        family.runners.append(weakref.ref(self))

    @property
    def graph(self):
        """The captured CUDA graph, or None."""
        return self.captured.graph if self.captured is not None else None

    @property
    def chosen(self) -> str | None:
        """The candidate captured, or None."""
        return self.captured.chosen if self.captured is not None else None

    def for_family(self, family: GraphFamily, warm: bool) -> CudaGraphRunner:
        """This graph's runner for another model instance's `family` (`warm`: the runtime ran
        once, so it captures at its first call)."""
        other = CudaGraphRunner(self.candidates, family, self.config, first=self)
        other.calls = 1 if warm else 0
        return other

    def drop_capture(self) -> None:
        """Forget this graph's capture, to capture again at its next call (its family was released)."""
        if self.captured is not None:
            self.launch_host_s += self.captured.launch_host_s
        self.captured = None

    def capture_refusal(self) -> str | None:
        """Why this graph is not captured, or None (docs/design/cuda-graphs.md#capture-headroom).
        The forward decides for its family, at the memory its first step used; its backward
        follows, since a backward run un-graphed beside the forward's pool, or captured after an
        un-graphed forward, needs memory the first step did not."""
        if self.kind == "backward":
            return self.family.capture_refused
        why = None
        headroom = self.config.memory.capture_headroom
        # a whole step captured regardless (headroom None) reads no pressure
        if (headroom is not None or self.kind == "forward") and (pressure := memory_pressure()) is not None:
            if headroom is not None:
                why = too_close_to_the_limit(*pressure, headroom=headroom)
            else:  # a forward captured regardless (cudagraphs=True): memory first, both graphs
                self.family.near_limit = near_the_limit(*pressure)
        if self.kind == "forward":
            self.family.capture_refused = why
        return why

    def summary(self) -> dict:
        """What it did; `replays` and `ungraphed_calls` add up those of its runners for the other
        model instances it served (`instances` families, `instances_released` freed)."""
        instances = self.family.instances
        others = [r for (_, kind), r in instances.copies.items() if kind == self.kind] if self.first is None else []
        c, choice = self.captured, self.chooser
        launch = self.launch_host_s + (c.launch_host_s if c is not None else 0.0)
        return {"replays": self.replays + sum(r.replays for r in others), "chosen": self.chosen,
                "instances": len(instances.families), "instances_released": instances.released,
                "measured_ms": dict(choice.measured_ms),
                "replay_host_ms": round(1e3 * self.replay_host_s / self.replays, 4) if self.replays else None,
                "launch_host_ms": round(1e3 * launch / self.replays, 4) if self.replays else None,
                "measuring_left_bytes": choice.measuring_left_bytes,
                "captured_bytes": c.captured_bytes if c is not None else 0,
                "candidate_pool_bytes": dict(choice.candidate_pool_bytes),
                "family_pool_bytes": c.family_pool_bytes if c is not None else None,
                "peak_after_capture": c.peak_after_capture if c is not None else 0,
                "donated_bytes": c.donated_bytes if c is not None else 0,
                "side_lane_donated_bytes": c.side_lane_donated_bytes if c is not None else 0,
                "withheld_bytes": c.withheld_bytes if c is not None else 0,
                "ungraphed_calls": self.ungraphed_calls + sum(r.ungraphed_calls for r in others),
                "disabled": self.disabled, "capture_refused": self.capture_refused,
                "lent_moved": c.lent.moved if c is not None and c.lent is not None else 0,
                # per replay: inputs copied into the graph's buffers / read in place, outputs lent / copied
                "inputs_copied": len(c.copy_idxs) if c else 0, "inputs_in_place": len(c.fixed_ptrs) if c else 0,
                "outputs_lent": len(c.lent_idxs) if c else 0, "outputs_copied": len(c.copied_out_idxs) if c else 0}

    # -- running un-graphed ---------------------------------------------------------------
    def _warn_once(self, key: str, why: str) -> None:
        self._say_once(key, f"apollo: {self.name} runs without its CUDA graph because {why} (correct, but slower)")

    def _say_once(self, key: str, message: str) -> None:
        """One ApolloFallbackWarning per runner and `key`, pointing at the caller's caller."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, ApolloFallbackWarning, stacklevel=4)

    def _eager(self, args: list, warm_up: bool = False) -> list:
        """Run the runtime un-graphed; `warm_up`: as part of the graph's first step, not counted."""
        if self.calls > 1 and not warm_up:
            self.ungraphed_calls += 1
        # a first call runs in the first step's pool: the forward's opens it, the backward's closes
        # it (docs/design/cuda-graphs.md#the-first-step-pool)
        first_call = self.calls == 1
        pool = self.family.open_first_step(args, self.kind) if first_call else None
        # an un-graphed forward of a graph that captures: its backward runs un-graphed too (instances.py)
        inputs = static = None
        if self.kind == "forward" and self.disabled is None:
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            static = {args[i].data_ptr() for i in self.static_input_idxs if isinstance(args[i], torch.Tensor)}
        try:
            with allocating_in(pool):
                outs = self.fn(args)
            self.family.instances.warm.add(self.kind)
            if inputs is not None:
                self.family.instances.ran_eagerly([o for j, o in enumerate(outs) if isinstance(o, torch.Tensor)
                                                   and not self.config.is_user_visible(j)
                                                   and o.data_ptr() not in static], first_call, inputs)
            return outs
        except torch.OutOfMemoryError as e:
            if self.disabled is not None and self.capture_refused is None and hasattr(e, "add_note"):
                e.add_note(f"apollo: {self.name} runs without its CUDA graph because its capture failed "
                           f"({self.disabled[:120]}), beside the graph pool its family keeps, whose free memory "
                           "this run cannot use (docs/design/cuda-graphs.md#capture-headroom). Once this step's "
                           "tensors are gone the family runs without its graphs; cudagraphs=False trains this "
                           "size that way from the start.")
            raise
        finally:
            if first_call and self.kind != "forward":
                self.family.close_first_step()

    def _let_go(self) -> None:
        """A forward whose backward failed to capture drops its graph and the memory it owns in the
        family's pool: un-graphed, the backward cannot use that pool's free memory, and near the
        limit it would run out at every step (docs/design/cuda-graphs.md#a-failed-capture). Called
        only once the last forward's saved activations are dead."""
        self.disabled = f"its backward's CUDA-graph capture failed ({self.family.backward_capture_failed[:200]})"
        self.drop_capture()
        self.family.owners.clear()
        self._warn_once("capture", self.disabled)

    def _capture_failed(self) -> None:
        """After a capture raised (outside the except block: the traceback held the failed
        capture's frames and so its graph and temporaries): warn once, and give the memory the
        capture held back before the un-graphed retry needs it."""
        self._warn_once("capture", f"CUDA-graph capture failed ({self.disabled})")
        if self.kind == "backward":
            self.family.backward_capture_failed = self.disabled
        elif self.kind == "forward":  # its backward follows: captured after an un-graphed forward, it needs more
            self.family.capture_refused = f"its forward's CUDA-graph capture failed ({self.disabled[:200]})"
        if not any(r() is not None and r().captured is not None for r in self.family.runners):
            self.family.pool = None  # no graph uses the pool the failed capture opened
        release_cached_segments()

    # -- a call ----------------------------------------------------------------------------
    def _capture(self, args: list) -> None:
        static = static_inputs(args, self.config, self.family)
        if self.family.pool is None:  # the family's first capture (docs/design/cuda-graphs.md#the-first-step-pool)
            release_cached_segments()
        capturer = self.config.capturer if self.config.capturer is not None else capture.in_effect()
        chosen = self.chooser.choose(static, bool(donatable(static, self.config, self.family)), capturer)
        if self.family.near_limit is not None and chosen == "one_lane" and "lanes" in self.candidates \
                and not self.chooser.measured_ms:
            self._say_once("near-limit", f"apollo: {self.name} replays one lane, unmeasured, because "
                           f"{self.family.near_limit}: captured there (cudagraphs=True), the backward's capture "
                           "reuses the saved activations' memory only on one stream")
        self.captured = capture_graph(self.candidates[chosen], chosen, args, static, self.config, self.family,
                                      capturer)

    def _route(self, args: list) -> tuple[CudaGraphRunner | None, bool | None]:
        """Which runner takes this call: this one, another family's, or None (it runs un-graphed);
        and whether this one's inputs were found in place (None: not checked)."""
        instances = self.family.instances
        if instances.some_gone:  # a model instance died: release its family now, not at the next new one
            instances.release_unused()
        if self.kind == "backward":
            if len(instances.families) == 1 and not instances.eager_saved:
                return self, None
            return instances.backward_runner(self, args), None
        in_place = self.captured is not None and self.captured.inputs_in_place(args)
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
        call_began()  # no family is released under a call (instances.py)
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
        elif self.kind == "backward" and self.first is None and self.family.instances.eager_saved:
            self.family.instances.backward_takes(self, args)  # a first call, un-graphed anyway: not routed
        start = time.perf_counter()
        self.calls += 1
        if self.calls > 1 and self.family.first_step_pool is not None:  # a second step began
            self.family.close_first_step()
        if (self.kind == "forward" and self.captured is not None and self.family.backward_capture_failed is not None
                and not self.family.forward_outputs_alive()):
            self._let_go()
        if self.disabled is not None or self.calls == 1:
            return self._eager(args)
        # a guard where `_route` did not check it (it found the inputs in place only for a dead forward)
        if in_place is None and self.kind == "forward" and self.family.forward_outputs_alive():
            self._warn_once("pending", "the previous forward's saved activations are still alive "
                                       "(two forwards before a backward, or retain_graph=True)")
            return self._eager(args)
        moved = self.captured is not None and not (
            in_place if in_place is not None else self.captured.inputs_in_place(args))
        if self.config.symbolic and self.captured is not None:
            if input_shapes(args) != self.captured.captured_shapes:
                self._warn_once("shape", "it was called at input shapes other than those it was captured at "
                                         "(dynamic shapes); calls at the captured shapes replay it")
                return self._eager(args)
        if self.captured is None:
            if host := host_values(args):
                x = args[host[0]]
                self.disabled = (f"its input {host[0]} is a CPU tensor ({x.dtype}, shape {tuple(x.shape)}; a Python "
                                 "float that changes between calls is passed so), whose value a replay would not "
                                 "read again; pass it as a CUDA tensor to keep the graph")
                self._warn_once("host", self.disabled)
                return self._eager(args)
            self.capture_refused = self.disabled = self.capture_refusal()
            if self.disabled is not None:
                self._warn_once("memory", self.disabled)
                return self._eager(args)
            try:
                self._capture(args)
                if self.config.symbolic:
                    self.captured.captured_shapes = input_shapes(args)
            except Exception as e:  # out of memory, or capture unsupported here
                self.captured, self.disabled = None, f"{type(e).__name__}: {e}"
            if self.disabled is not None:  # this step runs un-graphed, on the caller's untouched inputs
                self._capture_failed()
                return self._eager(args)
            start = time.perf_counter()  # capturing and measuring took seconds: not a replay's host time
            moved = not self.captured.inputs_in_place(args)
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
        outs = self.captured.replay(args, self.family)
        self.replays += 1
        self.replay_host_s += time.perf_counter() - start
        return outs
