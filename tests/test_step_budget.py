"""compile_step under a memory_budget: the whole step's graph re-runs forward ops in its backward
(passes/step_recompute.py).

Numerics: with the eager subgraph compiler a re-run op is the same ATen kernel on the same inputs,
so losses and gradients match eager at helpers.TOLERANCE["eager"] (observed: bit-identical). With
the optimizer inside, the update is apollo's (fused_update.py) against torch's AdamW: parameters
are compared at rtol 1e-4 / atol 5e-5 with eps=1e-4 (test_optimizer_step.py's docstring says why).
"""

from __future__ import annotations

import copy
import logging
import operator
import warnings

import pytest
import torch

import apollo_compile
from apollo_compile import ApolloFallbackWarning
from apollo_compile.annotations import info
from apollo_compile.report.explain import Report
from apollo_compile.nodes import is_random, nbytes, storage_node, written_inputs
from helpers import TOLERANCE, assert_same_loss_and_grads, backward_step, eager_subgraphs
from models import TwoTower, tiny_hf, two_tower_inputs

EAGER = {"subgraph_compiler": "eager"}
PARAMS = dict(rtol=1e-4, atol=5e-5)  # parameters after in-graph AdamW steps (module docstring)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.05)


def step_plan():
    """The inference graph's plan of the last compile_step."""
    return [p for p in apollo_compile.plans() if "inference" in p.graphs][-1].inference


def saved_bytes_at_backward(gm: torch.fx.GraphModule) -> int:
    """Bytes of the forward's values alive where the backward starts, by liveness over the final
    graph: each storage the forward made that a node from the first backward node on reads."""
    nodes = list(gm.graph.nodes)
    first = next(i for i, n in enumerate(nodes) if info(n).backward)
    made = {n for n in nodes[:first] if n.op == "call_function"}
    alive = {storage_node(a) for n in nodes[first:] for a in n.all_input_nodes}
    return sum(nbytes(s) for s in alive & made)


def train(model, options, steps=3, inside=False, seed=None):
    """compile_step against eager, `steps` AdamW steps: the loss and every gradient (optimizer
    outside) or every parameter (optimizer inside) at each step. With `seed`, torch is reseeded
    before each step of both, so dropout draws alike."""
    ref = copy.deepcopy(model)
    opt, ref_opt = adamw(model), adamw(ref)
    tol = TOLERANCE["eager"]
    compiled = apollo_compile.compile_step(backward_step(model), optimizer=opt if inside else None, options=options)
    for i in range(steps):
        inputs = two_tower_inputs(seed=i)
        if seed is not None:
            torch.manual_seed(seed + i)
        loss = compiled(*inputs)
        if seed is not None:
            torch.manual_seed(seed + i)
        ref_loss = ref(*inputs)
        ref_loss.backward()
        if inside:
            ref_opt.step()
            torch.testing.assert_close(loss, ref_loss.detach(), **(PARAMS if i else tol))
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, **PARAMS, msg=lambda m: f"step {i} param {name}: {m}")
        else:
            assert_same_loss_and_grads(loss, ref_loss.detach(), model, ref, tol, i)
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=True)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, **tol)
        ref_opt.zero_grad(set_to_none=True)
    return compiled


def listing(plan) -> list[tuple]:
    """Each node of a plan's graph: its name, target, arguments and lane."""
    return [(n.name, str(n.target), str(n.args), info(n).lane) for n in plan.gm.graph.nodes]


_PLAIN: dict[str, object] = {}


def plain_step() -> dict[str, object]:
    """TwoTower()'s whole step without a budget, compiled once for the module (several tests
    compare against it): its listing and the forward's bytes alive at the backward."""
    if not _PLAIN:
        torch.manual_seed(0)
        apollo_compile.compile_step(backward_step(TwoTower()), options=EAGER)(*two_tower_inputs())
        plan = step_plan()
        _PLAIN.update(listing=listing(plan), saved=saved_bytes_at_backward(plan.gm))
    return _PLAIN


def plain_saved_bytes() -> int:
    return plain_step()["saved"]


