"""Which GPU kernels a whole step runs, by name: count and total time per step, from torch's
profiler over a few warm steps (CUDA graph replays included: their kernels are traced one by one).

Session 34: with each parameter's update as one fused-Adam op (``fused_update.py``),
``compile_step`` with the optimizer inside ran HF CLIP's graph in 16.0 ms on one lane against
8.2 ms with the update as Inductor's kernels; this says which kernels the time went to.

    PYTHONPATH=. python benchmarks/probes/step_kernels.py --models hf-clip --batch 8 --variants apollo-step-opt
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent),  # benchmarks/: common.py, bench_whole_step.py
                str(Path(__file__).resolve().parent.parent.parent)]  # the repo root, for apollo_compile
import bench_whole_step as bws  # noqa: E402  (its models and whole-step variants)
import common  # noqa: E402
import step_host  # noqa: E402  (the same training step and arguments)


def kernels(variant: str, name: str, base, batch, args, device) -> list[dict]:
    """[{kernel, count, total_us}] per step, the costliest first."""
    step, held = step_host.training_step(variant, name, base, batch, args, device)
    for _ in range(args.warmup):
        step().item()
    common.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        common.synchronize(device)
    count: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count[e.name] += 1
            total[e.name] += e.device_time
    rows = [{"kernel": k, "count": count[k] / args.steps, "total_us": total[k] / args.steps} for k in count]
    del step, held
    common.free_device_memory(device)
    return sorted(rows, key=lambda r: -r["total_us"])


def main(argv=None) -> int:
    if (parsed := step_host.parse_step_args(argv, __doc__, ["apollo-step-opt"], 3)) is None:
        return 2
    args, device, out_dir = parsed
    if device.type != "cuda":
        common.log("step_kernels needs a CUDA device")
        return 2
    found = {}
    for name in args.models:
        base, shape = bws.build(name, args.seed)
        batch = bws.make_batch(shape, args.batch, device, args.seed)
        for variant in args.variants:
            rows = kernels(variant, name, base, batch, args, device)
            found[f"{name} {variant}"] = rows
            (out_dir / "step_kernels.json").write_text(json.dumps(found, indent=1))
            total = sum(r["total_us"] for r in rows)
            common.log(f"--- {name}, batch {args.batch}, {variant}: {sum(r['count'] for r in rows):.0f} kernels, "
                       f"{total / 1e3:.2f} ms of kernel time per step")
            common.log(common.markdown(["kernel", "per step", "us per step", "share"],
                                       [[r["kernel"][:90], f"{r['count']:.0f}", f"{r['total_us']:.0f}",
                                         f"{r['total_us'] / total:.1%}"] for r in rows[:args.top]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
