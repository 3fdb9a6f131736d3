"""Whole-step compilation: the forward, ``loss.backward()`` and the ``.grad`` updates in ONE graph.

    step = apollo_compile.compile_step(step_fn)      # step_fn calls loss.backward() itself

With ``torch._dynamo.config.trace_autograd_ops`` on (only while Dynamo traces and runs this
function), Dynamo traces ``loss.backward()`` into the forward's graph, and AOTAutograd hands apollo
one inference graph holding the forward and the backward. Each tower's forward and backward then
run on that tower's lane and, on CUDA, the whole step replays as one CUDA graph: no autograd engine
and no AOTAutograd wrapper between the halves.

What cannot be one graph trains on the module path, as a module-compiled model does (forward and
backward graphs, the autograd engine between them), with one :class:`ApolloFallbackWarning` saying
why: a Dynamo that cannot trace the backward, a graph break inside the step (``optimizer.step()``
is one: pass ``compile_step(fn, optimizer=opt)`` instead), or code whose shapes depend on a
tensor's values (NOTE: Data-dependent code under fullgraph).

With ``optimizer=`` (Adam or AdamW), each call is ``fn(...)``, ``optimizer.step()`` and
``optimizer.zero_grad(set_to_none=True)``, all traced into the same graph (``optimizer_step.py``):
what reads the gradients (clipping, logging their norm) goes inside `fn`, after
``loss.backward()``. AOTAutograd then keeps the writes into the parameters and the optimizer's
state inside the graph (``keep_inference_input_mutations``). Another optimizer, or a step on the
module path, runs ``optimizer.step()`` (with torch's list kernels: ``eager_update.py``) and
``zero_grad(set_to_none=True)`` eagerly after the compiled part, with one warning. While the whole
step is traced and run, ``stand_ins.py``'s traceable stand-ins are in place.
Design: docs/design/whole-step.md#the-whole-step-as-one-graph.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from typing import Any, Callable

import torch
import torch._dynamo
import torch.fx.traceback

from ..fallback import ApolloFallbackWarning
from ..passes.modality import traced_from_autograd
from ..runtime.first_call import WROTE_NOTHING
from ..runtime.graph_pool import release_cached_segments
from .eager_update import list_kernels
from .micro_batches import MicroBatchedStep, check_micro_batches
from .optimizer_step import InGraphAdam, unsupported_reason
from .stand_ins import needed as stand_ins_needed, whole_step_stand_ins
from ..options import COMPILE_STEP_ONLY, STEP, STEP_OPTIMIZER, ApolloOptions, ApolloOptionsError, check_path

log = logging.getLogger("apollo_compile")

TRACE_FLAG = "trace_autograd_ops"

# what is being traced, read by the backend (Dynamo calls it in the calling thread): "whole" while
# a whole step is that can fall back to the module path (not under the user's fullgraph=True),
# "updates" while its optimizer's update is inside (the input mutations stay in the graph)
_tracing = {"whole": False, "updates": False}


def keeps_input_mutations() -> bool:
    """Whether the graph being compiled is a whole step with its optimizer's update inside."""
    return _tracing["updates"]


def module_path_is_last_resort() -> bool:
    """Whether the graph being compiled is a whole step whose last resort is the module path.

    [NOTE] A whole step's last resort: a graph that neither apollo nor Inductor can compile runs,
    elsewhere, as Dynamo traced it, eagerly. A whole step's graph holds its backward as plain ops,
    and eager ops are all it would get, while the module path compiles the same step as forward
    and backward graphs, each with its own fallbacks. So there the backend raises instead
    (:class:`WholeStepNotCompiled`) and the step takes the module path. Case in point: Hugging
    Face's activation checkpointing around a random op (X-CLIP's): AOTAutograd cannot
    rematerialize it in a forward-loss-backward graph, while its partitioner handles it in a
    joint graph. Under the user's ``fullgraph=True`` the module path cannot run (its
    ``loss.backward()`` breaks the graph), and the graph runs eagerly, with the usual warning."""
    return _tracing["whole"]


class WholeStepNotCompiled(RuntimeError):
    """Raised by the backend where a whole step's graph cannot be compiled (NOTE: A whole step's
    last resort); Dynamo raises it on as a failed backend, and the step takes the module path."""