@pytest.mark.parametrize("inside", [False, True], ids=["optimizer-outside", "optimizer-inside"])
def test_a_budget_recomputes_in_the_whole_step_and_trains_like_eager(inside):
    plain = plain_saved_bytes()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        compiled = train(TwoTower(), {**EAGER, "memory_budget": 0.5}, inside=inside)
    assert compiled.fallback_reason is None
    plan = step_plan()
    decision = plan.decisions["recompute"]
    assert plan.checkpoint is decision and plan.summary()["checkpoint"]["copies"] == len(decision.copies)
    assert decision.met and decision.peak_after <= decision.targets["*"] < decision.peak_before
    assert decision.recomputed and decision.copies
    assert len(plan.decisions["lanes"].lanes) >= 2  # the towers keep their lanes under the budget
    nodes = list(plan.gm.graph.nodes)
    position = {n.name: i for i, n in enumerate(nodes)}
    first_backward = next(i for i, n in enumerate(nodes) if info(n).backward)
    copies = [n for n in nodes if n.name in decision.copies]
    again = {info(n).copy_of for n in nodes if info(n).copy_of and n.name not in decision.copies}
    # every copy survives the passes after this one, or is recomputed again where a cut's reader is
    assert all(name in position or original in again for name, original in decision.copies.items())
    for c in copies:  # each runs in the backward, marked, beside the original it re-runs
        assert info(c).recomputed and info(c).copy_of == decision.copies[c.name] and not info(c).backward
        assert position[c.name] > first_backward > position[decision.copies[c.name]]
        assert info(c).lane is not None and not is_random(c)
    rerun = set(decision.recomputed)
    for n in nodes[:first_backward]:  # what the originals make is read by no later node: it dies in the forward
        s = storage_node(n)
        if (s.args[0] if s.target is operator.getitem else s).name in rerun:
            assert all(position[u.name] < first_backward for u in n.users), n.name
    assert saved_bytes_at_backward(plan.gm) < plain  # by liveness over the graph that runs, not the plan
    text = str(Report([p for p in apollo_compile.plans() if p.inference is plan]))
    assert (f"recomputed: {plan.name}: {len(decision.recomputed)} forward ops re-run in the backward "
            f"({len(decision.copies)} nodes copied into the backward)") in text
    assert [n for n in plan.gm.graph.nodes if info(n).saved]
    if inside:  # each write into a parameter comes after every copy that reads it (the updates pass)
        for n in nodes:
            for x in written_inputs(n):
                assert all(position[u.name] < position[n.name] for u in x.users if u.name in decision.copies)


def test_dropout_trains_like_eager_under_a_budget():
    """Random ops are never re-run: the backward reads the masks the forward drew, as eager's does."""
    torch.manual_seed(0)
    train(TwoTower(dropout=0.3), {**EAGER, "memory_budget": 0.3}, seed=100)
    plan = step_plan()
    decision = plan.decisions["recompute"]
    assert decision.copies
    drawn = [n for n in plan.gm.graph.nodes if is_random(n)]
    assert drawn and not any(info(n).recomputed for n in drawn)
    assert not any(n.name in decision.recomputed for n in drawn)


@pytest.mark.parametrize("budget", [1.0, None])
def test_a_budget_of_one_changes_nothing(budget):
    plain = plain_step()["listing"]
    torch.manual_seed(0)
    apollo_compile.compile_step(backward_step(TwoTower()), options={**EAGER, "memory_budget": budget})(
        *two_tower_inputs())
    plan = step_plan()
    assert listing(plan) == plain  # the same graph, on the same lanes
    decision = plan.decisions["recompute"]
    assert decision is None if budget is None else (not decision.copies and not decision.tagged)


def test_a_per_modality_budget_recomputes_that_tower_only():
    torch.manual_seed(0)
    model = TwoTower()
    apollo_compile.compile_step(backward_step(model), options={**EAGER, "memory_budget": {"vision": 0.5}})(
        *two_tower_inputs())
    plan = step_plan()
    decision = plan.decisions["recompute"]
    assert decision.copies and set(decision.targets) == {"vision"}
    assert decision.peak_after_by_modality["vision"] <= decision.targets["vision"]
    copies = [n for n in plan.gm.graph.nodes if n.name in decision.copies]
    assert {info(c).modality for c in copies} <= {"vision", "fusion"} and "vision" in {info(c).modality for c in copies}


