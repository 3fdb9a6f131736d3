"""The ``apollo`` torch.compile backend: Dynamo graph -> AOTAutograd -> passes -> runtime.

``apollo_backend(gm, example_inputs, options=..., mode=...)`` is what ``torch.compile(...,
backend="apollo")`` calls once per Dynamo graph. Options are validated first, before any
tracing. AOTAutograd then hands each ATen graph (forward, backward, or inference) to
:func:`compile_graph`, which runs the pass pipeline and builds the runtime. Anything apollo
cannot handle falls back, for that graph alone, to Inductor (or eager ATen) with one warning.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings
import weakref
from typing import Callable

import torch
import torch.fx
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import RestartAnalysis

from . import plan as plan_store
from .annotations import info
from .devices import DEVICE_SPECS, DeviceSpec, detect_device_spec
from . import calibration, logs, pipeline
from .fallback import ApolloFallbackWarning
from .nodes import graph_outputs
from .options import ApolloOptions, ApolloOptionsError
from .passes import checkpoint, offload
from .passes.quotas import MIN_GAIN
from .pipeline import GraphContext, run_passes
from .plan import GraphPlan, ModelPlan
from .runtime.cudagraph import CudaGraphRunner, GraphFamily
from .runtime.runner import build_runtime
from .runtime.subgraphs import has_host_copies, has_symbolic_sizes, inductor_config
from .tracing import fw_metadata

log = logging.getLogger("apollo_compile")

# With a memory_budget the user put memory first: a concurrent candidate is replayed only if its
# CUDA-graph pool stays within this much of the one-stream candidate's (issue 3's bound on lanes).
MEMORY_FIRST_LANE_RATIO = 1.1
REPORT_HINT = "please report it with the dump (options={'dump_dir': ...}) at the apollo_compile issue tracker"


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


def _warn_fallback(name: str, path: str, reason: BaseException | str) -> None:
    why = reason if isinstance(reason, str) else f"{type(reason).__name__}: {reason}"
    warnings.warn(f"apollo: graph {name} runs on {path} instead of apollo's runtime because {why}; "
                  f"training stays correct, but {REPORT_HINT}", ApolloFallbackWarning, stacklevel=2)


def fallback_compile(gm: torch.fx.GraphModule, example_inputs, kind: str, compiler: str,
                     memory_first: bool = False) -> Callable:
    """Compile one ATen graph without apollo's planning: Inductor, else eager ATen."""
    if compiler == "inductor":
        try:
            from torch._inductor.compile_fx import compile_fx_inner

            with inductor_config(host_copies=has_host_copies(gm), memory_first=memory_first):
                return compile_fx_inner(gm, example_inputs, is_backward=kind == "backward",
                                        is_inference=kind == "inference")
        except Exception as e:  # pragma: no cover - Inductor unavailable
            log.warning("apollo: Inductor fallback failed too (%s); running eager ATen", e)
    return make_boxed_func(gm.forward)


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs,
    kind: str,
    name: str,
    options: ApolloOptions,
    spec: DeviceSpec,
    device: torch.device,
    model_plan: ModelPlan,
    family: GraphFamily | None = None,
) -> Callable:
    """Plan and build one ATen graph; on failure fall back for this graph only."""
    graph_name = f"{name}_{kind}"
    ctx = GraphContext(graph_name, kind, options, spec)
    forward = model_plan.graphs.get("forward")
    if kind == "backward" and forward is not None:
        ctx.forward_modalities = {n.name: info(n).modality for n in forward.gm.graph.nodes if n.op != "output"}
        ctx.forward_inputs = [info(n).modality for n in forward.gm.graph.nodes if n.op == "placeholder"]
    graph_plan = GraphPlan(graph_name, kind, spec.name, gm, ctx.decisions)
    if kind == "forward":
        graph_plan.checkpoint = model_plan.joint.get("checkpoint")
    model_plan.graphs[kind] = graph_plan
    try:
        run_passes(gm, ctx)
        try:
            # quota candidates only pay off, and are only measured, as CUDA graphs
            quotas = _quota_candidates(ctx) if family is not None else None
            runtimes = build_runtime(gm, ctx.decisions["lanes"], ctx.decisions["codegen"], graph_name, kind,
                                     options.subgraph_compiler, device, quotas,
                                     family.side_streams if family is not None else None, options.memory_first)
        except Exception as e:  # name the stage, as PassError names the pass
            raise RuntimeError(f"building the runtime (compiling its subgraphs with {options.subgraph_compiler}) "
                               f"failed: {type(e).__name__}: {e}") from e
        graph_plan.runtimes = runtimes
        if family is not None:
            fn = _cudagraphed(gm, runtimes, graph_name, kind, family, ctx, has_symbolic_sizes(example_inputs))
            graph_plan.runner_ref = weakref.ref(fn)
        elif device.type == "cuda":  # un-graphed CUDA: extra streams only add launches
            fn = runtimes.get("one_lane", runtimes["lanes"])
        else:  # CPU: the lane program itself runs, sequentially, so CI exercises it
            fn = runtimes["lanes"]
    except Exception as e:
        if options.strict:
            raise
        fallback = "Inductor" if options.subgraph_compiler == "inductor" else "eager ATen"
        graph_plan.fallback = f"{type(e).__name__}: {e}"
        _warn_fallback(graph_name, fallback, e)
        fn = fallback_compile(gm, example_inputs, kind, options.subgraph_compiler, options.memory_first)
    finally:
        for directory in {options.dump_dir, logs.debug_dump_dir()} - {None}:
            graph_plan.write(directory)
    summary = graph_plan.summary()
    log.info("apollo: %s planned: %s", graph_name, summary)
    logs.emit_plan(graph_name, summary)
    return fn


