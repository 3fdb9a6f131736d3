"""Variants of ``bench_whole_step.py`` timed in one process, their steps interleaved: is a small
difference between two variants theirs, or the process's and the order's?

One variant can run tens of percent apart in two processes, and the variant run second in a
process slower with identical kernels (RESULTS.md): variants timed one after the other
(``bench_whole_step.py``) cannot tell a few percent from drift. Here every variant is compiled and
warmed up first (each under its own ``bench_whole_step.runtime_for``), then ``--rounds`` rounds time
each variant in turn, the order reversed every round: ``--steps`` steps from an idle GPU (the loss
read every step) and one back-to-back run of ``--steps`` steps. Name a variant twice as a control
(``apollo apollo-no-first-step-pool apollo``): the spread between its two copies is what being a
different compiled object in the same process costs (e.g. Dynamo checking another cache entry's
guards first), the floor under which a difference means nothing.

Each copy of a module-compiled variant compiles a wrapper whose ``forward`` has a code object of
its own (:class:`OwnCode`): Dynamo keys its graphs by code object, not by module instance, so
without it every copy after the first would run the first's graphs: a family of CUDA graphs of
its own (runtime/instances.py), captured without the un-graphed first step and the choices a
variant's first capture makes.
``compile_step``'s steps already get graphs of their own per instance.

    PYTHONPATH=. python benchmarks/probes/interleaved_ab.py --models hf-clip --batch 8 \\
        --variants apollo apollo-no-first-step-pool apollo
    python benchmarks/probes/interleaved_ab.py --device cpu --models hf-clip-tiny --batch 2 --rounds 2 --steps 2 \\
        --warmup 2 --variants apollo apollo --apollo-options '{"subgraph_compiler": "eager"}'
"""

from __future__ import annotations

import json
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent),  # benchmarks/: common.py, bench_whole_step.py
                str(Path(__file__).resolve().parent)]  # probes/: step_host.py
import bench_whole_step as bws  # noqa: E402
import common  # noqa: E402
from step_host import parse_step_args, step_models, training_step  # noqa: E402


class OwnCode(torch.nn.Module):
    """`inner`, called through a ``forward`` whose code object is this copy's own (named
    ``forward_copy_K``), so that Dynamo compiles graphs for this instance rather than reusing
    another copy's. Its plan is the bare model's (apollo_compile.explain on hf-clip-tiny)."""

    def __init__(self, inner: torch.nn.Module, k: int) -> None:
        super().__init__()
        self.inner = inner
        template = OwnCode._forward
        code = template.__code__.replace(co_name=f"forward_copy_{k}")
        self.forward = types.MethodType(types.FunctionType(code, template.__globals__, code.co_name), self)

    def _forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def interleaved(steps: list, args, device: torch.device, partial: Path) -> list[dict[str, list[float]]]:
    """Per variant: its loaded step times and back-to-back ms per round, the variants timed in turn,
    the order reversed every round; written to `partial` after each round (a cut run keeps them)."""
    out = [{"loaded": [], "b2b": []} for _ in steps]
    for r in range(args.rounds):
        order = list(range(len(steps)))[::(-1 if r % 2 else 1)]
        for i in order:
            out[i]["loaded"] += common.time_steps(lambda: steps[i]().item(), args.steps, device)
            out[i]["b2b"].append(common.time_back_to_back(steps[i], args.steps, device, rounds=1)["ms"])
        partial.write_text(json.dumps({"variants": args.variants, "times": out}))
    return out


def main(argv=None) -> int:
    parsed = parse_step_args(argv, __doc__, ["apollo", "apollo-no-first-step-pool", "apollo"], 5,
                             lambda p: p.add_argument("--rounds", type=int, default=8, help="rounds of --steps steps per variant"))
    if parsed is None:
        return 2
    args, device, out_dir = parsed
    table = []
    for name, base, batch in step_models(args, device):
        steps, held = [], []
        for k, variant in enumerate(args.variants):
            model = base if variant in bws.STEP_VARIANTS else OwnCode(base, k)
            with bws.runtime_for(variant):  # what a variant's first step runs under (the first-step pool)
                step, keep = training_step(variant, name, model, batch, args, device)
                for _ in range(args.warmup):
                    step().item()
            steps.append(step)
            held.append(keep)
        times = interleaved(steps, args, device, out_dir / f"{name}_rounds.json")
        first = None
        for k, (variant, t) in enumerate(zip(args.variants, times)):
            row = {"model": name, "copy": k, "variant": variant, "loaded_ms": statistics.median(t["loaded"]),
                   "b2b_ms": statistics.median(t["b2b"]), "loaded_all": t["loaded"], "b2b_all": t["b2b"]}
            first = first or row
            row["loaded_vs_first"] = first["loaded_ms"] / row["loaded_ms"]
            row["b2b_vs_first"] = first["b2b_ms"] / row["b2b_ms"]
            table.append(row)
            (out_dir / "interleaved_ab.json").write_text(json.dumps(table, indent=1))
        del steps, held
        common.free_device_memory(device)
    common.log(common.markdown(
        ["model", "#", "variant", "loaded ms", "vs first", "b2b ms", "vs first"],
        [[r["model"], str(r["copy"]), r["variant"], f"{r['loaded_ms']:.2f}", f"{r['loaded_vs_first']:.3f}x",
          f"{r['b2b_ms']:.2f}", f"{r['b2b_vs_first']:.3f}x"] for r in table]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
