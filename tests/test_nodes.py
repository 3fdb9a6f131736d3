"""Graph helpers of nodes.py that passes lean on for speed: the graph order of a few nodes without
numbering the graph, the same with and without FX's position key."""

from __future__ import annotations

import random

import pytest
import torch
import torch.fx

from apollo_compile.nodes import in_graph_order, is_library_kernel_name, readers_of


def _shuffled_graph(seed: int) -> torch.fx.Graph:
    """A chain of adds whose nodes were moved around by prepend/append, as passes move them."""
    rng = random.Random(seed)
    g = torch.fx.Graph()
    nodes = [g.placeholder("x")]
    for _ in range(60):
        nodes.append(g.call_function(torch.add, (rng.choice(nodes), 1)))
    g.output(nodes[-1])
    for _ in range(80):
        a, b = rng.sample(nodes[1:], 2)
        (b.prepend if rng.random() < 0.5 else b.append)(a)
    return g


@pytest.mark.parametrize("position_key", [True, False])
def test_in_graph_order_is_the_graphs_order(position_key, monkeypatch):
    """By FX's position key, and by numbering the graph where a torch has no such key."""
    from apollo_compile import nodes

    if not nodes._HAS_SORT_KEY and position_key:
        pytest.skip("this torch's FX nodes carry no position key")
    monkeypatch.setattr(nodes, "_HAS_SORT_KEY", position_key)
    g = _shuffled_graph(0)
    order = list(g.nodes)
    picked = random.Random(1).sample(order, 20)
    assert in_graph_order(picked) == [n for n in order if n in picked]
    assert in_graph_order([]) == [] and in_graph_order(picked[:1]) == picked[:1]


def test_readers_of_are_in_graph_order():
    g = _shuffled_graph(2)
    x = next(iter(g.nodes))
    readers = readers_of(x)
    assert readers == [n for n in g.nodes if x in n.all_input_nodes]


def test_library_kernels_by_name():
    """Matmuls, convolutions and attention; a cast is not one, though Inductor's decompositions
    name it prims.convert_element_type (a "conv" prefix once matched it)."""
    kernels = ["mm", "addmm", "bmm", "linear", "convolution", "convolution_backward", "cudnn_convolution", "conv2d",
               "conv1d", "conv_transpose2d", "conv_tbc", "_conv_depthwise2d", "_scaled_dot_product_flash_attention",
               "scaled_dot_product_attention", "flex_attention"]
    others = ["convert_element_type", "_to_copy", "add", "mul", "where", "index", "sum", "convert"]
    assert [n for n in kernels if not is_library_kernel_name(n)] == []
    assert [n for n in others if is_library_kernel_name(n)] == []
