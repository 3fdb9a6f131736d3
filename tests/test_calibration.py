"""The performance model calibrates itself from measured candidates (no GPU: synthetic times)."""

from __future__ import annotations

import json

import pytest

from apollo_compile.perf import calibration
from apollo_compile.pipeline import quota_candidates
from apollo_compile.devices import DEVICE_SPECS
from apollo_compile.passes import quotas as Q
from apollo_compile.perf.model import PerfModel, quota_name
from apollo_compile.pipeline import GraphContext
from helpers import H200, make_plan, two_tower_plan


def measured_by(truth: PerfModel, plan, split: dict[int, int]) -> dict[str, float]:
    """What the runner would report (ms per replay) on a device that behaves like `truth`."""
    return {"lanes": truth.simulate(plan, None).makespan / 1e3, "one_lane": truth.serial_us(plan) / 1e3,
            quota_name(split): truth.simulate(plan, split).makespan / 1e3}


def test_record_fits_both_penalties_and_later_models_start_from_them(tmp_path):
    plan, split = two_tower_plan(), {1: 88, 2: 40}
    truth = PerfModel(H200, overlap_penalty=0.6, quota_penalty=0.9)
    assert calibration.defaults(H200) == {}  # the priors until something is measured
    fitted = calibration.record(H200, plan, PerfModel(H200), measured_by(truth, plan, split))
    assert fitted["overlap_penalty"] == pytest.approx(0.6, abs=1e-3)
    assert fitted["quota_penalty"] == pytest.approx(0.9, abs=1e-3)
    assert calibration.defaults(H200) == pytest.approx(fitted)
    # the quotas pass builds its model from the fits: it now predicts what was measured
    ctx = GraphContext("g_forward", "forward", options=None, device=H200, decisions={"lanes": plan})
    decision = Q.run(None, ctx)
    assert decision.model.overlap_penalty == pytest.approx(0.6, abs=1e-3)
    lanes = next(c for c in decision.candidates if c.name == "lanes")
    assert lanes.predicted_us == pytest.approx(truth.simulate(plan, None).makespan, rel=1e-3)


def test_fits_persist_for_a_new_process_and_keep_the_median(tmp_path):
    plan = two_tower_plan()
    for p in (0.2, 0.4, 0.9):
        calibration.record(H200, plan, PerfModel(H200), measured_by(PerfModel(H200, overlap_penalty=p), plan, {1: 88, 2: 40}))
    stored = json.loads(open(calibration.path()).read())
    assert len(stored[calibration.device_key(H200)]["overlap_penalty"]) == 3
    calibration.reset()  # a new process: only the file remains
    assert calibration.defaults(H200)["overlap_penalty"] == pytest.approx(0.4, abs=1e-3)
    assert calibration.defaults(DEVICE_SPECS["A100"]) == {}  # per device


def test_without_a_file_fits_stay_in_the_process(monkeypatch):
    monkeypatch.setenv("APOLLO_CALIBRATION_FILE", "")
    plan = two_tower_plan()
    calibration.record(H200, plan, PerfModel(H200), measured_by(PerfModel(H200), plan, {1: 88, 2: 40}))
    assert calibration.path() is None and "overlap_penalty" in calibration.defaults(H200)


def test_a_damaged_file_is_ignored(tmp_path, monkeypatch, caplog):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv("APOLLO_CALIBRATION_FILE", str(bad))
    assert calibration.defaults(H200) == {}
    assert "ignoring the calibration file" in caplog.text


def test_measurements_without_one_lane_fit_nothing():
    assert calibration.record(H200, two_tower_plan(), PerfModel(H200), {"lanes": 1.0}) == {}
    assert calibration.defaults(H200) == {}


def test_quota_splits_predicted_to_lose_are_not_captured(monkeypatch):
    """Only splits predicted to beat plain streams are timed; once measured interference makes every
    split lose, none is timed again."""
    from torch.cuda import green_contexts

    monkeypatch.setattr(green_contexts, "SUPPORTED", True)  # as on a CUDA build with green contexts
    # a compute-bound tower beside a memory-bound one, then a join: the priors favour a 96/32 split
    plan, split = make_plan([(1, [("compute", 4000.0)]), (2, [("memory", 3000.0)]), (0, [("memory", 100.0)])],
                            [(0, 2), (1, 2)]), {1: 96, 2: 32}
    ctx = GraphContext("g_forward", "forward", options=None, device=H200, decisions={"lanes": plan})
    ctx.decisions["quotas"] = Q.run(None, ctx)
    planned = {c.name: c.predicted_us for c in ctx.decisions["quotas"].candidates}
    lanes = planned["lanes"]
    assert any(name.startswith("quota:") and us >= lanes for name, us in planned.items())  # one predicted to lose
    assert quota_candidates(ctx) == {quota_name(split): split}  # ... is not measured; the winner is
    slow = PerfModel(H200, quota_penalty=1.5)  # as fixed splits measure on a GPU: every split loses
    calibration.record(H200, plan, PerfModel(H200), measured_by(slow, plan, split))
    ctx.decisions["quotas"] = Q.run(None, ctx)
    assert quota_candidates(ctx) == {}
    names = [c.name for c in ctx.decisions["quotas"].candidates]
    assert "lanes" in names and "one_lane" in names  # still planned and dumped, just not measured


def test_record_on_a_real_plan_through_the_backend_hook():
    """What the runner calls on the GPU (pipeline.calibrate), on a real two-tower plan made for an
    H200 on the CPU: the fits land in the graph's quota decision, its summary and the store."""
    import torch

    import apollo_compile
    from apollo_compile.pipeline import calibrate
    from models import TwoTower, two_tower_inputs

    compiled = torch.compile(TwoTower(), backend="apollo", options={"subgraph_compiler": "eager", "device": "H200"})
    compiled(*two_tower_inputs()).backward()
    gp = apollo_compile.last_plan().forward
    ctx = GraphContext(gp.name, "forward", options=None, device=H200, decisions=gp.decisions)
    one = gp.decisions["quotas"].model.serial_us(gp.lanes) / 1e3
    calibrate(ctx, {"lanes": 0.8 * one, "one_lane": one})
    fitted = gp.decisions["quotas"].calibrated
    assert 0.0 <= fitted["overlap_penalty"] <= 3.0
    assert gp.summary()["quotas"]["calibrated_from_measurement"] == fitted
    assert calibration.defaults(H200)["overlap_penalty"] == pytest.approx(fitted["overlap_penalty"])
    calibrate(ctx, {"lanes": 1.0})  # nothing to fit from: no change, no error
    assert gp.decisions["quotas"].calibrated == fitted
