"""Time one training step of the CLIP-style model (benchmarks/clip.py) under several compilers.

Variants, run side by side in ONE process (so absolute times are comparable; DESIGN.md notes
they drift between runs):

    eager          the nn.Module as is
    inductor       torch.compile(model)
    inductor-ro    torch.compile(model, mode="reduce-overhead")   (Inductor + CUDA graph trees)
    apollo-1lane   torch.compile(model, backend="apollo", options={"max_lanes": 1})
    apollo         torch.compile(model, backend="apollo")

Method, for each batch size (common.py holds the timing, memory and numerics code every
benchmark here shares):

1. The model is built once on the CPU from a fixed seed and kept there; every variant gets a
   deep copy moved to the device, so all variants start from identical weights and no other
   variant's tensors sit in device memory while one is measured. ``torch._dynamo.reset()``
   (which also drops CUDA-graph trees) runs between variants.
2. The step is ``zero_grad(set_to_none=True)``; forward (which returns the contrastive loss)
   under ``torch.autocast(<device>, dtype=torch.bfloat16)`` unless ``--no-amp``; ``backward()``
   outside autocast. There is **no optimizer step**: the weights never change, so every
   variant's numerics check below runs at exactly the reference weights, and the optimizer's
   time (the same for every variant) does not dilute the differences.
3. Warm-up: ``--warmup`` steps on the timing batch; compilation (and CUDA-graph recording)
   happens here. Their total wall time, synchronised, is reported as "compile s". Inductor's
   on-disk caches may shorten it for a graph already compiled earlier (``--no-compile-cache``).
4. Timing: ``--steps`` steps, each bracketed by a ``torch.cuda.Event`` pair after a
   ``synchronize()`` (the step's latency from an idle GPU, host launch overhead included);
   ``time.perf_counter`` on the CPU. Reported: median, p10, p90 in ms. Then ``--steps`` more
   steps queued back to back, one synchronize before and after, five times ("back-to-back ms",
   per step, the median round; "b2b host ms", the host's own time per step in those rounds): a
   loop that never reads a value from the GPU hides the host's work behind the GPU's, where
   the idle-GPU latency shows all of it before the first launch.
5. Memory: ``reset_peak_memory_stats()`` right before the timed steps, then
   ``max_memory_allocated`` ("peak GiB", as PyTorch reports it) and ``max_memory_reserved``
   ("reserved GiB"). Read the reserved column for CUDA-graph variants: a graph's replay does not
   go through the allocator, so its internal buffers live in the graph's private pool (reserved)
   without showing as allocated while it runs.
6. Numerics: after timing, one step on a *different* fixed batch (same shapes, other values:
   a compiled artifact that baked in its inputs fails here) compared with eager on the same
   weights and the same autocast: |loss - loss_ref| and max over parameters of
   ||g - g_ref|| / ||g_ref||. The eager variant is checked too (it shows the run-to-run floor:
   atomics make some CUDA backward kernels nondeterministic). PASS needs the loss within
   LOSS_RTOL and every parameter within GRAD_RTOL (2e-2 under bf16 autocast; the comment at the
   constants in common.py says why). With AMP, eager fp32 gradients are computed too: eager bf16's distance
   from them is the bf16 noise floor (printed per batch), and a parameter over GRAD_RTOL still
   passes ("PASS*") if the variant is no further from fp32 than 2x eager bf16 is.

Each variant runs inside try/except: an exception (an out-of-memory error included) prints its
traceback, marks the row FAILED (or OOM), and the run continues. Results are written after every
variant to ``<out>/step_results.json`` and ``<out>/step_results.md``; the markdown table is printed
last. Note that a CUDA error that corrupts the context (illegal memory access) cannot be contained
in-process: later variants will fail too, which is why the apollo variants run last.

Usage (from the repo root; apollo_compile is imported from there):

    PYTHONPATH=. python benchmarks/bench_step.py --batch 8 32 128
    python benchmarks/bench_step.py --device cpu --config tiny --batch 2 --variants eager inductor --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/clip.py, common.py (already first when run as a script)
sys.path.insert(1, str(HERE.parent))  # the repo root, for apollo_compile

import clip  # noqa: E402  (benchmarks/clip.py)
from common import (  # noqa: E402  (the method every benchmark here shares)
    add_run_args, batch_reference, compare, device_and_out_dir, diagnostics_for, environment, failed_cells, fmt,
    free_device_memory, guarded, header_line, log, loss_and_grads, markdown, memory_ratio, no_tf32, noise_floor_lines,
    numerics_cell, numerics_text,
    parse_run_args, read_peaks, reference as reference_from, reset_peaks, spread, spread_text, time_back_to_back, time_steps,
    tolerance_text, train_step, verdict, warm_up,
)

VARIANTS = ("eager", "inductor", "inductor-ro", "apollo-1lane", "apollo")
# named on the command line only: the backward traced by compiled autograd (CompiledAutogradStep)
COMPILED_AUTOGRAD_VARIANTS = ("inductor-ro-ca", "apollo-ca")
BASELINE = "inductor-ro"  # the "ratio" column is BASELINE median / variant median


# --------------------------------------------------------------------------------------------
# variants and the training step


def compiled_autograd(compiler):
    """torch._dynamo.compiled_autograd's context manager (``_enable``; ``enable`` in older torch)."""
    from torch._dynamo import compiled_autograd as ca

    enable = getattr(ca, "_enable", None) or ca.enable
    return enable(compiler)


