"""Data-parallel training throughput of the CLIP-style model (benchmarks/clip.py): apollo under DDP
and FSDP2 against DDP + Inductor and against single-GPU apollo, at the same per-GPU batch.

Launch with torchrun, one process per GPU (from the repo root):

    torchrun --nproc_per_node 8 benchmarks/bench_distributed.py --batch 32
    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --batch 8 32 --variants ddp-inductor ddp-apollo
    # CPU smoke (gloo; without torchrun it runs as a world of one):
    python benchmarks/bench_distributed.py --device cpu --config tiny --batch 2 --steps 2 --warmup 1
    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --device cpu --config tiny --batch 2 \\
        --steps 2 --warmup 1 --apollo-options '{"subgraph_compiler": "eager"}'

Variants (each rank builds its copy from the same seed; variants run one after another in ONE
job, so their times are comparable; DESIGN.md notes that absolute times drift between runs):

    single-apollo      torch.compile(model, backend="apollo"), no gradient communication: every
                       rank trains alone on its own GPU (the single-GPU baseline, measured on all
                       GPUs at once so that clocks and host load match the distributed variants)
    ddp-eager          DistributedDataParallel, eager (also the numerics reference, see below)
    ddp-inductor       torch.compile(DDP(model)); Dynamo's DDPOptimizer splits the graph at
                       DDP's gradient buckets (torch._dynamo.config.optimize_ddp, the default) so
                       that bucket all-reduces overlap the backward
    ddp-apollo         the same with backend="apollo": apollo plans each bucket's graph on its own.
                       A bucket graph holds consecutive layers, so most of them contain one tower
                       only and the towers overlap only in the graphs that straddle both
    ddp-apollo-1graph  DDP + apollo with optimize_ddp off: one graph for the whole step (the
                       towers overlap as on one GPU) but the gradient all-reduce starts only after
                       the whole compiled backward. ddp-apollo vs this row is the trade-off between
                       communication overlap and tower concurrency
    ddp-apollo-ca      DDP's Python reducer (optimize_ddp="python_reducer", set before DDP is
                       built) with the backward under compiled autograd, compiled by apollo too:
                       the backward is one graph with the bucket all-reduces inside it (functional
                       collectives), so they can run while the rest of the backward does
    fsdp2-eager        fully_shard on every transformer Block of both towers and on the root
                       (torch.distributed.fsdp.fully_shard; torch.distributed._composable.fsdp on
                       older torch), eager: the memory reference for FSDP2
    fsdp2-apollo       the same, the root compiled with apollo. Dynamo does not trace FSDP2's
                       hooks (torch._dynamo.config.skip_fsdp_hooks), so it breaks the graph at
                       every sharded Block: apollo sees per-Block graphs and cannot overlap the
                       towers; expect it near fsdp2 + Inductor, with FSDP2's memory per GPU

FSDP2 rejects 0-d parameters, so for the fsdp2 variants the model's ``logit_scale`` is made a
(1,)-tensor (same value; the forward broadcasts it the same way). Parameters stay fp32 under
bf16 autocast in every variant (no FSDP2 MixedPrecisionPolicy), so all variants compute the same
thing.

Method, per per-GPU batch size B (global batch = world size x B; rank r draws its own shard,
``clip.make_batch(B, seed=seed + 1000 * r)``):

1. A step is ``zero_grad(set_to_none=True)``, the forward under ``torch.autocast(bfloat16)`` (unless
   ``--no-amp``), ``backward()`` — which for DDP / FSDP2 includes the gradient all-reduce /
   reduce-scatter. There is no optimizer step (as in bench_step.py): weights never change, so the
   numerics check runs at the reference weights.
2. Warm-up: ``--warmup`` steps (compilation, CUDA-graph recording); their wall time, the maximum
   over ranks, is "compile s".
3. Timing: ``--steps`` steps; before each, ``synchronize()`` and a ``dist.barrier()`` (outside the
   timed window), then a CUDA event pair around the step (``perf_counter`` on CPU). The step time
   of a variant is the median over timed steps of the slowest rank's time (a data-parallel step
   ends when the slowest rank does). Throughput in samples/s: world x B / median for DDP and
   FSDP2; for single-apollo, the sum over ranks of B / (that rank's median). "scaling" is a
   variant's samples/s over single-apollo's: 1.0 is perfect data-parallel scaling.
4. Memory per rank: ``reset_peak_memory_stats()`` before the timed steps, then
   ``max_memory_allocated`` / ``max_memory_reserved`` on every rank (GPU only); the table shows
   the maximum over ranks, the JSON every rank. Read "reserved" for CUDA-graph variants (graph
   pools do not show as allocated).
5. Numerics, after timing, on another batch (seed + 1): eager DDP in the same job is the reference
   (its loss on rank 0 and its all-reduced gradients; with AMP also eager DDP's fp32 gradients, to
   know the bf16 noise floor). Each variant's gradients — DDP: as all-reduced; FSDP2: the full
   tensor of each sharded gradient; single-apollo: averaged over ranks by hand after the step,
   which is exactly what DDP computes — are compared with common.compare (same tolerances and
   PASS / PASS* rule as the single-GPU benchmark).

Each variant runs in try/except on every rank; a failure (OOM included) becomes a FAILED / OOM row
and the run continues with the next variant. A failure on one rank only can leave the others in a
collective until the process-group timeout (``--pg-timeout-s``). Results are appended at the end
of the run to ``<out>/distributed_results.jsonl`` (one JSON object per run: environment, rows,
every rank's step times and memory) and ``<out>/distributed_results.md``; after every batch size
the run so far is kept in ``<out>/distributed_results.partial.json``. Rank 0 prints the table last.

Rank-0 variants: the global batch (every rank's shard, concatenated) trained by rank 0 alone, at
the same global batch as the DDP rows, while the other ranks wait at a host (gloo) barrier that
keeps no kernel spinning on their GPU:

    onegpu-apollo     apollo on cuda:0 alone (CUDA graphs as usual): what one GPU does with the
                       whole global batch
    placed-eager       apollo_compile.place_modalities: the vision tower on cuda:0, the text tower
    placed-inductor    on the last GPU, projections and loss on cuda:0 (model parallelism by tower);
    placed-apollo      eager, torch.compile, backend="apollo" (one lane, no CUDA graph: the graph
                       spans two devices, placement.py says why)

The contrastive loss of the global batch is not the mean of the shards' losses (each example's
negatives differ), so these rows are checked against eager on one GPU at the global batch, not
against eager DDP; their step time is wall time around a step with every GPU synchronized; their
memory is the larger of the two GPUs' peaks; samples/s is the global batch over the median step.

Not done: pipeline and tensor parallelism are not measured.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/clip.py, common.py, bench_step.py
sys.path.insert(1, str(HERE.parent))  # the repo root, for apollo_compile

import clip  # noqa: E402  (benchmarks/clip.py)
import common  # noqa: E402  (the method every benchmark here shares)
from bench_step import compiled_autograd  # noqa: E402
from common import (  # noqa: E402
    GiB, compare, fmt, markdown, no_tf32, numerics_cell, numerics_text, spread, synchronize,
    time_steps, tolerance_text, train_step, verdict,
)

RANK0_VARIANTS = ("onegpu-apollo", "placed-eager", "placed-inductor", "placed-apollo")
VARIANTS = ("single-apollo", "ddp-eager", "ddp-inductor", "ddp-apollo", "ddp-apollo-1graph", "ddp-apollo-ca",
            "fsdp2-eager", "fsdp2-apollo", *RANK0_VARIANTS)
BASELINE = "ddp-inductor"  # "vs ddp-inductor" = its median / the variant's median
SINGLE = "single-apollo"


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def log(*args: Any, all_ranks: bool = False) -> None:
    if all_ranks:
        print(f"[rank {rank()}]", *args, flush=True)
    elif rank() == 0:
        print(*args, flush=True)


# --------------------------------------------------------------------------------------------
# process group


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_kind: str, timeout_s: float) -> torch.device:
    """env:// from torchrun; without torchrun, a world of one on 127.0.0.1."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    kwargs = {"device_id": device} if device_kind == "cuda" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return device