def test_a_budget_naming_a_tower_the_step_lacks_says_so(caplog):
    """A misspelt tower ("visoin") is not ignored without a word: a warning names it and the
    towers the graph has."""
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="apollo_compile"):
        apollo_compile.compile_step(backward_step(TwoTower(layers=1)),
                                    options={**EAGER, "memory_budget": {"visoin": 0.5}})(*two_tower_inputs())
    said = [r.getMessage() for r in caplog.records if "memory_budget names" in r.getMessage()]
    assert len(said) == 1 and "'visoin'" in said[0] and "text, vision" in said[0], said


def test_the_copies_reach_inductor(monkeypatch):
    """Under Inductor the step trains like eager, and nothing after the pass merges a copy back
    into its original: Inductor's post-grad passes
    (the last FX passes before lowering) still hold the copies of the matmuls, norms and attention
    it re-runs (a pointwise copy may be fused into its reader there, as intended)."""
    from torch._inductor import compile_fx
    from torch._inductor import config as inductor_config

    seen: list[set[str]] = []
    original = compile_fx._recursive_post_grad_passes

    def recording(gm, *args, **kwargs):
        out = original(gm, *args, **kwargs)
        seen.append({n.name for n in gm.graph.nodes})
        return out

    monkeypatch.setattr(compile_fx, "_recursive_post_grad_passes", recording)
    torch.manual_seed(0)
    model = TwoTower(layers=1)
    ref = copy.deepcopy(model)
    # the config's own patch: monkeypatch's undo deletes a torch config attribute (pytest 9.2)
    with inductor_config.patch(fx_graph_cache=False):
        loss = apollo_compile.compile_step(backward_step(model), options={"memory_budget": 0.5})(*two_tower_inputs())
    ref_loss = ref(*two_tower_inputs())
    ref_loss.backward()
    assert_same_loss_and_grads(loss, ref_loss.detach(), model, ref, TOLERANCE["inductor"], 0)
    plan = step_plan()
    assert plan.fallback is None
    decision = plan.decisions["recompute"]
    heavy = [n for n in plan.gm.graph.nodes if n.name in decision.copies and info(n).library]
    assert heavy
    lowered = set().union(*seen)
    assert {n.name for n in heavy} <= lowered
    assert {decision.copies[n.name] for n in heavy} <= lowered  # the originals too: both run


def test_a_hugging_face_clip_step_under_a_budget_matches_eager():
    """HF CLIP's whole step (its own contrastive loss, attention masks, a class token) recomputes
    under a budget and its loss and gradients are eager's."""
    model = tiny_hf("clip")
    ref = copy.deepcopy(model)

    def step(ids, pixels):
        out = model(input_ids=ids, pixel_values=pixels, return_loss=True)
        out.loss.backward()
        return out.loss.detach()

    g = torch.Generator().manual_seed(0)
    ids, pixels = torch.randint(0, 99, (4, 7), generator=g), torch.randn(4, 3, 16, 16, generator=g)
    loss = apollo_compile.compile_step(step, options={**EAGER, "memory_budget": 0.4})(ids, pixels)
    ref_loss = ref(input_ids=ids, pixel_values=pixels, return_loss=True).loss
    ref_loss.backward()
    assert_same_loss_and_grads(loss, ref_loss.detach(), model, ref, TOLERANCE["eager"], 0)
    decision = step_plan().checkpoint
    assert decision.copies and decision.peak_after < decision.peak_before


def small_hf_clip():
    """HF CLIP with two layers of width 64: enough pointwise work (quick GELU, decomposed norms)
    for a partition under Inductor to re-run some of it by itself."""
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=99, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=16)
    vision = dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4)
    torch.manual_seed(0)
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=32))


