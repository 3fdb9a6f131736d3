"""The largest batch each variant trains under an allocator cap: reduce-overhead, apollo on the
module, compile_step with the optimizer inside, each with and without a memory budget.

For every model, cap (``--cap-gib``) and variant (bench_whole_step.py's, the same whole step:
zero_grad, forward, backward, AdamW, ``loss.item()``), a search over batch sizes: doubling from
``--start`` until a batch fails (halving if the first fails), then bisection until the gap is at
most 1/``--resolution`` of the largest batch that trains; ``--at B ...`` tries exactly those
batches instead. Each try runs in a FRESH SUBPROCESS (an out-of-memory error poisons a process's
allocator and Dynamo's caches), under ``torch.cuda.set_per_process_memory_fraction(cap / total)``
and ``--try-timeout`` seconds, and records:

    trained    every one of the --warmup + --steps steps ran and its loss is finite
    graphed    whether it replayed as CUDA graphs: apollo's runners' summaries (apollo_compile.plans());
               reduce-overhead's CUDA-graph trees recorded and Inductor's cudagraph_skips counter
    memory     the peaks allocated and reserved over the whole try (compile, capture, steps, from a
               reset before the model's copy) and over the timed steps
    time       the timed steps' median (each from an idle GPU) and samples per second

A batch fits when it trained. Results, after every try: ``<out>/large_batch_results.json`` and
``.md``, each try's log under ``<out>/tries/``. Every try compiles afresh (about a minute for the
base models), so a device command of 10 minutes holds a few tries: split a run by ``--models``,
``--cap-gib`` and ``--variants``, start near the edge (``--start``) or name the batches (``--at``).
On the CPU no cap exists: the search runs with ``--max-batch`` as its bound (the tests' run).

    PYTHONPATH=. python benchmarks/bench_large_batch.py --models hf-clip --cap-gib 20 40 --variants inductor-ro apollo
    python benchmarks/bench_large_batch.py --device cpu --models hf-clip-tiny --variants apollo --start 2 \\
        --max-batch 4 --steps 1 --warmup 1 --apollo-options '{"subgraph_compiler": "eager"}'
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # common.py, bench_whole_step.py
sys.path.insert(1, str(HERE.parent))  # the repo root, for apollo_compile

import bench_whole_step as bws  # noqa: E402  (the models, the whole step and its variants)
import common  # noqa: E402  (the method every benchmark here shares)
from common import fmt, log  # noqa: E402

VARIANTS = ("inductor-ro", "apollo", "apollo-step-opt", "inductor-ro-amb", "apollo-budget", "apollo-step-opt-budget")
BASELINE = "inductor-ro"
DEFAULT_CAPS_GIB = (20.0, 40.0)


# --------------------------------------------------------------------------------------------
# the search


def search(fits: Callable[[int], bool], start: int, max_batch: int, resolution: int = 16) -> dict[str, Any]:
    """The largest batch in [1, max_batch] for which `fits` holds, assuming it holds below any batch
    it holds at: doubling from `start` until a batch fails (halving while the first fails), then
    bisection until ``smallest failing - largest <= max(1, largest // resolution)``. Each batch is
    tried once, in the order returned in ``tries``."""
    tried: dict[int, bool] = {}

    def attempt(b: int) -> bool:
        if b not in tried:
            tried[b] = bool(fits(b))
        return tried[b]

    lo: int | None = None
    hi: int | None = None
    b = max(1, min(start, max_batch))
    if attempt(b):
        lo = b
        while lo < max_batch:
            b = min(2 * lo, max_batch)
            if not attempt(b):
                hi = b
                break
            lo = b
    else:
        hi = b
        while hi > 1:
            b = hi // 2
            if attempt(b):
                lo = b
                break
            hi = b
    while lo is not None and hi is not None and hi - lo > max(1, lo // resolution):
        mid = (lo + hi) // 2
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    stop = ("nothing trains (batch 1 fails)" if lo is None else
            f"--max-batch {max_batch} trains" if hi is None else f"resolved to 1/{resolution}")
    return {"largest": lo, "smallest_failing": hi, "stop": stop, "tries": list(tried.items())}


def listed(fits: Callable[[int], bool], batches: list[int]) -> dict[str, Any]:
    """`search`'s result for exactly `batches`, tried in order (``--at``)."""
    tries = [(b, bool(fits(b))) for b in batches]
    ok = [b for b, passed in tries if passed]
    failing = [b for b, passed in tries if not passed and (not ok or b > max(ok))]
    return {"largest": max(ok) if ok else None, "smallest_failing": min(failing) if failing else None,
            "stop": "listed batches tried", "tries": tries}


# --------------------------------------------------------------------------------------------
# one try, in its own process


def cudagraph_trees(device: torch.device) -> int | None:
    """How many CUDA graphs reduce-overhead's trees recorded on `device` (None where this torch's
    tree manager does not say)."""
    try:
        from torch._inductor import cudagraph_trees as trees

        manager = trees.get_manager(device.index or 0, create_if_none_exists=False)
        if manager is None:
            return 0
        count, todo = 0, [n for nodes in manager.roots.values() for n in nodes]
        while todo:
            node = todo.pop()
            count += 1
            todo.extend(n for nodes in node.children.values() for n in nodes)
        return count
    except Exception:  # noqa: BLE001  (a private structure: absent or changed in another torch)
        return None


def graphed(variant: str, row: dict, device: torch.device) -> tuple[bool | None, list[str]]:
    """(whether the try replayed as CUDA graphs, why not / what was left un-graphed); None where the
    variant has no CUDA graphs (the CPU, eager, Inductor's default mode)."""
    if device.type != "cuda":
        return None, []
    if variant.startswith("apollo"):
        notes = []
        for plan in row.get("apollo") or ():
            for kind, g in plan["graphs"].items():
                cg = g.get("cuda_graph")
                if not cg:
                    notes.append(f"{plan['plan']} {kind}: no CUDA-graph runner: {g.get('fallback') or '?'}")
                elif cg.get("capture_refused"):
                    notes.append(f"{plan['plan']} {kind}: un-graphed by design: {cg['capture_refused']}")
                elif cg.get("disabled") or cg.get("ungraphed_calls") or not cg.get("replays"):
                    notes.append(f"{plan['plan']} {kind}: " + (cg.get("disabled") or
                                                               f"{cg.get('ungraphed_calls')} calls un-graphed, "
                                                               f"{cg.get('replays')} replays"))
        return (not notes) if row.get("apollo") else False, notes
    if variant.startswith("inductor-ro"):
        skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        recorded = cudagraph_trees(device)
        notes = [f"{skips} graphs skipped CUDA graphs"] if skips else []
        if recorded is not None:
            notes.append(f"{recorded} CUDA graphs recorded")
        return (skips == 0 and recorded != 0), notes
    return None, []


def one_try(args, device: torch.device) -> dict[str, Any]:
    """One model, variant, batch and cap (``--one-try``): --warmup + --steps whole steps of a fresh
    copy under the cap, the loss read every step."""
    (name,), (variant,), (batch_size,) = args.models, args.variants, args.at
    cap = args.cap_gib[0] if args.cap_gib else None
    rec: dict[str, Any] = {"model": name, "variant": variant, "batch": batch_size, "cap_gib": cap,
                           "steps_wanted": args.warmup + args.steps}
    base, shape = bws.build(name, args.seed)
    batch_cpu = bws.make_batch(shape, batch_size, torch.device("cpu"), args.seed)
    losses: list[float] = []

    def build() -> common.Trial:
        batch = tuple(t.to(device) for t in batch_cpu)  # in the whole run's peak
        trial = bws.trial(variant, name, base, batch, None, args, device)

        def step(read_loss: bool = True) -> float:
            losses.append(loss := trial.step(True))  # every step's loss, read: did it train
            return loss

        return common.Trial(step, keep=trial.keep)

    with common.memory_cap(device, cap):
        row = common.guarded(lambda: common.measure(
            variant, build, None, device, warmup=args.warmup, steps=args.steps, apollo=variant.startswith("apollo"),
            back_to_back=False, context=bws.runtime_for(variant, args.budget)), variant)
        if row["status"] != "ok":
            row["peak_alloc_all_gib"], row["peak_reserved_all_gib"] = common.read_peaks(device)
    rec["status"] = row["status"]
    rec["steps_run"] = len(losses)
    rec["trained"] = (row["status"] == "ok" and len(losses) == rec["steps_wanted"]
                      and all(math.isfinite(x) for x in losses))
    rec["graphed"], rec["graph_notes"] = graphed(variant, row, device) if row["status"] == "ok" else (None, [])
    for key in ("median_ms", "peak_alloc_gib", "peak_reserved_gib", "peak_alloc_all_gib", "peak_reserved_all_gib",
                "compile_s", "alloc_retries", "error", "warnings"):
        if key in row:
            rec[key] = row[key]
    if rec.get("median_ms"):
        rec["samples_per_s"] = batch_size / (rec["median_ms"] / 1e3)
    return rec


def try_in_subprocess(name: str, variant: str, batch: int, cap: float | None, args, out_dir: Path) -> dict[str, Any]:
    """`one_try` in a fresh Python process, within --try-timeout seconds; its log under out/tries/."""
    tries = out_dir / "tries"
    tries.mkdir(exist_ok=True)
    stem = f"{name}-{'nocap' if cap is None else f'{cap:g}GiB'}-{variant}-{batch}"
    result = tries / f"{stem}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one-try", str(result), "--models", name,
           "--variants", variant, "--at", str(batch), "--device", args.device, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--seed", str(args.seed), "--lr", str(args.lr), "--budget", str(args.budget),
           "--apollo-options", json.dumps(args.apollo_options), "--out", str(tries)]
    cmd += ["--cap-gib", str(cap)] if cap is not None else []
    cmd += [] if args.amp else ["--no-amp"]
    cmd += ["--no-compile-cache"] if args.no_compile_cache else []
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.try_timeout)
        output, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc = None
    (tries / f"{stem}.log").write_text(output)
    if rc is not None and result.exists():
        rec = json.loads(result.read_text())
    else:
        rec = {"model": name, "variant": variant, "batch": batch, "cap_gib": cap, "trained": False,
               "status": "timeout" if rc is None else f"exit {rc}",
               "error": f"no result within {args.try_timeout} s" if rc is None else output.strip()[-400:]}
    rec["wall_s"] = time.perf_counter() - t0
    return rec


