"""Tests for the static memory planner: hand-made cases, then a property test on random DAGs.

The property test re-derives "may be live together" with nx.has_path (not the module's own
functions), and also simulates random concurrent schedules to check that buffers whose lifetimes
actually overlap in time never share bytes.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apollo_compile.passes.memory_plan import (
    Buffer,
    MemoryPlan,
    Placement,
    check_plan,
    dead_before,
    may_be_live_together,
    plan_memory,
)

ALIGN = 512


def chain(dag: nx.DiGraph, nodes) -> None:
    nodes = list(nodes)
    dag.add_nodes_from(nodes)
    dag.add_edges_from(zip(nodes, nodes[1:]))


def ranges_overlap(plan: MemoryPlan, x: str, y: str) -> bool:
    by = {p.buffer.name: p for p in plan.placements}
    a, b = by[x], by[y]
    if a.buffer.nbytes == 0 or b.buffer.nbytes == 0:
        return False
    return a.offset < b.offset + b.buffer.nbytes and b.offset < a.offset + a.buffer.nbytes


# ------------------------------------------------------------------------------------------------
# hand-made cases
# ------------------------------------------------------------------------------------------------


def test_chain_on_one_lane_reuses_memory():
    dag = nx.DiGraph()
    chain(dag, [0, 1, 2, 3, 4])
    bufs = [Buffer(f"b{i}", 1000, i, (i + 1,)) for i in range(4)]
    plan = plan_memory(dag, bufs)
    assert check_plan(plan, dag) == []
    assert plan.total_bytes == 4 * 1024
    assert plan.arena_bytes == 2 * 1024 < plan.total_bytes  # ping-pong between two slots
    assert plan.offset_of("b0") == plan.offset_of("b2")
    assert plan.offset_of("b1") == plan.offset_of("b3")
    assert plan.offset_of("b0") != plan.offset_of("b1")


def test_reader_that_also_writes_does_not_share():
    # subgraph 1 reads a and writes b: both live during 1, even though a's last use "is" b's birth.
    dag = nx.DiGraph()
    chain(dag, [0, 1, 2])
    a = Buffer("a", 4096, 0, (1,))
    b = Buffer("b", 4096, 1, (2,))
    assert not dead_before(a, b, dag)
    assert may_be_live_together(a, b, dag)
    plan = plan_memory(dag, [a, b])
    assert check_plan(plan, dag) == []
    assert not ranges_overlap(plan, "a", "b")
    assert plan.arena_bytes == plan.total_bytes == 8192


def test_two_concurrent_lanes_never_share():
    # lane 0: 0 -> 1 -> 2 -> 3, lane 1: 10 -> 11 -> 12 -> 13, no cross-lane edges. 0 precedes 13 in
    # "program order", yet nothing makes 13 wait for 1, so their buffers must not share.
    dag = nx.DiGraph()
    chain(dag, [0, 1, 2, 3])
    chain(dag, [10, 11, 12, 13])
    lane0 = [Buffer(f"x{i}", 700, i, (i + 1,), lane=0) for i in range(3)]
    lane1 = [Buffer(f"y{i}", 700, 10 + i, (11 + i,), lane=1) for i in range(3)]
    plan = plan_memory(dag, lane0 + lane1)
    assert check_plan(plan, dag) == []
    for a in lane0:
        for b in lane1:
            assert may_be_live_together(a, b, dag)
            assert not ranges_overlap(plan, a.name, b.name), (a.name, b.name)
    # Each lane still reuses within itself: 2 slots per lane.
    assert plan.arena_bytes == 4 * 1024 < plan.total_bytes


def test_cross_lane_reuse_needs_happens_before_join():
    # Two lanes join at 20; a buffer born at 20 may reuse bytes of buffers that died before the join.
    dag = nx.DiGraph()
    chain(dag, [0, 1, 2])
    chain(dag, [10, 11, 12])
    dag.add_edges_from([(2, 20), (12, 20), (20, 21)])
    early = [Buffer("x0", 2048, 0, (1,), lane=0), Buffer("y0", 2048, 10, (11,), lane=1)]
    late = Buffer("z", 4096, 20, (21,), lane=0)
    # Also one buffer that crosses the join: produced on lane 1, read at 20 -> conflicts with z.
    cross = Buffer("y1", 512, 11, (20,), lane=1)
    plan = plan_memory(dag, early + [late, cross])
    assert check_plan(plan, dag) == []
    assert dead_before(early[0], late, dag) and dead_before(early[1], late, dag)
    assert ranges_overlap(plan, "z", "x0") or ranges_overlap(plan, "z", "y0")
    assert not ranges_overlap(plan, "z", "y1")
    assert plan.arena_bytes < plan.total_bytes


def test_output_sink_keeps_buffer_alive():
    dag = nx.DiGraph()
    chain(dag, [0, 1, 2, 3, "output"])
    out = Buffer("loss", 512, 0, ("output",))
    later = Buffer("tmp", 512, 2, (3,))
    plan = plan_memory(dag, [out, later])
    assert check_plan(plan, dag) == []
    assert not ranges_overlap(plan, "loss", "tmp")


def test_zero_byte_buffers_sit_at_zero_and_never_conflict():
    dag = nx.DiGraph()
    dag.add_nodes_from([0, 1])
    bufs = [Buffer("empty", 0, 0, (1,)), Buffer("big", 1000, 0, (1,)), Buffer("other", 0, 1)]
    plan = plan_memory(dag, bufs)
    assert plan.offset_of("empty") == plan.offset_of("other") == 0
    assert plan.offset_of("big") == 0
    assert check_plan(plan, dag) == []
    assert plan.total_bytes == plan.arena_bytes == 1024


def test_check_plan_catches_broken_plan():
    dag = nx.DiGraph()
    chain(dag, [0, 1])
    chain(dag, [10, 11])
    a = Buffer("a", 1024, 0, (1,), lane=0)
    b = Buffer("b", 1024, 10, (11,), lane=1)
    good = plan_memory(dag, [a, b])
    assert check_plan(good, dag) == []
    broken = dataclasses.replace(good, placements=[Placement(a, 0), Placement(b, 512)])
    problems = check_plan(broken, dag)
    assert len(problems) == 1 and "a" in problems[0] and "b" in problems[0]
    misaligned = dataclasses.replace(good, placements=[Placement(a, 0), Placement(b, 1100)], arena_bytes=4096)
    assert any("not a multiple" in p for p in check_plan(misaligned, dag))
    too_small = dataclasses.replace(good, arena_bytes=1024)
    assert any("exceeds the arena" in p for p in check_plan(too_small, dag))


def test_text_and_json_are_deterministic():
    dag = nx.DiGraph()
    chain(dag, [0, 1, 2, "output"])
    dag.add_edge(0, 2)
    bufs = [Buffer("h", 3000, 0, (1, 2), lane=0), Buffer("g", 100, 1, ("output",), lane=1),
            Buffer("e", 0, 2, ())]
    p1, p2 = plan_memory(dag, bufs), plan_memory(dag, list(reversed(bufs)))
    assert p1.to_text() == p2.to_text()
    text = p1.to_text()
    assert "0x" not in text
    assert text.splitlines()[-1] == (f"arena {p1.arena_bytes} bytes vs {p1.total_bytes} bytes "
                                     f"without reuse ({100 * (1 - p1.arena_bytes / p1.total_bytes):.1f}% saved)")
    row_h = next(line for line in text.splitlines() if line.startswith("h "))
    assert row_h.split()[-2:] == ["2", "0"]  # last consumer of h is 2 (1 happens before 2), lane 0
    assert json.loads(json.dumps(p1.to_json())) == p1.to_json()
    assert p1.offset_of("h") == 0
    with pytest.raises(KeyError, match="nope"):
        p1.offset_of("nope")


def test_bad_inputs_are_rejected():
    dag = nx.DiGraph()
    chain(dag, [0, 1])
    with pytest.raises(ValueError, match="not in the DAG"):
        plan_memory(dag, [Buffer("a", 8, 0, (7,))])
    with pytest.raises(ValueError, match="two buffers"):
        plan_memory(dag, [Buffer("a", 8, 0), Buffer("a", 8, 1)])
    with pytest.raises(ValueError, match="alignment"):
        plan_memory(dag, [Buffer("a", 8, 0)], alignment=0)
    dag.add_edge(1, 0)
    with pytest.raises(ValueError, match="cycle"):
        plan_memory(dag, [Buffer("a", 8, 0)])


def test_two_thousand_buffers_is_fast():
    rng = random.Random(0)
    dag = nx.DiGraph()
    lanes = 4
    n = 600
    for i in range(n):
        dag.add_node(i)
        if i >= lanes:
            dag.add_edge(i - lanes, i)  # lane chains
        if i > 0 and rng.random() < 0.3:
            dag.add_edge(rng.randrange(max(0, i - 40), i), i)  # cross-lane waits
    bufs = []
    for k in range(2000):
        p = rng.randrange(n - 1)
        desc = sorted(nx.descendants(dag, p))
        cons = tuple(rng.sample(desc, min(len(desc), rng.randint(1, 3)))) if desc else ()
        bufs.append(Buffer(f"t{k}", rng.randint(0, 1 << 20), p, cons, lane=p % lanes))
    t0 = time.perf_counter()
    plan = plan_memory(dag, bufs)
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, elapsed
    assert plan.arena_bytes < plan.total_bytes
    assert check_plan(plan, dag) == []


# ------------------------------------------------------------------------------------------------
# property test
# ------------------------------------------------------------------------------------------------


@st.composite
def problems(draw):
    n = draw(st.integers(1, 25))
    dag = nx.DiGraph()
    dag.add_nodes_from(range(n))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    if pairs:  # random edges i -> j with i < j, so the graph is acyclic by construction
        dag.add_edges_from(draw(st.sets(st.sampled_from(pairs), max_size=min(len(pairs), 60))))
    num_lanes = draw(st.integers(1, 4))
    lane = [draw(st.integers(0, num_lanes - 1)) for _ in range(n)]
    for l in range(num_lanes):
        chain(dag, [i for i in range(n) if lane[i] == l])  # a lane runs in program (id) order
    with_output = draw(st.booleans())
    if with_output:  # sentinel sink: every subgraph happens before "output"
        dag.add_edges_from((i, "output") for i in range(n))
    nbufs = draw(st.integers(0, 30))
    bufs = []
    for k in range(nbufs):
        p = draw(st.integers(0, n - 1))
        desc = sorted(nx.descendants(dag, p), key=str)
        cons = tuple(draw(st.lists(st.sampled_from(desc), max_size=4, unique=True))) if desc else ()
        size = draw(st.one_of(st.sampled_from([0, 1, 511, 512, 513, 4096]), st.integers(0, 10_000)))
        bufs.append(Buffer(f"buf{k}", size, p, cons, lane=lane[p]))
    alignment = draw(st.sampled_from([1, 8, 256, 512]))
    return dag, bufs, alignment


def oracle_live_together(a: Buffer, b: Buffer, dag: nx.DiGraph) -> bool:
    """Independent re-derivation: a dies before b iff every use of a has a path to b's producer."""

    def dies_before(x: Buffer, y: Buffer) -> bool:
        return all(u != y.producer and nx.has_path(dag, u, y.producer) for u in (x.producer, *x.consumers))

    return not dies_before(a, b) and not dies_before(b, a)


