"""Traceable stand-ins that ``compile_step`` puts in place only while Dynamo traces and runs a whole step.

A stand-in replaces a torch function that this PyTorch's Dynamo cannot trace under
``fullgraph=True`` by one that computes the same thing in ops Dynamo traces. :func:`whole_step_stand_ins`
sets them on the ``torch`` module on entry and puts the originals back on exit; ``CompiledStep``
enters it around each call of the whole step only (its trace, its guards and its run), so the
module path, eager code and every other ``torch.compile`` see torch's own functions. The compiled
graph holds the stand-in's ops, not a call to it, and Dynamo's guard on the name holds on every
call because the stand-in is in place on every call. Not thread-safe: another thread compiling
during a whole step's call sees the stand-ins too (as it would any ``torch._dynamo.config.patch``).

Where this PyTorch's Dynamo handles a function itself, no stand-in is set for it (:data:`STAND_INS`
says when). Design: docs/design/whole-step.md#traceable-stand-ins.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

__all__ = ["STAND_INS", "check_tensor_all", "check_tensor_all_with", "needed", "whole_step_stand_ins"]


def check_tensor_all(cond: torch.Tensor, message: Any = None) -> None:
    """``torch._check_tensor_all(cond)`` as torch 2.13's Dynamo traces it: every element of the
    bool tensor `cond` is true, checked at run time (a ``.item()`` and a runtime assertion in the
    graph). The message is not kept: under tracing torch's own handler keeps only a message
    defined inside the compiled region, and Hugging Face passes none there."""
    _check_all(cond)


def check_tensor_all_with(error_type: type[Exception], cond: torch.Tensor, message: Any = None) -> None:
    """``torch._check_tensor_all_with``: :func:`check_tensor_all`. A failed runtime assertion of a
    compiled graph raises a RuntimeError whatever the error type (torch 2.13's handler's too)."""
    _check_all(cond)


def _check_all(cond: torch.Tensor) -> None:
    """[NOTE] A tensor check is an int, not a bool. torch 2.11's Dynamo inlines
    ``torch._check_tensor_all`` and the bool it reads with ``.item()`` stays a pending unbacked
    symbol, which the next op of the graph trips over (``PendingUnbackedSymbolNotFound``: HF
    LLaVA's image-placeholder check before ``masked_scatter``). Read as an int (0 or 1) and
    compared, the value binds at its ``.item()`` and the comparison is a runtime assertion that
    AOTAutograd keeps (a bool's ``Eq(u0, 1)`` it drops). Neither touches what the model computes."""
    if not isinstance(cond, torch.Tensor) or cond.dtype != torch.bool:
        raise TypeError(f"cond must be a bool tensor, got {cond!r}")
    torch._check(cond.all().int().item() == 1)


# torch's name -> (the stand-in, the name under which Dynamo registers a handler of its own)
STAND_INS: dict[str, tuple[Callable, str]] = {
    "_check_tensor_all": (check_tensor_all, "torch._check_tensor_all"),
    "_check_tensor_all_with": (check_tensor_all_with, "torch._check_tensor_all_with"),
}


def needed() -> dict[str, Callable]:
    """The stand-ins this PyTorch needs: those whose function its Dynamo has no handler for."""
    import torch._dynamo.trace_rules as rules

    handled = getattr(rules, "manual_torch_name_rule_map", {})
    return {name: fn for name, (fn, qualname) in STAND_INS.items() if qualname not in handled and hasattr(torch, name)}


@contextlib.contextmanager
def whole_step_stand_ins(stand_ins: dict[str, Callable]) -> Iterator[None]:
    """`stand_ins` (name -> function, :func:`needed`) set on the ``torch`` module inside, torch's
    own functions put back on exit, also where the body raises."""
    saved = {name: getattr(torch, name) for name in stand_ins}
    try:
        for name, fn in stand_ins.items():
            setattr(torch, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)
