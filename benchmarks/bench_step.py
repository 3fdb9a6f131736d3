"""Time one training step of the CLIP-style model (benchmarks/clip.py) under several compilers.

Variants, run side by side in ONE process (absolute times drift between runs; DESIGN.md):

    eager          the nn.Module as is
    inductor       torch.compile(model)
    inductor-ro    torch.compile(model, mode="reduce-overhead")   (Inductor + CUDA graph trees)
    apollo-1lane   torch.compile(model, backend="apollo", options={"max_lanes": 1})
    apollo         torch.compile(model, backend="apollo")
    inductor-ro-ca, apollo-ca   (named on the command line) the backward traced by compiled autograd

The step is zero_grad, the forward under bf16 autocast (``--no-amp``: fp32) and ``backward()``,
no optimizer step: the weights never change, so the numerics check runs at the reference weights.
Timing, memory, numerics and the table are common.py's variant matrix. Results go to
``<out>/step_results.json`` and ``.md``, written after every variant.

    PYTHONPATH=. python benchmarks/bench_step.py --batch 8 32 128
    python benchmarks/bench_step.py --device cpu --config tiny --batch 2 --variants eager inductor --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/clip.py, common.py (already first when run as a script)
sys.path.insert(1, str(HERE.parent))  # the repo root, for apollo_compile

import clip  # noqa: E402  (benchmarks/clip.py)
import common  # noqa: E402  (the method every benchmark here shares)
from common import log, time_back_to_back, train_step  # noqa: E402,F401  (re-exported for the tests)

VARIANTS = ("eager", "inductor", "inductor-ro", "apollo-1lane", "apollo")
# named on the command line only: the backward traced by compiled autograd (CompiledAutogradStep)
COMPILED_AUTOGRAD_VARIANTS = ("inductor-ro-ca", "apollo-ca")
BASELINE = "inductor-ro"  # the "ratio" column is BASELINE median / variant median


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

    Why: a small batch's step is bound by host work between the backward's launch and
    ``backward()`` returning, in AOTAutograd and the engine's AccumulateGrad calls (RESULTS.md,
    "Host time of a batch-8 step"). Compiled autograd takes that into the graph, at its own cost
    per step. Its graph has no module paths, so apollo gives it one lane."""

    def __init__(self, forward: Callable[..., torch.Tensor], backward_compiler: Callable) -> None:
        self.forward, self.backward_compiler = forward, backward_compiler

    def __call__(self, *args: Any) -> torch.Tensor:
        return self.forward(*args)

    def backward_context(self) -> contextlib.AbstractContextManager:
        return compiled_autograd(self.backward_compiler)


def compile_variant(name: str, model: nn.Module, options: dict | None = None) -> Callable[..., torch.Tensor]:
    """`model` compiled as variant `name` says; `options` (apollo's, e.g. the tests' eager subgraph
    compiler) go to every apollo compile of the variant."""
    options = dict(options or {})
    if options and not name.startswith("apollo"):
        raise ValueError(f"variant {name!r} compiles without apollo: it takes no apollo options")
    if name in COMPILED_AUTOGRAD_VARIANTS:
        base = name.removesuffix("-ca")
        backward = (torch.compile(backend="apollo", options=options) if base == "apollo"
                    else torch.compile(mode="reduce-overhead"))
        return CompiledAutogradStep(compile_variant(base, model, options), backward)
    if name == "eager":
        return model
    if name == "inductor":
        return torch.compile(model)
    if name == "inductor-ro":
        return torch.compile(model, mode="reduce-overhead")
    if name in ("apollo", "apollo-1lane"):
        import apollo_compile  # noqa: F401  (importing registers backend="apollo")

        extra = {"max_lanes": 1} if name == "apollo-1lane" else {}
        return torch.compile(model, backend="apollo", options={**options, **extra})
    raise ValueError(f"unknown variant {name!r}")


# --------------------------------------------------------------------------------------------
# the matrix


