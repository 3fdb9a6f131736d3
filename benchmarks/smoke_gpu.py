"""A one-minute GPU check of apollo's CUDA-graph runner inside real training, before a long run.

The tiny CLIP of clip.py (``--config`` for another) with apollo's eager subgraph compiler (ATen
ops, no Inductor compile, so it takes seconds), a memory budget (recomputation in the backward),
and eight training loops: plain steps, two micro-batches per step with
``zero_grad(set_to_none=True)``, and the same with ``set_to_none=False``; then plain steps without
a budget (the backward's lanes are measured and may be replayed) and with Inductor's subgraphs
(which free each input at its last use, so the backward's capture really places its temporaries
over the donated saved activations), with a budget and without one (lanes measured: a side lane
may take over the saved activations the forward's same lane made); last, batch sizes that change
between steps (Dynamo's automatic dynamic shapes: the graph with a symbolic batch replays at the
size it was captured at and runs without its CUDA graph at the other), a second model trained
after the first is deleted (the family of graphs captured for the first is released and captured
again for it), and two live models trained in turn (a family each:
docs/design/cuda-graphs.md#one-graph-several-model-instances). Every step's loss and every
gradient is compared with eager PyTorch on the same weights (TF32 off, so both are true fp32), and
each runner's summary is printed: replays, the runtime it chose, calls that ran without the graph
(0 expected), gradients it moved out of the graph's memory because they were still held (the
lent-gradient path; > 0 only with accumulation and set_to_none=True), and the saved-activation
memory the backward took over (docs/design/cuda-graphs.md#donation).

    PYTHONPATH=. python benchmarks/smoke_gpu.py            # exit status 1 if anything disagrees
    PYTHONPATH=. python benchmarks/smoke_gpu.py --cpu      # the same loops on the CPU (no CUDA graphs)
    PYTHONPATH=. python benchmarks/smoke_gpu.py --config base --batch 16 --mode "plain, inductor, budget"
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # the repo root, for apollo_compile
import clip  # noqa: E402
import common  # noqa: E402

import apollo_compile  # noqa: E402,F401  (registers backend="apollo")

RTOL = 1e-4  # fp32 against fp32 with the same ATen ops: only summation order differs
INDUCTOR_RTOL = 1e-3  # Inductor's fused kernels reduce in another order than ATen's (fp32 throughout)
BUDGET = {"subgraph_compiler": "eager", "memory_budget": 0.2}
MODES = {  # name: (micro-batches per step, zero_grad(set_to_none), apollo options)
    "plain": (1, True, BUDGET),
    "accumulate, set_to_none=True": (2, True, BUDGET),
    "accumulate, set_to_none=False": (2, False, BUDGET),
    "plain, no budget": (1, True, {"subgraph_compiler": "eager"}),
    "plain, inductor, budget": (1, True, dict(BUDGET, subgraph_compiler="inductor")),
    # lanes measured, Inductor freeing inputs: a side lane may take over its own saved activations
    "plain, inductor": (1, True, {"subgraph_compiler": "inductor"}),
    # batch sizes that change (VARYING): Dynamo recompiles with a symbolic batch at the second size;
    # that graph is captured at one size and runs without its CUDA graph at the other
    "batch varies, inductor": (1, True, {"subgraph_compiler": "inductor"}),
    # a second model, built and compiled after the first is deleted, runs the first's graphs
    # (Dynamo keys them by code object): their family is released and captured again for it
    # (runtime/instances.py), and it trains with no call un-graphed
    "new instance, inductor": (1, True, {"subgraph_compiler": "inductor"}),
    # two live models of the class trained step by step in turn: a family of graphs each
    "two live instances, inductor": (1, True, {"subgraph_compiler": "inductor"}),
}
VARYING = (0, -1, -1, -1, 0, -1, 0)  # added to --batch, step by step ("batch varies" modes)


def max_rel_err(model, ref) -> float:
    return max(common.rel_err(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


def run(mode: str, device: str, steps: int = 4, config: str = "tiny", batch_size: int = 4) -> dict:
    micro, set_to_none, options = MODES[mode]
    rtol = INDUCTOR_RTOL if options["subgraph_compiler"] == "inductor" else RTOL
    torch._dynamo.reset()
    worst = [0.0, 0.0]  # loss, gradient relative errors
    varying = mode.startswith("batch varies")
    together = mode.startswith("two live")
    instances = 2 if mode.startswith(("new instance", "two live")) else 1

    def build(seed: int) -> dict:
        model = clip.build(config, device=device, seed=seed)
        ref = copy.deepcopy(model)
        return {"model": model, "ref": ref, "compiled": torch.compile(model, backend="apollo", options=options),
                "opts": [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]}

    def train_step(run: dict, step: int) -> None:
        for k in range(micro):
            size = batch_size + (VARYING[step] if varying else 0)
            batch = clip.make_batch(size, device, config, seed=10 * step + k)
            loss, ref_loss = run["compiled"](*batch), run["ref"](*batch)
            loss.backward()
            ref_loss.backward()
            worst[0] = max(worst[0], abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-12))
        worst[1] = max(worst[1], max_rel_err(run["model"], run["ref"]))
        for o in run["opts"]:
            o.step()
            o.zero_grad(set_to_none=set_to_none)

    def summaries() -> dict:
        plan = apollo_compile.last_plan()
        runners = {kind: plan.graphs[kind].runner for kind in ("forward", "backward") if kind in plan.graphs}
        return {kind: r.summary() if r is not None else None for kind, r in runners.items()}

    n_steps = len(VARYING) if varying else steps
    if together:
        runs = [build(seed) for seed in range(instances)]
        for step in range(n_steps):
            for one in runs:
                train_step(one, step)
        trained = summaries()  # before the last instance is deleted: what it replays
        del runs, one
    else:
        for seed in range(instances):  # each instance deleted before the next is built
            one = build(seed)
            for step in range(n_steps):
                train_step(one, step)
            trained = summaries()
            del one
            gc.collect()
    gc.collect()
    gone = summaries()
    # with varying sizes the symbolic graph runs un-graphed at the sizes it was not captured at;
    # a deleted instance's family is released at its deletion and serves the next; once every
    # instance is deleted, every family is released (docs/design/cuda-graphs.md#a-gone-instances-memory-goes-at-once)
    families = (instances, 0) if together else (1, instances - 1)
    ok = worst[0] <= rtol and worst[1] <= rtol and (device == "cpu" or all(
        s is not None and (varying or s["ungraphed_calls"] == 0) and s["replays"] > 0
        and (s["instances"], s["instances_released"]) == families for s in trained.values()) and all(
        s is not None and s["instances_released"] == instances for s in gone.values()))
    return {"mode": mode, "ok": ok, "loss_rel_err": worst[0], "grad_rel_err": worst[1], "runners": trained,
            "released_once_deleted": {kind: s["instances_released"] if s else None for kind, s in gone.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (no CUDA graphs)")
    p.add_argument("--config", default="tiny", choices=sorted(clip.CONFIGS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mode", action="append", choices=list(MODES), help="modes to run (default: all)")
    args = p.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("smoke_gpu.py needs CUDA (or --cpu)")
        return 2
    print(common.header_line(common.environment(torch.device(device))), flush=True)
    results = []
    for mode in args.mode or MODES:
        try:
            with common.no_tf32():
                results.append(run(mode, device, args.steps, args.config, args.batch))
        except Exception as exc:  # noqa: BLE001  (report it and go on to the next mode)
            results.append({"mode": mode, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    for r in results:
        print(json.dumps(r, default=str))
    print(f"\n{'mode':32} {'ok':5} {'loss rel err':>12} {'grad rel err':>12}  fw replays/ungraphed  "
          "bw replays/ungraphed/moved  bw chosen  donated MiB (on side lanes, withheld)")
    for r in results:
        fw, bw = (r.get("runners") or {}).get("forward") or {}, (r.get("runners") or {}).get("backward") or {}
        print(f"{r['mode']:32} {str(r['ok']):5} {r.get('loss_rel_err', float('nan')):12.2e} "
              f"{r.get('grad_rel_err', float('nan')):12.2e}  {fw.get('replays')}/{fw.get('ungraphed_calls')}"
              f"                  {bw.get('replays')}/{bw.get('ungraphed_calls')}/{bw.get('lent_moved')}"
              f"                    {bw.get('chosen')}  {(bw.get('donated_bytes') or 0) / 2**20:.2f}"
              f" ({(bw.get('side_lane_donated_bytes') or 0) / 2**20:.2f}, {(bw.get('withheld_bytes') or 0) / 2**20:.2f})"
              + (f"  {r['error']}" if "error" in r else ""))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
