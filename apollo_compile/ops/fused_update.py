"""Adam / AdamW updates as opaque ops of the step's graph.

``compile_step(fn, optimizer=opt)`` traces the update of every parameter into the step's graph
(``optimizer_step.py``). The parameters of a parameter group share one call of
:func:`adam_step_foreach`, torch's fused kernel over the list (``Adam(fused=True)``'s), which
``passes/update_lists.py`` splits by tower and cuts into parts; by default every parameter, on the
CPU and CUDA (:data:`FOREACH_DEVICES`, :data:`FOREACH_NUMEL`). A parameter left out of the lists
is one call of :func:`adam_step`, a custom op: one Triton kernel over the parameter's elements on
CUDA, torch's fused kernel elsewhere. The lanes pass puts each on its parameters' tower, and the
updates pass moves it next to its gradients. The ops read Adam's moments by name from the
:class:`AdamMoments` that ``InGraphAdam`` registers, and write them in place.

Also here: what the cost pass and the CUDA-graph runner need to know of these ops
(:func:`state_bytes`, :func:`written_state`), and their Inductor lowering
(:func:`register_inductor_lowering`). Measurements: docs/design/whole-step.md.
"""

from __future__ import annotations

import functools
import math
import sys
import weakref
from typing import Callable, Optional

import torch

__all__ = ["FOREACH_DEVICES", "FOREACH_NUMEL", "AdamMoments", "adam_step", "adam_step_foreach",
           "fused_kernel_devices", "kernel_lists", "register_inductor_lowering", "state_bytes", "written_state"]


