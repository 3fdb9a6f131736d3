"""Which attention and matmul ops a model's eager training step calls on the GPU, with their input
dtypes and shapes, and which GPU kernels each runs: where a whole step runs float32 cuBLAS GEMMs
without tensor cores (RESULTS.md), this says which of the model's ops they come from.

    PYTHONPATH=. python benchmarks/probes/attention_ops.py --models hf-siglip --batch 8
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
import bench_whole_step as bws  # noqa: E402
import common  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["hf-siglip"], type=bws.model_name)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in args.models:
        base, shape = bws.build(name, 0)
        model = base.to(device)
        batch = bws.make_batch(shape, args.batch, device, 0)
        f = bws.loss_fn(name, model)
        for _ in range(2):  # warm: cuDNN's and cuBLAS's choices made before the profile
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = f(*batch)
            loss.backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                    record_shapes=True) as prof:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = f(*batch)
            loss.backward()
            common.synchronize(device)
        ops = Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CPU and any(
                    k in e.name for k in ("attention", "mm", "matmul", "softmax", "baddbmm", "einsum")):
                ops[(e.name, str(e.input_shapes)[:120])] += 1
        common.log(f"--- {name}, batch {args.batch}: aten ops (name, input shapes) -> count")
        for (op, shapes), n in sorted(ops.items(), key=lambda kv: -kv[1])[:40]:
            common.log(f"{n:4d}  {op}  {shapes}")
        kernels = Counter(e.name[:110] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        common.log("--- GPU kernels -> count")
        for k, n in kernels.most_common(30):
            common.log(f"{n:4d}  {k}")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=25,
                                                                 max_name_column_width=60), flush=True)
        compiled_ops(name, model, f, batch, device)
        del model, base
    return 0


def compiled_ops(name, model, f, batch, device) -> None:
    """The attention calls Dynamo records (with their mask argument) and the attention and matmul
    ops of AOTAutograd's forward graph with their input dtypes: what a compiler gets to lower."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from apollo_compile.passes import attention_masks

    def dynamo_graph(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "attention" in str(n.target):
                mask = attention_masks.mask_of(n)
                val = None if mask is None else mask.meta.get("example_value")
                shown = "none" if val is None else (f"{tuple(val.shape)} {val.dtype} strides {val.stride()}, the "
                                                    f"pass {'rewrites' if attention_masks.last_dim_not_dense(val) else 'keeps'} it")
                common.log(f"dynamo: {n.target} mask {shown} "
                           f"kwargs={ {k: v for k, v in n.kwargs.items() if k != 'attn_mask'} }")
        return aot_autograd(fw_compiler=aot_graph("forward"), bw_compiler=aot_graph("backward"))(gm, example_inputs)

    def aot_graph(kind):
        def compiler(gm, example_inputs):
            ops = Counter()
            for n in gm.graph.nodes:
                if n.op == "call_function" and any(k in str(n.target) for k in ("attention", "mm", "softmax")):
                    dtypes = tuple(str(a.meta["val"].dtype).removeprefix("torch.") for a in n.all_input_nodes
                                   if isinstance(a.meta.get("val"), torch.Tensor))
                    ops[(str(n.target), dtypes)] += 1
            common.log(f"--- {name} AOT {kind} graph: op, input dtypes -> count")
            for (op, dtypes), k in sorted(ops.items(), key=lambda kv: -kv[1]):
                common.log(f"{k:4d}  {op}  {dtypes}")
            return make_boxed_func(gm)
        return compiler

    torch._dynamo.reset()
    g = torch.compile(f, backend=dynamo_graph)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = g(*batch)
    loss.backward()


if __name__ == "__main__":
    sys.exit(main())