def simulate(dag: nx.DiGraph, rng: random.Random) -> dict:
    """One random concurrent schedule: each subgraph starts after all predecessors end, plus a delay."""
    span = {}
    for n in nx.topological_sort(dag):
        ready = max((span[p][1] for p in dag.predecessors(n)), default=0.0)
        start = ready + rng.choice([0.0, rng.random()])
        span[n] = (start, start + rng.uniform(0.01, 1.0))
    return span


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problems())
def test_random_plans_are_safe(problem):
    dag, bufs, alignment = problem
    plan = plan_memory(dag, bufs, alignment=alignment)

    assert check_plan(plan, dag) == []
    assert [p.buffer for p in plan.placements] == bufs
    assert all(p.offset % alignment == 0 and p.offset >= 0 for p in plan.placements)
    assert plan.total_bytes == sum(-(-b.nbytes // alignment) * alignment for b in bufs)
    assert plan.arena_bytes <= plan.total_bytes
    for p in plan.placements:
        if p.buffer.nbytes == 0:
            assert p.offset == 0
        assert p.offset + p.buffer.nbytes <= plan.arena_bytes

    # every pair that may be live together (re-derived with has_path) has disjoint byte ranges
    for i, a in enumerate(bufs):
        for b in bufs[i + 1:]:
            together = oracle_live_together(a, b, dag)
            assert may_be_live_together(a, b, dag) == together
            if together:
                assert not ranges_overlap(plan, a.name, b.name), (a, b)

    # and in concrete random schedules, buffers whose lifetimes overlap in time never share bytes
    rng = random.Random(len(bufs) * 7919 + dag.number_of_edges())
    for _ in range(5):
        span = simulate(dag, rng)
        life = {b.name: (span[b.producer][0], max(span[u][1] for u in (b.producer, *b.consumers))) for b in bufs}
        for i, a in enumerate(bufs):
            for b in bufs[i + 1:]:
                (s1, e1), (s2, e2) = life[a.name], life[b.name]
                if s1 < e2 and s2 < e1:
                    assert not ranges_overlap(plan, a.name, b.name), (a, b)

    # determinism, also under a shuffled input order
    again = plan_memory(dag, list(bufs), alignment=alignment)
    assert again.placements == plan.placements and again.arena_bytes == plan.arena_bytes
    assert again.to_text() == plan.to_text() and again.to_json() == plan.to_json()
    shuffled = list(bufs)
    random.Random(1).shuffle(shuffled)
    other = plan_memory(dag, shuffled, alignment=alignment)
    assert {p.buffer.name: p.offset for p in other.placements} == {p.buffer.name: p.offset for p in plan.placements}
    assert other.to_text() == plan.to_text()
