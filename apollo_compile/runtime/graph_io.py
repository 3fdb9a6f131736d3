"""What a captured CUDA graph reads and hands out: which inputs it can take (layouts, host
values, shapes), the copies of its outputs, and the gradients it lends in its own memory.

Helpers of the runner's capture and replay (``capture.py``, ``replay.py``); which outputs are
copied and which are lent: docs/design/cuda-graphs.md#outputs-and-the-next-replay.
"""

from __future__ import annotations

import itertools
import os
import weakref
from typing import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["Addresses", "LentOutputs", "OutputCopier", "WrittenInputs", "host_values", "input_shapes",
           "is_non_overlapping"]

_use_count = torch._C._storage_Use_Count  # what CUDA-graph trees read to tell a storage's liveness
# all(tensors[i].data_ptr() == ptrs[i] for i in indices), in C++ (CUDA builds only; None: a Python check)
data_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class Addresses:
    """Where some inputs of a call must be (position -> data_ptr), and the check that they are.

    Hundreds of parameters and saved activations per call, before the launch: at small batches
    everything the host does before the forward's launch is step time. CUDA builds have the check
    CUDA-graph trees use on their hot path, in C++ (`data_ptrs_equal`; tests set it to None to
    check the other path); elsewhere one list comparison rather than a Python test each."""

    def __init__(self, ptrs: dict[int, int]) -> None:
        self.ptrs = ptrs
        self.positions = sorted(ptrs)
        self._aligned: list[int | None] = [None] * (self.positions[-1] + 1 if self.positions else 0)
        for i in self.positions:
            self._aligned[i] = ptrs[i]
        self._values = [ptrs[i] for i in self.positions]

    def hold(self, args: Sequence) -> bool:
        """Whether every position of `args` holds a tensor at its address."""
        try:
            if data_ptrs_equal is not None:
                return data_ptrs_equal(args, self._aligned, self.positions)
            return [args[i].data_ptr() for i in self.positions] == self._values
        except (AttributeError, TypeError, RuntimeError, IndexError):  # no longer a tensor
            return False


def is_non_overlapping(x: torch.Tensor) -> bool:
    """No two elements share memory (gaps allowed), so copy_ into an empty_strided twin works."""
    reach = 0  # elements spanned by the dims seen so far, smallest stride first
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.size()) if sz != 1):
        if stride <= reach:
            return False
        reach = stride * (size - 1) + reach
    return True