def gather(obj: Any) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------------------------
# variants


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def build_variant(name: str, base: nn.Module, device: torch.device, args) -> tuple[nn.Module, Callable, dict]:
    """(the module whose .parameters() train, the callable of a step's forward, Dynamo settings)."""
    model = copy.deepcopy(base).to(device)
    engine, _, compiler = name.partition("-")
    settings: dict[str, Any] = {}
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        settings["optimize_ddp"] = {"apollo-1graph": False, "apollo-ca": "python_reducer"}.get(compiler, True)
        with torch._dynamo.config.patch(optimize_ddp=settings["optimize_ddp"]):  # DDP picks its reducer when built
            wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                          bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view)
    elif engine == "fsdp2":
        fully_shard = _fully_shard()
        model.logit_scale = nn.Parameter(model.logit_scale.detach().reshape(1))  # no 0-d params in FSDP2
        for block in [*model.vision.blocks, *model.text.blocks]:
            fully_shard(block)
        wrapped = fully_shard(model)
    elif engine in ("single", "onegpu"):
        wrapped = model
    elif engine == "placed":
        from apollo_compile import place_modalities

        last = torch.device(device.type, torch.cuda.device_count() - 1) if device.type == "cuda" else device
        wrapped = place_modalities(model, {"vision": device, "text": last}, output_device=device)
    else:
        raise ValueError(f"unknown variant {name!r}")
    if compiler == "eager":
        step_fn = wrapped
    elif compiler == "inductor":
        step_fn = torch.compile(wrapped)
    elif compiler.startswith("apollo"):
        import apollo_compile  # noqa: F401  (importing registers backend="apollo")

        step_fn = torch.compile(wrapped, backend="apollo", options=dict(args.apollo_options))
        if compiler == "apollo-ca":
            settings["compiled_autograd"] = torch.compile(backend="apollo", options=dict(args.apollo_options))
    else:
        raise ValueError(f"unknown variant {name!r}")
    return model, step_fn, settings


