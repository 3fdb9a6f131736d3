"""How long the host holds each half of a training step, without a profiler in the way.

profile_step.py's trace inflates host work (the profiler instruments every op, and CUPTI every
kernel a CUDA graph launches: a ``cudaGraphLaunch`` read 1.3-5 ms there and 0.09 ms here). This
times, per variant, at one batch size, the median over ``--steps`` steps of:

- ``fw host`` / ``bw host``: wall time of the forward call and of ``loss.backward()`` (the host
  returns before the GPU is done, unless something in the call waits for it);
- ``latency``: the step from an idle GPU (CUDA events), as bench_step.py reports it;
- ``fw idle`` / ``bw idle``: each half's GPU span (events) when the GPU is idle at its start,
  and ``bw host idle``: the backward call's host time then. The end event is queued when the call
  returns, so ``bw host idle`` close to ``bw idle`` means the host, not the GPU, set the span
  (more host work, or a wait for the GPU inside the call);
- for apollo variants, where the host time goes around each launch (``prelaunch``: zero_grad,
  the framework before apollo's runner, apollo's checks before the launch, the rest), and the
  runner's own account of each replayed call's host time and of its
  launch alone (``summary()["replay_host_ms"]``, ``["launch_host_ms"]``), and the host time of
  one ``CUDAGraph.replay()`` of each graph, replayed in the order training uses (forward, then
  backward: the backward overwrites the saved activations it took over, so a second backward
  replay in a row would read garbage).

With ``--sync-debug``, one more step per variant runs under ``torch.cuda.set_sync_debug_mode``,
and every CUDA call that makes the host wait for the GPU is printed with the Python stack that
made it.

With ``--b2b-profile``, ``--steps`` steps per variant also run back to back (no synchronize
between them, as bench_step's back-to-back rounds: at batch 8 the host, 5.8-7.5 ms per step, set
the pace there, above apollo's GPU work): the host ms per step, the
garbage collections in them (count, ms), then the same steps under cProfile, its top functions
by own time. cProfile slows Python calls, so read the shares, not the absolute times.

    PYTHONPATH=. python benchmarks/probes/host_split.py --batch 8 --variants inductor-ro apollo-1lane apollo
    PYTHONPATH=. python benchmarks/probes/host_split.py --batch 8 --variants apollo --sync-debug
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent),  # benchmarks/: common.py, clip.py, ...
                str(Path(__file__).resolve().parent.parent.parent)]  # the repo root, for apollo_compile
import bench_step  # noqa: E402  (its variants)
import clip  # noqa: E402
import common  # noqa: E402  (the train step, the back-to-back timing)

import apollo_compile  # noqa: E402

COLUMNS = ("fw host", "bw host", "latency", "fw idle", "bw idle", "bw host idle")


def forward(f, model, batch) -> torch.Tensor:
    """The step's first half, as common.train_step runs it: zero_grad, forward under bf16 autocast."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return f(*batch)


def split(f, model, batch, steps: int) -> dict[str, float]:
    rows: dict[str, list[float]] = {k: [] for k in COLUMNS}
    e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    for _ in range(steps):
        torch.cuda.synchronize()
        e0.record()
        t0 = time.perf_counter()
        loss = forward(f, model, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        e2.record()
        torch.cuda.synchronize()
        rows["fw host"].append((t1 - t0) * 1e3)
        rows["bw host"].append((t2 - t1) * 1e3)
        rows["latency"].append(e0.elapsed_time(e2))
        e0.record()  # again, the GPU idle before each half
        loss = forward(f, model, batch)
        e1.record()
        torch.cuda.synchronize()
        rows["fw idle"].append(e0.elapsed_time(e1))
        e1.record()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        e2.record()
        torch.cuda.synchronize()
        rows["bw idle"].append(e1.elapsed_time(e2))
        rows["bw host idle"].append((t2 - t1) * 1e3)
    return {k: statistics.median(v) for k, v in rows.items()}


STAMPS = ("zero_grad", "fw to runner", "fw to launch", "fw after launch", "bw to runner", "bw to launch",
          "bw after launch")


def prelaunch(model, f, batch, steps: int) -> dict[str, float]:
    """Medians over `steps` of where an apollo step's host time goes around each graph launch:
    ``zero_grad``; from the call (forward, ``loss.backward()``) to apollo's runner (Dynamo,
    AOTAutograd, autograd: the framework) and from there to the launch (apollo's checks and input
    copies); the rest of the call. With the GPU idle at the step's start, everything before the
    forward's launch is exposed in the step's latency."""
    from apollo_compile.runtime.cudagraph import CudaGraphRunner

    plan = apollo_compile.last_plan()
    at: dict[str, float] = {}
    runner_call = CudaGraphRunner.__call__

    def call(self, args):
        at[f"{self.kind} entry"] = time.perf_counter()
        return runner_call(self, args)

    def stamped(replay, kind: str):
        def replay_and_stamp():
            at[f"{kind} launch"] = time.perf_counter()
            return replay()
        return replay_and_stamp

    for kind in ("forward", "backward"):
        graph = plan.graphs[kind].runner.graph
        graph.replay = stamped(graph.replay, kind)  # an instance attribute: `del` below restores the method
    rows: dict[str, list[float]] = {k: [] for k in STAMPS}
    CudaGraphRunner.__call__ = call
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = f(*batch)
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            for name, value in zip(STAMPS, (t1 - t0, at["forward entry"] - t1, at["forward launch"] - at["forward entry"],
                                            t2 - at["forward launch"], at["backward entry"] - t2,
                                            at["backward launch"] - at["backward entry"], t3 - at["backward launch"])):
                rows[name].append(value * 1e3)
    finally:
        CudaGraphRunner.__call__ = runner_call
        for kind in ("forward", "backward"):
            del plan.graphs[kind].runner.graph.replay
    torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in rows.items()}