class AdamMoments:
    """One parameter group's Adam moments, by the parameter's position in the group's list, under
    a name the update ops take in place of the tensors (NOTE: The moments are not graph inputs).
    `max_exp_avg_sqs` is None unless amsgrad. Registered while this object lives: the ops look
    it up through a weak reference, so the moments belong to whoever holds this (``InGraphAdam``).

    [NOTE] The moments are not graph inputs. An update op takes its parameters and gradients as
    tensors but the moments by name (:class:`AdamMoments`, the same tensors as ``optimizer.state``):
    as tensors they would be two thirds of the step's graph inputs, and every input costs host time
    before every call. Nothing else reads them, so the graph loses nothing: the op declares the
    parameters it writes, its cost counts the moments' bytes (:func:`state_bytes`), a captured CUDA
    graph replays the addresses found at capture (``InGraphAdam`` keeps them), and a runner that
    replays to time candidates puts them back (:func:`written_state`;
    docs/design/whole-step.md#the-moments-are-not-graph-inputs)."""

    def __init__(self, name: str, exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 max_exp_avg_sqs: Optional[list[torch.Tensor]] = None) -> None:
        self.name, self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs = name, exp_avgs, exp_avg_sqs, max_exp_avg_sqs
        _MOMENTS[name] = self

    def of(self, index: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The moments of the parameters at `index` (the third list empty unless amsgrad)."""
        amsgrad = self.max_exp_avg_sqs
        return ([self.exp_avgs[i] for i in index], [self.exp_avg_sqs[i] for i in index],
                [amsgrad[i] for i in index] if amsgrad is not None else [])


_MOMENTS: "weakref.WeakValueDictionary[str, AdamMoments]" = weakref.WeakValueDictionary()


def _moments(state: str) -> AdamMoments:
    moments = _MOMENTS.get(state)
    if moments is None:
        raise RuntimeError(f"apollo: the optimizer state {state!r} this compiled update reads is gone (the "
                           "compile_step(..., optimizer=) that laid it out was freed while its graph still runs)")
    return moments


def kernel_lists(state: str) -> int:
    """How many tensor lists torch's fused Adam kernel walks for the parameter group named `state`:
    parameters, gradients, both moments, and the maximum of the second with amsgrad."""
    return 5 if _moments(state).max_exp_avg_sqs is not None else 4


_LIBRARY = torch.library.Library("apollo", "FRAGMENT")
# [NOTE] The update is one op, not a formula. As Adam's formula (~15 elementwise ops per
# parameter), Inductor lowers, fuses and generates code for every parameter, and the
# optimizer-inside step compiles about 3x as long; as one op Inductor emits a call and generates
# nothing (docs/design/whole-step.md#the-update-is-one-op). The step counter and the learning rate
# stay device tensors the kernel reads (a CUDA graph replays it; no ``.item()``), and ``lr = 0`` is
# safe: the kernel multiplies by the step size, where torch's capturable path divides by it.
_LIBRARY.define(
    "adam_step(Tensor(a0!) param, Tensor grad, str state, int index, Tensor step, Tensor lr, float beta1, "
    "float beta2, float weight_decay, float eps, bool maximize, bool decoupled) -> ()")


def _adam_step(param: torch.Tensor, grad: torch.Tensor, state: str, index: int, step: torch.Tensor,
               lr: torch.Tensor, beta1: float, beta2: float, weight_decay: float, eps: float, maximize: bool,
               decoupled: bool) -> None:
    """Adam (AdamW when `decoupled`) on one parameter, in place, as ``optimizer.step()`` with
    ``fused=True`` computes it; its moments are those at `index` of the :class:`AdamMoments`
    named `state`, `step` is its counter already advanced to this step, `lr` a 0-d tensor.

    [NOTE] The op is defined with torch.library's low-level API: ``torch.library.custom_op``'s
    Python layers (autograd, view tracking, argument checks) cost several times the kernel's own
    host time per call, which every step pays per op wherever the graph is not replayed as a CUDA
    graph (docs/design/whole-step.md#the-op-uses-torchlibrarys-low-level-api)."""
    if not (param.device.type == "cuda" and param.is_contiguous() and _has_triton()):
        _adam_step_foreach([param], [grad], state, [index], [step], lr, beta1, beta2, weight_decay, eps, maximize,
                           decoupled)
        return
    (exp_avg,), (exp_avg_sq,), max_exp_avg_sq = _moments(state).of([index])
    max_exp_avg_sq = max_exp_avg_sq[0] if max_exp_avg_sq else None
    if grad.stride() != param.stride():  # the kernel walks the tensors as flat buffers
        grad = torch.empty_like(param).copy_(grad)
    _adam_triton(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, weight_decay, eps,
                 maximize, decoupled)
    for t in (param, exp_avg, exp_avg_sq, max_exp_avg_sq):
        if t is not None:  # one at a time: older torch takes no list
            torch.autograd.graph.increment_version(t)


def _register(name: str, kernel) -> torch._ops.OpOverload:
    """`kernel` as the op `name` on every device, and its fake (it writes its inputs, returns nothing)."""
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"apollo::{name}", lambda *args, **kwargs: None, lib=_LIBRARY)
    return getattr(torch.ops.apollo, name).default


adam_step = _register("adam_step", _adam_step)

_LIBRARY.define(
    "adam_step_foreach(Tensor(a0!)[] params, Tensor[] grads, str state, int[] index, Tensor[] steps, Tensor lr, "
    "float beta1, float beta2, float weight_decay, float eps, bool maximize, bool decoupled) -> ()")

FOREACH_NUMEL = sys.maxsize  # the largest parameter updated in a list: all (NOTE: Small parameters share a launch)
FOREACH_DEVICES = frozenset({"cpu", "cuda"})  # where parameters share a list (same NOTE); elsewhere an op each


def _adam_step_foreach(params: list[torch.Tensor], grads: list[torch.Tensor], state: str, index: list[int],
                       steps: list[torch.Tensor], lr: torch.Tensor, beta1: float, beta2: float, weight_decay: float,
                       eps: float, maximize: bool, decoupled: bool) -> None:
    """:func:`_adam_step` for a list of parameters of one device and dtype (at positions `index`
    of the moments named `state`), in one call of torch's fused Adam kernel.

    [NOTE] Small parameters share a launch, and so do the large ones. A launch costs a few
    microseconds whatever its size, and most of a model's parameters (biases, norm weights) are
    small; torch's multi-tensor kernel covers a list in a few launches, and a large weight in a
    list gets enough blocks. The list is traced as one op per parameter group (nothing at trace
    time says which tower a parameter is in); ``passes/update_lists.py`` splits it by tower and
    cuts each tower's into parts that run as their gradients complete. Every parameter in a list,
    on every device, is the fastest layout measured (:data:`FOREACH_NUMEL`,
    :data:`FOREACH_DEVICES`; docs/design/whole-step.md#small-parameters-share-a-launch)."""
    exp_avgs, exp_avg_sqs, max_exp_avg_sqs = _moments(state).of(index)
    grads = [g if g.dtype == p.dtype and g.stride() == p.stride() else torch.empty_like(p).copy_(g)  # flat, alike
             for p, g in zip(params, grads)]
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
           weight_decay=weight_decay, eps=eps, amsgrad=bool(max_exp_avg_sqs), maximize=maximize)
    for t in (*params, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs):  # one at a time: older torch takes no list
        torch.autograd.graph.increment_version(t)


