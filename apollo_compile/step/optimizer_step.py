"""The optimizer inside the compiled step: ``compile_step(fn, optimizer=opt)``.

``optimizer.step()`` cannot be traced into the step's graph on torch 2.13 (``whole_step.py`` says
why), but the update it runs can: Adam's update as opaque ops (``fused_update.py``) over the
optimizer's own parameters, gradients and state tensors. Traced after ``loss.backward()``, it
becomes part of the one graph, and each parameter's update is labelled with its tower
(``passes/modality.py``), so a tower whose backward finishes early updates its weights while the
other tower's backward still runs.

:class:`InGraphAdam` prepares, outside the graph before every call, what a CUDA-graph replay needs
at fixed addresses: the state as ``Adam`` creates it, each group's moments registered by name
(``fused_update.AdamMoments``), the step counters of a group in one tensor per device, every state
tensor marked static, and each group's learning rate as a device tensor (refreshed when a
scheduler changes it; the other hyperparameters are Python numbers, and Dynamo recompiles if one
changes). Inside the traced step the counters advance on the device (no ``.item()``) and a group's
parameters share an ``apollo::adam_step_foreach`` (a parameter ``fused_update.FOREACH_NUMEL`` or
``FOREACH_DEVICES`` leave out gets an ``apollo::adam_step``). With ``optimizer_update="inductor"``
the update is Adam's formula as elementwise ops instead (:func:`adam_update`), which Inductor
fuses with the ops around it, at the price of a compile about 3x as long.

The optimizer object stays the user's: its state is the one updated, ``state_dict()`` and
schedulers work, and an eager ``optimizer.step()`` after a fallback continues from it. The
reasoning and measurements behind the layout: docs/design/whole-step.md#the-optimizer-inside-the-step.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any, Sequence

import torch

from ..ops import fused_update
from ..ops.fused_update import AdamMoments, adam_step, adam_step_foreach, fused_kernel_devices, register_inductor_lowering

__all__ = ["InGraphAdam", "unsupported_reason"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_NAMES = itertools.count()  # each InGraphAdam's moments get names of their own (fused_update.AdamMoments)


def unsupported_reason(optimizer: Any) -> str | None:
    """Why `optimizer`'s update cannot run inside the step's graph, or None if it can."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"optimizer= takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):  # a subclass may step otherwise
        return (f"{type(optimizer).__name__}'s update is not supported inside the graph (Adam and AdamW are); "
                "it runs as optimizer.step() after the compiled step")
    devices = fused_kernel_devices()
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            return f"param_groups[{i}] has differentiable=True"
        for key in ("betas", "weight_decay", "eps"):
            values = group[key] if key == "betas" else (group[key],)
            if any(isinstance(v, torch.Tensor) for v in values):
                return f"param_groups[{i}]['{key}'] is a tensor (only lr may be one)"
        if any(p.is_sparse or torch.is_complex(p) for p in group["params"]):
            return f"param_groups[{i}] holds a sparse or complex parameter"
        for p in group["params"]:
            if p.device.type not in devices:
                return (f"param_groups[{i}] holds a parameter on {p.device.type}, where torch has no fused Adam "
                        f"kernel (it has one on {', '.join(devices)})")
    return None


