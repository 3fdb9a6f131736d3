"""How a CUDA-graph runner is configured: one frozen :class:`RunnerConfig` per graph, which
``pipeline.cudagraphed`` builds from the options and AOTAutograd's metadata, and the
:class:`MemoryPolicy` it carries: everything a memory budget (or ``cudagraphs=True``) changes at
run time, derived from the options in one place (:meth:`MemoryPolicy.from_options`).

Reads the options; writes nothing. The runner (``cudagraph.py``), its capture (``capture.py``)
and its candidate choice (``candidates.py``) read these fields and nothing else of the options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from .choice import Strategy
from .graph_pool import CAPTURE_HEADROOM

__all__ = ["Capturer", "LANE_MEMORY_RATIO", "MemoryPolicy", "RunnerConfig"]

# Under a memory budget a concurrent candidate replays only where its peak stays within this much
# of the one-stream candidate's (choice.fastest; docs/design/cuda-graphs.md#memory-budget).
LANE_MEMORY_RATIO = 1.1


class Capturer(Protocol):
    """Captures a runtime as a graph and times a graph's replays (``capture.CudaCapture``; tests
    give a fake one, or one that fails)."""

    def capture(self, fn: Callable[[list], list], inputs: list, pool: Any, name: str,
                written_state: Sequence[torch.Tensor] = ()) -> tuple[Any, list]:
        """(the graph, its outputs): `fn` captured on `inputs` (a boxed runtime clears the list)
        into `pool`. `name` names the graph and candidate; `written_state`: what else `fn` writes
        in place (a capture runs nothing, so a real one ignores it)."""

    def time(self, graph: Any, replays: int) -> float:
        """Milliseconds per replay of `graph` over `replays` replays, after one untimed replay."""


@dataclass(frozen=True)
class MemoryPolicy:
    """What the user's memory settings change at run time.

    `lane_memory_ratio`: under a memory budget, the bound on a concurrent candidate's peak against
    one lane's, and the memory-first rule (a graph whose backward reuses saved activations replays
    one lane: choice.memory_first_reason); None: time alone decides. `capture_headroom`: the share of
    the memory limit above which a family is not captured (graph_pool.too_close_to_the_limit); None:
    captured regardless (``cudagraphs=True``). `free_at_last_use`: subgraphs are compiled to free
    each buffer at its last use (subgraphs.inductor_config), for a budget or offloading."""

    lane_memory_ratio: float | None = None
    capture_headroom: float | None = CAPTURE_HEADROOM
    free_at_last_use: bool = False

    @classmethod
    def from_options(cls, options: Any) -> MemoryPolicy:
        """The policy of an ``ApolloOptions``: a budget puts memory first, ``cudagraphs=True``
        captures regardless of headroom, a budget or offloading frees buffers at their last use."""
        budget = options.memory_budget is not None
        return cls(lane_memory_ratio=LANE_MEMORY_RATIO if budget else None,
                   capture_headroom=None if options.cudagraphs is True else CAPTURE_HEADROOM,
                   free_at_last_use=budget or bool(options.offload_activations))


def _frozen(idxs) -> frozenset[int]:
    return frozenset(idxs or ())


@dataclass(frozen=True)
class RunnerConfig:
    """Everything a CUDA-graph runner is told of its graph, shared by its copies for other model
    instances (``CudaGraphRunner.for_family``).

    Inputs: `static_input_idxs` are read in place (parameters: AOTAutograd's static inputs);
    `donated_idxs` a backward may take over (docs/design/cuda-graphs.md#donation); `written_idxs`
    the graph writes (an optimizer inside the step); `saved_idxs` a backward's inputs that are its
    forward's saved outputs (None: any may be). Outputs: `user_visible_outputs` are the user's
    (None: all), `lent_outputs` are lent in the pool's memory like a backward's gradients.
    `symbolic`: sizes may change between calls. `predicted`: the planner's fastest plain candidate,
    replayed where timing cannot be. `written_state`: what else the graph writes in place (an
    optimizer's moments). `on_measured` gets the candidates' times. `strategy` picks the candidate
    (None: ``choice.in_effect()``); `capturer` captures and times graphs (None:
    ``capture.in_effect()``, the seam tests use to fake or fail a capture)."""

    name: str
    kind: str  # "forward" | "backward" | "inference"
    static_input_idxs: frozenset[int] = frozenset()
    user_visible_outputs: frozenset[int] | None = None
    donated_idxs: frozenset[int] = frozenset()
    lent_outputs: frozenset[int] = frozenset()
    written_idxs: frozenset[int] = frozenset()
    saved_idxs: tuple[int, ...] | None = None
    symbolic: bool = False
    predicted: str | None = None
    written_state: Callable[[], list] | None = None
    on_measured: Callable[[dict[str, float]], None] | None = None
    strategy: Strategy | None = None
    capturer: Capturer | None = None
    memory: MemoryPolicy = MemoryPolicy()
    timing_replays: int = 5

    def __post_init__(self) -> None:
        for name in ("static_input_idxs", "donated_idxs", "lent_outputs", "written_idxs"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        if self.user_visible_outputs is not None:
            object.__setattr__(self, "user_visible_outputs", _frozen(self.user_visible_outputs))
        if self.saved_idxs is not None:
            object.__setattr__(self, "saved_idxs", tuple(self.saved_idxs))
        if self.kind not in ("forward", "backward", "inference"):
            raise ValueError(f"RunnerConfig.kind must be 'forward', 'backward' or 'inference', not {self.kind!r}")

    def is_user_visible(self, i: int) -> bool:
        return self.user_visible_outputs is None or i in self.user_visible_outputs
