"""The invariant checker passes real plans and catches deliberately broken passes."""

import pytest
import torch

import apollo_compile
from helpers import replace_pass
from apollo_compile.annotations import info
from apollo_compile.passes import lanes
from apollo_compile.verify import verify
from models import TwoTower, two_tower_inputs


def compile_two_tower(**options):
    torch.manual_seed(0)
    compiled = torch.compile(TwoTower(), backend="apollo", options={"subgraph_compiler": "eager", "strict": True, **options})
    compiled(*two_tower_inputs()).backward()
    return apollo_compile.last_plan()


def test_real_plans_are_sound():
    plan = compile_two_tower()
    for graph in (plan.forward, plan.backward):
        assert verify(graph.gm, graph.decisions) == []


def test_a_lanes_pass_that_forgets_a_node_is_caught(monkeypatch):
    def broken(gm, ctx):
        plan = lanes.run(gm, ctx)
        victim = plan.subgraphs[0].nodes.pop()
        info(victim).subgraph = None
        return plan

    replace_pass(monkeypatch, "lanes", broken)
    with pytest.raises(Exception, match="pass 'lanes' failed.*in no subgraph"):
        compile_two_tower()


def test_a_cyclic_subgraph_order_is_caught(monkeypatch):
    def broken(gm, ctx):
        plan = lanes.run(gm, ctx)
        plan.order = list(reversed(plan.order))
        return plan

    replace_pass(monkeypatch, "lanes", broken)
    with pytest.raises(Exception, match="pass 'lanes' failed.*against launch order"):
        compile_two_tower()


def test_an_unlabelled_node_is_caught(monkeypatch):
    from apollo_compile.passes import modality

    def broken(gm, ctx):
        out = modality.run(gm, ctx)
        info(next(iter(gm.graph.nodes))).modality = None
        return out

    replace_pass(monkeypatch, "modality", broken)
    with pytest.raises(Exception, match="pass 'modality' failed.*no modality"):
        compile_two_tower()
