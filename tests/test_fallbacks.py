"""Every fallback path: what apollo does when it meets something it cannot plan, and that training
stays correct (loss and every gradient equal to eager PyTorch) whichever path a graph takes.

(a) ops without a cost formula, (b) dynamic shapes, (c) a failure in a pass or in subgraph
compilation, (d) recompilation, (e) a failing pre-autograd (casts) pass, (f) the CUDA-graph
runner's degrade paths (decision logic only: capture itself needs a GPU).
"""

from __future__ import annotations

import copy
import logging
import sys
import warnings
import weakref

import pytest
import torch
from torch import nn

import apollo_compile
from apollo_compile import pipeline
from apollo_compile.fallback import REPORT_HINT, ApolloFallbackWarning
from apollo_compile.devices import DEVICE_SPECS
from apollo_compile.runtime.choice import Fixed
from apollo_compile.runtime.config import MemoryPolicy
from apollo_compile.runtime.instances import GraphFamily
from helpers import (TOLERANCE, FakeCapture, assert_same_loss_and_grads, assert_trains_like_eager, eager_subgraphs,
                     fake_cuda, inductor_entry, replace_pass, runner_for)
from models import MLP, Block, TwoTower, two_tower_inputs

EAGER = {"subgraph_compiler": "eager"}


def fallback_messages(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ApolloFallbackWarning)]


def train_like_eager(model, batches, options=None, lr=0.1, **compile_kwargs):
    """One SGD step per batch (batches may change shape): loss and every gradient match eager.
    Returns the ApolloFallbackWarning messages raised meanwhile."""
    options = dict(options or EAGER)
    tol = TOLERANCE[options.get("subgraph_compiler", "inductor")]
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="apollo", options=options, **compile_kwargs)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, inputs in enumerate(batches):
            loss, ref_loss = compiled(*inputs), ref(*inputs)
            loss.backward()
            ref_loss.backward()
            assert_same_loss_and_grads(loss, ref_loss, model, ref, tol, step)
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
    return fallback_messages(caught)


def two_tower_fallbacks(options, tol=None) -> list[str]:
    """Train TwoTower like eager (a few SGD steps, loss and every gradient compared) from a fixed
    seed; the ApolloFallbackWarning messages raised meanwhile."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_trains_like_eager(TwoTower(), lambda s: two_tower_inputs(seed=s), options, tol=tol)
    return fallback_messages(caught)


def assert_apollo_ran(plan):
    """The graphs of `plan` ran apollo's own runtime (no fallback)."""
    assert plan.forward is not None and plan.backward is not None, plan.name
    assert plan.forward.fallback is None and plan.backward.fallback is None, (plan.forward.fallback, plan.backward.fallback)
    assert plan.forward.runtimes and plan.backward.runtimes


def mlp_batches(*sizes):
    return [(torch.randn(b, 32, generator=torch.Generator().manual_seed(i)),) for i, b in enumerate(sizes)]


def two_tower_batches(*sizes):
    return [two_tower_inputs(batch=b, seed=i) for i, b in enumerate(sizes)]


# ------------------------------------------------------------------------ (a) ops without a cost formula

