"""Peak memory and step time of the CLIP-style model (benchmarks/clip.py) under mixed precision,
activation checkpointing and activation memory budgets, and the largest batch within a memory limit.

Variants (``Variant.describe`` says what each sets up; ``variant_name`` takes any
``apollo-bf16-budget-<f>[-bytes-per-us][-fw-measured|-lanes-measured|-bw-follows][-offload[-stream]]``):
eager fp32 (TF32 off: the numerics reference) and bf16 autocast, eager with per-block
``torch.utils.checkpoint`` (and ``save_on_cpu``), Inductor with ``activation_memory_budget``, and
apollo at ``precision="bf16"`` with ``memory_budget`` fractions, offloading, and the candidate
choice under a budget measured (``-fw-measured``, ``-lanes-measured``, ``-bw-follows``: the rules
of runtime/choice.py's ``ChooseFastest``).

Main phase, per batch size: common.py's variant matrix without back-to-back steps (every compile
static). The ratio to eager fp32 and the search read the whole-run peak (compile, capture and
warm-up included): a CUDA graph's buffers live in its private pool, so the timed replays' own
allocated peak misses them. Numerics against eager fp32: bf16 variants by bf16's tolerance (PASS*
within 2x eager bf16's distance from fp32), eager-fp32 by fp32's.

Largest batch within ``--max-batch-search LIMIT_GIB`` (CUDA only; ``--skip-search`` turns it off):
the allocator capped at LIMIT, a probe at batch B runs ``--warmup`` + ``--search-steps`` steps of a
fresh copy in this process; B passes when nothing raises, the peak allocated is <= LIMIT and
apollo's graphs replayed as CUDA graphs (or were left un-graphed by design). Powers of two, the
first guessed from a fit of peak against batch, then bisection to 1/16, at most ``--search-probes``
probes; main-phase rows decide without a probe where they can. ``--search-at B ...`` probes exactly
those batches. (bench_large_batch.py runs each try in a fresh process, for the whole step.)

Results after every variant and probe: ``<out>/memory_results.json`` and ``.md``. Each compile
takes about 40 s on the device; the script prints how many the flags imply.

    PYTHONPATH=. python benchmarks/bench_memory.py --batch 64 256 --skip-search
    PYTHONPATH=. python benchmarks/bench_memory.py --batch 64 256 --variants apollo-bf16-budget-0.2 --max-batch-search 20
    python benchmarks/bench_memory.py --device cpu --config tiny --batch 4 --steps 2 --warmup 1 --skip-search \\
        --variants eager-fp32 eager-bf16 eager-bf16-ckpt apollo-bf16 apollo-bf16-budget-0.5
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import re
import sys
import time
import traceback
import unittest.mock
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch.utils.checkpoint import checkpoint

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # common.py, clip.py (already first when run as a script)
sys.path.insert(1, str(HERE.parent))  # the repo root, for apollo_compile

import clip  # noqa: E402
import common  # noqa: E402  (the method every benchmark here shares)
from common import GiB, fmt, log  # noqa: E402
COMPILE_S_ESTIMATE = 40  # one compile of the base model on the H200 (RESULTS.md: 38-53 s)
REFERENCE = "eager-fp32"  # the memory ratio's denominator and the numerics reference


# --------------------------------------------------------------------------------------------
# variants


@dataclass(frozen=True)
class Variant:
    name: str
    autocast: bool  # forward under torch.autocast(bf16)
    compiler: str | None = None  # None (eager), "inductor" or "apollo"
    options: dict = field(default_factory=dict)  # apollo options
    checkpoint_blocks: bool = False  # torch.utils.checkpoint around every clip.Block
    functorch_budget: float | None = None  # torch._functorch.config.activation_memory_budget
    tf32: bool = True  # False: TF32 off for matmuls and convolutions (true fp32)
    memory_bound_first: bool = True  # apollo's checkpoint order (checkpoint.MEMORY_BOUND_FIRST)
    forward_measured: bool = False  # the forward may replay lanes beside a donating backward (-fw-measured)
    lanes_measured: bool = False  # both graphs may replay lanes under the budget (-lanes-measured)
    backward_follows: bool = False  # the forward measured, its donating backward replays its choice (-bw-follows)
    save_on_cpu: bool = False  # eager: torch.autograd.graph.save_on_cpu(pin_memory=True) around the forward
    offload_stream: bool = False  # -offload-stream: PyTorch's offloading copies on a stream of their own

    @property
    def compiled(self) -> bool:
        return self.compiler is not None

    @property
    def tolerance(self) -> str:  # bench_step.GRAD_RTOL / LOSS_RTOL key
        return "fp32" if self.name == "eager-fp32" else "bf16"

    def describe(self) -> str:
        parts = ["bf16 autocast" if self.autocast else "no autocast"]
        if self.checkpoint_blocks:
            parts.append("checkpoint(use_reentrant=False) per block")
        if self.compiler == "inductor":
            parts.append("torch.compile (Inductor, default mode)")
        if self.functorch_budget is not None:
            parts.append(f"activation_memory_budget={self.functorch_budget}")
        if self.compiler == "apollo":
            parts.append(f"backend=apollo, options={self.options}")
        if not self.tf32:
            parts.append("TF32 off")
        if not self.memory_bound_first:
            parts.append("recompute order: bytes freed per microsecond alone (matmuls not last)")
        if self.forward_measured:
            parts.append("forward's lane candidates measured beside a donating backward")
        if self.lanes_measured:
            parts.append("both graphs' lane candidates measured under the budget")
        if self.backward_follows:
            parts.append("the forward's lane candidates measured, its backward replays the forward's choice unmeasured")
        if self.save_on_cpu:
            parts.append("save_on_cpu(pin_memory=True): saved tensors on the host")
        if self.offload_stream:
            parts.append("offloading copies on a stream of their own (offload_stream_settings)")
        return ", ".join(parts)

    @contextlib.contextmanager
    def context(self):
        """Active around the variant's compile and every call (compilation is lazy: first call)."""
        with contextlib.ExitStack() as stack:
            if not self.tf32:
                stack.enter_context(common.no_tf32())
            if self.functorch_budget is not None:
                stack.enter_context(functorch_config.patch(activation_memory_budget=self.functorch_budget))
            if not self.memory_bound_first:
                from apollo_compile.passes import checkpoint

                stack.enter_context(unittest.mock.patch.object(checkpoint, "MEMORY_BOUND_FIRST", False))
            if self.forward_measured or self.lanes_measured or self.backward_follows:
                # the memory-first rule off for the forward (-fw-measured, -bw-follows) or for every graph
                # (-lanes-measured); -bw-follows: the donating backward replays its forward's choice
                from apollo_compile.runtime import choice

                stack.enter_context(choice.using(choice.ChooseFastest(
                    memory_first=() if self.lanes_measured else ("backward",),
                    follow_forward=self.backward_follows)))
            if self.offload_stream:
                stack.enter_context(functorch_config.patch(**offload_stream_settings()))
            if self.save_on_cpu:  # packs what the forward saves; the backward unpacks it wherever it runs
                stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=True))
            yield

    def prepare(self, model: nn.Module) -> Callable[..., torch.Tensor]:
        """The step function for `model` (already on the device); wraps blocks in place."""
        if self.checkpoint_blocks:
            n = wrap_blocks_in_checkpoint(model)
            if n == 0:
                raise RuntimeError("no clip.Block found to checkpoint")
        if self.compiler is None:
            return model
        if self.compiler == "inductor":
            return torch.compile(model, dynamic=False)
        if self.compiler == "apollo":
            import apollo_compile  # noqa: F401  (importing registers backend="apollo")

            return torch.compile(model, backend="apollo", options=dict(self.options), dynamic=False)
        raise ValueError(self.compiler)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("eager-fp32", autocast=False, tf32=False),
        Variant("eager-bf16", autocast=True),
        Variant("eager-bf16-ckpt", autocast=True, checkpoint_blocks=True),
        Variant("eager-bf16-ckpt-offload", autocast=True, checkpoint_blocks=True, save_on_cpu=True),
        Variant("inductor-budget-0.5", autocast=True, compiler="inductor", functorch_budget=0.5),
        Variant("apollo-bf16", autocast=False, compiler="apollo", options={"precision": "bf16"}),
        Variant("apollo-bf16-budget-0.5", autocast=False, compiler="apollo",
                options={"precision": "bf16", "memory_budget": 0.5}),
        Variant("apollo-bf16-budget-0.3", autocast=False, compiler="apollo",
                options={"precision": "bf16", "memory_budget": 0.3}),
        Variant("apollo-bf16-budget-0.2", autocast=False, compiler="apollo",
                options={"precision": "bf16", "memory_budget": 0.2}),
        Variant("apollo-bf16-budget-0.3-bytes-per-us", autocast=False, compiler="apollo",
                options={"precision": "bf16", "memory_budget": 0.3}, memory_bound_first=False),
        Variant("apollo-bf16-budget-0.1", autocast=False, compiler="apollo",
                options={"precision": "bf16", "memory_budget": 0.1}),
        Variant("apollo-bf16-budget-0.05", autocast=False, compiler="apollo",
                options={"precision": "bf16", "memory_budget": 0.05}),
        Variant("apollo-bf16-budget-0.05-offload", autocast=False, compiler="apollo",
                options={"precision": "bf16", "memory_budget": 0.05, "offload_activations": True}),
    )
}
_BUDGET_VARIANT = re.compile(
    r"apollo-bf16-budget-((?:0\.\d+)|1(?:\.0)?)(-bytes-per-us)?(-fw-measured|-lanes-measured|-bw-follows)?"
    r"(-offload(-stream)?)?")


