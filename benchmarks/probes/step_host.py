"""Where a whole step's host time goes before its CUDA graph starts (compile_step with the
optimizer inside runs faster back to back than with the loss read every step: RESULTS.md).

Per variant of ``bench_whole_step.py`` (``apollo-step-opt``, ``apollo-step``, ``inductor-ro-step``; the
module-compiled ones too: ``apollo``, ``inductor-ro``, ``apollo-no-first-step-pool``),
after ``--warmup`` steps, the median over ``--steps`` steps each from an idle GPU of:

- ``to launch``: host ms from the step's start (``optimizer.zero_grad``, as the benchmark's loop)
  to the start of the first ``CUDAGraph.replay()`` of the step;
- ``launch``: that replay call's host ms;
- ``after``: host ms from the replay's return to the step's return (the optimizer outside, the
  outputs handed back);
- ``step``: the step from an idle GPU to ``loss.item()`` (CUDA events), as the benchmark's median;
- ``gpu from replay``: from a CUDA event recorded just before the step's first replay to the
  step's end: the graph's own time from an idle GPU (``step`` minus it is the host's time before
  the GPU starts the graph, as the GPU sees it);
- with ``--skip-guards-too``, the same steps again under ``torch.compiler.set_stance(
  skip_guard_eval_unsafe=True)``: what Dynamo's guard checks cost of the host's time (measured
  only; training under that stance would run a stale graph after a change it no longer checks);
- then the same steps under cProfile: the top functions by own time (cProfile slows Python calls:
  read the shares, not the times).

    PYTHONPATH=. python benchmarks/probes/step_host.py --models hf-clip --batch 8
    python benchmarks/probes/step_host.py --device cpu --models hf-clip-tiny --batch 2 --steps 3 --warmup 2 \\
        --variants apollo-step-opt --apollo-options '{"subgraph_compiler": "eager"}'
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent),  # benchmarks/: common.py, bench_whole_step.py
                str(Path(__file__).resolve().parent.parent.parent)]  # the repo root, for apollo_compile
import bench_whole_step as bws  # noqa: E402  (its models and whole-step variants)
import common  # noqa: E402


class ReplayStamps:
    """Host times of every ``torch.cuda.CUDAGraph.replay()`` call, while installed."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []
        self.original = None
        self.first_event = None  # a CUDA event recorded just before the first replay of a step

    def __enter__(self) -> "ReplayStamps":
        if torch.cuda.is_available():
            self.original = torch.cuda.CUDAGraph.replay
            original, calls = self.original, self.calls

            def replay(graph):
                start = time.perf_counter()
                if not calls:  # where the GPU reaches the step's first replay, on the replaying stream
                    self.first_event = torch.cuda.Event(enable_timing=True)
                    self.first_event.record()
                original(graph)
                calls.append((start, time.perf_counter()))

            torch.cuda.CUDAGraph.replay = replay
        return self

    def __exit__(self, *exc) -> None:
        if self.original is not None:
            torch.cuda.CUDAGraph.replay = self.original


def training_step(variant: str, name: str, base, batch, args, device) -> tuple:
    """(step, what it holds: the compiled step, model and optimizer) for one `variant` of
    ``bench_whole_step.py``: zero_grad, the compiled step, AdamW's step unless it is inside."""
    model = copy.deepcopy(base).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True if device.type == "cuda" else None)
    compiled, f = bws.compiled_loss(variant, name, model, device, args, optimizer)
    forward_backward = bws.with_backward(f, device, args.amp)
    inside = bws.updates_inside(variant)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(*batch)
        if not inside:
            optimizer.step()
        return loss

    return step, (compiled, model, optimizer)