# --------------------------------------------------------------------------------------------
# steps, timing, numerics


def loss_and_grads(model: nn.Module, step_fn: Callable, batch: tuple, device: torch.device, amp: bool,
                   average: bool = False) -> tuple[float, dict]:
    """One step; rank-local loss, and every gradient as the data-parallel step sees it (on every
    rank; an FSDP2 gradient gathered to its full tensor). average=True all-reduces the local
    gradients to their mean first (single-apollo)."""
    def mean_over_ranks(g: torch.Tensor) -> torch.Tensor:
        g = g.detach().clone()
        dist.all_reduce(g)
        return g / dist.get_world_size()

    return common.loss_and_grads(model, step_fn, batch, device, amp,
                                 grad=mean_over_ranks if average and dist.get_world_size() > 1 else None)


def free_device_memory(device: torch.device) -> None:
    common.free_device_memory(device)


def reference(base: nn.Module, batch: tuple, device: torch.device, args, variant: str = "ddp-eager") -> dict:
    """Eager DDP on the numerics batch: loss, all-reduced gradients and, with AMP, the fp32 ones.
    With variant="onegpu-eager", eager on this GPU alone (the rank-0 variants' reference)."""
    model, step_fn, _ = build_variant(variant, base, device, args)
    loss, grads = loss_and_grads(model, step_fn, batch, device, args.amp)
    fp32 = None
    if args.amp:
        with no_tf32():
            fp32 = loss_and_grads(model, step_fn, batch, device, False)
    del model, step_fn
    free_device_memory(device)
    return common.reference(loss, grads, fp32)


