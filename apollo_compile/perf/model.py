"""The performance model: a subgraph's time under an SM quota, and a lane plan's on plain streams
or under quotas. Pure Python, no GPU. The reasoning and the measurements behind every constant:
docs/design/performance-model.md.

The quotas pass (``passes/quotas.py``) plans its candidate runtimes with it; ``perf/calibration.py``
refits its interference parameters from what the CUDA-graph runner measured. Candidate names that
carry quotas (``"quota:1=88,2=44"``: :func:`quota_name`, :func:`parse_quota_name`) are defined
here, where the model reads them back when it calibrates.

A subgraph's time on ``q`` of the device's ``S`` SMs is a sum of saturating power laws, one per
component of its cost labels (compute, memory, the fixed launch cost, and tile-capped library
kernels)::

    t(q) = Σ_c  us_c * (sat_c / min(q, sat_c)) ** alpha_c          (flat beyond sat_c)

:meth:`PerfModel.calibrate` replaces a subgraph's curve by one fitted to measured quotas.

Lanes on plain streams slow each other by processor sharing: each of ``k`` running subgraphs
progresses at ``1 / (1 + p * (k - 1))`` of its full-device speed on its SM-bound part
(``overlap_penalty``). Under quotas, side lanes run on their green-context partitions (multiples
of 8 SMs) and lane 0 keeps what the running side lanes leave: its solo parts need the whole chip
(docs/design/performance-model.md#quotas-lane-0-runs-on-the-full-device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

import numpy as np
import torch.fx

from ..annotations import info
from ..devices import DeviceSpec
from ..lane_plan import LanePlan, Subgraph
from ..nodes import is_library_kernel_name, op_name

__all__ = [
    "Fit", "PerfModel", "Schedule", "SubgraphStats", "fit_power_law", "parse_quota_name", "quota_name", "tiles",
]

GRANULARITY = 8  # Hopper green-context partitions: multiples of 8 SMs, at least 8
# the priors, fitted to DESIGN_MATMUL_MS and DESIGN_STREAMS_B8 (docs/design/performance-model.md)
COMPUTE_ALPHA = 1.0  # least squares on the matmul: 0.98
COMPUTE_SAT_FRAC = 0.85  # least squares on the matmul: 112 of 132 SMs
MEMORY_ALPHA = 0.5  # an assumption; calibration corrects it per subgraph
MEMORY_SAT_FRAC = 0.5  # an assumption; calibration corrects it per subgraph
OVERLAP_PENALTY = 0.35  # batch 8: (7.61 - 6.09 - 0.36) / 3.34 (docs/design/performance-model.md#plain-streams)
ALPHA_MAX = 2.0
TILE = (128, 128)  # output tile one SM computes at a time, for the tile caps (heuristic)

# DESIGN.md, H200 (132 SMs): 8192^3 bf16 matmul, (SMs, ms)
DESIGN_MATMUL_MS = ((16, 10.3), (32, 5.2), (66, 2.4), (100, 1.8), (132, 1.5))
# DESIGN.md, B=8, CUDA graph: one stream, two streams, vision alone, text alone (ms)
DESIGN_STREAMS_B8 = (9.79, 7.61, 6.09, 3.34)


# ---------------------------------------------------------------------------------------------
# statistics of a subgraph


@dataclass(frozen=True)
class SubgraphStats:
    """What the model needs of a subgraph: its full-device estimate split by kind (µs).

    ``capped`` is compute work that saturates below the compute default: ((us, sat_sms), ...).
    """

    key: Hashable = None
    compute_us: float = 0.0
    memory_us: float = 0.0
    fixed_us: float = 0.0
    capped: tuple[tuple[float, int], ...] = ()

    @property
    def total_us(self) -> float:
        return self.compute_us + self.memory_us + self.fixed_us + sum(us for us, _ in self.capped)


def tiles(node: torch.fx.Node) -> int | None:
    """Output tiles of a matmul-like node (a library kernel: ``nodes.is_library_kernel_name``), how
    many SMs it can keep busy; None for other nodes or an output without a known 2-D shape."""
    name = op_name(node)
    if not is_library_kernel_name(name):
        return None
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if hasattr(v, "shape")), None)
    shape = getattr(val, "shape", None)
    if shape is None or len(shape) < 2:
        return None
    try:
        dims = [int(s) for s in shape]
    except Exception:  # unbacked symbolic sizes
        return None
    if "conv" in name and len(dims) >= 3:  # implicit GEMM: M = N * spatial, N = channels
        m, n = dims[0] * math.prod(dims[2:]), dims[1]
        batch = 1
    else:
        m, n, batch = dims[-2], dims[-1], math.prod(dims[:-2])
    return max(1, batch * math.ceil(m / TILE[0]) * math.ceil(n / TILE[1]))


# ---------------------------------------------------------------------------------------------
# fitting


def fit_power_law(points: Iterable[tuple[float, float]], sms: int, sat: float | None = None,
                  prior_sat: float | None = None, granularity: int = GRANULARITY
                  ) -> tuple[float, float, float, float] | None:
    """Least squares in log space of ``t(q) = t_full * (sat / min(q, sat)) ** alpha``.

    ``points``: (SMs, time). With ``sat=None`` and three or more distinct quotas the saturation
    point is chosen too, among ``prior_sat``, the multiples of ``granularity`` and ``sms`` (on
    a tie, such as when no point is measured near saturation: the one nearest ``prior_sat``,
    else the largest).
    Returns (t_full, alpha, sat, sse), or None when the points cannot tell alpha (fewer than two
    distinct quotas below the saturation point). alpha is kept in [0, ALPHA_MAX].
    """
    pts = [(float(q), float(t)) for q, t in points]
    if any(q <= 0 or t <= 0 for q, t in pts):
        raise ValueError(f"SMs and times must be positive: {pts}")
    qs = np.array([q for q, _ in pts])
    y = np.log([t for _, t in pts])
    if sat is not None:
        sats = [float(sat)]
    elif len(set(qs.tolist())) >= 3:
        sats = {float(granularity * k) for k in range(1, sms // granularity + 1)} | {float(sms)}
        if prior_sat is not None:
            sats.add(float(prior_sat))
        ref = float(sms if prior_sat is None else prior_sat)
        sats = sorted(sats, key=lambda s: (abs(s - ref), -s))  # preferred first
    else:
        sats = [float(sms)]
    best = None
    for s in sats:
        x = np.log(s / np.minimum(qs, s))
        if len(set(np.round(x, 12).tolist())) < 2:
            continue
        dx = x - x.mean()
        alpha = float(np.clip((dx * (y - y.mean())).sum() / (dx * dx).sum(), 0.0, ALPHA_MAX))
        log_t = float((y - alpha * x).mean())
        sse = float(((y - log_t - alpha * x) ** 2).sum())
        if best is None or sse < best[3] - 1e-12 * max(1.0, best[3]):
            best = (math.exp(log_t), alpha, s, sse)
    return best


@dataclass(frozen=True)
class Fit:
    """A calibrated curve for one subgraph: a scale on the prior curve, or a power law.

    A scale is the geometric mean of measured / prior over ``points`` (computed against the
    subgraph's statistics when predicting, so calibrating needs no plan).
    """

    kind: str  # "scale" | "power"
    t_full: float = 0.0
    alpha: float = 0.0
    sat: float = 0.0
    points: tuple[tuple[float, float], ...] = ()

    def to_dict(self) -> dict:
        if self.kind == "scale":
            return {"kind": "scale", "points": [list(p) for p in self.points]}
        return {"kind": "power", "t_full_us": round(self.t_full, 2), "alpha": round(self.alpha, 3),
                "sat_sms": self.sat, "points": len(self.points)}


# ---------------------------------------------------------------------------------------------
# schedules


@dataclass
class Schedule:
    """A simulated run of a lane plan: start and finish of every subgraph (µs)."""

    makespan: float
    start: dict[int, float]
    finish: dict[int, float]


# ---------------------------------------------------------------------------------------------
# candidate names


def quota_name(quotas: dict[int, int]) -> str:
    return "quota:" + ",".join(f"{lane}={sms}" for lane, sms in sorted(quotas.items()))


def parse_quota_name(name: str) -> dict[int, int]:
    """``"quota:1=88,2=44"`` -> ``{1: 88, 2: 44}``."""
    body = name.removeprefix("quota:")
    return {int(k): int(v) for k, v in (part.split("=") for part in body.split(",") if part)}


# ---------------------------------------------------------------------------------------------
# the model


class PerfModel:
    """Time of a subgraph on ``q`` SMs, and of a lane plan on plain streams or under quotas."""

    def __init__(self, spec: DeviceSpec, *, compute_alpha: float = COMPUTE_ALPHA,
                 compute_sat_frac: float = COMPUTE_SAT_FRAC, memory_alpha: float = MEMORY_ALPHA,
                 memory_sat_frac: float = MEMORY_SAT_FRAC, overlap_penalty: float = OVERLAP_PENALTY,
                 quota_penalty: float = 0.0, granularity: int = GRANULARITY, tile_caps: bool = True) -> None:
        self.spec = spec
        self.sms = spec.sms
        self.compute_alpha = compute_alpha
        self.compute_sat = max(1.0, compute_sat_frac * spec.sms)
        self.memory_alpha = memory_alpha
        self.memory_sat = max(1.0, memory_sat_frac * spec.sms)
        self.overlap_penalty = overlap_penalty
        self.quota_penalty = quota_penalty
        self.granularity = granularity
        self.tile_caps = tile_caps
        self.fits: dict[Hashable, Fit] = {}

    # -- one subgraph ---------------------------------------------------------------------------

    def stats(self, sg: Subgraph | SubgraphStats, key: Hashable = None) -> SubgraphStats:
        """The statistics of a subgraph from its nodes' cost labels (key: its id by default)."""
        if isinstance(sg, SubgraphStats):
            return sg
        compute = memory = fixed = 0.0
        capped: dict[int, float] = {}
        launch = self.spec.launch_us
        for n in sg.nodes:
            ann = info(n)
            est = ann.est_us
            if est <= 0:
                continue
            fix = min(launch, est)
            fixed += fix
            rest = est - fix
            if ann.bound == "compute":
                cap = tiles(n) if self.tile_caps else None
                if cap is not None:
                    cap = self.granularity * math.ceil(cap / self.granularity)
                if cap is not None and cap < self.compute_sat:
                    capped[cap] = capped.get(cap, 0.0) + rest
                else:
                    compute += rest
            else:
                memory += rest
        return SubgraphStats(sg.id if key is None else key, compute, memory, fixed,
                             tuple((us, cap) for cap, us in sorted(capped.items())))

    def components(self, st: SubgraphStats) -> list[tuple[float, float, float]]:
        """(us at full device, alpha, saturation SMs) of each component of the prior curve."""
        comps = [(st.compute_us, self.compute_alpha, self.compute_sat),
                 (st.memory_us, self.memory_alpha, self.memory_sat),
                 (st.fixed_us, 0.0, 1.0)]
        comps += [(us, self.compute_alpha, float(min(cap, self.compute_sat))) for us, cap in st.capped]
        return [c for c in comps if c[0] > 0]

    def prior_us(self, st: SubgraphStats, sms: float) -> float:
        q = self._check_sms(sms)
        return sum(us * (sat / min(q, sat)) ** alpha for us, alpha, sat in self.components(st))

    def predict(self, sg: Subgraph | SubgraphStats, sms: float) -> float:
        """Predicted time (µs) of a subgraph on ``sms`` SMs (calibrated when measured)."""
        st = self.stats(sg)
        q = self._check_sms(sms)
        fit = self.fits.get(st.key)
        if fit is None:
            return self.prior_us(st, q)
        if fit.kind == "scale":
            if st.total_us <= 0:
                return math.exp(sum(math.log(us) for _, us in fit.points) / len(fit.points))
            ratios = [math.log(us / self.prior_us(st, pq)) for pq, us in fit.points]
            return math.exp(sum(ratios) / len(ratios)) * self.prior_us(st, q)
        return fit.t_full * (fit.sat / min(q, fit.sat)) ** fit.alpha

    def _check_sms(self, sms: float) -> float:
        if sms <= 0:
            raise ValueError(f"an SM quota must be positive, got {sms}")
        return float(min(sms, self.sms))

    def prior_sat(self, st: SubgraphStats) -> float:
        """SMs beyond which `st`'s prior curve is flat: the largest saturation point of the
        components that scale with SMs, else the whole device. A calibration's power law starts
        there; public so a caller can build measurements on the prior's curve. Changes nothing."""
        sats = [sat for us, alpha, sat in self.components(st) if alpha > 0]
        return max(sats, default=float(self.sms))

    # -- plain streams ----------------------------------------------------------------------------

    def predict_overlap(self, a: float, b: float) -> float:
        """Two lanes overlapping on plain streams: ``max(a, b) + overlap_penalty * min(a, b)``."""
        return max(a, b) + self.overlap_penalty * min(a, b)

    # -- calibration ------------------------------------------------------------------------------

    def calibrate(self, measurements: Iterable[tuple[Hashable, float | None, float]],
                  plan: LanePlan | None = None) -> dict:
        """Refit from measurements ``(key, sms, measured_us)``.

        A subgraph key: its curve is refitted (scale + alpha by least squares in log space with
        two or more distinct quotas, the scale only with one; ``plan`` gives the prior saturation
        point of each subgraph, else the compute default is assumed). The keys ``"one_lane"`` and
        ``"lanes"`` (sms ignored), measured together, refit the overlap penalty over ``plan``;
        a quota candidate's name (``"quota:1=88,2=44"``) with ``"one_lane"`` refits the
        quota penalty. Returns what was fitted.
        """
        by_key: dict[Hashable, list[tuple[float, float]]] = {}
        whole: dict[str, float] = {}
        for key, sms, us in measurements:
            if key in ("one_lane", "lanes") or (isinstance(key, str) and key.startswith("quota:")):
                whole[key] = float(us)
            else:
                by_key.setdefault(key, []).append((float(sms), float(us)))
        fitted: dict[str, Any] = {}
        stats = {sg.id: self.stats(sg) for sg in plan.subgraphs} if plan is not None else {}
        for key, pts in by_key.items():
            st = stats.get(key)
            self.fits.pop(key, None)
            self.fits[key] = self._fit_one(st, pts)
            fitted[str(key)] = self.fits[key].to_dict()
        if whole:
            if "one_lane" not in whole or len(whole) < 2 or plan is None:
                raise ValueError("the penalties need 'one_lane' and 'lanes' or a quota candidate measured, "
                                 "and the plan")
            if "lanes" in whole:
                self.overlap_penalty = self.fit_overlap_penalty(whole["lanes"], whole["one_lane"], plan=plan)
                fitted["overlap_penalty"] = round(self.overlap_penalty, 4)
            quota_runs = [(parse_quota_name(k), us) for k, us in whole.items() if k.startswith("quota:")]
            if quota_runs:  # one penalty for all measured splits: their mean
                ps = [self.fit_quota_penalty(q, us, whole["one_lane"], plan) for q, us in quota_runs]
                self.quota_penalty = sum(ps) / len(ps)
                fitted["quota_penalty"] = round(self.quota_penalty, 4)
        return fitted

    def _fit_one(self, st: SubgraphStats | None, pts: list[tuple[float, float]]) -> Fit:
        if any(q <= 0 or us <= 0 for q, us in pts):
            raise ValueError(f"measurements must have positive SMs and times: {pts}")
        pts = [(min(q, float(self.sms)), us) for q, us in pts]
        prior_sat = self.prior_sat(st) if st is not None else self.compute_sat
        distinct = len({q for q, _ in pts})
        if distinct >= 2:
            res = fit_power_law(pts, self.sms, sat=None if distinct >= 3 else prior_sat,
                                prior_sat=prior_sat, granularity=self.granularity)
            if res is not None:
                t_full, alpha, sat, _ = res
                return Fit("power", t_full=t_full, alpha=alpha, sat=sat, points=tuple(pts))
        return Fit("scale", points=tuple(pts))

    def fit_overlap_penalty(self, lanes_us: float, one_lane_us: float, *, plan: LanePlan | None = None,
                            lane_us: tuple[float, float] | None = None, p_max: float = 3.0) -> float:
        """The overlap penalty that explains a measured (lanes, one_lane) pair.

        With ``lane_us=(a, b)``, the two lanes measured alone: closed form, the rest of the step
        being ``one_lane - a - b`` (how the default is derived:
        docs/design/performance-model.md#plain-streams). With ``plan``: the penalty whose
        simulated plain-stream time, scaled so the predicted serial time matches ``one_lane_us``,
        matches ``lanes_us`` (bisection). Kept in [0, p_max]; above 1 the lanes
        are slower than one lane.
        """
        if lane_us is not None:
            a, b = lane_us
            rest = one_lane_us - a - b
            return float(np.clip((lanes_us - max(a, b) - rest) / min(a, b), 0.0, p_max))
        if plan is None:
            raise ValueError("fit_overlap_penalty needs the plan or the lanes' times alone")
        return self._fit_penalty(plan, None, lanes_us, one_lane_us, self.overlap_penalty, p_max)

    def fit_quota_penalty(self, quotas: dict[int, int], measured_us: float, one_lane_us: float,
                          plan: LanePlan, p_max: float = 3.0) -> float:
        """The interference between quota lanes (shared HBM, L2) that explains a measured quota
        candidate, scaled like :meth:`fit_overlap_penalty`."""
        return self._fit_penalty(plan, quotas, measured_us, one_lane_us, self.quota_penalty, p_max)

    def _fit_penalty(self, plan: LanePlan, quotas: dict[int, int] | None, measured_us: float,
                     one_lane_us: float, current: float, p_max: float) -> float:
        stats = [self.stats(sg) for sg in plan.subgraphs]
        serial = sum(self.predict(st, self.sms) for st in stats)
        if serial <= 0 or one_lane_us <= 0:
            return current
        target = measured_us * serial / one_lane_us

        def sim(p: float) -> float:
            return self.simulate(plan, quotas, stats=stats, penalty=p).makespan

        lo, hi = 0.0, p_max
        if sim(lo) >= target:
            return lo
        if sim(hi) <= target:
            return hi
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sim(mid) < target else (lo, mid)
        return (lo + hi) / 2

    # -- a lane plan ------------------------------------------------------------------------------

    def serial_us(self, plan: LanePlan, stats: list[SubgraphStats] | None = None) -> float:
        """One stream, full device: the sum of the subgraphs."""
        stats = stats or [self.stats(sg) for sg in plan.subgraphs]
        return sum(self.predict(st, self.sms) for st in stats)

    def simulate(self, plan: LanePlan, quotas: dict[int, int] | None, *,
                 stats: list[SubgraphStats] | None = None, penalty: float | None = None) -> Schedule:
        """Event simulation over the subgraph DAG.

        ``quotas=None``: plain streams, each of k running subgraphs at 1 / (1 + p (k-1)) of its
        full-device speed (p: ``overlap_penalty``) on its SM-bound part. Otherwise side lane L
        runs on ``quotas[L]`` SMs (a lane without a quota on the full device), lane 0 on what the
        running side lanes leave, with ``quota_penalty`` in place of p (0 by default: isolated).
        ``penalty`` overrides the one that applies.
        """
        stats = stats or [self.stats(sg) for sg in plan.subgraphs]
        if penalty is not None:
            p = penalty
        else:
            p = self.overlap_penalty if quotas is None else self.quota_penalty
        lane = {sg.id: sg.lane for sg in plan.subgraphs}
        curve_cache: dict[tuple[int, float], float] = {}

        def dur(i: int, q: float) -> float:
            k = (i, q)
            if k not in curve_cache:
                curve_cache[k] = self.predict(stats[i], q)
            return curve_cache[k]

        waiting = {i: plan.dag.in_degree(i) for i in plan.dag.nodes}
        for sg in plan.subgraphs:
            waiting.setdefault(sg.id, 0)
        left = {i: 1.0 for i in waiting}  # fraction of the subgraph still to run
        ready = [i for i in plan.order if waiting[i] == 0]
        running: list[int] = []
        start: dict[int, float] = {}
        finish: dict[int, float] = {}
        now = 0.0
        while ready or running:
            for i in ready:
                start[i] = now
            running += ready
            ready = []
            # duration of each running subgraph if the current state persisted; the penalty
            # slows the SM-bound part, kernel dispatch overlaps freely
            slow = 1.0 + p * (len(running) - 1)
            side = 0 if quotas is None else sum(quotas.get(lane[i], 0) for i in running if lane[i] != 0)
            total = {}
            for i in running:
                if quotas is None:
                    q = self.sms
                elif lane[i] == 0:
                    q = max(self.sms - side, 1)
                else:
                    q = quotas.get(lane[i], self.sms)
                t = dur(i, q)
                fixed = min(stats[i].fixed_us, t)
                total[i] = fixed + (t - fixed) * slow
            done = [i for i in running if total[i] <= 0 or left[i] <= 1e-12]
            if not done:
                dt = min(left[i] * total[i] for i in running)
                now += dt
                for i in running:
                    left[i] -= dt / total[i]
                done = [i for i in running if left[i] <= 1e-9]
            for i in done:
                running.remove(i)
                left[i] = 0.0
                finish[i] = now
                for j in plan.dag.successors(i):
                    waiting[j] -= 1
                    if waiting[j] == 0:
                        ready.append(j)
            ready.sort(key=plan.order.index)
        return Schedule(max(finish.values(), default=0.0), start, finish)

    def summary(self) -> dict:
        return {"compute": {"alpha": self.compute_alpha, "sat_sms": round(self.compute_sat, 1)},
                "memory": {"alpha": self.memory_alpha, "sat_sms": round(self.memory_sat, 1)},
                "overlap_penalty": round(self.overlap_penalty, 4),
                "quota_penalty": round(self.quota_penalty, 4), "granularity": self.granularity,
                "calibrated": {str(k): f.to_dict() for k, f in self.fits.items()}}

