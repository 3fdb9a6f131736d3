"""Gradients pass: a whole step's new ``.grad`` is the gradient itself, not a copy of it.

Reads and rewrites the graph (no annotations); returns how many copies it removed.

Dynamo traces ``loss.backward()`` into a whole-step graph as ``torch.autograd.grad`` plus
``accumulate_grad_`` per parameter; functionalized, a parameter whose ``.grad`` is None gets
``copy(empty_like(p), g)``: a fresh parameter-sized buffer and a copy kernel per parameter (about
200 for a CLIP), where eager autograd's AccumulateGrad steals ``g`` when nothing else holds it and
its layout is the parameter's. This pass does the same: where ``g`` is a computed tensor (not an
input, not returned elsewhere, not a view) with the dtype, shape and strides ``empty_like(p)``
would have, the output is ``g`` itself. A gradient in another layout keeps its copy, as eager clones it.
Where ``.grad`` exists, ``p.grad + copy(empty_like(p), g)`` becomes ``p.grad + g``.

With the optimizer inside the step (``optimizer_step.py``), the copy's reader is the parameter's
update; an ``apollo::adam_step`` of its own (a parameter the lists leave out) reads a gradient
of any floating dtype in the parameter's layout: there ``copy(empty_like(p), _to_copy(g,
float32))`` becomes ``g`` itself, the bf16 matmul output of a weight under autocast (NOTE: The
update reads the gradient as it was computed).

A gradient that is a *view* in the parameter's layout (a weight's ``t(t(mm(...)))``, a bias's
``view(sum(...), [n])``: half of a two-tower model's gradients) is not handed out as that view:
a ``.grad`` with a ``_base`` changed what Dynamo guards on and recompiled the step. Where the
view chain's result is contiguous, starts at offset 0 and covers its whole base, which is
contiguous and read by that chain alone, it reads the base's memory in the base's own order, so
``_unsafe_view(base, shape)`` is the same values as a tensor of its own (what functionalization
emits for a reshape that must not alias), and the copy goes.
"""

from __future__ import annotations

import torch
import torch.fx

from ..fused_update import adam_step

aten = torch.ops.aten
# what empty_like(p) becomes: as traced, or under Inductor's decompositions
_ALLOCATIONS = (aten.empty_like.default, aten.empty.memory_format, aten.empty_strided.default)


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _owns_its_storage(node: torch.fx.Node) -> bool:
    """Whether `node`'s value is a tensor of its own, not a view (``t`` of a matmul's output): a
    ``.grad`` that is a view would also change what Dynamo guards on between calls (its ``_base``)."""
    return node.op == "call_function" and not (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)


def _contiguous_view_base(grad: torch.fx.Node, returned: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """The tensor a chain of views ending at `grad` reads, where the chain reads all of it in its
    own memory order (see the module docstring) and nothing else reads it or the chain; else None."""
    base = grad
    while not _owns_its_storage(base) and base.op == "call_function":  # up the views
        if len(base.users) != 1 or returned.get(base, 0) or not isinstance(base.args[0], torch.fx.Node):
            return None
        base = base.args[0]
    if base is grad or base.op != "call_function" or len(base.users) != 1 or returned.get(base, 0):
        return None
    g, b = _val(grad), _val(base)
    if g is None or b is None or g.dtype != b.dtype or g.device != b.device:
        return None
    try:
        same_memory = (g.numel() == b.numel() and g.storage_offset() == 0 and b.storage_offset() == 0
                       and g.is_contiguous() and b.is_contiguous())
    except Exception:  # a symbolic size that cannot be decided: keep the copy
        return None
    return base if same_memory else None


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
    out, g = _val(copy), _val(grad)
    if out is None or g is None or (out.dtype, out.device, out.shape) != (g.dtype, g.device, g.shape):
        return None
    if returned.get(copy, 0):  # a new .grad: it must also own its memory in the parameter's layout
        if out.stride() != g.stride():
            return None
        if _owns_its_storage(grad):
            return grad
        base = _contiguous_view_base(grad, returned)
        if base is None:
            return None
        with copy.graph.inserting_before(copy):  # the same values, as a tensor of its own
            own = copy.graph.call_function(aten._unsafe_view.default, (base, list(g.shape)))
        own.meta.update({k: v for k, v in grad.meta.items() if k != "apollo"})
        return own
    # the existing .grad plus the new gradient: the sum reads values, whatever their layout
    return grad if copy.users and all(u.target is aten.add.Tensor for u in copy.users) else None


_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _update_reads_as_computed(copy: torch.fx.Node, returned: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """The gradient `copy` copies (and casts to the parameter's dtype) for one parameter's update
    alone, where the update can read it as it is: in the parameter's shape and strides, a floating
    dtype; else None.

    [NOTE] The update reads the gradient as it was computed. Under bf16 autocast a weight's
    gradient leaves its matmul in bf16 (as ``t(t(mm))``, the parameter's own layout), and the
    update read a float32 copy of it: on HF CLIP B/16 the copies were 146 kernels of their own,
    0.52 ms of GPU time per step, and a float32 buffer per weight (H200, session 35,
    ``probes/step_kernels.py``). The update's kernels cast as they load (``fused_update.py``), so
    the copy goes; the values are the same (a bf16 value is exact in float32). A list update
    (``apollo::adam_step_foreach``, the default layout since session 37) keeps its copies:
    torch's multi-tensor kernel takes one dtype per list (``fused_update.py``, NOTE: Small
    parameters share a launch, says what that costs)."""
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
    out, g = _val(copy), _val(grad)
    if (not isinstance(grad, torch.fx.Node) or grad.op != "call_function" or returned.get(grad, 0)
            or out is None or g is None or not g.is_floating_point() or g.device != out.device):
        return None
    try:
        same_layout = g.shape == out.shape and g.stride() == out.stride()
    except Exception:  # a symbolic size that cannot be decided: keep the copy
        return None
    return grad if same_layout else None


def run(gm: torch.fx.GraphModule, ctx) -> dict:
    if ctx.kind != "inference":
        return {"stolen": 0}
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = output.args[0]
    if not isinstance(outs, (tuple, list)):
        return {"stolen": 0}
    returned: dict[torch.fx.Node, int] = {}
    for o in outs:
        if isinstance(o, torch.fx.Node):
            returned[o] = returned.get(o, 0) + 1
    stolen = 0
    for copy in [n for n in gm.graph.nodes if n.target is aten.copy.default]:
        if returned.get(copy, 0) > 1:
            continue
        grad = _stealable(copy, returned) or _update_reads_as_computed(copy, returned)
        if grad is not None:
            copy.replace_all_uses_with(grad)
            returned[grad] = returned.pop(copy, 0)
            stolen += 1
    if stolen:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return {"stolen": stolen}
