"""What crosses a cut between subgraphs (passes/lanes.py, passes/boundary.py): the boundary
recompute (a cheap elementwise value read across a cut is computed again where it is read, only
when that hands nothing new across, and the graph still computes the same), the items of a
multi-output op, which stay with it, a read of another lane's value, placed where it is used, and
a subgraph the recompute leaves empty, which is dropped."""

from __future__ import annotations

import os

import networkx as nx
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import apollo_compile
from apollo_compile.report import dump
from apollo_compile.report.cli import load_function
from apollo_compile.annotations import info
from apollo_compile.lane_plan import Subgraph
from apollo_compile.nodes import storage_node
from apollo_compile.passes import boundary, lanes
from helpers import assert_trains_like_eager

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cut(gm: torch.fx.GraphModule, first_of_second: str) -> list[Subgraph]:
    """Two subgraphs: the ops before the node whose name starts with `first_of_second`, and the rest."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    at = next(i for i, n in enumerate(ops) if n.name.startswith(first_of_second))
    subgraphs = [Subgraph(0, 0, ops[:at]), Subgraph(1, 1, ops[at:])]
    for sg in subgraphs:
        for n in sg.nodes:
            info(n).lane, info(n).subgraph = sg.lane, sg.id
    return subgraphs


def recomputed_at_relu_cut(f, *shapes: tuple[int, ...]) -> int:
    """How many values the boundary recompute takes off the cut of `f` (traced on random inputs of
    `shapes`) before its ReLU."""
    gm = make_fx(f)(*(torch.randn(*shape) for shape in shapes))
    return boundary.recompute_crossings(cut(gm, "relu"), gm.graph)["recomputed"]


def crossing(subgraphs: list[Subgraph], gm: torch.fx.GraphModule) -> set[str]:
    lanes.wire(subgraphs, list(gm.graph.nodes), nx.DiGraph([(0, 1)]))
    return {n.target.overloadpacket.__name__ for n in subgraphs[1].inputs if n.op == "call_function"}


def quick_gelu_then_backward(x: torch.Tensor, w: torch.Tensor):
    """A forward that keeps x * sigmoid(1.702 x) for a matmul, and a 'backward' that reads the
    sigmoid elementwise, with x (as a saved value) and the matmul's result."""
    s = torch.sigmoid(x * 1.702)
    h = (x * s) @ w
    g = torch.relu(h) @ w.t()  # the second subgraph starts at the ReLU
    return g * s * (1 + x * (1 - s) * 1.702)