def reference(base: nn.Module, batch: tuple, device: torch.device, amp: bool) -> dict:
    """Eager loss and gradients on the numerics batch; with AMP also eager fp32's (the noise floor)."""
    model = copy.deepcopy(base).to(device)
    loss, grads = common.loss_and_grads(model, model, batch, device, amp)
    fp32 = None
    if amp:
        with common.no_tf32():
            fp32 = common.loss_and_grads(model, model, batch, device, False)
    del model
    common.free_device_memory(device)
    return common.reference(loss, grads, fp32)


def trial(name: str, base: nn.Module, batch: tuple, numerics_batch: tuple, device: torch.device,
          amp: bool) -> common.Trial:
    model = copy.deepcopy(base).to(device)
    step_fn = compile_variant(name, model)
    return common.Trial(step=lambda read_loss=True: train_step(model, step_fn, batch, device, amp),
                        loss_and_grads=lambda: common.loss_and_grads(model, step_fn, numerics_batch, device, amp),
                        keep=step_fn)


def cells(base: nn.Module, args, device: torch.device):
    for batch_size in args.batch:
        batch = clip.make_batch(batch_size, device, args.config, seed=args.seed)
        numerics_batch = clip.make_batch(batch_size, device, args.config, seed=args.seed + 1)
        yield common.Cell(f"batch {batch_size}", {"batch": batch_size},
                          lambda: reference(base, numerics_batch, device, args.amp),
                          {"batch": batch, "numerics": numerics_batch})


def markdown_table(results: list[dict]) -> str:
    return common.matrix_table(results, BASELINE)


def report(env: dict, results: list[dict], out_dir: Path) -> str:
    precision = "bf16" if env["amp"] != "fp32" else "fp32"
    head = [
        f"# apollo step benchmark: CLIP-style ({env['config']}), {env['amp']}",
        "",
        common.header_line(env),
        f"{env['warmup']} warm-up + {env['steps']} timed steps of zero_grad + forward + backward (no optimizer step), "
        f"each from an idle GPU, then {env['steps']} back to back (ms per step); "
        f"ratio = {BASELINE} median / variant median (>1: faster than {BASELINE}); peak and reserved over the timed "
        f"steps, whole-run reserved from before the compile; numerics vs eager, {common.tolerance_text(precision)}.",
        *common.noise_floor_lines(results),
    ]
    return common.write_results(out_dir, "step", env, head, [markdown_table(results)], results=results)


# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + COMPILED_AUTOGRAD_VARIANTS,
                   help="default: the five above; -ca: the backward under compiled autograd")
    p.add_argument("--config", default="base", choices=sorted(clip.CONFIGS))
    common.add_run_args(p, steps=20, warmup=5)
    return common.parse_run_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if (setup := common.device_and_out_dir(args)) is None:
        return 2
    device, out_dir = setup
    env = common.environment(device, config=args.config, amp="bf16 autocast" if args.amp else "fp32",
                             steps=args.steps, warmup=args.warmup, optimizer_step=False)
    log(common.header_line(env))
    log(f"config {args.config} | {env['amp']} | batches {args.batch} | variants {args.variants} | out {out_dir}")
    base = clip.build(args.config, device="cpu", seed=args.seed)  # stays on the CPU; copies go to the device
    log(f"model: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters")

    def run(cell: common.Cell, name: str, ref: dict) -> dict:
        data = cell.data
        return common.measure(name, lambda: trial(name, base, data["batch"], data["numerics"], device, args.amp),
                              ref, device, warmup=args.warmup, steps=args.steps,
                              precision="bf16" if args.amp else "fp32", apollo=name.startswith("apollo"))

    results: list[dict] = []
    common.run_matrix(cells(base, args, device), args.variants, run, device, results,
                      on_update=lambda: report(env, results, out_dir))
    text = report(env, results, out_dir)
    log(f"\nwrote {out_dir / 'step_results.json'} and {out_dir / 'step_results.md'}\n")
    log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
