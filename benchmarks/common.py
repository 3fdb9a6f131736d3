"""The method every benchmark here shares, so that a change of method (how a step is timed,
which memory counter is read, what tolerance a gradient meets) is made once and holds for every
table in RESULTS.md.

The variant matrix (``run_matrix``, ``measure``, ``Trial``, ``matrix_table``, ``write_results``):
a bench_* script defines its models, cells (a model at a batch size, with eager's reference) and
variants (each builds a ``Trial``: one training step, and one step on the numerics batch); the
driver runs every variant of every cell, an exception becoming a FAILED / OOM row, and writes
``<out>/<stem>_results.{json,md}`` after every variant, so a cut run keeps what it measured.

What ``measure`` records per variant:
    timing     ``--warmup`` steps (compile, capture: "compile s"), then ``--steps`` steps, each from
               an idle GPU (a CUDA event pair after a synchronize; ``perf_counter`` on the CPU):
               median, p10, p90; then the same steps queued back to back ("b2b ms").
    memory     the peaks allocated and reserved over the timed steps (``peak_alloc_gib``,
               ``peak_reserved_gib``) and over the whole run, from a reset before the model's copy
               to the device through compile, capture and the steps (``peak_alloc_all_gib``,
               ``peak_reserved_all_gib``: what training needs), less what was still held when the
               variant started (``left_over``); what the allocator holds between steps, by pool.
    numerics   one step on another batch against eager (numerics.py's ``compare``: PASS, PASS*
               within bf16's noise, FAIL; its ``GRAD_RTOL`` says why these tolerances).

Also here: the environment line, the flags every benchmark takes (``add_run_args``), the step
without an optimizer (``train_step``), an allocator cap (``memory_cap``) and what apollo decided
for a variant (``apollo_diagnostics``).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from numerics import (  # noqa: F401  (re-exported: the benchmarks read the numerics here)
    GRAD_RTOL, LOSS_RTOL, NOISE_MULTIPLIER, VANISHING, compare, no_tf32, noise_floor, numerics_cell, numerics_text,
    reference, rel_err, tolerance_text, verdict,
)
from torch import nn

GiB = 1024**3
BACK_TO_BACK_ROUNDS = 5  # rounds of queued steps; their median is the back-to-back figure

# Inductor repeats this one for every attention softmax it splits; it drowns the log.
warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled")


def log(*args: Any) -> None:
    print(*args, flush=True)


# --------------------------------------------------------------------------------------------
# environment


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def environment(device: torch.device, **fields: Any) -> dict[str, Any]:
    """Where and when a run ran, and `fields` (the run's own settings), for its results file."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": device_name(device),
        "cuda": torch.version.cuda,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["sm_count"] = props.multi_processor_count
        env["total_memory_gib"] = props.total_memory / GiB
    env.update(fields)
    return env


def header_line(env: dict[str, Any]) -> str:
    """``date | torch | python | device (SMs, memory)``: the line each report opens with."""
    where = env.get("device_name", env.get("device", "?"))
    if "sm_count" in env:
        where += f" ({env['sm_count']} SMs, {env['total_memory_gib']:.0f} GiB)"
    return f"{env['date']} | torch {env['torch']} | python {env['python']} | {where}"


def device_and_out_dir(args) -> tuple[torch.device, Path] | None:
    """The device and the output folder (created) from the flags the benchmarks share
    (--device, --out, --no-compile-cache); None, said in the log, when CUDA is asked for and absent."""
    if args.device == "cuda" and not torch.cuda.is_available():
        log("CUDA is not available; use --device cpu")
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if getattr(args, "no_compile_cache", False):
        torch._inductor.config.force_disable_caches = True
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return device, out_dir


def default_out() -> str:
    """--out's default: the device tool's $OUT when set."""
    return os.environ.get("OUT") or "bench_out"


def add_run_args(p, *, steps: int = 20, warmup: int = 5, warmup_help: str | None = None, amp: bool = True,
                 compile_cache: bool = True) -> None:
    """The flags every benchmark here takes: --steps, --warmup, --device, --out, --seed, and
    --no-amp (bf16 autocast off) and --no-compile-cache where the benchmark has them."""
    p.add_argument("--steps", type=int, default=steps, help=f"timed steps (default {steps})")
    p.add_argument("--warmup", type=int, default=warmup,
                   help=warmup_help or f"warm-up steps (default {warmup}; >= 3 lets CUDA-graph trees record)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=default_out(), help="results folder (default: $OUT, else bench_out)")
    p.add_argument("--seed", type=int, default=0)
    if amp:
        p.add_argument("--no-amp", dest="amp", action="store_false", help="fp32, no bf16 autocast")
    if compile_cache:
        p.add_argument("--no-compile-cache", action="store_true", help="disable Inductor's on-disk caches")


def parse_run_args(p, argv=None):
    """`p.parse_args(argv)`, with the checks `add_run_args`'s flags need."""
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    return args


# --------------------------------------------------------------------------------------------
# the training step


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


# --------------------------------------------------------------------------------------------
# timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(run_step: Callable[[], Any], steps: int, device: torch.device,
            after_each: Callable[[], Any] | None = None) -> dict[str, float]:
    """`steps` steps (compilation and CUDA-graph capture happen here), synchronised: their wall
    time in seconds ("compile s": Inductor's on-disk caches shorten it for graphs compiled
    before) and the first step's. `after_each` runs after every step (bench_memory reads the
    peak there)."""
    synchronize(device)
    t0 = time.perf_counter()
    first = None
    for i in range(steps):
        run_step()
        if i == 0:
            synchronize(device)
            first = time.perf_counter() - t0
        if after_each is not None:
            after_each()
    synchronize(device)
    return {"compile_s": time.perf_counter() - t0, "first_step_s": first}


def time_steps(run_step: Callable[[], Any], steps: int, device: torch.device,
               before_step: Callable[[], Any] | None = None) -> list[float]:
    """Per-step milliseconds, each step from an idle GPU (host launch overhead included): CUDA
    events after a synchronize on CUDA, perf_counter on the CPU. `before_step` runs after the
    synchronize, untimed (bench_distributed.py lines ranks up there)."""
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
    the idle-GPU latency `time_steps` reports. Neither replaces the other: a loop that logs the
    loss every step synchronizes every step.

    One round is one sample, and a single host hiccup in it moves the whole round, so the median
    of `rounds` rounds is reported, with the host's own time per step (the loop's wall time before the final
    synchronize): host ms close to the round's ms means the host, not the GPU, sets the pace."""
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


