"""What kind of op an FX node is: the facts every pass asks about a node, decided once.

Passes import these instead of keeping their own name lists, so "is this a matmul" has one answer
across the cost model, the checkpoint planner and the performance model.
"""

from __future__ import annotations

from typing import Any

import torch.fx

# Library kernels (cuBLAS, cuDNN, attention): they read and write whole buffers and run at the
# matmul peak. Matched on the op name without its overload; convolutions and attention by substring
# (convolution_backward, _scaled_dot_product_flash_attention, flex_attention, ...).
_MATMUL_NAMES = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot",
                           "vdot", "_scaled_mm", "_int_mm"})


def op_name(target: Any) -> str:
    """'mm' for aten.mm.default, 'flex_attention' for the HOP, the name of a function or method.
    Takes a node's target, or a node."""
    if isinstance(target, torch.fx.Node):
        target = target.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None)
    return name if isinstance(name, str) else str(target)


def is_library_kernel_name(name: str) -> bool:
    """A matmul, convolution or attention op, by op name (see :func:`op_name`)."""
    return name in _MATMUL_NAMES or "convolution" in name or "conv" == name[:4] or "attention" in name


def is_library_kernel(node: torch.fx.Node) -> bool:
    """A matmul, convolution or attention node."""
    return node.op == "call_function" and is_library_kernel_name(op_name(node))
