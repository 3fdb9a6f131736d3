"""Traceable stand-ins that ``compile_step`` puts in place only while Dynamo traces and runs a whole step.

A stand-in replaces a torch function by one that checks or computes the same thing in ops a whole
step's graph can hold and a CUDA graph can capture. :func:`whole_step_stand_ins` sets them on the
``torch`` module on entry and puts the originals back on exit; ``CompiledStep`` enters it around
each call of the whole step only (its trace, its guards and its run), so the module path, eager
code and every other ``torch.compile`` see torch's own functions. The compiled graph holds the
stand-in's ops, not a call to it, and Dynamo's guard on the name holds on every call because the
stand-in is in place on every call. Not thread-safe: another thread compiling during a whole
step's call sees the stand-ins too (as it would any ``torch._dynamo.config.patch``).
Design: docs/design/whole-step.md#traceable-stand-ins.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

__all__ = ["STAND_INS", "check_tensor_all", "check_tensor_all_with", "needed", "whole_step_stand_ins"]


def check_tensor_all(cond: torch.Tensor, message: Any = None) -> None:
    """``torch._check_tensor_all(cond)``: every element of the bool tensor `cond` is true, checked
    where `cond` lives, without the host reading it (NOTE: A check on the device)."""
    _check_all(cond)


def check_tensor_all_with(error_type: type[Exception], cond: torch.Tensor, message: Any = None) -> None:
    """``torch._check_tensor_all_with``: :func:`check_tensor_all`. A failed check raises a
    RuntimeError whatever the error type, as a compiled graph's runtime assertion does."""
    _check_all(cond)


FAILED = "torch._check_tensor_all failed inside apollo's whole step"


def _check_all(cond: torch.Tensor) -> None:
    """[NOTE] A check on the device. Dynamo traces ``torch._check_tensor_all`` (Hugging Face's
    image-placeholder check before ``masked_scatter``) as a ``.item()`` and an assertion on the
    host (torch 2.13), or not at all (torch 2.11: the bool it reads stays a pending unbacked
    symbol, ``PendingUnbackedSymbolNotFound``). Either way the host would wait for the GPU in
    mid-step, which a CUDA graph cannot capture. ``torch._assert_async`` checks on the device: on
    the CPU it raises a RuntimeError at once; on CUDA a failed check is a device-side assertion
    (the CUDA context is lost, as with an out-of-range index), reported at the next sync. The
    message is a fixed one: torch's may be a callable, which the op cannot take."""
    if not isinstance(cond, torch.Tensor) or cond.dtype != torch.bool:
        raise TypeError(f"cond must be a bool tensor, got {cond!r}")
    torch._assert_async(cond.all(), FAILED)


# torch's name -> the stand-in
STAND_INS: dict[str, Callable] = {
    "_check_tensor_all": check_tensor_all,
    "_check_tensor_all_with": check_tensor_all_with,
}


def needed() -> dict[str, Callable]:
    """The stand-ins for the functions this PyTorch has (every one: NOTE: A check on the device)."""
    return {name: fn for name, fn in STAND_INS.items() if hasattr(torch, name)}


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
