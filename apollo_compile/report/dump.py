"""Human- and test-readable views of an annotated graph: a stable listing, JSON and DOT.

The listing (``*.apollo.txt``) is deterministic — no addresses, paths or timings — so golden
tests can pin it. Columns: node, op, value (dtype[shape]), modality (``*`` = recomputed in the
backward), lane/subgraph, FLOPs, bytes, FLOP/byte, bound, estimated µs, and marks: ``cast->bf16``
for a cast apollo inserted, ``saved`` for a forward value the backward reads, ``to-host`` /
``to-device`` for the copies of an offloaded saved value, ``copy-of-<node>`` for a value computed
again past a cut, where it is read (``passes/boundary.py``).
"""

from __future__ import annotations

import json
import operator
from typing import Any

import torch
import torch.fx

from ..annotations import info

_DTYPE = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
}

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7"]
FUSION_COLOR = "#e15759"


def format_value(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{_DTYPE.get(val.dtype, str(val.dtype).replace('torch.', ''))}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(format_value(v) for v in val) + ")"
    if val is None:
        return "-"
    return type(val).__name__ if not isinstance(val, (int, float, bool)) else str(val)


def format_target(node: torch.fx.Node) -> str:
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op
    if node.target is operator.getitem:
        return f"getitem[{node.args[1]}]"
    name = getattr(node.target, "__name__", str(node.target))
    if isinstance(node.target, torch._ops.OpOverload):
        name = str(node.target).replace("aten.", "")
    return name


def rows(gm: torch.fx.GraphModule) -> list[dict[str, Any]]:
    out = []
    for n in gm.graph.nodes:
        a = info(n)
        out.append({
            "node": n.name, "op": format_target(n), "value": format_value(n.meta.get("val")),
            "modality": a.modality, "recomputed": a.recomputed,
            "lane": a.lane, "subgraph": a.subgraph,
            "flops": a.flops, "bytes": a.bytes, "intensity": round(a.intensity, 2), "bound": a.bound,
            "est_us": round(a.est_us, 2), "cast": a.cast, "saved": a.saved,
            "transfer": a.transfer, "copy_of": a.copy_of,
            "inputs": [i.name for i in n.all_input_nodes],
        })
    return out


def listing(gm: torch.fx.GraphModule, title: str) -> str:
    """The stable annotated listing of one graph."""
    table = [("node", "op", "value", "modality", "lane/sg", "flops", "bytes", "AI", "bound", "est_us", "mark")]
    for r in rows(gm):
        where = "-" if r["subgraph"] is None else f"{r['lane']}/{r['subgraph']}"
        mod = f"{r['modality']}{'*' if r['recomputed'] else ''}"
        table.append((r["node"], r["op"], r["value"], mod, where, str(r["flops"]), str(r["bytes"]),
                      f"{r['intensity']:.1f}" if r["bytes"] else "-", r["bound"], f"{r['est_us']:.2f}",
                      _mark(r)))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    right = {5, 6, 7, 9}
    lines = [f"# {title}"]
    for row in table:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def _mark(row: dict[str, Any]) -> str:
    """Decisions of the memory passes: casts apollo inserted, values saved for the backward, copies
    of the offloaded ones, values computed again at a cut."""
    marks = []
    if row["cast"]:
        marks.append(f"cast->{row['cast']}")
    if row["saved"]:
        marks.append("saved")
    if row["transfer"]:
        marks.append(row["transfer"].replace(" ", "-"))
    if row["copy_of"]:  # computed again where a cut's reader is (passes/boundary.py), the listing's
        marks.append(f"copy-of-{row['copy_of']}")  # `recomputed` star says so; this names the original
    return ",".join(marks)


def to_json(gm: torch.fx.GraphModule, summary: dict[str, Any]) -> str:
    return json.dumps({"summary": summary, "nodes": rows(gm)}, indent=1, sort_keys=True, default=str)


def modality_colors(gm: torch.fx.GraphModule) -> dict[str, str]:
    mods = sorted({info(n).modality for n in gm.graph.nodes if info(n).modality})
    colors = {}
    for i, m in enumerate(m for m in mods if m != "fusion"):
        colors[m] = PALETTE[i % len(PALETTE)]
    colors["fusion"] = FUSION_COLOR
    return colors


def to_dot(gm: torch.fx.GraphModule, title: str) -> str:
    """Graphviz DOT: fill colour = modality, box = compute-bound, ellipse = memory-bound or view."""
    colors = modality_colors(gm)
    lines = [f'digraph "{title}" {{', "  rankdir=TB; node [style=filled, fontname=Helvetica, fontsize=10];"]
    for n in gm.graph.nodes:
        a = info(n)
        shape = "box" if a.bound == "compute" else "ellipse"
        label = f"{n.name}\\n{format_target(n)}\\n{a.modality} {a.bound}"
        lines.append(f'  "{n.name}" [label="{label}", shape={shape}, fillcolor="{colors.get(a.modality, "#cccccc")}"];')
    for n in gm.graph.nodes:
        for i in n.all_input_nodes:
            lines.append(f'  "{i.name}" -> "{n.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"