adam_step_foreach = _register("adam_step_foreach", _adam_step_foreach)


def _has_triton() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


_BLOCK = 1024


def _adam_triton(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, weight_decay, eps,
                 maximize, decoupled) -> None:
    """The update as one Triton kernel over the parameter's elements (NOTE: One parameter, one grid):
    the arithmetic of torch's fused kernel (``FusedAdamMathFunctor``), in float32, with the
    bias corrections from the step counter it reads on the device.

    [NOTE] One parameter, one grid. torch's fused kernel gives each chunk of 65536 elements of a list
    one thread block, so a large weight called alone gets a few dozen blocks on a GPU of 132 SMs.
    :func:`adam_step`'s Triton kernel runs the same arithmetic with a block per 1024 elements, and
    casts a bf16 gradient to float32 as it loads (``passes/gradients.py``). Triton compiles it once
    per dtype and option set (docs/design/whole-step.md#one-parameter-one-grid)."""
    import triton

    n = param.numel()
    _triton_kernel()[(triton.cdiv(n, _BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, exp_avg_sq if max_exp_avg_sq is None else max_exp_avg_sq, step, lr, n,
        beta1, beta2, math.log(beta1) if beta1 > 0 else -math.inf, math.log(beta2) if beta2 > 0 else -math.inf,
        weight_decay, eps, MAXIMIZE=maximize, DECOUPLED=decoupled, AMSGRAD=max_exp_avg_sq is not None,
        BLOCK=_BLOCK)


@functools.cache
def _triton_kernel():
    """Built on first use: importing Triton is slow, and it is absent on the CPU."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])
    def adam_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_ptr, step_ptr, lr_ptr, n, beta1, beta2,
                    log_beta1, log_beta2, weight_decay, eps, MAXIMIZE: tl.constexpr, DECOUPLED: tl.constexpr,
                    AMSGRAD: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        step = tl.load(step_ptr).to(tl.float32)
        lr = tl.load(lr_ptr).to(tl.float32)
        p = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
        g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
        m = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
        v = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
        if MAXIMIZE:
            g = -g
        if DECOUPLED:
            p = p - lr * weight_decay * p
        else:
            g = g + p * weight_decay
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        bias_correction1 = 1 - tl.exp(step * log_beta1)
        bias_correction2_sqrt = tl.sqrt(1 - tl.exp(step * log_beta2))
        if AMSGRAD:
            v_max = tl.maximum(tl.load(max_ptr + offsets, mask=mask).to(tl.float32), v)
            tl.store(max_ptr + offsets, v_max.to(max_ptr.dtype.element_ty), mask=mask)
            denom = tl.sqrt(v_max) / bias_correction2_sqrt + eps
        else:
            denom = tl.sqrt(v) / bias_correction2_sqrt + eps
        p = p - (lr / bias_correction1) * m / denom
        tl.store(param_ptr + offsets, p.to(param_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_ptr + offsets, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)

    return adam_kernel


def _update_of(node) -> bool:
    return (node.op == "call_function" and node.target is torch.ops.higher_order.auto_functionalized_v2
            and bool(node.args) and node.args[0] in (adam_step, adam_step_foreach))


def written_state(gm: torch.fx.GraphModule) -> "Callable[[], list[torch.Tensor]] | None":
    """What `gm`'s update ops write besides its inputs, the moments they find by name, as a function
    that looks them up when called (at a capture: the tensors a CUDA graph would replay); None
    where `gm` has no update op. A runner that replays the graph to time it puts these back too
    (docs/design/cuda-graphs.md#a-graph-that-writes-its-inputs)."""
    where = [(n.kwargs["state"], [n.kwargs["index"]] if n.args[0] is adam_step else list(n.kwargs["index"]))
             for n in gm.graph.nodes if _update_of(n)]
    if not where:
        return None

    def tensors() -> list[torch.Tensor]:
        return [t for state, index in where for ts in _moments(state).of(index) for t in ts]

    return tensors


def state_bytes(node) -> int:
    """Bytes of the moments an update node (an ``apollo::adam_step``/``adam_step_foreach`` under
    ``auto_functionalized_v2``) reads and writes beside its inputs and outputs, which the cost
    pass cannot see (NOTE: The moments are not graph inputs): two moments per parameter (three
    with amsgrad) of its parameter's size, each read and written; 0 for any other node."""
    if not _update_of(node):
        return 0
    moments = _MOMENTS.get(node.kwargs.get("state"))
    per_param = 2 if moments is None or moments.max_exp_avg_sqs is None else 3
    params = [b.meta.get("val") for b in node.kwargs.get("_all_bases", ())]  # the op writes its parameters alone
    return 2 * per_param * sum(p.numel() * p.element_size() for p in params if isinstance(p, torch.Tensor))


def fused_kernel_devices() -> list[str]:
    """The device types torch has the fused Adam kernel for."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


_registered = False


def register_inductor_lowering() -> None:
    """Lower :func:`adam_step` and :func:`adam_step_foreach` as Inductor's fallback kernels, with
    the inputs they write marked mutated first (NOTE: Inductor must see the old value's readers
    first). Once per process.

    [NOTE] Inductor must see the old value's readers first. The op writes its parameter in place
    (functionalized, then reinplaced by Inductor). Inductor realizes pending pointwise readers of a
    buffer (a layer norm's ``grad_out * weight``) only once the buffer is marked mutated, and its
    fallback kernel marks it after registering itself, so those readers would run after the write
    and read the updated weight (torch 2.13). This lowering marks the written inputs mutated
    before the kernel is created (docs/design/whole-step.md#inductor-must-see-the-old-values-readers-first)."""
    global _registered
    if _registered:
        return
    from torch._inductor.lowering import fallback_handler, register_lowering
    from torch._inductor.virtualized import V

    def lower_marking_writes_first(op) -> None:
        written = [(a.name, i) for i, a in enumerate(op._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        fallback = fallback_handler(op, add_to_fallback_set=False)

        @register_lowering(op, type_promotion_kind=None)
        def lower(*args, **kwargs):
            for name, i in written:
                x = args[i] if i < len(args) else kwargs.get(name)
                for buffer in (x if isinstance(x, (list, tuple)) else [x]):
                    if buffer is not None:
                        buffer.realize()
                        V.graph.mark_buffer_mutated(buffer.get_name())
            return fallback(*args, **kwargs)

    lower_marking_writes_first(torch.ops.apollo.adam_step.default)
    lower_marking_writes_first(torch.ops.apollo.adam_step_foreach.default)
    _registered = True
