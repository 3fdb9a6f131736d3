"""The whole training step as one graph (compile_step), and lanes found from the dataflow.

Numerics: the eager subgraph compiler runs the same ATen kernels as eager PyTorch, split
differently (tolerances in helpers.TOLERANCE); AdamW's update divides by sqrt(v), so a gradient
off by an ulp moves a parameter by ~lr ulps: several steps stay within the same tolerances.
"""

from __future__ import annotations

import copy
import logging
import threading
import warnings
from collections import Counter

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn

import apollo_compile
from apollo_compile import ApolloFallbackWarning, ApolloOptionsError
from apollo_compile.step import whole_step
from apollo_compile.annotations import info
from apollo_compile.nodes import deterministic_attention, storage_node
from helpers import TOLERANCE, backward_step
from models import HookedOnFirstCall, TwoTower, checkpoint_blocks, tiny_hf, two_tower_inputs


EAGER = {"subgraph_compiler": "eager"}


def assert_grads_equal(model, ref, tol, step):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), f"step {step}: {name}"
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m: f"step {step} grad {name}: {m}")


def train_both(model, make_inputs, options, steps=4, accumulate=1, forward=None):
    """compile_step(step) and eager side by side under AdamW; `accumulate` calls per update."""
    ref = copy.deepcopy(model)
    forward = forward or (lambda m, inputs: m(*inputs))

    def step(*inputs):
        loss = forward(model, inputs)
        loss.backward()
        return loss.detach()

    compiled = apollo_compile.compile_step(step, options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    tol = TOLERANCE[options.get("subgraph_compiler", "inductor")]
    for i in range(steps):
        inputs = make_inputs(i)
        loss = compiled(*inputs)
        ref_loss = forward(ref, inputs)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **tol)
        assert_grads_equal(model, ref, tol, i)
        if (i + 1) % accumulate == 0:
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
    return compiled


def whole_step_plans():
    return [p for p in apollo_compile.plans() if "inference" in p.graphs]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_whole_step_trains_like_eager(compiler):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        compiled = train_both(TwoTower(layers=1), lambda i: two_tower_inputs(seed=i), {"subgraph_compiler": compiler})
    assert compiled.fallback_reason is None
    plan = whole_step_plans()[-1]
    assert plan.inference.fallback is None
    assert len(plan.inference.decisions["lanes"].lanes) >= 2
    # a new .grad is the gradient itself, no parameter-sized copy: also where the gradient is a view
    # in the parameter's layout (a weight's t(t(mm)), a bias's view(sum)), read as a tensor of its own
    params = sum(1 for _ in TwoTower(layers=1).parameters())
    assert plan.inference.decisions["gradients"]["stolen"] == params
    outs = [n for n in plan.inference.gm.graph.nodes if n.op == "output"][0].args[0]
    assert not [o for o in outs if o.target is torch.ops.aten.copy.default]
    grads = [o for o in outs if info(o).backward]
    assert len(grads) == params and not [g for g in grads if getattr(g.target, "is_view", False)]  # no _base


