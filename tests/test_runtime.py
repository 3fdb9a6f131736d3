"""The generated runtimes compute exactly what the graph computes, whatever the lane layout."""

import re

import pytest
import torch

import apollo_compile
from helpers import assert_runtimes_equal_the_graph, inductor_entry
from models import TwoTower, two_tower_inputs


@pytest.fixture(scope="module")
def two_tower(module_guards):
    """The plan of TwoTower compiled with eager subgraphs, one forward and backward: the tests
    below only read it."""
    torch.manual_seed(0)
    compiled = torch.compile(TwoTower(), backend="apollo", options={"subgraph_compiler": "eager"})
    compiled(*two_tower_inputs()).backward()
    return apollo_compile.last_plan()


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_lane_and_one_lane_runtimes_equal_the_graph(two_tower, kind):
    graph = getattr(two_tower, kind)
    assert set(graph.runtimes) == {"lanes", "one_lane"}
    assert_runtimes_equal_the_graph(graph)


def test_one_lane_candidate_has_no_streams_and_the_same_launch_order(two_tower):
    source = two_tower.forward.decisions["codegen"]
    single = source.one_lane
    assert "rt.lane(" in source.text and "rt.lane(" not in single.text and "rt.wait(" not in single.text
    launches = [line.split("= ")[-1].split("(")[0] for line in source.text.splitlines() if "subgraph_" in line and "([" in line]
    single_launches = [line.split("= ")[-1].split("(")[0] for line in single.text.splitlines() if "subgraph_" in line and "([" in line]
    assert launches == single_launches


