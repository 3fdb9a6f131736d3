"""Micro-batches in one graph: ``compile_step(step, optimizer=opt, micro_batches=k)``.

The traced step runs the user's `step` k times, on k equal slices of dimension 0 of every tensor
argument with at least one dimension (leaves of lists, tuples and dicts included; 0-d tensors and
other values are passed to every call unchanged), then averages the gradients and returns the
combined result. Dynamo unrolls the k calls into the whole step's one graph, each with its
``loss.backward()``, and the optimizer's update follows once (``whole_step.py``).

Each slice is marked with its micro-batch (``node.meta["custom"][MICRO_BATCH_KEY]``, carried to the
ATen graph); the modality pass labels every node that one micro-batch alone reaches with it, so
each micro-batch's chain is a branch of its own and the lanes pass runs the chains side by side;
the gradients' sums, which join them, run on the main lane (docs/design/whole-step.md#micro-batches).

Normalisation: ``.grad`` receives the mean of the k micro-batches' gradients, as if each call's
loss were divided by k; the returned floating-point 0-d tensors (a loss) are the mean of the k
values, every other returned tensor the k values stacked on a new dimension 0, and any other value
a tuple of the k values (docs/whole-step.md#micro-batches).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.fx.traceback as fx_traceback
from torch.utils import _pytree as pytree

from ..options import ApolloOptionsError
from ..passes.modality import MICRO_BATCH_KEY

__all__ = ["MicroBatchedStep", "check_micro_batches", "split"]


def check_micro_batches(k: Any, optimizer: Any) -> int:
    """`k` as an int >= 1, or :class:`ApolloOptionsError` saying what is wrong with it."""
    if isinstance(k, str) and k == "auto":
        raise ApolloOptionsError("apollo.compile_step: micro_batches='auto' is not implemented; pass the number of "
                                 "micro-batches, an int >= 1")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ApolloOptionsError(f"apollo.compile_step: micro_batches takes an int >= 1, got {k!r}")
    if k > 1 and optimizer is None:
        raise ApolloOptionsError("apollo.compile_step: micro_batches > 1 needs optimizer=: the gradients are averaged "
                                 "over the micro-batches for the parameters of its param_groups")
    return k


def _leaves(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(a readable name, the value) for every leaf of the step's arguments."""
    flat, _ = pytree.tree_flatten_with_path((args, kwargs))
    named = []
    for path, value in flat:
        where, *rest = path
        head = f"argument {rest[0].idx}" if where.idx == 0 else f"argument {rest[0].key!r}"
        named.append((head + "".join(str(k) for k in rest[1:]), value))
    return named


def batch_size(args: tuple, kwargs: dict, k: int) -> int:
    """The size of dimension 0 shared by every tensor argument with a dimension, checked divisible
    by `k`; :class:`ApolloOptionsError` naming the argument that is not."""
    size, first = None, None
    for name, value in _leaves(args, kwargs):
        if isinstance(value, Mapping):  # a dict-like class pytree cannot look into (a BatchEncoding)
            raise ApolloOptionsError(f"apollo.compile_step: micro_batches={k} slices the tensors in lists, tuples and "
                                     f"dicts, but {name} is a {type(value).__name__}; pass dict(...) of it, or **it")
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        n = value.shape[0]
        if size is None:
            size, first = n, name
        elif n != size:
            raise ApolloOptionsError(f"apollo.compile_step: micro_batches={k} slices dimension 0 of every tensor "
                                     f"argument, but {name} has {n} rows and {first} {size}; pass what every "
                                     "micro-batch shares as a 0-d tensor or a non-tensor, or from a closure")
    if size is None:
        raise ApolloOptionsError(f"apollo.compile_step: micro_batches={k} needs a tensor argument with a batch "
                                 "dimension to slice; the step got none")
    if size % k:
        raise ApolloOptionsError(f"apollo.compile_step: micro_batches={k} cuts the batch into equal slices, but "
                                 f"dimension 0 of {first} is {size}, not divisible by {k}")
    return size


def _slice(value: Any, i: int, k: int) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    rows = value.shape[0] // k
    return value.narrow(0, i * rows, rows)


def _combine(outs: list[Any]) -> Any:
    """The k calls' results as one (module docstring)."""
    flats = [pytree.tree_flatten(o) for o in outs]
    spec = flats[0][1]
    combined = []
    for j, first in enumerate(flats[0][0]):
        values = [flat[j] for flat, _ in flats]
        if isinstance(first, torch.Tensor):
            stacked = torch.stack(values)
            combined.append(stacked.mean(0) if first.dim() == 0 and first.is_floating_point() else stacked)
        else:
            combined.append(tuple(values))
    return pytree.tree_unflatten(combined, spec)


def _marked(i: int) -> Any:
    """Marks what is traced inside as micro-batch i's (``node.meta["custom"]``). A torch without
    ``torch.fx.traceback.annotate`` marks nothing: the step trains the same, its micro-batches on
    one lane."""
    if not hasattr(fx_traceback, "annotate"):
        return contextlib.nullcontext()
    return fx_traceback.annotate({MICRO_BATCH_KEY: i})


def split(fn: Callable, k: int, params: Callable[[], list[torch.Tensor]]) -> Callable:
    """`fn` run on k micro-batches, for tracing as one graph (module docstring); `params()` gives
    the parameters whose gradients are averaged."""

    @functools.wraps(fn)
    def micro_batched(*args: Any, **kwargs: Any) -> Any:
        ps = params()
        held = [p.grad for p in ps]  # accumulated before this call: kept, the mean added to it
        for p, g in zip(ps, held):
            if g is not None:
                p.grad = None
        outs = []
        for i in range(k):
            with _marked(i):  # the seeds of micro-batch i's chain
                a, kw = pytree.tree_map(functools.partial(_slice, i=i, k=k), (args, kwargs))
            outs.append(fn(*a, **kw))
        with torch.no_grad():
            for p, g in zip(ps, held):
                if p.grad is not None:
                    p.grad = p.grad / k if g is None else g + p.grad / k
                elif g is not None:
                    p.grad = g
        return _combine(outs)

    return micro_batched


class MicroBatchedStep:
    """The compiled step (``whole_step.CompiledStep``) behind a check of each call's arguments,
    outside the graph: a batch that does not cut into k equal slices raises before anything runs.
    Everything else is the compiled step's (``fallback_reason``, ...)."""

    def __init__(self, fn: Callable, k: int, optimizer: torch.optim.Optimizer,
                 compile_fn: Callable[[Callable], Callable]) -> None:
        self.k, self.optimizer = k, optimizer
        self._ids: tuple = ()
        self._params: list[torch.Tensor] = []
        self._refresh()
        self.compiled = compile_fn(split(fn, k, self.params))
        functools.update_wrapper(self, fn, updated=())

    def params(self) -> list[torch.Tensor]:
        """The optimizer's parameters that take gradients, one list object while they are the same
        (the traced step reads it: Dynamo guards on it)."""
        return self._params

    def _refresh(self) -> None:
        ps = [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]
        ids = tuple(map(id, ps))
        if ids != self._ids:
            self._ids, self._params = ids, ps

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch_size(args, kwargs, self.k)
        self._refresh()
        return self.compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "compiled":  # not yet set: no recursion
            raise AttributeError(name)
        return getattr(self.compiled, name)