def test_gradient_accumulation_over_two_calls():
    """The first call assigns .grad, the second (a graph of its own: Dynamo guards on .grad being
    None) accumulates into it, as eager autograd does."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    train_both(TwoTower(layers=1), lambda i: two_tower_inputs(seed=i), EAGER, steps=4, accumulate=2)
    kinds = [sorted(p.graphs) for p in apollo_compile.plans()]
    assert kinds == [["inference"], ["inference"]]  # .grad None and .grad present: one graph each
    for p in apollo_compile.plans():
        assert len(p.inference.decisions["lanes"].lanes) >= 2


def test_returned_loss_is_safe_to_hold():
    torch.manual_seed(0)
    model = TwoTower(layers=1)
    compiled = apollo_compile.compile_step(backward_step(model), options=EAGER)
    held = [compiled(*two_tower_inputs(seed=i)) for i in range(3)]
    values = [float(x) for x in held]
    compiled(*two_tower_inputs(seed=9))
    assert [float(x) for x in held] == values


# ---------------------------------------------------------------------------- lanes, six ways


class Wrapper(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images, tokens):
        return self.model(images, tokens)


class NotSelf(nn.Module):
    """A forward whose first argument is not called ``self``."""

    def __init__(self):
        super().__init__()
        self.vision = TwoTower(layers=1).vision
        self.text = TwoTower(layers=1).text
        self.vision_proj = nn.Linear(32, 16, bias=False)
        self.text_proj = nn.Linear(32, 16, bias=False)

    def forward(s, images, tokens):  # noqa: N805 - the point of the test
        v = F.normalize(s.vision_proj(s.vision(images)), dim=-1)
        t = F.normalize(s.text_proj(s.text(tokens)), dim=-1)
        logits = v @ t.t()
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def _towers(plan_graph) -> list[frozenset]:
    """The lanes of a graph as sets of tower labels, joins left out: what the plan runs side by side."""
    lanes = plan_graph.decisions["lanes"].lanes
    return sorted((frozenset(m for m in ms if m != "fusion") for ms in lanes.values()), key=sorted)


def _lanes_of(way: str):
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    images, tokens = two_tower_inputs(seed=0)
    model = NotSelf() if way == "not_self" else TwoTower(layers=1)
    if way in ("module", "not_self"):
        torch.compile(model, backend="apollo", options=EAGER)(images, tokens).backward()
    elif way == "wrapper":
        torch.compile(Wrapper(model), backend="apollo", options=EAGER)(images, tokens).backward()
    elif way == "function":
        global GLOBAL_MODEL
        GLOBAL_MODEL = model
        torch.compile(_call_global, backend="apollo", options=EAGER)(images, tokens).backward()
    elif way == "compiled_autograd":
        from torch._dynamo import compiled_autograd

        enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
        loss = torch.compile(model, backend="apollo", options=EAGER)(images, tokens)
        with enable(torch.compile(backend="apollo", options=EAGER)):
            loss.backward()
    elif way == "whole_step":
        apollo_compile.compile_step(backward_step(model), options=EAGER)(images, tokens)
    return [(kind, len(g.decisions["lanes"].lanes), _towers(g)) for p in apollo_compile.plans()
            for kind, g in p.graphs.items()]


GLOBAL_MODEL = None


def _call_global(images, tokens):
    return GLOBAL_MODEL(images, tokens)


@pytest.mark.parametrize("way", ["module", "wrapper", "function", "not_self", "compiled_autograd", "whole_step"])
def test_lanes_come_from_the_dataflow(way):
    """Two lanes, one per tower, whichever way the model is compiled: module paths only name them."""
    graphs = _lanes_of(way)
    assert graphs, way
    for kind, lanes, towers in graphs:
        assert lanes >= 2, (way, kind, towers)
        assert all(len(t) == 1 for t in towers), (way, kind, towers)  # each lane runs one tower
    if way != "compiled_autograd":  # its graph has no module paths: towers are numbered
        for kind, lanes, towers in graphs:
            assert set().union(*towers) == {"vision", "text"}, (way, kind, towers)


class GridPositions(TwoTower):
    """Position embeddings made per image from an input of its own, through a small matmul, and
    added to the patches right away, as SigLIP 2 resizes them from ``spatial_shapes``."""

    def __init__(self):
        super().__init__(layers=2)
        self.grid_proj = nn.Linear(2, 32)

    def forward(self, images, tokens, grid):
        x = self.vision.patch_embed(images).flatten(2).transpose(1, 2) + self.grid_proj(grid).unsqueeze(1)
        for block in self.vision.blocks:
            x = block(x)
        v = F.normalize(self.vision_proj(self.vision.ln(x).mean(dim=1)), dim=-1)
        t = F.normalize(self.text_proj(self.text(tokens)), dim=-1)
        logits = self.logit_scale.exp() * v @ t.t()
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


@pytest.mark.parametrize("way", ["module", "whole_step"])
def test_an_input_that_only_feeds_a_tower_is_not_a_tower(way):
    """The grid's own matmul is tiny beside the vision blocks it feeds with the pixels: it is
    absorbed, and the vision tower, not a join of it and the pixels, runs beside the text tower
    (modality.py, NOTE: A tower is more than a feeder of one)."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    model = GridPositions()
    images, tokens = two_tower_inputs(seed=0)
    grid = torch.rand(images.shape[0], 2)
    if way == "module":
        torch.compile(model, backend="apollo", options=EAGER)(images, tokens, grid).backward()
    else:
        def step(images, tokens, grid):
            loss = model(images, tokens, grid)
            loss.backward()
            return loss.detach()

        apollo_compile.compile_step(step, options=EAGER)(images, tokens, grid)
    graphs = [(kind, _towers(g)) for p in apollo_compile.plans() for kind, g in p.graphs.items()]
    assert graphs
    for kind, towers in graphs:
        assert [set(t) for t in towers] == [{"text"}, {"vision"}], (kind, towers)


