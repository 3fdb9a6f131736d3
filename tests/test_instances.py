"""One compiled graph serving several model instances (runtime/instances.py, NOTE: One graph,
several model instances), on the CPU with fake CUDA graphs: Dynamo hands every instance of a class
the graphs compiled for the first; each instance's calls replay a family of graphs of their own,
training equals eager PyTorch step by step (the eager subgraph compiler: TOLERANCE["eager"]), and
what runs un-graphed, beyond a graph's first calls, says why."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from apollo_compile.fallback import ApolloFallbackWarning
from apollo_compile.runtime import instances
from helpers import TOLERANCE, assert_same_loss_and_grads, runners, sgd_like_eager, twins  # noqa: F401 (the fixture)
from models import TwoTower, two_tower_inputs

EAGER = {"subgraph_compiler": "eager"}
# TwoTower with one block a tower: its instances share whole graphs, which needs no depth, and each
# block is more graph to trace and plan (the repeated layers below are models of their own)
LAYERS = 1


def compiled_twins(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(model, its eager twin with the same weights, the model compiled by apollo)."""
    return model, copy.deepcopy(model), torch.compile(model, backend="apollo", options=EAGER)


def families_reading(forward, model) -> int:
    """How many of the graph's families read `model`'s parameters in place (their addresses)."""
    params = {p.data_ptr() for p in model.parameters()}
    return sum(1 for f in forward.family.instances.families
               if f.key is not None and f.key.ptrs and set(f.key.ptrs.values()) & params)


def test_two_live_instances_each_replay_graphs_of_their_own(runners):
    """Two models of one class trained in turn (an ensemble): the second gets a family of its own
    (its parameters, its pool), the first keeps replaying its graphs, nothing runs un-graphed after
    the graph's first call, and no warning."""
    first, first_ref, first_compiled = twins("eager", LAYERS)
    torch.manual_seed(1)
    second, second_ref, second_compiled = compiled_twins(TwoTower(layers=LAYERS))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        for _ in range(3):
            sgd_like_eager(first_compiled, first, first_ref, 1)
            sgd_like_eager(second_compiled, second, second_ref, 1)
    forward, backward = runners  # the same graphs for both: no recompile
    for runner in runners:
        summary = runner.summary()
        assert summary["instances"] == 2 and summary["ungraphed_calls"] == 0, summary
    assert families_reading(forward, first) == families_reading(forward, second) == 1
    assert forward.summary()["replays"] == 5  # six calls: the graph's first ran eagerly


def test_a_new_instance_takes_over_the_family_of_one_that_is_gone(runners):
    """A second TwoTower after the first is deleted: the family captured for the first is released
    (its graphs, its pool, and the old parameters' storages its static inputs held) and captured
    for the new one at its first call; nothing runs un-graphed, training equals eager."""
    model, ref, compiled = twins("eager", LAYERS)
    sgd_like_eager(compiled, model, ref, 3)
    forward, backward = runners
    gone = [weakref.ref(p) for p in model.parameters()]
    del model, ref, compiled
    gc.collect()
    assert all(r() is None for r in gone)

    torch.manual_seed(1)
    model, ref, compiled = compiled_twins(TwoTower(layers=LAYERS))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        sgd_like_eager(compiled, model, ref, 3)
    assert len(runners) == 2  # the same graphs, not a recompile
    for runner in runners:
        summary = runner.summary()
        assert (summary["instances"], summary["instances_released"]) == (1, 1), summary
        assert runner.replays == 5 and summary["ungraphed_calls"] == 0
    params = {p.data_ptr() for p in model.parameters()}
    read_in_place = {forward.captured.static_inputs[i].data_ptr()
                     for i in forward.static_input_idxs.intersection(forward.captured.fixed_ptrs)}
    assert read_in_place and read_in_place <= params  # the new instance's parameters, not the old ones


