"""The pipeline, from Dynamo's graph to the replayed CUDA graph. Reading this file tells the whole
story; ``backend.py`` only connects it to Dynamo and AOTAutograd.

Stages, in the order a training step's graphs meet them (:data:`STAGES`):

- ``pre_grad``: Dynamo's FX graph, ``PRE_GRAD_PASSES`` (casts, dense attention masks), traced
  through autograd afterwards; AOTAutograd then traces the joint graph.
- ``inductor_joint`` and ``joint``: the joint graph, Inductor's joint-graph passes (where Inductor
  compiles subgraphs), then ``JOINT_PASSES`` (recompute tags for ``memory_budget``, offload marks).
- ``partition``: PyTorch's min-cut partitioner, into forward and backward graphs (a whole step or a
  graph without gradients is one inference graph).
- ``graph``: each ATen graph, ``GRAPH_PASSES`` (towers, cost, lanes, quotas, memory, the runtime;
  a whole step's recomputation for ``memory_budget``, which no joint stage sees).
- ``runtime``: each lane's subgraphs compiled (Inductor or eager ATen), the lane program built.
- ``cuda_graph``: on CUDA, a ``CudaGraphRunner`` configured once here (:func:`cudagraphed`) that
  chooses a candidate, captures and replays it (docs/design/cuda-graphs.md).

One undo rule: a stage that rewrites a graph runs on a copy (:func:`working_copy`), adopted only
when every pass of the stage finished (:func:`run_stage`). When a stage fails, the graph it was
given is untouched and the stage's fallback runs, with one :class:`ApolloFallbackWarning`
(``strict=True`` raises): ``pre_grad`` and ``joint`` go on without their passes,
``inductor_joint`` without Inductor's, ``graph``, ``runtime`` and ``cuda_graph`` give that graph
alone to Inductor (or eager ATen). The runner falls back per call. Each pass is
``run(gm, ctx) -> decision``, recorded in ``ctx.decisions[name]``; a failing pass is re-raised as
:class:`PassError`. In tests (``VERIFY``) :func:`verify.verify` checks the invariants after every
pass; ``TORCH_COMPILE_DEBUG=1`` dumps every stage's listing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import os
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition

from .perf import calibration
from .report import dump, logs
from .annotations import KEY, info
from .devices import DeviceSpec
from .fallback import ApolloFallbackWarning, warn_fallback
from .ops.fused_update import written_state
from .nodes import graph_outputs
from .options import ApolloOptions
from .passes import (attention_masks, casts, checkpoint, codegen, cost, gradients, lanes, main_allocated, memory,
                     modality, offload, quotas, step_recompute, sync_free, update_lists, updates)
from .passes.quotas import MIN_GAIN
from .plan import GraphPlan, ModelPlan
from .runtime.config import MemoryPolicy, RunnerConfig
from .runtime.cudagraph import CudaGraphRunner
from .runtime.instances import GraphFamily
from .runtime.first_call import FirstCallFallback, WriteWatch
from .runtime.runner import build_runtime
from .runtime.subgraphs import has_host_copies, has_symbolic_sizes, inductor_config
from .tracing import fw_metadata

log = logging.getLogger("apollo_compile")

Pass = Callable[[torch.fx.GraphModule, "GraphContext"], Any]

# On the Dynamo graph (torch-level), before AOTAutograd: whatever is inserted here is traced
# through autograd, so gradients flow through it.
PRE_GRAD_PASSES: list[tuple[str, Pass]] = [
    ("casts", casts.run),        # mixed precision: compute-bound ops in bf16/fp16, sensitive ops fp32
    ("attention_masks", attention_masks.run),  # a broadcast mask laid out so SDPA can take a fused kernel
]

# On the joint forward+backward graph, before the min-cut partitioner splits it.
JOINT_PASSES: list[tuple[str, Pass]] = [
    ("checkpoint", checkpoint.run),  # memory_budget: tag what the backward recomputes instead of saving
    ("offload", offload.mark),  # offload_activations: mark what the partition may keep on the host
]

# On each forward, backward or inference ATen graph.
GRAPH_PASSES: list[tuple[str, Pass]] = [
    ("sync_free", sync_free.run),  # ops that report an output size to the host, where it is known: capturable
    ("gradients", gradients.run),  # whole step: a new .grad is the gradient itself, not a copy
    ("recompute", step_recompute.run),  # whole step, memory_budget or FUSED_BASELINE: the backward re-runs forward ops
    ("updates", updates.run),  # whole step with its optimizer: each update right after its gradient
    ("modality", modality.run),  # label every node by tower: vision, text, ..., fusion for joins
    ("update_lists", update_lists.run),  # whole step: a list update split by tower, cut into launch-sized parts
    ("recomputed", step_recompute.label),  # whole step: its re-run copies marked, and its saved values
    ("saved", checkpoint.mark_saved),  # forward values handed to the backward (with a memory_budget)
    ("offload", offload.label),  # the copies of offloaded saved values, to the host and back
    ("cost", cost.run),          # FLOPs, bytes, compute/memory bound, roofline time per node
    ("lanes", lanes.run),        # concurrent subgraphs, one lane per independent branch
    ("quotas", quotas.run),      # candidate runtimes (one lane, lanes, SM quotas) the CUDA runner measures
    ("main_allocated", main_allocated.run),  # a backward's side-lane gradients in main-stream memory
    ("memory", memory.run),      # arena offsets from lifetimes over the concurrent schedule
    ("codegen", codegen.run),    # the readable Python runtime that launches the subgraphs
]

# The stages in order (the module docstring says what each works on and does).
STAGES = ("pre_grad", "inductor_joint", "joint", "partition", "graph", "runtime", "cuda_graph")


@dataclass
class GraphContext:
    name: str  # e.g. "frame0_0_forward": Dynamo frame/compile id and graph kind
    kind: str  # "dynamo" | "joint" | "forward" | "backward" | "inference"
    options: ApolloOptions
    device: DeviceSpec
    decisions: dict[str, Any] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)
    # backward only: the forward graph's labels by node name (saved values, recomputed ops)
    forward_modalities: dict[str, str] | None = None
    # backward only: the labels of the forward's inputs, in order (output i is input i's gradient)
    forward_inputs: list[str | None] | None = None
    # backward only: the modalities on the forward's main lane (lanes.costliest_on_main follows them)
    forward_main_lane: list[str] | None = None


# Tests turn this on: after every pass of every stage, verify.verify() checks the invariants and a
# violation fails the pass that caused it.
VERIFY = False


class PassError(RuntimeError):
    def __init__(self, pass_name: str, graph: str, cause: BaseException) -> None:
        super().__init__(f"apollo pass '{pass_name}' failed on graph {graph}: {type(cause).__name__}: {cause}")
        self.pass_name = pass_name
        self.work: torch.fx.GraphModule | None = None  # the copy it failed on (for the dump), set by run_stage


# --------------------------------------------------------------------------------------------
# the stage runner


def working_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm` that passes can rewrite and annotate without touching `gm`: new nodes with
    copies of their meta dicts (fake values shared) and of their apollo annotations, the other
    attributes Dynamo gives nodes, the same submodules and attributes."""
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    result, output = graph.graph_copy(gm.graph, copies, return_output_node=True)
    graph.output(result).meta.update(output.meta)
    for old, new in copies.items():  # what Dynamo sets on nodes beside meta (a placeholder's _dynamo_source)
        for key, value in getattr(old, "__dict__", {}).items():
            if key not in new.__dict__:
                setattr(new, key, value)
    graph._codegen = gm.graph._codegen  # pytree in/out specs, where a graph has them (shared, never changed)
    for n in graph.nodes:
        if KEY in n.meta:
            n.meta[KEY] = copy.copy(n.meta[KEY])
    work = _GraphModule(gm, graph)
    work.meta.update(gm.meta)
    return work