def unmark_autograd_backward(monkeypatch):
    """Trace as torch 2.11 does: no node of a whole step is marked ``autograd_backward`` (on 2.11
    itself there is no such mark to turn off)."""
    monkeypatch.setattr(torch.fx.traceback, "_mark_autograd_backward", lambda: None, raising=False)


def test_whole_step_lanes_without_autograd_backward_marks(monkeypatch):
    """torch 2.11 marks no whole-step node ``autograd_backward`` (read from the marks alone, the
    graph has no backward nodes, and its gradients are copied out at every replay): the backward
    is found from the call it was traced from, ``torch.autograd.grad``, and the lanes are the same."""
    marked = _lanes_of("whole_step")
    unmark_autograd_backward(monkeypatch)
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    model = TwoTower(layers=1)

    def step(images, tokens):  # a code object of its own: Dynamo would reuse _lanes_of's graph for backward_step's
        loss = model(images, tokens)
        loss.backward()
        return loss.detach()

    compiled = apollo_compile.compile_step(step, options=EAGER)
    compiled(*two_tower_inputs(seed=0))
    (plan,) = apollo_compile.plans()
    graph = plan.graphs["inference"]
    assert not any(n.meta.get("autograd_backward") for n in graph.gm.graph.nodes)  # the marks are gone
    assert sum(info(n).backward for n in graph.gm.graph.nodes) > 50
    assert [("inference", len(graph.decisions["lanes"].lanes), _towers(graph))] == marked
    assert len(graph.decisions["lanes"].lanes) >= 2 and set().union(*_towers(graph)) == {"vision", "text"}


def test_whole_step_listing_names_its_lanes():
    """A golden summary of the whole-step graph: each tower's forward and backward on its lane,
    the loss and its gradient on the main lane."""
    torch.manual_seed(0)
    model = TwoTower(width=16, embed=8, layers=1)
    apollo_compile.compile_step(backward_step(model), options={**EAGER, "device": "H200"})(*two_tower_inputs(batch=2))
    graph = apollo_compile.last_plan().inference
    counts = Counter((info(n).lane, info(n).modality, "backward" if info(n).backward else "forward")
                     for n in graph.gm.graph.nodes if n.op == "call_function")
    listing = "\n".join(f"lane {lane}  {modality:<8} {part:<8} {k} ops" for (lane, modality, part), k in sorted(counts.items()))
    assert_expected_inline(listing, """\
lane 0  fusion   backward 10 ops
lane 0  fusion   forward  16 ops
lane 0  vision   backward 110 ops
lane 0  vision   forward  58 ops
lane 1  text     backward 95 ops
lane 1  text     forward  55 ops""")


# ---------------------------------------------------------------------------- fallbacks


def test_options_are_checked_before_tracing():
    with pytest.raises(ApolloOptionsError, match="unknown option 'lanes'"):
        apollo_compile.compile_step(lambda: None, options={"lanes": 2})
    with pytest.raises(ApolloOptionsError, match="backend='apollo'"):
        apollo_compile.compile_step(lambda: None, backend="inductor")
    with pytest.raises(TypeError, match="step function"):
        apollo_compile.compile_step(3)


def test_without_backward_tracing_the_step_runs_on_the_module_path(monkeypatch):
    monkeypatch.setattr(whole_step, "backward_tracing_supported", lambda: False)
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    with pytest.warns(ApolloFallbackWarning, match="cannot trace loss.backward"):
        train_both(TwoTower(layers=1), lambda i: two_tower_inputs(seed=i), EAGER, steps=2)
    assert ["backward", "forward"] in [sorted(p.graphs) for p in apollo_compile.plans()]


