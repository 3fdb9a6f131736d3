"""Probe (device tool): what each variant of the user's whole step holds between steps, pool by
pool, and what set its peak, by allocating line (apollo's surplus over reduce-overhead, say).

For each variant of bench_whole_step.py, on a fresh copy of the model: the allocator's history
recorded (Python stacks) over `--steps` whole steps (zero_grad, forward, backward, fused AdamW,
loss.item()); after the last one, the live blocks of every pool (the default one, each CUDA
graph's) grouped by the line that allocated them, each step's peak with what was alive there
(diag_memory.summarize), the run's highest reserved memory with the segments held there
(diag_memory.reserved_peak: which step, which line made them, which pool keeps them), and each
pool's reserved, allocated and free memory after the run. apollo's runners' summaries (inputs
copied or read in place, outputs lent or copied) are printed with them.

    PYTHONPATH=. python benchmarks/probes/whole_step_memory.py --model hf-clip --batch 8 \
        --variants inductor-ro-step apollo-step --out $OUT/who
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import pathlib
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]
import apollo_compile  # noqa: E402
import bench_whole_step as W  # noqa: E402
import common  # noqa: E402
from diag_memory import mark, pools, pools_text, reserved_peak, summarize, where  # noqa: E402


def live_by_line(segments: list[dict]) -> dict[str, list[tuple[str, float, int]]]:
    """Per pool: the live blocks' GiB grouped by allocating line, largest first."""
    out: dict[str, collections.Counter] = {}
    counts: dict[str, collections.Counter] = {}
    for seg in segments:
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        key = "default" if pool == (0, 0) else f"graph pool {pool[0]}.{pool[1]}"
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            line = where(blk.get("frames", []))
            out.setdefault(key, collections.Counter())[line] += blk["size"]
            counts.setdefault(key, collections.Counter())[line] += 1
    return {k: [(line, b / 2**30, counts[k][line]) for line, b in c.most_common(12)] for k, c in out.items()}


def run(variant: str, name: str, base, shape: dict, batch_size: int, steps: int, lines: list[str]) -> dict:
    device = torch.device("cuda")
    common.free_device_memory(device)
    apollo_compile.clear_plans()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    model = copy.deepcopy(base).to(device)
    batch = W.make_batch(shape, batch_size, device, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
    # apollo-step-opt takes the optimizer into its graph
    _, f = W.compiled_loss(variant, name, model, device, argparse.Namespace(amp=True, apollo_options={}), opt)
    forward_backward = W.with_backward(f, device, True)
    update_inside = getattr(f, "optimizer", None) is not None  # then the loop calls no optimizer.step()
    phases = []
    for s in range(steps):
        mark(s)
        torch.cuda.reset_peak_memory_stats()
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(*batch)
        if not update_inside:
            opt.step()
        loss.item()
        torch.cuda.synchronize()
        phases.append({"phase": f"step {s + 1}", "marker": s, "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                       "allocated_after_gib": torch.cuda.memory_allocated() / 2**30})
    mark(steps)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    held = live_by_line(snap["segments"])
    _, text = summarize(snap["device_traces"][0], phases, steps, header=f"### {variant}: each step's peak")
    lines.append(f"\n######## {variant} (hf model {name}, batch {batch_size}): held after step {steps}: "
                 + common.memory_held_text(common.memory_held(device)))
    for pool, top in held.items():
        lines.append(f"  {pool}:")
        lines += [f"    {gib:6.3f} GiB x{n:<4d} {line}" for line, gib, n in top]
    runners = []
    for plan in apollo_compile.plans():
        for kind, g in plan.graphs.items():
            summary = g.summary()
            cg = summary.get("cuda_graph")
            recomputed = (summary.get("lanes") or {}).get("recomputed_at_cuts")
            runners.append({"plan": plan.name, "kind": kind, "cuda_graph": cg, "recomputed_at_cuts": recomputed})
            lines.append(f"  runner {plan.name} {kind}: {json.dumps(cg)}")
            lines.append(f"  recomputed at cuts: {json.dumps(recomputed, default=str)[:600]}")
    lines.append(f"  parameters: {sum(1 for _ in model.parameters())}")
    lines.append(text)
    lines.append(reserved_peak(snap["device_traces"][0], phases, steps, snap["segments"]))
    lines.append(pools_text(f"after step {steps}", pools(snap["segments"])))
    del f, model, opt, loss, batch
    return {"variant": variant, "held": held, "phases": phases, "runners": runners}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="hf-clip", type=W.model_name)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--variants", nargs="+", default=["inductor-ro-step", "apollo-step"], choices=W.VARIANTS)
    p.add_argument("--out", default="whole_step_memory")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("this probe reads the CUDA allocator's history: it needs a CUDA device")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base, shape = W.build(args.model)
    lines: list[str] = []
    results = []
    for v in args.variants:
        try:
            with W.runtime_for(v):  # a variant's rule (its first step's pool, its choice), as bench_whole_step runs it
                results.append(run(v, args.model, base, shape, args.batch, args.steps, lines))
        except Exception as e:  # keep the other variants' findings
            lines.append(f"\n######## {v}: FAILED {type(e).__name__}: {str(e)[:500]}")
            torch.cuda.memory._record_memory_history(enabled=None)
        (out / "whole_step_memory.txt").write_text("\n".join(lines))  # after each variant: a cut run keeps it
        (out / "whole_step_memory.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
