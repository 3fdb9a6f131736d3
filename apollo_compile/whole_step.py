"""Whole-step compilation: the forward, ``loss.backward()`` and the ``.grad`` updates in ONE graph.

    step = apollo_compile.compile_step(step_fn)      # step_fn calls loss.backward() itself

With ``torch._dynamo.config.trace_autograd_ops`` on, Dynamo traces ``loss.backward()`` as
``torch.autograd.grad`` plus the ``.grad`` accumulation into the same graph as the forward, and
AOTAutograd hands apollo one inference graph holding the forward and the backward. Each tower's
forward and backward then run on that tower's lane and, on CUDA, the whole step replays as one
CUDA graph: no autograd engine and no AOTAutograd wrapper between the halves.

The flag is on only while Dynamo traces and runs this function (every other compiled function
keeps Dynamo's configuration as it was). What cannot be one graph still trains correctly, as a
module-compiled model does (forward and backward graphs, the autograd engine between them), with
one :class:`ApolloFallbackWarning` saying why: a PyTorch whose Dynamo cannot trace the backward,
or a graph break inside the step (an ``optimizer.step()`` inside it breaks the graph on
torch 2.11-2.13: keep the optimizer outside, ``fused=True``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
import torch._dynamo

from .fallback import ApolloFallbackWarning
from .options import ApolloOptions, ApolloOptionsError

TRACE_FLAG = "trace_autograd_ops"


def backward_tracing_supported() -> bool:
    """Whether this PyTorch's Dynamo can trace ``Tensor.backward()`` into the graph."""
    return hasattr(torch._dynamo.config, TRACE_FLAG)


def _graph_breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


class CompiledStep:
    """The compiled step: calls the ``torch.compile``-d function with backward tracing on, and says
    once, after the first call, if the step did not become one graph."""

    def __init__(self, fn: Callable, compiled: Callable, whole: bool) -> None:
        self.fn, self.compiled, self.whole = fn, compiled, whole
        self.calls = 0
        self.graph_breaks: dict[str, int] = {}  # reason -> count, seen while compiling this step
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.whole:
            return self.compiled(*args, **kwargs)
        before = _graph_breaks()
        with torch._dynamo.config.patch(**{TRACE_FLAG: True}):
            out = self.compiled(*args, **kwargs)
        self.calls += 1
        after = _graph_breaks()
        if after != before:
            fresh = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
            first = not self.graph_breaks
            for k, n in fresh.items():
                self.graph_breaks[k] = self.graph_breaks.get(k, 0) + n
            if first:
                reasons = "; ".join(list(fresh)[:3])
                warnings.warn(
                    f"apollo.compile_step: {getattr(self.fn, '__qualname__', self.fn)} did not compile as one graph "
                    f"(graph break: {reasons}); its parts compile separately and the backward of a part runs "
                    "through autograd, as for a module-compiled model: training stays correct, but the step is "
                    "not one CUDA graph. Keep optimizer.step() and Python-side work (printing, .item()) outside "
                    "the compiled step", ApolloFallbackWarning, stacklevel=2)
        return out


def compile_step(fn: Callable | None = None, **torch_compile_kwargs: Any) -> Callable:
    """``torch.compile(fn, backend="apollo", **torch_compile_kwargs)`` with ``loss.backward()``
    traced into the same graph: the user's whole step (forward, backward, gradients) is one
    compiled artifact. Usable as ``compile_step(fn, options={...})`` or as a decorator,
    ``@compile_step`` / ``@compile_step(options={...})``.

    `fn` computes a loss, calls ``loss.backward()`` and returns what it likes (``loss.detach()``);
    gradients land in ``.grad`` as eager autograd leaves them: assigned where ``.grad`` is None,
    accumulated where it exists. Keep the optimizer outside (see the module docstring). Options
    are validated here, before anything is traced."""
    if fn is None:
        return functools.partial(compile_step, **torch_compile_kwargs)
    if not callable(fn):
        raise TypeError(f"apollo.compile_step: expected the step function, got {type(fn).__name__}")
    backend = torch_compile_kwargs.pop("backend", "apollo")
    if backend != "apollo":
        raise ApolloOptionsError(f"apollo.compile_step compiles with backend='apollo', got backend={backend!r}; "
                                 "use torch.compile for other backends")
    ApolloOptions.from_user(torch_compile_kwargs.get("options"), torch_compile_kwargs.get("mode"))
    compiled = torch.compile(fn, backend="apollo", **torch_compile_kwargs)
    whole = backward_tracing_supported()
    if not whole:
        warnings.warn("apollo.compile_step: this PyTorch's Dynamo cannot trace loss.backward() into the graph "
                      f"(torch._dynamo.config.{TRACE_FLAG} is missing); the step compiles as a forward graph "
                      "and a backward graph with the autograd engine between them: correct, one graph less fast",
                      ApolloFallbackWarning, stacklevel=2)
    return CompiledStep(fn, compiled, whole)
