"""The performance model under SM quotas and the quota planner (pure Python, no GPU)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx

from apollo_compile.annotations import KEY, NodeInfo
from apollo_compile.perf import model as M
from apollo_compile.lane_plan import Subgraph
from apollo_compile.passes import quotas as Q
from apollo_compile.passes.quotas import Candidate, plan_quotas
from apollo_compile.perf.model import PerfModel, SubgraphStats, fit_power_law
from helpers import H200, make_plan, two_tower_plan


# -- synthetic plans --------------------------------------------------------------------------

def quota_cands(cands: list[Candidate]) -> list[Candidate]:
    return [c for c in cands if c.quotas is not None]


# -- the performance model --------------------------------------------------------------------

def test_compute_default_reproduces_design_matmul():
    model = PerfModel(H200)
    matmul = SubgraphStats("mm", compute_us=1500.0)
    for sms, ms in M.DESIGN_MATMUL_MS:
        assert model.predict(matmul, sms) / 1e3 == pytest.approx(ms, rel=0.15), sms


def test_compute_default_is_the_least_squares_fit_of_design():
    t_full, alpha, sat, _ = fit_power_law(M.DESIGN_MATMUL_MS, H200.sms)
    assert alpha == pytest.approx(M.COMPUTE_ALPHA, abs=0.05)
    assert sat == pytest.approx(M.COMPUTE_SAT_FRAC * H200.sms, abs=8)
    assert t_full == pytest.approx(1.5, rel=0.05)


def test_overlap_penalty_default_derived_from_design():
    one, two, vision, text = M.DESIGN_STREAMS_B8
    model = PerfModel(H200)
    p = model.fit_overlap_penalty(two, one, lane_us=(vision, text))
    assert p == pytest.approx(M.OVERLAP_PENALTY, abs=0.01)
    # the formula: max + p * min (+ the non-overlappable rest) gives back the measurement
    rest = one - vision - text
    assert model.predict_overlap(vision, text) + rest == pytest.approx(two, rel=0.01)


@pytest.mark.parametrize("stats", [
    SubgraphStats("c", compute_us=1000.0),
    SubgraphStats("m", memory_us=1000.0),
    SubgraphStats("mix", compute_us=600.0, memory_us=300.0, fixed_us=40.0, capped=((50.0, 24),)),
])
def test_monotone_non_increasing_in_quota(stats):
    model = PerfModel(H200)
    times = [model.predict(stats, q) for q in range(1, H200.sms + 1)]
    assert all(a >= b - 1e-9 for a, b in zip(times, times[1:]))
    assert times[-1] == pytest.approx(stats.total_us)
    # memory-bound work saturates at half the device; compute-bound keeps scaling longer
    if stats.key == "m":
        assert model.predict(stats, 72) == pytest.approx(stats.total_us)
        assert model.predict(stats, 33) == pytest.approx(stats.total_us * math.sqrt(2), rel=1e-6)


def test_mix_by_share_of_est_us():
    model = PerfModel(H200)
    plan = make_plan([(0, [("compute", 700.0), ("memory", 300.0)])], [])
    st = model.stats(plan.subgraphs[0])
    launch = H200.launch_us
    assert st.compute_us == pytest.approx(700.0 - launch) and st.memory_us == pytest.approx(300.0 - launch)
    assert st.fixed_us == pytest.approx(2 * launch)
    want = (st.compute_us * model.compute_sat / 32 + st.memory_us * math.sqrt(model.memory_sat / 32)
            + st.fixed_us)
    assert model.predict(plan.subgraphs[0], 32) == pytest.approx(want)


def test_tile_caps_small_matmuls_saturate_early():
    graph = torch.fx.Graph()
    small = graph.call_function(torch.ops.aten.mm.default, (1, 1))
    small.meta["val"] = torch.empty(616, 512)  # 5 x 4 tiles of 128 x 128: saturates at 24 SMs
    big = graph.call_function(torch.ops.aten.mm.default, (1, 1))
    big.meta["val"] = torch.empty(8192, 8192)
    for n in (small, big):
        n.meta[KEY] = NodeInfo(bound="compute", est_us=102.0)
    model = PerfModel(H200)
    st_small = model.stats(Subgraph(0, 1, [small]))
    st_big = model.stats(Subgraph(1, 1, [big]))
    assert st_small.capped == ((100.0, 24),) and st_big.capped == () and st_big.compute_us == 100.0
    assert model.predict(st_small, 24) == pytest.approx(model.predict(st_small, H200.sms))
    assert model.predict(st_small, 8) == pytest.approx(2.0 + 100.0 * 3)
    assert model.predict(st_big, 24) > 4 * model.predict(st_big, H200.sms)
    assert PerfModel(H200, tile_caps=False).stats(Subgraph(0, 1, [small])).capped == ()


def test_calibrate_recovers_alpha_and_scale():
    model = PerfModel(H200)
    st = SubgraphStats(7, compute_us=400.0, memory_us=400.0)  # a wrong prior on purpose
    t_full, alpha = 2500.0, 0.7
    sat = model.prior_sat(st)
    meas = [(7, q, t_full * (sat / min(q, sat)) ** alpha) for q in (16, 32, 64, 96, 132)]
    fitted = model.calibrate(meas)
    fit = model.fits[7]
    assert fitted["7"]["kind"] == "power"
    assert fit.alpha == pytest.approx(alpha, abs=1e-6)
    assert fit.t_full == pytest.approx(t_full, rel=1e-6)
    for _, q, us in meas:
        assert model.predict(st, q) == pytest.approx(us, rel=1e-6)


def test_calibrate_two_quotas_and_one_quota():
    model = PerfModel(H200)
    st = SubgraphStats("a", compute_us=1000.0)
    sat = model.compute_sat
    model.calibrate([("a", 32, 3000.0 * (sat / 32) ** 0.6), ("a", 132, 3000.0)])
    assert model.fits["a"].alpha == pytest.approx(0.6, abs=1e-6)
    assert model.predict(st, 64) == pytest.approx(3000.0 * (sat / 64) ** 0.6, rel=1e-6)
    # one point: only the scale of the prior curve
    model = PerfModel(H200)
    model.calibrate([("a", 132, 1500.0)])
    assert model.fits["a"].kind == "scale"
    assert model.predict(st, 132) == pytest.approx(1500.0)
    assert model.predict(st, 56) == pytest.approx(1.5 * PerfModel(H200).predict(st, 56))


def test_calibrate_keeps_monotone_with_noisy_points():
    model = PerfModel(H200)
    st = SubgraphStats("n", memory_us=100.0)
    model.calibrate([("n", 16, 100.0), ("n", 64, 104.0), ("n", 132, 101.0)])  # rising: alpha clamps to 0
    times = [model.predict(st, q) for q in range(8, 133, 8)]
    assert all(a >= b - 1e-9 for a, b in zip(times, times[1:]))


def test_calibrate_overlap_penalty_from_lanes_pair():
    plan = two_tower_plan()
    truth = PerfModel(H200, overlap_penalty=0.5)
    lanes_us = truth.simulate(plan, None).makespan
    one_us = truth.serial_us(plan)
    model = PerfModel(H200)
    fitted = model.calibrate([("lanes", None, lanes_us), ("one_lane", None, one_us)], plan=plan)
    assert fitted["overlap_penalty"] == pytest.approx(0.5, abs=1e-4)
    assert model.simulate(plan, None).makespan == pytest.approx(lanes_us, rel=1e-4)
    with pytest.raises(ValueError):
        model.calibrate([("lanes", None, lanes_us)], plan=plan)


def test_calibrate_quota_penalty_from_a_measured_split():
    plan = two_tower_plan()
    truth = PerfModel(H200, quota_penalty=0.4)
    split = {1: 88, 2: 40}
    measured = truth.simulate(plan, split).makespan
    model = PerfModel(H200)
    assert model.simulate(plan, split).makespan < measured  # isolated by default: optimistic
    fitted = model.calibrate([(M.quota_name(split), None, measured), ("one_lane", None, truth.serial_us(plan))],
                             plan=plan)
    assert fitted["quota_penalty"] == pytest.approx(0.4, abs=1e-4)
    assert M.parse_quota_name("quota:1=88,2=40") == split


def test_two_lane_overlap_is_max_plus_penalty_min():
    plan = make_plan([(1, [("compute", 5000.0)]), (2, [("compute", 2000.0)])], [])
    model = PerfModel(H200)
    a, b = (model.predict(sg, H200.sms) for sg in plan.subgraphs)
    assert model.simulate(plan, None).makespan == pytest.approx(model.predict_overlap(a, b), rel=1e-3)
    # exactly, without the launch part (which overlaps freely)
    stats = [SubgraphStats(i, compute_us=us) for i, us in enumerate((5000.0, 2000.0))]
    assert model.simulate(plan, None, stats=stats).makespan == pytest.approx(model.predict_overlap(5000.0, 2000.0))
    # three lanes: each at 1 / (1 + 2p) while all three run
    plan3 = make_plan([(1, []), (2, []), (3, [])], [])
    stats3 = [SubgraphStats(i, compute_us=1000.0) for i in range(3)]
    p = model.overlap_penalty
    assert model.simulate(plan3, None, stats=stats3).makespan == pytest.approx(1000.0 * (1 + 2 * p))


# -- the planner ------------------------------------------------------------------------------

def test_one_lane_plan_has_only_one_lane_candidate():
    plan = make_plan([(0, [("compute", 100.0)]), (0, [("memory", 50.0)])], [(0, 1)])
    cands = plan_quotas(plan, H200, PerfModel(H200))
    assert [c.name for c in cands] == ["one_lane"]
    assert cands[0].predicted_us == pytest.approx(150.0)


def test_sequential_lanes_get_no_quota():
    plan = make_plan([(0, [("compute", 100.0)]), (1, [("compute", 200.0)])], [(0, 1)])
    names = [c.name for c in plan_quotas(plan, H200, PerfModel(H200))]
    assert sorted(names) == ["lanes", "one_lane"]


def test_two_lane_unequal_work_quota_split():
    plan = two_tower_plan(heavy=6000.0, light=2000.0)
    model = PerfModel(H200)
    cands, reason, greedy = Q.plan_candidates(plan, model)
    names = [c.name for c in cands]
    assert "one_lane" in names and "lanes" in names and len(cands) <= 4
    times = [c.predicted_us for c in cands]
    assert all(x <= y * (1 + Q.MIN_GAIN) for x, y in zip(times, times[1:]))
    quota = quota_cands(cands)
    assert quota and greedy is not None
    refined = min(quota, key=lambda c: c.predicted_us)
    for c in quota:
        assert set(c.quotas) == {1, 2}
        assert all(v % 8 == 0 and v >= 8 for v in c.quotas.values())
        assert sum(c.quotas.values()) <= H200.sms
        assert c.quotas[1] > c.quotas[2]  # the heavier lane gets more SMs
        assert c.name == "quota:" + ",".join(f"{k}={v}" for k, v in sorted(c.quotas.items()))
    assert refined.predicted_us <= greedy.predicted_us
    one = next(c for c in cands if c.name == "one_lane")
    assert one.predicted_us == pytest.approx(model.serial_us(plan))


def test_refinement_balances_a_bad_greedy_start():
    # lane 1 is memory-bound (saturates at half the device), lane 2 compute-bound: the split by
    # work gives lane 1 too many SMs; refinement moves them to lane 2
    plan = make_plan([(1, [("memory", 5000.0)]), (2, [("compute", 3000.0)])], [])
    model = PerfModel(H200)
    cands, _, greedy = Q.plan_candidates(plan, model)
    refined = min(quota_cands(cands), key=lambda c: c.predicted_us)
    assert refined.quotas != greedy.quotas
    assert refined.quotas[2] > greedy.quotas[2]
    assert refined.predicted_us < greedy.predicted_us


def test_main_lane_concurrency_reserves_sms_for_lane0():
    # lane 0 has work concurrent with one side lane: lane 0 keeps the rest of the device
    plan = make_plan([(0, [("compute", 3000.0)]), (1, [("compute", 3000.0)]), (0, [("memory", 100.0)])],
                     [(0, 2), (1, 2)])
    model = PerfModel(H200)
    cands = plan_quotas(plan, H200, model)
    quota = quota_cands(cands)
    assert quota
    for c in quota:
        assert set(c.quotas) == {1}  # lane 0 gets no green context
        assert 8 <= c.quotas[1] <= H200.sms - 8
    # lane 0 alone runs on the full device: the join costs its full-device time under any quota
    sched = model.simulate(plan, quota[0].quotas)
    assert sched.finish[2] - sched.start[2] == pytest.approx(model.predict(plan.subgraphs[2], H200.sms))


def test_candidates_capped_and_always_keep_no_quota():
    plan = make_plan([(1, [("compute", 4000.0)]), (2, [("memory", 3000.0)]), (3, [("compute", 500.0)]),
                      (0, [("memory", 100.0)])], [(0, 3), (1, 3), (2, 3)])
    cands = plan_quotas(plan, H200, PerfModel(H200), max_candidates=3)
    names = [c.name for c in cands]
    assert "one_lane" in names and "lanes" in names and len(cands) <= 3
    for c in quota_cands(cands):
        assert sum(c.quotas.values()) <= H200.sms and all(v % 8 == 0 for v in c.quotas.values())


def test_design_two_towers_plain_streams_beat_fixed_splits():
    """DESIGN.md, B=8: the towers alone take 6.09 / 3.34 ms; quotas lost to plain streams."""
    plan = make_plan([(1, [("compute", 4200.0), ("memory", 1890.0)]),
                      (2, [("compute", 2000.0), ("memory", 1340.0)]),
                      (0, [("memory", 360.0)])], [(0, 2), (1, 2)])
    model = PerfModel(H200)
    cands = plan_quotas(plan, H200, model)
    by = {c.name: c.predicted_us for c in cands}
    assert by["lanes"] / 1e3 == pytest.approx(7.61, rel=0.05)
    assert by["one_lane"] / 1e3 == pytest.approx(9.79, rel=0.05)
    for split in ({1: 104, 2: 24}, {1: 88, 2: 40}, {1: 64, 2: 64}):
        assert model.simulate(plan, split).makespan > by["lanes"]


# -- on a real plan and as a pass ---------------------------------------------------------------

def test_real_two_tower_plan_and_pass():
    import apollo_compile
    from apollo_compile.pipeline import GraphContext
    from models import TwoTower, two_tower_inputs

    model = torch.compile(TwoTower(), backend="apollo", options={"subgraph_compiler": "eager", "device": "H200"})
    model(*two_tower_inputs()).backward()
    graphs = apollo_compile.last_plan().graphs
    for kind in ("forward", "backward"):
        gp = graphs[kind]
        ctx = GraphContext(gp.name, kind, options=None, device=H200, decisions={"lanes": gp.lanes})
        decision = Q.run(gp.gm, ctx)
        names = [c.name for c in decision.candidates]
        assert "one_lane" in names and "lanes" in names and 1 <= len(names) <= 4
        assert decision.best is decision.candidates[0]
        summary = decision.summary()
        assert summary["best"] == names[0] and len(summary["candidates"]) == len(names)
        for c in quota_cands(decision.candidates):
            assert all(v % 8 == 0 and v >= 8 for v in c.quotas.values())
            assert sum(c.quotas.values()) <= H200.sms and 0 not in c.quotas
        if decision.best.quotas is not None:  # a quota ranks first only if clearly better
            lanes = next(c for c in decision.candidates if c.name == "lanes")
            assert decision.best.predicted_us < lanes.predicted_us * (1 - Q.MIN_GAIN)
        serial, _ = gp.lanes.predicted_us()
        one = next(c for c in decision.candidates if c.name == "one_lane")
        assert one.predicted_us == pytest.approx(serial)


def test_pass_without_lane_plan():
    from apollo_compile.pipeline import GraphContext

    ctx = GraphContext("g", "forward", options=None, device=H200)
    decision = Q.run(torch.fx.GraphModule({}, torch.fx.Graph()), ctx)
    assert decision.candidates == [] and decision.best is None