# --------------------------------------------------------------------------------------------
# reporting


HEADER = ["model", "cap GiB", "variant", "largest that trains", "smallest failing", "graphed there", "step ms there",
          "samples/s there", f"vs {BASELINE} (batch)", "whole-run peak GiB", "whole-run reserved GiB",
          "steps' reserved GiB", "tries", "note"]


def markdown_table(searches: list[dict]) -> str:
    rows = []
    for s in searches:
        at = next((t for t in s["records"] if t["batch"] == s.get("largest") and t.get("trained")), {})
        base = next((b for b in searches if b["variant"] == BASELINE and b["model"] == s["model"]
                     and b["cap_gib"] == s["cap_gib"]), None)
        ratio = s["largest"] / base["largest"] if base and base.get("largest") and s.get("largest") else None
        failures = sorted({t["status"] for t in s["records"] if not t.get("trained")})
        note = s.get("stop", "in progress") + (f"; failures: {', '.join(failures)}" if failures else "")
        if (at.get("alloc_retries") or {}).get("timed"):
            note += f"; allocator retries in the timed steps: {at['alloc_retries']['timed']}"
        if at.get("graph_notes") and at.get("graphed") is False:
            note += "; " + "; ".join(at["graph_notes"])[:200]
        graph = {True: "yes", False: "no", None: "-"}[at.get("graphed")] if at else "-"
        rows.append([s["model"], fmt(s["cap_gib"], "g") if s["cap_gib"] else "none", s["variant"],
                     fmt(s.get("largest"), "d"), fmt(s.get("smallest_failing"), "d"), graph,
                     fmt(at.get("median_ms"), ".2f"), fmt(at.get("samples_per_s"), ".0f"), fmt(ratio, ".2f", "x"),
                     fmt(at.get("peak_alloc_all_gib"), ".2f"), fmt(at.get("peak_reserved_all_gib"), ".2f"),
                     fmt(at.get("peak_reserved_gib"), ".2f"), str(len(s["records"])), note.replace("|", "/")])
    return common.markdown(HEADER, rows)


