"""Which GPU kernels a whole step runs, by name: count and total time per step, from torch's
profiler over a few warm steps (CUDA graph replays included: their kernels are traced one by one).

It says which kernels a step's time goes to (the optimizer's update as fused-Adam ops or as
Inductor's kernels, ``fused_update.py``), and its timeline (one row per variant): from the first kernel of a step to its last
("span"), the time some kernel runs ("busy", the union over streams), the kernels' summed time
("sum": sum / busy is how much the streams overlap), the busiest stream's sum, and the sums by kind
(matmuls, attention, the optimizer's update, Inductor's Triton kernels, copies and the rest), the
medians over the profiled steps, each run from an idle GPU. It says how much of a step's GPU time
is left idle and what kind of kernel fills the rest.

    PYTHONPATH=. python benchmarks/probes/step_kernels.py --models hf-clip --batch 8 --variants apollo-step-opt
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent),  # benchmarks/: common.py, bench_whole_step.py
                str(Path(__file__).resolve().parent.parent.parent)]  # the repo root, for apollo_compile
import bench_whole_step as bws  # noqa: E402  (its models and whole-step variants)
import common  # noqa: E402
import step_host  # noqa: E402  (the same training step and arguments)


STEP_MARK = "step_kernels.step"
KINDS = (("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|_mm_|splitk", re.I)),
         ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
         ("update", re.compile(r"adam|multi_tensor|foreach", re.I)),
         ("triton", re.compile(r"^triton", re.I)),
         ("copy", re.compile(r"^memcpy|^memset", re.I)))


def kind(kernel: str) -> str:
    """The kind of a kernel, by its name (KINDS, first match; "other" else)."""
    return next((k for k, pattern in KINDS if pattern.search(kernel)), "other")


def is_kernel(e) -> bool:
    """Whether a profiler event is GPU work (a kernel, copy or fill), not a range marked on the GPU's
    timeline (this probe's steps, ``Optimizer.step#AdamW.step``)."""
    return (e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
            and not e.is_user_annotation() and not e.name().startswith(STEP_MARK) and "#" not in e.name())


def busy_ns(intervals: list[tuple[int, int]]) -> int:
    """The length of the union of [start, end) intervals."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def timeline(events) -> dict[str, float]:
    """Medians over the profiled steps (us): span, busy, sum, the busiest stream, the sums by kind,
    and how many streams and kernels a step has (the module docstring)."""
    marks = [(e.start_ns(), e.end_ns()) for e in events  # the host's ranges (the GPU's timeline has them too)
             if e.name().startswith(STEP_MARK) and e.device_type() == torch.autograd.DeviceType.CPU]
    gpu = [(e.start_ns(), e.end_ns(), e.device_resource_id(), e.name()) for e in events if is_kernel(e)]
    rows = []
    for lo, hi in marks:
        mine = [g for g in gpu if lo <= g[0] < hi]
        if not mine:
            continue
        streams: dict[int, int] = defaultdict(int)
        kinds: dict[str, int] = defaultdict(int)
        for a, b, stream, kernel in mine:
            streams[stream] += b - a
            kinds[kind(kernel)] += b - a
        ns = {"span": max(g[1] for g in mine) - min(g[0] for g in mine), "busy": busy_ns([g[:2] for g in mine]),
              "sum": sum(streams.values()), "busiest stream": max(streams.values())}
        ns |= {k: kinds.get(k, 0) for k, _ in KINDS} | {"other": kinds.get("other", 0)}
        rows.append({k: v / 1e3 for k, v in ns.items()} | {"streams": len(streams), "kernels": len(mine)})
    if not rows:
        return {}
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def kernels(variant: str, name: str, base, batch, args, device) -> tuple[list[dict], dict[str, float]]:
    """([{kernel, count, total_us}] per step, the costliest first; the step's `timeline`)."""
    step, held = step_host.training_step(variant, name, base, batch, args, device)
    for _ in range(args.warmup):
        step().item()
    common.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            with torch.profiler.record_function(f"{STEP_MARK}{i}"):  # from an idle GPU to the step's end
                step()
                common.synchronize(device)
    events = prof.profiler.kineto_results.events()
    steps = timeline(events)
    count: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for e in events:
        if is_kernel(e):
            count[e.name()] += 1
            total[e.name()] += e.duration_ns() / 1e3
    rows = [{"kernel": k, "count": count[k] / args.steps, "total_us": total[k] / args.steps} for k in count]
    del step, held
    common.free_device_memory(device)
    return sorted(rows, key=lambda r: -r["total_us"]), steps


def main(argv=None) -> int:
    if (parsed := step_host.parse_step_args(argv, __doc__, ["apollo-step-opt"], 3)) is None:
        return 2
    args, device, out_dir = parsed
    if device.type != "cuda":
        common.log("step_kernels needs a CUDA device")
        return 2
    found, timelines = {}, {}
    for name, base, batch in step_host.step_models(args, device):
        for variant in args.variants:
            with bws.runtime_for(variant):  # a *-first-step-pool variant's pool, as bench_whole_step runs it
                rows, timelines[f"{name} {variant}"] = kernels(variant, name, base, batch, args, device)
            found[f"{name} {variant}"] = rows
            (out_dir / "step_kernels.json").write_text(json.dumps(found, indent=1))
            total = sum(r["total_us"] for r in rows)
            common.log(f"--- {name}, batch {args.batch}, {variant}: {sum(r['count'] for r in rows):.0f} kernels, "
                       f"{total / 1e3:.2f} ms of kernel time per step")
            common.log(common.markdown(["kernel", "per step", "us per step", "share"],
                                       [[r["kernel"][:90], f"{r['count']:.0f}", f"{r['total_us']:.0f}",
                                         f"{r['total_us'] / total:.1%}"] for r in rows[:args.top]]))
    (out_dir / "step_timeline.json").write_text(json.dumps(timelines, indent=1))
    cols = ["span", "busy", "sum", "busiest stream", *(k for k, _ in KINDS), "other", "streams", "kernels"]
    common.log(f"--- timeline per step, batch {args.batch}, medians in us (streams, kernels: counts)")
    common.log(common.markdown(["model variant", *cols], [[key, *(f"{row.get(c, 0):.0f}" for c in cols)]
                                                          for key, row in timelines.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
