"""Cast pass: mixed precision on the Dynamo graph, for ``options={"precision": "bf16" | "fp16"}``.

Runs on the torch-level Dynamo FX graph, before AOTAutograd, so autograd traces through the casts
it inserts: the gradient of ``w.to(bf16)`` is cast back to fp32 on its way to ``w.grad``.

Reads  ``node.meta["example_value"]`` (Dynamo's FakeTensors: dtypes and shapes), ``ctx.options``
       (``precision``) and ``ctx.device`` (for the roofline figures in a keep-fp32 decision).
Writes new ``x.to(dtype)`` nodes, each marked twice: ``NodeInfo.cast`` on the Dynamo graph, and
       ``node.meta["custom"]["apollo_cast"]``, which torch copies onto every ATen node traced from
       it; the modality pass turns that into ``NodeInfo.cast`` (:func:`cast_mark`), shown as
       ``cast->bf16`` in listings. Returns a dict: what was lowered, kept, cast up, and every cast.

``precision=None`` (the default) and ``"fp32"`` change nothing. For ``"bf16"`` / ``"fp16"``
(docs/design/casts.md#rules): compute-bound ops get their fp32 inputs cast low; other ops follow
torch's type promotion; numerically sensitive ops (softmax, norms, losses, reductions) and ops
that need matching dtypes get fp32 inputs back; graph outputs return in their original dtypes;
parameters stay fp32 masters, each cast at most once per dtype. Matmuls under one 16x16x16 tile
(:data:`MIN_LOW_FLOPS`) keep fp32 (#tiny-matmuls); fp16 needs a ``GradScaler`` (#fp16); inside a
user's autocast region autocast decides (#autocast).

[NOTE] Dtypes after the rewrite are predicted, not re-traced: an op's output dtype follows the
promotion of its new input dtypes where it followed the old ones, and keeps an explicit or other
dtype (docs/design/casts.md#predicted-dtypes).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from ..annotations import KEY, info
from ..nodes import input_nodes, meta_tensor, meta_value
from ..shapes import concrete_numel as _numel
from ..shapes import concrete_shape as _shape

__all__ = ["CUSTOM_KEY", "LOW_DTYPES", "MIN_LOW_FLOPS", "cast_mark", "run"]

LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
CUSTOM_KEY = "apollo_cast"  # node.meta["custom"][CUSTOM_KEY] = "bf16": carried to the ATen nodes
TILE = 16
MIN_LOW_FLOPS = 2 * TILE**3  # one 16x16x16 multiply-add tile (docs/design/casts.md#tiny-matmuls)

_COMPUTE = (
    "linear", "matmul", "mm", "bmm", "mv", "addmm", "baddbmm", "addbmm", "addmv", "einsum",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "scaled_dot_product_attention",
)
_SENSITIVE = (
    # softmax family and norms
    "softmax", "log_softmax", "softmin", "layer_norm", "group_norm", "batch_norm", "instance_norm",
    "rms_norm", "local_response_norm", "normalize", "cosine_similarity",
    # losses
    "cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "poisson_nll_loss", "gaussian_nll_loss",
    "cosine_embedding_loss", "margin_ranking_loss", "hinge_embedding_loss", "soft_margin_loss",
    "multilabel_soft_margin_loss", "multilabel_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    # exp/log and other functions that amplify relative error
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "logsumexp", "logaddexp", "pow",
    "reciprocal", "rsqrt", "softplus", "erfinv", "acos", "asin", "cosh", "sinh", "tan",
    # reductions
    "sum", "mean", "nansum", "nanmean", "prod", "cumsum", "cumprod", "norm", "vector_norm",
    "matrix_norm", "var", "std", "var_mean", "std_mean", "dist", "cdist", "pdist", "renorm",
)
# Out-of-place ops that refuse mixed floating dtypes instead of promoting (autocast's "promote" list
# and the index/scatter family): their inputs go back to the program's dtypes.
_MATCHING = (
    "index_put", "scatter", "scatter_add", "scatter_reduce", "index_copy", "index_add", "masked_scatter",
    "lerp", "dot", "vdot", "cross", "atan2", "bilinear", "tensordot", "grid_sample", "addcmul", "addcdiv",
)
_FIXED_DTYPE_METHODS = frozenset({"float", "double", "half", "bfloat16"})  # x.float(): fp32 whatever x is
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor}


@functools.lru_cache(maxsize=None)
def _functions() -> dict[Any, tuple[str, str]]:
    """Callable -> (kind, name) for the torch-level functions Dynamo puts in its graphs."""
    table: dict[Any, tuple[str, str]] = {}
    spaces = [torch, F, torch._C._nn, torch.special, torch.linalg, torch.Tensor]
    for kind, names in (("matching", _MATCHING), ("sensitive", _SENSITIVE), ("compute", _COMPUTE)):
        for name in names:
            for space in spaces:
                fn = getattr(space, name, None)
                if callable(fn):
                    try:
                        table[fn] = (kind, name)
                    except TypeError:  # unhashable
                        pass
    table[operator.matmul] = ("compute", "matmul")
    table[operator.pow] = ("sensitive", "pow")
    return table


def _classify(node: torch.fx.Node) -> tuple[str, str]:
    """(kind, op name): compute | sensitive | matching | inplace | opaque | autocast | follow."""
    if node.op == "call_module":
        return "opaque", str(node.target)
    if node.op == "call_method":
        name = str(node.target)
        if name in ("__matmul__", "__rmatmul__"):
            return "compute", "matmul"
        if name.endswith("_") and not name.startswith("_"):
            return "inplace", name
        for kind, names in (("compute", _COMPUTE), ("sensitive", _SENSITIVE), ("matching", _MATCHING)):
            if name in names:
                return kind, name
        return "follow", name
    target = node.target
    name = getattr(target, "__name__", str(target))
    if target is operator.setitem or target in _INPLACE_OPERATORS:
        return "inplace", name
    if name in ("_enter_autocast", "_exit_autocast") and "autocast" in (getattr(target, "__module__", None) or ""):
        return "autocast", name
    try:
        hit = _functions().get(target)
    except TypeError:
        hit = None
    if hit is not None:
        return hit
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "opaque", name
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        if getattr(target, "namespace", "aten") != "aten":
            return "opaque", name
        return "follow", name
    if name.endswith("_") and not name.startswith("_") and getattr(target, "__module__", "") in ("torch", None):
        return "inplace", name  # torch.relu_ and friends
    return "follow", name


# ---------------------------------------------------------------------------- dtypes and shapes


def _dtypes(val: Any) -> Any:
    """The dtype structure of a meta value: a dtype, a tuple of them, or None."""
    if isinstance(val, torch.Tensor):
        return val.dtype
    if isinstance(val, (tuple, list)):
        return tuple(_dtypes(v) for v in val)
    return None


def _float(dtype: Any) -> bool:
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _promote(entries: list[tuple[torch.dtype, int]]) -> torch.dtype:
    """torch's promotion among floating tensors: dimensioned ones outrank 0-dim ones."""
    dims = [d for d, ndim in entries if ndim > 0] or [d for d, _ in entries]
    return functools.reduce(torch.promote_types, dims)