def _not_one_graph_errors() -> tuple[type[BaseException], ...]:
    """What tracing the step as one graph raises where the step cannot be one graph, before any of
    it has run, so that the module path can run the call from its start.

    [NOTE] Data-dependent code under fullgraph: with ``fullgraph=True`` Dynamo captures
    ``.item()`` and ``.tolist()`` as unbacked symbols instead of breaking the graph there, and
    code that then branches on such a value (Qwen2-VL's vision tower splits its attention with
    ``torch.split(q, lengths.tolist())``) raises the symbolic-shapes and fake-tensor errors
    below, not Dynamo's ``Unsupported``. The module path breaks the graph at the ``.tolist()``
    and trains. Dynamo's own exceptions (``TorchDynamoException``: Unsupported, a tracing-time
    ``TorchRuntimeError``, a failed backend) are all raised before the compiled code runs; an
    error of the user's code raises again on the module path, where it is the user's to see."""
    from torch._subclasses import fake_tensor
    from torch.fx.experimental import symbolic_shapes

    names = [(symbolic_shapes, "GuardOnDataDependentSymNode"), (symbolic_shapes, "PendingUnbackedSymbolNotFound"),
             (fake_tensor, "DataDependentOutputException"), (fake_tensor, "DynamicOutputShapeException"),
             (fake_tensor, "UnsupportedOperatorException")]
    return (torch._dynamo.exc.TorchDynamoException,
            *(getattr(module, name) for module, name in names if hasattr(module, name)))


# meta["custom"] on the Dynamo nodes that trace the backward (mark_backward): torch copies it onto
# every ATen node traced from them, where torch 2.11's rematerialization looks for it
BACKWARD_MARK = {"remat_pass_tag": "is_backward"}


class CheckpointAfterBackward(RuntimeError):
    """Raised by :func:`mark_backward` where this PyTorch would not re-run a user's checkpoint of
    the graph; the backend then does not compile the graph (NOTE: The user's checkpoints in a
    whole step)."""


def mark_backward(gm: torch.fx.GraphModule) -> None:
    """Mark the nodes of Dynamo's graph that trace the backward (``loss.backward()``, traced as
    ``torch.autograd.grad``) with :data:`BACKWARD_MARK`. A graph without a traced backward is left
    as it is. Raises :class:`CheckpointAfterBackward` where a user's checkpoint follows the first
    backward and this PyTorch finds only where the backward starts.

    [NOTE] The user's checkpoints in a whole step: AOTAutograd copies the ops the user's
    ``torch.utils.checkpoint`` tagged into the backward of a forward-loss-backward graph, and must
    know where the backward is. Torch 2.13 marks the nodes it traces from the autograd engine;
    torch 2.11 marks none and takes everything from the first node annotated with
    :data:`BACKWARD_MARK` on as the backward: without it, nothing is re-run and the checkpoints
    save no memory, silently. Torch 2.13 ignores the annotation. Both re-run one backward's
    checkpoints only; torch 2.13 refuses a second backward that re-runs ops, and torch 2.11 would
    keep a later one's saved, so there apollo refuses the graph. The step then takes the module
    path. Design: docs/design/whole-step.md#the-users-checkpoints."""
    nodes = list(gm.graph.nodes)
    calls = [i for i, n in enumerate(nodes) if n.op == "call_function" and traced_from_autograd(n)]
    if not calls:
        return
    if not _marks_autograd_backward():
        late = [n for n in nodes[calls[0]:] if n.target is torch.ops.higher_order.tag_activation_checkpoint]
        if late:
            where = _traced_at(late[0])
            raise CheckpointAfterBackward(
                f"{len(late)} of the user's checkpoints run after the step's first loss.backward() (a micro-batch's "
                f"but the first, or a second loss's){f', the first at {where}' if where else ''}, and this PyTorch "
                "re-runs checkpointed ops only before it: in one graph they would save no memory")
    for i in calls:
        custom = nodes[i].meta.get("custom")
        nodes[i].meta["custom"] = {**(custom if isinstance(custom, dict) else {}), **BACKWARD_MARK}


def _traced_at(node: torch.fx.Node) -> str | None:
    """``file:line in function`` of the user's code that Dynamo traced `node` from, if it says."""
    frames = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()
              if line.strip().startswith("File ")]
    if not frames:
        return None
    parts = frames[-1].split(", ", 2)  # File "path", line 12, in forward
    if len(parts) != 3:
        return None
    filename = parts[0].removeprefix("File ").strip('"')
    return f"{_short(filename)}:{parts[1].removeprefix('line ')} {parts[2]}"


def _marks_autograd_backward() -> bool:
    """Whether this PyTorch marks the nodes it traces from the autograd engine ``autograd_backward``
    (torch 2.13, not 2.11), by which its rematerialization finds each backward region itself."""
    return hasattr(torch.fx.traceback, "_mark_autograd_backward")


def backward_tracing_supported() -> bool:
    """Whether this PyTorch's Dynamo can trace ``Tensor.backward()`` into the graph."""
    return hasattr(torch._dynamo.config, TRACE_FLAG)