try:  # generates the module's Python only when it is run or read: once per stage, not once per pass
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:  # pragma: no cover - a torch without it generates code at every recompile()
    _GraphModule = torch.fx.GraphModule


def generated(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with its Python generated now (a working copy defers it: passes rewrite the graph
    and call ``recompile()`` many times, and a 9300-node step took ~0.3 s per generation on the
    CPU), so its ``forward`` is the graph's own, not the deferring wrapper, when it is handed on."""
    force = getattr(_GraphModule, "force_recompile", None)
    if force is not None:
        force(gm)
    return gm


def run_passes(gm: torch.fx.GraphModule, ctx: GraphContext, passes: list[tuple[str, Pass]]) -> GraphContext:
    """Run `passes` on `gm` in place and in order, recording each decision in `ctx` (and, under
    VERIFY, checking the invariants after each)."""
    for name, fn in passes:
        start = time.perf_counter()
        try:
            ctx.decisions[name] = fn(gm, ctx)
            if VERIFY:
                from .verify import verify

                if errors := verify(gm, ctx.decisions):
                    raise AssertionError("invariants broken: " + "; ".join(errors[:5]))
        except Exception as e:
            raise PassError(name, ctx.name, e) from e
        ctx.timings_ms[name] = (time.perf_counter() - start) * 1e3
        log.debug("%s: pass %s (%.1f ms) decided: %s", ctx.name, name, ctx.timings_ms[name],
                  _describe(ctx.decisions[name]))
    return ctx


def run_stage(stage: str, gm: torch.fx.GraphModule, ctx: GraphContext, passes: list[tuple[str, Pass]]
              ) -> torch.fx.GraphModule:
    """Run one stage's passes on a working copy of `gm` and return the copy, which the caller
    adopts. If a pass fails, :class:`PassError` is raised (carrying the copy, for the dump) and
    `gm` is as it was: the one undo rule."""
    _dump_stage(gm, ctx, stage, "before")
    work = working_copy(gm)
    try:
        run_passes(work, ctx, passes)
    except PassError as e:
        e.work = work
        raise
    _dump_stage(work, ctx, stage, "after")
    return generated(work)


def run_stage_or_warn(stage: str, gm: torch.fx.GraphModule, ctx: GraphContext, passes: list[tuple[str, Pass]],
                      instead: str) -> torch.fx.GraphModule | None:
    """:func:`run_stage` for a stage the graph can go on without: on failure, None and one warning
    that it goes on as `instead` (``strict=True`` raises)."""
    try:
        return run_stage(stage, gm, ctx, passes)
    except Exception as e:
        if ctx.options.strict:
            raise
        warn_fallback(ctx.name, instead, e)
        return None


def _dump_stage(gm: torch.fx.GraphModule, ctx: GraphContext, stage: str, when: str) -> None:
    directory = logs.debug_dump_dir()
    if directory is None:
        return
    try:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{ctx.name}.{stage}.{when}.txt"), "w") as f:
            f.write(dump.listing(gm, f"{ctx.name}: {when} stage {stage}"))
    except Exception as e:  # a debug aid: never lose a compile to it
        log.debug("apollo: could not dump %s before/after %s: %s", ctx.name, stage, e)


def _describe(decision: Any) -> Any:
    """A one-line view of a pass decision for the log."""
    summary = getattr(decision, "summary", None)
    if callable(summary):
        return summary()
    if hasattr(decision, "arena_bytes"):
        return {"arena_bytes": decision.arena_bytes, "total_bytes": decision.total_bytes}
    if hasattr(decision, "text"):
        return f"{len(decision.text.splitlines())} lines of runtime"
    return decision


# --------------------------------------------------------------------------------------------
# stage pre_grad: the Dynamo graph


def run_pre_grad_stage(gm: torch.fx.GraphModule, ctx: GraphContext) -> None:
    """``PRE_GRAD_PASSES`` on Dynamo's graph. A rewritten copy is adopted *into* `gm` (its graph
    replaced), because AOTAutograd reads what Dynamo left on this very module (its parameters, the
    placeholders' sources, which the copy keeps); a copy the passes left as it was is dropped, and
    on failure `gm` keeps its graph (one warning)."""
    work = run_stage_or_warn("pre_grad", gm, ctx, PRE_GRAD_PASSES, "the graph without apollo's pre-autograd passes")
    if work is None:
        return
    if work.code != gm.code or any(KEY in n.meta for n in work.graph.nodes):  # else Dynamo's graph stays as traced
        gm.graph = work.graph  # recompiles gm's forward


# --------------------------------------------------------------------------------------------
# stages inductor_joint, joint and partition: AOTAutograd's partition_fn


def inductor_joint_passes(gm: torch.fx.GraphModule, joint_inputs) -> torch.fx.GraphModule:
    """Stage ``inductor_joint``: Inductor's joint-graph passes (no-op and pointless-cast removal,
    pattern rewrites), run as Inductor's own ``partition_fn`` runs them: our subgraphs are compiled
    by Inductor and should get the graph it would compile. They rewrite in place, so they run on a
    working copy, adopted only if they finish, under the graph's fake mode (some passes trace), and
    with random ops left alone (``inductor_config``). The signature moved between torch releases,
    hence the introspection."""
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
    work = working_copy(gm)
    fake_mode = detect_fake_mode(joint_inputs)
    device_context = getattr(cfx, "get_cuda_device_context", lambda gm: contextlib.nullcontext())
    with device_context(work), inductor_config(), \
            (V.set_fake_mode(fake_mode) if fake_mode is not None else contextlib.nullcontext()):
        out = fn(work, **kwargs)
    return generated(out if out is not None else work)  # older releases rewrite in place and return None


def partition(joint_module, joint_inputs, *, num_fwd_outputs, ctx: GraphContext, **kwargs):
    """AOTAutograd's partition_fn: stage ``inductor_joint`` (when Inductor compiles the
    subgraphs), stage ``joint`` (our recompute tags and offload marks), then stage ``partition``,
    PyTorch's min-cut partitioner, reading those tags.

    If a joint stage fails, the graph is partitioned as if it had not run (the model's own
    activation-checkpoint tags kept), with one warning."""
    if ctx.options.subgraph_compiler == "inductor":
        try:
            joint_module = inductor_joint_passes(joint_module, joint_inputs)
        except Exception as e:
            if ctx.options.strict:
                raise
            warnings.warn(f"apollo: {ctx.name} is partitioned without Inductor's joint-graph passes because "
                          f"{type(e).__name__}: {e} (correct, maybe slower)", ApolloFallbackWarning, stacklevel=2)
    if JOINT_PASSES:
        work = run_stage_or_warn("joint", joint_module, ctx, JOINT_PASSES,
                                 "the default partition (no apollo recompute or offload tags)")
        joint_module = joint_module if work is None else work
    with checkpoint.attention_recomputed_as_is(), offload.partitioner_offloads(ctx.options):
        return min_cut_rematerialization_partition(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                                   **kwargs)


# --------------------------------------------------------------------------------------------
# stages graph, runtime and cuda_graph: each ATen graph AOTAutograd compiles


def fallback_compile(gm: torch.fx.GraphModule, example_inputs, kind: str, compiler: str,
                     free_at_last_use: bool = False) -> Callable:
    """Compile one ATen graph without apollo's planning: Inductor, else eager ATen. `free_at_last_use`:
    free each buffer at its last use (``MemoryPolicy.free_at_last_use``)."""
    if compiler == "inductor":
        try:
            from torch._inductor.compile_fx import compile_fx_inner

            with inductor_config(host_copies=has_host_copies(gm), free_at_last_use=free_at_last_use):
                return compile_fx_inner(gm, example_inputs, is_backward=kind == "backward",
                                        is_inference=kind == "inference")
        except Exception as e:  # pragma: no cover - Inductor unavailable
            log.warning("apollo: Inductor fallback failed too (%s); running eager ATen", e)
    return make_boxed_func(gm.forward)


def _strides_as_given(gm: torch.fx.GraphModule, example_inputs) -> None:
    """[NOTE] Saved activations as the forward laid them out. Where the forward's compiler laid a
    saved activation out otherwise than traced (Inductor's layout optimization: a convolution's
    input and weight channels-last on the CPU), AOTAutograd hands the backward's compiler example
    inputs with the real strides but leaves the graph's placeholders as traced. apollo compiles
    each subgraph from the placeholders' example values, and Inductor's code asserts the strides it
    was compiled for: X-CLIP's backward raised at its first call where its forward had fallen back
    to Inductor. So a placeholder takes the given example's strides (static strides only: AOTAutograd
    restrides only under layout optimization, which Inductor turns off for dynamic shapes)."""
    for ph, given in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        val = ph.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(given, torch.Tensor)) or val is given:
            continue
        strides = (tuple(val.stride()), tuple(given.stride()))
        if all(isinstance(s, int) for s in strides[0] + strides[1]) and strides[0] != strides[1]:
            ph.meta["val"] = given


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
    whole_step: bool = False,
) -> Callable:
    """Stages ``graph``, ``runtime`` and ``cuda_graph`` for one ATen graph (AOTAutograd's fw,
    bw and inference compiler); if any fails, this graph alone falls back, from the graph as
    AOTAutograd handed it over. `whole_step`: a whole step's graph that can take the module path,
    told an out-of-memory error at its first call before it wrote anything (first_call.py)."""
    graph_name = f"{name}_{kind}"
    ctx = GraphContext(graph_name, kind, options, spec)
    memory = MemoryPolicy.from_options(options)  # what the memory settings change at run time, once
    forward = model_plan.graphs.get("forward")
    if kind == "backward" and forward is not None:
        ctx.forward_modalities = {n.name: info(n).modality for n in forward.gm.graph.nodes if n.op != "output"}
        ctx.forward_inputs = [info(n).modality for n in forward.gm.graph.nodes if n.op == "placeholder"]
        forward_lanes = forward.decisions.get("lanes")
        ctx.forward_main_lane = forward_lanes.lanes.get(0, []) if forward_lanes is not None else None
    _strides_as_given(gm, example_inputs)
    graph_plan = GraphPlan(graph_name, kind, spec.name, gm, ctx.decisions)
    if kind == "forward":
        graph_plan.checkpoint = model_plan.joint.get("checkpoint")
    model_plan.graphs[kind] = graph_plan
    watch = WriteWatch() if whole_step and kind == "inference" and not options.strict else None
    try:
        start = time.perf_counter()
        try:
            planned = graph_plan.gm = run_stage("graph", gm, ctx, GRAPH_PASSES)
        except PassError as e:
            graph_plan.gm = e.work if e.work is not None else gm  # the dump shows how far it got
            raise
        if kind == "inference":  # a whole step's recomputation, as a forward shows its joint graph's
            graph_plan.checkpoint = ctx.decisions.get("recompute")
        graph_plan.compile_s["passes"] = time.perf_counter() - start
        start = time.perf_counter()
        try:
            # quota candidates only pay off, and are only measured, as CUDA graphs
            quotas = quota_candidates(ctx) if family is not None else None
            runtimes = build_runtime(planned, ctx.decisions["lanes"], ctx.decisions["codegen"], graph_name, kind,
                                     options.subgraph_compiler, device, quotas,
                                     family.side_streams if family is not None else None, memory.free_at_last_use,
                                     watch)
        except Exception as e:  # name the stage, as PassError names the pass
            raise RuntimeError(f"building the runtime (compiling its subgraphs with {options.subgraph_compiler}) "
                               f"failed: {type(e).__name__}: {e}") from e
        graph_plan.runtimes = runtimes
        graph_plan.compile_s["subgraphs"] = time.perf_counter() - start  # Inductor's share, where it compiles
        if family is not None:
            fn = cudagraphed(planned, runtimes, graph_name, kind, family, ctx, has_symbolic_sizes(example_inputs),
                             memory)
            graph_plan.runner_ref = weakref.ref(fn)
        elif device.type == "cuda":  # un-graphed CUDA: extra streams only add launches
            fn = runtimes.get("one_lane", runtimes["lanes"])
        else:  # CPU: the lane program itself runs, sequentially, so CI exercises it
            fn = runtimes["lanes"]
        if not options.strict:  # what fails only when the runtime first runs falls back too

            def fell_back(why: str) -> None:
                graph_plan.fallback = f"at its first call: {why}"

            fn = FirstCallFallback(fn, gm, graph_name, fell_back, watch)
    except Exception as e:
        if options.strict:
            raise
        fallback = "Inductor" if options.subgraph_compiler == "inductor" else "eager ATen"
        graph_plan.fallback = f"{type(e).__name__}: {e}"
        warn_fallback(graph_name, fallback, e)
        fn = fallback_compile(gm, example_inputs, kind, options.subgraph_compiler, memory.free_at_last_use)
    finally:
        for directory in {options.dump_dir, logs.debug_dump_dir()} - {None}:
            graph_plan.write(directory)
    summary = graph_plan.summary()
    log.info("apollo: %s planned: %s", graph_name, summary)
    logs.emit_plan(graph_name, summary)
    return fn