def offload_stream_settings() -> dict[str, bool]:
    """PyTorch's separate-stream activation offloading, as far as this torch has it: the copies to
    and from the host on a stream of their own, the forward's waits sunk and the backward's copies
    prefetched. apollo's offloading copies on the compute stream: at batch 64 its
    step took 61 ms against 32.5 without offloading, about the time of ~1.2 GB over PCIe each step.
    Whether apollo's lanes and Inductor take these stream ops is what the variant is for."""
    known = functorch_config.get_config_copy()
    if "activation_offload_separate_stream" not in known:
        raise RuntimeError(f"torch {torch.__version__} has no separate-stream activation offloading")
    wanted = ("activation_offload_separate_stream", "activation_offload_sink_wait", "activation_reload_prefetch")
    return {key: True for key in wanted if key in known}


def variant_name(name: str) -> str:
    """argparse type: a listed variant, or any
    ``apollo-bf16-budget-<fraction>[-bytes-per-us][-fw-measured|-lanes-measured|-bw-follows][-offload[-stream]]``
    (added to VARIANTS, after the listed apollo budgets)."""
    if name in VARIANTS:
        return name
    m = _BUDGET_VARIANT.fullmatch(name)
    if m is None:
        raise argparse.ArgumentTypeError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)} "
                                         "or apollo-bf16-budget-<fraction in (0, 1]>[-bytes-per-us]"
                                         "[-fw-measured|-lanes-measured|-bw-follows][-offload[-stream]]")
    budget = float(m.group(1))
    if budget <= 0:
        raise argparse.ArgumentTypeError(f"{name!r}: the budget must be in (0, 1]")
    options = {"precision": "bf16", "memory_budget": budget}
    if m.group(4):
        options["offload_activations"] = True
    VARIANTS[name] = Variant(name, autocast=False, compiler="apollo", options=options,
                             memory_bound_first=m.group(2) is None, forward_measured=m.group(3) == "-fw-measured",
                             lanes_measured=m.group(3) == "-lanes-measured",
                             backward_follows=m.group(3) == "-bw-follows", offload_stream=m.group(5) is not None)
    return name