def spread(times: Sequence[float]) -> dict[str, Any]:
    """The timed steps (ms) and their median, p10 and p90, as the result rows store them."""
    p10, median, p90 = np.percentile(times, [10, 50, 90])
    return {"times_ms": list(times), "median_ms": float(median), "p10_ms": float(p10), "p90_ms": float(p90)}


def spread_text(row: dict) -> str:
    return f"median {row['median_ms']:.2f} ms (p10 {row['p10_ms']:.2f}, p90 {row['p90_ms']:.2f})"


# --------------------------------------------------------------------------------------------
# memory


def reset_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def alloc_retries(device: torch.device) -> int | None:
    """The caching allocator's retries so far (``num_alloc_retries``): each is an allocation that
    found no room, freed every cached segment (a device synchronisation) and tried again, which is
    what a step near the memory limit pays when it does not fit its reserved memory. None on the CPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def read_peaks(device: torch.device) -> tuple[float | None, float | None]:
    """(max_memory_allocated, max_memory_reserved) in GiB since the last reset; (None, None) on the CPU."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device) / GiB, torch.cuda.max_memory_reserved(device) / GiB


def peaks_text(alloc: float | None, reserved: float | None) -> str:
    return "" if alloc is None else f"peak {alloc:.2f} GiB allocated / {reserved:.2f} reserved"


def memory_ratio(row: dict, base: dict | None, key: str) -> float | None:
    """`row`'s peak (`key`: ``peak_alloc_gib``, ``peak_reserved_all_gib``, ...) over the baseline
    row's; None where either is missing."""
    if base is None or not base.get(key) or row.get(key) is None:
        return None
    return row[key] / base[key]