class CompiledStep:
    """The compiled step. It runs as one graph (``fullgraph=True``, backward tracing on) or, once
    that cannot be, on the module path (backward tracing off: ``loss.backward()`` breaks the graph
    and the autograd engine runs the backward graphs), with one warning saying why.

    [NOTE] Why a graph break cannot be allowed inside a whole step: Dynamo resumes after a break in
    a new frame, and there ``loss.backward()`` finds no leaf it knows of (the parameters were the
    first frame's) and traces it as nothing: on torch 2.13 every ``.grad`` stays None, with no
    error. With ``fullgraph=True`` the break raises while the first frame is traced, before any of
    the step has run, so the module path can run the call from its start.

    [NOTE] Code only a first call runs: a model may do work on its first call that Dynamo cannot
    trace and later calls skip. Hugging Face's output-capturing models (LLaVA reads a hidden state
    of its vision tower) install their hooks on the first call under a ``threading.Lock``, which
    Dynamo does not enter. So a step that does not trace whole on its first call runs that call on
    the module path and is traced whole once more on its second; only if that fails too does it
    stay on the module path, with the warning. The whole step is traced from a code object of its
    own (``_without_update`` / ``_with_update``), not ``fn``'s: Dynamo keeps its compiled code per
    code object, and the retry would otherwise find the module path's code for ``fn`` and run it
    without tracing anything. A step that cannot be one graph is thus traced twice up to the point
    that fails.

    [NOTE] Out of memory at the first call: a whole step's graph saves every activation autograd
    saves, where the module path's partition re-runs cheap pointwise work, so near the memory
    limit the one graph can run out where the module path fits. Its first call runs un-graphed;
    if it runs out before any subgraph that writes state (a parameter, the optimizer's moments, a
    ``.grad``) has started (``first_call.WriteWatch``), nothing of the step has happened, and the
    call runs again on the module path, which the step keeps, with one warning. Run out after a
    write, the error is the user's, as before (docs/design/whole-step.md#out-of-memory-at-the-first-call)."""

    def __init__(self, fn: Callable, torch_compile_kwargs: dict[str, Any], fallback_reason: str | None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.fn, self.kwargs = fn, torch_compile_kwargs
        self.user_fullgraph = bool(torch_compile_kwargs.get("fullgraph", False))
        self.optimizer = optimizer
        self.update: InGraphAdam | None = None  # the optimizer's update inside the graph, where it can be
        traced = self._without_update  # a code object of its own: Dynamo's cache of `fn` is the module path's
        if optimizer is not None:
            why = unsupported_reason(optimizer)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"apollo.compile_step: {why}")
            if why is None:
                update = (torch_compile_kwargs.get("options") or {}).get("optimizer_update", "kernel")
                self.update = InGraphAdam(optimizer, update)
                traced = self._with_update
            else:
                warnings.warn(f"apollo.compile_step: {why}", ApolloFallbackWarning, stacklevel=4)
        options = _options(torch_compile_kwargs)
        if self.update is not None and _takes_guard_filters():  # the state's tensor guards are implied (optimizer_step.py, NOTE)
            options["guard_filter_fn"] = _both(self.update.guard_filter, options.get("guard_filter_fn"))
        self.whole = torch.compile(traced, backend="apollo", **{**torch_compile_kwargs, "options": options,
                                                                 "fullgraph": True})
        self.parts: Callable | None = None  # the module path, once a call has run on it
        self.parts_first_call_only = False  # compiled for the first call alone (_module_path)
        self.first_call_reason: str | None = None  # why the first call did not trace whole, if it did not
        self.fallback_reason = fallback_reason  # why the step runs on the module path, once it does for good
        self.stand_ins = stand_ins_needed()  # in place while the whole step is traced and run (stand_ins.py)
        if fallback_reason is not None:
            self._fall_back(fallback_reason, stacklevel=4)
        functools.update_wrapper(self, fn)

    @property
    def retry(self) -> bool:
        """The first call ran on the module path and the next traces the whole step once more:
        the module path is compiled, but no reason to stay on it is known yet."""
        return self.parts is not None and self.fallback_reason is None

    def _module_path(self, first_call_only: bool = False) -> Callable:
        """The step compiled as forward and backward graphs. `first_call_only`: for the first call
        alone (NOTE: Code only a first call runs), so without CUDA graphs: a graph captured for it
        (a micro-batched step calls it once per micro-batch) would never replay and would keep its
        memory for the rest of the run."""
        if self.parts is None or (self.parts_first_call_only and not first_call_only):
            options = _options(self.kwargs) | ({"cudagraphs": False} if first_call_only else {})
            self.parts = torch.compile(self.fn, backend="apollo", **{**self.kwargs, "options": options})
            self.parts_first_call_only = first_call_only
        return self.parts

    def _fall_back(self, reason: str, stacklevel: int = 3,
                   advice: str = "Keep optimizer.step() and Python-side work (print, .item()) outside the compiled "
                                 "step") -> None:
        self.fallback_reason = reason
        self._module_path()  # for good: compiled again where the first call's was without CUDA graphs
        warnings.warn(f"apollo.compile_step: {getattr(self.fn, '__qualname__', self.fn)} runs as forward and "
                      f"backward graphs with the autograd engine between them, not as one graph, because {reason}: "
                      f"training stays correct, the step is slower. {advice}", ApolloFallbackWarning,
                      stacklevel=stacklevel)

    def _without_update(self, *args: Any, **kwargs: Any) -> Any:
        """What is traced when the optimizer stays outside: the user's step."""
        return self.fn(*args, **kwargs)

    def _with_update(self, *args: Any, **kwargs: Any) -> Any:
        """What is traced when the optimizer's update is inside: the user's step, then the update."""
        out = self.fn(*args, **kwargs)
        self.update.apply()
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fallback_reason is None:  # one graph, or its second try (NOTE: Code only a first call runs)
            if self.update is not None:
                self.update.prepare()
            out_of_memory = None
            try:
                with torch._dynamo.config.patch(**{TRACE_FLAG: True}), whole_step_stand_ins(self.stand_ins):
                    _tracing.update(whole=not self.user_fullgraph, updates=self.update is not None)
                    try:
                        out = self.whole(*args, **kwargs)
                    finally:
                        _tracing.update(whole=False, updates=False)
                if self.update is None:
                    self._step_outside()
                if self.retry:
                    self.parts = None
                    log.info("apollo.compile_step: %s traced as one graph on its second call; its first ran on the "
                             "module path (%s)", getattr(self.fn, "__qualname__", self.fn), self.first_call_reason)
                return out
            except _not_one_graph_errors() as e:
                if self.user_fullgraph:
                    raise
                reason = f"it does not trace as one graph ({_why(e)})"
                if self.parts is None:  # once more at the next call (NOTE: Code only a first call runs)
                    self.first_call_reason = reason
                    self._module_path(first_call_only=True)
                else:
                    self._fall_back(reason)
            except torch.OutOfMemoryError as e:  # NOTE: Out of memory at the first call
                if self.user_fullgraph or getattr(e, WROTE_NOTHING, None) is None:
                    raise
                out_of_memory = str(e).strip().splitlines()[0][:200] if str(e).strip() else "CUDA out of memory"
            if out_of_memory is not None:  # outside the except block, whose traceback holds the run's memory
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    release_cached_segments()
                self._fall_back(f"its first call as one graph ran out of memory before it wrote anything "
                                f"({out_of_memory})", advice="The module path saves what a partition saves; "
                                "memory_budget= keeps the step one graph in less memory")
        if not backward_tracing_supported():
            out = self.parts(*args, **kwargs)
        else:
            with torch._dynamo.config.patch(**{TRACE_FLAG: False}):  # never the resumed frame's empty backward
                out = self.parts(*args, **kwargs)
        self._step_outside()
        return out

    def _step_outside(self) -> None:
        """The optimizer's step where it is not inside the graph: eagerly, after the compiled part,
        with torch's list kernels on an accelerator (eager_update.py, NOTE: The eager update uses
        list kernels)."""
        if self.optimizer is not None:
            with list_kernels(self.optimizer, self.update is not None):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def _why(e: BaseException) -> str:
    """The first line of what Dynamo raised (of the backend's own error, for a failed backend),
    where in the user's code it was (:func:`_where`) and Dynamo's first hint where it gives one:
    what the user can change."""
    inner = getattr(e, "inner_exception", None)
    lines = [line.strip() for line in str(inner if inner is not None else e).strip().splitlines() if line.strip()]
    why = lines[0] if lines else type(e).__name__
    if inner is not None:
        why = f"{type(inner).__name__}: {why}"
    where = _where(e, lines)
    if where:
        why = f"{why}, at {where}"
    hint = next((line for line in lines if line.startswith("Hint:")), None)
    return why if hint is None else f"{why}; Dynamo's {hint[0].lower()}{hint[1:]}"


