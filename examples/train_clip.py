"""Train the CLIP-style two-tower model on an image-text dataset under torch.compile.

What it shows — an ordinary PyTorch training script, with apollo as its compiler:

* ``torch.compile(model, backend="apollo", dynamic=False)`` (the backend is registered by
  ``import apollo_compile``, or by the installed entry point) around a plain loop: forward (the
  model returns the contrastive loss), backward, AdamW step, ``zero_grad(set_to_none=True)``;
* data from memory-mapped arrays (``examples/data.py`` documents the layout, so you can write your
  own and pass ``--data DIR``; a missing DIR gets a synthetic dataset whose images and captions
  share class-specific colours, stripes and token ids, so the loss goes down), read by a
  DataLoader with worker processes (``--workers``, persistent), pinned memory on CUDA;
* batch-size buckets (CPU: 8, 16, 32; CUDA: 32, 64, 128, 256): every batch has a bucket's size,
  so Dynamo compiles one static-shape graph per bucket used and reuses it (``dynamic=False``);
* choosing the bucket from apollo's memory prediction: one forward+backward at the smallest
  bucket is compiled by apollo and run (no optimizer step; apollo plans as always but runs the
  subgraphs as ATen ops, so only the chosen bucket pays for Inductor), the memory plans of its forward and backward
  graphs (``apollo_compile.last_plan().forward.memory.arena_bytes``, the backward's likewise) plus
  the inputs, parameters, gradients and AdamW states give the bytes at that batch size, and a
  *linear extrapolation in the batch size* predicts the others. The largest bucket predicted to fit
  ``--memory-limit-gib`` (CUDA default: 90% of the free device memory; CPU: 4 GiB) is used. This
  is a prediction from the plan, not a measurement: apollo's arena holds the buffers that cross
  its subgraph boundaries (the saved activations among them), not the temporaries inside a
  subgraph, and the B x B logits grow quadratically — leave head-room. The prediction comes from
  apollo's plan whatever ``--backend`` trains; ``--batch N`` skips it;
* checkpoints (``--checkpoint PATH``: model, optimizer, step, batch size, RNG states, every
  ``--save-every`` steps and at the end) and ``--resume``: the run continues at the saved step, on
  the same batch order, and reaches the same weights as an uninterrupted run (``--steps`` is the
  total step count, so ``--steps 3`` then ``--steps 6 --resume`` equals ``--steps 6``);
* a line before the first step saying that it compiles and about how long that takes, then a
  progress bar with loss, samples/s, peak memory (CUDA: ``torch.cuda.max_memory_allocated``; CPU:
  the process's peak RSS from ``resource.getrusage``) and the time left: redrawn in place on a
  terminal, a line every ``--log-every`` steps otherwise (a log file); ``--metrics FILE`` gets one JSON
  line per step (a resumed run appends);
* the summary at the end: median step time after warm-up, samples/s, final loss, peak memory and,
  for apollo, its plan (lanes and subgraphs of the forward and backward graphs).

The model is the one of ``benchmarks/clip.py`` ("base": ViT-B/16 + a 12-layer text transformer,
the model of DESIGN.md; "tiny": 2-layer narrow towers with the same structure, for CPU runs).

Run from anywhere (the repo root is put on ``sys.path`` relative to this file):

    python examples/train_clip.py                      # CPU: tiny config, one epoch; CUDA: base, bf16
    python examples/train_clip.py --backend eager      # the same loop without compilation
    python examples/train_clip.py --steps 200 --checkpoint checkpoints/clip.pt   # then add --resume
    python examples/train_clip.py --data my_dataset --config base --device cuda --dump-dir apollo_dump
    python examples/train_clip.py --config base --device cuda --memory-budget 0.05 --offload-activations \
        --batch 1024    # apollo's memory passes: recompute all but each block's input, keep that on the host

On a 2-core CPU, ``python examples/train_clip.py`` takes about a minute: it writes the synthetic
dataset (``./data/clip_synthetic``), plans the batch-8 probe (seconds), compiles the chosen bucket
(batch 32, in the first step: about 40 s, said before it starts; 27-54 s measured, the longer on a
busy machine with a cold Inductor cache) and trains one epoch (2048 examples, 64 steps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchmarks/clip.py
sys.path.insert(1, str(ROOT / "examples"))  # examples/data.py
sys.path.insert(2, str(ROOT))  # the repo root, for apollo_compile when running from a source tree

import clip  # noqa: E402  (benchmarks/clip.py)
import data  # noqa: E402  (examples/data.py)

BUCKETS = {"cpu": (8, 16, 32), "cuda": (32, 64, 128, 256)}
SYNTHETIC_N = {"tiny": 2048, "base": 4096}
GIB = 2**30
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["apollo", "inductor", "eager"], default="apollo")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--config", choices=sorted(clip.CONFIGS), default=None,
                   help="model size (default: tiny on CPU, base on CUDA; base is the DESIGN.md model)")
    p.add_argument("--data", default="data/clip_synthetic",
                   help="dataset directory (layout: examples/data.py); a missing one, or a synthetic "
                        "one made for another config, gets a synthetic dataset (default: %(default)s)")
    p.add_argument("--synthetic-n", type=int, default=None,
                   help="examples in a generated synthetic dataset (default: 2048 tiny, 4096 base)")
    p.add_argument("--steps", type=int, default=None,
                   help="total training steps, counted from 0 across --resume (default: --epochs epochs)")
    p.add_argument("--epochs", type=int, default=None,
                   help="passes over the dataset (default 1 without --steps; with both, the first reached stops)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader worker processes (default: 2 on CPU, min(8, cores) on CUDA)")
    p.add_argument("--buckets", default=None,
                   help="comma-separated batch-size buckets (default: 8,16,32 on CPU; 32,64,128,256 on CUDA)")
    p.add_argument("--batch", type=int, default=None,
                   help="use this batch size instead of choosing a bucket from the memory prediction")
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="memory the chosen bucket must fit (default: CUDA 90%% of free memory, CPU 4)")
    p.add_argument("--checkpoint", default=None, help="save model+optimizer+step+RNG here")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (and at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint (start from scratch if it does not exist yet)")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast for the forward (default: on for CUDA, off on CPU)")
    p.add_argument("--subgraph-compiler", choices=["inductor", "eager"], default=None,
                   help="apollo only: compile its subgraphs with Inductor (default) or run them as ATen ops")
    p.add_argument("--memory-budget", type=float, default=None,
                   help="apollo: activation memory kept without recomputation, a fraction in (0, 1] "
                        "(options['memory_budget']; recomputes the rest in the backward)")
    p.add_argument("--offload-activations", action="store_true",
                   help="apollo: saved activations wait for the backward in host memory "
                        "(options['offload_activations']; larger batches, slower steps, no CUDA graphs)")
    p.add_argument("--dump-dir", default=None,
                   help="apollo only: write its annotated graphs, runtime source and plans here")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order")
    p.add_argument("--log-every", type=int, default=10, help="off a terminal: print the progress line every N steps")
    p.add_argument("--metrics", default=None,
                   help="write one JSON line per step (step, loss, ms, ...) here; a resumed run appends")
    args = p.parse_args(argv)

    if args.steps is not None and args.steps < 1 or args.epochs is not None and args.epochs < 1:
        p.error("--steps and --epochs must be >= 1")
    if args.epochs is None and args.steps is None:
        args.epochs = 1
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint PATH")
    if args.save_every < 1 or args.log_every < 1:
        p.error("--save-every and --log-every must be >= 1")
    for flag in ("dump_dir", "subgraph_compiler"):
        if getattr(args, flag) is not None and args.backend != "apollo":
            p.error(f"--{flag.replace('_', '-')} only applies to --backend apollo")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu")
    if args.config is None:
        args.config = "base" if args.device.type == "cuda" else "tiny"
    if args.amp is None:
        args.amp = args.device.type == "cuda"
    if args.workers is None:
        args.workers = 2 if args.device.type == "cpu" else min(8, os.cpu_count() or 1)
    if args.buckets is None:
        args.buckets = BUCKETS["cuda" if args.device.type == "cuda" else "cpu"]
    else:
        try:
            args.buckets = tuple(sorted({int(b) for b in args.buckets.split(",")}))
        except ValueError:
            p.error("--buckets must be comma-separated integers, e.g. 8,16,32")
    if min(args.buckets) < 1 or args.batch is not None and args.batch < 1:
        p.error("batch sizes must be >= 1")
    if args.synthetic_n is None:
        args.synthetic_n = SYNTHETIC_N.get(args.config, 2048)
    return args


# ---------------------------------------------------------------------------------------------
# compilation and memory prediction


def apollo_options(args: argparse.Namespace) -> dict:
    options = {}
    if args.dump_dir:
        options["dump_dir"] = args.dump_dir
    if args.subgraph_compiler:
        options["subgraph_compiler"] = args.subgraph_compiler
    if args.memory_budget is not None:
        options["memory_budget"] = args.memory_budget
    if args.offload_activations:
        options["offload_activations"] = True
    return options


def compile_model(model: torch.nn.Module, args: argparse.Namespace):
    # dynamic=False: every bucket gets its own static-shape graph (no symbolic batch dimension),
    # which the bucketed sampler then reuses; allow a graph per bucket plus a spare.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, len(args.buckets) + 2)
    if args.backend == "eager":
        return model
    if (os.cpu_count() or 1) <= 4 and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        # On a small machine Inductor's pool of compile subprocesses starts after the first compile
        # and takes the cores from the first training steps (seconds on 2 cores); compile in-process.
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = 1
    if args.backend == "inductor":
        return torch.compile(model, dynamic=False)
    import apollo_compile  # noqa: F401  (registers backend="apollo" when the entry point is not installed)

    return torch.compile(model, backend="apollo", dynamic=False, options=apollo_options(args))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def state_bytes(model: torch.nn.Module) -> int:
    """Parameters + gradients + AdamW's two moment buffers (all in the parameters' dtype)."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def default_memory_limit(device: torch.device) -> float:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return 0.9 * free
    return 4.0 * GIB


