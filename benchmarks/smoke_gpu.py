"""A one-minute GPU check of apollo's CUDA-graph runner inside real training, before a long run.

The tiny CLIP of clip.py with apollo's eager subgraph compiler (ATen ops, no Inductor compile, so
it takes seconds), a memory budget (recomputation in the backward), and three training loops:
plain steps, two micro-batches per step with ``zero_grad(set_to_none=True)``, and the same with
``set_to_none=False``. Every step's loss and every gradient is compared with eager PyTorch on the
same weights (TF32 off, so both are true fp32), and each runner's summary is printed: replays,
the runtime it chose, calls that ran without the graph (0 expected) and gradients it moved out of
the graph's memory because they were still held (the lent-gradient path; > 0 only with
accumulation and set_to_none=True).

    PYTHONPATH=. python benchmarks/smoke_gpu.py            # exit status 1 if anything disagrees
    PYTHONPATH=. python benchmarks/smoke_gpu.py --cpu      # the same loops on the CPU (no CUDA graphs)
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_step  # noqa: E402
import clip  # noqa: E402

import apollo_compile  # noqa: E402,F401  (registers backend="apollo")

RTOL = 1e-4  # fp32 against fp32 with the same ATen ops: only summation order differs
MODES = {"plain": (1, True), "accumulate, set_to_none=True": (2, True), "accumulate, set_to_none=False": (2, False)}


def max_rel_err(model, ref) -> float:
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        worst = max(worst, float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12)))
    return worst


def run(mode: str, device: str, steps: int = 4) -> dict:
    micro, set_to_none = MODES[mode]
    torch._dynamo.reset()
    model = clip.build("tiny", device=device)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="apollo", options={"subgraph_compiler": "eager", "memory_budget": 0.2})
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref))
    worst_loss = worst_grad = 0.0
    for step in range(steps):
        for k in range(micro):
            batch = clip.make_batch(4, device, "tiny", seed=10 * step + k)
            loss, ref_loss = compiled(*batch), ref(*batch)
            loss.backward()
            ref_loss.backward()
            worst_loss = max(worst_loss, abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-12))
        worst_grad = max(worst_grad, max_rel_err(model, ref))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=set_to_none)
    plan = apollo_compile.last_plan()
    runners = {kind: plan.graphs[kind].runner for kind in ("forward", "backward") if kind in plan.graphs}
    summaries = {kind: r.summary() if r is not None else None for kind, r in runners.items()}
    ok = worst_loss <= RTOL and worst_grad <= RTOL and (device == "cpu" or all(
        s is not None and s["ungraphed_calls"] == 0 and s["replays"] > 0 for s in summaries.values()))
    return {"mode": mode, "ok": ok, "loss_rel_err": worst_loss, "grad_rel_err": worst_grad, "runners": summaries}


def main() -> int:
    device = "cpu" if "--cpu" in sys.argv[1:] else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("smoke_gpu.py needs CUDA (or --cpu)")
        return 2
    results = []
    for mode in MODES:
        try:
            with bench_step.no_tf32():
                results.append(run(mode, device))
        except Exception as exc:  # noqa: BLE001  (report it and go on to the next mode)
            results.append({"mode": mode, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    for r in results:
        print(json.dumps(r, default=str))
    print(f"\n{'mode':32} {'ok':5} {'loss rel err':>12} {'grad rel err':>12}  fw replays/ungraphed  bw replays/ungraphed/moved")
    for r in results:
        fw, bw = (r.get("runners") or {}).get("forward") or {}, (r.get("runners") or {}).get("backward") or {}
        print(f"{r['mode']:32} {str(r['ok']):5} {r.get('loss_rel_err', float('nan')):12.2e} "
              f"{r.get('grad_rel_err', float('nan')):12.2e}  {fw.get('replays')}/{fw.get('ungraphed_calls')}"
              f"                  {bw.get('replays')}/{bw.get('ungraphed_calls')}/{bw.get('lent_moved')}"
              + (f"  {r['error']}" if "error" in r else ""))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
