"""An elementwise chain that is the last reader of a value writes its result into that value's
memory (runtime/subgraphs.py, ``written_in_place``): the sum of micro-batches' gradients takes the
first micro-batch's gradient's memory. The same results as without, and only
where nothing else can see the memory change."""

import operator

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from apollo_compile.annotations import info
from apollo_compile.lane_plan import Subgraph
from apollo_compile.runtime import subgraphs

aten = torch.ops.aten


def hand_built(build, lanes=(0, 0)):
    """Subgraph 0 (on lane `lanes[0]`) makes ``g = mm(x, x).t()``; subgraph 1 (on `lanes[1]`) runs
    what `build(graph, g, x, c)` adds and returns. Returns (graph module, subgraph 1, its outputs)."""
    graph = torch.fx.Graph()
    x, c = graph.placeholder("x"), graph.placeholder("c")
    mm = graph.call_function(aten.mm.default, (x, x))
    g = graph.call_function(aten.t.default, (mm,))
    first = [mm, g]
    outs = build(graph, g, x, c)
    graph.output(tuple(outs))
    gm = torch.fx.GraphModule({}, graph)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.randn(4, 4)), mode.from_tensor(torch.randn(4, 4)))
    rest = [n for n in gm.graph.nodes if n.op == "call_function" and n not in first]
    for n in first:
        info(n).lane = lanes[0]
    for n in rest:
        info(n).lane = lanes[1]
    inputs = list(dict.fromkeys(a for n in rest for a in n.all_input_nodes if a not in rest))
    return gm, Subgraph(1, lanes[1], rest, inputs, [n for n in rest if n in set(outs)]), outs


def mean_of_two(graph, g, x, c):
    total = graph.call_function(aten.add.Tensor, (g, c))
    return [graph.call_function(aten.div.Tensor, (total, 2))]


def run_subgraph(gm, sg, compiler):
    """Subgraph 1 compiled alone, run on the value subgraph 0 made: (its input g, its outputs)."""
    x, c = torch.randn(4, 4), torch.randn(4, 4)
    g = (x @ x).t()
    sub = subgraphs.extract(gm, sg)
    inputs = {"x": x, "c": c, "t_default": g}
    args = [inputs[n.name] for n in sg.inputs]
    fn = subgraphs.compile_subgraph(sub, subgraphs.example_inputs(sg), compiler, "inference")
    expected = (g + c) / 2
    return g, fn(list(args)), expected


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_mean_of_gradients_is_written_into_the_first(compiler):
    gm, sg, outs = hand_built(mean_of_two)
    assert {k.name: v.name for k, v in subgraphs.written_in_place(sg).items()} == {outs[0].name: "t_default"}
    g, (result,), expected = run_subgraph(gm, sg, compiler)
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert result.data_ptr() == g.data_ptr()  # no buffer of its own
    torch.testing.assert_close(g, expected, rtol=0, atol=0)


def test_a_value_another_lane_made_is_written_too():
    """The reading subgraph waits for the one that made it, and the runtime holds a value read
    across lanes until the join anyway: the sum a later micro-batch's lane makes takes the earlier
    micro-batch's gradient's memory (docs/design/lanes.md#staggered-sums)."""
    gm, sg, outs = hand_built(mean_of_two, lanes=(1, 0))
    assert {k.name: v.name for k, v in subgraphs.written_in_place(sg).items()} == {outs[0].name: "t_default"}


def test_a_value_read_elsewhere_or_returned_is_not_written():
    def read_twice(graph, g, x, c):
        return [*mean_of_two(graph, g, x, c), graph.call_function(aten.mul.Tensor, (g, 3.0))]

    def returned(graph, g, x, c):
        return [*mean_of_two(graph, g, x, c), g]

    def another_view_read(graph, g, x, c):  # the matmul's output read through a second view
        base = g.args[0]
        return [*mean_of_two(graph, g, x, c), graph.call_function(aten.sum.default, (base,))]

    for build in (read_twice, returned, another_view_read):
        gm, sg, _ = hand_built(build)
        assert subgraphs.written_in_place(sg) == {}, build.__name__