def predict_bytes(plan_bytes: int, probe_batch: int, per_sample_input: int, static: int,
                  buckets) -> dict[int, float]:
    """Linear extrapolation in the batch size: static + batch * (plan_bytes / probe_batch + inputs)."""
    per_sample = plan_bytes / probe_batch + per_sample_input
    return {b: static + b * per_sample for b in buckets}


def choose_bucket(predicted: dict[int, float], limit: float) -> int:
    """The largest bucket predicted to fit ``limit`` (the smallest one when none fits)."""
    fitting = [b for b, need in predicted.items() if need <= limit]
    return max(fitting) if fitting else min(predicted)


def probe_memory(model, step_model, dataset, args, buckets, limit: float) -> tuple[int, bool]:
    """Compile and run forward+backward at the smallest bucket, read apollo's memory plans,
    predict every bucket's memory; return the chosen bucket and whether the probe compiled the
    training graph of the smallest bucket (see the module docstring)."""
    import apollo_compile

    device, b0 = args.device, buckets[0]
    images, tokens = dataset.batch(range(b0))
    images, tokens = images.to(device), tokens.to(device)
    reuse = args.backend == "apollo" and args.subgraph_compiler == "eager"
    if reuse:  # the probe's graph is the training graph of the smallest bucket
        probe = step_model
    else:
        # Plan with apollo but run the subgraphs as ATen ops: the plan (and so the prediction) is
        # the same, and the expensive compilation happens once, at the chosen bucket.
        options = {**apollo_options(args), "subgraph_compiler": "eager", "cudagraphs": False}
        options.pop("dump_dir", None)
        probe = torch.compile(model, backend="apollo", dynamic=False, options=options)
    n_before = len(apollo_compile.plans())
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
        loss = probe(images, tokens)
    loss.backward()
    sync(device)
    model.zero_grad(set_to_none=True)  # a probe, not a training step: no optimizer update
    elapsed = time.perf_counter() - start
    if not reuse:
        torch._dynamo.reset()  # drop the throwaway probe graph; the training backend compiles afresh

    graphs = [g for p in apollo_compile.plans()[n_before:] for g in (p.forward, p.backward) if g is not None]
    planned = [g for g in graphs if g.memory is not None]
    print(f"memory probe: batch {b0}, compiled and run in {elapsed:.2f} s, loss {loss.item():.4f}")
    if not planned:
        print("memory probe: apollo recorded no memory plan (graph fell back?); using the smallest bucket "
              f"{b0}")
        return b0, reuse
    arena = sum(g.memory.arena_bytes for g in planned)
    parts = ", ".join(f"{g.kind} arena {g.memory.arena_bytes / MIB:.2f} MiB "
                      f"({g.memory.total_bytes / MIB:.2f} MiB without reuse)" for g in planned)
    per_input = images[0].numel() * images.element_size() + tokens[0].numel() * tokens.element_size()
    static = state_bytes(model)
    predicted = predict_bytes(arena, b0, per_input, static, buckets)
    chosen = choose_bucket(predicted, limit)
    print(f"memory plan at batch {b0}: {parts}; params+grads+AdamW {static / MIB:.2f} MiB; "
          f"inputs {per_input * b0 / MIB:.2f} MiB")
    table = ", ".join(f"{b}: {need / GIB:.4f} GiB" for b, need in predicted.items())
    fits = "" if predicted[chosen] <= limit else " (none fits: the smallest)"
    print(f"memory prediction (linear extrapolation in batch size from the batch-{b0} plan, "
          f"not a measurement): {table} | limit {limit / GIB:.4f} GiB -> batch {chosen}{fits}")
    return chosen, reuse