def quota_candidates(ctx: GraphContext) -> dict[str, dict[int, int]]:
    """The SM-quota candidates the planner proposed (name -> side lane -> SMs), where this torch
    can make green contexts; without them, one warning and none."""
    cands = ctx.decisions["quotas"].candidates
    plain = min((c.predicted_us for c in cands if c.quotas is None), default=None)
    # only a split predicted to beat plain streams is captured and timed (perf/calibration.py says why)
    wanted = {c.name: c.quotas for c in cands
              if c.quotas and (plain is None or c.predicted_us < plain * (1 - MIN_GAIN))}
    if wanted:
        from torch.cuda import green_contexts

        if not green_contexts.SUPPORTED:
            warnings.warn(f"apollo: {ctx.name} is measured without its SM-quota candidates: this PyTorch "
                          "build has no green-context support", ApolloFallbackWarning, stacklevel=2)
            return {}
    return wanted


def cudagraphed(gm: torch.fx.GraphModule, runtimes: dict[str, Callable], graph_name: str, kind: str,
                family: GraphFamily, ctx: GraphContext, symbolic: bool, memory: MemoryPolicy) -> CudaGraphRunner:
    """Wrap a CUDA runtime for CUDA-graph replay: its :class:`RunnerConfig`, built here alone,
    tells it which inputs and outputs are whose, whether its sizes may change between calls
    (`symbolic`) and what the memory settings change (`memory`)."""
    static_idxs: set[int] = set()
    user_visible: set[int] | None = None  # None: every output is the user's (inference, backward)
    # a backward's inputs AOTAutograd lets it reuse: saved for the backward only, aliasing no
    # input or output; none if the first backward retained the graph (docs/design/cuda-graphs.md#donation)
    donated: set[int] = set()
    meta = fw_metadata()
    if meta is not None and kind != "backward":
        static_idxs = set(meta.static_input_indices or ())
    written: set[int] = set()
    if meta is not None and kind == "inference" and getattr(meta, "keep_input_mutations", False):
        # the graph writes its inputs itself (an optimizer inside the step): parameters and state in
        # place, anything else copied in and back (docs/design/cuda-graphs.md#a-graph-that-writes-its-inputs)
        written = {i for i, x in enumerate(meta.input_info) if x.mutates_data}
    elif meta is not None and kind == "inference":
        # a whole step's existing .grad (accumulating into it): copied in, not read in place, or
        # this graph would hold the tensors another step's graph lent and must reclaim
        static_idxs -= {i for i, x in enumerate(meta.input_info) if x.mutates_data}
    if meta is not None and kind == "forward" and hasattr(meta, "num_forward_returns"):
        user_visible = set(range(meta.num_forward_returns))
    saved: list[int] | None = None
    if kind == "backward":
        donated = set(getattr(meta, "bw_donated_idxs", None) or ()) if meta is not None else set()
        # its forward's saved outputs: every input but the gradients of the forward's outputs, which
        # AOTAutograd names tangents_N (by which instances.py finds a backward's model instance)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        saved = [i for i, name in enumerate(names) if not name.startswith("tangents")]
        saved = saved if len(saved) < len(names) else None
    # a whole step's gradients (and the .grad values it updates) are lent as a backward's are:
    # returned in the graph's memory, reclaimed before the next replay, never copied per step
    lent = {i for i, o in enumerate(graph_outputs(gm)) if isinstance(o, torch.fx.Node) and info(o).backward} \
        if kind == "inference" else set()
    if kind == "inference" and any(info(n).backward for n in gm.graph.nodes if n.op == "call_function"):
        # a whole step captures near the memory limit too: a failed capture completes its step
        # un-graphed, and with the backward (and the update) inside, no eager code allocates after a
        # capture that fits (docs/design/cuda-graphs.md#capture-headroom)
        memory = dataclasses.replace(memory, capture_headroom=None)
    config = RunnerConfig(graph_name, kind, static_input_idxs=static_idxs, user_visible_outputs=user_visible,
                          donated_idxs=donated, lent_outputs=lent, written_idxs=written, saved_idxs=saved,
                          symbolic=symbolic, predicted=predicted_plain(ctx), written_state=written_state(gm),
                          on_measured=functools.partial(calibrate, ctx), memory=memory)
    return CudaGraphRunner(runtimes, family, config)


def predicted_plain(ctx: GraphContext) -> str | None:
    """The plain candidate (lanes or one lane) the planner predicts fastest, by name (None without a
    quotas decision): what a graph replays where it cannot be timed. An SM quota is only replayed
    once measured (docs/design/cuda-graphs.md#a-graph-that-writes-its-inputs)."""
    plain = [c for c in getattr(ctx.decisions.get("quotas"), "candidates", ()) if c.quotas is None]
    return plain[0].name if plain else None  # best predicted first


def calibrate(ctx: GraphContext, measured_ms: dict[str, float]) -> None:
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


