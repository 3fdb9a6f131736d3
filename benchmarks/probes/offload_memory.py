"""Diagnostic (device tool): where a step's GPU memory peaks, forward or backward, with and without
``offload_activations``, against eager per-block checkpointing with ``save_on_cpu``.

In 20 GiB, apollo at budget 0.05 with offloading trains a smaller batch than eager per-block
checkpointing with save_on_cpu (RESULTS.md, "Largest batch within 20 GiB: offloading"), though
both keep the same block inputs on the host. This splits one step of each variant (after a warm-up step that compiles) into
its forward and its backward: the peak allocated in each (peak stats reset between them) and what
the forward leaves allocated for the backward. With ``--code-dir`` it also copies the Inductor
wrappers compiled in this process that copy to or from the host, to show where Inductor placed
each copy among the kernels. ``--snapshot VARIANT ...`` records the
measured step's allocations (``torch.cuda.memory._record_memory_history``) and lists the largest
ones live at the step's peak, each with the wrapper line that made it: what the backward holds.

    PYTHONPATH=. python benchmarks/probes/offload_memory.py --batch 512 --code-dir "$OUT/code" \\
        --snapshot eager-bf16-ckpt-offload apollo-bf16-budget-0.05-offload
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import pathlib
import sys
import time

import torch
import torch._inductor.config

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent),  # benchmarks/: common.py, clip.py, ...
                str(pathlib.Path(__file__).resolve().parent.parent.parent)]  # the repo root, for apollo_compile
import apollo_compile  # noqa: E402,F401  (registers the backend without an install)
import bench_memory  # noqa: E402
import clip  # noqa: E402
import common  # noqa: E402

GiB = common.GiB
VARIANTS = ["eager-bf16-ckpt-offload", "apollo-bf16-budget-0.05", "apollo-bf16-budget-0.05-offload"]


def phases(spec, base, batch, device, snapshot: bool = False) -> dict:
    """One warm-up step, then one step measured phase by phase (GiB). apollo runs un-graphed, as
    it does with offloading: a CUDA-graph replay allocates nothing the allocator counts. With
    `snapshot`, the measured step's allocations are recorded and their peak itemised."""
    if spec.compiler == "apollo":
        spec = dataclasses.replace(spec, options={**spec.options, "cudagraphs": False})
    model = copy.deepcopy(base).to(device)
    with spec.context():
        step_fn = spec.prepare(model)
        common.train_step(model, step_fn, batch, device, spec.autocast)
        common.synchronize(device)
        model.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        if snapshot:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        with common.autocast(device, spec.autocast):
            loss = step_fn(*batch)
        common.synchronize(device)
        fw_peak, after_fw = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        common.synchronize(device)
        bw_peak = torch.cuda.max_memory_allocated()
        record = {}
        if snapshot:
            trace = torch.cuda.memory._snapshot()["device_traces"][0]
            torch.cuda.memory._record_memory_history(enabled=None)
            traced_peak, largest, sizes = peak_allocations(trace)
            record = {"traced_peak_above_before": traced_peak / GiB, "largest_at_peak": largest,
                      "sizes_at_peak": sizes}
    del model, step_fn, loss
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return {"before": start / GiB, "forward_peak": fw_peak / GiB, "after_forward": after_fw / GiB,
            "backward_peak": bw_peak / GiB, **record}


def peak_allocations(entries: list[dict], top: int = 40) -> tuple[int, list[dict], list[dict]]:
    """From a memory-history trace (``torch.cuda.memory._snapshot()["device_traces"][0]``): the most
    bytes its allocations held at once (on top of what was live when recording began), and the
    `top` largest of the allocations live at that moment, each with where it was made (the first
    two Python frames outside torch itself: an Inductor wrapper's line names the buffer; the C++
    frames the recorder also keeps come first and say nothing), and all of them by size."""
    live: dict[int, dict] = {}
    cur, best, at_best = 0, 0, {}
    for e in entries:
        if e.get("action") == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, at_best = cur, dict(live)
        elif e.get("action") == "free_completed" and live.pop(e["addr"], None) is not None:
            cur -= e["size"]
    largest = sorted(at_best.values(), key=lambda e: -e["size"])[:top]

    def where(e: dict) -> list[str]:
        python = [f for f in e.get("frames", ()) if f["filename"].endswith(".py") and "/torch/" not in f["filename"]]
        return [f"{f['filename']}:{f['line']} {f['name']}" for f in python[:2]]

    return best, [{"gib": e["size"] / GiB, "where": where(e)} for e in largest], sizes_at(at_best.values())


