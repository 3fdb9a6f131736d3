"""What AOTAutograd's tracing context says about the graph being compiled."""

from __future__ import annotations

import torch


def fw_metadata():
    """AOTAutograd's ViewAndMutationMeta for the graph being compiled (static inputs, forward
    outputs, donated backward inputs), or None outside such a compile."""
    tc = torch._guards.TracingContext.try_get()
    return getattr(tc, "fw_metadata", None) if tc is not None else None
