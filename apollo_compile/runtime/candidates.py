"""Which candidate runtime a graph replays: its strategy asked at the capture step, each candidate
captured and timed where the strategy wants times, and the inputs the timing replays write put
back afterwards.

:class:`CandidateChoice` reads the static inputs and the family's record of what the forward
chose; it writes the times and pools it measured (``measured_ms``, ``candidate_pool_bytes``) and
the family's ``forward_chosen``. The strategies themselves are ``choice.py``; a graph that writes
its inputs while timed: docs/design/cuda-graphs.md#a-graph-that-writes-its-inputs.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .capture import Capturer, StaticInputs
from .choice import GraphFacts, in_effect, memory_first_reason
from .config import RunnerConfig
from .graph_io import WrittenInputs
from .graph_pool import pool_bytes
from .instances import GraphFamily

__all__ = ["CandidateChoice"]

log = logging.getLogger("apollo_compile")


class CandidateChoice:
    """The choice of one graph's candidate, made once per capture (`choose`). `another_instance`:
    the runner serves another model instance than the graph's first, and replays what the first
    capture of its kind chose, unmeasured."""

    def __init__(self, candidates: dict[str, Callable[[list], list]], config: RunnerConfig, family: GraphFamily,
                 another_instance: bool = False) -> None:
        self.candidates, self.config, self.family = candidates, config, family
        self.another_instance = another_instance
        self.measured_ms: dict[str, float] = {}  # candidate -> ms per replay, once measured
        self.candidate_pool_bytes: dict[str, int | None] = {}  # candidate -> its capture's pool (pool_bytes)
        self.measuring_left_bytes = 0  # memory still allocated after the candidates were measured

    def facts(self, will_donate: bool) -> GraphFacts:
        """What the strategy is told of this graph (`will_donate`: a backward whose capture takes
        over saved activations)."""
        c = self.config
        return GraphFacts(c.name, c.kind, tuple(self.candidates), c.memory.lane_memory_ratio,
                          will_donate=will_donate, forward_chosen=self.family.forward_chosen,
                          forward_measured=self.family.forward_measured,
                          memory_first=self.memory_first_reason(will_donate))

    def memory_first_reason(self, will_donate: bool) -> str | None:
        """Why this graph replays one lane unmeasured, or None: under a memory budget, or where its
        family is captured near the memory limit (docs/design/cuda-graphs.md#capture-headroom)."""
        if "one_lane" not in self.candidates:
            return None
        why = ("under a memory budget" if self.config.memory.lane_memory_ratio is not None
               else "near the memory limit" if self.family.near_limit is not None else None)
        return memory_first_reason(self.config.kind, why, will_donate, self.family.backward_donates)

    def choose(self, static: StaticInputs, will_donate: bool, capturer: Capturer) -> str:
        """The candidate to replay: the strategy's choice, unmeasured or from every candidate
        captured and timed. A choice the graph lacks raises (the capture then fails and the graph
        runs without it, with one warning)."""
        if len(self.candidates) == 1:
            chosen = next(iter(self.candidates))
        else:
            first = self.family.instances.chosen
            if self.another_instance and first.get(self.config.kind) in self.candidates:
                log.info("apollo: %s replays %r for another model instance, as for the first", self.config.name,
                         first[self.config.kind])
                chosen = first[self.config.kind]
            else:
                chosen = self._choose_anew(static, will_donate, capturer)
                first.setdefault(self.config.kind, chosen)
        if self.config.kind == "forward":
            self.family.forward_chosen, self.family.forward_measured = chosen, bool(self.measured_ms)
        return chosen

    def _choose_anew(self, static: StaticInputs, will_donate: bool, capturer: Capturer) -> str:
        c = self.config
        strategy = c.strategy if c.strategy is not None else in_effect()
        graph = self.facts(will_donate)
        pick = strategy.unmeasured(graph)
        written: WrittenInputs | None = None
        in_place = [] if pick is not None else (  # what timing replays would write: inputs, and moments
            [static.values[i] for i in sorted(c.written_idxs.intersection(static.fixed_ptrs))]
            + (c.written_state() if c.written_state is not None else []))
        if in_place:
            written = WrittenInputs.keep(in_place)
            if written is None:
                chosen = c.predicted if c.predicted in self.candidates else (
                    "lanes" if "lanes" in self.candidates else next(iter(self.candidates)))
                pick = chosen, ("it writes inputs in place (an optimizer's update) too large to keep a copy of on "
                                "the host while its candidates are timed, so it replays the planner's prediction")
        if pick is not None:
            chosen, why = pick
            log.info("apollo: %s replays %r unmeasured: %s", c.name, chosen, why)
            return self._offered(chosen)
        try:
            allocated_before = self._measure(static, capturer)
        finally:
            if written is not None:  # what the timing replays wrote: as before them
                written.restore()
        best = strategy.choose(graph, dict(self.measured_ms), dict(self.candidate_pool_bytes), allocated_before)
        if c.on_measured is not None:
            c.on_measured(dict(self.measured_ms))
        log.info("apollo: %s measured %s; replaying %r", c.name,
                 ", ".join(f"{k} {v:.3f} ms" + (f" ({self.candidate_pool_bytes[k] / 2**30:.2f} GiB pool)"
                                                 if self.candidate_pool_bytes.get(k) else "")
                           for k, v in self.measured_ms.items()), best)
        return self._offered(best)

    def _offered(self, chosen: str) -> str:
        if chosen not in self.candidates:
            raise ValueError(f"the strategy chose {chosen!r}, which {self.config.name} does not have "
                             f"({', '.join(self.candidates)})")
        return chosen

    def _measure(self, static: StaticInputs, capturer: Capturer) -> int:
        """Capture every candidate and time its replays; return the bytes allocated beside them.

        One lane is always a candidate: concurrency is a prediction until measured. Candidates are
        captured one at a time, each into a pool of its own that dies with it after timing (a pool
        outlives no graph), so memory never holds two of them; the winner is captured again into
        the family's pool. Replays advance the CUDA RNG: a graph with dropout draws other masks
        afterwards than an untimed run would (still random)."""
        torch.cuda.synchronize()
        allocated_before = torch.cuda.memory_allocated()
        written = self.config.written_state() if self.config.written_state is not None else []
        for name, fn in self.candidates.items():
            pool = torch.cuda.graph_pool_handle()
            graph, outputs = capturer.capture(fn, list(static.values), pool, f"{self.config.name} ({name})", written)
            self.candidate_pool_bytes[name] = pool_bytes(pool)  # lanes hold both towers' temporaries at once
            self.measured_ms[name] = capturer.time(graph, self.config.timing_replays)
            del graph, outputs
            torch.cuda.synchronize()
        # a candidate's graph, pool and outputs die with it, its cuBLAS workspaces too; anything
        # left would be a leak
        self.measuring_left_bytes = torch.cuda.memory_allocated() - allocated_before
        return allocated_before
