"""Which captured runtime a CUDA-graph runner replays: the strategy it is given.

A graph's runner holds its candidate runtimes: ``"lanes"``, ``"one_lane"`` when the plan has side
lanes, and SM-quota splits (``"quota:1=88,2=40"``). A graph with one candidate replays it.
Otherwise, at its capture step, its candidate choice (``candidates.py``) asks the strategy twice:

1. :meth:`Strategy.unmeasured`: a candidate to replay without measuring any (and why), or None;
2. if None, each candidate is captured into a pool of its own and timed, then
   :meth:`Strategy.choose` picks one from those times, each capture's pool and what was allocated
   beside the graph. The times also calibrate the performance model (``perf/calibration.py``).

Both get the :class:`GraphFacts` the runner knows then. :class:`ChooseFastest` is apollo's own rule
(the default): a backward that reuses its saved activations replays what its forward chose by
timing, a graph under a memory budget one lane, any other the fastest candidate where it beats one
stream by ``min_gain``. :class:`Fixed` replays one named candidate, unmeasured. A runner whose
``RunnerConfig.strategy`` is None (as the pipeline builds them) uses the one in effect when it
chooses: ``with using(Fixed("one_lane")):`` around a compile and its calls (benchmarks, tests),
else ``ChooseFastest()``. The rules' reasons: docs/design/cuda-graphs.md#memory-budget and
docs/design/cuda-graphs.md#a-donating-backward-follows-its-forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

from .process_wide import ProcessWide

__all__ = ["ChooseFastest", "Fixed", "GraphFacts", "Strategy", "fastest", "in_effect", "memory_first_reason", "using"]


@dataclass(frozen=True)
class GraphFacts:
    """What a runner knows of its graph when it chooses a candidate."""

    name: str
    kind: str  # "forward" | "backward" | "inference"
    candidates: tuple[str, ...]
    lane_memory_ratio: float | None = None  # under a memory budget: concurrency's bound (`fastest`); else None
    will_donate: bool = False  # a backward whose capture takes over saved activations (cuda-graphs.md#donation)
    forward_chosen: str | None = None  # what the family's forward replays, once it is captured
    forward_measured: bool = False  # ... chosen by timing its candidates (not unmeasured, not its only one)
    memory_first: str | None = None  # why the memory-first rule replays one lane (`memory_first_reason`), or None


class Strategy(Protocol):
    def unmeasured(self, graph: GraphFacts) -> tuple[str, str] | None:
        """(the candidate to replay without measuring, why), or None to measure every candidate."""

    def choose(self, graph: GraphFacts, measured_ms: dict[str, float], pool_bytes: dict[str, int | None],
               base_bytes: int) -> str:
        """The candidate to replay, from each one's ms per replay and capture pool (bytes, None where
        the allocator cannot say) and the bytes allocated beside the graph."""


def fastest(measured_ms: dict[str, float], min_gain: float, pool_bytes: dict[str, int | None] | None = None,
            lane_memory_ratio: float | None = None, base_bytes: int = 0) -> str:
    """The candidate to replay: the fastest, unless it beats the one-stream schedule by less than
    `min_gain`: concurrency that does not pay still costs memory (both towers' temporaries live at
    once).

    With `pool_bytes` (each candidate's capture pool) and `lane_memory_ratio` (under a memory
    budget), a candidate whose peak (`base_bytes`, what was allocated beside the graph, plus its
    pool) exceeds the one-stream candidate's by more than that ratio is not replayed, however fast;
    pools alone would overstate it (docs/design/cuda-graphs.md#memory-budget). A candidate whose
    pool is unknown is judged on time alone."""
    if lane_memory_ratio is not None and pool_bytes and pool_bytes.get("one_lane"):
        limit = (base_bytes + pool_bytes["one_lane"]) * lane_memory_ratio - base_bytes
        measured_ms = {k: v for k, v in measured_ms.items()
                       if k == "one_lane" or pool_bytes.get(k) is None or pool_bytes[k] <= limit}
    best = min(measured_ms, key=measured_ms.get)
    single = measured_ms.get("one_lane")
    if single is not None and measured_ms[best] > single * (1 - min_gain):
        return "one_lane"
    return best


def memory_first_reason(kind: str, why: str | None, will_donate: bool, backward_donates: bool) -> str | None:
    """Why a graph replays one lane unmeasured, or None. `why`: what puts memory first ("under a
    memory budget", "near the memory limit"), or None where nothing does.

    `will_donate`: this graph is a backward whose capture takes over saved activations;
    `backward_donates`: its family's backward does (a forward learns it from the family: its
    backward is compiled at the first backward, before the forward's second call captures).

    The caching allocator hands a freed block only to a tensor allocated on the stream that
    allocated it: on one lane in both graphs the backward's capture reuses every saved activation,
    with side lanes only those made and read by the same lane; and measuring holds each
    candidate's pool beside every saved activation (docs/design/cuda-graphs.md#memory-budget)."""
    if why is None:
        return None
    if will_donate:
        return f"{why} the backward reuses its saved activations' memory on one stream"
    if kind == "forward" and backward_donates:
        return (f"{why} the backward reuses the saved activations' memory, which only a forward on the capture "
                "stream makes reusable")
    return None


@dataclass(frozen=True)
class ChooseFastest:
    """apollo's rule, the default. A donating backward replays what its forward chose by timing
    (`follow_forward`: docs/design/cuda-graphs.md#a-donating-backward-follows-its-forward). Under a
    memory budget, a graph of a kind in `memory_first` whose memory-first rule applies
    (`GraphFacts.memory_first`) replays one lane unmeasured. Otherwise every candidate is measured
    and the fastest replays where it beats one stream by `min_gain`, within the budget's memory
    bound (:func:`fastest`).

    `memory_first=("backward",)` lets the forward measure beside a donating backward, `()` lets
    both graphs measure; `follow_forward=False` lets a donating backward measure too (the
    benchmarks' variants compare these rules)."""

    min_gain: float = 0.01
    memory_first: tuple[str, ...] = ("forward", "backward")
    follow_forward: bool = True

    def unmeasured(self, graph: GraphFacts) -> tuple[str, str] | None:
        if (self.follow_forward and graph.kind == "backward" and graph.will_donate and graph.forward_measured
                and graph.forward_chosen in graph.candidates):
            return graph.forward_chosen, ("the donating backward replays what its forward chose by timing (measuring "
                                          "it would hold each candidate beside every saved activation)")
        if graph.kind in self.memory_first and graph.memory_first is not None:
            return "one_lane", graph.memory_first
        return None

    def choose(self, graph: GraphFacts, measured_ms: dict[str, float], pool_bytes: dict[str, int | None],
               base_bytes: int) -> str:
        return fastest(measured_ms, self.min_gain, pool_bytes, graph.lane_memory_ratio, base_bytes)


@dataclass(frozen=True)
class Fixed:
    """Replay `candidate` (``"lanes"``, ``"one_lane"``, a quota split's name), unmeasured, in every
    graph that has it; a graph without it (a quota split whose green context was refused) chooses
    by `otherwise`."""

    candidate: str
    otherwise: Strategy = ChooseFastest()

    def unmeasured(self, graph: GraphFacts) -> tuple[str, str] | None:
        if self.candidate in graph.candidates:
            return self.candidate, "the strategy fixes it"
        return self.otherwise.unmeasured(graph)

    def choose(self, graph: GraphFacts, measured_ms: dict[str, float], pool_bytes: dict[str, int | None],
               base_bytes: int) -> str:
        return self.otherwise.choose(graph, measured_ms, pool_bytes, base_bytes)


DEFAULT = ChooseFastest()
_strategies: ProcessWide[Strategy] = ProcessWide()


def in_effect() -> Strategy:
    """The strategy a runner built without one uses: the innermost :func:`using`'s, else
    :data:`DEFAULT`."""
    return _strategies.innermost(DEFAULT)


def using(strategy: Strategy) -> contextlib.AbstractContextManager[Strategy]:
    """Runners without a strategy of their own choose with `strategy` inside this block, on every
    thread (the backward's included: they choose at their capture step, so the block must hold
    the graph's second call)."""
    return _strategies.using(strategy)
