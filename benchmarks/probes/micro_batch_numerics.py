"""A GPU check that micro-batches in one graph train as eager accumulation does, with their lanes
replayed as a CUDA graph: each gradient's sum runs on the lane of the micro-batch that made it
last, written into the other micro-batch's gradient (docs/design/lanes.md#staggered-sums).

bench_whole_step's tiny HF LLaVA (``hf-llava-tiny``) in fp32 (TF32 off), ``compile_step(step,
optimizer=AdamW, micro_batches=k)`` with the lanes replayed unmeasured (``choice.Fixed("lanes")``),
against eager accumulation over the same slices and against the same compiled step replayed on
one lane (one stream: no race possible); the loss and every parameter after each step, relative
to its largest element. Compiled kernels of other orders, amplified by AdamW's normalisation,
differ from eager by up to 8e-5 on the CPU; on an H100 (float32, TF32 off) the lanes differed by
1.2-1.9e-3 (benchmarks/RESULTS.md, HF LLaVA). The one-lane control measures what compiling alone
changes; a sum racing its gradient's writer would be off by up to a whole update.
``--compiler eager`` runs ATen subgraphs (seconds to compile).

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


def train(model, step_of, k: int, compiler: str, candidate: str | None, shape, steps: int, device: str):
    """The parameters after each of `steps` AdamW steps: eager accumulation over k slices where
    `candidate` is None, else ``compile_step(..., micro_batches=k)`` replaying `candidate`."""
    adamw = {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.0}
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    compiled = None
    if candidate is not None:
        compiled = apollo_compile.compile_step(step_of(model), optimizer=opt, micro_batches=k,
                                               options={"subgraph_compiler": compiler})
    after, rows = [], 8 // k
    for i in range(steps):
        inputs = bws.make_batch(shape, 8, torch.device(device), seed=i)
        if compiled is not None:
            with choice.using(choice.Fixed(candidate)):
                loss = compiled(*inputs)
        else:
            losses = []
            for j in range(k):
                part = [x[j * rows:(j + 1) * rows] for x in inputs]
                ref_loss = model(pixel_values=part[0], input_ids=part[1], labels=part[1]).loss
                (ref_loss / k).backward()
                losses.append(ref_loss.detach())
            loss = torch.stack(losses).mean()
            opt.step()
            opt.zero_grad(set_to_none=True)
        after.append([loss.detach().clone()] + [p.detach().clone() for p in model.parameters()])
    return after, (compiled.fallback_reason if compiled is not None else None)


def worst_error(a, b) -> float:
    """The largest difference over every step's loss and parameters, relative to each tensor's
    largest element in `b`."""
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-6)).item()
               for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def check(k: int, compiler: str, steps: int, device: str) -> bool:
    """Lanes against eager and against one lane: both compiled runs replay the same subgraphs, so
    one lane (one stream, no race possible) is the control for what compilation alone changes.
    PASS: lanes within 1e-3 of eager, or no further from one lane than compiling moves one lane
    from eager (1e-4 at least: atomics in a backward may sum in another order)."""
    model, shape = bws.build("hf-llava-tiny")
    model = model.to(device)
    copies = [copy.deepcopy(model) for _ in range(3)]

    def step_of(m):
        def step(pixel_values, input_ids):
            loss = m(pixel_values=pixel_values, input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            return loss.detach()
        return step

    ref, _ = train(copies[0], step_of, k, compiler, None, shape, steps, device)
    apollo_compile.clear_plans()  # this k's graphs only
    lanes, fallback = train(copies[1], step_of, k, compiler, "lanes", shape, steps, device)
    plans = [p.inference.decisions["lanes"] for p in apollo_compile.plans() if "inference" in p.graphs]
    one_lane, _ = train(copies[2], step_of, k, compiler, "one_lane", shape, steps, device)
    vs_eager, control, vs_control = worst_error(lanes, ref), worst_error(one_lane, ref), worst_error(lanes, one_lane)
    ok = vs_eager <= 1e-3 or vs_control <= max(1e-4, control)
    cuts = [(len(cut.subgraphs), len({sg.lane for sg in cut.subgraphs})) for cut in plans]
    print(f"k={k} {compiler}: {'PASS' if ok else 'FAIL'} (worst relative error over {steps} steps: lanes vs eager "
          f"{vs_eager:.2e}, one lane vs eager {control:.2e}, lanes vs one lane {vs_control:.2e}; whole-step graphs "
          f"(subgraphs, lanes): {cuts}; fallback: {fallback})", flush=True)
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