class InGraphAdam:
    """Adam / AdamW's update over `optimizer`'s state, for the inside of a traced step.

    What the traced update reads is laid out by :meth:`prepare` in plain lists (``_groups``), not
    read from the optimizer inside the graph: Dynamo guards on every value it reads there, and a
    scheduler's new ``param_groups[i]['lr']`` recompiled the step at each change."""

    def __init__(self, optimizer: torch.optim.Optimizer, update: str = "kernel") -> None:
        reason = unsupported_reason(optimizer)
        if reason is not None:
            raise TypeError(f"apollo.compile_step: {reason}")
        self.kernel = update == "kernel"  # else Adam's formula, for Inductor to fuse (options.py: optimizer_update)
        if self.kernel:
            register_inductor_lowering()
        self.optimizer = optimizer
        self.decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
            g.get("decoupled_weight_decay", False) for g in optimizer.param_groups)
        self._groups: list[dict] = []  # per parameter group, what `apply` reads
        self._layout: tuple | None = None  # what `_groups` was laid out for
        self._lr_value: list[Any] = []  # per group: the lr its tensors hold
        self._static: dict[int, weakref.ref] = {}  # the tensors marked static (the state and lr), by id
        self._name = f"adam{next(_NAMES)}"  # the update ops find each group's moments by it (fused_update.py)
        if hasattr(optimizer, "register_load_state_dict_post_hook"):
            optimizer.register_load_state_dict_post_hook(lambda opt: self._keep_addresses())

    def _keep_addresses(self) -> None:
        """After ``optimizer.load_state_dict`` (resuming from a checkpoint): the loaded values are
        copied into the state tensors the graph reads in place, which go back into
        ``optimizer.state``; a CUDA graph captured on them stays valid. Where a loaded tensor does
        not fit (another shape or dtype), the state is laid out again from what was loaded (with new
        step-counter tensors: a captured graph then finds that input moved, and runs un-graphed, with
        its warning; fused_update.py, NOTE: The moments are not graph inputs)."""
        state = self.optimizer.state
        for g in self._groups:
            moments = g["moments"]
            for j, p in enumerate(g["params"]):
                held = {"exp_avg": moments.exp_avgs[j], "exp_avg_sq": moments.exp_avg_sqs[j], "step": g["steps"][j]}
                if g["amsgrad"]:
                    held["max_exp_avg_sq"] = moments.max_exp_avg_sqs[j]
                loaded = state.get(p, {})
                if set(loaded) != set(held) or any(
                        not isinstance(loaded[k], torch.Tensor) and k != "step" for k in held):
                    self._layout = None
                    return
                for key, t in held.items():
                    value = torch.as_tensor(loaded[key])
                    if value.shape != t.shape:
                        self._layout = None
                        return
                    with torch.no_grad():
                        t.copy_(value)
                    loaded[key] = t

    @property
    def groups(self) -> list[dict]:
        """What the traced update reads, one dict per parameter group, as :meth:`prepare` last laid
        it out ("params", "moments", "state", "steps", "counters", "lr" and the hyperparameters):
        for inspection; the update owns these tensors."""
        return self._groups

    def _static_address(self, t: torch.Tensor) -> None:
        if not self.owns(t):
            torch._dynamo.mark_static_address(t)
            self._static[id(t)] = weakref.ref(t)

    def owns(self, t: Any) -> bool:
        """Whether `t` is a state or learning-rate tensor this update laid out (and keeps in step
        with its parameter: :meth:`_state`)."""
        ref = self._static.get(id(t))
        return ref is not None and ref() is t

    def guard_filter(self, entries: Sequence[Any]) -> list[bool]:
        """Dynamo's ``guard_filter_fn``: keep every guard but the tensor guards on the tensors this
        update owns.

        [NOTE] The state's tensor guards are implied. Dynamo checks every tensor the traced step
        reads before each call, four per parameter with AdamW inside, and the state's guards are
        about half of the guard manager's host time per call. The state's metadata is its parameter's by
        construction: :meth:`_state` makes each moment with its parameter's shape, strides, dtype
        and device (and a step a 0-d float32 on it), and :meth:`prepare` lays the state out again,
        before the call, whenever a parameter group changes. So the parameters' guards (kept, with
        the lists' lengths) already decide whether the graph fits; the state's own say nothing
        more (docs/design/whole-step.md#the-states-tensor-guards-are-implied)."""
        return [not (entry.guard_type == "TENSOR_MATCH" and entry.has_value and self.owns(entry.value))
                for entry in entries]

    def _state(self, p: torch.Tensor, amsgrad: bool) -> dict:
        """``optimizer.state[p]`` as Adam keeps it, with the step counter on `p`'s device."""
        state = self.optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step = state["step"]
        if not isinstance(step, torch.Tensor) or step.device != p.device or step.dtype != torch.float32 or step.dim():
            state["step"] = torch.as_tensor(step, dtype=torch.float32).reshape(()).to(p.device)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):  # the parameter's metadata (NOTE: The state's tensor guards)
            t = state.get(key)
            if t is None:
                continue
            if (t.shape, t.stride(), t.dtype, t.device) != (p.shape, p.stride(), p.dtype, p.device):
                state[key] = torch.empty_like(p, memory_format=torch.preserve_format).copy_(t)
            self._static_address(state[key])
        return state

    def _counters(self, params: list[torch.Tensor], states: list[dict]) -> dict:
        """One group's step counters as one float32 tensor per device (NOTE: The step counters are one
        tensor): ``state["step"]`` of each parameter becomes a 0-d view into it, holding the same value.
        Returns device -> (the counters, the group's parameter indices, in the counters' order)."""
        counters: dict[torch.device, tuple[torch.Tensor, Sequence[int]]] = {}
        members: dict[torch.device, list[int]] = {}
        for j, p in enumerate(params):
            members.setdefault(p.device, []).append(j)
        for device, js in members.items():
            flat = torch.stack([states[j]["step"].detach() for j in js]).to(device=device, dtype=torch.float32)
            for k, j in enumerate(js):
                states[j]["step"] = flat[k]
            self._static_address(flat)
            counters[device] = (flat, as_range(js))
        return counters

    def _lay_out(self) -> None:
        self._groups, self._lr_value = [], []
        for group in self.optimizer.param_groups:
            amsgrad = group["amsgrad"]
            params = [p for p in group["params"] if p.requires_grad]
            states = [self._state(p, amsgrad) for p in params]
            counters = self._counters(params, states)
            lr = {}
            for device in dict.fromkeys(p.device for p in params):
                lr[device] = torch.zeros((), dtype=torch.float32, device=device)
                self._static_address(lr[device])
            beta1, beta2 = group["betas"]
            moments = AdamMoments(f"{self._name}/{len(self._groups)}", [s["exp_avg"] for s in states],
                                  [s["exp_avg_sq"] for s in states],
                                  [s["max_exp_avg_sq"] for s in states] if amsgrad else None)
            self._groups.append({
                "params": params, "moments": moments, "state": moments.name, "steps": [s["step"] for s in states],
                "counters": counters,
                "lr": lr, "amsgrad": amsgrad, "beta1": beta1, "beta2": beta2,
                "weight_decay": group["weight_decay"], "eps": group["eps"], "maximize": group["maximize"]})
            self._lr_value.append(None)

    def prepare(self) -> None:
        """Before each call, outside the graph: the state exists where the graph reads it, and the
        learning-rate tensors hold ``param_groups``' current lr."""
        groups = self.optimizer.param_groups
        # built by C loops (map), faster than a genexpr: it runs before every call
        layout = tuple((tuple(map(id, g["params"])), tuple(map(_REQUIRES_GRAD, g["params"])), g["betas"],
                        g["weight_decay"], g["eps"], g["maximize"], g["amsgrad"]) for g in groups)
        if layout != self._layout:
            self._lay_out()
            self._layout = layout
        for i, group in enumerate(groups):
            lr = group["lr"]
            if not _same(lr, self._lr_value[i]):
                with torch.no_grad():
                    for t in self._groups[i]["lr"].values():
                        t.copy_(lr.detach() if isinstance(lr, torch.Tensor) else torch.tensor(lr))
                self._lr_value[i] = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr

    def _hyper(self, g: dict) -> tuple:
        """The Python-number arguments of the update ops after the learning rate."""
        return g["beta1"], g["beta2"], g["weight_decay"], g["eps"], g["maximize"], self.decoupled

    def apply(self) -> None:
        """The update, traced into the step after ``loss.backward()``: the parameters with a
        gradient, as ``optimizer.step()`` would update them (one ``adam_step_foreach`` per device
        and dtype, with a ``fused_update.adam_step`` each for those ``FOREACH_NUMEL`` and
        ``FOREACH_DEVICES`` leave out, or :func:`adam_update`'s formula with ``optimizer_update="inductor"``), then
        ``.grad = None`` for every parameter, as ``optimizer.zero_grad(set_to_none=True)``.

        [NOTE] The step consumes its gradients. Left in ``.grad``, every gradient is an output of
        the graph: held in the graph's memory between steps and handed out at every replay (a
        tensor lent and reclaimed and a ``.grad`` assignment per parameter, on the host, before the
        next step can start). Consumed inside, a gradient is a temporary of the graph, dead once
        its parameter is updated (docs/design/whole-step.md#the-step-consumes-its-gradients).

        [NOTE] The step counters are one tensor: each parameter group keeps its counters in one
        float32 tensor per device, and ``state["step"]`` of each parameter is a 0-d view into it
        (what ``state_dict()``, a loaded checkpoint and an eager ``optimizer.step()`` after a
        fallback read and write). The traced step advances them with one ``add_`` and reads each
        parameter's counter as an element of that one input. A counter per parameter would be a
        graph input per parameter, and every input costs host time before each replay, in Dynamo's
        frame, AOTAutograd and the runner (docs/design/whole-step.md#the-step-counters-are-one-tensor;
        fused_update.py, NOTE: The moments are not graph inputs)."""
        with torch.no_grad():
            for g in self._groups:
                stepped = {j for j, p in enumerate(g["params"]) if p.grad is not None}
                advance(g["counters"], stepped)
                if not self.kernel:
                    scalars = update_scalars(g, stepped, self.decoupled)
                small: dict[tuple, list[tuple[int, torch.Tensor]]] = {}  # (device, dtype) -> [(j, counter)]
                for flat, js in g["counters"].values():
                    for k, j in enumerate(js):
                        if j not in stepped:
                            continue
                        p = g["params"][j]
                        if not self.kernel:
                            m = g["moments"]
                            adam_update(p, p.grad, m.exp_avgs[j], m.exp_avg_sqs[j],
                                        m.max_exp_avg_sqs[j] if g["amsgrad"] else None, *scalars[j], g)
                        elif p.numel() <= fused_update.FOREACH_NUMEL and p.device.type in fused_update.FOREACH_DEVICES:
                            # fused_update.py, NOTE: Small parameters share a launch
                            small.setdefault((p.device, p.dtype), []).append((j, flat[k]))
                        else:  # its moments by name (fused_update.py, NOTE: The moments are not graph inputs)
                            adam_step(p, p.grad, g["state"], j, flat[k], g["lr"][p.device], *self._hyper(g))
                for (device, _), members in small.items():
                    js = [j for j, _ in members]
                    adam_step_foreach([g["params"][j] for j in js], [g["params"][j].grad for j in js], g["state"], js,
                                      [step for _, step in members], g["lr"][device], *self._hyper(g))
        for g in self._groups:
            for p in g["params"]:
                p.grad = None


