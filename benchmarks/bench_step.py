"""Time one training step of the CLIP-style model (benchmarks/clip.py) under several compilers.

Variants, run side by side in ONE process (so absolute times are comparable; DESIGN.md notes
they drift between runs):

    eager          the nn.Module as is
    inductor       torch.compile(model)
    inductor-ro    torch.compile(model, mode="reduce-overhead")   (Inductor + CUDA graph trees)
    apollo-1lane   torch.compile(model, backend="apollo", options={"max_lanes": 1})
    apollo         torch.compile(model, backend="apollo")

Method, for each batch size:

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
   constants says why). With AMP, eager fp32 gradients are computed too: eager bf16's distance
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
import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/clip.py (already first when run as a script)
sys.path.insert(1, str(HERE.parent))  # the repo root, for apollo_compile

import clip  # noqa: E402  (benchmarks/clip.py)

VARIANTS = ("eager", "inductor", "inductor-ro", "apollo-1lane", "apollo")
# named on the command line only: the backward traced by compiled autograd (CompiledAutogradStep)
COMPILED_AUTOGRAD_VARIANTS = ("inductor-ro-ca", "apollo-ca")
BASELINE = "inductor-ro"  # the "ratio" column is BASELINE median / variant median
BACK_TO_BACK_ROUNDS = 5  # rounds of --steps queued steps; their median is the back-to-back figure

# Tolerances of the numerics check against eager (same weights, same batch, same autocast).
# bf16 autocast: bf16 keeps 8 significand bits (relative rounding ~2e-3 to 4e-3 per op). A compiled
# step is *allowed* to differ from eager by that much at every op: Inductor fuses ops and keeps
# fused intermediates in fp32 where eager rounds each op's output to bf16, and it reorders
# reductions. Over 24 transformer blocks, forward and backward, these per-op differences compound
# to the 1e-3..1e-2 range for a parameter's relative gradient error. A real scheduling bug — a
# missing stream dependency, a buffer reused too early, a stale input — gives errors of order 1.
# GRAD_RTOL = 2e-2 separates the two.
# Small parameters whose gradient is a sum with heavy cancellation (late biases, logit_scale;
# worst at small batches) can exceed 2e-2 from rounding alone: eager bf16 is then just as far from
# eager fp32. So a parameter over GRAD_RTOL is still accepted when its gradient is no further from
# the fp32 gradient than NOISE_MULTIPLIER x eager bf16's own distance from it — the compiled step
# is as accurate as eager bf16, only elsewhere in the rounding noise. (PyTorch's own compiler
# accuracy check, torch._dynamo.utils.same with fp64_ref, uses the same rule with multiplier 2-3.)
# Such parameters are counted in the report ("PASS*").
# fp32 (--no-amp): compiled fp32 differs from eager only by reduction order, far below 1e-3.
GRAD_RTOL = {"bf16": 2e-2, "fp32": 1e-3}
LOSS_RTOL = {"bf16": 1e-2, "fp32": 1e-4}  # on |loss - loss_ref| / max(1, |loss_ref|)
NOISE_MULTIPLIER = 2.0

GiB = 1024**3

# Inductor repeats this one for every attention softmax it splits; it drowns the log.
warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled")


def log(*args: Any) -> None:
    print(*args, flush=True)


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


def autocast(device: torch.device, amp: bool) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)


def train_step(model: nn.Module, step_fn: Callable, batch: tuple, device: torch.device, amp: bool) -> torch.Tensor:
    """zero_grad + forward (under autocast) + backward; no optimizer step."""
    model.zero_grad(set_to_none=True)
    with autocast(device, amp):
        loss = step_fn(*batch)
    with getattr(step_fn, "backward_context", contextlib.nullcontext)():
        loss.backward()
    return loss


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(run_step: Callable[[], Any], steps: int, device: torch.device,
               before_step: Callable[[], Any] | None = None) -> list[float]:
    """Per-step milliseconds: CUDA events after a synchronize on CUDA, perf_counter on the CPU.
    `before_step` runs after the synchronize, untimed (bench_distributed.py lines ranks up)."""
    times = []
    for _ in range(steps):
        synchronize(device)
        if before_step is not None:
            before_step()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run_step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_back_to_back(run_step: Callable[[], Any], steps: int, device: torch.device,
                      rounds: int = BACK_TO_BACK_ROUNDS) -> dict[str, Any]:
    """Milliseconds per step with `steps` steps queued back to back, one synchronize before and
    after, as a training loop that never reads a value from the GPU runs: the host prepares the
    next step while the GPU still runs the last one, so a step costs max(host, GPU) rather than
    the idle-GPU latency `time_steps` reports (host launch overhead included). Neither replaces
    the other: a loop that logs the loss every step synchronizes every step.

    One round is one sample, and a single host hiccup in it moves the
    whole round (session 10: 11.19 ms back to back against a 10.13 ms idle-GPU median), so the
    median of `rounds` rounds is reported, with the host's own time per step (the loop's wall
    time before the final synchronize): host ms close to the round's ms means the host, not the
    GPU, sets the pace."""
    per_step, host = [], []
    for _ in range(rounds):
        synchronize(device)
        t0 = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        for _ in range(steps):
            run_step()
        host.append((time.perf_counter() - t0) * 1e3 / steps)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            per_step.append(start.elapsed_time(end) / steps)
        else:
            per_step.append(host[-1])
    return {"ms": float(np.median(per_step)), "rounds_ms": per_step, "host_ms": float(np.median(host))}


# --------------------------------------------------------------------------------------------
# numerics


def loss_and_grads(model: nn.Module, step_fn: Callable, batch: tuple, device: torch.device, amp: bool):
    """One step; the loss as a float and every parameter's gradient copied to the CPU in fp32."""
    loss = train_step(model, step_fn, batch, device, amp)
    loss_value = float(loss.detach().float().cpu())
    grads = {
        name: None if p.grad is None else p.grad.detach().float().cpu().clone()
        for name, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return loss_value, grads


def rel_err(g: torch.Tensor, g_ref: torch.Tensor) -> float:
    """||g - g_ref|| / ||g_ref||, in float64."""
    ref_norm = g_ref.double().norm().item()
    return (g.double() - g_ref.double()).norm().item() / max(ref_norm, 1e-30)


def compare(loss: float, grads: dict, ref: dict, precision: str) -> dict:
    """Loss difference and the worst per-parameter relative gradient error against eager, with a
    verdict. `ref` holds eager's loss and grads and, with AMP, the fp32 grads and eager bf16's
    per-parameter distance from them (the noise floor); see GRAD_RTOL."""
    worst_name, worst = None, 0.0
    problems, over_tol, excused = [], [], []
    for name, g_ref in ref["grads"].items():
        g = grads.get(name)
        if g_ref is None and g is None:
            continue
        if g is None or g_ref is None:
            problems.append(f"{name}: grad is {'missing' if g is None else 'unexpected'}")
            continue
        if not torch.isfinite(g).all():
            problems.append(f"{name}: non-finite grad")
            continue
        err = rel_err(g, g_ref)
        if worst_name is None or err > worst:
            worst_name, worst = name, err
        if err > GRAD_RTOL[precision]:
            floor = ref["noise_floor"].get(name) if ref.get("noise_floor") else None
            if floor is not None and rel_err(g, ref["grads_fp32"][name]) <= NOISE_MULTIPLIER * floor:
                excused.append(name)
            else:
                over_tol.append(name)
    loss_diff = abs(loss - ref["loss"])
    loss_ok = bool(np.isfinite(loss)) and loss_diff <= LOSS_RTOL[precision] * max(1.0, abs(ref["loss"]))
    ok = loss_ok and not problems and not over_tol
    return {
        "pass": bool(ok),
        "loss": loss,
        "loss_ref": ref["loss"],
        "loss_abs_diff": loss_diff,
        "grad_rel_err_max": worst,
        "grad_rel_err_worst_param": worst_name,
        "params_over_tol": over_tol,
        "params_within_bf16_noise": excused,
        "problems": problems,
        "tolerance": {"grad_rel": GRAD_RTOL[precision], "loss_rel": LOSS_RTOL[precision],
                      "noise_multiplier": NOISE_MULTIPLIER},
    }


def verdict(n: dict) -> str:
    if not n["pass"]:
        return "FAIL"
    return "PASS*" if n["params_within_bf16_noise"] else "PASS"


def numerics_text(n: dict) -> str:
    """The log line of a `compare` result after its verdict: worst errors, then the parameters over."""
    return (f"|dloss| {n['loss_abs_diff']:.2e}, max grad rel err {n['grad_rel_err_max']:.2e} "
            f"({n['grad_rel_err_worst_param']}); {len(n['params_over_tol'])} params over "
            f"{n['tolerance']['grad_rel']:g}, {len(n['params_within_bf16_noise'])} more within bf16 noise"
            + "".join(f"\n    {p}" for p in n["problems"] + n["params_over_tol"][:10]))


# --------------------------------------------------------------------------------------------
# one variant, one batch size


def free_device_memory(device: torch.device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        clear_cublas = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_cublas is not None:  # each stream a variant used keeps a cuBLAS workspace (~32 MiB) otherwise
            clear_cublas()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def no_tf32():
    """True fp32 matmuls and convolutions (cuDNN allows TF32 for convolutions by default)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def reference(base: nn.Module, batch: tuple, device: torch.device, amp: bool) -> dict:
    """Eager loss and gradients on the numerics batch. With AMP also eager fp32's gradients and
    eager bf16's per-parameter distance from them (the bf16 noise floor)."""
    model = copy.deepcopy(base).to(device)
    loss, grads = loss_and_grads(model, model, batch, device, amp)
    ref = {"loss": loss, "grads": grads, "grads_fp32": None, "noise_floor": None, "noise_summary": None}
    if amp:
        with no_tf32():
            loss32, grads32 = loss_and_grads(model, model, batch, device, False)
        ref["grads_fp32"] = grads32
        ref["noise_floor"] = {
            name: rel_err(g, grads32[name]) for name, g in grads.items() if g is not None and grads32[name] is not None
        }
        worst = max(ref["noise_floor"], key=ref["noise_floor"].get)
        ref["noise_summary"] = {"loss_abs_diff": abs(loss - loss32), "grad_rel_err_max": ref["noise_floor"][worst],
                                "grad_rel_err_worst_param": worst}
    del model
    free_device_memory(device)
    return ref


def run_variant(name: str, base: nn.Module, batch: tuple, numerics_batch: tuple, ref: dict, args, device) -> dict:
    row: dict[str, Any] = {"variant": name, "status": "ok"}
    with apollo_diagnostics(row, name) if name.startswith("apollo") else contextlib.nullcontext([]) as keep:
        return _run_variant(row, name, base, batch, numerics_batch, ref, args, device, keep)


def _run_variant(row: dict, name: str, base: nn.Module, batch: tuple, numerics_batch: tuple, ref: dict, args,
                 device, keep: list) -> dict:
    model = copy.deepcopy(base).to(device)
    step_fn = compile_variant(name, model)
    keep.append(step_fn)  # see apollo_diagnostics

    def run_step() -> None:
        train_step(model, step_fn, batch, device, args.amp)

    synchronize(device)
    t0 = time.perf_counter()
    first = None
    for i in range(args.warmup):
        run_step()
        if i == 0:
            synchronize(device)
            first = time.perf_counter() - t0
    synchronize(device)
    row["compile_s"] = time.perf_counter() - t0
    row["first_step_s"] = first
    log(f"  [{name}] compile + {args.warmup} warm-up steps: {row['compile_s']:.1f} s")

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = time_steps(run_step, args.steps, device)
    if device.type == "cuda":
        row["peak_alloc_gib"] = torch.cuda.max_memory_allocated(device) / GiB
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GiB
    p10, median, p90 = np.percentile(times, [10, 50, 90])
    row.update(times_ms=times, median_ms=float(median), p10_ms=float(p10), p90_ms=float(p90))
    b2b = time_back_to_back(run_step, args.steps, device)
    row.update(back_to_back_ms=b2b["ms"], back_to_back_rounds_ms=b2b["rounds_ms"], back_to_back_host_ms=b2b["host_ms"])
    log(f"  [{name}] {args.steps} steps: median {median:.2f} ms (p10 {p10:.2f}, p90 {p90:.2f}), "
        f"{b2b['ms']:.2f} ms per step back to back (median of {len(b2b['rounds_ms'])} rounds, host "
        f"{b2b['host_ms']:.2f} ms per step)"
        + (f", peak {row['peak_alloc_gib']:.2f} GiB allocated / {row['peak_reserved_gib']:.2f} reserved"
           if "peak_alloc_gib" in row else ""))

    loss, grads = loss_and_grads(model, step_fn, numerics_batch, device, args.amp)
    row["numerics"] = n = compare(loss, grads, ref, "bf16" if args.amp else "fp32")
    log(f"  [{name}] numerics {verdict(n)}: {numerics_text(n)}")
    return row


@contextlib.contextmanager
def apollo_diagnostics(row: dict, name: str):
    """Record in `row` what apollo decided and how its CUDA-graph runners ran (runtime chosen, candidate
    times, graph-less calls, memory held by captures), the checkpoint pass's predicted activation bytes,
    and every warning the variant raised (an ApolloFallbackWarning explains a slow or large row).

    Yields a list in which the variant keeps its compiled step until the plans are read here: the
    plans hold the CUDA-graph runners only weakly, and the compiled step owns them."""
    import apollo_compile

    apollo_compile.clear_plans()
    keep: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield keep
        finally:
            row["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
            row["apollo"] = []
            for plan in apollo_compile.plans():
                entry: dict[str, Any] = {"plan": plan.name}
                ckpt = plan.joint.get("checkpoint")
                if ckpt is not None:
                    entry["checkpoint"] = ckpt.summary()  # predicted peaks and bytes, per_block, relaxed, met
                summaries = {k: g.summary() for k, g in plan.graphs.items()}
                entry["graphs"] = {k: {key: summary.get(key) for key in ("lanes", "cuda_graph", "fallback", "offload")}
                                   for k, summary in summaries.items()}
                row["apollo"].append(entry)
            for w in row["warnings"]:
                log(f"  [{name}] warning: {w.splitlines()[0][:300]}")
            for entry in row["apollo"]:
                for kind, g in entry["graphs"].items():
                    if g.get("cuda_graph"):
                        log(f"  [{name}] {entry['plan']} {kind}: {json.dumps(g['cuda_graph'])}")
                    else:  # un-graphed (compiled autograd's graph in session 15): say so, and why if known
                        why = g.get("fallback") or "no CUDA-graph runner (CPU, or not a CUDA graph's device)"
                        log(f"  [{name}] {entry['plan']} {kind}: without a CUDA graph: {why}")


def is_oom(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def run_variant_guarded(name: str, *args_) -> dict:
    """run_variant; an exception becomes a FAILED (or OOM) row with its traceback."""
    try:
        return run_variant(name, *args_)
    except Exception as exc:  # noqa: BLE001  (one variant's failure must not lose the run)
        tb = traceback.format_exc()
        status = "OOM" if is_oom(exc) else "FAILED"
        log(f"  [{name}] {status}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        log(tb)
        return {"variant": name, "status": status, "error": f"{type(exc).__name__}: {exc}", "traceback": tb}


# --------------------------------------------------------------------------------------------
# reporting


def environment(device: torch.device, args) -> dict:
    env = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cuda": torch.version.cuda,
        "config": args.config,
        "amp": "bf16 autocast" if args.amp else "fp32",
        "steps": args.steps,
        "warmup": args.warmup,
        "optimizer_step": False,
    }
    if device.type == "cuda":
        env["sm_count"] = torch.cuda.get_device_properties(device).multi_processor_count
    return env


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(results: list[dict]) -> str:
    header = ["batch", "variant", "median ms", "p10", "p90", f"vs {BASELINE}", "back-to-back ms",
              f"back-to-back vs {BASELINE}", "b2b host ms", "peak GiB", "reserved GiB", "compile s", "numerics"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for entry in results:
        rows = entry["variants"]
        base = next((r for r in rows if r["variant"] == BASELINE and r["status"] == "ok"), None)
        for r in rows:
            if r["status"] != "ok":
                error = r.get("error", "").splitlines()[0][:80].replace("|", "/")
                cells = [str(entry["batch"]), r["variant"], r["status"]] + [""] * (len(header) - 4) + [error]
            else:
                n = r["numerics"]
                ratio = base["median_ms"] / r["median_ms"] if base else None
                b2b = r.get("back_to_back_ms")
                b2b_ratio = base["back_to_back_ms"] / b2b if base and b2b and base.get("back_to_back_ms") else None
                check = f"{verdict(n)} (dloss {n['loss_abs_diff']:.1e}, grad {n['grad_rel_err_max']:.1e})"
                cells = [
                    str(entry["batch"]), r["variant"], f"{r['median_ms']:.2f}", f"{r['p10_ms']:.2f}",
                    f"{r['p90_ms']:.2f}", fmt(ratio, ".2f") + ("x" if ratio else ""), fmt(b2b, ".2f"),
                    fmt(b2b_ratio, ".2f") + ("x" if b2b_ratio else ""), fmt(r.get("back_to_back_host_ms"), ".2f"),
                    fmt(r.get("peak_alloc_gib"), ".2f"),
                    fmt(r.get("peak_reserved_gib"), ".2f"), f"{r['compile_s']:.1f}", check,
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(env: dict, results: list[dict], out_dir: Path) -> str:
    precision = "bf16" if env["amp"] != "fp32" else "fp32"
    head = [
        f"# apollo step benchmark: CLIP-style ({env['config']}), {env['amp']}",
        "",
        f"{env['date']} | torch {env['torch']} | python {env['python']} | {env['device_name']}"
        + (f" ({env['sm_count']} SMs)" if "sm_count" in env else ""),
        f"{env['warmup']} warm-up + {env['steps']} timed steps of zero_grad + forward + backward (no optimizer step), "
        f"each from an idle GPU, then {env['steps']} back to back (ms per step); "
        f"ratio = {BASELINE} median / variant median (>1: faster than {BASELINE}); numerics vs eager, "
        f"PASS if max per-param relative grad error <= {GRAD_RTOL[precision]:g} "
        f"and |dloss| <= {LOSS_RTOL[precision]:g} * max(1, |loss|); PASS*: some params over it, but no further "
        f"from the fp32 gradient than {NOISE_MULTIPLIER:g}x eager bf16 is.",
    ]
    for entry in results:
        floor = entry.get("bf16_noise_floor")
        if floor:
            head.append(f"- batch {entry['batch']}: bf16 noise floor (eager bf16 vs eager fp32): "
                        f"dloss {floor['loss_abs_diff']:.1e}, grad {floor['grad_rel_err_max']:.1e}")
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
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps (>= 3 lets CUDA-graph trees record)")
    p.add_argument("--config", default="base", choices=sorted(clip.CONFIGS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    p.add_argument("--no-amp", dest="amp", action="store_false", help="fp32, no bf16 autocast")
    p.add_argument("--no-compile-cache", action="store_true", help="disable Inductor's on-disk caches")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    return args


def device_and_out_dir(args) -> tuple[torch.device, Path] | None:
    """The device and the output folder (created) from the flags every benchmark here shares
    (--device, --out, --no-compile-cache); None, said in the log, when CUDA is asked for and absent."""
    if args.device == "cuda" and not torch.cuda.is_available():
        log("CUDA is not available; use --device cpu")
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if args.no_compile_cache:
        torch._inductor.config.force_disable_caches = True
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return device, out_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    if (setup := device_and_out_dir(args)) is None:
        return 2
    device, out_dir = setup

    env = environment(device, args)
    log(f"date {env['date']} | torch {env['torch']} | python {env['python']} | device {env['device_name']}")
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
        try:
            ref = reference(base, numerics_batch, device, args.amp)
        except Exception as exc:  # noqa: BLE001
            log(f"  eager reference failed ({type(exc).__name__}); skipping batch {batch_size}")
            log(traceback.format_exc())
            entry["error"] = f"reference: {type(exc).__name__}: {exc}"
            free_device_memory(device)
            continue
        entry["loss_ref"] = ref["loss"]
        entry["bf16_noise_floor"] = f = ref["noise_summary"]
        if f:
            log(f"  bf16 noise floor (eager bf16 vs fp32): |dloss| {f['loss_abs_diff']:.2e}, "
                f"max grad rel err {f['grad_rel_err_max']:.2e} ({f['grad_rel_err_worst_param']})")
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