def run_variant(name: str, base: nn.Module, batch: tuple, numerics_batch: tuple, ref: dict, args,
                device: torch.device) -> dict:
    if name in RANK0_VARIANTS:
        return run_on_rank0(name, base, args, device)
    row: dict[str, Any] = {"variant": name, "status": "ok"}
    world = dist.get_world_size()
    model, step_fn, settings = build_variant(name, base, device, args)
    with contextlib.ExitStack() as stack:
        backward_compiler = settings.pop("compiled_autograd", None)
        if settings:
            stack.enter_context(torch._dynamo.config.patch(**settings))
        if backward_compiler is not None:
            stack.enter_context(compiled_autograd(backward_compiler))
        plans_before = apollo_plans_so_far(name)

        def run_step() -> None:
            train_step(model, step_fn, batch, device, args.amp)

        synchronize(device)
        dist.barrier()
        compile_s = common.warm_up(run_step, args.warmup, device)["compile_s"]
        common.reset_peaks(device)
        times = time_steps(run_step, args.steps, device, before_step=dist.barrier)
        alloc, reserved = common.read_peaks(device)
        mem = None if alloc is None else {"peak_alloc_gib": alloc, "peak_reserved_gib": reserved}
        graphs = apollo_graphs_since(plans_before)
        loss, grads = loss_and_grads(model, step_fn, numerics_batch, device, args.amp, average=name == SINGLE)

    per_rank = gather({"times_ms": times, "compile_s": compile_s, "memory": mem, "apollo": graphs})
    row["per_rank"] = per_rank
    row["compile_s"] = max(r["compile_s"] for r in per_rank)
    step_ms = np.array([r["times_ms"] for r in per_rank])  # ranks x steps
    row.update({k: v for k, v in spread(step_ms.max(axis=0).tolist()).items() if k != "times_ms"})
    median = row["median_ms"]
    if name == SINGLE:
        row["samples_per_s"] = float(sum(args.cur_batch / (np.median(t) / 1e3) for t in step_ms))
    else:
        row["samples_per_s"] = float(world * args.cur_batch / (median / 1e3))
    row["samples_per_s_per_gpu"] = row["samples_per_s"] / world
    if mem is not None:
        row["peak_alloc_gib"] = max(r["memory"]["peak_alloc_gib"] for r in per_rank)
        row["peak_reserved_gib"] = max(r["memory"]["peak_reserved_gib"] for r in per_rank)
    if graphs is not None:
        row["apollo_graphs"] = graphs["graphs"]
        row["apollo_fallbacks"] = graphs["fallbacks"]
    row["numerics"] = n = compare(loss, _align_shapes(grads, ref), ref, "bf16" if args.amp else "fp32")
    log(f"  [{name}] compile + {args.warmup} warm-up: {row['compile_s']:.1f} s | {common.spread_text(row)} | "
        f"{row['samples_per_s']:.1f} samples/s"
        + (f" | peak {row['peak_alloc_gib']:.2f} GiB / reserved {row['peak_reserved_gib']:.2f} (max over ranks)"
           if mem else "")
        + (f" | apollo graphs {graphs['graphs']}, {len(graphs['fallbacks'])} fell back" if graphs else ""))
    log(f"  [{name}] numerics {verdict(n)}: {numerics_text(n)}")
    return row


def global_batch(args, device: torch.device, seed: int) -> tuple:
    """Every rank's shard of this step, concatenated in rank order (what DDP trains together)."""
    shards = [clip.make_batch(args.cur_batch, device, args.config, seed=seed + 1000 * r)
              for r in range(dist.get_world_size())]
    return tuple(torch.cat(parts) for parts in zip(*shards))


