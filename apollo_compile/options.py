"""User options: one frozen dataclass, validated before anything is traced.

`torch.compile(m, backend="apollo", options={...})` hands the dict to the backend, which turns it
into an :class:`ApolloOptions` with :meth:`ApolloOptions.from_user` as its very first step;
``compile_step`` validates its options when it is called, and refuses those that do not apply to
a whole step (:data:`OPTION_PATHS`). Every mistake is a :class:`ApolloOptionsError` (a
``ValueError``) that names the key and the valid choices.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch._functorch.config

from .devices import DEVICE_SPECS


def _dynamo_passthrough_base() -> type:
    # Dynamo wraps every exception a backend raises in BackendCompilerFailed, except the ones
    # derived from ShortenTraceback, which it re-raises as they are. Deriving from it lets a bad
    # option reach the user as the ValueError it is, with a short traceback.
    try:
        from torch._dynamo.exc import ShortenTraceback

        return ShortenTraceback
    except ImportError:  # pragma: no cover - older torch: the error arrives wrapped
        return Exception


class ApolloOptionsError(ValueError, _dynamo_passthrough_base()):  # type: ignore[misc]
    """A bad `options=` or `mode=` value; raised before apollo traces anything.

    [NOTE] The error is the last line printed: Dynamo appends its own hints ("Set
    TORCHDYNAMO_VERBOSE=1 ...") to the message of every exception that leaves a compiled frame, by
    rewriting ``args[0]``. The hints are about Dynamo's internals, not about a misspelt option, so
    the error prints the message it was raised with, whatever ``args`` becomes. The backend sets
    ``first_useful_frame`` to its own frame, where Dynamo starts the traceback it shows.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.first_useful_frame = None  # what ShortenTraceback reads; None keeps the whole traceback

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # the message alone: a frame does not pickle
        return type(self), (self.message,)


ApolloOptionsError.__module__ = "apollo_compile"  # tracebacks name it as users import it


SUBGRAPH_COMPILERS = ("inductor", "eager")
OPTIMIZER_UPDATES = ("kernel", "inductor")
CUDAGRAPH_CHOICES = ("auto", True, False)
SUPPORTED_MODES = (None, "default", "reduce-overhead")
PRECISIONS = ("bf16", "fp16", "fp32")


def _valid_fraction(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1


# An integer memory_budget is a byte count (1 is the fraction 1). Activations of a model worth
# budgeting take megabytes, so a smaller count is a fraction typed without its point.
MIN_BUDGET_BYTES = 2**20


def _valid_budget(budget: Any) -> bool:
    if isinstance(budget, Mapping):
        return bool(budget) and all(isinstance(k, str) and _valid_fraction(v) for k, v in budget.items())
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= MIN_BUDGET_BYTES:
        return True  # bytes
    return isinstance(budget, float) and _valid_fraction(budget) or budget == 1


def _tiny_byte_count(budget: Any) -> bool:
    return isinstance(budget, int) and not isinstance(budget, bool) and 1 < budget < MIN_BUDGET_BYTES


def partitioner_offloads() -> bool:
    """Whether this PyTorch's partitioner can keep saved values in host memory (2.9 and later)."""
    return hasattr(torch._functorch.config, "enable_activation_offloading")


# Where each option takes effect, in one place. "module": torch.compile(model, backend="apollo"),
# whose forward and backward graphs pass the joint stage (pipeline.py); "step": compile_step's
# whole step, one inference graph that no joint stage sees (a memory budget is planned on it:
# passes/step_recompute.py); "step+optimizer": compile_step(...,
# optimizer=), the optimizer's update inside that graph. An option given where it does not apply
# is refused with the reason below (check_path), not ignored.
MODULE, STEP, STEP_OPTIMIZER = "module", "step", "step+optimizer"
_EVERYWHERE = (MODULE, STEP, STEP_OPTIMIZER)
OPTION_PATHS: dict[str, tuple[str, ...]] = {
    "dump_dir": _EVERYWHERE,
    "modalities": _EVERYWHERE,
    "device": _EVERYWHERE,
    "subgraph_compiler": _EVERYWHERE,
    "max_lanes": _EVERYWHERE,
    "cudagraphs": _EVERYWHERE,
    "strict": _EVERYWHERE,
    "precision": _EVERYWHERE,
    "memory_budget": _EVERYWHERE,
    "offload_activations": (MODULE,),
    "optimizer_update": (STEP_OPTIMIZER,),
}
# what compile_step reads itself and hands the backend no more
COMPILE_STEP_ONLY = tuple(key for key, paths in OPTION_PATHS.items() if MODULE not in paths)
_MODULE_PATH = "compile the model instead: torch.compile(model, backend='apollo', options={{{!r}: ...}})"
_NOT_HERE = {
    "offload_activations": "a whole step's graph does not offload activations yet (the offload pass runs on the "
                           "joint graph of the module path); to offload, " + _MODULE_PATH.format("offload_activations"),
    "optimizer_update": "it chooses how the optimizer's update inside the graph is computed, and only "
                        "compile_step(..., optimizer=...) puts the update there",
}
_PATH_NAMES = {MODULE: "torch.compile(..., backend='apollo')", STEP: "compile_step",
               STEP_OPTIMIZER: "compile_step(..., optimizer=...)"}


def check_path(options: Mapping[str, Any] | None, path: str) -> None:
    """Raise ApolloOptionsError for an option the user set that does not take effect on `path`."""
    for key in options or {}:
        if key in OPTION_PATHS and path not in OPTION_PATHS[key]:
            raise ApolloOptionsError(f"apollo: option {key!r} does not apply to {_PATH_NAMES[path]}: {_NOT_HERE[key]}")


@dataclass(frozen=True)
class ApolloOptions:
    """Everything apollo can be told, with its default.

    Attributes:
        dump_dir: write annotated graphs, runtime source and plans here (env ``APOLLO_DUMP_DIR``).
        modalities: module-path prefix -> modality name, e.g. ``{"vision_model": "vision"}``.
            Default: the towers come from the dataflow (passes/modality.py), module paths name them.
        device: device spec to plan for (``"H200"``, ``"H100"``, ``"A100"``, ``"cpu"``);
            default: the device the example inputs live on.
        subgraph_compiler: ``"inductor"`` (default) or ``"eager"`` (ATen ops, no codegen).
        max_lanes: most concurrent lanes per graph; ``1`` forces single-stream execution.
        cudagraphs: replay each graph as a CUDA graph on CUDA (``"auto"``: on where CUDA is, unless
            the first step used over 75% of the memory the process may hold; ``True``: even then).
        strict: raise instead of falling back when apollo cannot plan a graph.
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"``: compute-bound ops run in this dtype,
            numerically sensitive ones stay fp32, parameters stay fp32 masters (cast pass).
            Default ``None``: the user's dtypes and autocast are left as they are.
        memory_budget: activation memory kept without recomputation: a fraction (0, 1] of what
            the plain partition saves, a number of bytes (an int of at least 1 MiB), or a
            per-modality dict of fractions such as ``{"vision": 0.3, "text": 1.0}`` (the checkpoint
            pass on the module path; on ``compile_step``'s one graph the step recompute pass, from
            that graph's own backward peak). Default ``None``.
        offload_activations: keep the large values saved for the backward in host memory between
            their last forward use and their first backward use (offload pass; PyTorch >= 2.9).
            Frees GPU memory for a larger batch at the price of two PCIe copies per value per
            step; the model runs without CUDA graphs. Module path only. Default ``False``.
        optimizer_update: how ``compile_step(..., optimizer=)`` updates each parameter inside the
            graph: ``"kernel"`` (default), one op per parameter (``fused_update.py``: a Triton
            kernel on CUDA); or ``"inductor"``, Adam's formula as elementwise ops for Inductor to
            fuse: a slightly faster step for a much longer compile (benchmarks/RESULTS.md).
    """

    dump_dir: str | None = None
    modalities: Mapping[str, str] | None = None
    device: str | None = None
    subgraph_compiler: str = "inductor"
    max_lanes: int | None = None
    cudagraphs: bool | str = "auto"
    strict: bool = False
    precision: str | None = None
    memory_budget: float | int | Mapping[str, float] | None = None
    offload_activations: bool = False
    optimizer_update: str = "kernel"

    @property
    def memory_first(self) -> bool:
        """Whether the user asked for memory over speed (a budget or offloading)."""
        return self.memory_budget is not None or self.offload_activations

    @classmethod
    def from_user(cls, options: Mapping[str, Any] | None = None, mode: str | None = None) -> "ApolloOptions":
        """Validate `options`/`mode` as passed by ``torch.compile``; raise ApolloOptionsError."""
        if mode not in SUPPORTED_MODES:
            raise ApolloOptionsError(
                f"apollo: mode={mode!r} is not supported; valid modes: 'default', 'reduce-overhead' "
                "(apollo replays CUDA graphs in both), or pass options= instead"
            )
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ApolloOptionsError(f"apollo: options must be a dict, got {type(options).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in valid:
                raise ApolloOptionsError(f"apollo: unknown option {key!r}; valid options: {', '.join(valid)}")
        values = dict(options)
        if "dump_dir" not in values and os.environ.get("APOLLO_DUMP_DIR"):
            values["dump_dir"] = os.environ["APOLLO_DUMP_DIR"]
        opts = cls(**values)
        opts._check()
        for key in ("modalities", "memory_budget"):
            if isinstance(getattr(opts, key), Mapping):
                object.__setattr__(opts, key, dict(getattr(opts, key)))
        return opts

    def _check(self) -> None:
        def bad(key: str, expected: str) -> ApolloOptionsError:
            return ApolloOptionsError(f"apollo: option {key!r}={getattr(self, key)!r} is invalid; expected {expected}")

        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise bad("dump_dir", "a directory path (str) or None")
        if self.modalities is not None:
            if not isinstance(self.modalities, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) and k and v for k, v in self.modalities.items()
            ):
                raise bad("modalities", "a dict of module-path prefix (str) -> modality name (str)")
        if self.device is not None and self.device not in DEVICE_SPECS:
            raise bad("device", f"one of {', '.join(DEVICE_SPECS)} or None")
        if self.subgraph_compiler not in SUBGRAPH_COMPILERS:
            raise bad("subgraph_compiler", f"one of {', '.join(SUBGRAPH_COMPILERS)}")
        if self.max_lanes is not None and (
            isinstance(self.max_lanes, bool) or not isinstance(self.max_lanes, int) or self.max_lanes < 1
        ):
            raise bad("max_lanes", "an int >= 1 or None (as many lanes as independent branches)")
        if not any(self.cudagraphs is c for c in CUDAGRAPH_CHOICES) and self.cudagraphs != "auto":
            raise bad("cudagraphs", "'auto', True or False")
        if not isinstance(self.strict, bool):
            raise bad("strict", "True or False")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise bad("precision", f"one of {', '.join(PRECISIONS)} or None")
        if _tiny_byte_count(self.memory_budget):
            raise ApolloOptionsError(
                f"apollo: option 'memory_budget'={self.memory_budget!r} is invalid: an int is a byte count, and "
                f"{self.memory_budget} bytes (under 1 MiB) is no activation budget; pass a fraction as a float in "
                f"(0, 1], e.g. 0.5, or a byte count of at least {MIN_BUDGET_BYTES}")
        if self.memory_budget is not None and not _valid_budget(self.memory_budget):
            raise bad("memory_budget", f"a fraction in (0, 1], a byte count (int >= {MIN_BUDGET_BYTES}), or a dict of "
                                       "modality name -> fraction in (0, 1]")
        if not isinstance(self.offload_activations, bool):
            raise bad("offload_activations", "True or False")
        if self.optimizer_update not in OPTIMIZER_UPDATES:
            raise bad("optimizer_update", f"one of {', '.join(map(repr, OPTIMIZER_UPDATES))}")
        if self.offload_activations:
            if not partitioner_offloads():
                raise ApolloOptionsError(
                    f"apollo: option 'offload_activations' needs PyTorch 2.9 or later (activation offloading "
                    f"in the partitioner); this is {torch.__version__}")
            if self.cudagraphs is True:
                raise ApolloOptionsError(
                    "apollo: options 'offload_activations' and cudagraphs=True do not go together: the copies "
                    "to host memory cannot be replayed as a CUDA graph; use cudagraphs='auto' or False")


DEFAULT_OPTIONS = ApolloOptions()
