"""The apollo backend end to end on CPU: training and inference match eager PyTorch."""

import subprocess
import sys
import warnings

import pytest
import torch

import apollo_compile
from helpers import assert_trains_like_eager
from models import MLP, GraphBreakModel, TwoTower, two_tower_inputs


def two_tower_batches(step):
    return two_tower_inputs(batch=4, seed=step)


def mlp_batches(step):
    return (torch.randn(8, 32, generator=torch.Generator().manual_seed(step)),)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_two_tower_trains_like_eager(compiler):
    # one layer a tower: the model test_cudagraph_training compiles, so Inductor builds its kernels once
    torch.manual_seed(0)
    assert_trains_like_eager(TwoTower(layers=1), two_tower_batches, {"subgraph_compiler": compiler})
    plan = apollo_compile.last_plan()
    assert plan.forward is not None and plan.backward is not None
    assert plan.forward.fallback is None and plan.backward.fallback is None
    # two lanes: the costliest tower shares the main lane with the joins, the other has its own
    assert len(plan.forward.lanes.lanes) == 2 and len(plan.backward.lanes.lanes) == 2


class SwappingTowers(torch.nn.Module):
    """Tower a: a dear forward (frozen layers) and a cheap backward; tower b the other way round."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)], torch.nn.Linear(256, 16))
        for layer in list(self.a)[:-1]:
            layer.requires_grad_(False)
        self.b = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                     torch.nn.ReLU(), torch.nn.Linear(128, 16))

    def forward(self, x, y):
        return (self.a(x) * self.b(y)).sum()


def test_backward_keeps_the_forwards_main_lane_tower():
    # by its own estimates the backward would put b on the main lane (it did, before the rule below);
    # a tower that changes streams between the graphs can donate none of its saved activations
    torch.manual_seed(0)
    assert_trains_like_eager(SwappingTowers(), lambda i: (torch.randn(32, 256), torch.randn(32, 64)),
                             {"subgraph_compiler": "eager", "device": "H200"})
    plan = apollo_compile.last_plan()
    assert plan.forward.lanes.lanes == {0: ["a", "fusion"], 1: ["b"]}
    assert plan.backward.lanes.lanes == plan.forward.lanes.lanes
    assert "a on the main lane, as in the forward" in plan.backward.lanes.reason


def test_two_tower_one_lane_trains_like_eager():
    torch.manual_seed(0)
    assert_trains_like_eager(TwoTower(), two_tower_batches, {"subgraph_compiler": "eager", "max_lanes": 1})
    plan = apollo_compile.last_plan()
    assert len(plan.forward.lanes.subgraphs) == 1 and len(plan.backward.lanes.subgraphs) == 1


def test_dropout_model_trains_like_eager():
    # dropout masks are drawn in the forward and saved for the backward: same RNG stream as eager
    torch.manual_seed(0)
    model = TwoTower(dropout=0.2)
    ref = __import__("copy").deepcopy(model)
    compiled = torch.compile(model, backend="apollo", options={"subgraph_compiler": "eager"})
    inputs = two_tower_inputs()
    torch.manual_seed(1)
    loss = compiled(*inputs)
    loss.backward()
    torch.manual_seed(1)
    ref_loss = ref(*inputs)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_mlp_single_branch(compiler):
    torch.manual_seed(0)
    assert_trains_like_eager(MLP(), mlp_batches, {"subgraph_compiler": compiler})
    plan = apollo_compile.last_plan()
    assert list(plan.forward.lanes.lanes) == [0] and len(plan.forward.lanes.subgraphs) == 1


def test_graph_break_gives_each_graph_its_plan():
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    assert_trains_like_eager(GraphBreakModel(), mlp_batches, {"subgraph_compiler": "eager"})
    names = [p.name for p in apollo_compile.plans()]
    assert len(names) == 2 and len(set(names)) == 2
    assert all(p.forward is not None and p.backward is not None for p in apollo_compile.plans())


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_inference_matches_eager(compiler):
    torch.manual_seed(0)
    model = TwoTower().eval()
    compiled = torch.compile(model, backend="apollo", options={"subgraph_compiler": compiler})
    inputs = two_tower_inputs()
    with torch.no_grad():
        out = compiled(*inputs)
        ref = model(*inputs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert apollo_compile.last_plan().inference is not None


def test_every_node_is_labelled_in_forward_and_backward():
    torch.manual_seed(0)
    compiled = torch.compile(TwoTower(), backend="apollo", options={"subgraph_compiler": "eager"})
    compiled(*two_tower_inputs()).backward()
    plan = apollo_compile.last_plan()
    for graph in (plan.forward, plan.backward):
        for node in graph.gm.graph.nodes:
            ann = node.meta["apollo"]
            assert ann.modality in {"vision", "vision_proj", "text", "text_proj", "fusion"}, node
            if node.op == "call_function":
                assert ann.bound in ("compute", "memory", "-"), node
                assert ann.subgraph is not None, node
    mods = {n.meta["apollo"].modality for n in plan.forward.gm.graph.nodes}
    assert {"vision", "text", "fusion"} <= mods


def test_modalities_option_maps_prefixes():
    torch.manual_seed(0)
    options = {"subgraph_compiler": "eager",
               "modalities": {"vision": "image", "vision_proj": "image", "text": "language", "text_proj": "language"}}
    compiled = torch.compile(TwoTower(), backend="apollo", options=options)
    compiled(*two_tower_inputs()).backward()
    plan = apollo_compile.last_plan()
    for graph in (plan.forward, plan.backward):
        assert {n.meta["apollo"].modality for n in graph.gm.graph.nodes} == {"image", "language", "fusion"}


def test_recompilation_on_new_shape_and_reset():
    torch.manual_seed(0)
    model = TwoTower()
    compiled = torch.compile(model, backend="apollo", options={"subgraph_compiler": "eager"}, dynamic=False)
    for batch in (4, 6):
        out = compiled(*two_tower_inputs(batch=batch))
        torch.testing.assert_close(out, model(*two_tower_inputs(batch=batch)))
    torch._dynamo.reset()
    torch.testing.assert_close(compiled(*two_tower_inputs()), model(*two_tower_inputs()))


def test_pass_failure_falls_back_with_one_warning(monkeypatch):
    from apollo_compile import pipeline

    def broken(gm, ctx):
        raise RuntimeError("synthetic failure")

    monkeypatch.setattr(pipeline, "GRAPH_PASSES", [("modality", broken)] + pipeline.GRAPH_PASSES[1:])
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_trains_like_eager(MLP(), mlp_batches, {"subgraph_compiler": "eager"}, steps=2)
    messages = [str(w.message) for w in caught if issubclass(w.category, apollo_compile.ApolloFallbackWarning)]
    assert len(messages) == 2, messages  # one for the forward graph, one for the backward
    assert all("modality" in m and "synthetic failure" in m for m in messages)
    assert apollo_compile.last_plan().forward.fallback


def test_strict_raises_instead_of_falling_back(monkeypatch):
    from apollo_compile import pipeline

    def broken(gm, ctx):
        raise RuntimeError("synthetic failure")

    monkeypatch.setattr(pipeline, "GRAPH_PASSES", [("modality", broken)])
    compiled = torch.compile(MLP(), backend="apollo", options={"strict": True, "subgraph_compiler": "eager"})
    with pytest.raises(Exception, match="synthetic failure"):
        compiled(torch.randn(2, 32))


def test_registered_without_import_when_installed():
    """After `pip install`, the entry point makes backend="apollo" work with no import."""
    from importlib.metadata import entry_points

    if not any(ep.name == "apollo" for ep in entry_points(group="torch_dynamo_backends")):
        pytest.skip("apollo_compile is not pip-installed here (the CI installs it)")
    code = (
        "import sys, torch\n"
        "assert 'apollo' in torch._dynamo.list_backends(), torch._dynamo.list_backends()\n"
        "m = torch.nn.Linear(4, 4)\n"
        "c = torch.compile(m, backend='apollo', options={'subgraph_compiler': 'eager'})\n"
        "c(torch.randn(2, 4)).sum().backward()\n"
        "assert 'apollo_compile' in sys.modules\n"
        "import apollo_compile\n"
        "assert torch._dynamo.list_backends().count('apollo') == 1\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_inductor_subgraphs_get_inductors_joint_graph_passes(monkeypatch):
    """With Inductor compiling the subgraphs, the joint graph goes through Inductor's own joint
    passes first (as in torch.compile's default backend): here a pointless bf16->fp32->bf16 cast
    pair disappears. Gradients are those of Inductor's own backend, and without the passes those of
    eager: with the pair gone the gradient skips a bf16 rounding that eager makes, 1.6% apart on
    torch 2.11 (Inductor's default backend alike), not at all on 2.13."""
    import apollo_compile
    from apollo_compile import pipeline

    class CastPair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x).to(torch.bfloat16)
            return h.to(torch.float32).to(torch.bfloat16).float().square().sum()

    def casts_in_forward(reference) -> int:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, x = CastPair(), torch.randn(4, 8)
        ref = CastPair()
        ref.load_state_dict(model.state_dict())
        torch.compile(model, backend="apollo", options={"subgraph_compiler": "inductor"})(x).backward()
        reference(ref)(x).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        gm = apollo_compile.last_plan().forward.gm
        return sum("convert_element_type" in str(n.target) for n in gm.graph.nodes)

    with_passes = casts_in_forward(torch.compile)
    monkeypatch.setattr(pipeline, "inductor_joint_passes", lambda gm, joint_inputs: gm)
    assert with_passes < casts_in_forward(lambda module: module)


class WithConstant(torch.nn.Module):
    """A tensor built inside forward: AOTAutograd lifts it as a get_attr constant (_tensor_constant0),
    as in Hugging Face LLaVA's forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return (self.lin(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum()


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_lifted_constant_is_read_inside_its_subgraph(compiler):
    """A subgraph reading a get_attr constant holds the constant itself: the runtime passed it as an
    input it never bound (UnboundLocalError at the first call, on tiny HF LLaVA too)."""
    torch.manual_seed(0)
    assert_trains_like_eager(WithConstant(), lambda step: (torch.randn(2, 4),),
                             {"subgraph_compiler": compiler, "strict": True}, steps=2)
    assert any(n.op == "get_attr" for n in apollo_compile.last_plan().forward.gm.graph.nodes)


class ScatterMerge(torch.nn.Module):
    """Image features scattered into text embeddings at the image tokens, as HF LLaVA merges them."""

    def __init__(self):
        super().__init__()
        self.image = torch.nn.Linear(6, 8)
        self.embed = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, features, ids):
        text = self.embed(ids)
        mask = (ids == 19).unsqueeze(-1).expand_as(text)
        return self.head(text.masked_scatter(mask, self.image(features))).square().mean()


def scatter_inputs(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 19, (2, 10), generator=g)
    ids[:, 3:7] = 19  # 8 image tokens for the 8 feature rows
    return torch.randn(8, 6, generator=g), ids


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_masked_scatter_backward_is_computed_without_a_host_sync(compiler):
    """masked_scatter's backward (masked_select: its size is counted on the GPU, which a CUDA graph
    cannot capture) becomes nonzero_static of the known size; the gradients stay eager's."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    assert_trains_like_eager(ScatterMerge(), scatter_inputs, {"subgraph_compiler": compiler, "strict": True}, steps=2)
    backward = apollo_compile.last_plan().backward
    assert backward.decisions["sync_free"] == {"rewritten": 1}
    targets = {str(n.target) for n in backward.gm.graph.nodes}
    assert "aten.masked_scatter_backward.default" not in targets and "aten.nonzero_static.default" in targets
