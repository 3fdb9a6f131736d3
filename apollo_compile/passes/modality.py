"""Modality pass: label every node with the modality (tower) it belongs to.

Reads ``nn_module_stack`` (forward, and forward ops recomputed in the backward) and
``fwd_nn_module_stack`` (backward ops) that Dynamo and AOTAutograd leave in ``node.meta``.
Writes ``NodeInfo.modality`` and ``NodeInfo.recomputed``.

Rules, in order:
0. In a backward, a value the forward computed (a saved activation, an op recomputed under a
   memory budget) keeps the label the forward gave it, found by node name (the partitioner keeps
   the joint graph's names). Labelling it afresh would see only backward users: with the
   contrastive loss recomputed from the saved logits, nothing in the loss region has a module path
   or a labelled input, the whole region took one tower's label from its users, and the other
   tower's gradients waited for that tower's lane (the H200 ran lanes no faster than one stream).
1. A node that ran inside a submodule takes that submodule's modality: with the ``modalities``
   option, the name of the longest matching module-path prefix; without it, the name of the
   top-level submodule (``vision``, ``text``, ...). A path no prefix matches gets no seed.
2. A node without a seed takes the modality of its inputs; when they disagree it is a join,
   labelled ``fusion`` (the contrastive loss, a cross-attention layer).
3. Whatever is still unlabelled (parameters, inputs, saved activations, tangents, constants)
   takes the modality of its users, again ``fusion`` when they disagree.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from typing import Mapping

import torch.fx

from ..annotations import FUSION, KEY, info
from . import casts

_SUBSCRIPT = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")


def module_path(stack_entry: str) -> str:
    """``"L['self'].vision.blocks[0]"`` -> ``"vision.blocks.0"``: a plain dotted module path."""
    path = stack_entry
    for root in ("L['self']", 'L["self"]', "L__self__", "self"):
        if path.startswith(root):
            path = path[len(root):]
            break
    path = _SUBSCRIPT.sub(r".\1", path).replace("._modules.", ".")
    return path.strip(".").replace("..", ".")


def innermost_path(node: torch.fx.Node) -> str | None:
    """The dotted path of the innermost module a node ran in (forward or backward), or None."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    entries = list(stack.values())
    entry = entries[-1]
    return module_path(entry[0] if isinstance(entry, tuple) else str(entry))


def modality_of_path(path: str, modalities: Mapping[str, str] | None) -> str | None:
    """The modality a module path belongs to (see the module docstring, rule 1)."""
    if not path:
        return None
    if modalities is None:
        return path.split(".")[0]
    best = None
    for prefix, name in modalities.items():
        if path == prefix or path.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, name)
    return best[1] if best else None


def _merge(labels) -> str | None:
    labels = {label for label in labels if label is not None}
    if not labels:
        return None
    return labels.pop() if len(labels) == 1 else FUSION


def run(gm: torch.fx.GraphModule, ctx) -> dict:
    modalities = ctx.options.modalities
    from_forward = getattr(ctx, "forward_modalities", None) or {}
    nodes = list(gm.graph.nodes)
    for node in nodes:
        ann = info(node)
        # the partitioner tags forward values it hands the backward too (placeholders): only ops
        # the backward runs are recomputed
        ann.recomputed = (ctx.kind == "backward" and node.op == "call_function"
                          and node.meta.get("partitioner_tag") == "is_forward")
        ann.cast = casts.cast_mark(node)  # carried from the Dynamo graph's cast nodes (casts pass)
        if node.name in from_forward and (node.op == "placeholder" or ann.recomputed):  # rule 0
            ann.modality = from_forward[node.name]
            continue
        if node.op in ("call_function", "call_method", "call_module"):
            path = innermost_path(node)
            ann.modality = modality_of_path(path, modalities) if path else None
            if ann.modality is None:
                ann.modality = _merge(info(arg).modality for arg in node.all_input_nodes)
    for node in reversed(nodes):
        ann = info(node)
        if ann.modality is None and node.op != "output":
            ann.modality = _merge(info(user).modality for user in node.users if user.op != "output")
    for node in nodes:  # a node whose users are only the graph output, or that nothing labels
        ann = info(node)
        if ann.modality is None:
            ann.modality = _merge(info(arg).modality for arg in node.all_input_nodes) or FUSION
    counts = Counter(info(n).modality for n in nodes if n.op not in ("placeholder", "output"))
    return {"nodes": dict(sorted(counts.items())), "recomputed": sum(info(n).recomputed for n in nodes)}


def labels_of(gm: torch.fx.GraphModule, ctx) -> dict[torch.fx.Node, str]:
    """Each node's modality as this pass would label it, leaving no annotation behind: the joint
    passes (checkpoint) plan per modality before the per-graph pipeline labels the halves."""
    had = {n for n in gm.graph.nodes if KEY in n.meta}
    if all(n in had and n.meta[KEY].modality for n in gm.graph.nodes):  # a joint modality pass ran
        return {n: n.meta[KEY].modality for n in gm.graph.nodes}
    joint_ctx = copy.copy(ctx)
    joint_ctx.kind = "joint"  # recomputation is marked only in a backward graph
    try:
        run(gm, joint_ctx)
        return {n: info(n).modality for n in gm.graph.nodes}
    finally:
        for n in gm.graph.nodes:
            if n not in had:
                n.meta.pop(KEY, None)
