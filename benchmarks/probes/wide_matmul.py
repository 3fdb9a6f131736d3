"""Can a weight's bf16 gradient matmul write float32 itself (``aten.mm.dtype``), and is that
cheaper than the bf16 matmul plus the float32 cast kernel the update lists read (a cast kernel
per weight, RESULTS.md)?

For each weight-gradient shape of HF CLIP B/16 at a batch (``[out, in] = grad_out.T @ x`` over
``tokens = batch * 197`` rows, and the text tower's ``batch * 77``), CUDA-event medians of:

- ``mm+cast``: ``torch.mm(a, b).float()`` (two kernels);
- ``mm.dtype``: ``torch.ops.aten.mm.dtype(a, b, torch.float32)`` (one kernel),

each call's GPU time from a CUDA graph of 20 calls (one by one, a few-microsecond kernel is
host-bound: the first run of this probe read 26-37 us for every shape). Then whether Inductor
lowers the ``dtype`` overload (its ``kernel/mm.py``) or would fall back to the ATen op.

Also prints the largest difference of each from the float32 product (the float32 output keeps
what the bf16 output rounds away).

    PYTHONPATH=. python benchmarks/probes/wide_matmul.py --batch 8
"""

from __future__ import annotations

import argparse
import statistics

import torch


def median_us(fn, inner: int = 20, reps: int = 30) -> float:
    """GPU time of one call of `fn`: `inner` calls captured in a CUDA graph, replayed `reps` times
    (a kernel of a few microseconds is host-bound when launched one by one)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / inner)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    print("torch", torch.__version__, "has aten.mm.dtype:", hasattr(torch.ops.aten.mm, "dtype"))
    wide = torch.ops.aten.mm.dtype

    def narrow_then_cast(a, b):
        return torch.mm(a, b).float()

    def wide_mm(a, b):
        return wide(a, b, torch.float32)

    print("| shape [out, in] x rows | mm+cast us | mm.dtype us | max err mm+cast / mm.dtype |")
    print("|---|---|---|---|")
    total = [0.0, 0.0]
    for rows in (args.batch * 197, args.batch * 77):
        for out, inner in ((768, 768), (3072, 768), (768, 3072), (512, 512), (2048, 512), (512, 2048)):
            a = torch.randn(out, rows, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(rows, inner, device="cuda", dtype=torch.bfloat16)
            exact = a.float() @ b.float()
            times = [median_us(lambda f=f: f(a, b)) for f in (narrow_then_cast, wide_mm)]
            errs = [(f(a, b) - exact).abs().max().item() for f in (narrow_then_cast, wide_mm)]
            total = [t + x for t, x in zip(total, times)]
            print(f"| [{out}, {inner}] x {rows} | " + " | ".join(f"{t:.1f}" for t in times)
                  + f" | {errs[0]:.3g} / {errs[1]:.3g} |")
    print("| sum | " + " | ".join(f"{t:.1f}" for t in total) + " | |")
    from torch._inductor import lowering

    print("Inductor lowers aten.mm.dtype:", wide in lowering.lowerings)


if __name__ == "__main__":
    main()