def test_an_elementwise_value_read_across_the_cut_is_recomputed_there():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    gm = make_fx(quick_gelu_then_backward)(x, w)
    expected = gm(x, w)
    subgraphs = cut(gm, "relu")
    assert crossing([Subgraph(s.id, s.lane, list(s.nodes)) for s in subgraphs], gm) == {"sigmoid", "mm"}
    done = boundary.recompute_crossings(subgraphs, gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert done == {"recomputed": 1, "bytes": x.numel() * x.element_size()}
    assert crossing(subgraphs, gm) == {"mm"}  # the sigmoid is made again from x, a graph input
    assert not any(n.target is torch.ops.aten.sigmoid.default for n in subgraphs[1].inputs)
    copies = [n for n in subgraphs[1].nodes if n.target is torch.ops.aten.sigmoid.default]
    assert len(copies) == 1 and info(copies[0]).subgraph == 1 and info(copies[0]).recomputed
    original = next(n.name for n in gm.graph.nodes if n.target is torch.ops.aten.sigmoid.default and n is not copies[0])
    assert info(copies[0]).copy_of == original  # the dump's listing names it: mark copy-of-<original>
    assert f"copy-of-{original}" in dump.listing(gm, "cut").split(copies[0].name, 1)[1].splitlines()[0]
    torch.testing.assert_close(gm(x, w), expected, rtol=0, atol=0)


def test_the_copy_comes_before_every_reader_in_the_graph_whatever_the_subgraphs_order():
    """A subgraph's node list is a valid order of its own, not always the graph's (OWL-ViT's
    backward under Inductor): the copy goes before the first reader in the graph, or the graph reads
    it before it is made (the lanes pass's lint failed and the graph fell back to Inductor)."""
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    gm = make_fx(quick_gelu_then_backward)(x, w)
    expected = gm(x, w)
    subgraphs = cut(gm, "relu")
    second = subgraphs[1].nodes
    readers = [n for n in second if any(a.target is torch.ops.aten.sigmoid.default for a in n.all_input_nodes)]
    assert len(readers) == 2 and second.index(readers[0]) < second.index(readers[1])
    second.remove(readers[0])  # the graph's first reader of the sigmoid last in the subgraph's order
    second.insert(second.index(readers[1]) + 1, readers[0])
    done = boundary.recompute_crossings(subgraphs, gm.graph)
    assert done["recomputed"] == 1
    gm.graph.lint()
    gm.recompile()
    copy = next(n for n in second if n.target is torch.ops.aten.sigmoid.default)
    assert second.index(copy) < second.index(readers[1]) < second.index(readers[0])
    torch.testing.assert_close(gm(x, w), expected, rtol=0, atol=0)


def test_a_saved_alias_of_the_value_is_recomputed_too():
    """Autograd saves a ``detach`` of sigmoid's result for its backward: in a whole step both the
    sigmoid and its detach cross to the backward's subgraph, and the sigmoid's buffer is freed
    only when neither does (recomputing the sigmoid alone left the H200's peak where it was)."""
    def f(x, w):
        s = torch.sigmoid(x * 1.702)
        saved = s.detach()
        h = (x * s) @ w
        g = torch.relu(h) @ w.t()
        return g * s + g * saved * (1 - saved)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    gm = make_fx(f)(x, w)
    expected = gm(x, w)
    subgraphs = cut(gm, "relu")
    before = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert {n.target for n in before if n.target is torch.ops.aten.detach.default}  # make_fx kept the alias
    done = boundary.recompute_crossings(subgraphs, gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert done == {"recomputed": 2, "bytes": x.numel() * x.element_size()}, done  # one buffer, the sigmoid's
    assert crossing(subgraphs, gm) == {"mm"}
    assert not [n for n in subgraphs[1].inputs if storage_node(n).target is torch.ops.aten.sigmoid.default]
    torch.testing.assert_close(gm(x, w), expected, rtol=0, atol=0)


def test_a_view_read_by_a_matmul_keeps_its_elementwise_base_crossing():
    """The alias's readers decide as the value's do: a matmul reading the detach needs a buffer."""
    def f(x, w):
        s = torch.sigmoid(x)
        h = (x * s) @ w
        return torch.relu(h) @ s.detach()

    assert recomputed_at_relu_cut(f, (8, 8), (8, 8)) == 0


def test_a_value_a_matmul_reads_across_the_cut_is_handed_over():
    """Inductor would write a matmul's input to a buffer in the reading subgraph anyway."""
    def f(x, w):
        s = torch.sigmoid(x)
        h = (x * s) @ w
        return torch.relu(h) @ s.t()

    assert recomputed_at_relu_cut(f, (8, 8), (8, 8)) == 0


def test_a_value_made_from_random_numbers_is_never_recomputed():
    def f(x, w):
        kept = x * torch.bernoulli(torch.full_like(x, 0.5))  # dropout's mask, drawn once
        h = (kept * 2) @ w
        return torch.relu(h) * kept + x

    assert recomputed_at_relu_cut(f, (8, 8), (8, 8)) == 0


def test_nothing_new_crosses_and_written_inputs_are_not_read_again():
    """A parameter the graph overwrites is not at hand, even where the reading subgraph reads it
    (here to compute what it writes): a recomputation there could read the new value."""
    def f(x, w, p):
        s = torch.sigmoid(x * p)
        h = (x * s) @ w
        out = torch.relu(h) * s
        p.copy_(p * 0.5)  # an optimizer's write into the parameter, at the graph's end
        return out

    assert recomputed_at_relu_cut(f, (8, 8), (8, 8), (8, 8)) == 0


def test_the_items_of_a_multi_output_op_stay_in_its_subgraph():
    """docs/design/lanes.md#items-with-tuple: one foreach op on the main lane, each item read
    by another tower's matmul. The items are cut with the op, and leave its subgraph as tensors
    (a subgraph handing on the op's list made Inductor assert)."""
    def f(a, b):
        xs = torch._foreach_mul([a, b], 2.0)
        return xs[0] @ a, xs[1] @ b

    gm = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4))
    nodes = list(gm.graph.nodes)
    foreach = next(n for n in nodes if n.op == "call_function" and "_foreach_mul" in str(n.target))
    items = list(foreach.users)
    info(foreach).modality = "fusion"
    for item, tower in zip(items, ("vision", "text")):
        info(item).modality = tower
        for u in item.users:
            info(u).modality = tower
    subgraphs, dag = lanes.segment(nodes, {"fusion": 0, "vision": 1, "text": 2})
    lanes.wire(subgraphs, nodes, dag)
    home = info(foreach).subgraph
    assert {info(item).subgraph for item in items} == {home}
    assert subgraphs[home].outputs == items and foreach not in subgraphs[home].outputs
    assert {info(u).lane for item in items for u in item.users} == {1, 2}


