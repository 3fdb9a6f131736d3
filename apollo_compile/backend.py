"""The ``apollo`` torch.compile backend: the glue between Dynamo, AOTAutograd and the pipeline.

``apollo_backend(gm, example_inputs, options=..., mode=...)`` is what ``torch.compile(...,
backend="apollo")`` calls once per Dynamo graph, at the compiled function's first call
(``torch.compile`` itself passes the options to nothing). Options are validated first, before any
tracing; then the pipeline's stages (``pipeline.py``) run: ``pre_grad`` here, the joint stages and
the partition as AOTAutograd's ``partition_fn``, and the per-graph stages as its forward,
backward and inference compilers (:func:`pipeline.compile_graph`). If AOTAutograd itself fails,
the Dynamo graph goes to Inductor (or runs as traced), with one warning.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from typing import Callable

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import RestartAnalysis

from . import pipeline
from .step import whole_step
from .passes import checkpoint
from . import plan as plan_store
from .devices import DEVICE_SPECS, detect_device_spec
from .fallback import ApolloFallbackWarning, warn_fallback
from .options import MODULE, ApolloOptions, ApolloOptionsError, check_path
from .pipeline import GraphContext
from .plan import ModelPlan
from .runtime.cudagraph import GraphFamily

log = logging.getLogger("apollo_compile")


def _input_device(example_inputs) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def cuda_devices(example_inputs) -> list[torch.device]:
    """The CUDA devices a graph's inputs live on, in first-seen order: more than one after
    ``place_modalities`` put towers on separate GPUs."""
    seen = dict.fromkeys(x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda")
    return list(seen)


_last_context: list = [None, 0]  # the CompileContext of the last backend call, and calls within it
_unnamed = [0]


def _graph_name() -> str:
    """``frame<F>_<C>`` from Dynamo's compile id. A backend called several times within one
    frame's compilation (DDP splits the graph at its gradient buckets) gets ``_1``, ``_2``...
    after the first, so plans and dumps do not collide."""
    context = torch._guards.CompileContext.try_get()
    compile_id = context.compile_id if context is not None else None
    if compile_id is None:
        _unnamed[0] += 1
        return f"graph{_unnamed[0]}"
    if _last_context[0] is context:
        _last_context[1] += 1
    else:
        _last_context[:] = [context, 0]
    base = f"frame{compile_id.frame_id}_{compile_id.frame_compile_id}"
    return base if _last_context[1] == 0 else f"{base}_{_last_context[1]}"


def use_cudagraphs(opts: ApolloOptions, example_inputs, name: str) -> bool:
    """Whether this model's graphs are captured: on one CUDA device, unless told not to."""
    device = _input_device(example_inputs)
    if opts.cudagraphs is True and device.type != "cuda":
        log.warning("apollo: cudagraphs=True ignored for %s: CUDA graphs need a CUDA device", device)
    if device.type != "cuda" or opts.cudagraphs not in ("auto", True):
        return False
    if opts.offload_activations:  # copies to host memory Inductor allocates per call (offload.py)
        log.info("apollo: %s runs un-graphed: offload_activations copies to host memory each step", name)
        return False
    spanned = cuda_devices(example_inputs)
    if len(spanned) > 1:  # a capture records one device's streams (placement.py)
        why = f"its graph spans {', '.join(map(str, spanned))} (place_modalities)"
        if opts.cudagraphs is True:
            warnings.warn(f"apollo: {name} runs without CUDA graphs because {why}; training stays correct",
                          ApolloFallbackWarning, stacklevel=3)
        else:
            log.info("apollo: %s runs un-graphed: %s", name, why)
        return False
    return True


def apollo_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                   mode: str | None = None) -> Callable:
    """The torch.compile backend registered as ``"apollo"``."""
    device = _input_device(example_inputs)
    try:
        opts = ApolloOptions.from_user(options, mode)
        check_path(options, MODULE)  # compile_step hands over only what applies here (whole_step._options)
        if device.type not in ("cpu", "cuda"):
            raise ApolloOptionsError(f"apollo: device {device.type!r} is not supported; apollo runs on 'cuda' and 'cpu'")
    except ApolloOptionsError as e:
        e.first_useful_frame = inspect.currentframe()  # Dynamo shows the traceback from here on, not its own frames
        raise
    spec = DEVICE_SPECS[opts.device] if opts.device else detect_device_spec(device)
    name = _graph_name()
    model_plan = ModelPlan(name)
    compiler = functools.partial(pipeline.compile_graph, name=name, options=opts, spec=spec, device=device,
                                 model_plan=model_plan,
                                 family=GraphFamily() if use_cudagraphs(opts, example_inputs, name) else None,
                                 whole_step=whole_step.module_path_is_last_resort())
    decompositions = None
    if opts.subgraph_compiler == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
    if pipeline.PRE_GRAD_PASSES:
        pre_ctx = GraphContext(f"{name}_dynamo", "dynamo", opts, spec)
        pipeline.run_pre_grad_stage(gm, pre_ctx)
        model_plan.pre_grad = pre_ctx.decisions
    joint_ctx = GraphContext(f"{name}_joint", "joint", opts, spec)
    model_plan.joint = joint_ctx.decisions
    aot = aot_autograd(
        fw_compiler=functools.partial(compiler, kind="forward"),
        bw_compiler=functools.partial(compiler, kind="backward"),
        inference_compiler=functools.partial(compiler, kind="inference"),
        partition_fn=functools.partial(pipeline.partition, ctx=joint_ctx),
        decompositions=decompositions,
        # a whole step with its optimizer inside writes the parameters and the optimizer's state in
        # the graph (whole_step.py), not as new outputs copied back after it
        keep_inference_input_mutations=whole_step.keeps_input_mutations(),
    )
    try:
        with checkpoint.attention_recomputed_as_is():  # also where a whole step's graph rematerializes
            whole_step.mark_backward(gm)  # where the user's checkpoints re-run (whole_step.py, NOTE)
            compiled = aot(gm, example_inputs)
    except RestartAnalysis:
        # Dynamo's own control flow, not a failure: e.g. with dynamic=True, AOTAutograd asks Dynamo
        # to retrace with a symbolic float (an attention scale) as a tensor; the retrace calls us
        # again, and only that attempt's plan is kept
        raise
    except Exception as e:
        if opts.strict:
            plan_store.record(model_plan)
            raise
        compiled = None
        # Inductor's AOTAutograd would not re-run those checkpoints either (whole_step.py, NOTE)
        if opts.subgraph_compiler == "inductor" and not isinstance(e, whole_step.CheckpointAfterBackward):
            try:
                from torch._inductor.compile_fx import compile_fx

                compiled = compile_fx(gm, example_inputs)
            except Exception:  # Inductor cannot either: eager is always right
                pass
        if compiled is None and whole_step.module_path_is_last_resort():  # better than its graph run eagerly (NOTE)
            raise whole_step.WholeStepNotCompiled(f"graph {name} cannot be compiled: {type(e).__name__}: {e}") from e
        plan_store.record(model_plan)
        warn_fallback(name, "Inductor" if compiled is not None else "eager PyTorch (the Dynamo graph as traced)", e)
        return compiled if compiled is not None else gm.forward
    plan_store.record(model_plan)
    return compiled
