"""Diagnostic (device tool): does a whole step whose first call runs out of memory train on?

docs/design/whole-step.md#out-of-memory-at-the-first-call. ``compile_step(step, optimizer=AdamW)``
on clip.py's tiny CLIP (fp32, TF32 off, eager subgraphs: seconds to compile), with an
out-of-memory error raised at the first call of the whole step's first subgraph that writes no
state, as a CUDA allocation near the limit would. Expected: one warning, the step runs on the
module path, whose forward and backward graphs are then captured and replayed, and every step's
loss and parameters equal eager AdamW's. With ``--after-write`` the error comes from a subgraph
that writes state instead, and must reach the caller.

    PYTHONPATH=. python benchmarks/probes/whole_step_oom.py            # exit status 1 if not as expected
    PYTHONPATH=. python benchmarks/probes/whole_step_oom.py --after-write
    PYTHONPATH=. python benchmarks/probes/whole_step_oom.py --cpu          # the same without CUDA graphs
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import pathlib
import sys
import warnings
from typing import Callable, Iterator

import torch

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent),  # benchmarks/: common.py, clip.py
                str(pathlib.Path(__file__).resolve().parent.parent.parent)]  # the repo root, for apollo_compile
import apollo_compile  # noqa: E402
import clip  # noqa: E402
import common  # noqa: E402
from apollo_compile.runtime import runner  # noqa: E402
from apollo_compile.runtime.first_call import writes_state  # noqa: E402

RTOL = 1e-4  # fp32 against fp32, the same ATen ops (eager subgraphs): only summation order differs


def out_of_memory_once(original: Callable, writes: bool) -> tuple[Callable, list[str]]:
    """(a stand-in for `original`, runtime.runner.compile_subgraph, whose first subgraph compiled
    for a whole step's graph that writes state (`writes`) or none raises torch.OutOfMemoryError at
    its first call, as a CUDA allocation near the limit would; a list that names that subgraph
    once it is compiled). tests/test_optimizer_step.py arms its tests with it too."""
    armed: list[str] = []

    def compile_subgraph(sub, example_inputs, compiler, kind, *args):
        fn = original(sub, example_inputs, compiler, kind, *args)
        if kind != "inference" or armed or any(writes_state(n) for n in sub.graph.nodes) != writes:
            return fn
        armed.append(f"a subgraph of {len(sub.graph.nodes)} nodes")
        calls = []

        def run(inputs):
            calls.append(1)
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated by whole_step_oom.py)")
            return fn(inputs)

        return run

    return compile_subgraph, armed


@contextlib.contextmanager
def armed_subgraph(writes: bool) -> Iterator[list[str]]:
    """While open, runtime.runner compiles subgraphs through :func:`out_of_memory_once`."""
    original = runner.compile_subgraph
    runner.compile_subgraph, armed = out_of_memory_once(original, writes)
    try:
        yield armed
    finally:
        runner.compile_subgraph = original


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--after-write", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cpu", action="store_true", help="on the CPU: no CUDA graphs to replay")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = "cpu" if args.cpu else "cuda"
    model = clip.build("tiny", device=device)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, fused=not args.cpu) for m in (model, ref))
    with armed_subgraph(writes=args.after_write) as armed:
        return train(args, model, ref, opt, ref_opt, device, armed)


def train(args, model, ref, opt, ref_opt, device: str, armed: list[str]) -> int:
    """Train `args.steps` steps of the compiled whole step and of eager AdamW side by side; 0 if
    the out-of-memory error did what the docstring says."""

    def step(images, tokens):
        loss = model(images, tokens)
        loss.backward()
        return loss.detach()

    apollo_compile.clear_plans()  # the graphs reported below are this run's
    compiled = apollo_compile.compile_step(step, optimizer=opt, options={"subgraph_compiler": "eager"})
    worst = 0.0
    for i in range(args.steps):
        batch = clip.make_batch(args.batch, device, "tiny", seed=i)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                loss = compiled(*batch)
            except torch.OutOfMemoryError as e:
                ok = args.after_write and i == 0 and compiled.fallback_reason is None
                print(f"step {i}: OutOfMemoryError reached the caller ({str(e)[:80]}): "
                      f"{'as expected' if ok else 'NOT expected'}")
                return 0 if ok else 1
        for w in caught:
            if issubclass(w.category, apollo_compile.ApolloFallbackWarning):
                print(f"step {i} warning: {str(w.message)[:300]}")
        ref_loss = ref(*batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        worst = max(worst, abs(float(loss) - float(ref_loss.detach())) / abs(float(ref_loss.detach())),
                    max(common.rel_err(a, b) for a, b in zip(model.parameters(), ref.parameters())))
    states = {f"{plan.name} {kind}": {k: (graph.summary().get("cuda_graph") or {}).get(k)
                                      for k in ("replays", "ungraphed_calls", "chosen")}
              for plan in apollo_compile.plans() for kind, graph in plan.graphs.items()}
    print("graphs:", states)
    replayed = [s for name, s in states.items() if name.endswith(("forward", "backward"))]
    ok = (not args.after_write and bool(armed) and compiled.fallback_reason is not None and worst <= RTOL
          and (args.cpu or len(replayed) >= 2 and all((s["replays"] or 0) > 0 and s["ungraphed_calls"] == 0
                                                     for s in replayed)))
    print(f"{'PASS' if ok else 'FAIL'}: armed {armed}; worst relative error of the loss and the parameters "
          f"{worst:.2e} (<= {RTOL}); fallback: {compiled.fallback_reason is not None}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
