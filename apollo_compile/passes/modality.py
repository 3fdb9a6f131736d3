"""Modality pass: label every node with the tower (modality) it belongs to, from the dataflow.

Reads the graph's edges, which inputs are parameters (AOTAutograd's static inputs), the backward
marks AOTAutograd leaves (``autograd_backward``, ``partitioner_tag``), and, for display names and
the ``modalities`` option only, the module paths in ``nn_module_stack`` / ``fwd_nn_module_stack``.
Writes ``NodeInfo.modality``, ``NodeInfo.backward``, ``NodeInfo.recomputed`` and ``NodeInfo.cast``.

A tower is what the graph says it is, so the same plan comes out whether the user compiles the
module, a wrapper, a function that calls a global model, or the whole training step
(docs/design/modality.md#rules):

1. **Forward**: a node belongs to the towers whose *data inputs* (pixels, tokens; not parameters)
   reach it; several make a join, ``fusion``. An input with no library kernel of its own (a mask,
   position ids), or with few beside the region it feeds with one other input, is absorbed.
2. **Backward**: a node belongs to the towers whose *parameter gradients* it reaches; a gradient
   output's tower is its parameter's (:func:`_grouped_gradients` where nothing names it).
3. In a backward, a value the forward computed keeps the forward's label, found by node name:
   labelled afresh from its backward users, a recomputed loss would take one tower's label.
4. Whatever is still unlabelled takes the label of its inputs, then of its users, ``fusion`` where
   they disagree.
5. **Micro-batches** (``compile_step(..., micro_batches=k)``): a node that one micro-batch's slices
   of the batch alone reach is that micro-batch's, ``<label>@mb<i>``; one that several reach (the
   gradients' sums, the mean loss) is a join, ``fusion`` (:func:`_by_micro_batch`).

A tower's name is for people: the longest module path its forward nodes share, else the module most
of its nodes ran in, else its input's name; the ``modalities`` option (module-path prefix -> name)
decides instead where the user gives it (docs/design/modality.md#names).
"""

from __future__ import annotations

import copy
import os
import re
from collections import Counter
from typing import Iterable, Mapping

import torch
import torch.fx

from ..annotations import FUSION, KEY, info
from ..nodes import graph_outputs, is_library_kernel, written_inputs
from ..tracing import compiling_autograd_graph, fw_metadata
from . import casts
from .cost import node_flops

# An input whose own kernels do less than this share of the FLOPs of the largest region it reaches
# together with exactly one other input is absorbed into the towers it meets: a real tower meets
# another only at their join, far smaller than either (SigLIP 2's patch grid resizes the position
# embeddings and is no tower; docs/design/modality.md#feeder-of-one).
MIN_TOWER_SHARE = 0.1

# node.meta["custom"][MICRO_BATCH_KEY] = i: a slice of the batch for micro-batch i
# (step/micro_batches.py), carried by torch from the Dynamo graph to the ATen graph
MICRO_BATCH_KEY = "apollo_micro_batch"

_SUBSCRIPT = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")
_ROOT = re.compile(r"^(?:[LG]\[['\"][^'\"\]]+['\"]\]|L__self__|self)")
COMPUTE = ("call_function", "call_method", "call_module")


def module_path(stack_entry: str) -> str:
    """``"L['self'].vision.blocks[0]"`` -> ``"vision.blocks.0"``: a plain dotted module path below
    the compiled root, whatever the root is called (``L['self']``, ``L['s']``, ``G['model']``)."""
    path = _ROOT.sub("", stack_entry, count=1)
    path = _SUBSCRIPT.sub(r".\1", path).replace("._modules.", ".")
    return path.strip(".").replace("..", ".")