def _label(gm: torch.fx.GraphModule, towers: dict[str, str]) -> list[torch.fx.Node]:
    """The graph's nodes, each op labelled with the tower its name's prefix maps to (else a join)."""
    nodes = list(gm.graph.nodes)
    for n in nodes:
        if n.op == "call_function":
            info(n).modality = next((m for prefix, m in towers.items() if n.name.startswith(prefix)), "fusion")
    return nodes


def test_a_read_across_lanes_waits_where_it_is_used():
    """docs/design/lanes.md#wait-where-read: a text node that reads a vision
    value, standing in graph order while the text tower's subgraph is open, is placed with its
    reader. The text subgraph before it waits for nothing of the vision lane; the reader's does."""
    def f(v, t, w):
        fv = torch.relu(v @ w)  # vision
        ft = t @ w  # text
        x = fv * 2.0  # text, reading vision's value, read only by text below
        ft = torch.tanh(ft)  # text goes on
        y = torch.sigmoid(ft + x)  # x's reader
        return fv.sum() + y.sum()

    gm = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
    nodes = _label(gm, {"mm_1": "text", "mul": "text", "tanh": "text", "add": "text", "sigmoid": "text",
                        "mm": "vision", "relu": "vision"})
    by_name = {n.name: n for n in nodes}
    add = next(n for n in nodes if n.name.startswith("add") and by_name["sigmoid"] in n.users)
    info(add).modality = "text"
    final = [n for n in nodes if n.op == "call_function" and n.name.startswith(("sum", "add")) and n is not add]
    for n in final:
        info(n).modality = "fusion"
    subgraphs, dag = lanes.segment(nodes, {"fusion": 0, "vision": 1, "text": 2})
    sg = {name: info(by_name[name]).subgraph for name in ("mm", "relu", "mm_1", "mul", "tanh", "sigmoid")}
    assert sg["mm_1"] == sg["tanh"] and sg["mul"] == info(add).subgraph == sg["sigmoid"] != sg["mm_1"], sg
    assert sg["relu"] not in nx.ancestors(dag, sg["mm_1"])
    assert sg["relu"] in nx.ancestors(dag, sg["mul"])


