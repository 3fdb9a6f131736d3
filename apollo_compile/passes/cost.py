"""Cost pass: a roofline estimate for every node of an ATen-level FX graph.

Reads  ``node.meta["val"]`` (FakeTensor, a tuple/list of them, SymInt, or None; Dynamo's
       ``meta["example_value"]`` and get_attr tensors are used when ``val`` is missing).
Writes the cost fields of :class:`apollo_compile.annotations.NodeInfo` (``node.meta["apollo"]``):
       ``flops``, ``bytes``, ``intensity``, ``bound``, ``est_us``, and ``library``: the op class,
       labelled once here (:func:`apollo_compile.nodes.is_library_kernel`) for the passes after
       it. :func:`node_cost` stands alone: the checkpoint pass costs joint-graph nodes, which this
       pass never sees.

The model is deliberately simple and deterministic (docs/design/cost.md#model): views, metadata
ops and bare allocations are free; FLOPs come from torch's ``flop_registry`` and a few formulas of
apollo's own for matmul-like ops, else one FLOP per element touched (0 for data movement); bytes
are every distinct tensor input read plus every output written; symbolic sizes use their hint.
Library kernels are rated against the device's matmul peak, other ops against its vector peak;
``est_us = max(flops / peak, bytes / bandwidth) * 1e6 + spec.launch_us``, and ``bound`` says which
term wins. Unknown ops never raise: a failing FLOP formula falls back to the generic rule, and a
node whose metadata cannot be read at all costs only its launch.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from ..annotations import info
from ..devices import DeviceSpec
from ..ops.fused_update import state_bytes
from ..nodes import input_nodes, is_library_kernel, is_library_kernel_name, meta_value, op_name, tensors
from ..shapes import concrete_int as _int
from ..shapes import concrete_numel as _numel
from ..shapes import concrete_shape as _shape

__all__ = ["node_cost", "node_flops", "run"]

Cost = tuple[int, int, float, str, float]
_FREE: Cost = (0, 0, 0.0, "-", 0.0)

# Views and metadata-only ops (by op name, without the overload), beyond what OpOverload.is_view says.
_VIEW_NAMES = frozenset(
    {
        "view", "_unsafe_view", "_reshape_alias", "view_as", "alias", "detach", "t", "permute",
        "expand", "expand_as", "squeeze", "unsqueeze", "select", "slice", "as_strided", "transpose",
        "split", "split_with_sizes", "unbind", "chunk", "narrow", "diagonal", "unfold", "unflatten",
        "view_as_real", "view_as_complex", "_conj", "_neg_view", "movedim", "lift_fresh",
    }
)
_METADATA_NAMES = frozenset(
    {
        "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_assert_tensor_metadata",
        "_assert_scalar", "_assert_async", "sym_constrain_range", "sym_constrain_range_for_size",
        "_make_dep_token", "_functional_assert_scalar", "_functional_sym_constrain_range",
        "_functional_sym_constrain_range_for_size",
        # Allocations launch no kernel and touch no memory.
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
    }
)
# Pure data movement / fills: they cost bytes but no arithmetic.
_MOVEMENT_NAMES = frozenset(
    {
        "clone", "_to_copy", "copy", "copy_", "contiguous", "lift_fresh_copy", "cat", "stack",
        "index", "_unsafe_index", "index_select", "gather", "scatter", "embedding", "constant_pad_nd",
        "repeat", "slice_scatter", "select_scatter", "as_strided_scatter", "diagonal_scatter",
        "full", "full_like", "zeros", "zeros_like", "ones", "ones_like", "new_zeros", "new_ones",
        "new_full", "fill", "fill_", "zero", "zero_", "scalar_tensor", "flip", "roll", "tril", "triu",
        "_local_scalar_dense", "_to_dtype", "to", "select_backward", "slice_backward",
        "diagonal_backward", "as_strided_backward",
    }
)


# ---------------------------------------------------------------------------- small helpers


def _nbytes(t: torch.Tensor) -> int:
    try:
        return _numel(t) * t.element_size()
    except Exception:
        return 0


def _contiguous(t: torch.Tensor) -> bool:
    """Row-major contiguity from hinted sizes and strides (no guards on symbolic shapes)."""
    try:
        expected = 1
        for size, stride in reversed(list(zip(_shape(t), (_int(s) for s in t.stride())))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True
    except Exception:
        return True


def _is_free(node: torch.fx.Node, out: Any, name: str) -> bool:
    """Views, metadata, placeholders/outputs: nodes that launch no kernel."""
    if node.op in ("placeholder", "output", "get_attr"):
        return True
    target = node.target
    if target is operator.getitem:
        return True
    if name == "reshape":  # a view exactly when it needs no copy; contiguous input is the common case
        inp = node.args[0] if node.args else None
        val = meta_value(inp)  # None for a constant
        if not isinstance(val, torch.Tensor):
            return True
        return _contiguous(val)
    if getattr(target, "is_view", False) is True:
        return True
    if name in _VIEW_NAMES or name in _METADATA_NAMES:
        return True
    if node.op == "call_function" and not isinstance(target, torch._ops.OperatorBase):
        # Python-level functions (operator.mul on SymInts, math, sym_* helpers): free unless they
        # produce a tensor.
        return not tensors(out)
    return False


def _concrete(x: Any) -> Any:
    """For the flop formulas: tensors with symbolic sizes become meta tensors of their hints."""
    if isinstance(x, torch.Tensor):
        if all(isinstance(d, int) for d in x.shape):
            return x
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return torch.empty(_shape(x), dtype=x.dtype, device="meta")
    if isinstance(x, list):
        return [_concrete(y) for y in x]
    if isinstance(x, tuple):  # torch.Size of SymInts included
        return tuple(_concrete(y) for y in x)
    if isinstance(x, torch.SymInt):
        return _int(x)
    return x


def _shape_of(x: Any) -> tuple[int, ...] | None:
    return _shape(x) if isinstance(x, torch.Tensor) else None


def _flops_extra(name: str, args: tuple, out: Any) -> int | None:
    """Formulas for matmul-like ops that flop_registry lacks; None when the op is not one of them."""
    from torch.utils import flop_counter as fc

    outs = tensors(out)
    out_numel = sum(_numel(t) for t in outs)
    if name in ("matmul", "dot", "vdot", "mv", "linear"):
        a = _shape_of(args[0]) if args else None
        return 2 * out_numel * a[-1] if a else None  # out elements x K multiply-adds
    if name == "addmv":
        mat = _shape_of(args[1]) if len(args) > 1 else None
        return 2 * out_numel * mat[-1] if mat else None
    if name == "addbmm":
        b1 = _shape_of(args[1]) if len(args) > 1 else None
        return 2 * out_numel * b1[0] * b1[-1] if b1 and len(b1) == 3 else None
    if name == "_scaled_dot_product_flash_attention_for_cpu":
        q, k, v = (_shape_of(a) for a in args[:3])
        return int(fc.sdpa_flop_count(q, k, v)) if q and k and v else None
    if name == "_scaled_dot_product_flash_attention_for_cpu_backward":
        g, q, k, v = (_shape_of(a) for a in args[:4])
        return int(fc.sdpa_backward_flop_count(g, q, k, v)) if g and q and k and v else None
    return None


def _flops(node: torch.fx.Node, name: str, out: Any, in_vals: list[Any]) -> int:
    target = node.target
    packet = getattr(target, "overloadpacket", target)
    args = torch.fx.node.map_arg(node.args, meta_value)
    kwargs = torch.fx.node.map_arg(node.kwargs, meta_value)
    try:
        fn: Callable[..., Any] | None = flop_registry.get(packet)
    except TypeError:  # unhashable target
        fn = None
    if fn is not None:
        try:
            return max(0, _int(fn(*_concrete(tuple(args)), out_val=_concrete(out), **{k: _concrete(v) for k, v in kwargs.items()})))
        except Exception:
            pass
    try:
        extra = _flops_extra(name, tuple(args), out)
    except Exception:
        extra = None
    if extra is not None:
        return max(0, _int(extra))
    if name in _MOVEMENT_NAMES or name.endswith("_copy") or name.endswith("_scatter"):
        return 0
    out_numel = sum(_numel(t) for t in tensors(out))
    in_numel = max((_numel(t) for v in in_vals for t in tensors(v)), default=0)
    return max(out_numel, in_numel)


def _first_float_dtype(*vals: Any) -> torch.dtype | None:
    for v in vals:
        for t in tensors(v):
            if t.dtype.is_floating_point:
                return t.dtype
    return None


# ---------------------------------------------------------------------------- public API


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one node from its example values (0 where unknown), for passes before this one."""
    try:
        return int(_flops(node, op_name(node), meta_value(node), [meta_value(n) for n in input_nodes(node)]))
    except Exception:
        return 0