def _quota_candidates(ctx: GraphContext) -> dict[str, dict[int, int]]:
    """The SM-quota candidates the planner proposed (name -> side lane -> SMs), where this torch
    can make green contexts; without them, one warning and none."""
    cands = ctx.decisions["quotas"].candidates
    plain = min((c.predicted_us for c in cands if c.quotas is None), default=None)
    # only a split predicted to beat plain streams is captured and timed (calibration.py says why)
    wanted = {c.name: c.quotas for c in cands
              if c.quotas and (plain is None or c.predicted_us < plain * (1 - MIN_GAIN))}
    if wanted:
        from torch.cuda import green_contexts

        if not green_contexts.SUPPORTED:
            warnings.warn(f"apollo: {ctx.name} is measured without its SM-quota candidates: this PyTorch "
                          "build has no green-context support", ApolloFallbackWarning, stacklevel=2)
            return {}
    return wanted


def _cudagraphed(gm: torch.fx.GraphModule, runtimes: dict[str, Callable], graph_name: str, kind: str,
                 family: GraphFamily, ctx: GraphContext, symbolic: bool) -> CudaGraphRunner:
    """Wrap a CUDA runtime for CUDA-graph replay, telling it which inputs and outputs are whose,
    and whether its sizes may change between calls (`symbolic`)."""
    static_idxs: set[int] = set()
    user_visible: set[int] | None = None  # None: every output is the user's (inference, backward)
    # a backward's inputs AOTAutograd lets it reuse: saved for the backward only, aliasing no
    # input or output; none if the first backward retained the graph (NOTE: Donation)
    donated: set[int] = set()
    meta = fw_metadata()
    if meta is not None and kind != "backward":
        static_idxs = set(meta.static_input_indices or ())
    if meta is not None and kind == "inference":
        # a whole step's existing .grad (accumulating into it): copied in, not read in place, or
        # this graph would hold the tensors another step's graph lent and must reclaim
        static_idxs -= {i for i, x in enumerate(meta.input_info) if x.mutates_data}
    if meta is not None and kind == "forward" and hasattr(meta, "num_forward_returns"):
        user_visible = set(range(meta.num_forward_returns))
    if meta is not None and kind == "backward":
        donated = set(getattr(meta, "bw_donated_idxs", None) or ())
    # a whole step's gradients (and the .grad values it updates) are lent as a backward's are:
    # returned in the graph's memory, reclaimed before the next replay, never copied per step
    lent = {i for i, o in enumerate(graph_outputs(gm)) if isinstance(o, torch.fx.Node) and info(o).backward} \
        if kind == "inference" else set()
    return CudaGraphRunner(runtimes, graph_name, kind, family, static_idxs, user_visible,
                           on_measured=functools.partial(_calibrate, ctx),
                           max_memory_ratio=MEMORY_FIRST_LANE_RATIO if ctx.options.memory_budget is not None else None,
                           donated_idxs=donated, capture_near_limit=ctx.options.cudagraphs is True,
                           symbolic=symbolic, lent_outputs=lent)


