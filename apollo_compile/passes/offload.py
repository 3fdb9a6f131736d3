"""Offload pass: saved activations wait for the backward in host memory, not on the GPU.

With ``options={"offload_activations": True}`` the forward copies each large value it saves for
the backward to host memory right after its last forward use, so its GPU memory is free for the
rest of the forward; the backward copies it back just before its first use. Per-block
checkpointing still saves every block's input, most of the GPU memory a large batch needs, and
keeping those inputs off the GPU is the only way below it without changing the model
(docs/design/checkpointing.md#offload). The price is PCIe traffic: each offloaded byte crosses
twice per step.

PyTorch implements the graph rewrite (``torch._functorch._activation_offloading``): the min-cut
partitioner applies it to forward values marked ``should_offload`` that it ends up saving, when
``torch._functorch.config.enable_activation_offloading`` is on. This pass marks the values (joint
graph), turns the switch on around the partition, and labels the copies it inserted in the forward
and backward graphs (``NodeInfo.transfer``) for dumps. Inductor allocates the host buffers afresh
on every call, and a CUDA graph would replay its copies into the buffers of the call it captured,
so an offloading model runs un-graphed.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Iterator

import torch
import torch._functorch.config
import torch.fx

from ..annotations import info
from ..nodes import is_view, nbytes
from ..options import ApolloOptions

# Smaller values are left on the GPU: each transfer costs a launch and a PCIe round trip, and a
# block's small saved values (norm statistics, attention's logsumexp) free almost nothing.
MIN_BYTES = 1 << 20

_TO_HOST, _TO_DEVICE = "to host", "to device"


def mark(gm: torch.fx.GraphModule, ctx) -> dict[str, Any] | None:
    """Joint graph: mark the values worth offloading if the partition saves them.

    Every op output of at least MIN_BYTES is a candidate; the partitioner offloads the ones it
    saves, except model outputs, views, pieces of multi-output ops and non-contiguous values
    (PyTorch's ``can_offload``: Inductor would restride those on both sides)."""
    if not ctx.options.offload_activations:
        return None
    marked = [n for n in gm.graph.nodes if _worth_offloading(n)]
    for n in marked:
        n.meta["should_offload"] = True
    return {"candidates": len(marked), "min_bytes": MIN_BYTES}


def _worth_offloading(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor) and nbytes(node) >= MIN_BYTES


def waits_on_host(node: torch.fx.Node, model_outputs) -> bool:
    """Whether the partition would keep `node` on the host if it saves it: :func:`mark` marks it
    and PyTorch's ``can_offload`` takes it (not one of `model_outputs`, a view, a piece of a
    multi-output op or non-contiguous). The checkpoint pass simulates the GPU memory with it."""
    val = node.meta.get("val")
    return (_worth_offloading(node) and node not in model_outputs and node.target is not operator.getitem
            and not is_view(node) and val.is_contiguous())


@contextlib.contextmanager
def partitioner_offloads(options: ApolloOptions) -> Iterator[None]:
    """Turn on PyTorch's activation offloading for one partition, if the user asked for it."""
    if not options.offload_activations:
        yield
        return
    with torch._functorch.config.patch(enable_activation_offloading=True):
        yield


def transfer_of(node: torch.fx.Node) -> str | None:
    """"to host" or "to device": which copy of PyTorch's offloading `node` is, by the names it
    gives its copies; None for any other node."""
    if node.op != "call_function" or node.target is not torch.ops.prims.device_put.default:
        return None
    from torch._functorch._activation_offloading.activation_offloading import CPU_OFFLOAD_PREFIX, GPU_RELOAD_PREFIX

    if node.name.startswith(CPU_OFFLOAD_PREFIX):
        return _TO_HOST
    if node.name.startswith(GPU_RELOAD_PREFIX):
        return _TO_DEVICE
    return None


def label(gm: torch.fx.GraphModule, ctx) -> dict[str, Any] | None:
    """Forward or backward graph: mark the copies the partitioner inserted (``NodeInfo.transfer``)
    and count them: values and bytes sent to the host (forward) or brought back (backward)."""
    if not ctx.options.offload_activations:
        return None
    count, total = 0, 0
    for n in gm.graph.nodes:
        if (direction := transfer_of(n)) is not None:
            info(n).transfer = direction
            count += 1
            total += nbytes(n)
    key = "to_host" if ctx.kind == "forward" else "to_device"
    return {key: count, "bytes": total}