def test_a_deleted_model_frees_its_family_without_another_call(runners):
    """A model deleted and never called again (the next one compiled with other options, which
    Dynamo compiles anew): its family is released at once, with the old parameters' storages its
    static inputs held (NOTE: A gone instance's memory goes at once), not at a call that never
    comes."""
    model, ref, compiled = twins("eager", LAYERS)
    sgd_like_eager(compiled, model, ref, 3)
    forward, backward = runners
    assert forward.graph is not None and forward.captured.static_inputs
    held = [x for x in forward.captured.static_inputs if isinstance(x, torch.Tensor)]
    storages = {x.untyped_storage().data_ptr() for x in held}
    assert storages & {p.untyped_storage().data_ptr() for p in model.parameters()}
    del model, ref, compiled, held
    gc.collect()
    for runner in runners:
        summary = runner.summary()
        assert (summary["instances"], summary["instances_released"]) == (1, 1), summary
        assert runner.graph is None and runner.captured is None and runner.family.pool is None


def test_a_deleted_model_whose_saved_activations_live_is_freed_when_they_die(runners):
    """Deleted after a forward whose loss is kept: the family waits for those saved activations
    (its backward could still come), and is released when they die, with no call in between."""
    model, ref, compiled = twins("eager", LAYERS)
    sgd_like_eager(compiled, model, ref, 2)
    loss = compiled(*two_tower_inputs(seed=7))  # its autograd graph keeps the parameters alive
    forward, _ = runners
    del model, ref, compiled
    gc.collect()
    assert forward.summary()["instances_released"] == 0 and forward.graph is not None
    del loss
    gc.collect()
    assert forward.summary()["instances_released"] == 1 and forward.graph is None


def test_no_family_is_released_during_a_call(runners, monkeypatch):
    """A collection inside a call (any thread's) leaves the gone family to the graph's next
    dispatch: the call's own families must not change under it."""
    model, ref, compiled = twins("eager", LAYERS)
    sgd_like_eager(compiled, model, ref, 2)
    forward, _ = runners
    instances.call_began()
    try:
        del model, ref, compiled
        gc.collect()
        assert forward.summary()["instances_released"] == 0 and forward.family.instances.some_gone
    finally:
        instances.call_ended()
    torch.manual_seed(1)
    model, ref, compiled = compiled_twins(TwoTower(layers=LAYERS))  # the same graph's next dispatch releases it
    sgd_like_eager(compiled, model, ref, 2)
    assert forward.summary()["instances_released"] == 1 and forward.summary()["instances"] == 1


def test_a_new_instance_takes_over_for_inference_too(runners):
    """The same for a graph run under torch.no_grad() (an inference graph, no backward)."""
    for seed in range(2):
        torch.manual_seed(seed)
        model, ref, compiled = compiled_twins(TwoTower(layers=LAYERS))
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", ApolloFallbackWarning)
            for i in range(3):
                inputs = two_tower_inputs(seed=i)
                torch.testing.assert_close(compiled(*inputs), ref(*inputs), **TOLERANCE["eager"])
        del model, ref, compiled
        gc.collect()
    (runner,) = runners
    summary = runner.summary()
    assert runner.kind == "inference" and runner.replays == 2 + 3
    # the first model's family served the second; the second's was released when it was deleted
    assert (summary["instances"], summary["instances_released"]) == (1, 2)


def test_a_sweep_over_new_models_needs_no_help_from_the_user(runners):
    """A sweep: each run builds, compiles and trains a new model, and the last run's loss (its
    autograd graph holding the old parameters) is rebound only once the new model's first forward
    returns. That forward gets a family of its own; the old one is released once the old model is
    gone and serves the run after. No call runs un-graphed, no warning, training equals eager."""
    steps = instances.MIN_REPLAYS + 2  # a run long enough not to count as a short-lived instance
    with warnings.catch_warnings():  # the loop written out, not sgd_like_eager: `loss` outlives each run into the next
        warnings.simplefilter("error", ApolloFallbackWarning)
        for run in range(3):
            torch.manual_seed(run)
            model, ref, compiled = compiled_twins(TwoTower(layers=LAYERS))
            opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
            for step in range(steps):
                inputs = two_tower_inputs(seed=step)
                loss, ref_loss = compiled(*inputs), ref(*inputs)
                loss.backward()
                ref_loss.backward()
                assert_same_loss_and_grads(loss, ref_loss, model, ref, TOLERANCE["eager"], step)
                for o in (opt, ref_opt):
                    o.step()
                    o.zero_grad(set_to_none=True)
    for runner in runners:
        summary = runner.summary()
        assert summary["instances"] == 2 and summary["instances_released"] == 2, summary
        assert summary["ungraphed_calls"] == 0 and summary["replays"] == 3 * steps - 1


