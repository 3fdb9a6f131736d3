"""Gradients pass: a whole step's new ``.grad`` is the gradient itself, not a copy of it.

Reads and rewrites the graph (no annotations); returns how many copies it removed (``stolen``) and,
for a backward graph, how many gradients it widened.

Functionalized, a whole step gives a parameter whose ``.grad`` is None ``copy(empty_like(p), g)``:
a parameter-sized buffer and a copy kernel per parameter, where eager autograd's AccumulateGrad
steals ``g`` when nothing else holds it and its layout is the parameter's. This pass does the same
(docs/design/step-passes.md#gradients):

- where ``g`` is a computed tensor (not an input, not returned elsewhere) in the layout
  ``empty_like(p)`` would have, the output is ``g`` itself; another layout keeps its copy, as eager
  clones it; where ``.grad`` exists, ``p.grad + copy(empty_like(p), g)`` becomes ``p.grad + g``;
- a gradient that is a contiguous view covering its whole contiguous base becomes
  ``_unsafe_view(base, shape)``: a ``.grad`` with a ``_base`` changes what Dynamo guards on;
- an ``apollo::adam_step`` of its own reads the gradient in any floating dtype, so its float32
  copy goes too (NOTE: The update reads the gradient as it was computed);
- a list update (``apollo::adam_step_foreach``) reads its gradients as a new ``.grad`` is read;
  where what it reads (or a new ``.grad``, or a backward graph's returned gradient) is the float32
  cast of a bf16/fp16 matmul's output, the matmul writes float32 itself (NOTE: A weight's gradient
  leaves its matmul in float32).
"""

from __future__ import annotations

import torch
import torch.fx

from torch._guards import detect_fake_mode

from ..ops.fused_update import adam_step, adam_step_foreach
from ..nodes import meta_tensor

aten = torch.ops.aten
# aten::mm.dtype: a bf16/fp16 matmul with a float32 output (torch >= 2.8); ATen has CUDA kernels only
_WIDE_MM = getattr(aten.mm, "dtype", None)
WIDE_MATMUL_DEVICES = frozenset({"cuda"})  # where the gradients' matmuls write float32 (tests add the CPU)
_LOW = (torch.bfloat16, torch.float16)
# what empty_like(p) becomes: as traced, or under Inductor's decompositions
_ALLOCATIONS = (aten.empty_like.default, aten.empty.memory_format, aten.empty_strided.default)


def _owns_its_storage(node: torch.fx.Node) -> bool:
    """Whether `node`'s value is a tensor of its own, not a view (``t`` of a matmul's output): a
    ``.grad`` that is a view would also change what Dynamo guards on between calls (its ``_base``)."""
    return node.op == "call_function" and not (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)