def device_segments(device: torch.device) -> list[dict[str, Any]]:
    """The caching allocator's segments on `device` (``torch.cuda.memory_snapshot``)."""
    return [seg for seg in torch.cuda.memory_snapshot() if seg.get("device", device.index or 0) == (device.index or 0)]


def memory_held(device: torch.device) -> dict[str, Any] | None:
    """What the allocator holds now, between steps: allocated GiB, and reserved / allocated GiB per
    memory pool ("default", or a CUDA graph's private pool by its id), largest first. A variant's
    surplus over another's shows here as the pool that holds it; None off CUDA."""
    if device.type != "cuda":
        return None
    pools: dict[str, list[float]] = {}
    for seg in device_segments(device):
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        key = "default" if pool == (0, 0) else f"graph pool {pool[0]}.{pool[1]}"
        held = pools.setdefault(key, [0.0, 0.0])
        held[0] += seg["total_size"] / GiB
        held[1] += seg["allocated_size"] / GiB
    ranked = sorted(pools.items(), key=lambda kv: -kv[1][0])
    return {"allocated_gib": torch.cuda.memory_allocated(device) / GiB,
            "pools": [{"pool": k, "reserved_gib": r, "allocated_gib": a} for k, (r, a) in ranked]}


def memory_held_text(held: dict[str, Any] | None) -> str:
    if held is None:
        return ""
    pools = ", ".join(f"{p['pool']} {p['reserved_gib']:.2f}/{p['allocated_gib']:.2f}" for p in held["pools"][:6])
    return f"held between steps {held['allocated_gib']:.2f} GiB allocated; pools reserved/allocated GiB: {pools}"


@contextlib.contextmanager
def memory_cap(device: torch.device, limit_gib: float | None):
    """The caching allocator capped at `limit_gib` (``set_per_process_memory_fraction``: an
    allocation past it raises an out-of-memory error as a GPU of that size would), peak stats
    reset; the cap is lifted afterwards. No cap without a limit or off CUDA."""
    if device.type != "cuda" or not limit_gib:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gib * GiB / total), device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def left_over(device: torch.device) -> dict[str, Any] | None:
    """What is still allocated and reserved before a variant starts (after :func:`free_device_memory`):
    what earlier variants of the process left, which the variant's peaks would count, and the
    largest CUDA tensors the garbage collector still sees, with the type of what refers to each,
    and the allocator's live blocks of >= 1 MiB by size and stream (what no Python object holds:
    a side stream's cuBLAS workspace, say), to find who holds them. None off CUDA."""
    if device.type != "cuda":
        return None
    from torch._subclasses.fake_tensor import FakeTensor

    live = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on deprecated module attributes
        for obj in gc.get_objects():
            try:
                if (isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) and obj.is_cuda
                        and obj.untyped_storage().nbytes() >= 1 << 20):  # Dynamo's fakes hold no memory
                    live.append(obj)
            except Exception:  # an object that fails isinstance or a storage without data
                continue
    live.sort(key=lambda t: -t.untyped_storage().nbytes())
    largest = [{"shape": list(t.shape), "dtype": str(t.dtype), "mib": t.untyped_storage().nbytes() / 2**20,
                "held_by": sorted({type(r).__name__ for r in gc.get_referrers(t)} - {"list", "frame"})[:4]}
               for t in live[:5]]
    del live
    blocks: dict[tuple[float, int], int] = {}  # (MiB, stream) -> how many: tensors Python does not see show here
    for seg in device_segments(device):
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated" and block["size"] >= 1 << 20:
                key = (round(block["size"] / 2**20, 2), seg.get("stream", 0))
                blocks[key] = blocks.get(key, 0) + 1
    ranked = sorted(blocks.items(), key=lambda kv: -kv[0][0] * kv[1])[:6]
    return {"allocated_gib": torch.cuda.memory_allocated(device) / GiB,
            "reserved_gib": torch.cuda.memory_reserved(device) / GiB, "largest_tensors": largest,
            "allocated_blocks": [{"mib": mib, "stream": stream, "count": n} for (mib, stream), n in ranked]}