def test_a_held_read_of_an_input_is_placed_before_its_write():
    """A node held for its reader (NOTE: A lane waits for another where it reads it) that reads a
    graph input is placed before a later write into that input, as the graph has it."""
    def f(v, t, w):
        fv = torch.relu(v @ w)  # vision
        x = fv * w  # text, reading vision's value and the old w
        w.add_(1.0)  # text, a write into the input w (an update)
        return torch.sigmoid(t + x).sum()  # x's reader, text; the sum a join

    gm = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
    nodes = _label(gm, {"mm": "vision", "relu": "vision", "mul": "text", "add_": "text", "add": "text",
                        "sigmoid": "text"})
    write = next(n for n in nodes if n.op == "call_function" and n.target is torch.ops.aten.add_.Tensor)
    mul = next(n for n in nodes if n.op == "call_function" and n.target is torch.ops.aten.mul.Tensor)
    lane_of = {"fusion": 0, "vision": 1, "text": 2}
    assert lanes.waits_across_lanes(mul, lane_of)  # held: only text reads it
    subgraphs, dag = lanes.segment(nodes, lane_of)
    if info(mul).subgraph == info(write).subgraph:
        order = subgraphs[info(write).subgraph].nodes
        assert order.index(mul) < order.index(write)
    else:
        assert info(mul).subgraph in nx.ancestors(dag, info(write).subgraph)


def test_dropping_an_empty_subgraph_renumbers_the_rest_and_keeps_its_order():
    """Subgraph 1 lost its nodes: 0 and 3 now come straight before 2 (its successor), and the rest
    are numbered 0, 1, 2 in the subgraphs, their nodes' annotations and the DAG."""
    gm = make_fx(lambda x: torch.relu(x).sin().cos())(torch.randn(2))
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    subgraphs = [Subgraph(0, 0, [ops[0]]), Subgraph(1, 1, []), Subgraph(2, 1, [ops[1]]), Subgraph(3, 0, [ops[2]])]
    for sg in subgraphs:
        for n in sg.nodes:
            info(n).lane, info(n).subgraph = sg.lane, sg.id
    dag = nx.DiGraph([(0, 1), (3, 1), (1, 2), (0, 3)])
    kept, dag = lanes.drop_empty(subgraphs, dag)
    assert [sg.id for sg in kept] == [0, 1, 2] and [sg.nodes for sg in kept] == [[ops[0]], [ops[1]], [ops[2]]]
    assert [info(n).subgraph for n in ops] == [0, 1, 2]
    assert set(dag.nodes) == {0, 1, 2} and set(dag.edges) == {(0, 1), (2, 1), (0, 2)}


def test_a_subgraph_the_recompute_empties_is_dropped_and_the_model_trains_like_eager(monkeypatch):
    """The README's example planned for an H200: the backward's small loss subgraph (``exp``,
    ``clamp_max``) is copied whole into its one reader's subgraph. The empty subgraph it leaves
    is dropped (codegen would launch it, and lanes would wait for it), the rest renumbered
    (``verify`` checks the plan after every pass), and the model trains as in eager."""
    emptied = []

    def counting(subgraphs, dag):
        emptied.extend(sg.id for sg in subgraphs if not sg.nodes)
        return drop_empty(subgraphs, dag)

    drop_empty = lanes.drop_empty
    monkeypatch.setattr(lanes, "drop_empty", counting)
    model, batch = load_function(os.path.join(REPO, "examples", "clip.py") + ":build")()
    assert_trains_like_eager(model, lambda step: batch, {"subgraph_compiler": "eager", "device": "H200"}, steps=2)
    assert emptied, "the recompute emptied no subgraph: the test no longer covers the case"
    plan = apollo_compile.last_plan()
    for graph in (plan.forward, plan.backward):
        lane_plan = graph.decisions["lanes"]
        assert all(sg.nodes for sg in lane_plan.subgraphs), graph.name
        assert [sg.id for sg in lane_plan.subgraphs] == list(range(len(lane_plan.subgraphs)))
        assert set(lane_plan.dag.nodes) == set(lane_plan.order) == {sg.id for sg in lane_plan.subgraphs}
    assert plan.backward.decisions["lanes"].recomputed["recomputed"] >= 1
    assert "| 0 nodes" not in plan.backward.runtime_source  # codegen's comment above each launch
