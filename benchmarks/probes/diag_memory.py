"""Diagnostic (device tool): where apollo's whole-run peak memory comes from, step by step.

Records the CUDA allocator's history over the first steps of a compiled CLIP (step 1 runs
un-graphed, step 2 measures the candidates and captures, step 3 replays) and prints, per phase,
the peak above the phase's start and what is alive at that peak, grouped by the allocating line.

    PYTHONPATH=. python benchmarks/probes/diag_memory.py --batch 64 --budget 0.05 --out $OUT/diag
    PYTHONPATH=. python benchmarks/probes/diag_memory.py --batch 1152 --limit-gib 20 --out $OUT/diag   # where it OOMs

With ``--limit-gib`` the allocator is capped as bench_memory.py's search caps it; an out-of-memory
error ends the run, and the trace up to it is summarized (the failing phase is named).

After each phase, and at an out-of-memory error, it also sums the allocator's segments per pool
(the default pool, each CUDA-graph pool): reserved, allocated, free, the largest free block. A
free block in a live graph pool serves only that pool's captures, and inside a capture the
allocator cannot release or remake segments, so a capture can run out with gigabytes free in
pieces too small for its next request (batch 1152: 4.19 GiB free, largest block 0.98 GiB).
"""
from __future__ import annotations

import argparse
import collections
import json
import linecache
import pathlib
import sys

import torch

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent),  # benchmarks/: common.py, clip.py, ...
                str(pathlib.Path(__file__).resolve().parent.parent.parent)]  # the repo root, for apollo_compile
import apollo_compile  # noqa: E402,F401  (registers the backend without an install)
import clip  # noqa: E402

MARK = 512 * 100_003  # marker allocations: unique sizes that bracket each phase in the trace


