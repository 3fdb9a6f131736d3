"""Train the CLIP-style two-tower model for a few steps under torch.compile and print loss and
step time per step.

What it shows:

* how to use apollo: ``torch.compile(model, backend="apollo", options={...})`` (the backend is
  registered by ``import apollo_compile``, or by the installed entry point) and an ordinary
  training loop around it: forward (the model returns the contrastive loss), backward, AdamW step,
  ``zero_grad(set_to_none=True)``;
* that the first step pays for compilation (reported separately, in seconds) and later steps run
  the compiled code (reported in ms; the summary gives the median step time over the steps after
  the first two, the final loss and, on CUDA, the peak memory);
* for apollo, a short summary of its plan (``apollo_compile.last_plan()``): how many lanes the
  forward and backward graphs use and how many subgraphs they were split into.

The model is the one of ``benchmarks/clip.py`` ("base": ViT-B/16 + a 12-layer text transformer, the
model of DESIGN.md; "tiny": a 2-layer narrow version with the same structure, for CPU runs). Each
step draws a fixed synthetic batch from a seeded generator (``make_batch(seed=step)``), so runs
are repeatable.

Run from anywhere (the repo root is put on ``sys.path`` relative to this file):

    python examples/train_clip.py                      # CPU: tiny config; CUDA: base config, bf16
    python examples/train_clip.py --backend eager      # the same loop without compilation
    python examples/train_clip.py --backend inductor --steps 3
    python examples/train_clip.py --device cuda --config base --batch 32 --dump-dir apollo_dump

On a CPU, ``python examples/train_clip.py`` runs within about a minute with the tiny config, most
of it the first step's compilation (apollo compiles its subgraphs with Inductor by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchmarks/clip.py
sys.path.insert(1, str(ROOT))  # the repo root, for apollo_compile when running from a source tree

import clip  # noqa: E402  (benchmarks/clip.py)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="training steps, the compiling first one included")
    p.add_argument("--batch", type=int, default=8, help="examples per batch (image-text pairs)")
    p.add_argument("--config", choices=sorted(clip.CONFIGS), default=None,
                   help="model size (default: tiny on CPU, base on CUDA; base is the DESIGN.md model)")
    p.add_argument("--backend", choices=["apollo", "inductor", "eager"], default="apollo")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--dump-dir", default=None,
                   help="apollo only: write its annotated graphs, runtime source and plans here")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast for the forward (default: on for CUDA, off on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights; batch i uses seed + i")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        p.error("--steps and --batch must be >= 1")
    if args.dump_dir is not None and args.backend != "apollo":
        p.error("--dump-dir only applies to --backend apollo")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu")
    if args.config is None:
        args.config = "base" if args.device.type == "cuda" else "tiny"
    if args.amp is None:
        args.amp = args.device.type == "cuda"
    return args


def compile_model(model: torch.nn.Module, args: argparse.Namespace):
    if args.backend == "eager":
        return model
    if args.backend == "inductor":
        return torch.compile(model)
    import apollo_compile  # noqa: F401  (registers backend="apollo" when the entry point is not installed)

    options = {"dump_dir": args.dump_dir} if args.dump_dir else {}
    return torch.compile(model, backend="apollo", options=options)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_apollo_plan() -> None:
    import apollo_compile

    plan = apollo_compile.last_plan()
    if plan is None:
        print("apollo plan: none recorded (nothing was compiled by apollo)")
        return
    n_plans = len(apollo_compile.plans())
    print(f"apollo plan: {plan.name}" + (f" (the last of {n_plans} compiled graphs)" if n_plans > 1 else ""))
    for kind in ("forward", "backward"):
        graph = getattr(plan, kind)
        if graph is None:
            print(f"  {kind:8s}: not compiled")
            continue
        lanes = graph.lanes
        if lanes is None:
            print(f"  {kind:8s}: no lane plan" + (f" (fell back: {graph.fallback})" if graph.fallback else ""))
            continue
        s = lanes.summary()
        lane_text = ", ".join(f"{lane}: {'+'.join(mods) or '-'}" for lane, mods in s["lanes"].items())
        line = (f"  {kind:8s}: {len(s['lanes'])} lane(s) [{lane_text}], {s['subgraphs']} subgraphs, "
                f"predicted {s['predicted_serial_us']:.0f} us serial -> {s['predicted_concurrent_us']:.0f} us concurrent")
        if graph.fallback:
            line += f" (runs on a fallback: {graph.fallback})"
        print(line)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device

    model = clip.build(args.config, device=device, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"CLIP-style model ({args.config}): {n_params / 1e6:.2f} M parameters | device {device} | "
          f"backend {args.backend} | batch {args.batch} | {'bf16 autocast' if args.amp else 'fp32'} | "
          f"torch {torch.__version__}")

    step_model = compile_model(model, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    step_ms: list[float] = []
    loss_value = float("nan")
    for step in range(args.steps):
        images, tokens = clip.make_batch(args.batch, device, args.config, seed=args.seed + step)
        sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = step_model(images, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # waits for the step on an accelerator
        sync(device)
        elapsed = time.perf_counter() - start
        if step == 0:
            label = "compile" if args.backend != "eager" else "first step"
            print(f"step 0 ({label}): {elapsed:.2f} s  loss {loss_value:.4f}")
        else:
            step_ms.append(elapsed * 1e3)
            print(f"step {step}  loss {loss_value:.4f}  time {elapsed * 1e3:.1f} ms")

    # the median over the steps after the first two (step 1 may still pay for a recompilation or
    # warm-up); with fewer steps, over whatever steps after the first there are
    timed = step_ms[1:] if len(step_ms) > 1 else step_ms
    summary = f"summary: final loss {loss_value:.4f}"
    if timed:
        first = args.steps - len(timed)
        summary += f" | median step {statistics.median(timed):.1f} ms over steps {first}..{args.steps - 1}"
    if device.type == "cuda":
        summary += f" | peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
    print(summary)

    if args.backend == "apollo":
        print_apollo_plan()
        if args.dump_dir:
            print(f"apollo dump: {args.dump_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