def as_range(js: list[int]) -> Sequence[int]:
    """`js` as a ``range`` where it is one (a group's parameters on one device: the usual case).

    [NOTE] A group's indices are one guard. The traced step reads each counter's parameter indices
    (which counters advance, which parameters the update ops take); Dynamo guards every int it
    reads out of a list, and a range as one value: a model's parameter indices would otherwise be a
    guard and an accessor each, checked before every call (a tenth of HF CLIP's guard tree)."""
    if js and js == list(range(js[0], js[-1] + 1)):
        return range(js[0], js[-1] + 1)
    return js


def advance(counters: dict, stepped: set[int]) -> None:
    """Add one to the counters of the `stepped` parameters (group indices), in place: one ``add_``
    per counter tensor when all of its parameters stepped (the usual case), else an ``index_add_``
    of the ones that did (a parameter without a gradient keeps its count, as in eager Adam)."""
    for flat, js in counters.values():
        hit = [k for k, j in enumerate(js) if j in stepped]
        if len(hit) == len(js):
            flat.add_(1)
        elif hit:
            flat.index_add_(0, torch.tensor(hit, device=flat.device), torch.ones(len(hit), device=flat.device))


def update_scalars(group: dict, stepped: set[int], decoupled: bool) -> dict[int, tuple]:
    """The per-parameter scalars of Adam's update, 0-d tensors on the parameter's device, for each
    `stepped` parameter (group index -> ``(decay, step_size, bias_correction2_sqrt)``): ``decay =
    1 - lr * weight_decay`` (None unless decoupled weight decay applies), ``step_size = lr / (1 -
    beta1 ** step)`` and ``sqrt(1 - beta2 ** step)``, from its counter already advanced.

    [NOTE] The update's scalars are foreach outputs. Inductor compiles the formula slowly, and two
    things every update kernel read would add to it: its step as ``flat[k]``, a load at a constant
    offset, so that no two parameters' kernels are the same source; and the one learning-rate
    tensor, which puts every update in one group of Inductor's pairwise fusion search
    (``Scheduler.get_possible_fusions``). Computed by foreach ops, each parameter's scalars are
    buffers of its own: an update kernel shares no input with another parameter's, and parameters
    of one shape share one kernel (docs/design/whole-step.md#the-updates-scalars-are-foreach-outputs)."""
    out: dict[int, tuple] = {}
    for device, (flat, js) in group["counters"].items():
        ks = [k for k, j in enumerate(js) if j in stepped]
        if not ks:
            continue
        steps, lrs = [flat[k] for k in ks], [group["lr"][device]] * len(ks)
        decay = [None] * len(ks)
        if decoupled and group["weight_decay"] != 0:
            decay = _one_minus_(torch._foreach_mul(lrs, group["weight_decay"]))
        step_size = torch._foreach_div(lrs, _one_minus_(torch._foreach_pow(group["beta1"], steps)))
        second = _one_minus_(torch._foreach_pow(group["beta2"], steps))
        torch._foreach_sqrt_(second)
        for k, d, size, c2 in zip(ks, decay, step_size, second):
            out[js[k]] = (d, size, c2)
    return out


