"""What the report shows of a plan, apart from how it is drawn: per-graph statistics, the predicted
timeline, each subgraph's costliest ops, the runtime candidates and the notes
that explain them. The text table (:mod:`.text`), the page (:mod:`.html_page`), its drawings
(:mod:`.svg`) and the trace (:mod:`.trace`) all read these, so none imports another's internals.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx

from ..annotations import info
from ..devices import DEVICE_SPECS
from ..perf.model import parse_quota_name
from ..plan import GraphPlan


def predicted_timeline(lanes) -> dict[int, tuple[float, float]]:
    """Predicted (start_us, end_us) of every subgraph of a LanePlan, in launch order.

    The recurrence of ``LanePlan.predicted_us``: a subgraph starts when its last DAG predecessor
    ends, and runs for the sum of its nodes' roofline estimates.
    """
    times: dict[int, tuple[float, float]] = {}
    for sg_id in lanes.order:
        start = max((times[p][1] for p in lanes.dag.predecessors(sg_id)), default=0.0)
        times[sg_id] = (start, start + lanes.subgraphs[sg_id].est_us)
    return times


@dataclass(frozen=True)
class GraphStats:
    """What the text table shows for one graph."""

    name: str
    kind: str
    device: str
    lanes: dict[int, list[str]]
    subgraphs: int
    serial_us: float
    concurrent_us: float
    waits: int
    arena_bytes: int | None
    total_bytes: int | None
    compute: int
    memory: int
    recomputed: int
    casts: int
    fallback: str | None

    @property
    def speedup(self) -> float | None:
        return self.serial_us / self.concurrent_us if self.concurrent_us > 0 else None


def graph_stats(gp: GraphPlan) -> GraphStats:
    nodes = list(gp.gm.graph.nodes)
    bounds = Counter(info(n).bound for n in nodes)
    lanes = gp.lanes
    serial = concurrent = 0.0
    waits = 0
    if lanes is not None:
        serial, concurrent = lanes.predicted_us()
        codegen = gp.decisions.get("codegen")
        waits = codegen.waits if codegen is not None else sum(
            lanes.lane_of(a) != lanes.lane_of(b) for a, b in lanes.dag.edges)
    mem = gp.memory
    return GraphStats(
        name=gp.name, kind=gp.kind, device=gp.device,
        lanes=dict(sorted(lanes.lanes.items())) if lanes is not None else {},
        subgraphs=len(lanes.order) if lanes is not None else 0,
        serial_us=serial, concurrent_us=concurrent, waits=waits,
        arena_bytes=mem.arena_bytes if mem is not None else None,
        total_bytes=mem.total_bytes if mem is not None else None,
        compute=bounds.get("compute", 0), memory=bounds.get("memory", 0),
        recomputed=sum(info(n).recomputed for n in nodes), casts=sum(bool(info(n).cast) for n in nodes),
        fallback=gp.fallback,
    )


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# ----------------------------------------------------------------------------------------------
# Per subgraph: its costliest ops, its modality; per graph: the runtime candidates
# ----------------------------------------------------------------------------------------------


TOP_OPS_RANKING = ("ranked by roofline time past the fixed launch cost (the larger of FLOPs / peak and "
                   "bytes / bandwidth), then FLOPs, then bytes")


def largest_ops(nodes: Iterable[torch.fx.Node], k: int) -> list[torch.fx.Node]:
    """The `k` costliest real ops (compute- or memory-bound) of `nodes` (:data:`TOP_OPS_RANKING`).

    ``est_us`` is that roofline time plus one fixed launch cost, so it ranks the same, unrounded:
    on a small model every op reads about the launch floor and only the digits past
    it tell a 200 kFLOP convolution from a 16-element softmax. Ties go to FLOPs, then bytes."""
    nodes = [n for n in nodes if info(n).bound in ("compute", "memory")]
    return sorted(nodes, key=lambda n: (-info(n).est_us, -info(n).flops, -info(n).bytes, n.name))[:k]


def format_flops(n: int) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} FLOP"


def op_cost(n: torch.fx.Node) -> str:
    """What sets a top op's rank, readable: ``"196.6 kFLOP · 38.1 KiB · 2.008 µs"``."""
    a = info(n)
    return f"{format_flops(a.flops)} · {format_bytes(a.bytes)} · {a.est_us:.3f} µs"