def timed(step, args, device) -> dict[str, list[float]]:
    """The host and GPU times of `args.steps` steps, each from an idle GPU (the module docstring)."""
    rows: dict[str, list[float]] = {"to launch": [], "launch": [], "after": [], "step": [], "gpu from replay": []}
    with ReplayStamps() as stamps:
        for _ in range(args.steps):
            common.synchronize(device)
            stamps.calls.clear()
            start_event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
            end_event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
            if start_event is not None:
                start_event.record()
            t0 = time.perf_counter()
            loss = step()
            t1 = time.perf_counter()
            if end_event is not None:
                end_event.record()
            loss.item()
            if stamps.calls:
                first, last = stamps.calls[0], stamps.calls[-1]
                rows["to launch"].append(1e3 * (first[0] - t0))
                rows["launch"].append(1e3 * (first[1] - first[0]))
                rows["after"].append(1e3 * (t1 - last[1]))
            rows["step"].append(start_event.elapsed_time(end_event) if start_event is not None else 1e3 * (t1 - t0))
            if stamps.first_event is not None and end_event is not None:
                rows["gpu from replay"].append(stamps.first_event.elapsed_time(end_event))
                stamps.first_event = None
    return rows


def run(variant: str, name: str, base, batch, args, device) -> dict:
    step, held = training_step(variant, name, base, batch, args, device)
    for _ in range(args.warmup):
        step().item()
    out = {k: statistics.median(v) for k, v in timed(step, args, device).items() if v}
    if args.skip_guards_too:
        # what Dynamo's guard checks cost in the step, measured only: the stance is unsafe for training
        # (a changed shape, flag or module would run the stale graph), so no benchmark row uses it
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            skipped = timed(step, args, device)
        out |= {f"{k} (guards skipped)": statistics.median(v) for k, v in skipped.items() if v}
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        step()
    common.synchronize(device)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
    out["profile"] = text.getvalue()
    del step, held
    common.free_device_memory(device)
    return out


def parse_step_args(argv, doc: str, variants: list[str], steps: int, more=None):
    """(args, device, out dir) of a probe that times `training_step`s, or None (the device is
    missing: the caller exits 2): models, batch, variants of ``bench_whole_step.py``, apollo's
    options, how many profile rows, the run arguments every benchmark takes, and what `more`
    (given the parser) adds."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["hf-clip"], type=bws.model_name)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=variants, choices=bws.VARIANTS)
    p.add_argument("--apollo-options", type=json.loads, default={})
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--skip-guards-too", action="store_true",
                   help="time the steps again with Dynamo's guard checks skipped (measured only: unsafe to train with)")
    common.add_run_args(p, steps=steps, warmup=5)
    if more is not None:
        more(p)
    args = common.parse_run_args(p, argv)
    if (setup := common.device_and_out_dir(args)) is None:
        return None
    return (args, *setup)


def step_models(args, device):
    """(name, model on the CPU, batch on `device`) for each of a step probe's --models, built from
    --seed at --batch, one after the other."""
    for name in args.models:
        base, shape = bws.build(name, args.seed)
        yield name, base, bws.make_batch(shape, args.batch, device, args.seed)


def main(argv=None) -> int:
    if (parsed := parse_step_args(argv, __doc__, ["inductor-ro-step", "apollo-step", "apollo-step-opt"], 30)) is None:
        return 2
    args, device, out_dir = parsed
    table = []
    for name, base, batch in step_models(args, device):
        for variant in args.variants:
            with bws.runtime_for(variant):  # a *-first-step-pool variant's pool, as bench_whole_step runs it
                result = run(variant, name, base, batch, args, device)
            common.log(f"--- {name}, batch {args.batch}, {variant}: "
                       + ", ".join(f"{k} {v:.3f} ms" for k, v in result.items() if k != "profile"))
            common.log(result["profile"])
            table.append({"model": name, "variant": variant, **result})
            (out_dir / "step_host.json").write_text(json.dumps(table, indent=1))  # a cut run keeps what it measured
    cols = ["to launch", "launch", "after", "step", "gpu from replay"]
    if args.skip_guards_too:
        cols += ["to launch (guards skipped)", "step (guards skipped)"]
    common.log(common.markdown(["model", "variant", *cols],
                               [[r["model"], r["variant"], *(f"{r[c]:.3f}" if c in r else "-" for c in cols)]
                                for r in table]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