class CompiledAutogradStep:
    """A compiled forward whose backward compiled autograd traces, engine work and all, into one
    graph for `backward_compiler` (`train_step` enters `backward_context` around the backward).

    Why (issue 3, batch 8): the step is bound by host work, 3.2-3.8 ms of it between the backward's
    launch and ``backward()`` returning, in AOTAutograd and the engine's ~200 AccumulateGrad calls
    (RESULTS.md, session 13). Compiled autograd takes that into the graph, at its own cost per step
    (the autograd graph walked and looked up in its cache). Its graph has no module paths, so apollo
    gives it one lane (session 14, on the CPU)."""

    def __init__(self, forward: Callable[..., torch.Tensor], backward_compiler: Callable) -> None:
        self.forward, self.backward_compiler = forward, backward_compiler

    def __call__(self, *args: Any) -> torch.Tensor:
        return self.forward(*args)

    def backward_context(self) -> contextlib.AbstractContextManager:
        return compiled_autograd(self.backward_compiler)


def compile_variant(name: str, model: nn.Module) -> Callable[..., torch.Tensor]:
    if name in COMPILED_AUTOGRAD_VARIANTS:
        base = name.removesuffix("-ca")
        backward = (torch.compile(backend="apollo") if base == "apollo"
                    else torch.compile(mode="reduce-overhead"))
        return CompiledAutogradStep(compile_variant(base, model), backward)
    if name == "eager":
        return model
    if name == "inductor":
        return torch.compile(model)
    if name == "inductor-ro":
        return torch.compile(model, mode="reduce-overhead")
    if name in ("apollo", "apollo-1lane"):
        import apollo_compile  # noqa: F401  (importing registers backend="apollo")

        options = {"max_lanes": 1} if name == "apollo-1lane" else {}
        return torch.compile(model, backend="apollo", options=options)
    raise ValueError(f"unknown variant {name!r}")


# --------------------------------------------------------------------------------------------
# one variant, one batch size


def reference(base: nn.Module, batch: tuple, device: torch.device, amp: bool) -> dict:
    """Eager loss and gradients on the numerics batch. With AMP also eager fp32's gradients and
    eager bf16's per-parameter distance from them (the bf16 noise floor)."""
    model = copy.deepcopy(base).to(device)
    loss, grads = loss_and_grads(model, model, batch, device, amp)
    fp32 = None
    if amp:
        with no_tf32():
            fp32 = loss_and_grads(model, model, batch, device, False)
    del model
    free_device_memory(device)
    return reference_from(loss, grads, fp32)


def run_variant(name: str, base: nn.Module, batch: tuple, numerics_batch: tuple, ref: dict, args, device) -> dict:
    row: dict[str, Any] = {"variant": name, "status": "ok"}
    with diagnostics_for(row, name, name.startswith("apollo")) as keep:
        return _run_variant(row, name, base, batch, numerics_batch, ref, args, device, keep)


def _run_variant(row: dict, name: str, base: nn.Module, batch: tuple, numerics_batch: tuple, ref: dict, args,
                 device, keep: list) -> dict:
    model = copy.deepcopy(base).to(device)
    step_fn = compile_variant(name, model)
    keep.append(step_fn)  # see common.apollo_diagnostics

    def run_step() -> None:
        train_step(model, step_fn, batch, device, args.amp)

    row.update(warm_up(run_step, args.warmup, device))
    log(f"  [{name}] compile + {args.warmup} warm-up steps: {row['compile_s']:.1f} s")

    reset_peaks(device)
    times = time_steps(run_step, args.steps, device)
    alloc, reserved = read_peaks(device)
    if alloc is not None:
        row["peak_alloc_gib"], row["peak_reserved_gib"] = alloc, reserved
    row.update(spread(times))
    b2b = time_back_to_back(run_step, args.steps, device)
    row.update(back_to_back_ms=b2b["ms"], back_to_back_rounds_ms=b2b["rounds_ms"], back_to_back_host_ms=b2b["host_ms"])
    log(f"  [{name}] {args.steps} steps: {spread_text(row)}, "
        f"{b2b['ms']:.2f} ms per step back to back (median of {len(b2b['rounds_ms'])} rounds, host "
        f"{b2b['host_ms']:.2f} ms per step)" + (f", peak {alloc:.2f} GiB allocated / {reserved:.2f} reserved"
                                                 if alloc is not None else ""))

    loss, grads = loss_and_grads(model, step_fn, numerics_batch, device, args.amp)
    row["numerics"] = n = compare(loss, grads, ref, "bf16" if args.amp else "fp32")
    log(f"  [{name}] numerics {verdict(n)}: {numerics_text(n)}")
    return row


