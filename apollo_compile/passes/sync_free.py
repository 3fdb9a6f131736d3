"""Sync-free pass: ops whose output size the GPU must report to the host, where the size is known.

Reads and rewrites the graph (no annotations); returns how many ops it rewrote.

A CUDA graph cannot capture an op that waits for the GPU to tell the host how large its output is:
``masked_select`` counts the mask's true elements first. ``masked_scatter``'s backward
(``aten.masked_scatter_backward``, which HF LLaVA's image features meet) is one; its output size
is static, the ``sizes`` argument: the gradient of the scattered source
(docs/design/graph-rewrites.md#sync-free). So it is computed from indices of a known count instead:
``nonzero_static(mask, size=numel(sizes))`` lists the true elements in order (as ``masked_select``
reads them), padded with -1, and the padded slots are zero, as the op pads a source larger than
the mask's true count. The values are the op's own.
"""

from __future__ import annotations

import math

import torch
import torch.fx
from torch._guards import detect_fake_mode

from ..nodes import meta_tensor, meta_value

aten = torch.ops.aten


class _Emitter:
    """Adds ATen calls before `anchor`, each with its fake value (later passes read shapes)."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, fake_mode) -> None:
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode

    def __call__(self, op, *args, **kwargs):
        fake_args = torch.fx.node.map_arg(args, meta_value)  # nested too: index's list of index tensors
        with self.fake_mode:
            val = op(*fake_args, **kwargs)
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(op, tuple(args), kwargs)
        node.meta["val"] = val
        return node


def _static_ints(values) -> list[int] | None:
    """`values` as ints, or None where one is symbolic (a SymInt is no int)."""
    return list(values) if all(isinstance(v, int) for v in values) else None


def _rewrite_masked_scatter_backward(node: torch.fx.Node, fake_mode) -> bool:
    grad, mask, sizes = node.args[0], node.args[1], node.args[2]
    g, m = meta_value(grad), meta_value(mask)
    sizes = _static_ints(sizes)
    if g is None or m is None or sizes is None or _static_ints(g.shape) is None:
        return False
    count = math.prod(sizes)
    emit = _Emitter(node.graph, node, fake_mode)
    flat_mask = emit(aten.reshape.default, emit(aten.expand.default, mask, list(g.shape)), [-1])
    index = emit(aten.reshape.default, emit(aten.nonzero_static.default, flat_mask, size=count, fill_value=-1), [count])
    values = emit(aten.index.Tensor, emit(aten.reshape.default, grad, [-1]), [emit(aten.clamp_min.default, index, 0)])
    kept = emit(aten.where.ScalarOther, emit(aten.ge.Scalar, index, 0), values, 0.0)
    out = emit(aten.reshape.default, kept, sizes)
    out.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    node.replace_all_uses_with(out)
    node.graph.erase_node(node)
    return True


def run(gm: torch.fx.GraphModule, ctx) -> dict:
    targets = [n for n in gm.graph.nodes if n.target is aten.masked_scatter_backward.default]
    if not targets:
        return {"rewritten": 0}
    fake_mode = detect_fake_mode([t for n in gm.graph.nodes if (t := meta_tensor(n)) is not None])
    if fake_mode is None:
        return {"rewritten": 0}
    rewritten = sum(_rewrite_masked_scatter_backward(n, fake_mode) for n in targets)
    if rewritten:
        gm.recompile()
    return {"rewritten": rewritten}