def _calibrate(ctx: GraphContext, measured_ms: dict[str, float]) -> None:
    """The runner measured this graph's candidates: refit the performance model for the device."""
    quotas = ctx.decisions.get("quotas")
    try:
        fitted = calibration.record(ctx.device, ctx.decisions.get("lanes"), quotas.model if quotas else None,
                                    measured_ms)
    except Exception as e:  # calibration is advice: never lose a training step to it
        log.warning("apollo: %s could not calibrate the performance model: %s: %s", ctx.name, type(e).__name__, e)
        return
    if quotas is not None and fitted:
        quotas.calibrated = fitted


def _inductor_joint_passes(gm: torch.fx.GraphModule, joint_inputs) -> torch.fx.GraphModule:
    """Inductor's joint-graph passes (no-op and pointless-cast removal, pattern rewrites), run as
    Inductor's own ``partition_fn`` runs them: our subgraphs are compiled by Inductor and should
    get the graph it would compile. They rewrite in place, so they run on a copy that is adopted
    only if they finish (a failure must not leave a half-rewritten graph), under the graph's fake
    mode (some passes trace), and with random ops left alone (``inductor_config``). The signature
    moved between torch releases, hence the introspection."""
    from torch._guards import detect_fake_mode
    from torch._inductor import compile_fx as cfx
    from torch._inductor.virtualized import V

    fn = cfx._recursive_joint_graph_passes
    params = inspect.signature(fn).parameters
    kwargs: dict = {}
    if "skip_invoke_subgraph" in params:
        kwargs["skip_invoke_subgraph"] = True
    if "input_device" in params and hasattr(cfx, "get_inputs_devices"):
        kwargs["input_device"] = next(iter(cfx.get_inputs_devices(joint_inputs, gm)), None)
    graph = torch.fx.Graph()  # a copy: nodes get copies of their meta dicts; fake values are shared
    result, output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(result).meta.update(output.meta)
    work = torch.fx.GraphModule(gm, graph)
    work.meta.update(gm.meta)
    fake_mode = detect_fake_mode(joint_inputs)
    device_context = getattr(cfx, "get_cuda_device_context", lambda gm: contextlib.nullcontext())
    with device_context(work), inductor_config(), \
            (V.set_fake_mode(fake_mode) if fake_mode is not None else contextlib.nullcontext()):
        out = fn(work, **kwargs)
    return out if out is not None else work  # older releases rewrite in place and return None


# what the joint passes write for the partitioner: checkpoint's recompute policy, offload's marks
_JOINT_TAGS = ("recompute", "should_offload")


def _partition(joint_module, joint_inputs, *, num_fwd_outputs, ctx: GraphContext, **kwargs):
    """Our partition hook: Inductor's joint-graph passes (when it compiles the subgraphs), our joint
    passes tag recomputation, then Inductor's min-cut partitions.

    If a joint pass fails, its tags are undone (the model's own activation-checkpoint tags are
    kept) and the graph is partitioned as if it had not run, with one warning."""
    if ctx.options.subgraph_compiler == "inductor":
        try:
            joint_module = _inductor_joint_passes(joint_module, joint_inputs)
        except Exception as e:
            if ctx.options.strict:
                raise
            warnings.warn(f"apollo: {ctx.name} is partitioned without Inductor's joint-graph passes because "
                          f"{type(e).__name__}: {e} (correct, maybe slower)", ApolloFallbackWarning, stacklevel=2)
    if pipeline.JOINT_PASSES:
        before = {n: {k: n.meta.get(k) for k in _JOINT_TAGS} for n in joint_module.graph.nodes}
        try:
            run_passes(joint_module, ctx, pipeline.JOINT_PASSES)
        except Exception as e:
            if ctx.options.strict:
                raise
            for n, tags in before.items():
                for key, tag in tags.items():
                    if tag is None:
                        n.meta.pop(key, None)
                    else:
                        n.meta[key] = tag
            _warn_fallback(ctx.name, "the default partition (no apollo recompute or offload tags)", e)
    with checkpoint.attention_recomputed_as_is(), offload.partitioner_offloads(ctx.options):
        return min_cut_rematerialization_partition(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                                   **kwargs)