def dominant_modality(nodes: Iterable[torch.fx.Node]) -> str | None:
    """The modality that carries most of `nodes`' estimated time (None when none has one)."""
    weight: Counter = Counter()
    for n in nodes:
        m = info(n).modality
        if m:
            weight[m] += info(n).est_us + 1e-6
    return weight.most_common(1)[0][0] if weight else None


CANDIDATE_NAMES = ("one_lane: every subgraph on the caller's stream, in launch order (no concurrency); "
                   "lanes: the lane plan, each side lane on a CUDA stream of its own, no SM limit; "
                   "quota:LANE=SMS,...: the lane plan with each listed side lane held to SMS streaming "
                   "multiprocessors (a green context), lane 0 (the caller's stream) on the SMs they leave")
MEASURED_NOTE = ("measured fills in on a CUDA device only: on the graph's second call the CUDA-graph runner "
                 "captures each candidate, times its replays, reads the memory pool its capture held and keeps "
                 "one (the fastest that beats one stream; under a memory budget one_lane, unmeasured); "
                 "explain() runs one step, so there and on CPU it "
                 "stays empty (-); Report(apollo_compile.plans()) after a few training steps on a GPU shows it "
                 "while the compiled model lives")


def candidates_note() -> str:
    """What the runtime candidates' names and columns mean; shown once per report."""
    return f"{CANDIDATE_NAMES}. µs: predicted by the performance model; {MEASURED_NOTE}."


def device_notes(devices: Iterable[str]) -> list[str]:
    """Why a plan made for the CPU shows no measurements and few or no compute-bound ops.

    The CUDA-graph runner measures candidates only on a CUDA device, and the CPU spec's ridge
    point (FLOP per byte at which an op turns compute-bound) sits above most ops of a small model.
    """
    if "cpu" not in set(devices):
        return []
    ridge = DEVICE_SPECS["cpu"].ridge(torch.float32, matmul=True)
    return [f"planned for the CPU: the measured columns fill in on a GPU only, where the CUDA-graph runner "
            f"replays each candidate; the compute column counts ops whose FLOP per byte reaches the "
            f"device's ridge point, {ridge:.0f} on the CPU spec (fp32 matmul), which most ops of a small "
            f"model stay below, so it may read 0; options={{'device': 'H200'}} plans for a GPU from this machine"]


def describe_candidate(name: str) -> str:
    """One candidate runtime's name in words (:data:`CANDIDATE_NAMES`)."""
    if name == "one_lane":
        return "every subgraph on one stream"
    if name == "lanes":
        return "lanes on their own streams, no SM limit"
    if name.startswith("quota:"):
        try:
            quotas = parse_quota_name(name)
        except ValueError:
            return "an SM split"
        return "; ".join(f"lane {lane} on {sms} SMs" for lane, sms in sorted(quotas.items())) + "; lane 0 on the rest"
    return ""


def candidate_rows(gp: GraphPlan) -> list[tuple[str, str, str, str, str]]:
    """(runtime, predicted µs, measured ms, its capture's memory pool, note) for each candidate the
    quotas pass proposed; the measured columns and the replayed mark come from the CUDA-graph runner
    while the graph lives. The pool is what the candidate's capture held (its temporaries and
    outputs): lanes cost memory where one stream's freed blocks cannot serve another's, so the
    report shows that trade beside the time."""
    decision = gp.decisions.get("quotas")
    if decision is None or not decision.candidates:
        return []
    runner = gp.runner.summary() if gp.runner is not None else {}
    measured = runner.get("measured_ms") or {}
    pools = runner.get("candidate_pool_bytes") or {}
    rows = []
    for c in decision.candidates:
        note = "replayed" if runner.get("chosen") == c.name else ("not captured" if measured and c.name not in measured else "")
        ms = measured.get(c.name)
        pool = pools.get(c.name)
        rows.append((c.name, f"{c.predicted_us:.1f}", f"{ms:.3f}" if ms is not None else "-",
                     f"{pool / 2**20:,.0f} MiB" if pool else "-", note))
    return rows