def _views_base(grad: torch.fx.Node, returned: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """The computed tensor a chain of views ending at `grad` (maybe none) reads, where nothing else
    reads it or the chain and the chain reads all of it in its own memory order (see the module
    docstring); else None."""
    base = grad
    while not _owns_its_storage(base) and base.op == "call_function":  # up the views
        if len(base.users) != 1 or returned.get(base, 0) or not isinstance(base.args[0], torch.fx.Node):
            return None
        base = base.args[0]
    if base.op != "call_function" or len(base.users) != 1 or returned.get(base, 0):
        return None
    g, b = meta_tensor(grad), meta_tensor(base)
    if g is None or b is None or g.dtype != b.dtype or g.device != b.device:
        return None
    try:
        same_memory = (g.numel() == b.numel() and g.storage_offset() == 0 and b.storage_offset() == 0
                       and g.is_contiguous() and b.is_contiguous())
    except Exception:  # a symbolic size that cannot be decided: keep the copy
        return None
    return base if same_memory else None


def _contiguous_view_base(grad: torch.fx.Node, returned: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """:func:`_views_base` where `grad` is a view."""
    base = _views_base(grad, returned)
    return None if base is grad else base


def _as_own_tensor(base: torch.fx.Node, like: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
    """``_unsafe_view(base, shape of like)``, before `before`: the values of `like` (a contiguous view
    chain over all of `base`) as a tensor of its own."""
    with before.graph.inserting_before(before):
        own = before.graph.call_function(aten._unsafe_view.default, (base, list(meta_tensor(like).shape)))
    own.meta.update({k: v for k, v in like.meta.items() if k != "apollo"})
    return own


def _widened(cast: torch.fx.Node, returned: dict[torch.fx.Node, int], *, output: bool = False) -> torch.fx.Node | None:
    """For `cast`, the float32 cast of (a chain of views of) a bf16/fp16 ``mm``'s output, read
    through that chain alone: the same product as ``aten::mm.dtype`` writing float32, in the
    chain's shape; else None.

    [NOTE] A weight's gradient leaves its matmul in float32. Under bf16 autocast the float32 copy
    of a weight's bf16 gradient is a cast kernel of its own (Inductor cannot fuse a cast into an
    ATen matmul) and a bf16 buffer besides the float32 one. cuBLAS writes the float32 result of a
    bf16 product itself (``aten::mm.dtype``), so the cast and the bf16 buffer go; the values are
    the product before its rounding to bf16, within bf16's rounding of eager autocast's gradient.
    Only gradients the cast copies whole (a new ``.grad``, a list update's read, or with `output`
    a backward graph's output): a cast the backward's other ops read fuses into them
    (docs/design/step-passes.md#float32-matmul)."""
    if _WIDE_MM is None or cast.target not in _CASTS or len(cast.users) != 1:
        return None
    if returned.get(cast, 0) != (1 if output else 0):
        return None
    out, chain = meta_tensor(cast), cast.args[0]
    if (out is None or out.dtype != torch.float32 or out.device.type not in WIDE_MATMUL_DEVICES
            or not isinstance(chain, torch.fx.Node)):
        return None
    mm = _views_base(chain, returned)
    if mm is None or mm.target is not aten.mm.default or mm.kwargs or meta_tensor(mm) is None:
        return None
    if meta_tensor(mm).dtype not in _LOW:
        return None
    try:
        if not out.is_contiguous() or out.shape != meta_tensor(chain).shape:
            return None
    except Exception:  # a symbolic size that cannot be decided
        return None
    a, b = mm.args
    fake_mode = detect_fake_mode([meta_tensor(a), meta_tensor(b)])
    if fake_mode is None:
        return None
    with cast.graph.inserting_before(cast):
        wide = cast.graph.call_function(_WIDE_MM, (a, b, torch.float32))
    wide.meta.update({k: v for k, v in mm.meta.items() if k not in ("apollo", "val", "tensor_meta")})
    with fake_mode:
        wide.meta["val"] = _WIDE_MM(meta_tensor(a), meta_tensor(b), torch.float32)
    if chain is mm:
        return wide
    own = _as_own_tensor(wide, cast, cast)
    with fake_mode:
        own.meta["val"] = aten._unsafe_view.default(wide.meta["val"], list(out.shape))
    return own


def _read_by_list_updates_alone(copy: torch.fx.Node) -> bool:
    """Whether every reader of `copy` is a list update (``apollo::adam_step_foreach``) reading it
    as one of its gradients, and as nothing else."""
    for update in copy.users:
        if not (update.target is torch.ops.higher_order.auto_functionalized_v2 and update.args
                and update.args[0] is adam_step_foreach):
            return False
        for key, value in update.kwargs.items():
            times = sum(x is copy for x in value) if isinstance(value, (list, tuple)) else int(value is copy)
            if times != (key == "grads"):
                return False
    return bool(copy.users)


def _stealable(copy: torch.fx.Node, returned: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """The gradient `copy` copies, if the copy can go (see the module docstring)."""
    if copy.target is not aten.copy.default or len(copy.args) < 2 or copy.kwargs:
        return None
    dst, grad = copy.args[0], copy.args[1]
    if not (isinstance(dst, torch.fx.Node) and isinstance(grad, torch.fx.Node)):
        return None
    if dst.target not in _ALLOCATIONS or len(dst.users) != 1:
        return None
    if grad.op != "call_function" or returned.get(grad, 0) or len(grad.users) != 1:
        return None
    out, g = meta_tensor(copy), meta_tensor(grad)
    if out is None or g is None or (out.dtype, out.device, out.shape) != (g.dtype, g.device, g.shape):
        return None
    if returned.get(copy, 0) or _read_by_list_updates_alone(copy):
        # a new .grad, or a list's: it must also own its memory in the parameter's layout
        if out.stride() != g.stride():
            return None
        if _owns_its_storage(grad):
            return _widened(grad, returned) or grad
        base = _contiguous_view_base(grad, returned)
        return None if base is None else _as_own_tensor(base, grad, copy)  # the same values, as a tensor of its own
    # the existing .grad plus the new gradient: the sum reads values, whatever their layout
    return grad if copy.users and all(u.target is aten.add.Tensor for u in copy.users) else None


_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _update_reads_as_computed(copy: torch.fx.Node, returned: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """The gradient `copy` copies (and casts to the parameter's dtype) for one parameter's update
    alone, where the update can read it as it is: in the parameter's shape and strides, a floating
    dtype; else None.

    [NOTE] The update reads the gradient as it was computed. Under bf16 autocast a weight's
    gradient leaves its matmul in bf16, in the parameter's own layout; a float32 copy of it for the
    update is a kernel and a float32 buffer per weight. The update's kernels cast as they load
    (``fused_update.py``), so the copy goes; the values are the same (a bf16 value is exact in
    float32). A list update (``apollo::adam_step_foreach``) keeps its copies: torch's multi-tensor
    kernel takes one dtype per list (docs/design/step-passes.md#update-reads-as-computed)."""
    if copy.target is not aten.copy.default or len(copy.users) != 1 or returned.get(copy, 0):
        return None
    (update,) = copy.users
    if not (update.target is torch.ops.higher_order.auto_functionalized_v2 and update.args
            and update.args[0] is adam_step and update.kwargs.get("grad") is copy):
        return None
    dst, grad = copy.args[0], copy.args[1]
    if not (isinstance(dst, torch.fx.Node) and dst.target in _ALLOCATIONS and len(dst.users) == 1):
        return None
    while isinstance(grad, torch.fx.Node) and grad.target in _CASTS and len(grad.users) == 1:
        grad = grad.args[0]
    out, g = meta_tensor(copy), meta_tensor(grad)
    if (not isinstance(grad, torch.fx.Node) or grad.op != "call_function" or returned.get(grad, 0)
            or out is None or g is None or not g.is_floating_point() or g.device != out.device):
        return None
    try:
        same_layout = g.shape == out.shape and g.stride() == out.stride()
    except Exception:  # a symbolic size that cannot be decided: keep the copy
        return None
    return grad if same_layout else None


def _widen_outputs(returned: dict[torch.fx.Node, int]) -> int:
    """A backward graph's gradients that are float32 casts of low-precision matmuls, made by the
    matmul in float32 (NOTE: A weight's gradient leaves its matmul in float32); returns how many."""
    widened = 0
    for out in list(returned):
        wide = _widened(out, returned, output=True)
        if wide is not None:
            out.replace_all_uses_with(wide)
            widened += 1
    return widened


def _steal_copies(gm: torch.fx.GraphModule, returned: dict[torch.fx.Node, int]) -> int:
    """A whole step's gradient copies that can go, gone (see the module docstring); returns how many."""
    stolen = 0
    for copy in [n for n in gm.graph.nodes if n.target is aten.copy.default]:
        if returned.get(copy, 0) > 1:
            continue
        grad = _stealable(copy, returned) or _update_reads_as_computed(copy, returned)
        if grad is not None:
            copy.replace_all_uses_with(grad)
            returned[grad] = returned.pop(copy, 0)
            stolen += 1
    return stolen


def run(gm: torch.fx.GraphModule, ctx) -> dict:
    if ctx.kind not in ("inference", "backward"):
        return {"stolen": 0}
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = output.args[0]
    if not isinstance(outs, (tuple, list)):
        return {"stolen": 0}
    returned: dict[torch.fx.Node, int] = {}
    for o in outs:
        if isinstance(o, torch.fx.Node):
            returned[o] = returned.get(o, 0) + 1
    if ctx.kind == "backward":
        decision = {"stolen": 0, "widened": _widen_outputs(returned)}
    else:
        decision = {"stolen": _steal_copies(gm, returned)}
    if any(decision.values()):  # what the rewrites left unread goes
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return decision