@torch.library.custom_op("apollo_fallback_tests::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


@torch.library.custom_op("apollo_fallback_tests::scaled_tanh_backward", mutates_args=())
def scaled_tanh_backward(grad: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return grad * (scale - y * y / scale)


@scaled_tanh_backward.register_fake
def _(grad, y, scale):
    return torch.empty_like(grad)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return scaled_tanh_backward(grad, y, ctx.scale), None


scaled_tanh.register_autograd(_backward, setup_context=_setup_context)


class TwoBranchCustom(nn.Module):
    """Two independent branches, each through the custom op (forward) and its custom backward,
    and an exotic ATen op (logcumsumexp) that neither flop_registry nor apollo has a formula for."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.left = nn.Linear(width, width)
        self.right = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = scaled_tanh(self.left(x), 1.5)
        b = torch.logcumsumexp(scaled_tanh(self.right(y), 0.5), dim=-1)
        return (a * b).mean()


def custom_batches(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_op_without_cost_formula_compiles_and_trains(compiler):
    torch.manual_seed(0)
    options = {"subgraph_compiler": compiler, "device": "H200"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_trains_like_eager(TwoBranchCustom(), custom_batches, options)
    assert fallback_messages(caught) == []
    plan = apollo_compile.last_plan()
    assert_apollo_ran(plan)
    spec = DEVICE_SPECS["H200"]
    seen = set()
    for graph in (plan.forward, plan.backward):
        for node in graph.gm.graph.nodes:
            name = getattr(node.target, "__name__", "")
            if not name.startswith(("scaled_tanh", "logcumsumexp")):
                continue
            seen.add(name.split(".")[0])
            ann = node.meta["apollo"]
            vals = [n.meta["val"] for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
            out = node.meta["val"]
            # the generic rule: one FLOP per element touched, bytes = every tensor read + written,
            # and the roofline time is the bytes' (memory-bound) time plus one launch
            assert ann.flops == max([out.numel()] + [v.numel() for v in vals]), node
            assert ann.bytes == sum(v.nbytes for v in vals) + out.nbytes, node
            assert ann.bound == "memory", node
            assert ann.est_us == pytest.approx(ann.bytes / spec.bandwidth * 1e6 + spec.launch_us), node
            assert ann.subgraph is not None, node
    # the forward has both custom ops' forward; the backward the custom backward and logcumsumexp's
    assert {"scaled_tanh", "scaled_tanh_backward", "logcumsumexp"} <= seen, seen


def test_a_raising_flop_formula_falls_back_to_the_generic_rule(monkeypatch):
    """flop_registry formulas that raise (a new op overload, an odd signature) cost the generic
    rule instead; the cost pass itself never raises."""
    from apollo_compile.passes import cost

    def raising(*args, **kwargs):
        raise TypeError("synthetic: formula does not understand these arguments")

    monkeypatch.setattr(cost, "flop_registry", {k: raising for k in cost.flop_registry})
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_trains_like_eager(MLP(), lambda s: mlp_batches(8)[0], EAGER, steps=2)
    assert fallback_messages(caught) == []
    plan = apollo_compile.last_plan()
    assert_apollo_ran(plan)
    mms = [n for n in plan.forward.gm.graph.nodes if getattr(n.target, "__name__", "").startswith("addmm")]
    assert mms
    for n in mms:  # generic: max(out numel, largest input numel), not 2*M*N*K
        vals = [a.meta["val"] for a in n.all_input_nodes]
        assert n.meta["apollo"].flops == max([n.meta["val"].numel()] + [v.numel() for v in vals])


# ------------------------------------------------------------------------ (b) dynamic shapes

def test_dynamic_true_two_tower_trains_across_batch_sizes():
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    messages = train_like_eager(TwoTower(), two_tower_batches(4, 6, 5), dynamic=True)
    # With dynamic=True, scaled_dot_product_attention's scale 1/sqrt(head_dim) is a symbolic float:
    # AOTAutograd asks Dynamo to restart with it as a tensor (TensorifyScalarRestartAnalysis), which
    # apollo lets through instead of treating as a failure; the retrace is planned as usual.
    assert messages == [], messages
    assert_apollo_ran(apollo_compile.last_plan())


def test_dynamic_true_with_a_budget_compiles_again_from_inductors_cache():
    """dynamic=True with a memory_budget, compiled twice: the second compile finds the first's
    subgraphs in Inductor's FX graph cache, whose guards name sources of the whole graph
    (L['images']) that a subgraph lacks; looking them up raised KeyError and the backward fell
    back. Subgraphs with symbolic sizes now skip that cache (subgraphs.inductor_config). One layer
    a tower: any subgraph with symbolic sizes meets the cache."""
    for attempt in range(2):
        torch._dynamo.reset()
        torch.manual_seed(0)
        apollo_compile.clear_plans()
        messages = train_like_eager(TwoTower(width=16, embed=8, layers=1), two_tower_batches(4, 6),
                                    {"memory_budget": 0.5}, dynamic=True)
        assert messages == [], (attempt, messages)
        assert_apollo_ran(apollo_compile.last_plan())


def test_dynamic_true_runs_apollo_when_no_symbolic_float_appears():
    """With no float computed from a size (no attention scale), dynamic=True plans one graph
    with a symbolic batch and apollo's runtime runs it for every batch size."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    assert train_like_eager(MLP(), mlp_batches(4, 6, 5, 4), dynamic=True) == []
    assert len(apollo_compile.plans()) == 1  # one compile for every size
    plan = apollo_compile.last_plan()
    assert_apollo_ran(plan)
    sizes = [n.meta["val"].shape[0] for n in plan.forward.gm.graph.nodes
             if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 2
             and n.meta["val"].shape[1] == 32]
    assert any(isinstance(s, torch.SymInt) for s in sizes), sizes


class BlockLoss(Block):
    """A Block trained on its own. One input, one tower: BLOCK_MODALITIES names its submodules
    (ln1, qkv, proj, ...) as modalities, so that its backward is cut into several subgraphs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).square().mean()


BLOCK_MODALITIES = {name: name for name in ("ln1", "qkv", "proj", "ln2", "fc1", "fc2")}


@pytest.mark.parametrize("dynamic", [None, True])
def test_subgraphs_bind_the_symbols_of_a_symbolic_head_count(dynamic):
    """Blocks of two widths share Block's code: Dynamo compiles the second as a recompile of the
    first and, by automatic dynamic shapes, makes `heads` symbolic (s40). A backward subgraph took a
    tensor of size s40*((24//s40)) and nothing that is s40 itself, and Inductor failed on it ("For
    s40*((24//s40)), expected [s40] to have been codegen-ed"; FSDP2 on a GPU, whose modules' int
    attributes Dynamo leaves unspecialized, as allow_unspec_int_on_nn_module does here). Such a
    subgraph now also takes the SymInt placeholder (lanes.bind_symbols)."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
        for width, heads in [(32, 4), (24, 3)]:
            batches = [(torch.randn(2, 5, width, generator=torch.Generator().manual_seed(i)),) for i in range(3)]
            messages = train_like_eager(BlockLoss(width, heads), batches,
                                        {"subgraph_compiler": "inductor", "modalities": BLOCK_MODALITIES},
                                        dynamic=dynamic)
            assert messages == [], (width, heads, messages)
            assert_apollo_ran(apollo_compile.last_plan())
    # the case it guards: a subgraph with an input none of its nodes reads, a symbol's binder
    subgraphs = apollo_compile.last_plan().backward.lanes.subgraphs
    assert len(subgraphs) > 1
    binders = [a for sg in subgraphs for a in sg.inputs if all(a not in n.all_input_nodes for n in sg.nodes)]
    assert binders and all(isinstance(a.meta["val"], torch.SymInt) for a in binders), binders


def test_a_symint_input_binds_the_symbol_it_was_passed_as_not_its_replacement():
    """benchmarks/clip.py's model (one layer a tower: the loss is what matters) at a second batch
    size (automatic dynamic shapes, Inductor's subgraphs): Dynamo passes the batch size as a SymInt s52 that the shape environment knows to
    equal s34, and a subgraph holding only the loss's arange(s34) took that SymInt alone. Inductor
    binds a forward's SymInt input by its placeholder expression (s52), not by the replaced one, so
    its code read an unbound s34: NameError at the graph's first call, and the forward fell back to
    eager ATen (smoke_gpu.py's "batch varies" mode). Such a SymInt binds
    nothing for certain, and the subgraph takes a binder of s34 too (lanes.plain_symbols)."""
    import clip  # benchmarks/clip.py

    config = clip.CLIPConfig(image_size=16, patch_size=8, vision_width=32, vision_layers=1, vision_heads=2,
                             context_length=8, vocab_size=64, text_width=32, text_layers=1, text_heads=2,
                             embed_dim=16)
    apollo_compile.clear_plans()
    batches = [clip.make_batch(b, "cpu", config, seed=b) for b in (4, 3, 3)]
    messages = train_like_eager(clip.build(config, device="cpu", seed=0), batches, {"subgraph_compiler": "inductor"})
    assert messages == [], messages
    assert_apollo_ran(apollo_compile.last_plan())


# ------------------------------------------------------------------------ (c) failures in a pass / in subgraph compilation

def _broken_pass(message, kinds=("forward", "backward", "inference")):
    def broken(gm, ctx):
        if ctx.kind in kinds:
            raise RuntimeError(message)
        return orig(gm, ctx)

    orig = dict(pipeline.GRAPH_PASSES)["codegen"]
    return broken


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_codegen_failure_falls_back_once_per_graph(monkeypatch, compiler):
    """Each graph goes whole to its fallback: Inductor (asked once per graph, read at its entry:
    helpers.inductor_entry) or eager ATen."""
    handed: list[bool] = []
    inductor_entry(monkeypatch, lambda gm, inputs, kwargs: handed.append(kwargs.get("is_backward")))
    replace_pass(monkeypatch, "codegen", _broken_pass("synthetic codegen failure"))
    messages = two_tower_fallbacks({"subgraph_compiler": compiler})
    assert len(messages) == 2, messages  # forward and backward, once each, not once per step
    path = "Inductor" if compiler == "inductor" else "eager ATen"
    for kind, m in zip(("forward", "backward"), messages):
        assert f"_{kind} runs on {path}" in m, m
        assert "pass 'codegen'" in m and "synthetic codegen failure" in m and REPORT_HINT in m, m
    assert handed == ([False, True] if compiler == "inductor" else [])
    plan = apollo_compile.last_plan()
    assert "codegen" in plan.forward.fallback and "codegen" in plan.backward.fallback


def test_failure_in_the_backward_only_falls_back_for_that_graph(monkeypatch):
    replace_pass(monkeypatch, "codegen", _broken_pass("synthetic backward failure", kinds=("backward",)))
    messages = two_tower_fallbacks(EAGER)
    assert len(messages) == 1 and "_backward runs on eager ATen" in messages[0], messages
    plan = apollo_compile.last_plan()
    assert plan.forward.fallback is None and plan.forward.runtimes
    assert plan.backward.fallback and not plan.backward.runtimes


class ConvStem(nn.Module):
    """Convolutions on 4-D activations: Inductor's layout optimization lays the saved inputs of a
    convolution out channels-last on the CPU, as X-CLIP's patch embedding's were."""

    def __init__(self):
        super().__init__()
        self.convs = nn.Sequential(*(nn.Conv2d(8, 8, 3, padding=1) for _ in range(4)))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.convs(x).mean(dim=(2, 3))).square().mean()


def test_a_backward_after_an_inductor_forward_takes_the_saved_activations_strides(monkeypatch):
    """The forward falls back to Inductor, which lays its saved activations out channels-last; the
    backward runs apollo's runtime on them (pipeline.py, NOTE: Saved activations as the forward
    laid them out): its subgraphs were compiled for the traced strides and Inductor's code
    asserted them at the first call."""
    replace_pass(monkeypatch, "codegen", _broken_pass("synthetic forward failure", kinds=("forward",)))
    torch.manual_seed(0)
    batches = [(torch.randn(2, 8, 8, 8),) for _ in range(2)]
    messages = train_like_eager(ConvStem(), batches, {"subgraph_compiler": "inductor"})
    assert len(messages) == 1 and "_forward runs on Inductor" in messages[0], messages
    plan = apollo_compile.last_plan()
    assert plan.backward.fallback is None and plan.backward.runtimes
    saved = [n.meta["val"] for n in plan.backward.gm.graph.find_nodes(op="placeholder")
             if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 4]
    assert any(v.is_contiguous(memory_format=torch.channels_last) and not v.is_contiguous() for v in saved), \
        [v.stride() for v in saved]  # what the test is about: Inductor did lay them out otherwise


def _raising_at_first_call(run, message: str, free_inputs: bool = False):
    """`run` (a boxed runtime) raising at its first call as the generated program would: the inputs
    unpacked into its frame and the caller's list cleared first; with `free_inputs`, dropped too."""
    calls = [0]

    def runtime(args):
        calls[0] += 1
        if calls[0] > 1:
            return run(args)
        held = list(args)
        args.clear()
        if free_inputs:
            held.clear()
        raise UnboundLocalError(message)

    return runtime


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_a_runtime_that_raises_at_its_first_call_runs_its_graph_as_eager_aten(monkeypatch, kind):
    """runtime/first_call.py: an error that shows only when apollo's runtime first runs (HF LLaVA's
    unbound lifted constant) does not stop training: that call runs again as eager
    ATen, with every input still alive, and so does every later call of that graph, with one
    warning; the other graph keeps apollo's runtime."""
    original = pipeline.build_runtime

    def build_runtime(planned, lanes, codegen, graph_name, kind_, *args, **kwargs):
        runtimes = original(planned, lanes, codegen, graph_name, kind_, *args, **kwargs)
        if kind_ == kind:
            runtimes = {k: _raising_at_first_call(fn, "synthetic unbound value") for k, fn in runtimes.items()}
        return runtimes

    monkeypatch.setattr(pipeline, "build_runtime", build_runtime)
    messages = two_tower_fallbacks(EAGER)
    assert len(messages) == 1, messages
    assert f"_{kind} runs on eager ATen" in messages[0] and "first call" in messages[0], messages
    assert "UnboundLocalError: synthetic unbound value" in messages[0] and REPORT_HINT in messages[0]
    plan = apollo_compile.last_plan()
    graph, other = (plan.forward, plan.backward) if kind == "forward" else (plan.backward, plan.forward)
    assert graph.fallback.startswith("at its first call") and other.fallback is None


def test_a_first_call_error_that_cannot_run_again_is_raised_with_a_note():
    """Where the failed run freed an input, or the graph writes one of its inputs (a partial run may
    have written it already), the error is raised as it was, with a note saying why apollo did not
    run the call again."""
    from apollo_compile.runtime.first_call import FirstCallFallback, writes_an_input

    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    guarded = FirstCallFallback(_raising_at_first_call(None, "freed", free_inputs=True), gm, "g_backward")
    with pytest.raises(UnboundLocalError, match="freed") as raised:
        guarded([torch.randn(3)])  # the list is the input's only holder, as AOTAutograd's backward list is
    assert "1 of its inputs were already freed" in "".join(getattr(raised.value, "__notes__", [""]))

    def writes(x, y):
        torch.ops.aten.copy_.default(torch.ops.aten.view.default(x, [-1]), y)
        return (y * 2,)

    written = torch.fx.symbolic_trace(writes)
    assert writes_an_input(written) and not writes_an_input(gm)
    x, y = torch.zeros(3), torch.ones(3)
    guarded = FirstCallFallback(_raising_at_first_call(None, "written"), written, "g_inference")
    with pytest.raises(UnboundLocalError, match="written") as raised:
        guarded([x, y])
    assert "writes one of its inputs" in "".join(getattr(raised.value, "__notes__", [""]))
    guarded = FirstCallFallback(_raising_at_first_call(None, "kept"), gm, "g_forward")
    with pytest.warns(ApolloFallbackWarning, match="first call"):
        out = guarded([y])  # y lives in this frame: the call runs again, as eager ATen
    torch.testing.assert_close(out, y * 2)
    torch.testing.assert_close(guarded([y]), y * 2)  # and so does every later call


def test_a_failed_stage_leaves_its_graph_as_it_was_handed_over(monkeypatch):
    """The one undo rule: the graph stage's passes run on a working copy, so a pass that rewrote
    the graph and then failed leaves nothing behind. The fallback compiles the graph AOTAutograd
    handed over (no node of the half-rewritten copy, no apollo annotation), and training equals
    eager; the plan's dump shows the copy as far as it got."""
    def rewrite_then_fail(gm, ctx):
        for n in list(gm.graph.nodes):
            if n.op == "call_function":
                with gm.graph.inserting_after(n):  # a node the original lacks
                    gm.graph.create_node("call_function", torch.ops.aten.clone.default, (n,), name="inserted_here")
                break
        raise RuntimeError("synthetic failure after a rewrite")

    handed_to_fallback = []
    original = pipeline.fallback_compile

    def spy(gm, *args, **kwargs):
        handed_to_fallback.append([(n.name, "apollo" in n.meta) for n in gm.graph.nodes])
        return original(gm, *args, **kwargs)

    monkeypatch.setattr(pipeline, "fallback_compile", spy)
    monkeypatch.setattr(pipeline, "GRAPH_PASSES", [("modality", dict(pipeline.GRAPH_PASSES)["modality"]),
                                                   ("rewrite", rewrite_then_fail)])
    messages = two_tower_fallbacks(EAGER)
    assert len(messages) == 2 and all("synthetic failure after a rewrite" in m for m in messages), messages
    assert len(handed_to_fallback) == 2  # forward and backward
    for nodes in handed_to_fallback:
        assert "inserted_here" not in {name for name, _ in nodes}
        assert not any(annotated for _, annotated in nodes)  # the modality pass ran on the copy only
    plan = apollo_compile.last_plan()
    assert "inserted_here" in {n.name for n in plan.forward.gm.graph.nodes}  # the dump: how far it got


def test_every_stage_dumps_its_graph_before_and_after_under_torch_compile_debug(monkeypatch, tmp_path):
    """TORCH_COMPILE_DEBUG=1: each stage that rewrites a graph writes its listing before and after."""
    from apollo_compile.report import logs

    monkeypatch.setattr(logs, "debug_dump_dir", lambda: str(tmp_path))
    assert_trains_like_eager(MLP(), lambda step: (torch.randn(4, 32),), EAGER, steps=1)
    names = {p.name for p in tmp_path.iterdir()}
    for graph, stage in (("frame0_0_dynamo", "pre_grad"), ("frame0_0_joint", "joint"),
                         ("frame0_0_forward", "graph"), ("frame0_0_backward", "graph")):
        for when in ("before", "after"):
            assert f"{graph}.{stage}.{when}.txt" in names, sorted(names)


def _break_subgraph_compilation(monkeypatch):
    # build_runtime calls the name runner.py imported (`from .subgraphs import compile_subgraph`),
    # so patching apollo_compile.runtime.subgraphs.compile_subgraph would not reach it.
    from apollo_compile.runtime import runner

    def broken(sub, inputs, compiler, kind, free_at_last_use=False):
        raise RuntimeError("synthetic compiler failure")

    monkeypatch.setattr(runner, "compile_subgraph", broken)


def test_subgraph_compilation_failure_falls_back_once_per_graph(monkeypatch):
    _break_subgraph_compilation(monkeypatch)
    messages = two_tower_fallbacks(EAGER)
    assert len(messages) == 2, messages
    for kind, m in zip(("forward", "backward"), messages):
        assert f"_{kind} runs on eager ATen" in m and "synthetic compiler failure" in m, m
        assert REPORT_HINT in m, m
    plan = apollo_compile.last_plan()
    assert plan.forward.fallback and plan.backward.fallback
    assert plan.forward.lanes is not None  # every pass ran; only building the runtime failed


def test_subgraph_compilation_failure_warning_names_the_stage(monkeypatch):
    _break_subgraph_compilation(monkeypatch)
    compiled = torch.compile(MLP(), backend="apollo", options=EAGER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(4, 32)).backward()
    messages = fallback_messages(caught)
    assert messages and all("subgraph" in m for m in messages), messages


@pytest.mark.parametrize("where", ["codegen", "subgraph"])
def test_strict_raises_for_codegen_and_subgraph_failures(monkeypatch, where):
    if where == "codegen":
        replace_pass(monkeypatch, "codegen", _broken_pass("synthetic codegen failure"))
        expected = "synthetic codegen failure"
    else:
        _break_subgraph_compilation(monkeypatch)
        expected = "synthetic compiler failure"
    compiled = torch.compile(MLP(), backend="apollo", options={**EAGER, "strict": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Exception, match=expected):
            compiled(torch.randn(4, 32))
    assert fallback_messages(caught) == []


def test_inductor_failing_too_runs_eager_aten(monkeypatch, caplog):
    """A graph apollo cannot plan goes to Inductor; when Inductor fails as well, eager ATen."""
    import torch._inductor.compile_fx as compile_fx

    replace_pass(monkeypatch, "codegen", _broken_pass("synthetic codegen failure"))

    def no_inductor(*args, **kwargs):
        raise RuntimeError("synthetic: Inductor unavailable")

    monkeypatch.setattr(compile_fx, "compile_fx_inner", no_inductor)
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="apollo_compile"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_trains_like_eager(MLP(), lambda s: mlp_batches(8)[0], {"subgraph_compiler": "inductor"}, steps=2)
    assert len(fallback_messages(caught)) == 2
    assert sum("Inductor fallback failed too" in r.getMessage() for r in caplog.records) == 2


def test_dynamo_graph_aotautograd_cannot_handle_runs_eager_pytorch(monkeypatch):
    """A failure outside the per-graph passes (here: the partitioner) drops the whole Dynamo graph
    to eager PyTorch (subgraph_compiler="eager") with one warning naming that graph."""

    def broken_partition(*args, **kwargs):
        raise RuntimeError("synthetic partitioner failure")

    monkeypatch.setattr(pipeline, "min_cut_rematerialization_partition", broken_partition)
    messages = two_tower_fallbacks(EAGER)
    assert len(messages) == 1, messages
    assert "eager PyTorch" in messages[0] and "synthetic partitioner failure" in messages[0]
    assert REPORT_HINT in messages[0]


# ------------------------------------------------------------------------ (d) recompilation

@pytest.mark.parametrize("dynamic", [False, None])
def test_recompiles_on_new_shapes_and_trains(dynamic):
    """dynamic=False: one graph per batch size; None (the default): the second size recompiles
    with a symbolic batch (automatic dynamic), which serves every later size. apollo plans each."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    assert train_like_eager(TwoTower(), two_tower_batches(4, 6, 4, 5), dynamic=dynamic) == []
    plans = apollo_compile.plans()
    assert len(plans) == (3 if dynamic is False else 2), [p.name for p in plans]
    assert len({p.name for p in plans}) == len(plans)
    for plan in plans:
        assert_apollo_ran(plan)
        assert len(plan.forward.lanes.lanes) == 2


def test_dynamo_reset_between_two_compiles():
    torch.manual_seed(0)
    model = TwoTower()
    apollo_compile.clear_plans()
    assert train_like_eager(model, two_tower_batches(4, 4)) == []
    first = apollo_compile.last_plan()
    torch._dynamo.reset()
    # same module, compiled again from scratch after the reset, now with parameters SGD moved
    assert train_like_eager(model, two_tower_batches(4, 6)) == []
    plans = apollo_compile.plans()
    assert len(plans) == 3 and plans[0] is first  # a fresh compile, then a recompile for batch 6
    for plan in plans:
        assert_apollo_ran(plan)


# ------------------------------------------------------------------------ (e) the pre-autograd (casts) pass

def test_casts_failure_falls_back_to_the_uncast_graph(monkeypatch):
    """The cast pass fails after it has inserted its casts into the graph (before it syncs the
    metadata): the Dynamo graph is compiled without them, fp32, with one warning."""
    from apollo_compile.passes import casts

    def broken(self):
        assert any(n.op == "call_method" and n.target == "to" for n in self.graph.nodes)  # half-applied
        raise RuntimeError("synthetic cast failure")

    monkeypatch.setattr(casts._Rewriter, "sync_meta", broken)
    options = {**EAGER, "precision": "bf16"}
    # fp32 eager's own tolerance: a graph still (half-)cast to bf16 would miss it by ~1e-3
    messages = two_tower_fallbacks(options, tol=TOLERANCE["eager"])
    assert len(messages) == 1, messages
    assert "_dynamo runs on the graph without apollo's pre-autograd passes" in messages[0]
    assert "pass 'casts'" in messages[0] and "synthetic cast failure" in messages[0] and REPORT_HINT in messages[0]
    plan = apollo_compile.last_plan()
    assert "casts" not in plan.pre_grad
    assert_apollo_ran(plan)  # only the pre-autograd pass fell back; the graphs run apollo's runtime
    for graph in (plan.forward, plan.backward):
        dtypes = {n.meta["val"].dtype for n in graph.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
        assert torch.bfloat16 not in dtypes, graph.name


def test_casts_failure_with_strict_raises(monkeypatch):
    from apollo_compile.passes import casts

    def broken(self):
        raise RuntimeError("synthetic cast failure")

    monkeypatch.setattr(casts._Rewriter, "sync_meta", broken)
    compiled = torch.compile(TwoTower(), backend="apollo", options={**EAGER, "precision": "bf16", "strict": True})
    with pytest.raises(Exception, match="synthetic cast failure"):
        compiled(*two_tower_inputs())


# ------------------------------------------------------------------------ (f) the CUDA-graph runner's decisions

class FakeRuntimes:
    """Two candidate runtimes that return which one ran; boxed like the real ones. `one_lane`, if
    given, runs in place of the un-graphed candidate's body."""

    def __init__(self, one_lane=None):
        self.calls = {"lanes": 0, "one_lane": 0}
        self.one_lane = one_lane

    def candidates(self):
        def make(name):
            def run(args):
                self.calls[name] += 1
                if name == "one_lane" and self.one_lane is not None:
                    self.one_lane(args)
                out = [args[0] * 2, name]
                args.clear()
                return out
            return run
        return {"lanes": make("lanes"), "one_lane": make("one_lane")}


def _runner(kind="forward", family=None, capturer=None, one_lane=None, **config):
    """A runner of FakeRuntimes that replays "lanes" when captured by `capturer` (a FakeCapture
    that fails its captures unless told otherwise)."""
    fake = FakeRuntimes(one_lane)
    capturer = capturer if capturer is not None else FakeCapture(fail="", error=RuntimeError)
    runner = runner_for(fake.candidates(), f"frame0_0_{kind}", kind, family, strategy=Fixed("lanes"),
                        capturer=capturer, **config)
    return runner, fake


def _graph_warnings(caught):
    return [str(w.message) for w in caught if "runs without its CUDA graph" in str(w.message)]


def test_cudagraph_capture_failure_runs_the_runtime_and_warns_once(monkeypatch):
    # The real capture needs a GPU; the CUDA calls around it (torch.cuda.synchronize, which a CPU
    # build of torch refuses: "Torch not compiled with CUDA enabled") are no-ops here.
    fake_cuda(monkeypatch)
    capturer = FakeCapture(fail="", error=RuntimeError)
    runner, fake = _runner(capturer=capturer)
    x = torch.arange(3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [runner([x]) for _ in range(3)]
    for out in outs:  # call 1: eager warm-up; call 2: capture fails -> eager; call 3: disabled -> eager
        torch.testing.assert_close(out[0], x * 2)
        assert out[1] == "one_lane"  # un-graphed, the single-stream candidate runs
    assert fake.calls == {"lanes": 0, "one_lane": 3}
    assert len(capturer.captured) == 1  # capture tried once, on call 2, never again
    messages = _graph_warnings(caught)
    assert len(messages) == 1 and "synthetic: out of memory capturing" in messages[0], messages
    assert runner.disabled and runner.summary()["disabled"] == runner.disabled and runner.replays == 0
    assert fallback_messages(caught) == messages  # filterable as ApolloFallbackWarning


@pytest.mark.parametrize("peak_gib, captured", [(17.55, False), (15.71, False), (14.8, True)])
def test_a_family_near_the_memory_limit_stays_ungraphed_with_one_warning_per_graph(monkeypatch, peak_gib, captured):
    """docs/design/cuda-graphs.md#capture-headroom: steps whose first step peaked at 88% and 79% of
    the limit lost their second step capturing; at 74% both graphs captured. The forward decides
    for its family and the backward follows; both stay correct, running what the first step ran."""
    from apollo_compile.runtime import cudagraph

    fake_cuda(monkeypatch)
    monkeypatch.setattr(cudagraph, "memory_pressure", lambda: (int(peak_gib * 2**30), 20 * 2**30))
    family = GraphFamily()
    capturer = FakeCapture()
    (forward, fake_fw), (backward, fake_bw) = (_runner(kind, family, capturer) for kind in ("forward", "backward"))
    x = torch.arange(3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [(forward([x]), backward([x])) for _ in range(3)]
    messages = _graph_warnings(caught)
    captures = [name.split("_")[-1].split(" ")[0] for name in capturer.captured]
    if captured:
        assert captures == ["forward", "backward"] and not messages and family.capture_refused is None
        assert (outs[2][0][1], outs[2][1][1]) == ("lanes", "lanes")  # replayed
    else:
        assert captures == [] and fake_fw.calls["one_lane"] == 3 and fake_bw.calls["one_lane"] == 3
        share = f"{peak_gib / 20:.0%} of the 20.00 GiB"
        assert len(messages) == 2 and all(share in m and "cudagraphs=True" in m for m in messages)
        assert forward.summary()["capture_refused"] == backward.summary()["capture_refused"] == family.capture_refused
        assert forward.ungraphed_calls == backward.ungraphed_calls == 2


def test_cudagraphs_true_captures_near_the_memory_limit(monkeypatch):
    from apollo_compile.runtime import cudagraph, graph_pool

    monkeypatch.setattr(cudagraph, "memory_pressure", lambda: (19 * 2**30, 20 * 2**30))
    runner, _ = _runner(memory=MemoryPolicy(capture_headroom=None))
    assert runner.capture_refusal() is None
    assert graph_pool.too_close_to_the_limit(19 * 2**30, 20 * 2**30) is not None
    assert graph_pool.too_close_to_the_limit(15 * 2**30, 20 * 2**30) is None  # 75% exactly: captured
    assert graph_pool.too_close_to_the_limit(int(15.71 * 2**30), 20 * 2**30) is not None  # 79%: ran out
    assert graph_pool.too_close_to_the_limit(5, 0) is None  # an unknown limit refuses nothing


def test_cudagraph_capture_failure_frees_what_the_failed_capture_held_before_the_fallback(monkeypatch):
    """The un-graphed run after a failed capture must not run while the exception (and through its
    traceback, every temporary the failed capture allocated) is still alive: at the edge of memory
    that fallback needs those bytes."""
    import gc

    fake_cuda(monkeypatch)
    held = []

    class RunsOut(FakeCapture):
        def capture(self, fn, inputs, pool, name, written_state=()):
            temporary = torch.empty(1 << 10)  # what a capture's runtime had allocated when it ran out
            held.append(weakref.ref(temporary))
            raise torch.OutOfMemoryError("synthetic: out of memory during capture")

    seen = []

    def fallback(args):
        gc.collect()
        seen.append((sys.exc_info()[0], held[0]() if held else None))

    runner, fake = _runner(capturer=RunsOut(), one_lane=fallback)
    x = torch.arange(3.0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        runner([x])  # call 1: eager warm-up
        out = runner([x])  # call 2: capture fails -> eager
    torch.testing.assert_close(out[0], x * 2)
    assert seen[-1] == (None, None), seen  # no exception in flight, the temporary already freed


def test_a_failed_capture_releases_what_it_held_before_the_ungraphed_retry(monkeypatch):
    """docs/design/cuda-graphs.md#a-failed-capture: after a capture that ran out midway, the pool
    no graph uses is given up and the allocator's cached segments are released, and only then
    does that step run un-graphed, on the caller's inputs (the capture consumed only its copy)."""
    from apollo_compile.runtime import cudagraph

    fake_cuda(monkeypatch)
    events = []
    monkeypatch.setattr(cudagraph, "release_cached_segments", lambda: events.append("released"))
    runner, fake = _runner(capturer=FakeCapture(fail=""), one_lane=lambda args: events.append(len(args)))
    x = torch.arange(3.0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        runner([x])  # call 1: eager warm-up
        events.clear()
        out = runner([x])  # call 2: the capture fails midway
    assert events == ["released", "released", 1]  # before the family's first capture, after the failure; then x
    assert runner.family.pool is None and runner.captured is None
    torch.testing.assert_close(out[0], x * 2)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_an_out_of_memory_after_a_failed_capture_says_why_and_what_to_do(monkeypatch):
    """A backward's capture ran out, then the un-graphed fallback did too (it cannot use the pool's
    free memory): the user's OutOfMemoryError, still of that type, says so and names
    cudagraphs=False. An OOM with no failed capture behind it is left as PyTorch raised it."""
    fake_cuda(monkeypatch)

    def out_of_memory(args):
        raise torch.OutOfMemoryError("synthetic: out of memory in the fallback")

    runner, fake = _runner(capturer=FakeCapture(fail=""), one_lane=out_of_memory)
    x = torch.arange(3.0)
    with pytest.raises(torch.OutOfMemoryError) as first:
        runner([x])  # call 1: un-graphed warm-up, no capture tried yet
    assert not getattr(first.value, "__notes__", None)
    with warnings.catch_warnings(record=True), pytest.raises(torch.OutOfMemoryError) as caught:
        warnings.simplefilter("always")
        runner([x])  # call 2: the capture fails, then the fallback
    note = " ".join(caught.value.__notes__)
    assert "capture failed" in note and "cudagraphs=False" in note and "synthetic: out of memory capturing" in note


def test_a_failed_backward_capture_makes_the_forward_let_its_graph_go(monkeypatch):
    """docs/design/cuda-graphs.md#a-failed-capture. Un-graphed, a backward cannot use the pool its
    forward's graph keeps, so after its capture fails the forward drops its graph and the memory it
    owns there, at its first call once the last forward's saved activations are dead (not while
    they are: the pending backward may still read them), and the family runs as its first step did."""
    from apollo_compile.runtime import instances

    fake_cuda(monkeypatch)
    monkeypatch.setattr(instances, "MAX_FAMILIES", 1)  # step 3 runs here, not in a second family
    family = GraphFamily()
    saved = torch.zeros(4)

    class OwnsForwardFailsBackward(FakeCapture):
        def capture(self, fn, inputs, pool, name, written_state=()):
            out = super().capture(fn, inputs, pool, name, written_state)
            family.owners[saved.data_ptr()] = saved.untyped_storage()  # the forward's output in the pool
            return out

    capturer = OwnsForwardFailsBackward(fail="backward")
    # output 0 is a saved activation (not the user's): a replay hands it out as the tracked alias
    (forward, fake_fw), (backward, fake_bw) = (_runner(kind, family, capturer, user_visible_outputs={1})
                                               for kind in ("forward", "backward"))
    x = torch.arange(3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forward([x]), backward([x])  # step 1: un-graphed
        alias = forward([x])  # step 2: the forward captured and replayed ...
        assert alias[1] == "lanes"
        backward([x])  # ... its backward's capture fails: un-graphed
        assert family.backward_capture_failed and "out of memory" in family.backward_capture_failed
        forward([x])  # step 3 while step 2's saved activations live: un-graphed, graph kept
        assert forward.captured is not None and family.owners
        del alias
        forward([x])  # step 4: they are dead, so the forward lets go
    assert forward.captured is None and not family.owners
    assert "its backward's CUDA-graph capture failed" in forward.summary()["disabled"]
    assert fake_fw.calls["one_lane"] == 3 and fake_bw.calls["one_lane"] == 2  # steps 1, 3, 4; 1, 2
    messages = _graph_warnings(caught)
    assert any(m.startswith("apollo: frame0_0_forward") and "backward's CUDA-graph capture failed" in m
               for m in messages), messages


def test_cudagraph_pending_forward_runs_eager_and_warns_once(monkeypatch):
    """More forwards of one model instance before their backwards than get a family each
    (runtime/instances.py; 1 here): while the last forward's saved activations are alive the
    forward runs without its graph (capture is not even tried); once they die, capture is tried."""
    from apollo_compile.runtime import instances

    monkeypatch.setattr(instances, "MAX_PER_INSTANCE", 1)
    fake_cuda(monkeypatch)
    family = GraphFamily()
    capturer = FakeCapture(fail="", error=RuntimeError)
    runner, fake = _runner("forward", family, capturer, static_input_idxs={0})  # input 0 a parameter, in place
    saved = torch.ones(1)
    x = torch.arange(3.0)
    family.pending = [weakref.ref(saved)]  # as a replay leaves it, in a family bound to its instance
    family.instances.bind(family, [x], runner.static_input_idxs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert runner([x])[1] == "one_lane"
        assert capturer.captured == [] and len(_graph_warnings(caught)) == 1
        assert "2 forwards of one model instance await their backwards" in _graph_warnings(caught)[0]
        del saved  # the pending backward ran: its activations are released
        assert runner([x])[1] == "one_lane"
    assert len(capturer.captured) == 1
    assert len(_graph_warnings(caught)) == 2 and "capture failed" in _graph_warnings(caught)[1]
    assert fake.calls["one_lane"] == 4


def test_cudagraph_moved_input_runs_eager_and_warns_once(monkeypatch):
    """An input captured in place (a saved activation) that later lives elsewhere: no replay, one
    warning."""
    fake_cuda(monkeypatch)
    family = GraphFamily()
    x = torch.arange(3.0)
    family.saved_ptrs = {x.data_ptr()}  # as the forward's capture records its saved outputs
    runner, fake = _runner("backward", family, FakeCapture())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [runner([x]), runner([x])]  # the warm-up, then the capture reading x in place
        outs += [runner([x.clone()]) for _ in range(2)]  # it now lives elsewhere
    assert [o[1] for o in outs] == ["one_lane", "lanes", "one_lane", "one_lane"] and fake.calls["one_lane"] == 3
    assert runner.replays == 1
    messages = _graph_warnings(caught)
    assert len(messages) == 1 and "another address" in messages[0], messages


def test_inductor_joint_passes_failure_partitions_without_them(monkeypatch):
    """Inductor's joint-graph passes fail: the joint graph is partitioned as it is, apollo's runtime
    still runs every graph, one warning names the cause; strict raises. (The subgraphs run eagerly:
    helpers.eager_subgraphs.)"""
    eager_subgraphs(monkeypatch)

    def broken(gm, joint_inputs):
        raise RuntimeError("synthetic joint-pass failure")

    monkeypatch.setattr(pipeline, "inductor_joint_passes", broken)
    messages = two_tower_fallbacks({"subgraph_compiler": "inductor"})
    assert len(messages) == 1, messages
    assert "without Inductor's joint-graph passes" in messages[0] and "synthetic joint-pass failure" in messages[0]
    assert_apollo_ran(apollo_compile.last_plan())
    torch._dynamo.reset()
    with pytest.raises(Exception, match="synthetic joint-pass failure"):
        torch.compile(TwoTower(), backend="apollo", options={"strict": True})(*two_tower_inputs()).sum().backward()
