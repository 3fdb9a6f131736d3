"""Quotas pass: the quota planner, on the performance model of a subgraph under an SM quota.

Reads ``ctx.decisions["lanes"]`` (a :class:`LanePlan`), ``ctx.device`` and the cost labels
(``NodeInfo.bound``, ``NodeInfo.est_us``, through the model); writes no annotation. Returns a
:class:`QuotaDecision`: a short list of :class:`Candidate` runtimes, best predicted first, for the
runtime to measure. "No quota" is always a candidate: DESIGN.md measured fixed splits losing to
plain streams, so a quota is only ever proposed, never imposed.

The model (:class:`~apollo_compile.perf.model.PerfModel`: a subgraph's time on ``q`` SMs, a lane
plan on plain streams or under quotas, and their fits) is ``perf/model.py``; the pass builds it
from DESIGN.md's priors as refitted on this device by what the runner measured (``perf/calibration.py``).
Side lanes get quotas of multiples of 8 SMs, lane 0 none (perf/model.py, "Quotas: lane 0 runs on
the full device").

Planner (:func:`plan_quotas`)
-----------------------------
``one_lane`` (serial sum at full device), ``lanes`` (plain streams, simulated over the subgraph
DAG with the overlap penalty), and, when subgraphs of different lanes can run concurrently, quota
candidates: a greedy split proportional to each concurrent lane's full-device work (lane 0's share
is what the side lanes leave), then refinement that moves 8 SMs from the lane predicted to finish
first (else the next earliest) to the lane finishing last while the predicted makespan improves
by at least 0.1%. A side lane missing from a candidate's quotas runs on a plain stream. Sorted by predicted time,
at most ``max_candidates`` (one_lane and lanes always kept); predictions within 0.1% count as a
tie, broken in favour of no quota (quotas are the riskier bet, DESIGN.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cmp_to_key

import networkx as nx
import torch.fx

from ..perf.calibration import defaults
from ..devices import DeviceSpec
from ..lane_plan import LanePlan
from ..perf.model import PerfModel, Schedule, quota_name

__all__ = ["MIN_GAIN", "Candidate", "QuotaDecision", "concurrent_lanes", "plan_candidates", "plan_quotas", "run"]

MIN_GAIN = 1e-3  # refinement keeps a move only if the predicted makespan drops by 0.1% or more


@dataclass(frozen=True)
class Candidate:
    name: str
    quotas: dict[int, int] | None  # side lane -> SMs (others: plain streams); None: no green contexts
    predicted_us: float

    def to_dict(self) -> dict:
        return {"name": self.name,
                "quotas": None if self.quotas is None else {str(k): v for k, v in sorted(self.quotas.items())},
                "predicted_us": round(self.predicted_us, 2)}


# ---------------------------------------------------------------------------------------------
# planner


def concurrent_lanes(plan: LanePlan) -> dict[int, set[int]]:
    """lane -> ids of its subgraphs that may run at the same time as another lane's subgraph."""
    reach = {i: nx.descendants(plan.dag, i) for i in plan.dag.nodes}
    out: dict[int, set[int]] = {}
    sgs = plan.subgraphs
    for a in sgs:
        for b in sgs:
            if a.id < b.id and a.lane != b.lane and b.id not in reach.get(a.id, ()) \
                    and a.id not in reach.get(b.id, ()):
                out.setdefault(a.lane, set()).add(a.id)
                out.setdefault(b.lane, set()).add(b.id)
    return out


def _split(work: dict[int, float], units: int) -> dict[int, int] | None:
    """Largest-remainder split of ``units`` proportional to ``work``, at least 1 each."""
    lanes = sorted(work)
    if len(lanes) > units:
        return None
    total = sum(work.values())
    ideal = {l: (units * work[l] / total if total > 0 else units / len(lanes)) for l in lanes}
    got = {l: max(1, int(math.floor(ideal[l]))) for l in lanes}
    while sum(got.values()) > units:  # the minimum of 1 overshot: take from the largest
        big = max((l for l in lanes if got[l] > 1), key=lambda l: (got[l] - ideal[l], got[l]))
        got[big] -= 1
    for l in sorted(lanes, key=lambda l: (-(ideal[l] - got[l]), l)):
        if sum(got.values()) >= units:
            break
        got[l] += 1
    return got


def plan_quotas(plan: LanePlan, spec: DeviceSpec, model: PerfModel | None = None, *,
                max_candidates: int = 4) -> list[Candidate]:
    """Candidate runtimes for ``plan``, best predicted first (see the module docstring)."""
    model = model or PerfModel(spec)
    if model.sms != spec.sms:
        raise ValueError(f"the model is for {model.sms} SMs, the device has {spec.sms}")
    return plan_candidates(plan, model, max_candidates)[0]


