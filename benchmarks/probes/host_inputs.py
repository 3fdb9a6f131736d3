"""Which inputs of apollo's graphs are CPU tensors beside CUDA ones, and what reads them.

A CUDA graph bakes a CPU scalar's value into its launches, so the runner never captures a graph
with one (runtime/graph_io.py, `host_values`). smoke_gpu.py's "batch varies, inductor" mode found
such an input in the symbolic graph's backward ("its input 51 is a CPU tensor (torch.int64,
shape ())"): this names it and its users, to tell whether it varies between
replays at one shape (a Python number) or is fixed by the shape (then the backward could be
captured). Runs one smoke_gpu mode, then lists every graph's fallback, every CPU tensor input of a
graph whose other inputs are on the GPU, and apollo's warnings.

    PYTHONPATH=. python benchmarks/probes/host_inputs.py                      # "batch varies, inductor"
    PYTHONPATH=. python benchmarks/probes/host_inputs.py --mode "plain, inductor"
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # smoke_gpu, common
import common  # noqa: E402
import smoke_gpu  # noqa: E402

import apollo_compile  # noqa: E402


def host_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """'position name dtype shape <- producer: users' for each CPU tensor placeholder of `gm` whose
    graph also takes CUDA tensors."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    if not any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in vals):
        return []
    return [f"{i} {n.name} {v.dtype} {tuple(v.shape)}: read by "
            + ", ".join(f"{u.name} ({u.target})" for u in list(n.users)[:6])
            for i, (n, v) in enumerate(zip(placeholders, vals))
            if isinstance(v, torch.Tensor) and v.device.type == "cpu"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="batch varies, inductor", choices=list(smoke_gpu.MODES))
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with common.no_tf32():
            result = smoke_gpu.run(args.mode, device)
    print("ok", result["ok"], {k: v and (v["replays"], v["ungraphed_calls"], v["disabled"])
                               for k, v in result["runners"].items()})
    for plan in apollo_compile.plans():
        for kind, graph in plan.graphs.items():
            print(plan.name, kind, "fallback:", graph.fallback)
            for line in host_inputs(graph.gm):
                print("  CPU input", line)
    for w in caught:
        if "apollo" in str(w.message).lower():
            print("warning:", str(w.message)[:400])
    return 0


if __name__ == "__main__":
    sys.exit(main())