def innermost_path(node: torch.fx.Node) -> str | None:
    """The dotted path of the innermost module a node ran in (forward or backward), or None."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    entry = list(stack.values())[-1]
    return module_path(entry[0] if isinstance(entry, tuple) else str(entry))


def modality_of_path(path: str, modalities: Mapping[str, str]) -> str | None:
    """The name of the longest ``modalities`` prefix that `path` falls under, or None."""
    best = None
    for prefix, name in modalities.items():
        if path == prefix or path.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, name)
    return best[1] if best else None


def _merge(labels: Iterable[str | None]) -> str | None:
    found = {label for label in labels if label is not None}
    if not found:
        return None
    return found.pop() if len(found) == 1 else FUSION


# ---------------------------------------------------------------------------- graph facts


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


# What a whole step's ``loss.backward()`` is traced as (Dynamo's trace_autograd_ops): the node
# AOTAutograd was interpreting when it traced a backward op, as its ``source_fn_stack`` names it.
_AUTOGRAD_CALLS = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward, "backward")


def traced_from_autograd(node: torch.fx.Node) -> bool:
    """Whether AOTAutograd traced `node` while running the autograd engine inside a whole step.
    torch 2.13 marks such nodes ``autograd_backward``; torch 2.11 does not (a whole-step graph
    would have no backward nodes, and its gradients would be copied out at every replay), but
    both record the Dynamo call they came from, ``torch.autograd.grad``, in ``source_fn_stack``."""
    if node.meta.get("autograd_backward"):
        return True
    stack = node.meta.get("source_fn_stack") or ()
    return bool(stack) and stack[-1][1] in _AUTOGRAD_CALLS


def backward_nodes(gm: torch.fx.GraphModule, kind: str) -> set[torch.fx.Node]:
    """The nodes that compute gradients: in a backward graph (and compiled autograd's) every op but
    the recomputed forward ones; in a joint graph what the tangents reach; in a whole-step graph
    what AOTAutograd traced from the autograd engine (:func:`traced_from_autograd`) and everything
    downstream of it (``.grad`` copies, an optimizer)."""
    nodes = list(gm.graph.nodes)
    if kind == "backward" or (kind == "inference" and compiling_autograd_graph()):
        return {n for n in nodes if n.op in COMPUTE and n.meta.get("partitioner_tag") != "is_forward"}
    seeds = {n for n in nodes if n.op in COMPUTE and traced_from_autograd(n)}
    if kind == "joint":
        seeds |= {n for n in nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    found: set[torch.fx.Node] = set()
    for n in nodes:  # graph order is topological: one sweep closes over users
        if n.op == "output":
            continue
        if n in seeds or any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def data_inputs(gm: torch.fx.GraphModule, kind: str) -> list[torch.fx.Node]:
    """The tensor inputs that are data, not parameters, buffers, tangents or saved values: the
    inputs AOTAutograd does not mark static (Dynamo marks parameters and buffers static) and
    that need no gradient. Outside an AOTAutograd compile, the inputs that need no gradient."""
    if kind == "backward" or compiling_autograd_graph():
        return []
    phs = [n for n in _placeholders(gm) if not n.name.startswith("tangents")]
    meta = fw_metadata()
    static = set(meta.static_input_indices or ()) if meta is not None else set()
    infos = list(meta.input_info) if meta is not None else []
    if kind == "joint":  # the last outputs are the primals' gradients: None where none is needed
        outs = graph_outputs(gm)
        needs_grad = [isinstance(o, torch.fx.Node) for o in outs[len(outs) - len(phs):]]
    else:
        needs_grad = [info.requires_grad for info in infos]
    found = []
    for i, ph in enumerate(phs):
        if not _is_tensor(ph) or i in static:
            continue
        requires_grad = needs_grad[i] if i < len(needs_grad) else ph.meta["val"].requires_grad
        if not requires_grad:
            found.append(ph)
    return found


# ---------------------------------------------------------------------------- forward: data inputs


def _reach(nodes: list[torch.fx.Node], seeds: dict[torch.fx.Node, int], skip: set[torch.fx.Node]
           ) -> dict[torch.fx.Node, int]:
    """Which seeds (bitmask) reach each node, along the graph's edges, not through `skip`."""
    reach: dict[torch.fx.Node, int] = {}
    for n in nodes:
        if n in skip or n.op == "output":
            continue
        mask = seeds.get(n, 0)
        for a in n.all_input_nodes:
            mask |= reach.get(a, 0)
        if mask:
            reach[n] = mask
    return reach


def forward_towers(gm: torch.fx.GraphModule, kind: str, backward: set[torch.fx.Node]
                   ) -> tuple[dict[torch.fx.Node, int], list[torch.fx.Node]]:
    """Rule 1: for each forward node, the towers (bitmask over the returned tower inputs) whose
    data inputs reach it. Inputs whose own region runs no library kernel are absorbed, then, one at
    a time, an input whose own region is small beside what it feeds together with one other input
    (docs/design/modality.md#feeder-of-one); where no input's region runs a library kernel (a
    compiled optimizer step: one elementwise update per parameter, each from its own gradient and
    state), there are no towers, and the graph is one join (one lane), not a lane per parameter."""
    nodes = list(gm.graph.nodes)
    inputs = data_inputs(gm, kind)
    flops = {n: max(1, node_flops(n)) for n in nodes if is_library_kernel(n)}
    heavy = list(inputs)
    while True:
        reach = _reach(nodes, {x: 1 << i for i, x in enumerate(heavy)}, backward)
        work: Counter[int] = Counter()  # reach bitmask -> FLOPs of the library kernels there
        for n, m in reach.items():
            if n in flops:
                work[m] += flops[n]
        light = [i for i in range(len(heavy)) if not work[1 << i]] or _feeder(work, len(heavy))
        if not light:
            return reach, heavy
        heavy = [x for i, x in enumerate(heavy) if i not in light]


def _feeder(work: Counter[int], inputs: int) -> list[int]:
    """[the input whose own kernels are the smallest share, under MIN_TOWER_SHARE, of the kernels
    it reaches together with exactly one other input], or []
    (docs/design/modality.md#feeder-of-one). `work`: reach bitmask -> the FLOPs of the library kernels with that reach."""
    shares = {}
    for i in range(inputs):
        joined = max((w for m, w in work.items() if m & (1 << i) and bin(m).count("1") == 2), default=0)
        if joined:
            shares[i] = work[1 << i] / joined
    smallest = min(shares, key=shares.get, default=None)
    return [smallest] if smallest is not None and shares[smallest] < MIN_TOWER_SHARE else []


# ---------------------------------------------------------------------------- backward: gradients


def _gradient_outputs(gm: torch.fx.GraphModule, kind: str, backward: set[torch.fx.Node],
                      forward_inputs: list[str | None] | None) -> list[tuple[torch.fx.Node, str | None]]:
    """(gradient output, its parameter's tower where the graph says it by position)."""
    outs = graph_outputs(gm)
    if kind == "backward":  # output i is the gradient of the forward's input i
        labels = forward_inputs or []
        return [(o, labels[i] if i < len(labels) else None) for i, o in enumerate(outs)
                if isinstance(o, torch.fx.Node)]
    if kind == "joint":  # the forward's outputs, then one gradient per primal, in order
        primals = [n for n in _placeholders(gm) if not n.name.startswith("tangents")]
        grads = outs[len(outs) - len(primals):]
        return [(o, info(p).modality) for o, p in zip(grads, primals) if isinstance(o, torch.fx.Node)]
    # a whole step's gradients, and the writes of an optimizer inside it (a parameter's update)
    returned = [o for o in outs if isinstance(o, torch.fx.Node) and o in backward]
    writes = [n for n in gm.graph.nodes if n in backward and written_inputs(n)]
    return [(o, None) for o in dict.fromkeys(returned + writes)]


def _tower_of_gradient(out: torch.fx.Node, backward: set[torch.fx.Node],
                       memo: dict[tuple[torch.fx.Node, int], str | None]) -> str | None:
    """A gradient output's tower from the nodes around it (docs/design/modality.md#rules, rule 2).
    `memo` keeps what the search found from a lone node at a depth, for the other outputs whose
    search passes there (the three writes of a parameter's update, and every parameter of a list
    update, meet at that update: a whole step's 1200 writes walked its gradients again each)."""
    # the input it is allocated like or updates: copy(empty_like(p), g), p.grad's new value
    stack, seen, found = [out], set(), []
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if a.op == "placeholder":
                found.append(info(a).modality)
            elif a not in backward:
                stack.append(a)
    if label := _merge(found):
        return label
    # the forward activations the last library kernel before it reads (a weight's gradient)
    # breadth first, each node once (a list update's fan-in multiplied the paths); from a lone node
    # at a depth the rest of the search is taken as that node's, and kept for the next output
    frontier, depth, met, starts, label = [out], 0, {out}, [], None
    while frontier and depth < 8:
        if len(frontier) == 1:
            if (frontier[0], depth) in memo:
                label = memo[frontier[0], depth]
                break
            starts.append((frontier[0], depth))
        kernels = [n for n in frontier if is_library_kernel(n)]
        if kernels:
            label = _merge(info(a).modality for k in kernels for a in k.all_input_nodes if a not in backward)
            break
        frontier = [a for n in frontier for a in n.all_input_nodes if a in backward and a not in met]
        met.update(frontier)
        depth += 1
    memo.update(dict.fromkeys(starts, label))
    return label


def _grouped_gradients(gm: torch.fx.GraphModule, backward: set[torch.fx.Node], outs: list[torch.fx.Node]
                       ) -> dict[torch.fx.Node, str]:
    """Gradient outputs grouped into towers with no label to go by. Each backward node reaches a
    set of the weights' gradients (those a library kernel computes alone); the largest sets short
    of all of them, merged where they overlap, are the towers. The other gradients (biases, norms,
    a logit scale) then follow the towers their producers reach."""
    bit = {o: 1 << i for i, o in enumerate(dict.fromkeys(outs))}
    reach: dict[torch.fx.Node, int] = {}
    for n in reversed(list(gm.graph.nodes)):
        if n in backward:
            mask = bit.get(n, 0)
            for user in n.users:
                mask |= reach.get(user, 0)
            if mask:
                reach[n] = mask
    # a weight's gradient is a library kernel's alone; biases, norms and scales follow their towers
    full = 0
    for n, m in reach.items():
        if is_library_kernel(n) and m & (m - 1) == 0:
            full |= m
    groups: list[int] = []
    for mask in sorted({m & full for m in reach.values()} - {full, 0}, key=lambda m: -bin(m).count("1")):
        if any(mask & ~g == 0 for g in groups):
            continue  # inside a larger group
        overlapping = [g for g in groups if g & mask]
        groups = [g for g in groups if not g & mask] + [mask | sum(overlapping)]
    if len(groups) < 2:
        return {}
    return {o: f"tower{i}" for i, g in enumerate(groups) for o, b in bit.items() if b & g}


def backward_towers(gm: torch.fx.GraphModule, kind: str, backward: set[torch.fx.Node],
                    forward_inputs: list[str | None] | None) -> dict[torch.fx.Node, str]:
    """Rule 2: each backward node's label from the towers of the parameter gradients it reaches."""
    sinks: dict[torch.fx.Node, set[str]] = {}
    outputs = _gradient_outputs(gm, kind, backward, forward_inputs)
    memo: dict[tuple[torch.fx.Node, int], str | None] = {}
    for out, label in outputs:
        label = label if label not in (None, FUSION) else _tower_of_gradient(out, backward, memo)
        if label is not None and label != FUSION:
            sinks.setdefault(out, set()).add(label)
    if not sinks and compiling_autograd_graph():  # no forward names a gradient's tower: group them
        sinks = {out: {name} for out, name in _grouped_gradients(gm, backward, [o for o, _ in outputs]).items()}
    reached: dict[torch.fx.Node, set[str]] = {}
    for n in reversed(list(gm.graph.nodes)):
        if n not in backward:
            continue
        towers = set(sinks.get(n, ()))
        for user in n.users:
            towers |= reached.get(user, set())
        if towers:
            reached[n] = towers
    return {n: (next(iter(t)) if len(t) == 1 else FUSION) for n, t in reached.items()}


# ---------------------------------------------------------------------------- names


def tower_names(nodes_of: dict[int, list[torch.fx.Node]], inputs: list[torch.fx.Node]) -> dict[int, str]:
    """A readable, unique name per tower: its longest shared module path less the prefix all
    towers share; else its most frequent top-level module; else its input's name."""
    paths = {t: [p for p in (innermost_path(n) for n in ns) if p] for t, ns in nodes_of.items()}
    common = {t: os.path.commonprefix([p.split(".") for p in ps]) if ps else [] for t, ps in paths.items()}
    shared = os.path.commonprefix([c for c in common.values()]) if len(common) > 1 else []
    names: dict[int, str] = {}
    for t in sorted(nodes_of):
        rest = common[t][len(shared):]
        if rest:
            name = ".".join(rest)
        elif paths[t]:
            depth = len(shared)
            heads = Counter(".".join(p.split(".")[:depth + 1]) for p in paths[t] if len(p.split(".")) > depth)
            name = heads.most_common(1)[0][0].split(".")[-1] if heads else inputs[t].name
        else:
            name = inputs[t].name
        while name in names.values() or name == FUSION:
            name += "_"
        names[t] = name
    return names


# ---------------------------------------------------------------------------- the pass


def _by_module_paths(gm: torch.fx.GraphModule, modalities: Mapping[str, str]) -> None:
    """The ``modalities`` option: a node in a named module takes that name (rule 4 does the rest)."""
    for node in gm.graph.nodes:
        if node.op in COMPUTE and info(node).modality is None:
            path = innermost_path(node)
            if path:
                info(node).modality = modality_of_path(path, modalities)


def _by_dataflow(gm: torch.fx.GraphModule, kind: str, backward: set[torch.fx.Node],
                 forward_inputs: list[str | None] | None) -> None:
    reach, inputs = forward_towers(gm, kind, backward)
    single = {n: m.bit_length() - 1 for n, m in reach.items() if m & (m - 1) == 0}
    nodes_of: dict[int, list[torch.fx.Node]] = {}
    for n, t in single.items():
        if n.op in COMPUTE:
            nodes_of.setdefault(t, []).append(n)
    names = tower_names(nodes_of, inputs)
    for n, m in reach.items():
        if info(n).modality is None and (n.op in COMPUTE or n.op == "placeholder"):
            info(n).modality = names.get(single[n]) if n in single else FUSION
    _fill(gm, skip=backward)  # parameters take their users' towers: gradients are named by them
    if backward:
        labelled = backward_towers(gm, kind, backward, forward_inputs)
        for n in backward:
            if n in labelled and not info(n).recomputed:
                info(n).modality = labelled[n]
        for n in gm.graph.nodes:
            # a forward value the backward recomputes and several towers' gradients read (one
            # tower's normalized features, for the logits' gradient) is a join: on its own tower's
            # lane the other tower would wait for that whole lane's subgraph
            if info(n).recomputed and len({info(u).modality for u in n.users if u.op != "output"} - {FUSION}
                                          | {info(n).modality} - {FUSION}) > 1:
                info(n).modality = FUSION


def _fill(gm: torch.fx.GraphModule, skip: set[torch.fx.Node] = frozenset()) -> None:
    """Rule 4: unlabelled nodes take their inputs' label, then their users' (none of `skip`)."""
    nodes = [n for n in gm.graph.nodes if n not in skip]
    for node in nodes:
        ann = info(node)
        if ann.modality is None and node.op in COMPUTE:
            ann.modality = _merge(info(arg).modality for arg in node.all_input_nodes)
    for node in reversed(nodes):
        ann = info(node)
        if ann.modality is None and node.op != "output":
            ann.modality = _merge(info(user).modality for user in node.users
                                  if user.op != "output" and user not in skip)


def micro_batch_of(node: torch.fx.Node) -> int | None:
    """The micro-batch whose slice of the batch `node` is, or None (also for the sizes traced
    while slicing, which every micro-batch's slice reads)."""
    custom = node.meta.get("custom")
    mark = custom.get(MICRO_BATCH_KEY) if isinstance(custom, dict) else None
    return mark if isinstance(mark, int) and node.op in COMPUTE and _is_tensor(node) else None


def _is_size(node: torch.fx.Node) -> bool:
    """A symbolic size or number (``sym_size``, its arithmetic), not data."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _by_micro_batch(gm: torch.fx.GraphModule) -> int:
    """Rule 5: each micro-batch's chain a branch of its own. Micro-batches share the parameters,
    so the towers cannot tell them apart; the dataflow can: a node that only micro-batch i's slices
    reach (its forward, and its backward, which reads its activations) becomes ``<label>@mb<i>``,
    one that several reach a join, ``fusion``. A node none reaches (an ``empty_like`` of a
    parameter for its ``.grad``, a step counter, a size) follows its users, ``fusion`` where they
    disagree (a dynamic batch's size, read by every slice: a few host-side ops on the main lane).
    Returns the number of micro-batches (0 without them; docs/design/whole-step.md#micro-batches)."""
    nodes = list(gm.graph.nodes)
    seeds = {n: 1 << i for n in nodes if (i := micro_batch_of(n)) is not None}
    if len(set(seeds.values())) < 2:
        return 0
    # a size read by several micro-batches (a dynamic batch's) joins nothing: it is not followed
    reach = _reach(nodes, seeds, {n for n in nodes if _is_size(n)})
    for n, m in reach.items():
        if n.op not in COMPUTE:
            continue
        if m & (m - 1):
            info(n).modality = FUSION
        else:
            info(n).modality = f"{info(n).modality or FUSION}@mb{m.bit_length() - 1}"
    for n in reversed(nodes):
        if n.op in COMPUTE and n not in reach:
            users = [u for u in n.users if u.op != "output"]
            info(n).modality = _merge(info(u).modality for u in users) if users else FUSION
    return len(set(seeds.values()))


def run(gm: torch.fx.GraphModule, ctx) -> dict:
    from_forward = getattr(ctx, "forward_modalities", None) or {}
    nodes = list(gm.graph.nodes)
    for node in nodes:
        ann = info(node)
        ann.modality, ann.backward = None, False
        # the partitioner tags forward values it hands the backward too (placeholders): only ops
        # the backward runs are recomputed
        ann.recomputed = (ctx.kind == "backward" and node.op == "call_function"
                          and node.meta.get("partitioner_tag") == "is_forward")
        ann.cast = casts.cast_mark(node)  # carried from the Dynamo graph's cast nodes (casts pass)
        if node.name in from_forward and (node.op == "placeholder" or ann.recomputed):  # rule 3
            ann.modality = from_forward[node.name]
    backward = backward_nodes(gm, ctx.kind) if ctx.kind in ("backward", "joint", "inference") else set()
    for n in backward:
        info(n).backward = True
    if ctx.options.modalities is not None:
        _by_module_paths(gm, ctx.options.modalities)
    else:
        _by_dataflow(gm, ctx.kind, backward, getattr(ctx, "forward_inputs", None))
    micro_batches = _by_micro_batch(gm)
    _fill(gm)
    for node in nodes:  # a node nothing labels: outputs, a graph with no data input
        ann = info(node)
        if ann.modality is None:
            ann.modality = _merge(info(arg).modality for arg in node.all_input_nodes) or FUSION
    counts = Counter(info(n).modality for n in nodes if n.op not in ("placeholder", "output"))
    out = {"nodes": dict(sorted(counts.items())), "recomputed": sum(info(n).recomputed for n in nodes)}
    return out | {"micro_batches": micro_batches} if micro_batches else out


def labels_of(gm: torch.fx.GraphModule, ctx) -> dict[torch.fx.Node, str]:
    """Each node's modality as this pass would label it, leaving no annotation behind: the joint
    passes (checkpoint) plan per modality before the per-graph pipeline labels the halves."""
    had = {n for n in gm.graph.nodes if KEY in n.meta}
    if all(n in had and n.meta[KEY].modality for n in gm.graph.nodes):  # a joint modality pass ran
        return {n: n.meta[KEY].modality for n in gm.graph.nodes}
    joint_ctx = copy.copy(ctx)
    # recomputation is marked only in a backward graph; a whole step's graph keeps its kind, whose
    # data inputs are found as an inference graph's (as "joint", torch 2.11 found none: one tower)
    joint_ctx.kind = "inference" if ctx.kind == "inference" else "joint"
    try:
        run(gm, joint_ctx)
        return {n: info(n).modality for n in gm.graph.nodes}
    finally:
        for n in gm.graph.nodes:
            if n not in had:
                n.meta.pop(KEY, None)
