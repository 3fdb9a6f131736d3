"""Attention-masks pass: an attention mask whose last dimension is broadcast is laid out densely, so
``scaled_dot_product_attention`` can run a fused kernel rather than its float32 math path.

Reads Dynamo's graph (``node.meta["example_value"]``); rewrites the mask argument of each
``scaled_dot_product_attention`` call whose mask's last dimension is not dense (stride 0, or a
transposed mask's); returns the masks it rewrote.

[NOTE] A broadcast mask rules out the fused kernels. On CUDA, SDPA's memory-efficient and cuDNN
kernels take a mask only if its last dimension has stride 1 (``sdp_utils.cpp``); otherwise SDPA
runs its math path, which computes bf16 or fp16 attention in float32. Transformers' all-True
bidirectional mask, a broadcast column, is such a mask, and costs HF SigLIP's text tower float32
GEMMs and softmax in every step (docs/design/graph-rewrites.md#broadcast-masks). The pass keeps
the mask's values and shape, copies one slice of every other broadcast dimension densely and
broadcasts it back with ``expand_as``; SDPA then picks a kernel as for a mask laid out so, which
changes rounding only. A mask with a symbolic size or stride is left as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from ..nodes import meta_tensor

SDPA_TARGETS = (torch.nn.functional.scaled_dot_product_attention,)  # torch._C._nn's, as Dynamo records it
MASK_POSITION = 3  # scaled_dot_product_attention(query, key, value, attn_mask=None, ...)


def mask_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The mask argument of an SDPA call, where it is a graph value."""
    mask = node.kwargs.get("attn_mask", node.args[MASK_POSITION] if len(node.args) > MASK_POSITION else None)
    return mask if isinstance(mask, torch.fx.Node) else None


def last_dim_not_dense(val: torch.Tensor) -> bool:
    """Whether `val`'s last dimension (of more than one element) has a stride other than 1 (broadcast,
    or transposed), which the fused kernels do not take ([NOTE] A broadcast mask rules out the fused
    kernels)."""
    if val.dim() == 0 or free_symbols(val.size()) or free_symbols(val.stride()):
        return False
    return val.size(-1) > 1 and val.stride(-1) != 1


def densified(graph: torch.fx.Graph, mask: torch.fx.Node, val: torch.Tensor, before: torch.fx.Node) -> torch.fx.Node:
    """`mask` with its last dimension dense: one slice of every other broadcast dimension, copied,
    then broadcast back to `mask`'s shape."""
    with graph.inserting_before(before):
        small, small_val = mask, val
        for dim in range(val.dim() - 1):
            if val.stride(dim) == 0 and val.size(dim) > 1:
                small = graph.call_method("narrow", (small, dim, 0, 1))
                small_val = small_val.narrow(dim, 0, 1)
                small.meta["example_value"] = small_val
        small = graph.call_method("contiguous", (small,))
        small.meta["example_value"] = small_val = small_val.contiguous()
        dense = graph.call_method("expand_as", (small, mask))
        dense.meta["example_value"] = small_val.expand_as(val)
    for node in (dense, *dense.all_input_nodes):
        for field in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if field in before.meta and field not in node.meta:  # labelled like the attention it feeds
                node.meta[field] = before.meta[field]
    return dense


def run(gm: torch.fx.GraphModule, ctx: Any) -> dict:
    """Make the last dimension of every SDPA call's mask dense in Dynamo's graph `gm`; return
    ``changed`` and ``masks`` (each rewritten mask: ``attention``, ``mask``, ``shape``, ``stride``)."""
    done: dict[torch.fx.Node, torch.fx.Node] = {}  # a mask read by several attention calls: one copy
    masks = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        mask = mask_of(node)
        val = meta_tensor(mask)
        if val is None or not last_dim_not_dense(val):
            continue
        if mask not in done:
            done[mask] = densified(gm.graph, mask, val, node)
            masks.append({"attention": node.name, "mask": mask.name, "shape": list(val.shape),
                          "stride": list(val.stride())})
        node.replace_input_with(mask, done[mask])
    if masks:
        gm.graph.lint()
        gm.recompile()
    return {"changed": bool(masks), "masks": masks}
