"""Modality placement: whole towers on separate devices, the loss where their outputs meet.

A model-parallel alternative to data parallelism for towers of very different size::

    model = apollo_compile.place_modalities(model, {"vision": "cuda:1", "text": "cuda:0"})
    model = torch.compile(model, backend="apollo")

Each named submodule moves to its device; everything else (the loss, a projection or a
temperature outside the towers) moves to ``output_device`` (default: the first device named).
Hooks move a tower's tensor inputs to its device and its tensor outputs to ``output_device``, so
the model's own code does not change. Dynamo traces the hooks: the compiled graph holds the
copies between devices, and their gradients flow back the same way.

Why hooks and not a backend option: the backend sees parameters as graph inputs that the user's
optimizer owns. Copies made by the backend would go stale after the first optimizer step; the
parameters themselves have to live on their tower's device.

apollo runs a graph that spans several CUDA devices with one lane and without a CUDA graph (a
capture records one device's streams): each device works through its own queue, so the towers
can run at the same time, and PyTorch orders the copies between the devices' current streams.
The memory plan of such a graph is one arena over both devices' buffers (it describes, it does not
allocate). Measured on two GPUs: benchmarks/RESULTS.md#distributed-2-x-h200.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .options import ApolloOptionsError


@dataclass
class ModalityPlacement:
    """Where each tower lives, kept on the model as ``model.apollo_placement``."""

    devices: dict[str, torch.device]
    output_device: torch.device
    handles: list = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Drop the hooks (the modules stay where they are)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _to(device: torch.device):
    def move(x: Any) -> Any:
        return x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x

    return move


def _parse_device(path: str, value: Any) -> torch.device:
    if not isinstance(value, (str, torch.device, int)) or isinstance(value, bool):
        raise ApolloOptionsError(f"apollo: place_modalities: the device for {path!r} must be a str, int or "
                                 f"torch.device, got {type(value).__name__}")
    try:
        device = torch.device(value) if not isinstance(value, int) else torch.device("cuda", value)
    except RuntimeError as e:
        raise ApolloOptionsError(f"apollo: place_modalities: {value!r} (for {path!r}) is not a device: {e}") from None
    if device.type not in ("cuda", "cpu"):
        raise ApolloOptionsError(f"apollo: place_modalities: device {device} (for {path!r}) is not supported; "
                                 "apollo runs on 'cuda' and 'cpu'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ApolloOptionsError(f"apollo: place_modalities: {device} (for {path!r}) needs CUDA, "
                                     "which this torch cannot use")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ApolloOptionsError(f"apollo: place_modalities: {device} (for {path!r}) does not exist: "
                                     f"{torch.cuda.device_count()} CUDA device(s) visible")
    return device


def _check_paths(model: nn.Module, paths: list[str]) -> None:
    for path in paths:
        try:
            model.get_submodule(path)
        except AttributeError:
            children = ", ".join(repr(n) for n, _ in model.named_children()) or "none"
            raise ApolloOptionsError(f"apollo: place_modalities: the model has no submodule {path!r} "
                                     f"(its top-level submodules: {children})") from None
        if path == "":
            raise ApolloOptionsError("apollo: place_modalities: '' names the whole model; name its towers")
    for a in paths:
        for b in paths:
            if a != b and b.startswith(a + "."):
                raise ApolloOptionsError(f"apollo: place_modalities: {b!r} lies inside {a!r}; name each tower once")


def place_modalities(model: nn.Module, devices: Mapping[str, Any], output_device: Any = None) -> nn.Module:
    """Move each tower (a submodule path -> its device) and the rest of the model (to
    ``output_device``), and hook the towers so that tensors cross devices at their boundaries.

    Returns ``model`` (moved in place, like ``Module.to``). Call it before building the optimizer
    and before ``torch.compile``; calling it again replaces the earlier placement.
    """
    if not isinstance(model, nn.Module):
        raise ApolloOptionsError(f"apollo: place_modalities expects an nn.Module, got {type(model).__name__}")
    if not isinstance(devices, Mapping) or not devices:
        raise ApolloOptionsError("apollo: place_modalities expects a non-empty mapping of submodule path -> "
                                 "device, e.g. {'vision': 'cuda:1', 'text': 'cuda:0'}")
    bad = [k for k in devices if not isinstance(k, str)]
    if bad:
        raise ApolloOptionsError(f"apollo: place_modalities: submodule paths must be str, got {bad[0]!r}")
    placed = {path: _parse_device(path, d) for path, d in devices.items()}
    _check_paths(model, list(placed))
    out = _parse_device("output_device", output_device) if output_device is not None else next(iter(placed.values()))

    previous = getattr(model, "apollo_placement", None)
    if isinstance(previous, ModalityPlacement):
        previous.remove()
    towers = {path: model.get_submodule(path) for path in placed}
    in_towers = {id(t) for tower in towers.values() for t in (*tower.parameters(), *tower.buffers())}
    for p in model.parameters():  # the rest: moved in place so that references to it stay valid
        if id(p) not in in_towers:
            p.data = p.data.to(out)
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and id(b) not in in_towers:
                mod._buffers[name] = b.to(out)
    placement = ModalityPlacement(placed, out)
    for path, tower in towers.items():
        tower.to(placed[path])
        into, back = _to(placed[path]), _to(out)
        placement.handles.append(tower.register_forward_pre_hook(
            lambda _m, args, kwargs, into=into: (tree_map(into, args), tree_map(into, kwargs)), with_kwargs=True))
        placement.handles.append(tower.register_forward_hook(lambda _m, _args, output, back=back: tree_map(back, output)))
    model.apollo_placement = placement
    return model