def report_syncs(f, model, batch) -> int:
    """One step under sync debug mode: print each synchronizing call with its Python stack."""
    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        # other warnings of the step are not the question, nor the mode's own "prototype" notice
        if "synchroniz" not in str(message) or "prototype feature" in str(message):
            return
        seen.append(message)
        print(f"  sync: {message}\n" + "".join(traceback.format_stack(limit=14)[:-2]), flush=True)

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            common.train_step(model, f, batch, torch.device("cuda"), True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return len(seen)


def b2b_profile(f, model, batch, steps: int, top: int = 25) -> str:
    """Where the host's time goes in steps queued back to back (see the module docstring)."""
    import cProfile
    import gc
    import io
    import pstats

    collections: list[float] = []
    started: list[float] = []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            collections.append((time.perf_counter() - started.pop()) * 1e3)

    device = batch[0].device

    def step():
        common.train_step(model, f, batch, device, True)

    gc.callbacks.append(on_gc)
    try:
        host_ms = common.time_back_to_back(step, steps, device, rounds=1)["host_ms"]
    finally:
        gc.callbacks.remove(on_gc)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    common.synchronize(device)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return (f"host {host_ms:.2f} ms per step back to back; {len(collections)} garbage collections in "
            f"{steps} steps, {sum(collections):.2f} ms in all (longest {max(collections, default=0):.2f})\n"
            + out.getvalue())


def replay_host_ms(replays: int = 20) -> str:
    plan = apollo_compile.last_plan()
    times: dict[str, list[float]] = {"forward": [], "backward": []}
    for _ in range(replays):
        for kind in times:  # forward then backward, as training replays them
            graph = plan.graphs[kind].runner.graph
            torch.cuda.synchronize()
            t = time.perf_counter()
            graph.replay()
            times[kind].append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return ", ".join(f"{kind} {statistics.median(v):.3f}" for kind, v in times.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=["inductor-ro", "apollo-1lane", "apollo"],
                   choices=bench_step.VARIANTS)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--sync-debug", action="store_true", help="print what makes the host wait for the GPU")
    p.add_argument("--b2b-profile", action="store_true",
                   help="also profile the host in steps queued back to back (garbage collections, cProfile)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_split.py needs CUDA")
        return 2
    lines = [f"| variant | {' | '.join(COLUMNS)} | replay() host ms |", "|---" * (len(COLUMNS) + 2) + "|"]
    around = [f"| variant | {' | '.join(STAMPS)} |", "|---" * (len(STAMPS) + 1) + "|"]
    for name in args.variants:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = clip.build("base", device="cuda")
        batch = clip.make_batch(args.batch, "cuda", "base", seed=1)
        f = bench_step.compile_variant(name, model)
        for _ in range(args.warmup):
            common.train_step(model, f, batch, torch.device("cuda"), True)
        row = split(f, model, batch, args.steps)
        if args.sync_debug:
            print(f"{name}: {report_syncs(f, model, batch)} synchronizing call(s) in one step", flush=True)
        replays = ""
        if name.startswith("apollo"):  # the runner's own account: host ms per replayed call, launch alone
            plan = apollo_compile.last_plan()
            for kind in ("forward", "backward"):
                summary = plan.graphs[kind].runner.summary()
                print(f"  {name} {kind}: replayed call {summary['replay_host_ms']} ms on the host, "
                      f"its launch {summary['launch_host_ms']} ms", flush=True)
            replays = replay_host_ms()
            host = prelaunch(model, f, batch, args.steps)
            around.append(f"| {name} | " + " | ".join(f"{host[k]:.3f}" for k in STAMPS) + " |")
            print(around[-1], flush=True)
        if args.b2b_profile:
            print(f"\n{name}, back to back:\n{b2b_profile(f, model, batch, args.steps)}", flush=True)
        lines.append(f"| {name} | " + " | ".join(f"{row[k]:.2f}" for k in COLUMNS) + f" | {replays} |")
        print(lines[-1], flush=True)
        del f, model
    print(f"\nbatch {args.batch}, medians of {args.steps} steps, ms\n" + "\n".join(lines))
    if len(around) > 2:
        print("\nhost ms around each launch (prelaunch())\n" + "\n".join(around))
    return 0


if __name__ == "__main__":
    sys.exit(main())