def clip_step_with_reference():
    """small_hf_clip()'s whole step (forward, loss, backward), its AdamW, and an eager copy with its
    own AdamW to train beside it."""
    model = small_hf_clip()
    ref = copy.deepcopy(model)

    def step(ids, pixels):
        out = model(input_ids=ids, pixel_values=pixels, return_loss=True)
        out.loss.backward()
        return out.loss.detach()

    return step, model, adamw(model), ref, adamw(ref)


def step_like_eager(compiled, model, ref, ref_opt, ids, pixels, i=0) -> None:
    """One call of `compiled` (AdamW inside) against eager's step on `ref`: the loss and every parameter."""
    loss = compiled(ids, pixels)
    ref_loss = ref(input_ids=ids, pixel_values=pixels, return_loss=True).loss
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss, ref_loss.detach(), **TOLERANCE["inductor"])
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **PARAMS, msg=lambda m: f"step {i} param {name}: {m}")


def test_a_fraction_saves_as_much_as_on_the_module_path(monkeypatch):
    """docs/design/checkpointing.md#whole-step-baseline: planned as under Inductor (its
    decompositions, pointwise work fused), the whole step's fraction is of the state a partition
    reaches by itself, as the module path's is of min-cut's: the same budget allows about the same
    bytes on both paths, well under half of what the step holds as traced. The subgraphs run
    eagerly (the plan is Inductor's; only the code generation is left out, for time), and the step,
    AdamW inside, trains like eager."""
    eager_subgraphs(monkeypatch)
    g = torch.Generator().manual_seed(0)
    ids, pixels = torch.randint(0, 99, (8, 16), generator=g), torch.randn(8, 3, 32, 32, generator=g)
    step, model, opt, ref, ref_opt = clip_step_with_reference()
    compiled = apollo_compile.compile_step(step, optimizer=opt, options={"memory_budget": 0.5})
    step_like_eager(compiled, model, ref, ref_opt, ids, pixels)
    whole = step_plan().checkpoint
    assert whole.baseline == "fused-pointwise" and whole.peak_before < whole.peak_traced
    assert whole.recomputed and whole.met and whole.peak_after <= whole.targets["*"] == int(0.5 * whole.peak_before)

    compiled = torch.compile(small_hf_clip(), backend="apollo", options={"memory_budget": 0.5})
    compiled(input_ids=ids, pixel_values=pixels, return_loss=True).loss.backward()
    module = apollo_compile.last_plan().joint["checkpoint"]
    assert module.baseline == "min-cut" and module.met
    # counted from the graph as traced, the step's target was 1.27x the module path's
    assert whole.targets["*"] <= 1.1 * module.targets["*"]
    assert whole.peak_after <= 1.1 * module.peak_after and whole.peak_after <= 0.45 * whole.peak_traced


def test_without_a_budget_the_fused_baseline_re_runs_what_a_partition_would(monkeypatch):
    """step_recompute.FUSED_BASELINE on, no budget: the whole step re-runs the pointwise work a
    partition re-runs by itself (docs/design/checkpointing.md#whole-step-baseline), holds less at
    the backward's peak than as traced, and trains like eager over three AdamW steps. Planned as
    under Inductor, the subgraphs run eagerly (helpers.eager_subgraphs). Off (the default), a step
    without a budget re-runs nothing: test_a_budget_of_one_changes_nothing."""
    from apollo_compile.passes import step_recompute

    eager_subgraphs(monkeypatch)
    monkeypatch.setattr(step_recompute, "FUSED_BASELINE", True)
    g = torch.Generator().manual_seed(0)
    step, model, opt, ref, ref_opt = clip_step_with_reference()
    compiled = apollo_compile.compile_step(step, optimizer=opt)
    for i in range(3):
        ids, pixels = torch.randint(0, 99, (8, 16), generator=g), torch.randn(8, 3, 32, 32, generator=g)
        step_like_eager(compiled, model, ref, ref_opt, ids, pixels, i)
    assert compiled.fallback_reason is None
    plan = step_plan()
    decision = plan.checkpoint
    assert decision.budget is None and decision.baseline == "fused-pointwise"
    assert decision.recomputed and decision.copies and not decision.added and decision.extra_us == 0
    assert decision.peak_after < decision.peak_before == decision.peak_traced
    assert len(plan.decisions["lanes"].lanes) >= 2