class CheckpointedBlock(nn.Module):
    """Recompute the wrapped block's forward in the backward (non-reentrant checkpoint)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def wrap_blocks_in_checkpoint(model: nn.Module) -> int:
    """Replace every clip.Block held in an nn.ModuleList (both towers' ``blocks``) by a
    CheckpointedBlock around it. Parameter names gain ``.block``; the numerics keys gradients by
    the names taken before wrapping."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    n = 0
    for blocks in lists:
        for i, block in enumerate(blocks):
            if isinstance(block, clip.Block):
                blocks[i] = CheckpointedBlock(block)
                n += 1
    return n


# --------------------------------------------------------------------------------------------
# measurement helpers


def param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def reference(base: nn.Module, batch_cpu: tuple, device: torch.device) -> dict:
    """Eager fp32 (TF32 off) loss and gradients on the numerics batch — the reference — and eager
    bf16 autocast's per-parameter distance from them (the bf16 noise floor), in the layout
    common.compare reads ("grads" = "grads_fp32" = the fp32 gradients)."""
    model = copy.deepcopy(base).to(device)
    batch = tuple(t.to(device) for t in batch_cpu)
    with common.no_tf32():
        loss32, grads32 = common.loss_and_grads(model, model, batch, device, False)
    loss16, grads16 = common.loss_and_grads(model, model, batch, device, True)
    floor, worst = common.noise_floor(grads16, grads32)
    del model, batch, grads16
    common.free_device_memory(device)
    return {
        "loss": loss32, "grads": grads32, "grads_fp32": grads32, "noise_floor": floor,
        "noise_summary": {"loss_fp32": loss32, "loss_bf16": loss16, "loss_abs_diff": abs(loss16 - loss32),
                          "grad_rel_err_max": floor[worst], "grad_rel_err_worst_param": worst},
    }


# --------------------------------------------------------------------------------------------
# main phase: one variant at one batch size


def run_variant(spec: Variant, base: nn.Module, batch: tuple, numerics_cpu: tuple, ref: dict, args,
                device: torch.device) -> dict:
    """One variant at one batch size through common.measure (no back-to-back steps); numerics
    against eager fp32, an fp32 variant without bf16's noise excuse."""

    def build() -> common.Trial:
        model = copy.deepcopy(base).to(device)
        names = param_names(model)  # before prepare() wraps blocks
        step_fn = spec.prepare(model)
        return common.Trial(
            step=lambda read_loss=True: common.train_step(model, step_fn, batch, device, spec.autocast),
            loss_and_grads=lambda: common.loss_and_grads(model, step_fn, tuple(t.to(device) for t in numerics_cpu),
                                                         device, spec.autocast, names),
            keep=step_fn)

    check_ref = ref if spec.tolerance == "bf16" else dict(ref, noise_floor=None)  # fp32: no bf16 excuse
    row = common.measure(spec.name, build, check_ref, device, warmup=args.warmup, steps=args.steps,
                         precision=spec.tolerance, apollo=spec.compiler == "apollo", back_to_back=False,
                         context=spec.context())
    row["setup"] = spec.describe()
    return row


# --------------------------------------------------------------------------------------------
# largest batch within a memory limit


def ungraphed_runners(by_design: bool = False) -> list[str]:
    """apollo's graphs that ran without their CUDA graph in the plans recorded since the last
    ``clear_plans()``: a capture that runs out of memory falls back to the runtime, correct and
    warned, and such a probe must not count as apollo training at that batch. With `by_design`,
    those apollo left un-graphed on purpose instead: too close to the memory limit to capture
    (docs/design/cuda-graphs.md#capture-headroom), running what the probe's first step ran."""
    import apollo_compile

    out = []
    for plan in apollo_compile.plans():
        for kind, graph in plan.graphs.items():
            cg = graph.summary().get("cuda_graph") or {}
            if bool(cg.get("capture_refused")) != by_design:
                continue
            if cg.get("disabled") or cg.get("ungraphed_calls"):
                out.append(f"{plan.name} {kind}: " + (cg.get("disabled") or f"{cg['ungraphed_calls']} calls un-graphed"))
    return out


def probe(spec: Variant, base: nn.Module, batch_size: int, args, device: torch.device) -> dict:
    """One capped run at `batch_size`: --warmup + --search-steps steps of a fresh copy. An apollo
    run whose graphs fell back to running without their CUDA graphs is no pass ("un-graphed")."""
    limit = args.max_batch_search
    rec: dict[str, Any] = {"batch": batch_size, "source": "probe"}
    common.free_device_memory(device)
    rec["baseline_alloc_gib"] = torch.cuda.memory_allocated(device) / GiB
    rec["baseline_reserved_gib"] = torch.cuda.memory_reserved(device) / GiB
    model = step_fn = batch = None
    t0 = time.perf_counter()
    if spec.compiler == "apollo":
        import apollo_compile

        apollo_compile.clear_plans()
    with common.memory_cap(device, limit):
        try:
            with spec.context():
                batch = tuple(t.to(device) for t in clip.make_batch(batch_size, "cpu", args.config, seed=args.seed))
                model = copy.deepcopy(base).to(device)
                step_fn = spec.prepare(model)
                for _ in range(args.warmup + args.search_steps):
                    common.train_step(model, step_fn, batch, device, spec.autocast)
                common.synchronize(device)
            rec["peak_alloc_gib"], rec["peak_reserved_gib"] = common.read_peaks(device)
            rec["status"] = "ok" if rec["peak_alloc_gib"] <= limit else "over limit"
            if spec.compiler == "apollo" and (ungraphed := ungraphed_runners()):
                rec["status"], rec["ungraphed"] = "un-graphed", ungraphed
                log(f"  [{spec.name}] batch {batch_size} ran without its CUDA graphs: " + "; ".join(ungraphed)[:400])
            elif spec.compiler == "apollo" and (refused := ungraphed_runners(by_design=True)):
                rec["ungraphed_by_design"] = refused  # trains, as designed: a pass, marked in the table
                log(f"  [{spec.name}] batch {batch_size} trained un-graphed by design: " + "; ".join(refused)[:400])
        except Exception as exc:  # noqa: BLE001
            rec.update(common.error_row(exc, **rec))
            rec["peak_alloc_gib"], rec["peak_reserved_gib"] = common.read_peaks(device)
            if rec["status"] == "FAILED":  # not recognisably an OOM: show why
                log(rec["traceback"])
            del rec["traceback"]
        finally:
            model = step_fn = batch = None
            common.free_device_memory(device)
    rec["wall_s"] = time.perf_counter() - t0
    rec["pass"] = rec["status"] == "ok"
    return rec


def pow2_floor(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(x, 1)))))


