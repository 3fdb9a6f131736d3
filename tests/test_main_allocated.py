"""A backward's side lane writes its gradients into buffers the main lane allocated
(passes/main_allocated.py): same results as eager, the buffers where the codegen says, and only
where it is safe."""

import networkx as nx
import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import apollo_compile
from apollo_compile.lane_plan import LanePlan, Subgraph
from apollo_compile.ops.mm_into import mm_into
from apollo_compile.passes import main_allocated
from helpers import assert_trains_like_eager
from models import TextTower, TwoTower, VisionTower, two_tower_inputs
from helpers import assert_runtimes_equal_the_graph


@pytest.fixture
def every_size(monkeypatch):
    """The test models' gradients are far under the 1 MiB a real one must reach: take them all."""
    monkeypatch.setattr(main_allocated, "MIN_BYTES", 0)


def uneven_two_tower() -> TwoTower:
    """A vision tower four times the text tower's depth: the text lane can wait for the vision
    lane's head and still end first, as a text tower at batch 8 does."""
    model = TwoTower()
    model.vision, model.text = VisionTower(layers=4), TextTower(layers=1)
    return model


def compile_two_tower(options=None):
    torch.manual_seed(0)
    compiled = torch.compile(uneven_two_tower(), backend="apollo",
                             options={"subgraph_compiler": "eager", **(options or {})})
    compiled(*two_tower_inputs(batch=64)).backward()
    return apollo_compile.last_plan()


def test_the_side_lane_tail_writes_into_what_the_main_lane_allocates_after_its_head(every_size):
    plan = compile_two_tower()
    chosen = plan.backward.decisions["main_allocated"]
    assert len(chosen.values) == 1 and chosen.nbytes > 0
    assert plan.backward.summary()["main_allocated"] == chosen.summary()  # in the dumps and the benchmarks' rows
    lanes = plan.backward.decisions["lanes"]
    (writer,) = [lanes.subgraphs[i] for i in chosen.values]
    head = lanes.subgraphs[writer.allocate_after]
    assert writer.lane != 0 and head.lane == 0
    assert lanes.dag.has_edge(head.id, writer.id)  # the writer waits for the head that frees the memory
    assert [n.name for n in writer.main_allocated] == chosen.values[writer.id]
    body = plan.backward.decisions["codegen"].text.splitlines()
    head_launch = next(i for i, line in enumerate(body) if f"= subgraph_{head.id}(" in line)
    writer_launch = next(i for i, line in enumerate(body) if f"= subgraph_{writer.id}(" in line)
    allocs = [i for i, line in enumerate(body) if "rt.empty(" in line]
    assert len(allocs) == len(writer.main_allocated)
    assert head_launch < min(allocs) and max(allocs) < writer_launch
    assert all(body[i].startswith("    ") and not body[i].startswith("        ") for i in allocs)  # main stream
    assert any(f"rt.wait({head.id})" in line for line in body[max(allocs):writer_launch])
    # the forward's side-lane outputs are saved activations: that lane makes and frees them
    assert not plan.forward.decisions["main_allocated"].values
    assert "rt.empty(" not in plan.forward.decisions["codegen"].text
    # on one lane each buffer comes right before the subgraph that writes it
    single = plan.backward.decisions["codegen"].one_lane.text.splitlines()
    launch = next(i for i, line in enumerate(single) if f"# subgraph {writer.id}:" in line)
    allocs = [i for i, line in enumerate(single) if "rt.empty(" in line]
    assert allocs == list(range(launch + 1, launch + 1 + len(writer.main_allocated)))


def test_lane_and_one_lane_runtimes_with_main_allocated_buffers_equal_the_graph(every_size):
    graph = compile_two_tower().backward
    assert graph.decisions["main_allocated"].values
    assert_runtimes_equal_the_graph(graph)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_trains_like_eager_with_main_allocated_gradients(every_size, compiler):
    torch.manual_seed(0)
    assert_trains_like_eager(uneven_two_tower(), lambda step: two_tower_inputs(batch=64, seed=step),
                             options={"subgraph_compiler": compiler})
    assert apollo_compile.last_plan().backward.decisions["main_allocated"].values


def test_not_under_a_memory_budget(every_size):
    # those graphs replay one lane: buffers allocated ahead would only raise the peak
    chosen = compile_two_tower({"memory_budget": 0.5}).backward.decisions["main_allocated"]
    assert not chosen.values and "memory first" in chosen.reason


def test_small_gradients_stay_with_their_lane(monkeypatch):
    graph = compile_two_tower().backward
    chosen = graph.decisions["main_allocated"]
    assert not chosen.values and "1 MiB" in chosen.reason
    monkeypatch.setattr(main_allocated, "ENABLED", False)
    unchanged = compile_two_tower().backward.decisions["lanes"].subgraphs
    assert len(graph.decisions["lanes"].subgraphs) == len(unchanged)  # nothing cut


def _plan_for(build):
    """A one-subgraph side lane over a hand-built backward: `build(graph, x)` returns its outputs,
    which come back in graph order after the plan."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    outs = build(graph, x)
    graph.output(tuple(outs))
    gm = torch.fx.GraphModule({}, graph)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.randn(4, 4)))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    outputs = [n for n in nodes if n in set(outs)]
    dag = nx.DiGraph()
    dag.add_node(0)
    return gm, LanePlan({1: ["text"]}, [Subgraph(0, 1, nodes, [x], outputs)], dag, [0]), outputs


def test_only_matmuls_that_alias_nothing_else_are_chosen(every_size):
    aten = torch.ops.aten

    def build(graph, x):
        alone = graph.call_function(aten.mm.default, (x, x))
        weight_grad = graph.call_function(aten.t.default, (graph.call_function(aten.mm.default, (x, x)),))
        pointwise = graph.call_function(aten.mul.Tensor, (x, 2.0))  # not written in place: a temporary
        base = graph.call_function(aten.mm.default, (x, x))
        view_of_base = graph.call_function(aten.t.default, (base,))  # a copy would split it from its base
        view_of_input = graph.call_function(aten.view.default, (x, [16]))  # aliases the graph's input
        return [alone, weight_grad, pointwise, base, view_of_base, view_of_input]

    gm, plan, outputs = _plan_for(build)
    assert [n.name for n in main_allocated.eligible(gm, plan.subgraphs[0])] == [outputs[0].name, outputs[1].name]
    assert main_allocated.choose(gm, plan, "forward", memory_first=False).values == {}


def test_a_transposed_matmul_is_written_as_the_transposes_product():
    a, b, out = torch.randn(5, 3), torch.randn(3, 4), torch.empty(4, 5).t().contiguous().t()
    mm_into(out, b.t(), a.t())
    torch.testing.assert_close(out, (a @ b).t(), rtol=0, atol=1e-6)
    mm_into(out := torch.empty(5, 4), a.bfloat16(), b.bfloat16(), torch.float32)
    torch.testing.assert_close(out, a.bfloat16().float() @ b.bfloat16().float(), rtol=1e-2, atol=1e-2)