def _every_gpu(fn: Callable[[torch.device], Any]) -> list:
    return [fn(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


def run_on_rank0(name: str, base: nn.Module, args, device: torch.device) -> dict:
    """A rank-0 variant (module docstring): rank 0 trains the global batch; the others wait on the
    host. A failure on rank 0 is reported after the barrier, so no rank is left in a collective."""
    row: dict[str, Any] = {"variant": name, "status": "ok"}
    error = None
    if rank() == 0:
        try:
            row.update(_rank0_measure(name, base, args, device))
        except Exception as exc:  # noqa: BLE001  (re-raised below, after the barrier)
            error = exc
    dist.barrier(group=args.host_group)
    if error is not None:
        raise error
    return row if rank() == 0 else {"variant": name, "status": "rank 0 only"}


def _rank0_measure(name: str, base: nn.Module, args, device: torch.device) -> dict:
    batch = global_batch(args, device, args.seed)
    numerics_batch = global_batch(args, device, args.seed + 1)
    ref = reference(base, numerics_batch, device, args, variant="onegpu-eager")
    model, step_fn, _ = build_variant(name, base, device, args)
    plans_before = apollo_plans_so_far(name)
    sync_all = (lambda: _every_gpu(torch.cuda.synchronize)) if device.type == "cuda" else (lambda: None)

    def run_step() -> None:
        train_step(model, step_fn, batch, device, args.amp)

    sync_all()
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        run_step()
    sync_all()
    compile_s = time.perf_counter() - t0
    if device.type == "cuda":
        _every_gpu(torch.cuda.reset_peak_memory_stats)
    times = []
    for _ in range(args.steps):
        sync_all()
        t0 = time.perf_counter()
        run_step()
        sync_all()
        times.append((time.perf_counter() - t0) * 1e3)
    out: dict[str, Any] = {"compile_s": compile_s, "per_rank": [{"times_ms": times}]}
    out.update({k: v for k, v in spread(times).items() if k != "times_ms"})
    median = out["median_ms"]
    out["samples_per_s"] = float(len(batch[0]) / (median / 1e3))
    out["samples_per_s_per_gpu"] = out["samples_per_s"] / dist.get_world_size()
    if device.type == "cuda":
        out["peak_alloc_gib_per_gpu"] = [m / GiB for m in _every_gpu(torch.cuda.max_memory_allocated)]
        out["peak_alloc_gib"] = max(out["peak_alloc_gib_per_gpu"])
        out["peak_reserved_gib"] = max(_every_gpu(torch.cuda.max_memory_reserved)) / GiB
    if (graphs := apollo_graphs_since(plans_before)) is not None:
        out["apollo_graphs"], out["apollo_fallbacks"] = graphs["graphs"], graphs["fallbacks"]
    loss, grads = loss_and_grads(model, step_fn, numerics_batch, device, args.amp)
    out["numerics"] = n = compare(loss, grads, ref, "bf16" if args.amp else "fp32")
    out["numerics_reference"] = "eager, one GPU, global batch"
    log(f"  [{name}] global batch {len(batch[0])} | compile + {args.warmup} warm-up: {compile_s:.1f} s | "
        f"{common.spread_text(out)} | {out['samples_per_s']:.1f} samples/s"
        + (f" | peak per GPU {', '.join(f'{m:.2f}' for m in out['peak_alloc_gib_per_gpu'])} GiB"
           if "peak_alloc_gib_per_gpu" in out else ""))
    log(f"  [{name}] numerics vs eager one GPU {verdict(n)}: {numerics_text(n)}")
    return out


def apollo_plans_so_far(name: str) -> int | None:
    """For an apollo variant, how many plans apollo has recorded before it compiles anything."""
    if "apollo" not in name:
        return None
    import apollo_compile

    return len(apollo_compile.plans())


def apollo_graphs_since(before: int | None) -> dict | None:
    """The graphs apollo planned since `before` plans (apollo_plans_so_far), and which fell back."""
    if before is None:
        return None
    import apollo_compile

    new = apollo_compile.plans()[before:]
    return {"graphs": len(new),
            "fallbacks": [f"{p.name}_{k}: {g.fallback}" for p in new for k, g in p.graphs.items() if g.fallback]}


def _align_shapes(grads: dict, ref: dict) -> dict:
    """FSDP2's (1,) logit_scale against the reference's 0-d one."""
    return {n: g if g is None or ref["grads"].get(n) is None else g.reshape(ref["grads"][n].shape)
            for n, g in grads.items()}


# --------------------------------------------------------------------------------------------
# reporting


def environment(device: torch.device, args) -> dict:
    env = common.environment(
        device, world_size=dist.get_world_size(), backend=dist.get_backend(),
        device_names=gather(common.device_name(device)), config=args.config,
        amp="bf16 autocast" if args.amp else "fp32", steps=args.steps, warmup=args.warmup, optimizer_step=False,
        bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view,
        apollo_options=args.apollo_options)
    env["device"] = device.type  # every rank's own index differs
    return env


HEADER = ["B/GPU", "variant", "median ms", "p10", "p90", "samples/s", "samples/s/GPU", f"vs {BASELINE}",
          f"scaling vs {SINGLE}", "peak GiB/GPU", "reserved GiB/GPU", "compile s", "apollo graphs", "numerics"]


def markdown_table(results: list[dict]) -> str:
    rows = []
    for entry in results:
        ok = {r["variant"]: r for r in entry["variants"] if r["status"] == "ok"}
        base, single = ok.get(BASELINE), ok.get(SINGLE)
        for r in entry["variants"]:
            if r["status"] != "ok":
                rows.append(common.failed_cells(entry["batch"], r, len(HEADER)))
                continue
            speed = base["median_ms"] / r["median_ms"] if base else None
            scaling = r["samples_per_s"] / single["samples_per_s"] if single else None
            graphs = f"{r['apollo_graphs']} ({len(r['apollo_fallbacks'])} fell back)" if "apollo_graphs" in r else "-"
            rows.append([
                str(entry["batch"]), r["variant"], f"{r['median_ms']:.2f}", f"{r['p10_ms']:.2f}",
                f"{r['p90_ms']:.2f}", f"{r['samples_per_s']:.1f}", f"{r['samples_per_s_per_gpu']:.1f}",
                fmt(speed, ".2f", "x"), fmt(scaling, ".2f"), fmt(r.get("peak_alloc_gib"), ".2f"),
                fmt(r.get("peak_reserved_gib"), ".2f"), f"{r['compile_s']:.1f}", graphs,
                numerics_cell(r["numerics"]) + (" vs 1-GPU eager" if "numerics_reference" in r else ""),
            ])
    return markdown(HEADER, rows)


def report(env: dict, results: list[dict]) -> str:
    precision = "bf16" if env["amp"] != "fp32" else "fp32"
    head = [
        f"## apollo distributed benchmark: CLIP-style ({env['config']}), {env['amp']}, "
        f"{env['world_size']} x {env['device_names'][0]} ({env['backend']})",
        "",
        f"{env['date']} | torch {env['torch']} | python {env['python']} | DDP bucket_cap_mb {env['bucket_cap_mb']}"
        f"{', gradient_as_bucket_view' if env.get('gradient_as_bucket_view') else ''} | "
        f"apollo options {env['apollo_options'] or '{}'}",
        f"{env['warmup']} warm-up + {env['steps']} timed steps of zero_grad + forward + backward (gradient "
        f"communication included, no optimizer step); median of the slowest rank's step; samples/s over all "
        f"GPUs; numerics vs eager DDP: {tolerance_text(precision)}.",
        *common.noise_floor_lines(results, "B/GPU", "eager DDP bf16 vs fp32"),
    ]
    return "\n".join(head) + "\n\n" + markdown_table(results) + "\n"


def write_partial(env: dict, results: list[dict], out_dir: Path) -> None:
    """This run so far, rewritten after every batch size: a crash keeps what was measured."""
    (out_dir / "distributed_results.partial.json").write_text(json.dumps({"environment": env, "results": results}))


def append(env: dict, results: list[dict], out_dir: Path) -> str:
    """Append this run to distributed_results.jsonl (one line) and .md; drop the partial file."""
    text = report(env, results)
    with open(out_dir / "distributed_results.jsonl", "a") as f:
        f.write(json.dumps({"environment": env, "results": results}) + "\n")
    with open(out_dir / "distributed_results.md", "a") as f:
        f.write(text + "\n")
    (out_dir / "distributed_results.partial.json").unlink(missing_ok=True)
    return text


# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[32], help="per-GPU batch sizes")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--config", default="base", choices=sorted(clip.CONFIGS))
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size (DDP's default 25)")
    p.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="DDP(gradient_as_bucket_view=True): .grad views the buckets, no copy into them")
    p.add_argument("--apollo-options", type=json.loads, default={},
                   help='JSON options for backend="apollo", e.g. \'{"subgraph_compiler": "eager"}\'')
    p.add_argument("--pg-timeout-s", type=float, default=900.0, help="process-group (collective) timeout")
    common.add_run_args(p, steps=20, warmup=5, compile_cache=False)
    return common.parse_run_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu", flush=True)
        return 2
    device = init_distributed(args.device, args.pg_timeout_s)
    args.host_group = dist.new_group(backend="gloo")  # rank-0 variants: the others wait without a GPU kernel
    r, world = dist.get_rank(), dist.get_world_size()
    out_dir = Path(args.out)
    if r == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(device, args)
    log(f"date {env['date']} | torch {env['torch']} | world {world} x {env['device_names'][0]} ({env['backend']})")
    log(f"config {args.config} | {env['amp']} | per-GPU batches {args.batch} | variants {args.variants} | out {out_dir}")

    base = clip.build(args.config, device="cpu", seed=args.seed)  # the same weights on every rank
    log(f"model: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters")

    results: list[dict] = []

    def cells():
        for batch_size in args.batch:
            args.cur_batch = batch_size
            batch = clip.make_batch(batch_size, device, args.config, seed=args.seed + 1000 * r)
            numerics_batch = clip.make_batch(batch_size, device, args.config, seed=args.seed + 1 + 1000 * r)
            yield common.Cell(f"per-GPU batch {batch_size} (global {world * batch_size})",
                              {"batch": batch_size, "global_batch": world * batch_size},
                              functools.partial(reference, base, numerics_batch, device, args),
                              {"batch": batch, "numerics": numerics_batch})

    say = functools.partial(log, all_ranks=True)
    common.run_matrix(cells(), args.variants,
                      lambda cell, name, ref: run_variant(name, base, cell.data["batch"], cell.data["numerics"], ref,
                                                          args, device),
                      device, results, what="eager DDP", say=say,
                      on_update=lambda: write_partial(env, results, out_dir) if r == 0 else None)

    if r == 0:
        text = append(env, results, out_dir)
        log(f"\nappended to {out_dir / 'distributed_results.jsonl'} and {out_dir / 'distributed_results.md'}\n")
        log(text)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