def sizes_at(allocations) -> list[dict]:
    """Live allocations grouped by size, most bytes first: two variants' lists side by side show
    which buffer one holds that the other does not (apollo's offloading backward against eager +
    save_on_cpu's, say)."""
    counts = collections.Counter(e["size"] for e in allocations)
    return [{"bytes": size, "count": n, "gib": size * n / GiB}
            for size, n in sorted(counts.items(), key=lambda kv: -kv[0] * kv[1])]


def host_copy_wrappers(root: str, since: float, out_dir: pathlib.Path) -> list[str]:
    """Copy each Inductor wrapper written after `since` that moves data between host and device (a
    ``.copy_(`` line in its ``call``) to `out_dir`, whole, so that the snapshot's line numbers
    (``--snapshot``) point into the copy; return the file names. (A ``call`` copied alone
    would leave the offset to find by hand.)"""
    out_dir.mkdir(parents=True, exist_ok=True)
    kept = []
    for path in pathlib.Path(root).rglob("*.py"):
        if path.stat().st_mtime < since:
            continue
        text = path.read_text(errors="replace")
        if "def call(" not in text or ".copy_(" not in text[text.index("def call("):]:
            continue
        (out_dir / path.name).write_text(text[:8_000_000])  # the device tool returns 16 MiB a file
        kept.append(path.name)
    return kept


def inductor_setting(text: str) -> tuple[str, object]:
    """``allow_buffer_reuse=False`` -> ("allow_buffer_reuse", False): a literal, else the string."""
    import ast

    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--config", default="base", choices=sorted(clip.CONFIGS))
    p.add_argument("--variants", nargs="+", default=VARIANTS, type=bench_memory.variant_name)
    p.add_argument("--snapshot", nargs="*", default=[], type=bench_memory.variant_name,
                   help="record these variants' measured step and list what is live at its peak")
    p.add_argument("--inductor-config", nargs="*", default=[], metavar="KEY=VALUE", type=inductor_setting,
                   help="run every variant under these Inductor settings (e.g. allow_buffer_reuse=False); "
                        "apollo's own (runtime/subgraphs.inductor_config) win for the keys they set: with a "
                        "memory budget allow_buffer_reuse is False, with offloading reorder_for_peak_memory too")
    p.add_argument("--code-dir", default=None, help="copy the host-copying Inductor wrappers here")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA: the question is GPU memory", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    since = time.time()
    base = clip.build(args.config)
    batch = clip.make_batch(args.batch, device, args.config)
    rows = {}
    settings = dict(args.inductor_config)
    for name in args.variants:
        try:
            with torch._inductor.config.patch(**settings):
                rows[name] = phases(bench_memory.VARIANTS[name], base, batch, device, snapshot=name in args.snapshot)
        except Exception as e:  # noqa: BLE001 - report and go on to the next variant
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, json.dumps({k: v for k, v in rows[name].items() if not k.endswith("_at_peak")}), flush=True)
        if "largest_at_peak" in rows[name]:  # printed as it comes: a run cut short still tells
            print(f"  {rows[name]['traced_peak_above_before']:.2f} GiB allocated in the step at its peak; the largest:")
            for a in rows[name]["largest_at_peak"][:12]:  # all `top` of them in --out
                print(f"  {a['gib']:.3f} GiB  {' <- '.join(a['where'])}", flush=True)
            print("  by size: " + ", ".join(f"{s['count']} x {s['bytes']} B" for s in rows[name]["sizes_at_peak"][:16]))
    if args.code_dir:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        root = cache_dir()
        print("wrappers that copy to or from the host:", host_copy_wrappers(root, since, pathlib.Path(args.code_dir)))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"batch": args.batch, "rows": rows}, indent=1))
    print(f"\nbatch {args.batch} ({args.config}), GiB allocated" + (f", Inductor {settings}" if settings else ""))
    print("| variant | before | forward peak | after forward | backward peak |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        cells = [r.get("error", "")] if "error" in r else [
            f"{r[k]:.2f}" for k in ("before", "forward_peak", "after_forward", "backward_peak")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