def test_a_graph_break_inside_the_step_warns_once_and_trains_like_eager():
    torch.manual_seed(0)

    def forward(model, inputs):
        loss = model(*inputs)
        torch._dynamo.graph_break()
        return loss * 1.0

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = train_both(TwoTower(layers=1), lambda i: two_tower_inputs(seed=i), EAGER, steps=3, forward=forward)
    mine = [w for w in caught if issubclass(w.category, ApolloFallbackWarning) and "compile_step" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "graph_break()" in str(mine[0].message)
    assert "does not trace as one graph" in compiled.fallback_reason


class SplitByLengths(nn.Module):
    """Attention over variable-length pieces whose lengths are a tensor, as Qwen2-VL's vision tower
    splits its patches per image (``torch.split(q, lengths.tolist(), dim=2)``)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, cu_seqlens):
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        q = self.proj(x).view(1, 2, -1, 4)
        pieces = torch.split(q, lengths.tolist(), dim=2)
        return torch.cat([F.scaled_dot_product_attention(p, p, p) for p in pieces], dim=2).square().mean()


def test_data_dependent_code_in_the_step_falls_back_and_trains_like_eager():
    """With fullgraph=True Dynamo traces ``.tolist()`` as unbacked symbols and the split then
    raises a symbolic-shapes error (not Unsupported): the step runs on the module path, one warning
    (whole_step.py, NOTE: Data-dependent code under fullgraph)."""
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 2, 6])

    def inputs(i):
        return torch.randn(6, 8, generator=torch.Generator().manual_seed(i)), cu_seqlens

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = train_both(SplitByLengths(), inputs, EAGER, steps=3)
    mine = [w for w in caught if issubclass(w.category, ApolloFallbackWarning) and "compile_step" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "data-dependent" in compiled.fallback_reason, compiled.fallback_reason


@pytest.fixture
def graphed(monkeypatch):
    """The `cudagraphs` option each graph the backend compiles is given, in order."""
    from apollo_compile import backend

    seen: list = []
    original = backend.use_cudagraphs

    def use_cudagraphs(opts, example_inputs, name):
        seen.append(opts.cudagraphs)
        return original(opts, example_inputs, name)

    monkeypatch.setattr(backend, "use_cudagraphs", use_cudagraphs)
    return seen


def test_code_only_a_first_call_runs_leaves_the_later_steps_whole(graphed):
    """The first call runs on the module path, without CUDA graphs (they would never replay); the
    second traces the step whole, with no warning (whole_step.py, NOTE: Code only a first call runs)."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        compiled = train_both(HookedOnFirstCall(layers=1), lambda i: two_tower_inputs(seed=i), EAGER, steps=3)
    assert graphed[0] is False and graphed[-1] == "auto"  # the first call's graphs, the whole step's
    assert compiled.fallback_reason is None and compiled.parts is None and not compiled.retry
    assert "Unsupported context manager" in compiled.first_call_reason
    assert [sorted(p.graphs) for p in apollo_compile.plans()][-1] == ["inference"]
    assert len(whole_step_plans()[-1].inference.decisions["lanes"].lanes) >= 2


def test_what_fails_on_the_second_call_too_warns_once(graphed):
    """The module path it stays on for good is compiled again, with CUDA graphs as the user set them."""
    torch.manual_seed(0)
    lock = threading.Lock()

    def forward(model, inputs):
        with lock:  # on every call
            return model(*inputs)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = train_both(TwoTower(layers=1), lambda i: two_tower_inputs(seed=i), EAGER, steps=3, forward=forward)
    mine = [w for w in caught if issubclass(w.category, ApolloFallbackWarning) and "compile_step" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "Unsupported context manager" in compiled.fallback_reason
    assert not compiled.parts_first_call_only and graphed[0] is False and graphed[-1] == "auto"


class CheckpointedWithNoise(TwoTower):
    """Each tower under the user's own activation checkpoint with a random op inside, as Hugging
    Face's ``gradient_checkpointing_enable()`` wraps layers that hold dropout. The noise is
    multiplied by zero, so that eager's values are the compiled step's."""

    def forward(self, images, tokens):
        def vision(x):
            out = self.vision(x)
            return out + 0.0 * torch.rand_like(out)

        v = F.normalize(self.vision_proj(torch.utils.checkpoint.checkpoint(vision, images, use_reentrant=False)),
                        dim=-1)
        t = F.normalize(self.text_proj(self.text(tokens)), dim=-1)
        logits = self.logit_scale.exp() * v @ t.t()
        labels = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def test_a_step_whose_graph_cannot_be_compiled_takes_the_module_path():
    """AOTAutograd cannot rematerialize a random op inside the user's checkpoint in a whole step's
    graph; its partitioner can in the module path's joint graph. So the step takes the module path
    (two lanes there), with one warning naming the cause, not its graph run eagerly (whole_step.py,
    NOTE: A whole step's last resort)."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = train_both(CheckpointedWithNoise(layers=1), lambda i: two_tower_inputs(seed=i), EAGER, steps=3)
    mine = [str(w.message) for w in caught if issubclass(w.category, ApolloFallbackWarning)]
    assert len(mine) == 1 and "compile_step" in mine[0], mine
    assert "WholeStepNotCompiled" in compiled.fallback_reason and "RNG" in compiled.fallback_reason
    module_path = [p.graphs for p in apollo_compile.plans() if "backward" in p.graphs]  # apollo's, not eager's
    # the first call's (without CUDA graphs), then the one it stays on (NOTE: Code only a first call runs)
    assert [len(g["backward"].lanes.lanes) for g in module_path] == [2, 2]


def test_the_users_checkpoints_around_attention_stay_one_graph():
    """Attention carries the random tag for its dropout, and AOTAutograd refuses to rematerialize
    a random op in a whole step's graph; at dropout 0 it draws nothing, so apollo lets it be
    recomputed (checkpoint.attention_recomputed_as_is). The step is one graph with two lanes, each
    block's attention is run again for the backward, and training is eager's. On torch 2.11 the
    backward is re-run only because apollo marks where it starts (whole_step.py, NOTE: The user's
    checkpoints in a whole step)."""
    torch.manual_seed(0)
    model = checkpoint_blocks(TwoTower(layers=2))
    apollo_compile.clear_plans()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        compiled = train_both(model, lambda i: two_tower_inputs(seed=i), EAGER, steps=3)
    assert compiled.fallback_reason is None and compiled.parts is None
    graph = whole_step_plans()[0].graphs["inference"]
    assert len(graph.lanes.lanes) == 2
    attention = [n for n in graph.gm.graph.nodes if deterministic_attention(n) and "backward" not in str(n.target)]
    assert len(attention) == 2 * 4, [n.name for n in attention]  # 4 blocks, each run again for its backward


def test_the_backward_is_marked_where_the_user_annotated_too():
    """The node that traces ``loss.backward()`` gets the mark torch 2.11's rematerialization looks
    for, beside the user's own annotation of it; no other node gets it."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = nn.Linear(4, 1)

    def step(x):
        loss = model(x).sum()
        with torch.fx.traceback.annotate({"mine": 1}):
            loss.backward()
        return loss.detach()

    with torch._dynamo.config.patch(**{whole_step.TRACE_FLAG: True}):
        torch.compile(step, backend=capture, fullgraph=True)(torch.randn(2, 4))
    whole_step.mark_backward(graphs[0])
    marked = {n.name: n.meta["custom"] for n in graphs[0].graph.nodes
              if n.meta.get("custom", {}).get("remat_pass_tag")}
    assert marked == {"grad": {"mine": 1, **whole_step.BACKWARD_MARK}}, marked


_LOG = logging.getLogger("apollo_compile.tests.whole_step")


class LogsEachCall(TwoTower):
    def forward(self, images, tokens):
        _LOG.debug("a step")  # Hugging Face's models warn this way, under gradient checkpointing among others
        return super().forward(images, tokens)


def test_the_fallback_warning_passes_on_what_dynamo_suggests():
    """A log call inside the step keeps it off one graph; the warning says so with Dynamo's hint,
    and following the hint makes the step one graph."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ApolloFallbackWarning)
        compiled = train_both(LogsEachCall(layers=1), lambda i: two_tower_inputs(seed=i), EAGER, steps=2)
    assert "Logger" in compiled.fallback_reason and "ignore_logging_functions" in compiled.fallback_reason
    torch._dynamo.reset()
    with torch._dynamo.config.patch(ignore_logger_methods={logging.Logger.debug}), warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        compiled = train_both(LogsEachCall(layers=1), lambda i: two_tower_inputs(seed=i), EAGER, steps=2)
    assert compiled.fallback_reason is None and compiled.parts is None


def test_retain_graph_trains_like_eager():
    torch.manual_seed(0)
    model = TwoTower(layers=1)
    ref = copy.deepcopy(model)

    def step(images, tokens):
        loss = model(images, tokens)
        loss.backward(retain_graph=True)
        return loss.detach()

    compiled = apollo_compile.compile_step(step, options=EAGER)
    for i in range(2):
        inputs = two_tower_inputs(seed=i)
        loss = compiled(*inputs)
        ref_loss = ref(*inputs)
        ref_loss.backward(retain_graph=True)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOLERANCE["eager"])
        assert_grads_equal(model, ref, TOLERANCE["eager"], i)


# ---------------------------------------------------------------------------- Hugging Face models


def assert_forwards_side_by_side(cut) -> None:
    """No tower's first subgraph (its forward) waits for a subgraph of another tower: HF CLIP's
    ``t(t(image_embeds))``, read by the text tower's gradient, made the text tower's forward wait
    for the vision tower's (lanes.py, NOTE: A lane waits for another where it reads it)."""
    towers = {sg.id: {info(n).modality for n in sg.nodes} - {"fusion"} for sg in cut.subgraphs}
    first: dict[str, int] = {}
    for sg in cut.subgraphs:
        for m in sorted(towers[sg.id]):
            first.setdefault(m, sg.id)
    assert len(first) >= 2, towers
    for m, i in first.items():
        waits_for = {o for a in nx.ancestors(cut.dag, i) for o in towers[a]} - {m}
        assert not waits_for, (m, i, waits_for)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_hugging_face_whole_step_trains_like_eager(kind):
    """Called as HF models are, by keyword, with the loss from the model's output object."""
    model = tiny_hf(kind)

    def forward(m, inputs):
        input_ids, pixel_values = inputs
        return m(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss

    def make_inputs(i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(1, 99, (4, 16), generator=g), torch.randn(4, 3, 16, 16, generator=g)

    apollo_compile.clear_plans()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        train_both(model, make_inputs, EAGER, steps=3, forward=forward)
    for plan in apollo_compile.plans():
        assert plan.inference.fallback is None
        assert len(plan.inference.decisions["lanes"].lanes) >= 2, plan.inference.decisions["lanes"].lanes
        assert_forwards_side_by_side(plan.inference.decisions["lanes"])
        if kind == "clip":  # quick_gelu's sigmoid is made again in the backward's subgraph, not handed to it
            cut = plan.inference.decisions["lanes"]
            assert cut.recomputed["recomputed"] >= 2, cut.recomputed
            sigmoids = [n for sg in cut.subgraphs for n in sg.inputs  # nor a view of it (autograd's detach)
                        if storage_node(n).target is torch.ops.aten.sigmoid.default]
            assert not sigmoids, sigmoids


def test_an_elementwise_graph_of_many_inputs_is_one_lane():
    """A compiled optimizer-like update (each parameter's new value from its own gradient and
    state, elementwise) has a data input per tensor but no matmul anywhere: no towers, one lane,
    not a lane per parameter (a 60-parameter AdamW update planned 60 lanes). Values as eager's."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    params = [torch.randn(8, 8) for _ in range(6)]
    grads = [torch.randn(8, 8) for _ in range(6)]
    state = [torch.zeros(8, 8) for _ in range(6)]

    def update(params, grads, state):
        out = []
        for p, g, m in zip(params, grads, state):
            m = 0.9 * m + g
            out.append(p - 0.1 * m)
        return out

    compiled = torch.compile(update, backend="apollo", options=EAGER)
    for got, want in zip(compiled(params, grads, state), update(params, grads, state)):
        torch.testing.assert_close(got, want, **TOLERANCE["eager"])
    (plan,) = apollo_compile.plans()
    assert len(plan.graphs["inference"].decisions["lanes"].lanes) == 1