def run_variant_guarded(name: str, *args_) -> dict:
    """run_variant; an exception becomes a FAILED (or OOM) row with its traceback."""
    return guarded(lambda: run_variant(name, *args_), name)


# --------------------------------------------------------------------------------------------
# reporting


HEADER = ["batch", "variant", "median ms", "p10", "p90", f"vs {BASELINE}", "back-to-back ms",
          f"back-to-back vs {BASELINE}", "b2b host ms", "peak GiB", f"peak / {BASELINE}", "reserved GiB",
          f"reserved / {BASELINE}", "compile s", "numerics"]


def markdown_table(results: list[dict]) -> str:
    rows = []
    for entry in results:
        base = next((r for r in entry["variants"] if r["variant"] == BASELINE and r["status"] == "ok"), None)
        for r in entry["variants"]:
            if r["status"] != "ok":
                rows.append(failed_cells(entry["batch"], r, len(HEADER)))
                continue
            ratio = base["median_ms"] / r["median_ms"] if base else None
            b2b = r.get("back_to_back_ms")
            b2b_ratio = base["back_to_back_ms"] / b2b if base and b2b and base.get("back_to_back_ms") else None
            rows.append([
                str(entry["batch"]), r["variant"], f"{r['median_ms']:.2f}", f"{r['p10_ms']:.2f}",
                f"{r['p90_ms']:.2f}", fmt(ratio, ".2f", "x"), fmt(b2b, ".2f"), fmt(b2b_ratio, ".2f", "x"),
                fmt(r.get("back_to_back_host_ms"), ".2f"), fmt(r.get("peak_alloc_gib"), ".2f"),
                fmt(memory_ratio(r, base, "peak_alloc_gib"), ".2f", "x"), fmt(r.get("peak_reserved_gib"), ".2f"),
                fmt(memory_ratio(r, base, "peak_reserved_gib"), ".2f", "x"), f"{r['compile_s']:.1f}",
                numerics_cell(r["numerics"]),
            ])
    return markdown(HEADER, rows)


def report(env: dict, results: list[dict], out_dir: Path) -> str:
    precision = "bf16" if env["amp"] != "fp32" else "fp32"
    head = [
        f"# apollo step benchmark: CLIP-style ({env['config']}), {env['amp']}",
        "",
        header_line(env),
        f"{env['warmup']} warm-up + {env['steps']} timed steps of zero_grad + forward + backward (no optimizer step), "
        f"each from an idle GPU, then {env['steps']} back to back (ms per step); "
        f"ratio = {BASELINE} median / variant median (>1: faster than {BASELINE}); numerics vs eager, "
        f"{tolerance_text(precision)}.",
        *noise_floor_lines(results),
    ]
    text = "\n".join(head) + "\n\n" + markdown_table(results) + "\n"
    (out_dir / "step_results.md").write_text(text)
    (out_dir / "step_results.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
    return text


# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + COMPILED_AUTOGRAD_VARIANTS,
                   help="default: the five of issue 3's table; -ca: the backward under compiled autograd")
    p.add_argument("--config", default="base", choices=sorted(clip.CONFIGS))
    add_run_args(p, steps=20, warmup=5)
    return parse_run_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if (setup := device_and_out_dir(args)) is None:
        return 2
    device, out_dir = setup

    env = environment(device, config=args.config, amp="bf16 autocast" if args.amp else "fp32", steps=args.steps,
                      warmup=args.warmup, optimizer_step=False)
    log(header_line(env))
    log(f"config {args.config} | {env['amp']} | batches {args.batch} | variants {args.variants} | out {out_dir}")

    base = clip.build(args.config, device="cpu", seed=args.seed)  # stays on the CPU; copies go to the device
    log(f"model: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters")

    results: list[dict] = []
    for batch_size in args.batch:
        log(f"\n=== batch {batch_size} ===")
        entry: dict[str, Any] = {"batch": batch_size, "variants": []}
        results.append(entry)
        batch = clip.make_batch(batch_size, device, args.config, seed=args.seed)
        numerics_batch = clip.make_batch(batch_size, device, args.config, seed=args.seed + 1)
        ref = batch_reference(entry, functools.partial(reference, base, numerics_batch, device, args.amp))
        if ref is None:
            free_device_memory(device)
            continue
        for name in args.variants:
            log(f"--- batch {batch_size}, {name}")
            entry["variants"].append(run_variant_guarded(name, base, batch, numerics_batch, ref, args, device))
            free_device_memory(device)
            report(env, results, out_dir)  # after every variant: a crash keeps what was measured
        del batch, numerics_batch, ref
        free_device_memory(device)

    text = report(env, results, out_dir)
    log(f"\nwrote {out_dir / 'step_results.json'} and {out_dir / 'step_results.md'}\n")
    log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
