"""Probe: how much of a tower's backward could hide if weight gradients ran on a side stream.

At batch 8 the two towers' backward side by side runs about 1.2x faster than on one stream
(RESULTS.md). Each linear layer's backward is two GEMMs: dX = dY W (the chain the next layer
waits for) and dW = dY^T X (read by nothing but the optimizer). This script times, inside CUDA
graphs, a hand-written backward of two ViT-like towers (bf16; per layer the four linears of a
transformer block with elementwise stand-ins for attention and GELU):

  one-stream      vision then text on one stream
  towers          vision and text on two streams (what apollo's lanes do today)
  towers+dw       as towers, each tower's weight gradients on a stream of its own, one event per layer

    python benchmarks/probes/dw_lane_probe.py --batch 8 32
"""

from __future__ import annotations

import argparse
import statistics

import torch

WIDTHS = {"vision": (768, 197), "text": (512, 77)}  # width, tokens per sample (DESIGN.md's CLIP)
LAYERS = 12


def make_tower(width: int, tokens: int, batch: int, device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(width)
    rows = batch * tokens
    dims = [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]
    layers = []
    for _ in range(LAYERS):
        ws = [(torch.randn(o, i, generator=g) / i ** 0.5).to(device, torch.bfloat16) for i, o in dims]
        xs = [torch.randn(rows, i, generator=g).to(device, torch.bfloat16) for i, _ in dims]  # saved inputs
        layers.append((ws, xs))
    return {"layers": layers, "dy": torch.randn(rows, width, generator=g).to(device, torch.bfloat16)}


def backward(tower: dict, chain: torch.cuda.Stream, dw_stream: torch.cuda.Stream | None) -> list[torch.Tensor]:
    """The chain's dX GEMMs and elementwise steps on `chain`; dW on `dw_stream` (or `chain`)."""
    grads = []

    def weight_grad(dy, x):
        if dw_stream is None:
            grads.append(dy.t() @ x)
            return
        ev = torch.cuda.Event()
        ev.record(chain)
        dw_stream.wait_event(ev)
        with torch.cuda.stream(dw_stream):
            grads.append(dy.t() @ x)

    with torch.cuda.stream(chain):
        dy = tower["dy"]
        for (w_qkv, w_out, w_fc1, w_fc2), (x_qkv, x_out, x_fc1, x_fc2) in reversed(tower["layers"]):
            weight_grad(dy, x_fc2)
            d = (dy @ w_fc2) * torch.sigmoid(x_fc2)  # GELU's backward, roughly
            weight_grad(d, x_fc1)
            dy = dy + d @ w_fc1  # residual
            weight_grad(dy, x_out)
            d = dy @ w_out
            d = torch.cat([d * torch.sigmoid(x_out), d, d], dim=1)  # attention's backward, roughly
            weight_grad(d, x_qkv)
            dy = dy + d @ w_qkv
    return grads


def step(towers: dict, variant: str, streams: dict) -> None:
    main = torch.cuda.current_stream()
    if variant == "one-stream":
        for t in towers.values():
            backward(t, main, None)
        return
    side = streams["text"]
    side.wait_stream(main)
    dws = {}
    if variant == "towers+dw":
        for name in towers:
            dws[name] = streams[name + "_dw"]
            dws[name].wait_stream(main)
    backward(towers["vision"], main, dws.get("vision"))
    backward(towers["text"], side, dws.get("text"))
    for s in [side, *dws.values()]:
        main.wait_stream(s)


def time_graph(fn, reps: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for batch in args.batch:
        towers = {name: make_tower(w, n, batch, dev) for name, (w, n) in WIDTHS.items()}
        streams = {k: torch.cuda.Stream() for k in ("text", "vision_dw", "text_dw")}
        ms = {v: time_graph(lambda v=v: step(towers, v, streams)) for v in ("one-stream", "towers", "towers+dw")}
        rows.append((batch, ms))
        del towers
    print("| batch | one-stream ms | towers ms | towers+dw ms | towers vs one | towers+dw vs one | towers+dw vs towers |")
    print("|---|---|---|---|---|---|---|")
    for batch, ms in rows:
        one, tw, dw = ms["one-stream"], ms["towers"], ms["towers+dw"]
        print(f"| {batch} | {one:.3f} | {tw:.3f} | {dw:.3f} | {one / tw:.2f}x | {one / dw:.2f}x | {tw / dw:.2f}x |")


if __name__ == "__main__":
    main()