class Layer(nn.Module):
    """A residual MLP layer; `graph_break` puts a graph break inside its forward, which makes the
    forward a frame of its own that Dynamo compiles once for every layer."""

    def __init__(self, width: int, graph_break: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.graph_break = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if self.graph_break:
            print("", end="")  # graph break
        return x + self.fc2(h)


def stack_inputs(seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)),)


def last_step_replays_every_call(runners, compiled, model, ref) -> dict[str, int]:
    """Three SGD steps of `compiled` against its eager twin on stack_inputs, then a fourth in which
    every graph replays once per instance it serves, with no warning and no call un-graphed since
    the first; returns graph name -> the instances it serves."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        sgd_like_eager(compiled, model, ref, 3, make_inputs=stack_inputs)
        before = [r.summary()["replays"] for r in runners]
        sgd_like_eager(compiled, model, ref, 1, make_inputs=stack_inputs)
    served = {r.name: r.summary()["instances"] for r in runners}
    for runner, replays in zip(runners, before):
        assert runner.summary()["replays"] - replays == served[runner.name], runner.name
    assert not [r.name for r in runners if r.summary()["ungraphed_calls"]]
    return served


class Stack(nn.Module):
    def __init__(self, depth: int = 3, width: int = 16, graph_break: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(width, graph_break) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


@pytest.mark.parametrize("how", ["regional", "graph break in the layer"])
def test_every_layer_of_a_stack_replays_the_one_graph_compiled_for_its_class(runners, how):
    """Repeated layers compiled one by one (regional compilation) or a graph break inside the
    layer's forward: Dynamo compiles the layer's forward for the first layer, then once more for
    all the others, which call that graph with their own parameters. Each layer gets a family; the
    last step replays every call, and none ran un-graphed beyond the first step's (a first forward
    call runs eagerly, and so does its backward, wherever it comes in the step)."""
    depth = 4
    torch.manual_seed(0)
    model = Stack(depth, graph_break=how != "regional")
    ref = copy.deepcopy(model)
    if how == "regional":
        for layer in model.layers:
            layer.compile(backend="apollo", options=EAGER)
        compiled = model
    else:
        compiled = torch.compile(model, backend="apollo", options=EAGER)
    served = last_step_replays_every_call(runners, compiled, model, ref)
    shared = [r for r in runners if served[r.name] == depth - 1]  # the layers after the first
    assert shared and {r.kind for r in shared} == {"forward", "backward"}, served
    forward = next(r for r in shared if r.kind == "forward")
    assert [families_reading(forward, layer) for layer in model.layers] == [0] + [1] * (depth - 1)


class SharedStack(nn.Module):
    """One layer applied `depth` times (ALBERT's sharing across depth), breaking the graph inside."""

    def __init__(self, depth: int = 3, width: int = 16) -> None:
        super().__init__()
        self.depth, self.layer, self.head = depth, Layer(width, graph_break=True), nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.depth):
            x = self.layer(x)
        return self.head(x).square().mean()