def free_device_memory(device: torch.device) -> None:
    """Between variants: Dynamo's caches (and CUDA-graph trees) dropped, garbage collected, each
    stream's cuBLAS workspace (~32 MiB) and the allocator's cache released."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        clear_cublas = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_cublas is not None:
            clear_cublas()
        torch.cuda.empty_cache()


def rss_gib() -> float | None:
    """The process's resident memory now (Linux), for CPU runs, where no allocator counts peaks."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GiB
    except (OSError, ValueError, IndexError):
        return None


# --------------------------------------------------------------------------------------------
# a step's loss and gradients (numerics.py judges them)


def cpu_fp32(g: torch.Tensor) -> torch.Tensor:
    """An fp32 CPU copy of a gradient; an FSDP2 DTensor is gathered to its full tensor first (a
    collective: every rank must call it)."""
    if hasattr(g, "full_tensor"):
        g = g.full_tensor()
    return g.detach().float().cpu().clone()


def loss_and_grads(model: nn.Module, step_fn: Callable, batch: tuple, device: torch.device, amp: bool,
                   names: dict[int, str] | None = None,
                   grad: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[float, dict]:
    """One `train_step`; the loss as a float and every parameter's gradient as an fp32 CPU copy
    (None where it has none), keyed by parameter name, or by ``names[id(p)]`` when given (the names
    before a wrapper renamed them). `grad` transforms each gradient first (bench_distributed
    averages it over ranks). Gradients are cleared afterwards."""
    loss = train_step(model, step_fn, batch, device, amp)
    loss_value = float(loss.detach().float().cpu())
    named = ((names[id(p)], p) for p in model.parameters()) if names is not None else model.named_parameters()
    grads = {}
    for name, p in named:
        g = p.grad
        if g is not None and grad is not None:
            g = grad(g)
        grads[name] = None if g is None else cpu_fp32(g)
    model.zero_grad(set_to_none=True)
    return loss_value, grads


# --------------------------------------------------------------------------------------------
# failures and tables


def is_oom(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def error_row(exc: BaseException, **fields: Any) -> dict:
    """A variant's exception (call inside the ``except``) as a row: status OOM or FAILED, the
    error's first line and the traceback."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return {**fields, "status": "OOM" if is_oom(exc) else "FAILED", "error": f"{type(exc).__name__}: {first}",
            "traceback": traceback.format_exc()}


def guarded(run: Callable[[], dict], name: str, say: Callable[..., None] = log, **fields: Any) -> dict:
    """``run()``, the result row of one variant; an exception (an out-of-memory error included)
    becomes a FAILED / OOM row with its traceback (`error_row`), said in the log, and the run goes
    on. A CUDA error that corrupts the context cannot be contained in-process: later variants fail
    too, which is why the benchmarks run apollo's variants last."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001  (one variant's failure must not lose the run)
        row = error_row(exc, variant=name, **fields)
    say(f"  [{name}] {row['status']}: {row['error']}")
    say(row["traceback"])
    return row


def batch_reference(entry: dict, make_reference: Callable[[], dict], what: str = "eager",
                    say: Callable[..., None] = log) -> dict | None:
    """A batch's numerics reference (`make_reference()`, a `reference` dict), its loss and bf16
    noise floor recorded in `entry` and logged; None when it fails, the reason in `entry` (the
    batch is then skipped)."""
    try:
        ref = make_reference()
    except Exception as exc:  # noqa: BLE001
        say(f"  {what} reference failed ({type(exc).__name__}); skipping batch {entry['batch']}")
        say(traceback.format_exc())
        entry["error"] = f"reference: {type(exc).__name__}: {exc}"
        return None
    entry["loss_ref"] = ref["loss"]
    entry["bf16_noise_floor"] = f = ref["noise_summary"]
    if f:
        say(f"  bf16 noise floor ({what} bf16 vs fp32): |dloss| {f['loss_abs_diff']:.2e}, "
            f"max grad rel err {f['grad_rel_err_max']:.2e} ({f['grad_rel_err_worst_param']})")
    return ref


def noise_floor_lines(results: list[dict], label: str = "batch", what: str = "eager bf16 vs eager fp32") -> list[str]:
    """A report header's line per batch: the bf16 noise floor `batch_reference` recorded."""
    return [f"- {label} {entry['batch']}: bf16 noise floor ({what}): dloss {f['loss_abs_diff']:.1e}, "
            f"grad {f['grad_rel_err_max']:.1e}" for entry in results if (f := entry.get("bf16_noise_floor"))]


def fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def markdown(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def failed_cells(batch: Any, row: dict, width: int, status_at: int = 2) -> list[str]:
    """The cells of a row that did not run: batch, variant, status, blanks, the error (a table cell)."""
    error = (row.get("error") or "").splitlines()[0][:80].replace("|", "/") if row.get("error") else ""
    return [str(batch), row["variant"], row["status"]] + [""] * (width - status_at - 2) + [error]


# --------------------------------------------------------------------------------------------
# what apollo decided


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
                # "checkpoint" per graph: a whole step's re-runs (its inference graph's recompute decision)
                keys = ("lanes", "cuda_graph", "fallback", "offload", "compile_s", "main_allocated", "checkpoint")
                entry["graphs"] = {k: {key: summary.get(key) for key in keys} for k, summary in summaries.items()}
                row["apollo"].append(entry)
            for w in row["warnings"]:
                log(f"  [{name}] warning: {w.splitlines()[0][:300]}")
            for entry in row["apollo"]:
                for kind, g in entry["graphs"].items():
                    if g.get("compile_s"):
                        moved = g.get("main_allocated") or {}
                        log(f"  [{name}] {entry['plan']} {kind}: compile s {json.dumps(g['compile_s'])}, "
                            f"{(g.get('lanes') or {}).get('subgraphs')} subgraphs"
                            + (f", {moved['values']} side-lane gradients ({moved['bytes'] / 2**20:.0f} MiB) in "
                               "main-allocated memory" if moved.get("values") else ""))
                    if g.get("cuda_graph"):
                        log(f"  [{name}] {entry['plan']} {kind}: {json.dumps(g['cuda_graph'])}")
                    else:  # un-graphed (compiled autograd's graph, say): say so, and why if known
                        why = g.get("fallback") or "no CUDA-graph runner (CPU, or not a CUDA graph's device)"
                        log(f"  [{name}] {entry['plan']} {kind}: without a CUDA graph: {why}")


def diagnostics_for(row: dict, name: str, apollo: bool) -> contextlib.AbstractContextManager:
    """`apollo_diagnostics` for an apollo variant; for any other, a context yielding a list to
    keep its step in (unused)."""
    return apollo_diagnostics(row, name) if apollo else contextlib.nullcontext([])


# --------------------------------------------------------------------------------------------
# the variant matrix


@dataclass
class Trial:
    """What a variant built on the device. `step(read_loss=True)` runs one training step on the
    timing batch (``read_loss=False``: the loss not waited for, as queued steps run);
    `loss_and_grads()` one step on the numerics batch: the loss and every gradient (fp32, CPU);
    `keep` holds what must live until apollo's plans are read (the compiled step)."""

    step: Callable[..., Any]
    loss_and_grads: Callable[[], tuple[float, dict]] | None = None
    keep: Any = None


@dataclass
class Cell:
    """One cell of the matrix: a model at a batch size. `entry` is its results entry ("batch", and
    "model" where there are several; the variants' rows go to ``entry["variants"]``);
    `reference()` makes eager's reference (a `reference` dict), None for none; `data` is what the
    variants share (the model on the CPU, the batches)."""

    label: str
    entry: dict
    reference: Callable[[], dict] | None = None
    data: dict = field(default_factory=dict)


def measure(name: str, build: Callable[[], Trial], ref: dict | None, device: torch.device, *, warmup: int,
            steps: int, precision: str = "bf16", apollo: bool = False, back_to_back: bool = True,
            context: contextlib.AbstractContextManager | None = None, say: Callable[..., None] = log) -> dict:
    """One variant's row: `build()` (under `context`, with the peaks reset before it, so the
    whole-run peaks count the model's copy, compile and capture), ``warmup`` steps, ``steps`` timed
    steps and, with `back_to_back`, the same queued; memory as the module docstring says; numerics
    against `ref` (none without one or without ``trial.loss_and_grads``)."""
    row: dict[str, Any] = {"variant": name, "status": "ok"}
    with diagnostics_for(row, name, apollo) as keep, (context or contextlib.nullcontext()):
        row["left_over"] = left = left_over(device)  # earlier variants' memory, not this one's
        if left is not None and left["allocated_gib"] > 0.01:
            say(f"  [{name}] left over from earlier variants: {left['allocated_gib']:.2f} GiB allocated, "
                f"{left['reserved_gib']:.2f} reserved; largest tensors {left['largest_tensors']}")
        reset_peaks(device)
        retries = [alloc_retries(device)]
        trial = build()
        keep.append(trial.keep if trial.keep is not None else trial)  # see apollo_diagnostics
        row["warmup_peaks_gib"] = []  # the whole-run peak after each warm-up step: which one set it
        row.update(warm_up(trial.step, warmup, device,
                           after_each=lambda: row["warmup_peaks_gib"].append(read_peaks(device)[0])))
        say(f"  [{name}] compile + {warmup} warm-up steps: {row['compile_s']:.1f} s")
        warm_alloc, warm_reserved = read_peaks(device)
        reset_peaks(device)
        retries.append(alloc_retries(device))
        row.update(spread(time_steps(trial.step, steps, device)))
        retries.append(alloc_retries(device))
        if retries[0] is not None:  # allocator retries in compile + warm-up, and in the timed steps
            row["alloc_retries"] = {"warmup": retries[1] - retries[0], "timed": retries[2] - retries[1]}
        if back_to_back:
            b2b = time_back_to_back(lambda: trial.step(False), steps, device)
            row.update(back_to_back_ms=b2b["ms"], back_to_back_rounds_ms=b2b["rounds_ms"],
                       back_to_back_host_ms=b2b["host_ms"])
        row["peak_alloc_gib"], row["peak_reserved_gib"] = read_peaks(device)
        if row["peak_alloc_gib"] is None:
            row["rss_gib"] = rss_gib()
        else:  # the whole run, less what earlier variants left (as if run alone)
            row["peak_alloc_all_gib"] = max(warm_alloc, row["peak_alloc_gib"]) - left["allocated_gib"]
            row["peak_reserved_all_gib"] = max(warm_reserved, row["peak_reserved_gib"]) - left["reserved_gib"]
        row["held"] = memory_held(device)
        say(f"  [{name}] {steps} steps: {spread_text(row)}"
            + (f"; back to back {row['back_to_back_ms']:.2f} ms (host {row['back_to_back_host_ms']:.2f})"
               if back_to_back else "")
            + (f"; timed steps {peaks_text(row['peak_alloc_gib'], row['peak_reserved_gib'])}; whole run "
               f"{peaks_text(row['peak_alloc_all_gib'], row['peak_reserved_all_gib'])}"
               if row["peak_alloc_gib"] is not None else ""))
        if row["held"] is not None:
            say(f"  [{name}] {memory_held_text(row['held'])}")
        if ref is not None and trial.loss_and_grads is not None:
            loss, grads = trial.loss_and_grads()
            row["numerics"] = n = compare(loss, grads, ref, precision)
            say(f"  [{name}] numerics {verdict(n)}: {numerics_text(n)}")
    return row


def run_matrix(cells: Iterable[Cell], variants: Sequence[str], run: Callable[[Cell, str, dict | None], dict],
               device: torch.device, results: list[dict], *, on_update: Callable[[], Any] = lambda: None,
               what: str = "eager", fields: Callable[[str], dict] = lambda variant: {},
               say: Callable[..., None] = log) -> list[dict]:
    """Every variant of every cell: ``run(cell, variant, ref)`` makes the variant's row (usually
    through `measure`), guarded (`guarded`: an exception is a FAILED / OOM row, with
    ``fields(variant)``), the device's memory freed after it and `on_update()` called (the results
    written). A cell whose reference fails is skipped, the reason in its entry. Cells come one at a
    time (a generator), so only one cell's batches sit on the device. Returns `results`."""
    for cell in cells:
        say(f"\n=== {cell.label} ===")
        cell.entry.setdefault("variants", [])
        results.append(cell.entry)
        ref = None
        if cell.reference is not None:
            ref = batch_reference(cell.entry, cell.reference, what, say)
            if ref is None:
                free_device_memory(device)
                on_update()
                continue
        for variant in variants:
            say(f"--- {cell.label}, {variant}")
            cell.entry["variants"].append(guarded(lambda: run(cell, variant, ref), variant, say, **fields(variant)))
            free_device_memory(device)
            on_update()
        cell.data.clear()
        ref = None  # the batch's reference freed before the next cell's
        free_device_memory(device)
    return results


def matrix_columns(baseline: str) -> list[str]:
    """The columns every matrix table has after its lead columns and "variant"."""
    return ["median ms", "p10", "p90", f"vs {baseline}", "b2b ms", f"b2b vs {baseline}", "b2b host ms",
            "peak GiB", f"peak vs {baseline}", "reserved GiB", f"reserved vs {baseline}", "whole-run reserved GiB",
            f"whole-run vs {baseline}", "compile s", "numerics"]


def matrix_cells(r: dict, base: dict | None) -> list[str]:
    """An ok row's `matrix_columns` cells: times and ratios to the baseline's (>1: faster), the
    timed steps' peak allocated and reserved, the whole run's reserved (<1: less memory)."""
    b2b = r.get("back_to_back_ms")
    return [f"{r['median_ms']:.2f}", f"{r['p10_ms']:.2f}", f"{r['p90_ms']:.2f}",
            fmt(base["median_ms"] / r["median_ms"] if base else None, ".2f", "x"), fmt(b2b, ".2f"),
            fmt(base["back_to_back_ms"] / b2b if base and b2b and base.get("back_to_back_ms") else None, ".2f", "x"),
            fmt(r.get("back_to_back_host_ms"), ".2f"),
            fmt(r.get("peak_alloc_gib"), ".2f"), fmt(memory_ratio(r, base, "peak_alloc_gib"), ".2f", "x"),
            fmt(r.get("peak_reserved_gib"), ".2f"), fmt(memory_ratio(r, base, "peak_reserved_gib"), ".2f", "x"),
            fmt(r.get("peak_reserved_all_gib"), ".2f"), fmt(memory_ratio(r, base, "peak_reserved_all_gib"), ".2f", "x"),
            f"{r['compile_s']:.1f}", numerics_cell(r["numerics"]) if r.get("numerics") else "-"]


def matrix_table(results: list[dict], baseline: str, lead: Sequence[str] = ("batch",)) -> str:
    """The markdown table of `run_matrix`'s results: the `lead` fields of each entry, the variant,
    `matrix_columns`; a row that did not run shows its status and error."""
    header = [*lead, "variant", *matrix_columns(baseline)]
    rows = []
    for entry in results:
        first = [str(entry.get(key, "")) for key in lead]
        base = next((r for r in entry["variants"] if r["variant"] == baseline and r["status"] == "ok"), None)
        for r in entry["variants"]:
            if r["status"] != "ok":
                error = (r.get("error") or "").splitlines()[0][:80].replace("|", "/") if r.get("error") else ""
                rows.append([*first, r["variant"], r["status"]] + [""] * (len(header) - len(first) - 3) + [error])
                continue
            rows.append([*first, r["variant"], *matrix_cells(r, base)])
    return markdown(header, rows)


def write_results(out_dir: Path, stem: str, env: dict, head: Sequence[str], tables: Sequence[str],
                  **data: Any) -> str:
    """``<out_dir>/<stem>_results.md`` (the `head` lines, then each table) and
    ``<stem>_results.json`` (``environment`` and `data`); returns the markdown."""
    text = "\n".join(head) + "".join("\n\n" + t for t in tables if t) + "\n"
    (out_dir / f"{stem}_results.md").write_text(text)
    (out_dir / f"{stem}_results.json").write_text(json.dumps({"environment": env, **data}, indent=1, default=str))
    return text
