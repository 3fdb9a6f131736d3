"""The generated runtimes compute exactly what the graph computes, whatever the lane layout."""

import pytest
import torch

import apollo_compile
from models import TwoTower, two_tower_inputs


def graph_args(gm):
    """Inputs for a graph from its placeholders' metadata (integer inputs are zeros: valid ids)."""
    gen = torch.Generator().manual_seed(0)
    args = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta["val"]
            if v.dtype.is_floating_point:
                args.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype).normal_(generator=gen))
            else:
                args.append(torch.zeros(v.shape, dtype=v.dtype))
    return args


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_lane_and_one_lane_runtimes_equal_the_graph(kind):
    torch.manual_seed(0)
    compiled = torch.compile(TwoTower(), backend="apollo", options={"subgraph_compiler": "eager"})
    compiled(*two_tower_inputs()).backward()
    graph = getattr(apollo_compile.last_plan(), kind)
    assert set(graph.runtimes) == {"lanes", "one_lane"}
    args = graph_args(graph.gm)
    expected = graph.gm(*args)
    for name, run in graph.runtimes.items():
        got = run(list(args))
        assert len(got) == len(expected), name
        for g, e in zip(got, expected):
            if isinstance(e, torch.Tensor):
                torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
            else:
                assert g == e


def test_one_lane_candidate_has_no_streams_and_the_same_launch_order():
    torch.manual_seed(0)
    compiled = torch.compile(TwoTower(), backend="apollo", options={"subgraph_compiler": "eager"})
    compiled(*two_tower_inputs()).backward()
    source = apollo_compile.last_plan().forward.decisions["codegen"]
    single = source.one_lane
    assert "rt.lane(" in source.text and "rt.lane(" not in single.text and "rt.wait(" not in single.text
    launches = [line.split("= ")[-1].split("(")[0] for line in source.text.splitlines() if "subgraph_" in line and "([" in line]
    single_launches = [line.split("= ")[-1].split("(")[0] for line in single.text.splitlines() if "subgraph_" in line and "([" in line]
    assert launches == single_launches


def test_a_run_that_raised_does_not_keep_its_cross_lane_values():
    """keep_alive holds values until the join; a run that raised never reaches it, so the next
    run's fork lets them go (a caller retrying after an OOM must get that memory back)."""
    from apollo_compile.runtime.streams import LaneRuntime

    rt = LaneRuntime([1], [], torch.device("cpu"))
    rt.held.append((torch.ones(3),))  # as a run on CUDA leaves it when it raises mid-way
    rt.fork([1])
    assert rt.held == []