def _storage(node: Any) -> Any:
    """A weak reference to the storage of a node's example value (views share it), else None."""
    val = meta_value(node)
    if not isinstance(val, torch.Tensor):
        return None
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(val.untyped_storage())
    except Exception:
        return None


def _is_parameter(node: torch.fx.Node) -> bool:
    """A parameter of the compiled model (Dynamo lifts them to placeholders typed Parameter)."""
    if node.op == "get_attr":
        return True
    kind = node.type
    return isinstance(meta_value(node), torch.nn.Parameter) or (
        isinstance(kind, type) and issubclass(kind, torch.nn.Parameter))


def _ambient_autocast() -> bool:
    """Is autocast on around the compiled call (Dynamo compiles inside the user's context)?"""
    for device in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device):
                return True
        except Exception:  # pragma: no cover - a build without that device type
            pass
    return False


def _has_dtype_arg(node: torch.fx.Node) -> bool:
    return any(isinstance(a, torch.dtype) for a in (*node.args, *node.kwargs.values()))


# ---------------------------------------------------------------------------- FLOPs


def _flops(name: str, node: torch.fx.Node) -> int | None:
    """FLOPs of a compute op from Dynamo's example values; None when unknown."""
    try:
        args = [meta_value(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
        out = meta_value(node)
        if name == "scaled_dot_product_attention":
            q, k, v = (_shape(a) for a in args[:3])
            batch = math.prod(q[:-2])
            return 2 * batch * q[-2] * k[-2] * (q[-1] + v[-1])
        if name == "einsum":
            return _einsum_flops(args)
        if not isinstance(out, torch.Tensor):
            return None
        if name.startswith("conv_transpose"):
            return 2 * _numel(args[0]) * (_numel(args[1]) // _shape(args[1])[0])
        if name.startswith("conv"):
            return 2 * _numel(out) * (_numel(args[1]) // _shape(args[1])[0])
        if name in ("addmm", "baddbmm", "addbmm"):
            return 2 * _numel(args[1]) * _shape(args[2])[-1]
        if name == "addmv":
            return 2 * _numel(args[1])
        if name == "linear":
            return 2 * _numel(out) * _shape(args[1])[-1]
        a = _shape(args[0])  # matmul, mm, bmm, mv, @
        if node.op == "call_method" and node.target == "__rmatmul__":
            a = _shape(args[1])
        return 2 * _numel(out) * a[-1]
    except Exception:
        return None


def _einsum_flops(args: list[Any]) -> int | None:
    equation = args[0]
    operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    if not isinstance(equation, str) or "..." in equation or len(operands) != 2:
        return None
    sizes: dict[str, int] = {}
    for letters, t in zip(equation.replace(" ", "").split("->")[0].split(","), operands):
        for letter, size in zip(letters, _shape(t)):
            sizes[letter] = size
    return 2 * math.prod(sizes.values())


def _roofline_us(node: torch.fx.Node, flops: int, spec: Any) -> float:
    nbytes = 0
    for t in (*(meta_value(n) for n in input_nodes(node)), meta_value(node)):
        if isinstance(t, torch.Tensor):
            nbytes += _numel(t) * t.element_size()
    peak = spec.peak_flops(torch.float32, matmul=True)
    return max(flops / peak if peak else 0.0, nbytes / spec.bandwidth if spec.bandwidth else 0.0) * 1e6


# ---------------------------------------------------------------------------- the pass


def cast_mark(node: torch.fx.Node) -> str | None:
    """The cast mark of a node: "bf16" for a cast apollo inserted, else None.

    On ATen graphs it reads ``node.meta["custom"]["apollo_cast"]``, which torch copied from the
    Dynamo cast node the ATen node was traced from; the mark is the dtype the node produces
    (so the backward of a cast to bf16, a cast back to fp32, reads "fp32"). Elsewhere it returns
    the node's ``NodeInfo.cast`` if it has one.
    """
    if node.op in ("placeholder", "output"):  # e.g. a saved cast entering the backward: not run there
        return None
    custom = node.meta.get("custom")
    mark = custom.get(CUSTOM_KEY) if isinstance(custom, dict) else None
    if mark is None:
        ann = node.meta.get(KEY)
        return getattr(ann, "cast", None)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype in SHORT:
        return SHORT[val.dtype]
    return mark


class _Rewriter:
    """One walk over the graph in order: predicts dtypes, inserts and caches casts."""

    def __init__(self, gm: torch.fx.GraphModule, low: torch.dtype, spec: Any) -> None:
        self.gm, self.graph, self.low, self.spec = gm, gm.graph, low, spec
        self.orig: dict[torch.fx.Node, Any] = {}
        self.new: dict[torch.fx.Node, Any] = {}
        self.cache: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        self.casts: list[dict[str, Any]] = []
        self.lowered: list[str] = []
        self.kept: list[dict[str, Any]] = []
        self.fp32_ops: list[str] = []
        self.autocast_ops: list[str] = []
        self.autocast: list[bool] = [_ambient_autocast()]  # enabled? innermost last

    # ---- helpers
    def dtype(self, node: Any) -> Any:
        if not isinstance(node, torch.fx.Node):
            return None
        return self.new.get(node, self.orig.get(node))

    def float_inputs(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        return [n for n in input_nodes(node) if _float(self.dtype(n))]

    def cast(self, src: torch.fx.Node, dtype: torch.dtype, user: torch.fx.Node) -> None:
        """Make `user` read `src` in `dtype`, through the cached cast of `src` or a new one."""
        key = (src, dtype)
        node = self.cache.get(key)
        if node is None:
            with self.graph.inserting_before(user):
                node = self.graph.call_method("to", (src, dtype))
            for field in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if field in user.meta:  # labelled like the op it feeds (modality pass, listings)
                    node.meta[field] = user.meta[field]
            val = meta_value(src)
            if isinstance(val, torch.Tensor):
                node.meta["example_value"] = val.to(dtype)
            mark = SHORT.get(dtype, str(dtype))
            node.meta["custom"] = {CUSTOM_KEY: mark}
            info(node).cast = mark
            self.orig[node] = self.new[node] = dtype
            self.cache[key] = node
            self.casts.append({"node": node.name, "source": src.name, "to": mark, "first_user": user.name,
                               "parameter": _is_parameter(src)})
        user.replace_input_with(src, node)

    def restore_inputs(self, node: torch.fx.Node) -> bool:
        """Cast back every input whose dtype the pass changed; True if any was."""
        changed = [n for n in self.float_inputs(node) if self.dtype(n) != self.orig.get(n)]
        for n in changed:
            self.cast(n, self.orig[n], node)
        return bool(changed)

    def invalidate(self, mutated: Any) -> None:
        """Forget the casts of everything sharing storage with `mutated`: they would be stale."""
        ref = _storage(mutated)
        if ref is None:
            self.cache.clear()
            return
        for key in list(self.cache):
            other = _storage(key[0])
            if other is None or other == ref:
                del self.cache[key]

    # ---- per kind
    def visit(self, node: torch.fx.Node) -> None:
        self.orig[node] = _dtypes(meta_value(node))
        if node.op in ("placeholder", "get_attr", "output"):
            return
        kind, name = _classify(node)
        if kind == "autocast":
            self.enter_exit_autocast(node, name)
        elif kind == "inplace":
            self.invalidate(node.args[0] if node.args else None)
            self.inplace(node, name)
        elif kind == "compute":
            self.compute(node, name)
        elif kind in ("sensitive", "matching", "opaque"):
            if self.restore_inputs(node) and kind == "sensitive":
                self.fp32_ops.append(node.name)
        else:
            self.follow(node, name)

    def enter_exit_autocast(self, node: torch.fx.Node, name: str) -> None:
        if name == "_enter_autocast":
            enabled = node.args[2] if len(node.args) > 2 else node.kwargs.get("enabled", True)
            self.autocast.append(bool(enabled))
        elif len(self.autocast) > 1:
            self.autocast.pop()

    def compute(self, node: torch.fx.Node, name: str) -> None:
        inputs = self.float_inputs(node)
        out = self.orig[node]
        if self.autocast[-1]:  # the user's autocast decides this op's dtype
            self.autocast_ops.append(node.name)
            return
        if len(self.autocast) > 1:  # inside a region where the user disabled autocast
            self.kept.append({"node": node.name, "op": name, "flops": _flops(name, node),
                              "reason": "the user disabled autocast around it: it runs in the program's dtypes"})
            self.restore_inputs(node)
            return
        if not inputs or any(self.dtype(n) not in (torch.float32, self.low) for n in inputs) or not _float(out):
            self.restore_inputs(node)  # other dtypes (fp64, ...) are the user's choice: leave them
            return
        flops = _flops(name, node)
        if flops is not None and flops < MIN_LOW_FLOPS:
            t = _roofline_us(node, flops, self.spec)
            self.kept.append({
                "node": node.name, "op": name, "flops": flops,
                "reason": f"{flops} FLOPs < {MIN_LOW_FLOPS} (one {TILE}x{TILE}x{TILE} tile): roofline "
                          f"{t:.3f} us in fp32 vs {self.spec.launch_us:.1f} us launch on {self.spec.name}; "
                          f"{SHORT[self.low]} cannot pay for its casts",
            })
            self.restore_inputs(node)
            return
        for n in inputs:
            if self.dtype(n) == torch.float32:
                self.cast(n, self.low, node)
        self.lowered.append(node.name)
        if out == torch.float32:
            self.new[node] = self.low

    def inplace(self, node: torch.fx.Node, name: str) -> None:
        self_node = node.args[0] if node.args else None
        self_dtype = self.dtype(self_node)
        if name.rstrip("_") in _MATCHING or node.target is operator.setitem:
            for n in self.float_inputs(node):
                if n is not self_node and _float(self_dtype) and self.dtype(n) != self_dtype:
                    self.cast(n, self_dtype, node)
        if isinstance(self.orig[node], torch.dtype) and _float(self_dtype):
            self.new[node] = self_dtype

    def follow(self, node: torch.fx.Node, name: str) -> None:
        inputs = self.float_inputs(node)
        if not any(self.dtype(n) != self.orig.get(n) for n in inputs):
            return
        if node.target is operator.getitem and isinstance(self.dtype(node.args[0]), tuple):
            idx = node.args[1]
            if isinstance(idx, int):
                self.new[node] = self.dtype(node.args[0])[idx]
            return
        if (node.op == "call_method" and name in _FIXED_DTYPE_METHODS) or _has_dtype_arg(node):
            return
        if node.op == "call_method" and name in ("to", "type", "type_as", "new_tensor"):
            others = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
            if name == "new_tensor":
                return
            if others:  # .to(other) / .type_as(other): other's dtype
                if _float(self.dtype(others[0])):
                    self.new[node] = self.dtype(others[0])
                return
        ndims = {n: (t.dim() if (t := meta_tensor(n)) is not None else 0) for n in inputs}
        old = _promote([(self.orig[n], ndims[n]) for n in inputs])
        new = _promote([(self.dtype(n), ndims[n]) for n in inputs])

        def remap(d: Any) -> Any:
            if isinstance(d, tuple):
                return tuple(remap(x) for x in d)
            return new if d == old else d

        self.new[node] = remap(self.orig[node])

    def outputs(self, output: torch.fx.Node) -> int:
        """Cast returned values back to their original dtypes; the number of casts made."""
        count = 0
        for n in input_nodes(output):
            if isinstance(self.orig.get(n), torch.dtype) and self.dtype(n) != self.orig[n]:
                self.cast(n, self.orig[n], output)
                count += 1
        return count

    def sync_meta(self) -> None:
        """Keep ``example_value`` consistent with the predicted dtypes of rewritten nodes."""

        def retype(val: Any, dtype: Any) -> Any:
            if isinstance(val, torch.Tensor) and isinstance(dtype, torch.dtype) and val.dtype != dtype:
                return val.to(dtype)
            if isinstance(val, (tuple, list)) and isinstance(dtype, tuple) and len(val) == len(dtype):
                return type(val)(retype(v, d) for v, d in zip(val, dtype))
            return val

        for node, dtype in self.new.items():
            if dtype != self.orig.get(node) and "example_value" in node.meta:
                try:
                    node.meta["example_value"] = retype(node.meta["example_value"], dtype)
                except Exception:  # meta is advisory here; AOTAutograd re-traces from the inputs
                    pass


def run(gm: torch.fx.GraphModule, ctx: Any) -> dict:
    """Insert the casts for ``ctx.options.precision`` into the Dynamo graph `gm`; return the decision.

    The decision: ``precision``; ``changed``; ``lowered`` (compute ops now in the low dtype);
    ``kept_fp32`` (compute ops kept, each with ``flops`` and ``reason``); ``fp32_ops``
    (sensitive ops whose inputs were cast back up); ``autocast_ops`` (compute ops left to the
    user's autocast); ``casts`` (every cast node: ``node``, ``source``, ``to``, ``first_user``,
    ``parameter``) and their count ``cast_nodes``; ``weight_casts`` (parameter -> its one cast
    to the low dtype); ``output_casts`` (graph outputs cast back). With nothing to do, only
    ``precision``, ``changed=False`` and a ``note`` saying why.
    """
    precision = ctx.options.precision
    if precision not in LOW_DTYPES:
        why = "default: the user's dtypes and autocast are left as written" if precision is None else \
            "fp32 requested: the graph runs in the dtypes the user wrote"
        return {"precision": precision, "changed": False, "note": why}
    low = LOW_DTYPES[precision]
    rw = _Rewriter(gm, low, ctx.device)
    output = None
    for node in list(gm.graph.nodes):
        if node.op == "output":
            output = node
            continue
        rw.visit(node)
    out_casts = rw.outputs(output) if output is not None else 0
    rw.sync_meta()
    gm.graph.lint()
    gm.recompile()
    weight_casts = {c["source"]: c["node"] for c in rw.casts if c["parameter"] and c["to"] == precision}
    return {
        "precision": precision,
        "changed": bool(rw.casts),
        "rule": f"compute ops with >= {MIN_LOW_FLOPS} FLOPs run in {precision}; sensitive ops and outputs in fp32",
        "lowered": rw.lowered,
        "kept_fp32": rw.kept,
        "fp32_ops": rw.fp32_ops,
        "autocast_ops": rw.autocast_ops,
        "casts": rw.casts,
        "cast_nodes": len(rw.casts),
        "weight_casts": weight_casts,
        "output_casts": out_casts,
    }
