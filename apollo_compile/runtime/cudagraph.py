"""Replay a graph's whole runtime — every lane — as one CUDA graph.

The forward and backward of one Dynamo graph share a :class:`GraphFamily`: one memory pool (so
the backward reuses the forward's freed intermediates, as ``make_graphed_callables`` does) and
the forward's saved outputs, which the backward reads in place instead of copying.

Call 1 runs the runtime eagerly (Inductor/Triton compile their kernels lazily, which must not
happen under capture); call 2 captures and replays; later calls replay. Inputs the graph was
told are static (parameters) and the forward's saved outputs are used in place; other inputs are
copied into static buffers.

[NOTE] Outputs and the next replay::

    fw replay 1 ─► saved acts A (pool)      bw 1 reads A        fw replay 2 overwrites A
                   loss L (pool) ─clone─► user keeps L           the user's L is a clone: safe

User-visible outputs (the loss, gradients) are cloned, since a user or AccumulateGrad may keep
them. Saved activations are returned as fresh aliases whose liveness we track: if any alias of
the previous forward is still alive when the forward runs again (two forwards before one
backward, ``retain_graph=True``), that call runs without the CUDA graph, so nothing the pending
backward needs is overwritten. A backward whose saved inputs are not where the captured one read
them runs without the CUDA graph too. Both paths are correct and warn once.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Callable

import torch
from torch._prims_common import is_non_overlapping_and_dense

log = logging.getLogger("apollo_compile")


class GraphFamily:
    """State shared by the CUDA graphs of one Dynamo graph (forward + backward)."""

    def __init__(self) -> None:
        self.pool = None
        self.saved_ptrs: set[int] = set()  # data_ptrs of the forward's captured outputs
        self.pending: list[weakref.ref] = []  # aliases handed out by the last forward replay

    def forward_outputs_alive(self) -> bool:
        return any(ref() is not None for ref in self.pending)


class CudaGraphRunner:
    """A boxed callable: warm up, capture once, then replay the wrapped runtime."""

    def __init__(self, fn: Callable[[list], list], name: str, kind: str, family: GraphFamily,
                 static_input_idxs: set[int], user_visible_outputs: set[int] | None) -> None:
        self.fn, self.name, self.kind, self.family = fn, name, kind, family
        self.static_input_idxs = static_input_idxs
        self.user_visible_outputs = user_visible_outputs  # None: all outputs
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.disabled: str | None = None
        self._warned: set[str] = set()
        self._boxed_call = True
        self.replays = 0

    # -- helpers -------------------------------------------------------------------------
    def _warn_once(self, key: str, why: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"apollo: {self.name} runs without its CUDA graph because {why} "
                          "(correct, but slower)", stacklevel=3)

    def _eager(self, args: list) -> list:
        return self.fn(args)

    def _is_user_visible(self, i: int) -> bool:
        return self.user_visible_outputs is None or i in self.user_visible_outputs

    # -- capture ---------------------------------------------------------------------------
    def _capture(self, args: list) -> None:
        self.static_inputs: list = []
        self.copy_idxs: list[int] = []
        self.fixed_ptrs: dict[int, int] = {}
        for i, x in enumerate(args):
            if not isinstance(x, torch.Tensor):
                self.static_inputs.append(x)
            elif i in self.static_input_idxs or x.data_ptr() in self.family.saved_ptrs:
                self.static_inputs.append(x)
                self.fixed_ptrs[i] = x.data_ptr()
            else:
                if not is_non_overlapping_and_dense(x):
                    raise RuntimeError(f"input {i} is not dense (stride {tuple(x.stride())})")
                buf = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
                buf.copy_(x)
                self.static_inputs.append(buf)
                self.copy_idxs.append(i)
        if self.family.pool is None:
            self.family.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.family.pool):
            outputs = self.fn(list(self.static_inputs))
        self.static_outputs = list(outputs)
        # an output that *is* a fixed input (a parameter saved for backward) is returned as the
        # caller's own tensor, not the capture-time one
        ids = {id(x): i for i, x in enumerate(self.static_inputs) if i in self.fixed_ptrs}
        self.output_is_input = {j: ids[id(o)] for j, o in enumerate(self.static_outputs) if id(o) in ids}
        if self.kind == "forward":
            self.family.saved_ptrs = {o.data_ptr() for o in self.static_outputs if isinstance(o, torch.Tensor)}
        self.graph = graph
        log.info("apollo: captured %s as a CUDA graph (%d inputs copied, %d used in place)", self.name,
                 len(self.copy_idxs), len(self.fixed_ptrs))

    # -- replay ----------------------------------------------------------------------------
    def _inputs_in_place(self, args: list) -> bool:
        return all(isinstance(args[i], torch.Tensor) and args[i].data_ptr() == p for i, p in self.fixed_ptrs.items())

    def _replay(self, args: list) -> list:
        for i in self.copy_idxs:
            self.static_inputs[i].copy_(args[i])
        self.graph.replay()
        self.replays += 1
        outs: list = []
        aliases: list[weakref.ref] = []
        for j, o in enumerate(self.static_outputs):
            if j in self.output_is_input:
                outs.append(args[self.output_is_input[j]])
            elif not isinstance(o, torch.Tensor):
                outs.append(o)
            elif self._is_user_visible(j):
                outs.append(o.clone())
            else:
                alias = o.detach()
                aliases.append(weakref.ref(alias))
                outs.append(alias)
        if self.kind == "forward":
            self.family.pending = aliases
        args.clear()
        return outs

    def __call__(self, args: list) -> list:
        self.calls += 1
        if self.disabled is not None or self.calls == 1:
            return self._eager(args)
        if self.kind == "forward" and self.family.forward_outputs_alive():
            self._warn_once("pending", "the previous forward's saved activations are still alive "
                                       "(two forwards before a backward, or retain_graph=True)")
            return self._eager(args)
        if self.graph is None:
            try:
                self._capture(args)
            except Exception as e:  # capture unsupported here: run the runtime as it is
                self.disabled = f"{type(e).__name__}: {e}"
                self._warn_once("capture", f"CUDA-graph capture failed ({self.disabled})")
                torch.cuda.synchronize()
                return self._eager(args)
        if not self._inputs_in_place(args):
            self._warn_once("moved", "an input captured in place (a parameter or a saved activation) "
                                     "now lives at another address")
            return self._eager(args)
        return self._replay(args)
