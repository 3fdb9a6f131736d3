"""Probe (CPU): what crosses the cuts between apollo's subgraphs in a whole step, by op: what a
cut keeps alive beyond what one subgraph would (`passes/boundary.py`, NOTE: A cut materializes what crosses it).

Compiles ``compile_step`` (with AdamW inside unless ``--optimizer-outside``) on a transformers
CLIP or SigLIP with the base model's widths and ``--layers`` layers a tower, subgraphs run as eager
ATen (the cut is the same as under Inductor), runs one step, and prints the values each subgraph
reads from another, grouped by op: MiB (per reading subgraph, so a value read by two counts twice),
and which crossing values still hold an elementwise op's buffer (directly or as a view of it). The
lane plan's ``recomputed_at_cuts`` says what the boundary recompute took off the cuts.

    python benchmarks/probes/cut_crossings.py --model clip --layers 2 --batch 2
    python benchmarks/probes/cut_crossings.py --model siglip --layers 2 --batch 2
"""

from __future__ import annotations

import argparse
import collections
import warnings

import torch

import apollo_compile
from apollo_compile.annotations import info
from apollo_compile.nodes import is_elementwise, is_view, nbytes, storage_node


def build(kind: str, layers: int):
    import transformers

    vision = dict(image_size=224, patch_size=16, hidden_size=768, intermediate_size=3072, num_hidden_layers=layers,
                  num_attention_heads=12)
    if kind == "clip":
        text = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=layers,
                    num_attention_heads=8, max_position_embeddings=77)
        return transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision,
                                                               projection_dim=512)), 77
    text = dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=layers,
                num_attention_heads=12, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    return transformers.SiglipModel(transformers.SiglipConfig(text_config=text, vision_config=vision)), 64


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("clip", "siglip"), default="clip")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--optimizer-outside", action="store_true")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model, tokens = build(args.model, args.layers)

    def step(ids, pixels):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, pixel_values=pixels, return_loss=True).loss
        loss.backward()
        return loss.detach()

    inside = {} if args.optimizer_outside else {"optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4)}
    apollo_compile.clear_plans()
    compiled = apollo_compile.compile_step(step, options={"subgraph_compiler": "eager"}, **inside)
    compiled(torch.randint(1, 1000, (args.batch, tokens)), torch.randn(args.batch, 3, 224, 224))
    cut = apollo_compile.last_plan().inference.decisions["lanes"]
    print("subgraphs (id, lane, ops):", [(sg.id, sg.lane, len(sg.nodes)) for sg in cut.subgraphs])
    by_op, count, elementwise_left = collections.Counter(), collections.Counter(), []
    for sg in cut.subgraphs:
        for value in sg.inputs:
            if value.op == "placeholder":
                continue
            by_op[str(value.target)] += nbytes(value)
            count[str(value.target)] += 1
            base = storage_node(value)  # a view's buffer is its base's: a detach of a sigmoid holds the sigmoid
            if is_elementwise(base) and not is_view(base):
                readers = collections.Counter(str(u.target) for u in value.users if info(u).subgraph == sg.id)
                elementwise_left.append(f"{value.name} ({value.target} of {base.target}) {info(value).subgraph} -> {sg.id}, "
                                        f"read by {dict(readers)}")
    print(f"read across cuts: {sum(by_op.values()) / 2**20:.1f} MiB")
    for op, b in by_op.most_common():
        print(f"  {b / 2**20:8.1f} MiB x{count[op]:<4d} {op}")
    print("values whose buffer is an elementwise op's, still crossing:", *elementwise_left or ["none"], sep="\n  ")
    print("recomputed at the cuts:", cut.recomputed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