def predict_max_batch(points: list[tuple[int, float]], limit: float, fixed_guess: float) -> float | None:
    """Largest batch whose predicted peak is <= limit, from (batch, peak GiB) measurements: a least
    squares line through them, or with one point a line through it and `fixed_guess` at batch 0."""
    xs = np.array([b for b, _ in points], dtype=float)
    ys = np.array([p for _, p in points], dtype=float)
    if len(set(xs.tolist())) >= 2:
        slope, intercept = np.polyfit(xs, ys, 1)
    elif len(xs) == 1 and ys[0] > fixed_guess:
        slope, intercept = (ys[0] - fixed_guess) / xs[0], fixed_guess
    else:
        return None
    if slope <= 0:
        return None
    return float(min(max((limit - intercept) / slope, 1.0), 1 << 16))


def next_candidate(lo: int | None, hi: int | None, pred: float | None, start: int) -> int | None:
    """The next batch to probe; None when the bracket is resolved. lo passes, hi fails."""
    if lo is not None and hi is not None:
        if hi - lo <= max(1, lo // 16):
            return None
        pows = [1 << k for k in range(17) if lo < (1 << k) < hi]
        if pows:  # a power of two between them, the one nearest the geometric mean
            mid = (math.log2(lo) + math.log2(hi)) / 2
            return min(pows, key=lambda p: abs(math.log2(p) - mid))
        return (lo + hi) // 2
    if lo is None and hi is None:
        return pow2_floor(pred) if pred else start
    if hi is None:  # only passes: the next power of two up, or further if the fit says so
        nxt = pow2_floor(lo) * 2
        return max(nxt, pow2_floor(pred)) if pred else nxt
    if hi <= 1:  # only fails, down to batch 1
        return None
    prv = pow2_floor(hi - 1)
    return min(prv, pow2_floor(pred)) if pred else prv


def bracket(known: dict[int, bool]) -> tuple[int | None, int | None]:
    """(largest passing batch, smallest failing batch above it)."""
    passing = [b for b, ok in known.items() if ok]
    lo = max(passing) if passing else None
    failing = [b for b, ok in known.items() if not ok and (lo is None or b > lo)]
    return lo, min(failing) if failing else None


def search_variant(spec: Variant, base: nn.Module, args, device: torch.device, main_rows: list[tuple[int, dict]],
                   fixed_guess: float, res: dict, on_update: Callable[[], None]) -> dict:
    """Fill `res` (the variant's search record, reported after every probe through on_update)."""
    limit = args.max_batch_search
    res.update({"variant": spec.name, "limit_gib": limit, "records": [], "probes_run": 0})
    known: dict[int, bool] = {}
    points: list[tuple[int, float]] = []
    for b, row in main_rows:
        rec = {"batch": b, "source": "main", "status": row["status"],
               "peak_alloc_gib": row.get("peak_alloc_all_gib"), "peak_reserved_gib": row.get("peak_reserved_all_gib")}
        if row["status"] == "ok" and row.get("peak_alloc_all_gib") is not None:
            points.append((b, row["peak_alloc_all_gib"]))
            if row["peak_reserved_all_gib"] <= limit:
                rec["pass"] = True
            elif row["peak_alloc_all_gib"] > limit:
                rec.update({"pass": False, "status": "over limit"})
        elif row["status"] == "OOM" and limit <= torch.cuda.get_device_properties(device).total_memory / GiB:
            rec["pass"] = False  # out of memory on the whole device
        if "pass" in rec:
            known[b] = rec["pass"]
            res["records"].append(rec)
            log(f"  [{spec.name}] batch {b}: {'passes' if rec['pass'] else 'fails'} (main phase: "
                f"{fmt(rec['peak_alloc_gib'], '.2f')} GiB allocated / {fmt(rec['peak_reserved_gib'], '.2f')} reserved)")

    while True:
        lo, hi = bracket(known)
        res["largest_ok"], res["smallest_fail"] = lo, hi
        pred = predict_max_batch(points, limit, fixed_guess) if points else None
        if args.search_at:  # the listed batches, in order, none probed twice
            b = next((x for x in args.search_at if x not in known), None)
        else:
            b = next_candidate(lo, hi, pred, args.search_start)
        if b is None or b in known:
            res["stop"] = "repeat" if b is not None else "listed batches probed" if args.search_at else "resolved"
            break
        if res["probes_run"] >= args.search_probes:
            res["stop"] = "probe budget spent"
            break
        log(f"  [{spec.name}] probe batch {b} (bracket {lo}..{hi}"
            + (f", fit predicts {pred:.0f}" if pred else "") + ")")
        rec = probe(spec, base, b, args, device)
        res["probes_run"] += 1
        res["records"].append(rec)
        known[b] = rec["pass"]
        if rec.get("peak_alloc_gib") is not None and rec["status"] in ("ok", "over limit"):
            points.append((b, rec["peak_alloc_gib"]))
        log(f"  [{spec.name}] batch {b}: {'passes' if rec['pass'] else 'fails'} ({rec['status']}"
            + (f": {rec['error']}" if "error" in rec else "")
            + f"; peak {fmt(rec.get('peak_alloc_gib'), '.2f')} GiB allocated / "
              f"{fmt(rec.get('peak_reserved_gib'), '.2f')} reserved; {rec['wall_s']:.0f} s)")
        res["largest_ok"], res["smallest_fail"] = bracket(known)
        on_update()
    ok_recs = [r for r in res["records"] if r.get("pass") and r["batch"] == lo]
    res["peak_at_largest_gib"] = ok_recs[-1]["peak_alloc_gib"] if ok_recs else None
    log(f"  [{spec.name}] largest batch within {limit:g} GiB: {lo} (smallest failing: {hi}; "
        f"{res['probes_run']} probes; {res['stop']})")
    return res


# --------------------------------------------------------------------------------------------
# reporting


def environment(device: torch.device, args) -> dict:
    return common.environment(
        device, config=args.config, steps=args.steps, warmup=args.warmup, optimizer_step=False,
        variants={name: VARIANTS[name].describe() for name in args.variants},
        search=None if args.skip_search else {
            "limit_gib": args.max_batch_search, "probes_per_variant": args.search_probes,
            "steps_per_probe": f"{args.warmup} warm-up + {args.search_steps}", "listed_batches": args.search_at})


MAIN_HEADER = ["batch", "variant", "median ms", "peak GiB", "whole-run peak GiB", "reserved GiB",
               f"vs {REFERENCE} peak (whole run)", "vs fastest apollo time", "numerics"]


def main_table(results: list[dict], cuda: bool) -> str:
    na = "-" if cuda else "n/a"
    rows = []
    for entry in results:
        ok = [r for r in entry["variants"] if r["status"] == "ok"]
        ref = next((r for r in ok if r["variant"] == REFERENCE and r.get("peak_alloc_all_gib")), None)
        apollo = [r["median_ms"] for r in ok if r["variant"].startswith("apollo")]
        fastest = min(apollo) if apollo else None
        for r in entry["variants"]:
            if r["status"] != "ok":
                rows.append(common.failed_cells(entry["batch"], r, len(MAIN_HEADER)))
                continue
            peak, reserved, whole = r.get("peak_alloc_gib"), r.get("peak_reserved_gib"), r.get("peak_alloc_all_gib")
            mem_ratio = whole / ref["peak_alloc_all_gib"] if ref and whole is not None else None
            time_ratio = r["median_ms"] / fastest if fastest else None
            rows.append([
                str(entry["batch"]), r["variant"], f"{r['median_ms']:.2f}",
                na if peak is None else f"{peak:.2f}", na if whole is None else f"{whole:.2f}",
                na if reserved is None else f"{reserved:.2f}", fmt(mem_ratio, ".2f", "x"),
                fmt(time_ratio, ".2f", "x"), common.numerics_cell(r["numerics"]),
            ])
    return common.markdown(MAIN_HEADER, rows)


def runtime_notes(results: list[dict]) -> str:
    """A line per apollo row: the checkpoint plan (predicted peak vs the plain partition's) and, per
    graph, the runtime replayed, each candidate's replay time and capture pool (what concurrency
    costs in memory) and what measuring left allocated."""
    lines = []
    for entry in results:
        for r in entry["variants"]:
            for plan in r.get("apollo") or ():
                parts = []
                ckpt = plan.get("checkpoint")
                if ckpt and ckpt.get("peak_before"):
                    ratio = ckpt["peak_after"] / ckpt["peak_before"]
                    text = f"checkpoint: predicted peak {ratio:.3f}x of the plain partition's"
                    if ckpt.get("per_block"):
                        text += f" (per-block, {ckpt['relaxed']} saved back)" if ckpt.get("relaxed") else " (per-block)"
                    if not ckpt.get("met", True):
                        text += ", not met"
                    parts.append(text)
                for kind, g in plan["graphs"].items():
                    if (moved := g.get("offload")) and moved.get("to_host"):
                        parts.append(f"offload: {moved['to_host']} saved values, {moved['bytes'] / 2**30:.2f} GiB "
                                     "to the host and back")
                    cg = g.get("cuda_graph")
                    if not cg:
                        continue
                    pools = cg.get("candidate_pool_bytes") or {}
                    cands = ", ".join(f"{c} {ms:.2f} ms" + (f" / {pools[c] / 2**30:.2f} GiB" if pools.get(c) else "")
                                      for c, ms in cg.get("measured_ms", {}).items())
                    text = (f"{kind}: {cg.get('chosen')} [{cands or 'unmeasured'}], measuring left "
                            f"{(cg.get('measuring_left_bytes') or 0) / 2**30:.2f} GiB")
                    if cg.get("donated_bytes"):
                        text += f", saved activations reused {cg['donated_bytes'] / 2**30:.2f} GiB"
                    parts.append(text)
                if parts:
                    lines.append(f"- batch {entry['batch']}, {r['variant']}: " + "; ".join(parts))
    return "\n".join(lines)


def search_table(searches: list[dict], limit: float) -> str:
    header = ["variant", f"largest batch within {limit:g} GiB", "smallest failing", "peak GiB at largest",
              "probes (+ reused)", "note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in searches:
        lo, hi = s.get("largest_ok"), s.get("smallest_fail")
        reused = sum(1 for r in s["records"] if r["source"] == "main")
        failed = sorted({r["status"] for r in s["records"] if r["status"] not in ("ok", "over limit")})
        if s.get("stop") == "resolved" and lo is None:
            note = "nothing fits (batch 1 fails)"
        elif s.get("stop") == "resolved":
            note = "resolved (gap <= 1/16)"
        elif hi is None:
            note = f"no failing batch found: >= {lo}" if lo else "no result"
        elif s.get("stop"):
            note = f"{s['stop']}: the limit lies in [{fmt(lo, 'd')}, {hi})"
        else:
            note = "in progress"
        if failed:
            note += "; failures: " + ", ".join(failed)
        if any(r.get("ungraphed_by_design") for r in s["records"] if r["batch"] == lo and r.get("pass")):
            note += f"; un-graphed by design at {lo} (too close to the limit to capture)"
        lines.append("| " + " | ".join([
            s["variant"], fmt(lo, "d"), fmt(hi, "d"), fmt(s.get("peak_at_largest_gib"), ".2f"),
            f"{s['probes_run']} (+{reused})", note]) + " |")
    return "\n".join(lines)


def report(env: dict, results: list[dict], searches: list[dict], out_dir: Path, args) -> str:
    cuda = env["device"].startswith("cuda")
    head = [
        f"# apollo memory benchmark: CLIP-style ({env['config']})",
        "",
        common.header_line(env),
        f"{env['warmup']} warm-up + {env['steps']} timed steps of zero_grad + forward + backward (no optimizer "
        f"step). peak / reserved GiB = max_memory_allocated / max_memory_reserved over the timed steps"
        + ("" if cuda else " (not measured on the CPU: n/a; RSS is in the JSON)")
        + (". A CUDA-graph replay allocates nothing the allocator counts (apollo's timed steps show only "
           "what lives outside the replays); its memory shows in the whole-run peak, set while capturing "
           "or by the un-graphed first step, and in the reserved column" if cuda else "")
        + f". vs {REFERENCE} peak = variant peak / {REFERENCE} peak (<1: less memory); vs fastest apollo time "
        f"= variant median / the fastest apollo variant's median at that batch (>1: slower). Numerics vs eager "
        f"fp32 (TF32 off): PASS if every param's relative grad error <= {common.GRAD_RTOL['bf16']:g} "
        f"({common.GRAD_RTOL['fp32']:g} for eager-fp32) and |dloss| <= {common.LOSS_RTOL['bf16']:g} * max(1, |loss|); "
        f"PASS*: some params over it but no further from fp32 than {common.NOISE_MULTIPLIER:g}x eager bf16 is.",
        "",
        "Variants: " + "; ".join(f"`{k}`: {v}" for k, v in env["variants"].items()) + ".",
    ]
    for entry in results:
        floor = entry.get("bf16_noise_floor")
        if floor:
            head.append(f"- batch {entry['batch']}: loss fp32 {floor['loss_fp32']:.4f}; bf16 noise floor (eager bf16 "
                        f"vs eager fp32): dloss {floor['loss_abs_diff']:.1e}, grad {floor['grad_rel_err_max']:.1e} "
                        f"({floor['grad_rel_err_worst_param']})")
        if entry.get("error"):
            head.append(f"- batch {entry['batch']}: {entry['error'].splitlines()[0]}")
    text = "\n".join(head) + "\n\n" + main_table(results, cuda) + "\n"
    notes = runtime_notes(results)
    if notes:
        text += "\napollo's plans and runtimes (candidate: replay ms / capture pool):\n" + notes + "\n"
    if searches:
        tried = f"those listed, {args.search_at}" if args.search_at else "powers of two, then midpoints"
        text += (f"\nLargest batch whose step (with compile and {args.warmup} warm-up + {args.search_steps} steps) "
                 f"stays within {args.max_batch_search:g} GiB peak allocated, the allocator capped at that limit; "
                 f"batches tried: {tried}; main-phase results reused where they decide.\n\n"
                 + search_table(searches, args.max_batch_search) + "\n")
    (out_dir / "memory_results.md").write_text(text)
    (out_dir / "memory_results.json").write_text(
        json.dumps({"environment": env, "results": results, "max_batch_search": searches}, indent=1))
    return text


# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="*", default=[64, 256],
                   help="main-phase batch sizes (none: only the batch search)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), type=variant_name, metavar="VARIANT",
                   help="variants to run (default: all listed above; any apollo-bf16-budget-<fraction> too)")
    p.add_argument("--config", default="base", choices=sorted(clip.CONFIGS))
    p.add_argument("--max-batch-search", type=float, default=20.0, metavar="LIMIT_GIB",
                   help="find each variant's largest batch within this peak allocated memory (default 20)")
    p.add_argument("--skip-search", action="store_true", help="no largest-batch search")
    p.add_argument("--search-probes", type=int, default=4, help="most probe runs per variant (default 4)")
    p.add_argument("--search-steps", type=int, default=2, help="steps after the warm-up in a probe (default 2)")
    p.add_argument("--search-start", type=int, default=64,
                   help="first probe when nothing is measured yet (ignored with --search-at)")
    p.add_argument("--search-at", type=int, nargs="+", metavar="B",
                   help="probe exactly these batches, in this order, for each searched variant: no doubling or "
                        "bisection; batches already known are skipped, --search-probes still caps; wins over "
                        "--search-start")
    p.add_argument("--search-variants", nargs="+", type=variant_name, metavar="VARIANT",
                   help="the variants to search, in this order (default: --variants)")
    common.add_run_args(p, steps=20, warmup=3, warmup_help="warm-up steps (default 3: compile, CUDA-graph capture)",
                        amp=False)
    args = common.parse_run_args(p, argv)
    args.variants = [v for v in VARIANTS if v in args.variants]  # eager first, apollo last
    args.search_variants = args.search_variants or args.variants
    if args.max_batch_search <= 0 or args.search_probes < 0 or args.search_steps < 1 or args.search_start < 1:
        p.error("--max-batch-search must be > 0, --search-probes >= 0, --search-steps and --search-start >= 1")
    if args.search_at and min(args.search_at) < 1:
        p.error("--search-at batches must be >= 1")
    if args.search_at and args.skip_search:
        p.error("--search-at and --skip-search contradict each other")
    if args.device == "cpu" and not args.skip_search:
        args.skip_search = True
        args.search_skipped_reason = "the batch search needs CUDA (allocator cap); skipped on the CPU"
    if not args.batch and args.skip_search:
        p.error("nothing to do: no --batch and no search")
    return args


def announce_plan(args) -> None:
    compiled = [v for v in args.variants if VARIANTS[v].compiled]
    main_compiles = len(args.batch) * len(compiled)
    searched = [v for v in args.search_variants if VARIANTS[v].compiled]
    probes = min(len(args.search_at), args.search_probes) if args.search_at else args.search_probes
    search_compiles = 0 if args.skip_search else probes * len(searched)
    total = main_compiles + search_compiles
    log(f"compiles: {main_compiles} in the main phase ({len(args.batch)} batches x {len(compiled)} compiled variants)"
        + ("" if args.skip_search else
           f" + up to {search_compiles} in the search ({probes} probes x {len(searched)}; fewer where "
           f"main-phase results decide)")
        + f" = up to {total}; at ~{COMPILE_S_ESTIMATE} s each on an H200 ~{total * COMPILE_S_ESTIMATE / 60:.1f} min "
        f"of compiling, plus the steps")
    if not args.skip_search:
        eager = [v for v in args.search_variants if not VARIANTS[v].compiled]
        if eager:
            log(f"search: up to {probes} probes for each of {len(eager)} eager variants too (seconds each)")
    if total * COMPILE_S_ESTIMATE > 480:
        log("  note: more than ~8 min of compiling; a device command may run at most 10 min: "
            "split with --variants / --skip-search / --search-probes")
    if getattr(args, "search_skipped_reason", None):
        log(args.search_skipped_reason)


def main(argv=None) -> int:
    args = parse_args(argv)
    if (setup := common.device_and_out_dir(args)) is None:
        return 2
    device, out_dir = setup

    env = environment(device, args)
    log(common.header_line(env))
    log(f"config {args.config} | batches {args.batch} | variants {args.variants} | out {out_dir}")
    announce_plan(args)

    base = clip.build(args.config, device="cpu", seed=args.seed)  # stays on the CPU; copies go to the device
    n_params = sum(p.numel() for p in base.parameters())
    log(f"model: {n_params / 1e6:.1f} M parameters")

    results: list[dict] = []
    searches: list[dict] = []

    def cells():
        for batch_size in args.batch:
            batch = clip.make_batch(batch_size, device, args.config, seed=args.seed)
            numerics_cpu = clip.make_batch(batch_size, "cpu", args.config, seed=args.seed + 1)
            entry: dict[str, Any] = {"batch": batch_size}

            def make_reference() -> dict:
                ref = reference(base, numerics_cpu, device)
                entry["loss_ref_fp32"] = ref["loss"]
                log(f"  reference: loss fp32 {ref['loss']:.5f}, bf16 {ref['noise_summary']['loss_bf16']:.5f}")
                return ref

            yield common.Cell(f"batch {batch_size}", entry, make_reference, {"batch": batch, "numerics": numerics_cpu})

    common.run_matrix(cells(), args.variants,
                      lambda cell, name, ref: run_variant(VARIANTS[name], base, cell.data["batch"],
                                                          cell.data["numerics"], ref, args, device),
                      device, results, what="eager fp32", fields=lambda name: {"setup": VARIANTS[name].describe()},
                      on_update=lambda: report(env, results, searches, out_dir, args))

    if not args.skip_search:
        log(f"\n=== largest batch within {args.max_batch_search:g} GiB ===")
        fixed_guess = 2 * n_params * 4 / GiB  # fp32 weights + grads, with one main-phase point only
        for name in args.search_variants:
            log(f"--- search, {name}")
            main_rows = [(e["batch"], r) for e in results for r in e["variants"] if r["variant"] == name]
            res: dict[str, Any] = {"variant": name, "records": [], "probes_run": 0}
            searches.append(res)
            try:
                search_variant(VARIANTS[name], base, args, device, main_rows, fixed_guess, res,
                               on_update=lambda: report(env, results, searches, out_dir, args))
            except Exception as exc:  # noqa: BLE001  (a bug in the search itself)
                log(f"  [{name}] search failed: {type(exc).__name__}: {exc}")
                log(traceback.format_exc())
                res["stop"] = f"search error: {type(exc).__name__}"
            torch.cuda.set_per_process_memory_fraction(1.0, device)
            common.free_device_memory(device)
            report(env, results, searches, out_dir, args)

    text = report(env, results, searches, out_dir, args)
    log(f"\nwrote {out_dir / 'memory_results.json'} and {out_dir / 'memory_results.md'}\n")
    log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
