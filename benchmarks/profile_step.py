"""Where the time of an apollo step goes: kernels per CUDA stream, and how much the lanes overlap.

The step benchmark (bench_step.py) says how fast apollo is; this says why. It compiles the
CLIP-style model with apollo, lets the CUDA-graph runner capture (and choose between the lane and
one-lane runtimes), then records a few steps with ``torch.profiler`` (kernels inside CUDA-graph
replays are traced by CUPTI) and reports, per replayed graph:

- busy time per stream (union of its kernels' intervals) and the step's wall time on the GPU;
- overlap: time during which kernels of two or more streams run at once, as a share of the
  GPU-busy time — the spatial multiplexing actually achieved;
- host time per step outside the GPU (launch, autograd, copies) = wall - GPU-busy, and the host
  time to issue one step against the step's latency from an idle GPU: close numbers mean the
  step is bound by the host (batch 8 was: DESIGN.md) rather than by the GPU.

Outputs under --out: ``trace_b<batch>.json`` (Perfetto or chrome://tracing), ``profile.json``
and ``profile.md`` (the table, printed last), and the plan report (``report_b<batch>.html``).

    PYTHONPATH=. python benchmarks/profile_step.py --batch 8 32 --compare inductor-ro apollo-1lane
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import bench_step  # noqa: E402  (its variants)
import clip  # noqa: E402
import common  # noqa: E402  (the train step: zero_grad, forward under bf16 autocast, backward)

import apollo_compile  # noqa: E402


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a set of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def overlap_us(per_stream: dict[int, list[tuple[float, float]]]) -> float:
    """Time during which kernels of at least two streams run at once (sweep over all edges)."""
    edges = sorted((t, d) for ivs in per_stream.values() for s, e in ivs for t, d in ((s, 1), (e, -1)))
    active, last, covered = 0, None, 0.0
    for t, d in edges:
        if active >= 2 and last is not None:
            covered += t - last
        active += d
        last = t
    return covered


def kernel_intervals(prof) -> dict[int, list[tuple[float, float]]]:
    """CUDA kernel intervals (µs) per stream id from a finished profiler."""
    per_stream: dict[int, list[tuple[float, float]]] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.time_range.elapsed_us() > 0:
            stream = getattr(evt, "stream", None)
            if stream is None:
                stream = getattr(evt, "device_resource_id", 0)
            per_stream.setdefault(int(stream), []).append((evt.time_range.start, evt.time_range.end))
    return per_stream


def host_and_latency(step, steps: int) -> tuple[float, float]:
    """Median host time to issue one step (it returns before the GPU is done) and median latency
    of a step from an idle GPU: when the two are close, the step is bound by the host."""
    issue_ms, latency_ms = [], []
    for _ in range(max(steps, 10)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue_ms.append((t1 - t0) * 1e3)
        latency_ms.append((t2 - t0) * 1e3)
    return round(statistics.median(issue_ms), 2), round(statistics.median(latency_ms), 2)


def compare_variant(name: str, batch: int, args) -> dict:
    """Host issue time and latency of another variant (bench_step.py's names), same step."""
    torch._dynamo.reset()
    device = torch.device(args.device)
    model = clip.build(args.config, device=device)
    step = functools.partial(common.train_step, model, bench_step.compile_variant(name, model),
                             clip.make_batch(batch, device, args.config, seed=0), device, device.type == "cuda")
    for _ in range(args.warmup):
        step()
    issue, latency = host_and_latency(step, args.steps)
    return {"variant": name, "batch": batch, "host_issue_ms": issue, "step_latency_ms": latency}


def profile_batch(batch: int, args) -> dict:
    device = torch.device(args.device)
    model = clip.build(args.config, device=device)
    compiled = torch.compile(model, backend="apollo", options=dict(args.option))
    data = clip.make_batch(batch, device, args.config, seed=0)
    step = functools.partial(common.train_step, model, compiled, data, device, device.type == "cuda")
    for _ in range(args.warmup):  # compile, warm up, capture (and measure the runtime candidates)
        step()
    torch.cuda.synchronize()
    issue, latency = host_and_latency(step, args.steps)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    out = Path(args.out)
    prof.export_chrome_trace(str(out / f"trace_b{batch}.json"))  # Perfetto / chrome://tracing
    per_stream = kernel_intervals(prof)
    all_ivs = [iv for ivs in per_stream.values() for iv in ivs]
    wall = (max(e for _, e in all_ivs) - min(s for s, _ in all_ivs)) / args.steps if all_ivs else float("nan")
    busy = union_us(all_ivs) / args.steps if all_ivs else float("nan")
    plan = apollo_compile.last_plan()
    runners = {g.name: g.runner.summary() for g in plan.graphs.values() if g.runner is not None}
    apollo_compile.Report([plan]).save_html(str(out / f"report_b{batch}.html"))
    return {
        "batch": batch,
        "streams": {str(k): round(union_us(v) / args.steps, 1) for k, v in sorted(per_stream.items())},
        "host_issue_ms": issue,
        "step_latency_ms": latency,
        "gpu_wall_us": round(wall, 1),
        "gpu_busy_us": round(busy, 1),
        "overlap_us": round(overlap_us(per_stream) / args.steps, 1),
        "overlap_share": round(overlap_us(per_stream) / args.steps / busy, 3) if busy == busy and busy else None,
        "runners": runners,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--config", default="base", choices=["base", "tiny"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--option", action="append", default=[], type=lambda kv: (kv.split("=")[0], ast.literal_eval(kv.split("=", 1)[1])),
                   help="apollo option as key=python_literal, e.g. --option max_lanes=1")
    p.add_argument("--compare", nargs="*", default=[], metavar="VARIANT",
                   help="also time these bench_step.py variants' host issue and latency (e.g. inductor-ro apollo-1lane)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or args.device != "cuda":
        print("profile_step.py measures CUDA streams: it needs a CUDA device")
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(common.header_line(common.environment(torch.device(args.device))), flush=True)
    rows = []
    for batch in args.batch:
        torch._dynamo.reset()
        rows.append(profile_batch(batch, args))
        print(json.dumps(rows[-1]), flush=True)
    compared = [compare_variant(name, batch, args) for batch in args.batch for name in args.compare]
    (Path(args.out) / "profile.json").write_text(json.dumps({"apollo": rows, "compared": compared}, indent=1))
    lines = ["| batch | host issue ms | step latency ms | GPU wall us | GPU busy us | overlap us | overlap share | busy per stream us | runtime chosen |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        chosen = "; ".join(f"{k}: {v['chosen']} {v['measured_ms']}" for k, v in r["runners"].items())
        lines.append(f"| {r['batch']} | {r['host_issue_ms']} | {r['step_latency_ms']} | {r['gpu_wall_us']} | {r['gpu_busy_us']} | {r['overlap_us']} | "
                     f"{r['overlap_share']} | {r['streams']} | {chosen} |")
    if compared:
        lines += ["", "| batch | variant | host issue ms | step latency ms |", "|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['variant']} | {r['host_issue_ms']} | {r['step_latency_ms']} |" for r in compared]
    table = "\n".join(lines)
    (Path(args.out) / "profile.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
