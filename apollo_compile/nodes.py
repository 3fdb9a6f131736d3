"""What kind of op an FX node is: the facts every pass asks about a node, decided once.

Passes import these instead of keeping their own name lists, so "is this a matmul" has one answer
across the cost model, the checkpoint planner and the performance model; "is this a view", "does
it draw random numbers" and "how many bytes is it" one answer across checkpointing and offloading.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Iterable

import torch
import torch.fx

from .shapes import concrete_numel

__all__ = ["deterministic_attention", "input_nodes", "is_elementwise", "is_library_kernel", "is_library_kernel_name",
           "is_random", "is_view", "nbytes", "node_tensors", "op_name", "readers_of", "storage_node", "tensors",
           "written_inputs"]

# Library kernels (cuBLAS, cuDNN, attention): they read and write whole buffers and run at the
# matmul peak. Matched on the op name without its overload; convolutions and attention by substring
# (convolution_backward, _scaled_dot_product_flash_attention, flex_attention, ...).
_MATMUL_NAMES = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot",
                           "vdot", "_scaled_mm", "_int_mm"})
# Ops that draw random numbers, by op name, beyond the ``nondeterministic_seeded`` tag.
_RANDOM_NAMES = frozenset({
    "native_dropout", "dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "randperm", "normal", "normal_", "uniform", "uniform_", "exponential", "exponential_",
    "geometric", "cauchy", "log_normal", "multinomial", "poisson", "rrelu_with_noise", "_fused_dropout",
    "philox_rand", "run_and_save_rng_state", "run_with_rng_state", "graphsafe_run_with_rng_state",
    "_standard_gamma", "_sample_dirichlet", "binomial",
})


# ---------------------------------------------------------------------------- names and op classes


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


# conv1d..3d, conv_transpose2d, conv_tbc, _conv_depthwise2d: not prims.convert_element_type, a
# cast, which Inductor's decompositions write where eager's graph has _to_copy (a prefix "conv"
# made every cast a library kernel under the default subgraph compiler: an attention mask's cast
# then made the mask a tower of its own, a third lane on HF text towers)
_CONV_NAME = re.compile(r"_?conv(\d|_transpose|_tbc|_depthwise)")


def is_library_kernel_name(name: str) -> bool:
    """A matmul, convolution or attention op, by op name (see :func:`op_name`)."""
    return (name in _MATMUL_NAMES or "convolution" in name or _CONV_NAME.match(name) is not None
            or "attention" in name)


def is_library_kernel(node: torch.fx.Node) -> bool:
    """A matmul, convolution or attention node."""
    return node.op == "call_function" and is_library_kernel_name(op_name(node))


def _partitioner_views() -> frozenset:
    try:
        from torch._functorch.partitioners import get_default_op_list

        return frozenset(get_default_op_list().view_ops)
    except Exception:  # pragma: no cover - private API moved
        return frozenset()


_PARTITIONER_VIEWS = _partitioner_views()


def is_view(node: torch.fx.Node) -> bool:
    """Aliases its input (our view rule and the min-cut partitioner's): recomputing it is free.

    (The cost pass's free nodes are a wider set: they also count detaches and metadata ops.)"""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    if getattr(node.target, "is_view", False) is True:
        return True
    packet = getattr(node.target, "overloadpacket", node.target)
    try:
        return packet in _PARTITIONER_VIEWS or op_name(node) in ("_unsafe_view", "_reshape_alias")
    except TypeError:
        return False


def is_random(node: torch.fx.Node) -> bool:
    """An op that draws random numbers: recomputing it would draw a different mask."""
    if node.op != "call_function":
        return False
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        # attention carries the tag for its dropout_p, even at 0 (see deterministic_attention)
        return not deterministic_attention(node)
    name = op_name(node)
    namespace = getattr(node.target, "namespace", "")
    return name in _RANDOM_NAMES or "rng" in name or "philox" in name or namespace in ("rngprims",)


def is_elementwise(node: torch.fx.Node) -> bool:
    """An elementwise ATen op (``Tag.pointwise``) with one tensor out that draws no random numbers and
    writes nothing: recomputed where it is read, a compiler that fuses inlines it into the reader."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return (torch.Tag.pointwise in node.target.tags and not is_random(node) and not node.target._schema.is_mutable
            and isinstance(node.meta.get("val"), torch.Tensor))


def deterministic_attention(node: torch.fx.Node) -> bool:
    """An attention op (flash, efficient, cuDNN, CPU flash) called with ``dropout_p == 0``.

    It carries the random tag for its dropout, but at 0 its kernels draw no random numbers (the
    rng outputs are placeholders), so re-running it gives the forward's values. Recomputable, it
    lets the checkpoint planner's block plan (``recompute_planner.Planner.block_plan``) save only
    block inputs: saved, every block's q, k, v, output and logsumexp are a floor no budget goes
    under (docs/design/checkpointing.md#plan)."""
    if not isinstance(node.target, torch._ops.OpOverload) or "attention" not in op_name(node):
        return False
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return isinstance(p, (int, float)) and p == 0
    return False


# ---------------------------------------------------------------------------- values and bytes


def meta_value(node: Any) -> Any:
    """What a node computes, as tracing recorded it: AOTAutograd's ``val``, else Dynamo's
    ``example_value``, else a get_attr's tensor itself; None for anything else (a constant
    argument, a node with no record)."""
    if not isinstance(node, torch.fx.Node):
        return None
    if "val" in node.meta:
        return node.meta["val"]
    if "example_value" in node.meta:
        return node.meta["example_value"]
    if node.op == "get_attr":
        obj: Any = node.graph.owning_module
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None
    return None


def meta_tensor(node: Any) -> torch.Tensor | None:
    """:func:`meta_value` where it is one tensor, else None."""
    val = meta_value(node)
    return val if isinstance(val, torch.Tensor) else None


def tensors(val: Any) -> list[torch.Tensor]:
    """The tensors in a meta value: a tensor, nested tuples/lists/dicts of them, or anything else
    (none)."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for y in val for t in tensors(y)]
    if isinstance(val, dict):
        return [t for y in val.values() for t in tensors(y)]
    return []


def node_tensors(node: torch.fx.Node) -> list[torch.Tensor]:
    """The tensors a node's ``meta["val"]`` is, as a value the backward may save: a tensor or
    nested tuples/lists of them. A dict-valued node (a Triton kernel's functional wrapper) is none:
    its getitems are the values."""

    def walk(x: Any) -> list[torch.Tensor]:
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, (list, tuple)):
            return [t for y in x for t in walk(y)]
        return []

    return walk(node.meta.get("val"))


def nbytes(node: torch.fx.Node) -> int:
    """Bytes of the tensor(s) a node produces (:func:`node_tensors`, symbolic sizes at their hints)."""
    total = 0
    for t in node_tensors(node):
        total += concrete_numel(t) * t.element_size()
    return total


def storage_node(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose output a value's storage is: views lead to their base, graph inputs to themselves."""
    seen = 0
    while seen < 10_000:
        seen += 1
        if is_view(node):
            base = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
            if base is None:
                return node
            node = base
        elif node.target is operator.getitem and is_view(node.args[0]):  # a piece of split/unbind
            node = node.args[0]
        else:
            return node
    return node


def input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Distinct input nodes in argument order (args, then kwargs)."""
    seen: dict[torch.fx.Node, None] = {}
    torch.fx.node.map_arg((node.args, node.kwargs), lambda n: seen.setdefault(n, None))
    return list(seen)


def graph_outputs(gm: torch.fx.GraphModule) -> list[Any]:
    """The flat outputs of an AOTAutograd graph (None for a gradient that is not there)."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    return list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]


def written_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The graph inputs (placeholders) `node` writes, directly or through a view of one: the
    ``copy_`` AOTAutograd leaves in a graph that keeps its input mutations (an optimizer's update
    of a parameter and its state, a ``.grad`` accumulated into), a buffer's in-place update."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    found = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, torch.fx.Node):
            base = storage_node(value)
            if base.op == "placeholder":
                found.append(base)
    return found


def readers_of(value: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read `value` or a view of it (not the views themselves), in graph order."""
    found: dict[torch.fx.Node, None] = {}
    stack = [value]
    while stack:
        for user in stack.pop().users:
            if is_view(user) or (user.target is operator.getitem and is_view(user.args[0])):
                stack.append(user)
            else:
                found.setdefault(user, None)
    return in_graph_order(found)


def in_graph_order(nodes: Iterable[torch.fx.Node]) -> list[torch.fx.Node]:
    """`nodes` (of one graph) sorted as the graph runs them: by the position key FX keeps on every
    node where this torch has it, else by numbering the graph (a pass that asked this per node
    numbered a 9300-node whole-step graph thousands of times: seconds of compile)."""
    nodes = list(nodes)
    if len(nodes) < 2:
        return nodes
    if _HAS_SORT_KEY:
        return sorted(nodes, key=_SORT_KEY)
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return sorted(nodes, key=order.__getitem__)


_HAS_SORT_KEY = hasattr(torch.fx.Node, "_sort_key")  # kept in order by FX's node insertions
_SORT_KEY = operator.attrgetter("_sort_key")