def mark(k: int) -> None:
    torch.empty(MARK + 512 * k, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()


def marker(e: dict, k: int) -> int | None:
    """The phase `e` opens, where it is the allocation of one of `mark`'s markers 0..k; else None."""
    d = e.get("size", 0) - MARK
    return d // 512 if e["action"] == "alloc" and d >= 0 and d % 512 == 0 and d // 512 <= k else None


def where(frames: list[dict]) -> str:
    for f in frames:
        fn = f["filename"]
        if "torchinductor" in fn or "apollo_compile" in fn or "benchmarks/" in fn:
            src = linecache.getline(fn, f["line"]).strip()[:90]
            short = fn.split("apollo_compile/")[-1] if "apollo_compile" in fn else fn.rsplit("/", 1)[-1]
            return f"{short}:{f['line']} {f['name']}: {src}"
    return "(torch) " + (f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['name']}" if frames else "?")


def summarize(trace: list[dict], phases: list[dict], k: int, header: str = "") -> tuple[list[dict], str]:
    """Per phase (bracketed by marker allocations 0..k): the peak of the running allocated bytes and
    what is alive at it, by allocating line and by file. Returns (report records, text)."""
    def is_marker(e):
        return marker(e, k) is not None

    # pass 1: each phase's peak (event index) of the running allocated bytes since recording began
    sizes: dict[int, int] = {}
    cur, phase_of, start, best = 0, None, {}, {}
    for i, e in enumerate(trace):
        if is_marker(e):
            phase_of = marker(e, k)
            start[phase_of] = cur
        elif e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            cur += e["size"]
            if phase_of is not None and cur > best.get(phase_of, (-1, 0))[0]:
                best[phase_of] = (cur, i)
        elif e["action"] == "free_completed" and e["addr"] in sizes:
            cur -= sizes.pop(e["addr"])

    def alive_at(index: int) -> list[dict]:
        live: dict[int, dict] = {}
        for e in trace[:index + 1]:
            if e["action"] == "alloc" and not is_marker(e):
                live[e["addr"]] = e
            elif e["action"] == "free_completed":
                live.pop(e["addr"], None)
        return list(live.values())

    lines = [header]
    report = []
    for ph in phases:
        m = ph["marker"]
        peak, index = best.get(m, (0, 0))
        groups = collections.Counter()
        counts = collections.Counter()
        files = collections.Counter()
        for blk in alive_at(index):
            key = where(blk.get("frames", []))
            groups[key] += blk["size"]
            counts[key] += 1
            files[key.split(":", 1)[0]] += blk["size"]  # one generated file per compiled (sub)graph
        top = groups.most_common(10)
        ph |= {"trace_peak_above_start_gib": (peak - start.get(m, 0)) / 2**30, "trace_peak_gib": peak / 2**30,
               "by_file": {f: b / 2**30 for f, b in files.most_common()},
               "top": [(g, b / 2**30, counts[g]) for g, b in groups.most_common(200)]}
        report.append(ph)
        lines.append(f"\n== {ph['phase']}: max_allocated {ph['max_allocated_gib']:.2f} GiB, after {ph['allocated_after_gib']:.2f}; "
                     f"recorded live at the phase's peak {peak / 2**30:.2f} GiB above the start of recording")
        lines.append("  by file: " + ", ".join(f"{f} {b / 2**30:.3f}" for f, b in files.most_common(6)))
        for g, b in top:
            lines.append(f"  {b / 2**30:6.3f} GiB x{counts[g]:<4d} {g}")
    return report, "\n".join(lines)


def reserved_peak(trace: list[dict], phases: list[dict], k: int, segments: list[dict]) -> str:
    """Reserved memory (the allocator's segments) over the recorded run: at each phase's start
    (marker 0..k) and its highest, the run's highest and the segments held there, by the line whose
    allocation made each segment and by the pool that still holds it after the run (from the final
    snapshot's `segments`; "released later" where it went back to the driver before the end, "?"
    where the final snapshot does not know its address).
    The peak reserved is what a process holds at its worst (what nvidia-smi shows), the benchmarks'
    reserved column."""
    pool_of = {seg["address"]: ("default" if tuple(seg.get("segment_pool_id") or (0, 0)) == (0, 0)
                                else "graph pool {}.{}".format(*seg["segment_pool_id"])) for seg in segments}
    grow, shrink = ("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")
    cur, phase, start, opened, best, overall = 0, None, {}, {}, {}, (-1, 0)
    for i, e in enumerate(trace):
        if (m := marker(e, k)) is not None:
            phase = m
            start[phase], opened[phase] = cur, i
        if e["action"] in grow:
            cur += e["size"]
            if phase is not None and cur > best.get(phase, (-1, 0))[0]:
                best[phase] = (cur, i)
            if cur > overall[0]:
                overall = (cur, i)
        elif e["action"] in shrink:
            cur -= e["size"]
    names = {ph["marker"]: ph["phase"] for ph in phases}
    lines = ["\n== reserved (segments made since recording began), per phase: start -> highest GiB"]
    for m in sorted(start):
        lines.append(f"  {names.get(m, f'marker {m}')}: {start[m] / 2**30:.3f} -> {best.get(m, (start[m], 0))[0] / 2**30:.3f}")
    peak, index = overall
    live: dict[int, dict] = {}
    for e in trace[:index + 1]:
        if e["action"] in grow:
            live[e["addr"]] = e
        elif e["action"] in shrink:
            live.pop(e["addr"], None)
    in_phase = max((m for m, i in opened.items() if i <= index), default=None)
    freed_later = {e["addr"] for e in trace[index + 1:] if e["action"] in shrink}  # its address may be remade
    lines.append(f"  highest: {peak / 2**30:.3f} GiB, in {names.get(in_phase, in_phase)}; segments held there, by the "
                 f"line that made them and the pool that holds them after the run:")
    groups, counts, by_stream = collections.Counter(), collections.Counter(), collections.Counter()
    streams = {e.get("stream") for e in live.values()}  # a pool captured on lanes: a high-water mark per stream
    for e in live.values():
        pool = "released later" if e["addr"] in freed_later else pool_of.get(e["addr"], "?")
        stream = f", stream {e.get('stream')}" if len(streams) > 1 else ""
        key = f"[{pool}{stream}] {where(e.get('frames', []))}"
        groups[key] += e["size"]
        counts[key] += 1
        by_stream[e.get("stream")] += e["size"]
    if len(streams) > 1:
        lines.append("    by stream: " + ", ".join(f"{k}: {b / 2**30:.3f} GiB" for k, b in by_stream.most_common()))
    lines += [f"    {b / 2**30:6.3f} GiB x{counts[g]:<4d} {g}" for g, b in groups.most_common(24)]
    return "\n".join(lines)


def pools(segments: list[dict]) -> dict[str, dict]:
    """Per allocator pool (the default one, each CUDA-graph pool): segments, reserved, allocated and
    free bytes, the largest free block, and the free bytes in blocks under 512 MiB, which no request
    of that size or more can use (inside a capture the allocator cannot release a live pool's
    segments to make a larger one). Also per stream that made the segments (`by_stream`: the stream's
    handle -> reserved and allocated bytes): the allocator hands a freed block only to an allocation
    on the stream that made it, so a pool captured on lanes is one high-water mark per stream
    (RESULTS.md); `small` is the part in the small pool's 2 MiB segments, whose blocks
    (1 MiB and under) no larger request can use."""
    out: dict[str, dict] = {}
    for seg in segments:
        key = str(tuple(seg.get("segment_pool_id") or (0, 0)))
        d = out.setdefault(key, {"segments": 0, "reserved": 0, "allocated": 0, "free": 0, "largest_free": 0,
                                 "free_in_blocks_under_512MiB": 0, "segment_sizes_MiB": [], "by_stream": {}})
        d["segments"] += 1
        d["reserved"] += seg["total_size"]
        d["allocated"] += seg["allocated_size"]
        per = d["by_stream"].setdefault(seg.get("stream", "?"), {"reserved": 0, "allocated": 0, "small": 0})
        per["reserved"] += seg["total_size"]
        per["allocated"] += seg["allocated_size"]
        if seg.get("segment_type") == "small":
            per["small"] += seg["total_size"]
        d["segment_sizes_MiB"].append(seg["total_size"] >> 20)
        for b in seg["blocks"]:
            if b["state"] == "inactive":
                d["free"] += b["size"]
                d["largest_free"] = max(d["largest_free"], b["size"])
                if b["size"] < 512 << 20:
                    d["free_in_blocks_under_512MiB"] += b["size"]
    return out


def pools_text(title: str, summary: dict[str, dict]) -> str:
    lines = [f"\n== pools {title}"]
    for key, d in summary.items():
        sizes = sorted(d["segment_sizes_MiB"], reverse=True)
        lines.append(f"  pool {key}: {d['segments']} segments, reserved {d['reserved'] / 2**30:.2f} GiB, allocated "
                     f"{d['allocated'] / 2**30:.2f}, free {d['free'] / 2**30:.2f} (largest free block "
                     f"{d['largest_free'] / 2**30:.3f}, in blocks under 512 MiB "
                     f"{d['free_in_blocks_under_512MiB'] / 2**30:.2f}); largest segments MiB {sizes[:12]}")
        streams = sorted(d.get("by_stream", {}).items(), key=lambda kv: -kv[1]["reserved"])
        if len(streams) > 1:
            lines.append("    by stream (reserved/allocated GiB, of it in small segments): " + ", ".join(
                f"{stream}: {v['reserved'] / 2**30:.2f}/{v['allocated'] / 2**30:.2f} "
                f"({v.get('small', 0) / 2**30:.2f})" for stream, v in streams))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--budget", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="diag_memory")
    p.add_argument("--limit-gib", type=float, default=0.0, help="cap the allocator at this many GiB (0: no cap)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("diag_memory.py reads the CUDA allocator's history: it needs a CUDA device")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = clip.build("base", device="cuda")
    images, tokens = clip.make_batch(args.batch, device="cuda")
    opts = {"precision": "bf16"} | ({"memory_budget": args.budget} if args.budget < 1 else {})
    step_fn = torch.compile(model, backend="apollo", options=opts, dynamic=False)
    base = torch.cuda.memory_allocated()
    if args.limit_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.limit_gib * 2**30 / total))
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=3_000_000)
    phases, k, oom = [], 0, None
    pool_states: list[tuple[str, dict]] = []  # (when, pools()) after each phase and at an out-of-memory error
    for s in range(1, args.steps + 1):
        model.zero_grad(set_to_none=True)
        for name in ("forward", "backward"):
            mark(k)
            torch.cuda.reset_peak_memory_stats()
            try:
                if name == "forward":
                    loss = step_fn(images, tokens)
                else:
                    loss.backward()
                    del loss
            except torch.OutOfMemoryError as e:
                oom = str(e).split("\n")[0][:400]
                pool_states.append(("at the out-of-memory error", pools(torch.cuda.memory_snapshot())))
            torch.cuda.synchronize()
            phases.append({"phase": f"step {s} {name}" + (" (out of memory)" if oom else ""), "marker": k,
                           "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                           "allocated_after_gib": torch.cuda.memory_allocated() / 2**30, "oom": oom})
            if not oom:
                pool_states.append((f"after step {s} {name}", pools(torch.cuda.memory_snapshot())))
            k += 1
            if oom:
                break
        if oom:
            break
    torch.cuda.empty_cache()  # room for the closing marker after an out-of-memory error
    mark(k)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    report, text = summarize(trace, phases, k, header=(
        f"torch {torch.__version__}, batch {args.batch}, options {opts}; allocated before the first step "
        f"{base / 2**30:.2f} GiB (parameters); trace {len(trace)} events"
        + (f"; capped at {args.limit_gib:g} GiB" if args.limit_gib else "")
        + (f"\nout of memory: {oom}" if oom else "")))
    text += "".join(pools_text(when, summary) for when, summary in pool_states)
    (out / "diag_memory.json").write_text(json.dumps({"phases": report, "pools": pool_states}, indent=1))
    (out / "diag_memory.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