def report(env: dict, searches: list[dict], out_dir: Path) -> str:
    head = [
        f"# largest batch that trains: {', '.join(env['models'])}",
        "",
        common.header_line(env),
        f"Each try in a fresh process: compile + {env['warmup']} warm-up + {env['steps']} timed steps of the whole "
        f"step (AdamW, loss.item()), the allocator capped; a batch fits when every step trained. Batches tried: "
        f"{env['batches']}. Memory at the largest batch: whole run from before the compile, and the timed steps'; "
        f"vs {BASELINE}: the largest batch over {BASELINE}'s; budget {env['budget']:g}.",
    ]
    return common.write_results(out_dir, "large_batch", env, head, [markdown_table(searches)], searches=searches)


# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["hf-clip", "hf-siglip"], type=bws.model_name, metavar="MODEL")
    p.add_argument("--cap-gib", type=float, nargs="+", metavar="GIB",
                   help=f"allocator caps, one search each (CUDA; default {' '.join(map(str, DEFAULT_CAPS_GIB))})")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=bws.VARIANTS, metavar="VARIANT",
                   help=f"bench_whole_step.py's variants (default {' '.join(VARIANTS)})")
    p.add_argument("--start", type=int, default=64, help="the first batch tried (default 64)")
    p.add_argument("--max-batch", type=int, default=4096, help="the largest batch tried (default 4096)")
    p.add_argument("--resolution", type=int, default=16,
                   help="bisect until the gap is <= 1/RESOLUTION of the largest batch that trains (default 16)")
    p.add_argument("--at", type=int, nargs="+", metavar="B", help="try exactly these batches, in order (no search)")
    p.add_argument("--try-timeout", type=float, default=300.0, help="seconds a try may take (default 300)")
    p.add_argument("--one-try", metavar="RESULT_JSON", help=argparse.SUPPRESS)  # a try's own process
    bws.add_step_args(p)
    common.add_run_args(p, steps=5, warmup=3)
    args = common.parse_run_args(p, argv)
    if args.device == "cpu" and args.cap_gib:
        p.error("--cap-gib needs CUDA: the CPU has no allocator to cap")
    if args.device == "cuda" and not args.cap_gib:
        args.cap_gib = list(DEFAULT_CAPS_GIB)
    if args.cap_gib and min(args.cap_gib) <= 0:
        p.error("--cap-gib must be > 0")
    if min(args.start, args.max_batch, args.resolution, *(args.at or [1])) < 1 or args.try_timeout <= 0:
        p.error("--start, --max-batch, --resolution and --at must be >= 1, --try-timeout > 0")
    if args.one_try and (len(args.models), len(args.variants), len(args.at or ()), len(args.cap_gib or [0])) != (1,) * 4:
        p.error("--one-try takes one model, variant, batch (--at) and cap")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if (setup := common.device_and_out_dir(args)) is None:
        return 2
    device, out_dir = setup
    if args.one_try:
        rec = one_try(args, device)
        Path(args.one_try).write_text(json.dumps(rec, indent=1, default=str))
        log(json.dumps({k: v for k, v in rec.items() if k not in ("warnings",)}, default=str))
        return 0
    caps = args.cap_gib or [None]
    env = common.environment(device, models=args.models, caps_gib=caps, variants=args.variants, steps=args.steps,
                             warmup=args.warmup, budget=args.budget, apollo_options=args.apollo_options,
                             batches=f"exactly {args.at}" if args.at else
                             f"from {args.start} doubling, then bisecting to 1/{args.resolution}, at most {args.max_batch}",
                             amp="bf16 autocast" if args.amp else "fp32", try_timeout_s=args.try_timeout)
    log(common.header_line(env))
    log(f"models {args.models} | caps {caps} GiB | variants {args.variants} | out {out_dir}")
    searches: list[dict] = []
    for name in args.models:
        for cap in caps:
            for variant in args.variants:
                s: dict[str, Any] = {"model": name, "cap_gib": cap, "variant": variant, "records": []}
                searches.append(s)
                log(f"\n=== {name}, cap {cap} GiB, {variant}")

                def fits(batch: int) -> bool:
                    rec = try_in_subprocess(name, variant, batch, cap, args, out_dir)  # noqa: B023  (called here)
                    s["records"].append(rec)  # noqa: B023
                    log(f"  batch {batch}: {rec['status']}, trained {rec.get('trained')}, graphed {rec.get('graphed')}"
                        f", {fmt(rec.get('median_ms'), '.2f')} ms, whole run {fmt(rec.get('peak_alloc_all_gib'), '.2f')}"
                        f" GiB allocated / {fmt(rec.get('peak_reserved_all_gib'), '.2f')} reserved ({rec['wall_s']:.0f} s)"
                        + (f"; {rec['error']}" if rec.get("error") and not rec.get("trained") else ""))
                    report(env, searches, out_dir)
                    return rec["trained"]

                found = listed(fits, args.at) if args.at else search(fits, args.start, args.max_batch, args.resolution)
                s.update({k: v for k, v in found.items() if k != "tries"})
                report(env, searches, out_dir)
    text = report(env, searches, out_dir)
    log(f"\nwrote {out_dir / 'large_batch_results.json'} and {out_dir / 'large_batch_results.md'}\n")
    log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