def _run_pre_grad_passes(gm: torch.fx.GraphModule, ctx: GraphContext) -> None:
    """The pre-autograd passes, in place; if one fails, the graph is put back as it was (one
    warning), never left half-rewritten. In place, because AOTAutograd reads what Dynamo left on
    this very module and its placeholder nodes (which inputs are parameters, their sources)."""
    before = [(n, n.args, n.kwargs, dict(n.meta)) for n in gm.graph.nodes]
    try:
        run_passes(gm, ctx, pipeline.PRE_GRAD_PASSES)
    except Exception as e:
        if ctx.options.strict:
            raise
        originals = set()
        for node, args, kwargs, meta in before:  # restoring args restores every use
            node.args, node.kwargs = args, kwargs
            node.meta.clear()
            node.meta.update(meta)
            originals.add(node)
        for node in reversed(list(gm.graph.nodes)):  # what the pass inserted, users first
            if node not in originals:
                gm.graph.erase_node(node)
        gm.recompile()
        _warn_fallback(ctx.name, "the graph without apollo's pre-autograd passes", e)


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
    opts = ApolloOptions.from_user(options, mode)
    device = _input_device(example_inputs)
    if device.type not in ("cpu", "cuda"):
        raise ApolloOptionsError(f"apollo: device {device.type!r} is not supported; apollo runs on 'cuda' and 'cpu'")
    spec = DEVICE_SPECS[opts.device] if opts.device else detect_device_spec(device)
    name = _graph_name()
    model_plan = ModelPlan(name)
    compiler = functools.partial(compile_graph, name=name, options=opts, spec=spec, device=device,
                                 model_plan=model_plan,
                                 family=GraphFamily() if use_cudagraphs(opts, example_inputs, name) else None)
    decompositions = None
    if opts.subgraph_compiler == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
    if pipeline.PRE_GRAD_PASSES:
        pre_ctx = GraphContext(f"{name}_dynamo", "dynamo", opts, spec)
        _run_pre_grad_passes(gm, pre_ctx)
        model_plan.pre_grad = pre_ctx.decisions
    joint_ctx = GraphContext(f"{name}_joint", "joint", opts, spec)
    model_plan.joint = joint_ctx.decisions
    aot = aot_autograd(
        fw_compiler=functools.partial(compiler, kind="forward"),
        bw_compiler=functools.partial(compiler, kind="backward"),
        inference_compiler=functools.partial(compiler, kind="inference"),
        partition_fn=functools.partial(_partition, ctx=joint_ctx),
        decompositions=decompositions,
    )
    try:
        compiled = aot(gm, example_inputs)
    except RestartAnalysis:
        # Dynamo's own control flow, not a failure: e.g. with dynamic=True, AOTAutograd asks Dynamo
        # to retrace with a symbolic float (an attention scale) as a tensor; the retrace calls us
        # again, and only that attempt's plan is kept
        raise
    except Exception as e:
        plan_store.record(model_plan)
        if opts.strict:
            raise
        if opts.subgraph_compiler == "inductor":
            try:
                from torch._inductor.compile_fx import compile_fx

                compiled = compile_fx(gm, example_inputs)
                _warn_fallback(name, "Inductor", e)
                return compiled
            except Exception:  # Inductor cannot either: eager is always right
                pass
        _warn_fallback(name, "eager PyTorch (the Dynamo graph as traced)", e)
        return gm.forward
    plan_store.record(model_plan)
    return compiled
