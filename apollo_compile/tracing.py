"""What AOTAutograd's tracing context says about the graph being compiled."""

from __future__ import annotations

import torch


def fw_metadata():
    """AOTAutograd's ViewAndMutationMeta for the graph being compiled (static inputs, forward
    outputs, donated backward inputs), or None outside such a compile."""
    tc = torch._guards.TracingContext.try_get()
    return getattr(tc, "fw_metadata", None) if tc is not None else None


def compiling_autograd_graph() -> bool:
    """Whether the graph being compiled is compiled autograd's: a whole backward, traced from the
    autograd graph, which AOTAutograd hands over as an inference graph."""
    context = torch._guards.CompileContext.try_get()
    compile_id = getattr(context, "compile_id", None)
    return getattr(compile_id, "compiled_autograd_id", None) is not None