class OutputCopier:
    """Copies of a fixed list of tensors (a graph's static outputs) in new memory, same sizes and
    strides, planned once.

    Used for what a graph hands out that the next replay would overwrite and that is not lent
    (docs/design/cuda-graphs.md#outputs-and-the-next-replay): a forward's user-visible outputs, all
    outputs of an inference graph. There may be many, and at small batches a step is bound by the
    host (benchmarks/profile_step.py), so the contiguous ones of
    each dtype are copied by one ``cat`` into one allocation and handed out as views made in C++
    (``_flatten/_unflatten_dense_tensors``): no Python work per tensor. The views keep the shared
    allocation alive until the last of them dies. Other layouts are cloned one by one (``clone``
    keeps a dense layout's strides)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        groups: dict[tuple, list[int]] = {}
        self.singles: list[int] = []
        for k, t in enumerate(tensors):
            if t.is_contiguous():
                groups.setdefault((t.dtype, t.device), []).append(k)
            else:
                self.singles.append(k)
        for ks in list(groups.values()):
            if len(ks) == 1:  # flattening one tensor returns a view of it, not a copy
                self.singles += ks
        self.groups = [ks for ks in groups.values() if len(ks) > 1]

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = list(tensors)
        for k in self.singles:
            out[k] = tensors[k].clone()
        for ks in self.groups:
            src = [tensors[k] for k in ks]
            for k, view in zip(ks, _unflatten_dense_tensors(_flatten_dense_tensors(src), src)):
                out[k] = view
        return out


def host_values(args: Sequence) -> list[int]:
    """Positions of the inputs a CUDA graph would read only once, at capture: CPU tensors holding
    data beside device ones. A kernel takes a CPU scalar's value as a launch argument, so a replay
    keeps the captured value whatever the static buffer holds: a Python float that Dynamo has seen
    change becomes such a 0-dim tensor (a replayed ``loss * t`` keeps the captured ``t``:
    benchmarks/probes/scalar_input_probe.py). Empty CPU tensors (compiled
    autograd's size carriers) hold no value. All-CPU inputs are the tests' fake graphs."""
    host = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.numel()]
    on_device = any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in args)
    return host if on_device else []


def input_shapes(args: Sequence) -> tuple:
    """What a graph with symbolic sizes was called at: each tensor's shape, each other input
    itself (a SymInt input arrives as an int)."""
    return tuple(x.shape if isinstance(x, torch.Tensor) else x for x in args)


class LentOutputs:
    """Static outputs handed out in the pool's own memory, and the check that lets a replay
    overwrite them (docs/design/cuda-graphs.md#outputs-and-the-next-replay).

    Built once at capture, when only the runner's static outputs hold the storages: their use
    counts then are the baseline. Each replay lends fresh aliases, which AccumulateGrad can steal
    (it keeps a detached alias of its own as ``.grad``): a held gradient is therefore found through
    the tensors it is the ``.grad`` of, not through what we handed out."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        storages = {}  # cdata -> storage, held so that the counts we compare never lose a holder of ours
        for t in tensors:
            storage = t.untyped_storage()
            storages.setdefault(storage._cdata, storage)
        self.storages = list(storages.values())
        self.cdatas = list(storages)
        self.baseline = list(map(_use_count, self.cdatas))
        self.moved = 0  # gradients moved to a copy because they were still held at a later replay
        self.aliases: list[weakref.ref] = []  # the last replay's, held by whoever took them as they are

    def lend(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        aliases = list(map(torch.Tensor.detach, tensors))
        self.aliases = list(map(weakref.ref, aliases))  # torch.autograd.grad hands these out unchanged
        return aliases

    def reclaim(self, *owners: list[weakref.ref]) -> bool:
        """Make the storages safe to overwrite: move the ``.grad`` of `owners` (parameters, inputs
        that require grad), and the aliases we lent that are still alive (``torch.autograd.grad``'s
        results), out of them. False if something else still holds one (a view of a gradient)."""
        counts = list(map(_use_count, self.cdatas))
        if counts == self.baseline:
            return True
        held = {c for c, n, base in zip(self.cdatas, counts, self.baseline) if n != base}
        grads = (None if (p := ref()) is None else p.grad for ref in itertools.chain(*owners))
        with torch.no_grad():
            for t in itertools.chain(grads, (ref() for ref in self.aliases)):
                if t is not None and t.untyped_storage()._cdata in held:
                    t.data = t.clone()  # every reference to this tensor follows it to the copy
                    self.moved += 1
        return list(map(_use_count, self.cdatas)) == self.baseline


class WrittenInputs:
    """A copy on the host of the inputs a graph writes in place (an optimizer's update inside the
    step), so that its candidates can be timed: each timing replay applies the update once more,
    and :meth:`restore` puts the values back afterwards (docs/design/cuda-graphs.md#a-graph-that-writes-its-inputs). Host memory, not the device's: a second copy of the parameters and optimizer state on
    the GPU would set the run's peak. :meth:`keep` returns None where the copy would take more than
    `host_fraction` of the host memory available now (the caller then does not time)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.copies = [x.detach().to("cpu", copy=True) for x in tensors]

    @classmethod
    def keep(cls, tensors: list[torch.Tensor], host_fraction: float = 0.25) -> "WrittenInputs | None":
        nbytes = sum(x.numel() * x.element_size() for x in tensors)
        available = available_host_bytes()
        if available is not None and nbytes > host_fraction * available:
            return None
        return cls(tensors)

    def restore(self) -> None:
        with torch.no_grad():
            for x, value in zip(self.tensors, self.copies):
                x.copy_(value)


def available_host_bytes() -> int | None:
    """The host's free memory now (Linux's free pages: the page cache not counted, so it errs
    low), None where the OS does not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