def node_cost(node: torch.fx.Node, spec: DeviceSpec) -> Cost:
    """(flops, bytes, intensity, bound, est_us) of one node on `spec`; never raises."""
    try:
        out = meta_value(node)
        name = op_name(node)
        if _is_free(node, out, name):
            return _FREE
    except Exception:
        return _FREE if node.op in ("placeholder", "output", "get_attr") else (0, 0, 0.0, "memory", spec.launch_us)

    try:
        in_vals = [meta_value(n) for n in input_nodes(node)]
        nbytes = sum(_nbytes(t) for v in in_vals for t in tensors(v)) + sum(_nbytes(t) for t in tensors(out))
        nbytes += state_bytes(node)  # an update's optimizer state, found by name, not an input
        flops = _flops(node, name, out, in_vals)
        dtype = _first_float_dtype(*in_vals) or _first_float_dtype(out)
    except Exception:
        return (0, 0, 0.0, "memory", spec.launch_us)

    peak = spec.peak_flops(dtype, matmul=is_library_kernel_name(name))
    bw = spec.bandwidth
    intensity = flops / nbytes if nbytes else 0.0
    ridge = peak / bw if bw > 0 else math.inf
    bound = "compute" if intensity >= ridge else "memory"
    t_compute = flops / peak if peak > 0 else 0.0
    t_memory = nbytes / bw if bw > 0 else 0.0
    est_us = max(t_compute, t_memory) * 1e6 + spec.launch_us
    return int(flops), int(nbytes), float(intensity), bound, float(est_us)


def run(gm: torch.fx.GraphModule, ctx: Any) -> dict:
    """Annotate every node of `gm` with its cost on ``ctx.device``; return the graph's totals."""
    spec: DeviceSpec = ctx.device
    summary = {"flops": 0, "bytes": 0, "est_us": 0.0, "compute_bound": 0, "memory_bound": 0}
    for node in gm.graph.nodes:
        flops, nbytes, intensity, bound, est_us = node_cost(node, spec)
        ann = info(node)
        ann.flops, ann.bytes, ann.intensity, ann.bound, ann.est_us = flops, nbytes, intensity, bound, est_us
        ann.library = is_library_kernel(node)
        summary["flops"] += flops
        summary["bytes"] += nbytes
        summary["est_us"] += est_us
        if bound == "compute":
            summary["compute_bound"] += 1
        elif bound == "memory":
            summary["memory_bound"] += 1
    return summary