def _one_minus_(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``1 - x`` for each of `xs`, in place (foreach has no scalar-minus-list op); returns `xs`."""
    torch._foreach_neg_(xs)
    torch._foreach_add_(xs, 1)
    return xs


def adam_update(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                max_exp_avg_sq: torch.Tensor | None, decay: torch.Tensor | None, step_size: torch.Tensor,
                bias_correction2_sqrt: torch.Tensor, hyper: dict) -> None:
    """One parameter's Adam / AdamW update, in place: the formula of ``torch.optim.adam``'s
    single-tensor path without ``capturable``, with its scalars as device tensors
    (:func:`update_scalars`: from the learning rate and the step counter already advanced to this
    step, NOTE: The step counters are one tensor). `decay` is given for decoupled weight decay.

    [NOTE] Why not torch's functional ``adam(..., capturable=True)``: it divides by the step size
    (``denom / (-lr / bias_correction1)``), so at lr = 0, the first step of a warm-up schedule, a
    gradient element that is exactly zero (an embedding row no token used) gives 0 / 0 and the
    parameter becomes NaN (docs/design/whole-step.md#why-not-torchs-capturable-adam). Without
    capturable it reads the step counter with ``.item()``, which a CUDA graph cannot replay. The
    formula is short enough to state once here."""
    beta1, beta2, eps, weight_decay = hyper["beta1"], hyper["beta2"], hyper["eps"], hyper["weight_decay"]
    if hyper["maximize"]:
        grad = -grad
    if decay is not None:
        p.mul_(decay)
    elif weight_decay != 0:
        grad = grad.add(p, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        second = max_exp_avg_sq
    else:
        second = exp_avg_sq
    denom = (second.sqrt() / bias_correction2_sqrt).add_(eps)
    p.sub_(exp_avg / denom * step_size)


def _same(lr: Any, held: Any) -> bool:
    if isinstance(lr, torch.Tensor) or isinstance(held, torch.Tensor):
        return isinstance(lr, torch.Tensor) and isinstance(held, torch.Tensor) and bool(torch.equal(lr.cpu(), held.cpu()))
    return lr == held
