"""Diagnostic (device tool): does training go on after a CUDA-graph capture runs out of memory?

docs/design/cuda-graphs.md#capture-headroom. With ``cudagraphs=True`` (no headroom check) at a
batch whose backward capture runs out within the memory limit (budgeted CLIP, batch 1152 in
20 GiB: RESULTS.md, "CUDA graphs near the memory limit"), step 2 is lost. The forward then lets
its graph go once that step's tensors are dead, and the steps after it run un-graphed as step 1 did. The loop
catches an out-of-memory error as a trainer that skips a batch would (dropping its references to
the step), and prints per step: ok or OOM, allocated / reserved GiB, and each graph's CUDA-graph
state.

    PYTHONPATH=. python benchmarks/probes/capture_recovery.py --batch 1152 --budget 0.05 --limit-gib 20 --steps 5
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys

import torch

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent),  # benchmarks/: common.py, clip.py, ...
                str(pathlib.Path(__file__).resolve().parent.parent.parent)]  # the repo root, for apollo_compile
import apollo_compile  # noqa: E402  (registers the backend without an install)
import clip  # noqa: E402
import common  # noqa: E402

GiB = common.GiB


def graph_states() -> dict[str, dict]:
    """Each compiled graph's CUDA-graph summary: replays, un-graphed calls, why disabled."""
    keep = ("replays", "ungraphed_calls", "disabled", "capture_refused")
    return {f"{plan.name} {kind}": {k: (graph.summary().get("cuda_graph") or {}).get(k) for k in keep}
            for plan in apollo_compile.plans() for kind, graph in plan.graphs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--budget", type=float, default=0.05)
    p.add_argument("--limit-gib", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--config", default="base", choices=sorted(clip.CONFIGS))
    p.add_argument("--cudagraphs", default="true", choices=["true", "auto"],
                   help="true: capture even near the limit (the case under study); auto: the headroom rule")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the loop alone, no CUDA graphs (the tests check the script runs)")
    p.add_argument("--out", default=None, help="also write the per-step records here as JSON")
    p.add_argument("--apollo-options", type=json.loads, default={},
                   help='JSON options added to backend="apollo"\'s, e.g. \'{"subgraph_compiler": "eager"}\'')
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("needs CUDA: the question is what a failed CUDA-graph capture leaves behind", file=sys.stderr)
        return 2

    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.limit_gib * GiB / total))
        torch.cuda.reset_peak_memory_stats()
    apollo_compile.clear_plans()
    model = clip.build(args.config, device=args.device)
    options = {"precision": "bf16", "memory_budget": args.budget,
               "cudagraphs": True if args.cudagraphs == "true" and cuda else "auto", **args.apollo_options}
    step_fn = torch.compile(model, backend="apollo", options=options, dynamic=False)
    batch = clip.make_batch(args.batch, args.device, args.config)

    records = []
    for step in range(1, args.steps + 1):
        rec = {"step": step}
        try:  # the precision option casts, so no autocast
            common.train_step(model, step_fn, batch, device, amp=False)
            common.synchronize(device)
            rec["status"] = "ok"
        except torch.OutOfMemoryError as e:
            rec["status"] = "OOM"
            rec["error"] = str(e).splitlines()[0][:200]
            rec["notes"] = list(getattr(e, "__notes__", []))
        finally:
            gc.collect()  # a trainer that skips the batch drops its references to the step
        if cuda:
            rec.update(allocated_gib=torch.cuda.memory_allocated() / GiB,
                       reserved_gib=torch.cuda.memory_reserved() / GiB, peak_gib=torch.cuda.max_memory_allocated() / GiB)
        else:
            rec.update(allocated_gib=0.0, reserved_gib=0.0, peak_gib=0.0)
        rec["graphs"] = graph_states()
        records.append(rec)
        print(f"step {step}: {rec['status']:3s} allocated {rec['allocated_gib']:.2f} GiB, reserved "
              f"{rec['reserved_gib']:.2f}, peak {rec['peak_gib']:.2f}" + (f" ({rec['error']})" if "error" in rec else ""))
        for note in rec.get("notes", []):
            print(f"    note: {note}")
        for name, state in rec["graphs"].items():
            print(f"    {name}: {state}")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "capture_recovery.json").write_text(json.dumps({"args": vars(args), "steps": records}, indent=1))
    lost = [r["step"] for r in records if r["status"] != "ok"]
    print(f"steps lost: {lost or 'none'}; the last {args.steps - max(lost or [0])} ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