def test_a_run_that_raised_lets_go_of_its_cross_lane_values(monkeypatch):
    """keep_alive holds values until the join; a run that raises (an OOM) never reaches it. The
    loaded runtime then joins its lanes (so a CUDA-graph capture can end) and drops what it held:
    plans keep their runtimes, so anything left held stays allocated."""
    from apollo_compile.lane_plan import RuntimeSource
    from apollo_compile.runtime.runner import load_runtime

    program = ("def run(args):\n    (x,) = args\n    args.clear()\n    rt.fork([1])\n"
               "    rt.keep_alive(1, x)\n    raise MemoryError('out of memory midway')\n")
    run = load_runtime(RuntimeSource(program, side_lanes=[1]), {}, "g", torch.device("cpu"))
    rt = run.lane_runtime
    rt.cuda = True  # as on a GPU, with the CUDA calls stubbed: CPU runs keep nothing
    waits = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            waits.append((self.name, other.name))

    rt.streams = {1: Stream("side")}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream("main"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    with pytest.raises(MemoryError):
        run([torch.ones(3)])
    assert rt.held == [] and waits == [("side", "main"), ("main", "side")]  # fork, then the join on the error


def test_memory_plan_keeps_values_read_across_lanes_until_the_join(two_tower):
    """The runtime holds a value another lane reads until every side lane has joined
    (rt.keep_alive ... rt.release()); the plan must not let anything reuse its bytes earlier.
    (It once freed them after their last reader: a plan the runtime did not follow.)"""
    plan = two_tower.backward
    lanes, memory = plan.decisions["lanes"], plan.decisions["memory"]
    read_across = [p.buffer for p in memory.placements
                   if any(c != "output" and lanes.lane_of(c) != p.buffer.lane for c in p.buffer.consumers)]
    assert read_across, "the two-tower backward has values read across lanes"
    assert all("output" in b.consumers for b in read_across)
    runtime = plan.runtime_source
    for b in read_across:  # and the generated runtime does keep each of them until its release
        assert re.search(rf"rt\.keep_alive\(\d+,[^)]*\b{re.escape(b.name)}\b", runtime), b.name


@pytest.mark.parametrize("runtime", ["lanes", "one_lane"])
def test_each_value_is_handed_over_at_its_last_reader(two_tower, runtime):
    """A subgraph that reads a value for the last time gets the only reference to it (in its input
    list, which it clears as Inductor's compiled code does), so it can free the value as soon as
    it is done with it, not after it returns: a one-subgraph backward otherwise held every saved
    activation to its end, beside the gradients it makes."""
    import gc
    import weakref

    from apollo_compile.runtime.runner import load_runtime

    graph = two_tower.backward
    source = graph.decisions["codegen"]
    source = source if runtime == "lanes" else source.one_lane
    lanes = graph.decisions["lanes"]
    launches = {op.subgraph: op for op in source.ops if op.kind == "launch"}
    assert any(op.last_read for op in launches.values())
    freed: dict[int, set[str]] = {}

    def fake(sg):
        def run(args):
            refs = {n.name: weakref.ref(a) for n, a in zip(sg.inputs, args)}
            args.clear()  # boxed, as Inductor's compiled code is
            gc.collect()
            freed[sg.id] = {name for name, ref in refs.items() if ref() is None}
            return tuple(torch.zeros(1) for _ in sg.outputs)
        return run

    run = load_runtime(source, {f"subgraph_{sg.id}": fake(sg) for sg in lanes.subgraphs}, "g", torch.device("cpu"))
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    run([torch.zeros(1) for _ in placeholders])
    # on the CPU keep_alive holds nothing; on CUDA it holds what crosses lanes until the join
    # (NOTE: Freeing across lanes), so there a side lane's backward keeps its saved inputs to its end
    for sg_id, op in launches.items():
        assert freed[sg_id] == set(op.last_read), sg_id


def test_inductor_subgraphs_are_told_no_input_is_donated(monkeypatch):
    """AOTAutograd's donated backward inputs are numbered over the whole backward; a subgraph's
    inputs are numbered otherwise (its input 3 may be a gradient another subgraph still reads), so
    Inductor must not read them as its own. The whole graph's list is put back: the runner reuses
    that memory itself, and AOTAutograd still refuses a retained graph by it. What Inductor is
    told is read at its entry (helpers.inductor_entry)."""
    seen, metas = [], []

    def record(gm, inputs, kwargs):
        if kwargs.get("is_backward"):
            metas.append(torch._guards.TracingContext.try_get().fw_metadata)
            seen.append(list(metas[-1].bw_donated_idxs))

    inductor_entry(monkeypatch, record)
    torch.manual_seed(0)
    compiled = torch.compile(TwoTower(width=16, embed=8, layers=1), backend="apollo",
                             options={"subgraph_compiler": "inductor"})
    compiled(*two_tower_inputs()).backward()
    assert seen and all(d == [] for d in seen), seen
    assert metas[0].bw_donated_idxs, "the model's backward has donated inputs: the test means something"
    plan = apollo_compile.last_plan()
    assert plan.backward.fallback is None and len(seen) == len(plan.backward.lanes.subgraphs)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_the_costliest_tower_runs_on_the_main_lane_without_delaying_the_other(two_tower, kind):
    """The costliest tower's subgraphs move to lane 0 (the capture stream), so the backward's CUDA
    graph can reuse its saved activations (lanes.py, NOTE: The costliest branch runs on the
    caller's stream). One stream runs lane 0 in launch order: a join subgraph another lane waits
    for must not be launched behind tower work it does not depend on."""
    import networkx as nx

    from apollo_compile.annotations import info

    plan = getattr(two_tower, kind).lanes
    assert sorted(plan.lanes) == [0, 1] and "on the main lane" in plan.reason
    towers = {m.split("_")[0] for m in plan.lanes[0] if m != "fusion"}
    assert len(towers) == 1 and towers.isdisjoint(m.split("_")[0] for m in plan.lanes[1])
    moved = sum(sg.est_us for sg in plan.subgraphs
                if sg.lane == 0 and all(info(n).modality != "fusion" for n in sg.nodes))
    assert moved >= sum(sg.est_us for sg in plan.subgraphs if sg.lane == 1)  # the costlier tower moved
    main = [sg_id for sg_id in plan.order if plan.lane_of(sg_id) == 0]
    for sg_id in plan.order:
        if plan.lane_of(sg_id) == 0:
            continue
        for dep in plan.dag.predecessors(sg_id):
            if plan.lane_of(dep) == 0:
                before = main[:main.index(dep)]
                assert set(before) <= nx.ancestors(plan.dag, dep), (dep, before)


def test_the_runtime_says_which_lanes_read_each_input(two_tower):
    """A backward's capture frees a saved activation on the side lane that made it only if no
    other lane reads it (cudagraph.py, NOTE: Donation on side lanes): the runtime lists, per input,
    the lanes whose subgraphs read it. The two-tower backward has inputs only the side lane reads
    (the other tower's saved activations); its one-lane runtime reads everything on lane 0."""
    from apollo_compile.annotations import info

    graph = two_tower.backward
    source, lanes = graph.decisions["codegen"], graph.decisions["lanes"]
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    assert len(source.input_lanes) == len(placeholders)
    for p, read_by in zip(placeholders, source.input_lanes):
        assert read_by == {lanes.lane_of(info(u).subgraph) for u in p.users if info(u).subgraph is not None}
    assert frozenset({1}) in source.input_lanes
    assert all(read_by <= {0} for read_by in source.one_lane.input_lanes)