def test_a_layer_shared_across_depth_replays_a_family_per_application(runners):
    """The same layer (one set of parameters) called three times before the backward: a call that
    finds an earlier one's saved activations alive replays another family bound to the same
    parameters; the last step replays every call and training equals eager."""
    torch.manual_seed(0)
    model, ref, compiled = compiled_twins(SharedStack())
    served = last_step_replays_every_call(runners, compiled, model, ref)
    # Dynamo compiles the layer's two pieces for its first application and again for the others
    # (their input requires grad): those graphs serve two applications of one parameter set
    assert sorted(set(served.values())) == [1, 2] and list(served.values()).count(2) == 4, served


class Encoder(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_one_instance_twice_before_its_backward(runners, set_to_none):
    """Two views through one encoder, one backward (a Siamese or SimCLR step): the second forward
    finds the first's saved activations alive, so it replays a second family bound to the same
    parameters; each backward finds its own. The gradients from both add up as eager's do, whether
    .grad starts each step as None (the first backward's lent gradient becomes it, the second's is
    added into it, in the other family's memory) or as a zeroed tensor."""
    torch.manual_seed(0)
    encoder, ref, compiled = compiled_twins(Encoder())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            a, b = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
            loss = (compiled(a) - compiled(b)).square().mean()
            ref_loss = (ref(a) - ref(b)).square().mean()
            loss.backward()
            ref_loss.backward()
            assert_same_loss_and_grads(loss, ref_loss, encoder, ref, TOLERANCE["eager"], step)
            encoder.zero_grad(set_to_none=set_to_none)
            ref.zero_grad(set_to_none=set_to_none)
    for runner in runners:
        summary = runner.summary()
        assert summary["instances"] == 2 and summary["ungraphed_calls"] == 0, summary


def test_parameters_replaced_in_place_release_their_family(runners):
    """p.data = ... moves every parameter: the family bound to the old addresses can never replay
    again, so it is released and captured anew for the new ones (no second family kept)."""
    model, ref, compiled = twins("eager", LAYERS)
    sgd_like_eager(compiled, model, ref, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        sgd_like_eager(compiled, model, ref, 3)
    for runner in runners:
        summary = runner.summary()
        assert summary["instances"] == 1 and summary["instances_released"] == 1 and summary["ungraphed_calls"] == 0


def test_past_the_most_instances_a_graph_keeps_calls_run_ungraphed_and_say_why(runners, monkeypatch):
    """MAX_FAMILIES (2 here): a third live model of the class trains without CUDA graphs, correctly,
    with one warning naming the limit; the first two keep theirs."""
    monkeypatch.setattr(instances, "MAX_FAMILIES", 2)
    models = [twins("eager", LAYERS) for _ in range(3)]
    with pytest.warns(ApolloFallbackWarning, match="captured for 2 model instances already"):
        for _ in range(3):
            for model, ref, compiled in models:
                sgd_like_eager(compiled, model, ref, 1)
    forward, backward = runners
    assert forward.summary()["instances"] == 2
    assert forward.summary()["ungraphed_calls"] == 3 - 1  # the third model's calls, less the first capture call


def test_an_instance_replaced_every_step_stops_being_captured(runners):
    """A new model instance every step (a copy per step): each would be a capture for one replay.
    After MAX_SHORT_LIVED such families are released, new instances run un-graphed with one
    warning that says so; training stays equal to eager."""
    torch.manual_seed(0)
    base = TwoTower(layers=LAYERS)
    with pytest.warns(ApolloFallbackWarning, match=f"were replaced within {instances.MIN_REPLAYS} calls"):
        for step in range(8):
            model, ref, compiled = compiled_twins(copy.deepcopy(base))
            inputs = two_tower_inputs(seed=step)
            loss, ref_loss = compiled(*inputs), ref(*inputs)
            loss.backward()
            ref_loss.backward()
            assert_same_loss_and_grads(loss, ref_loss, model, ref, TOLERANCE["eager"], step)
            del model, ref, compiled, loss, ref_loss
            gc.collect()
    forward = runners[0]
    assert forward.family.instances.short_lived == instances.MAX_SHORT_LIVED


def test_a_decoder_layer_that_breaks_the_graph_replays_a_family_per_layer(runners):
    """Model code nobody here wrote: Hugging Face Qwen2-VL (benchmarks/probes/hf_zoo.py's tiny
    config: two decoder layers, random weights) breaks the graph inside its decoder layer, so some
    frames of the layer's forward are compiled once and called by both layers. With CUDA graphs
    (fake ones, on the CPU) each such graph keeps a family per layer, four AdamW steps match eager's
    (hf_zoo's rtol 1e-4 / atol 1e-5 per element; the eager subgraph compiler runs eager's ops), and
    nothing runs un-graphed beyond the first step, with no warning."""
    transformers = pytest.importorskip("transformers")
    import hf_zoo

    if not hasattr(transformers, hf_zoo.MODEL_CLASSES["qwen2-vl"]):
        pytest.skip(f"transformers {transformers.__version__} has no {hf_zoo.MODEL_CLASSES['qwen2-vl']}")
    out = hf_zoo.run_one("qwen2-vl", "apollo", "module", steps=4, options=EAGER, rtol=1e-4, atol=1e-5)
    assert out.status == "PASS" and not out.warnings, (out.status, out.worst_grad, out.warnings, out.error)
    shared = [r for r in runners if r.summary()["instances"] == 2]  # frames both layers call
    assert {r.kind for r in shared} == {"forward", "backward"}, [(r.name, r.summary()["instances"]) for r in runners]
    assert not [r.name for r in runners if r.summary()["ungraphed_calls"] or r.disabled]


def test_a_backward_finds_its_family_by_its_saved_inputs_alone():
    """GraphInstances.backward_runner: the first saved input (not a gradient of the forward's
    outputs, AOTAutograd's tangents) whose address a captured forward wrote names the family; one an
    un-graphed forward saved, while alive, sends the call un-graphed; a tangent at a captured
    address decides nothing."""
    from apollo_compile.runtime.instances import GraphFamily
    from helpers import runner_for

    first_family = GraphFamily()
    other = first_family.sibling()
    group = first_family.instances
    group.families.append(other)
    backward = runner_for({"lanes": lambda args: args}, "g_backward", "backward", first_family, saved_idxs=[0, 1])
    mine, theirs, tangent = torch.zeros(2), torch.ones(2), torch.full((2,), 3.0)
    group.captured(first_family, [mine])
    group.captured(other, [theirs, tangent])
    routed = group.backward_runner(backward, [theirs, mine, tangent])
    assert routed is not backward and routed.family is other and routed.first is backward
    assert group.backward_runner(backward, [mine, theirs, tangent]) is backward
    assert group.backward_runner(backward, [torch.zeros(1), torch.zeros(1), tangent]) is backward  # tangent ignored
    eager, kept = torch.zeros(3), torch.zeros(4)
    view = kept[:2]  # saved too, at its base's address
    group.ran_eagerly([eager, kept, view], warm_up=True, inputs=set())
    assert group.backward_runner(backward, [eager, mine, tangent]) is None and group.warm_up_backward
    gone = eager.data_ptr()
    del eager  # its address counts no more (another tensor may take it); the output still alive does
    assert group.backward_runner(backward, [torch.zeros(3), mine, tangent]) is backward
    assert gone not in group.eager_saved and set(group.eager_saved) == {kept.data_ptr()}
    del kept  # the saved view at its address still lives
    assert group.backward_runner(backward, [view, mine, tangent]) is None
    del view
    assert group.backward_runner(backward, [torch.zeros(3), mine, tangent]) is backward and not group.eager_saved
    # an input the forward saved as-is (a batch reused every step) routes its own backward only
    batch, written = torch.zeros(5), torch.zeros(6)
    group.ran_eagerly([batch, written], warm_up=True, inputs={batch.untyped_storage().data_ptr()})
    assert group.backward_runner(backward, [batch, written, tangent]) is None
    assert set(group.eager_saved) == {written.data_ptr()}  # the written one counts while it lives
    del written
    assert group.backward_runner(backward, [batch, mine, tangent]) is backward and not group.eager_saved
