"""The optimizer's step where ``compile_step`` runs it eagerly: torch's list kernels, not its per-parameter loop.

``compile_step(fn, optimizer=opt)`` runs ``opt.step()`` after the compiled part where the update is
not inside the graph: a step on the module path, or an optimizer apollo does not trace. The update
is then apollo's to run, as it is inside the graph, so it need not inherit a setting that makes it
slow on an accelerator: a group built with ``foreach=False`` (or ``None`` where torch would pick
the loop) steps one parameter at a time, a dozen kernel launches each. :func:`list_kernels` sets,
for the duration of one ``step()``, what :func:`settings` chooses, and puts the group's own values
back after it, so ``param_groups`` and ``state_dict()`` stay the user's.

Read: the optimizer's type, ``param_groups`` and ``state`` (where each step counter lies). Written:
``param_groups[i]['foreach']`` / ``['fused']``, inside :func:`list_kernels` only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["list_kernel_devices", "list_kernels", "settings"]


def list_kernel_devices() -> set[str]:
    """The device types where torch has foreach kernels (CUDA, not the CPU): where the
    per-parameter loop costs a launch per op and parameter, and where torch's own default for
    ``foreach=None`` is the list kernels already. On the CPU the loop is torch's default and
    nothing here changes."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return set(_get_foreach_kernels_supported_devices())


def _fused_devices() -> set[str]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return set(_get_fused_kernels_supported_devices())


def settings(optimizer: torch.optim.Optimizer, in_graph_update: bool) -> list[dict]:
    """Per parameter group of `optimizer`, what its eager step sets (``{}``: the group's own).

    [NOTE] The eager update uses list kernels. A torch optimizer (its own class, not a subclass,
    which may step otherwise) whose group is neither differentiable nor already fused or foreach,
    with every parameter on a device of :func:`list_kernel_devices`, steps with:
    - ``fused=True`` for Adam / AdamW whose update apollo traces (`in_graph_update`), not built
      ``capturable``, when every step counter lies on its parameter's device: the kernel the graph's update runs
      (``ops/fused_update.py``), so a call on the module path updates as a call in one graph does,
      and the counters ``InGraphAdam`` lays out on the device are read by the kernel, not by an
      ``.item()`` per parameter as the foreach and loop paths read them;
    - ``foreach=True`` otherwise (SGD, another Adam, RMSprop, ...): the loop's formula, op by op,
      over lists, so its values are the loop's."""
    if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"] or "foreach" not in optimizer.defaults:
        return [{} for _ in optimizer.param_groups]
    devices, fused_devices = list_kernel_devices(), _fused_devices()
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    out = []
    for group in optimizer.param_groups:
        params = group["params"]
        kinds = {p.device.type for p in params}
        if (not params or group.get("differentiable") or group.get("fused") or group.get("foreach")
                or not kinds <= devices):
            out.append({})
        elif (adam and in_graph_update and not group.get("capturable") and kinds <= fused_devices
              and _counters_on_device(optimizer, params)):
            out.append({"fused": True, "foreach": False})
        else:
            out.append({"foreach": True})
    return out


def _counters_on_device(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Whether each parameter's Adam step counter, where it has one yet, is a tensor on its device
    (the fused kernel reads it there; a new state gets one there under ``fused=True``)."""
    for p in params:
        step = optimizer.state.get(p, {}).get("step")
        if step is not None and not (isinstance(step, torch.Tensor) and step.device == p.device):
            return False
    return True


@contextlib.contextmanager
def list_kernels(optimizer: torch.optim.Optimizer, in_graph_update: bool) -> Iterator[list[dict]]:
    """Inside, `optimizer`'s groups step with :func:`settings`' choice; on exit each group's own
    values are back (a key the group lacked is removed again). Yields the choice."""
    chosen = settings(optimizer, in_graph_update)
    missing = object()
    saved = []
    for group, changes in zip(optimizer.param_groups, chosen):
        saved.append({k: group.get(k, missing) for k in changes})
        group.update(changes)
    try:
        yield chosen
    finally:
        for group, old in zip(optimizer.param_groups, saved):
            for k, v in old.items():
                if v is missing:
                    group.pop(k, None)
                else:
                    group[k] = v
