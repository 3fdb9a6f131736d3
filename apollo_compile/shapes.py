"""Concrete sizes for planning: a symbolic size (dynamic shapes) counts at the value it was traced
with (its hint), 1 when it has none. Costs, casts, checkpoints and the memory plan all size
tensors this way."""

from __future__ import annotations

import math
from typing import Any

import torch


def concrete_int(x: Any) -> int:
    if isinstance(x, int):  # bool included
        return int(x)
    if isinstance(x, torch.SymInt):
        hint = getattr(getattr(x, "node", None), "hint", None)
        if hint is None:
            return 1
        try:
            return int(hint)
        except Exception:
            return 1
    try:
        return int(x)
    except Exception:
        return 1


def concrete_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(concrete_int(d) for d in t.shape)


def concrete_numel(t: torch.Tensor) -> int:
    return math.prod(concrete_shape(t))
