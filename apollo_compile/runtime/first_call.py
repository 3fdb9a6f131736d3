"""A graph's first call, with a way back: where apollo's runtime raises there, the graph runs as
eager ATen from then on, with one warning.

Compiling falls back per graph (``pipeline.compile_graph``), but some failures show only when the
generated runtime first runs: its lazily compiled kernels, or a value it never bound (a lifted
tensor constant can raise UnboundLocalError there). Caught here, they cost a graph, not the
training run. At the first call the inputs are held weakly, so that they can be passed again
without holding any of them longer than the runtime would (a backward frees each saved activation
at its last use, and AOTAutograd's list is its only holder): a failed run's traceback keeps the
frames, and so the inputs it had not freed yet, alive while the exception is handled. The call
is run again as eager ATen where every input is still alive and the graph writes none of its
inputs (a partial run may have written one: running it again would apply the write twice);
otherwise the error is raised with a note saying so. Out-of-memory errors are not retried here:
the runtime has its own account of them (docs/design/cuda-graphs.md#a-failed-capture). A whole
step's graph that runs out of memory at its first call before any subgraph that writes state has
started is marked :data:`WROTE_NOTHING`: ``compile_step`` then runs that call on the module path
(docs/design/whole-step.md#out-of-memory-at-the-first-call).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.fx
from torch._functorch.aot_autograd import make_boxed_func

from ..fallback import REPORT_HINT, warn_fallback
from ..nodes import written_inputs

__all__ = ["WROTE_NOTHING", "FirstCallFallback", "WriteWatch", "writes_an_input", "writes_state"]

# set on an OutOfMemoryError raised by a whole step's first call before it wrote anything
WROTE_NOTHING = "apollo_wrote_nothing"


def writes_an_input(gm: torch.fx.GraphModule) -> bool:
    """Whether an op of `gm` writes a placeholder or a view of one (``copy_`` into a ``.grad``, a
    buffer's in-place update)."""
    return any(written_inputs(node) for node in gm.graph.nodes)


_FUNCTIONALIZED = ("auto_functionalized", "auto_functionalized_v2")


def writes_state(node: torch.fx.Node) -> bool:
    """Whether `node` writes what outlives the call: a graph input (:func:`written_inputs`), or
    state through a functionalized mutable op (the optimizer's update writes its moments, which
    are no input of the graph)."""
    if written_inputs(node):
        return True
    target = node.target
    return isinstance(target, torch._ops.HigherOrderOperator) and target.name() in _FUNCTIONALIZED


class WriteWatch:
    """Whether a run of a graph's runtime has started a subgraph that writes state: its compiled
    subgraphs that do are wrapped (:meth:`watching`) to say so before they run."""

    def __init__(self) -> None:
        self.began = False

    def watching(self, subgraph: Callable[[list], list]) -> Callable[[list], list]:
        def run(args: list) -> list:
            self.began = True
            return subgraph(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run


class FirstCallFallback:
    """A boxed compiled graph (`fn`: apollo's runtime or its CUDA-graph runner) whose first call
    falls back to `gm` as eager ATen if it raises. `on_fallback` gets the reason (the plan records
    it). After a first call that returns, only an attribute test per call. `watch`: where the
    graph is a whole step's, what tells an out-of-memory error before any write (marked
    :data:`WROTE_NOTHING`) from one after."""

    def __init__(self, fn: Callable[[list], list], gm: torch.fx.GraphModule, name: str,
                 on_fallback: Callable[[str], None] | None = None, watch: WriteWatch | None = None) -> None:
        self.inner, self.name, self.on_fallback = fn, name, on_fallback
        self._gm = gm
        self.retry_safe = not writes_an_input(gm)
        self.watch = watch
        self.first_done = False
        self._boxed_call = True  # an instance attribute: torch._dynamo.disable's wrapper copies only those

    def __call__(self, args: list) -> list:
        if self.first_done:
            return self.inner(args)
        held = [(True, weakref.ref(a)) if isinstance(a, torch.Tensor) else (False, a) for a in args]
        retry = None
        try:
            out = self.inner(args)
        except torch.OutOfMemoryError as e:
            if self.watch is not None and not self.watch.began:
                setattr(e, WROTE_NOTHING, self.name)
            raise
        except Exception as e:
            why = f"its runtime raised at the graph's first call ({type(e).__name__}: {str(e)[:300]})"
            again = [value() if weak else value for weak, value in held]
            dead = sum(1 for (weak, _), value in zip(held, again) if weak and value is None)
            if not self.retry_safe or dead:
                if hasattr(e, "add_note"):
                    e.add_note(f"apollo: graph {self.name}'s runtime raised at its first call and could not run it "
                               "again as eager ATen: " + ("the graph writes one of its inputs, which this run may "
                                                          "already have done" if not self.retry_safe else
                                                          f"{dead} of its inputs were already freed")
                               + f"; options={{'subgraph_compiler': 'eager'}} may avoid it, and {REPORT_HINT}")
                raise
            retry = again
        if retry is None:
            self.first_done = True
            self._gm = None  # not needed again
            return out
        # outside the except block: the traceback holds the failed run's frames and their memory
        self.inner = make_boxed_func(self._gm.forward)
        self.first_done = True
        warn_fallback(self.name, "eager ATen", why)
        if self.on_fallback is not None:
            self.on_fallback(why)
        return self.inner(retry)