def test_a_graph_input_or_a_chain_of_another_layout_is_not_written():
    def input_only(graph, g, x, c):  # x is the caller's
        return [graph.call_function(aten.div.Tensor, (graph.call_function(aten.add.Tensor, (x, c)), 2))]

    def other_strides(graph, g, x, c):  # g is transposed, the chain's result laid out as c
        return [graph.call_function(aten.add.Tensor, (graph.call_function(aten.clone.default, (c,)), g))]

    def other_dtype(graph, g, x, c):
        return [graph.call_function(aten.add.Tensor, (g, graph.call_function(
            aten._to_copy.default, (c,), {"dtype": torch.float64})))]

    for build in (input_only, other_strides, other_dtype):
        gm, sg, _ = hand_built(build)
        assert subgraphs.written_in_place(sg) == {}, build.__name__


def test_the_chain_ends_where_its_value_is_read_twice():
    """add -> div -> (read twice): the div's value is the one written, read by both."""
    def chain(graph, g, x, c):
        mean, = mean_of_two(graph, g, x, c)
        return [graph.call_function(aten.mul.Tensor, (mean, 2.0)), graph.call_function(aten.neg.default, (mean,))]

    gm, sg, outs = hand_built(chain)
    written = subgraphs.written_in_place(sg)
    assert [(k.target, v.name) for k, v in written.items()] == [(aten.div.Tensor, "t_default")]
    g, results, _ = run_subgraph(gm, sg, "eager")
    mean = g.clone()  # g holds the mean now
    torch.testing.assert_close(results[0], mean * 2, rtol=0, atol=0)
    torch.testing.assert_close(results[1], -mean, rtol=0, atol=0)


def test_a_chain_reading_its_input_through_a_view_made_here_is_not_written():
    """Written through a view, the input's memory would take the chain's layout only where the
    compiler handles a write into a view: the chain must read the input itself."""
    graph = torch.fx.Graph()
    x, c = graph.placeholder("x"), graph.placeholder("c")
    mm = graph.call_function(aten.mm.default, (x, x))
    g = graph.call_function(aten.t.default, (mm,))
    mean = graph.call_function(aten.div.Tensor, (graph.call_function(aten.add.Tensor, (g, c)), 2))
    graph.output((mean,))
    gm = torch.fx.GraphModule({}, graph)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.randn(4, 4)), mode.from_tensor(torch.randn(4, 4)))
    rest = [n for n in gm.graph.nodes if n.op == "call_function" and n is not mm]
    for n in gm.graph.nodes:
        info(n).lane = 0
    assert subgraphs.written_in_place(Subgraph(1, 0, rest, [mm, c], [mean])) == {}


def test_an_item_of_a_tuple_op_is_written():
    """A layer norm's or a convolution's weight gradient is an item of its backward op's tuple, a
    tensor of its own: its sum is written into it like a matmul's."""
    graph = torch.fx.Graph()
    x, c = graph.placeholder("x"), graph.placeholder("c")
    pair = graph.call_function(aten.aminmax.default, (x,), {"dim": 0})
    low = graph.call_function(operator.getitem, (pair, 0))
    mean = graph.call_function(aten.div.Tensor, (graph.call_function(aten.add.Tensor, (low, c)), 2))
    graph.output((mean,))
    gm = torch.fx.GraphModule({}, graph)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.randn(4, 4)), mode.from_tensor(torch.randn(4)))
    for n in gm.graph.nodes:
        info(n).lane = 0
    rest = [n for n in gm.graph.nodes if n.op == "call_function" and n not in (pair, low)]
    assert {k.name: v.name for k, v in subgraphs.written_in_place(Subgraph(1, 0, rest, [low, c], [mean])).items()} \
        == {mean.name: low.name}