# ---------------------------------------------------------------------------------------------
# data


class BucketBatchSampler(torch.utils.data.Sampler):
    """Batches of exactly ``batch`` indices: a seeded permutation per epoch, last partial batch
    dropped. ``set_epoch(epoch, start)`` picks the epoch and skips its first ``start`` batches
    (resuming mid-epoch); the permutation depends only on ``(seed, epoch)``."""

    def __init__(self, n: int, batch: int, seed: int) -> None:
        if n < batch:
            raise ValueError(f"dataset of {n} examples is smaller than one batch of {batch}")
        self.n, self.batch, self.seed = n, batch, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return self.n // self.batch - self.start

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        for i in range(self.start, self.n // self.batch):
            yield order[i * self.batch:(i + 1) * self.batch]


def open_dataset(args: argparse.Namespace, cfg) -> data.MemmapImageText:
    root = Path(args.data)
    start = time.perf_counter()
    if _may_generate(root):  # the synthetic data do not depend on --seed: seed 0 always
        root, created = data.ensure_synthetic(root, args.synthetic_n, cfg, seed=0)
    elif not (root / data.META).exists():
        raise SystemExit(f"--data {root}: no {data.META} in this non-empty directory; it is neither a dataset "
                         "(layout: examples/data.py) nor a place to write the synthetic one")
    else:
        created = False
    try:
        dataset = data.MemmapImageText(root)
        dataset.check_compatible(cfg)
    except ValueError as e:
        raise SystemExit(f"--data {root}: {e}") from None
    what = f"synthetic, written in {time.perf_counter() - start:.1f} s" if created else \
        ("synthetic" if "synthetic" in dataset.meta else "memmap")
    print(f"data: {root} ({what}): {len(dataset)} examples, images 3x{dataset.image_size}x{dataset.image_size} "
          f"uint8, {dataset.context} tokens, vocab {dataset.vocab}")
    return dataset


def _may_generate(root: Path) -> bool:
    """Generate into a missing directory, an empty one or one holding a synthetic dataset."""
    if not (root / data.META).exists():
        return not root.exists() or not any(root.iterdir())
    return "synthetic" in data.read_meta(root)


# ---------------------------------------------------------------------------------------------
# checkpoints


def save_checkpoint(path: str, model, optimizer, step: int, batch: int, loss: float, args) -> None:
    state = {
        "format": "apollo-train-clip-v1",
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "batch": batch,
        "loss": loss,
        "config": args.config,
        "seed": args.seed,
        "rng": {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-save leaves the previous checkpoint intact


def load_checkpoint(path: str, model, optimizer, args) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("config") != args.config:
        raise SystemExit(f"{path} was saved for --config {state.get('config')}, not {args.config}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # moves the AdamW states to the parameters' device
    torch.set_rng_state(state["rng"]["cpu"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state


# ---------------------------------------------------------------------------------------------
# reporting


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


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
    ckpt = plan.joint.get("checkpoint")
    if ckpt is not None and ckpt.peak_before:
        print(f"  memory  : budget {ckpt.budget}: predicted peak activations {ckpt.peak_after / 2**20:.1f} of "
              f"{ckpt.peak_before / 2**20:.1f} MiB, {len(ckpt.added)} more ops recomputed")
    moved = plan.forward.summary().get("offload") if plan.forward is not None else None
    if moved is not None:
        print(f"  offload : {moved['to_host']} saved values, {moved['bytes'] / 2**20:.1f} MiB to the host and back "
              "each step")


def compile_notice(args: argparse.Namespace, batch: int, compiled: bool) -> str | None:
    """What the first step does before it trains, and about how long it takes here, so that the
    silence of a compile is expected (None: nothing to compile)."""
    if args.backend == "eager":
        return None
    if compiled:
        return f"step 0 runs the batch-{batch} graph the memory probe compiled"
    what = f"step 0 compiles the batch-{batch} training graph with {args.backend}"
    if args.backend == "apollo" and args.subgraph_compiler == "eager":
        return f"{what} (seconds: its subgraphs run as ATen ops)"
    if args.device.type == "cpu":
        how_long = "about 40 s on a 2-core CPU" if args.config == "tiny" else "minutes on a CPU"
    else:
        how_long = "about 40 s on an H200" if args.config == "base" else "under a minute on a GPU"
    return f"{what} ({how_long}; less once Inductor's on-disk cache holds it) ..."


class Progress:
    """The training's progress bar: ``[#####-----] step 12/64 ...`` with loss, speed, peak memory and
    the time left, redrawn in place on a terminal; off a terminal (a log, a pipe) the same line every
    ``every`` steps and at the last one, so a log stays readable."""

    WIDTH = 24

    def __init__(self, start: int, total: int, every: int, stream=None) -> None:
        self.start, self.total, self.every = start, total, every
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self.first: tuple[float, int] | None = None  # (time, step) after the first step, which may compile
        self.shown = ""

    def line(self, step: int, epoch: int, loss: float, samples_per_s: float, peak: int, ms: float) -> str:
        done = step / max(self.total, 1)
        filled = int(round(self.WIDTH * done))
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        now = time.perf_counter()
        if self.first is None:
            self.first = (now, step)
        since, first_step = self.first
        left = (now - since) / (step - first_step) * (self.total - step) if step > first_step else float("nan")
        eta = f"{int(left // 60)}:{int(left % 60):02d} left" if math.isfinite(left) else ""
        return (f"[{bar}] step {step}/{self.total}  epoch {epoch}  loss {loss:.4f}  {ms:.1f} ms  "
                f"{samples_per_s:.0f} samples/s  peak {peak / GIB:.2f} GiB  {eta}").rstrip()

    def update(self, step: int, epoch: int, loss: float, samples_per_s: float, peak: int, ms: float) -> None:
        text = self.line(step, epoch, loss, samples_per_s, peak, ms)
        if self.live:
            self.stream.write("\r" + text.ljust(len(self.shown)))
            self.stream.flush()
            self.shown = text
        elif step % self.every == 0 or step == self.total:
            print(text, file=self.stream, flush=True)

    def write(self, text: str) -> None:
        """A line of its own, above the bar."""
        if self.live and self.shown:
            self.stream.write("\r" + " " * len(self.shown) + "\r")
        print(text, file=self.stream, flush=True)
        if self.live and self.shown:
            self.stream.write(self.shown)
            self.stream.flush()

    def close(self) -> None:
        if self.live and self.shown:
            self.stream.write("\n")
            self.stream.flush()
        self.shown = ""


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    torch.manual_seed(args.seed)
    limit = args.memory_limit_gib * GIB if args.memory_limit_gib is not None else default_memory_limit(device)
    cfg = clip.get_config(args.config)

    dataset = open_dataset(args, cfg)
    model = clip.build(args.config, device=device, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"CLIP-style model ({args.config}): {n_params / 1e6:.2f} M parameters | device {device} | "
          f"backend {args.backend} | {'bf16 autocast' if args.amp else 'fp32'} | torch {torch.__version__}")

    start_step, last_loss, batch = 0, float("nan"), args.batch
    if args.resume and Path(args.checkpoint).exists():
        state = load_checkpoint(args.checkpoint, model, optimizer, args)
        start_step, last_loss = state["step"], state["loss"]
        if batch is not None and batch != state["batch"]:
            raise SystemExit(f"--batch {batch} differs from the checkpoint's batch {state['batch']}: the data "
                             "order would not continue; drop --batch to resume")
        batch = state["batch"]
        print(f"resumed from {args.checkpoint}: step {start_step}, loss {last_loss:.4f}, batch {batch}")
    elif args.resume:
        print(f"--resume: {args.checkpoint} does not exist yet; starting from step 0")

    step_model = compile_model(model, args)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    buckets = tuple(b for b in args.buckets if b <= len(dataset)) or (len(dataset),)
    compiled = False  # whether the graph of the training batch size is compiled already
    if batch is None:
        batch, reused = probe_memory(model, step_model, dataset, args, buckets, limit)
        compiled = reused and batch == buckets[0]
    else:
        print(f"batch {batch} ({'from the checkpoint' if args.resume and start_step else 'from --batch'}; "
              "no memory prediction)")

    steps_per_epoch = len(dataset) // batch
    total = steps_per_epoch * args.epochs if args.epochs is not None else args.steps
    if args.steps is not None:
        total = min(total, args.steps)
    print(f"training: batch {batch}, {steps_per_epoch} steps per epoch, steps {start_step}..{total - 1} "
          f"({len(dataset) - steps_per_epoch * batch} examples per epoch dropped), {args.workers} workers")

    sampler = BucketBatchSampler(len(dataset), batch, args.seed)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=args.workers,
        persistent_workers=args.workers > 0, pin_memory=device.type == "cuda",
    )
    metrics = open(args.metrics, "a" if start_step else "w") if args.metrics else None  # a resumed run appends

    step, epoch = start_step, start_step // steps_per_epoch
    step_ms: list[float] = []
    wall_start = None  # wall clock after the warm-up steps, for samples/s including data loading
    progress = Progress(start_step, total, args.log_every)
    if step < total and (notice := compile_notice(args, batch, compiled)):
        progress.write(notice)
    last_end = time.perf_counter()
    while step < total:
        sampler.set_epoch(epoch, start=step - epoch * steps_per_epoch)
        for images, tokens in loader:
            images = images.to(device, non_blocking=True)
            tokens = tokens.to(device, non_blocking=True)
            sync(device)
            begin = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                loss = step_model(images, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            last_loss = loss.item()  # waits for the step on an accelerator
            end = time.perf_counter()
            ms = (end - begin) * 1e3
            samples_per_s = batch / (end - last_end)
            last_end = end
            if len(step_ms) == 0 and args.backend != "eager":
                how = "compiled by the probe" if compiled else f"compiles the batch-{batch} graph"
                progress.write(f"step {step}: {ms / 1e3:.2f} s (the first step; {how})")
            step_ms.append(ms)
            if len(step_ms) == 2:
                wall_start = end
            step += 1
            peak = peak_memory_bytes(device)
            progress.update(step, epoch, last_loss, samples_per_s, peak, ms)
            if metrics:
                metrics.write(json.dumps({"step": step - 1, "epoch": epoch, "loss": last_loss, "ms": ms,
                                          "samples_per_s": samples_per_s, "peak_bytes": peak}) + "\n")
            if args.checkpoint and step % args.save_every == 0:
                save_checkpoint(args.checkpoint, model, optimizer, step, batch, last_loss, args)
            if step >= total:
                break
        epoch += 1
    progress.close()
    if metrics:
        metrics.close()
    if args.checkpoint and (step % args.save_every != 0 or step == start_step):
        save_checkpoint(args.checkpoint, model, optimizer, step, batch, last_loss, args)
    if args.checkpoint:
        print(f"checkpoint: {args.checkpoint} (step {step})")

    # the median over the steps after the first two (the first may compile, the second may still
    # warm up); with fewer steps, over whatever steps there are after the first
    timed = step_ms[2:] if len(step_ms) > 2 else step_ms[1:]
    summary = f"summary: final loss {last_loss:.4f} | batch {batch}"
    if timed:
        median = statistics.median(timed)
        summary += f" | median step {median:.1f} ms over {len(timed)} steps ({batch / median * 1e3:.0f} samples/s compute"
        if wall_start is not None and len(step_ms) > 2:
            summary += f", {batch * (len(step_ms) - 2) / (last_end - wall_start):.0f} samples/s with data loading"
        summary += ")"
    mem_kind = "peak allocated" if device.type == "cuda" else "peak RSS (main process)"
    summary += f" | {mem_kind} {peak_memory_bytes(device) / GIB:.2f} GiB"
    print(summary)

    if args.backend == "apollo":
        print_apollo_plan()
        if args.dump_dir:
            print(f"apollo dump: {args.dump_dir}")
    return 0 if math.isfinite(last_loss) or step == start_step else 1


if __name__ == "__main__":
    sys.exit(main())
