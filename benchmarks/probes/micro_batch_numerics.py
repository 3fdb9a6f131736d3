"""A GPU check that micro-batches in one graph train as eager accumulation does, with their lanes
replayed as a CUDA graph: each gradient's sum runs on the lane of the micro-batch that made it
last, written into the other micro-batch's gradient (docs/design/lanes.md#staggered-sums).

bench_whole_step's tiny HF LLaVA (``hf-llava-tiny``) in fp32 (TF32 off), ``compile_step(step,
optimizer=AdamW, micro_batches=k)`` with the lanes replayed unmeasured (``choice.Fixed("lanes")``),
against eager accumulation over the same slices; the loss and every parameter after each step,
relative to its largest element, within 1e-3: float32 kernels of other shapes and orders,
amplified by AdamW's normalisation, differ by up to 8e-5 on the CPU, where a sum racing its
gradient's writer would be off by the whole gradient. ``--compiler eager`` runs ATen subgraphs
(seconds to compile).

    PYTHONPATH=. python benchmarks/probes/micro_batch_numerics.py --compiler inductor --k 2 4
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent),  # benchmarks/: bench_whole_step.py
                str(Path(__file__).resolve().parent.parent.parent)]  # the repo root, for apollo_compile
import bench_whole_step as bws  # noqa: E402  (its tiny LLaVA and batches)

import apollo_compile  # noqa: E402
from apollo_compile.runtime import choice  # noqa: E402


def check(k: int, compiler: str, steps: int, device: str) -> bool:
    model, shape = bws.build("hf-llava-tiny")
    model = model.to(device)
    ref = copy.deepcopy(model)

    def step(pixel_values, input_ids):
        loss = model(pixel_values=pixel_values, input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return loss.detach()

    adamw = {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.0}
    opt, ref_opt = torch.optim.AdamW(model.parameters(), **adamw), torch.optim.AdamW(ref.parameters(), **adamw)
    compiled = apollo_compile.compile_step(step, optimizer=opt, micro_batches=k,
                                           options={"subgraph_compiler": compiler})
    worst, ok = 0.0, True
    with choice.using(choice.Fixed("lanes")):
        for i in range(steps):
            inputs = bws.make_batch(shape, 8, torch.device(device), seed=i)
            loss = compiled(*inputs)
            rows = 8 // k
            losses = []
            for j in range(k):
                part = [x[j * rows:(j + 1) * rows] for x in inputs]
                ref_loss = ref(pixel_values=part[0], input_ids=part[1], labels=part[1]).loss
                (ref_loss / k).backward()
                losses.append(ref_loss.detach())
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            pairs = [(loss, torch.stack(losses).mean())] + list(zip(model.parameters(), ref.parameters()))
            for a, b in pairs:
                err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
                worst = max(worst, err)
                ok &= err <= 1e-3
    lanes = [p.inference.decisions["lanes"] for p in apollo_compile.plans() if "inference" in p.graphs]
    shape = [(len(cut.subgraphs), len({sg.lane for sg in cut.subgraphs})) for cut in lanes]
    print(f"k={k} {compiler}: {'PASS' if ok else 'FAIL'} (worst relative error {worst:.2e} over {steps} steps; "
          f"whole-step graphs (subgraphs, lanes): {shape}; fallback: {compiled.fallback_reason})", flush=True)
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, nargs="+", default=[2])
    p.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = "cpu" if args.cpu else "cuda"
    results = [check(k, args.compiler, args.steps, device) for k in args.k]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