def plan_candidates(plan: LanePlan, model: PerfModel, max_candidates: int = 4
                    ) -> tuple[list[Candidate], str, Candidate | None]:
    """:func:`plan_quotas` with its workings: (the candidates, why, the greedy quota split before
    refinement, or None where no quota was tried). Tests and the decision's log read the last two."""
    stats = [model.stats(sg) for sg in plan.subgraphs]
    serial = model.serial_us(plan, stats)
    one = Candidate("one_lane", None, serial)
    lanes_used = {sg.lane for sg in plan.subgraphs}
    if len(lanes_used) < 2:
        return [one], "one lane: nothing runs concurrently", None
    cands = [one, Candidate("lanes", None, model.simulate(plan, None, stats=stats).makespan)]
    conc = concurrent_lanes(plan)
    g = model.granularity
    units = model.sms // g
    reason = ""
    greedy = None
    if len(conc) < 2:
        reason = "no subgraphs of different lanes can overlap: no quotas"
    else:
        work = {l: sum(model.predict(stats[i], model.sms) for i in ids) for l, ids in conc.items()}
        split = _split(work, units)
        if split is None:
            reason = f"{len(work)} concurrent lanes > {units} partitions of {g} SMs: no quotas"
        else:
            def quotas_of(u: dict[int, int]) -> dict[int, int]:
                return {l: n * g for l, n in u.items() if l != 0}

            def evaluate(u: dict[int, int]) -> Schedule:
                return model.simulate(plan, quotas_of(u), stats=stats)

            sched = evaluate(split)
            greedy = Candidate(quota_name(quotas_of(split)), quotas_of(split), sched.makespan)
            best, best_sched = dict(split), sched
            for _ in range(4 * units):
                fin = {l: max(best_sched.finish[i] for i in conc[l]) for l in best}
                last = max(best, key=lambda l: (fin[l], -l))
                moved = False
                for donor in sorted(best, key=lambda l: (fin[l], l)):
                    if donor == last or best[donor] <= 1:
                        continue
                    trial = dict(best)
                    trial[donor] -= 1
                    trial[last] += 1
                    s = evaluate(trial)
                    if s.makespan < best_sched.makespan * (1 - MIN_GAIN):
                        best, best_sched, moved = trial, s, True
                        break
                if not moved:
                    break
            refined = Candidate(quota_name(quotas_of(best)), quotas_of(best), best_sched.makespan)
            cands.append(refined)
            if refined.quotas != greedy.quotas:
                cands.append(greedy)
            reason = (f"{len(conc)} concurrent lanes; lane 0 on the full device" +
                      (", sharing with the side lanes" if 0 in conc else ""))

    def cmp(a: Candidate, b: Candidate) -> int:  # within MIN_GAIN: a tie, no quota first
        if abs(a.predicted_us - b.predicted_us) > MIN_GAIN * max(a.predicted_us, b.predicted_us):
            return -1 if a.predicted_us < b.predicted_us else 1
        return (a.quotas is not None) - (b.quotas is not None) or (a.predicted_us > b.predicted_us) - (
            a.predicted_us < b.predicted_us)

    cands.sort(key=cmp_to_key(cmp))
    keep = [c for c in cands if c.quotas is None]
    rest = [c for c in cands if c.quotas is not None][: max(max_candidates - len(keep), 0)]
    out = sorted(keep + rest, key=cmp_to_key(cmp))
    return out, reason, greedy


# ---------------------------------------------------------------------------------------------
# the pass


@dataclass
class QuotaDecision:
    candidates: list[Candidate]
    reason: str = ""
    greedy: Candidate | None = None  # the quota split before refinement, when there was one
    model: PerfModel | None = field(default=None, repr=False)
    calibrated: dict[str, float] = field(default_factory=dict)  # fits from this graph's measured candidates

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def summary(self) -> dict:
        return {"candidates": [c.to_dict() for c in self.candidates],
                "best": self.best.name if self.best else None,
                "greedy": self.greedy.to_dict() if self.greedy else None,
                "lane0": "full device (no quota); when concurrent, the SMs the side lanes leave",
                "reason": self.reason,
                "model": self.model.summary() if self.model else None,
                "calibrated_from_measurement": dict(self.calibrated)}


def run(gm: torch.fx.GraphModule, ctx, model: PerfModel | None = None) -> QuotaDecision:
    plan = ctx.decisions.get("lanes")
    if model is None:  # DESIGN.md's priors, refitted by what the runner measured on this device
        model = PerfModel(ctx.device, **defaults(ctx.device))
    if plan is None:
        return QuotaDecision([], "no lane plan", None, model)
    cands, reason, greedy = plan_candidates(plan, model)
    return QuotaDecision(cands, reason, greedy, model)