def _where(e: BaseException, lines: list[str]) -> str | None:
    """``file:line in function`` of the user's code where tracing stopped: the innermost frame of
    Dynamo's ``real_stack`` (an ``Unsupported``), else the ``Caused by: ... # file:line in fn``
    a symbolic-shapes error names; None where neither is given. The file is cut to its package's
    path (``transformers/utils/output_capturing.py``)."""
    stack = getattr(e, "real_stack", None)
    if stack:
        frame = stack[-1]
        return f"{_short(frame.filename)}:{frame.lineno} in {frame.name}"
    caused = next((line for line in lines if line.startswith("Caused by:") and "  # " in line), None)
    if caused is None:
        return None
    return caused.split("  # ", 1)[1].split(" (", 1)[0].strip() or None


def _short(filename: str) -> str:
    """`filename` from its package on (below ``site-packages``), else its last two components."""
    parts = filename.replace("\\", "/").split("/")
    if "site-packages" in parts:
        return "/".join(parts[len(parts) - parts[::-1].index("site-packages"):])
    return "/".join(parts[-2:])


# what torch.compile takes out of `options` itself: the rest is the backend's
TORCH_COMPILE_OPTIONS = ("guard_filter_fn",)


def _options(torch_compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A copy of the user's ``options`` for one ``torch.compile`` call: it pops what is its own
    (``guard_filter_fn``) from the dict it is given, so each call gets the user's whole dict."""
    return {k: v for k, v in (torch_compile_kwargs.get("options") or {}).items()
            if k not in COMPILE_STEP_ONLY}  # read here, not by the backend, which refuses them


def _takes_guard_filters() -> bool:
    """Whether this PyTorch's ``torch.compile`` takes ``options={"guard_filter_fn": ...}`` (it pops it
    before the backend sees the options)."""
    return "guard_filter_fn" in inspect.signature(torch._dynamo.eval_frame._optimize).parameters


def _both(ours: Callable, theirs: Callable | None) -> Callable:
    """A ``guard_filter_fn`` keeping the guards both filters keep (`theirs`: the user's, if any)."""
    if theirs is None:
        return ours
    return lambda entries: [a and b for a, b in zip(ours(entries), theirs(entries))]


def compile_step(fn: Callable | None = None, *, optimizer: torch.optim.Optimizer | None = None,
                 micro_batches: int = 1, **torch_compile_kwargs: Any) -> Callable:
    """``torch.compile(fn, backend="apollo", **torch_compile_kwargs)`` with ``loss.backward()``
    traced into the same graph: the user's whole step (forward, backward, gradients) is one
    compiled artifact. Usable as ``compile_step(fn, options={...})`` or as a decorator,
    ``@compile_step`` / ``@compile_step(options={...})``.

    `fn` computes a loss, calls ``loss.backward()`` and returns what it likes (``loss.detach()``);
    gradients land in ``.grad`` as eager autograd leaves them: assigned where ``.grad`` is None,
    accumulated where it exists. With `optimizer` (Adam, AdamW) each call also runs its step and
    ``zero_grad(set_to_none=True)``, inside the same graph (see the module docstring); otherwise
    keep the optimizer outside. With ``micro_batches=k`` (and `optimizer`) each call runs `fn` on k
    slices of the batch inside the one graph, the gradients averaged (``micro_batches.py``).
    Options are validated here, before anything is traced."""
    if fn is None:
        return functools.partial(compile_step, optimizer=optimizer, micro_batches=micro_batches, **torch_compile_kwargs)
    if not callable(fn):
        raise TypeError(f"apollo.compile_step: expected the step function, got {type(fn).__name__}")
    backend = torch_compile_kwargs.pop("backend", "apollo")
    if backend != "apollo":
        raise ApolloOptionsError(f"apollo.compile_step compiles with backend='apollo', got backend={backend!r}; "
                                 "use torch.compile for other backends")
    options = torch_compile_kwargs.get("options")
    if isinstance(options, dict):  # the backend's own, as torch.compile hands them over
        options = {k: v for k, v in options.items() if k not in TORCH_COMPILE_OPTIONS}
    ApolloOptions.from_user(options, torch_compile_kwargs.get("mode"))
    check_path(options, STEP if optimizer is None else STEP_OPTIMIZER)  # refused, not ignored (options.py)
    reason = None if backward_tracing_supported() else (
        f"this PyTorch's Dynamo cannot trace loss.backward() into the graph (torch._dynamo.config.{TRACE_FLAG} "
        "is missing)")
    if check_micro_batches(micro_batches, optimizer) > 1:
        return MicroBatchedStep(fn, micro_batches, optimizer,
                                lambda split: CompiledStep(split, torch_compile_kwargs, reason, optimizer))
    return CompiledStep(fn, torch_compile_kwargs, reason, optimizer)
