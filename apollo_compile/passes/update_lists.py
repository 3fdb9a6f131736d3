"""Update-lists pass: a list update (``apollo::adam_step_foreach``) is split into one list per tower,
so no tower's backward waits for another's, and each tower's into parts of one launch of torch's
multi-tensor kernel each (:func:`parts_of`) in the order its gradients are made, so each part runs
as soon as its gradients are complete and their float32 copies live only until then.

Reads the modality labels of the parameters (``passes/modality.py``: a parameter takes its
forward readers' tower, where its gradient, which reaches the join, is labelled ``fusion``);
rewrites the graph, then places the new updates (``passes/updates.py``) and labels the graph
again (``passes/modality.py``). Returns how many lists it split, and for each its parameters by
tower and its number of parts.

``compile_step(..., optimizer=)`` traces one list op per parameter group: at trace time nothing
says which tower a parameter belongs to. Read by every tower's gradients, the op is a join, and
runs on the main lane after every tower's backward; split by tower, each list runs right after its
tower's last gradient, on its lane (docs/design/step-passes.md#lists-by-tower).

[NOTE] A list is cut where one launch ends: a part runs after the last gradient it reads, and only
its own float32 copies are alive. A part is what one launch of the multi-tensor kernel takes
(ATen's ``MultiTensorApply.cuh``): a block per :data:`CHUNK` elements of a tensor, at most
:data:`LAUNCH_CHUNKS` blocks and :data:`LAUNCH_TENSORS` tensors for the number of lists it walks,
so the cut adds no launches (docs/design/step-passes.md#launch-parts).

The op arrives functionalized (``auto_functionalized_v2``, item 1 + j the new ``_all_bases[j]``);
each part keeps that form with its elements, bases and items. A list element that is a view of its
base is left alone, as is any op but the list update (docs/design/step-passes.md#functionalized-lists).
"""

from __future__ import annotations

import copy
import operator
import re

import torch
import torch.fx

from ..annotations import KEY, info
from ..ops.fused_update import adam_step_foreach, kernel_lists
from . import modality, updates

# one launch of torch's multi-tensor kernel (module docstring, [NOTE]), as ATen's
# MultiTensorApply.cuh sets it: kChunkSize, depth_to_max_blocks, depth_to_max_tensors by the lists walked
CHUNK = 65536
LAUNCH_CHUNKS = 320
LAUNCH_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
_ELEMENT_KEY = re.compile(r"^_(?P<arg>\w+?)_(?P<k>\d+)_(?P<what>\w+)$")  # _params_3_base_index


# the op's list arguments: those it writes (each element a base of auto_functionalized_v2), and the others
_WRITTEN = [a.name for a in adam_step_foreach._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and isinstance(a.type, torch.ListType)]
_READ = {a.name for a in adam_step_foreach._schema.arguments if isinstance(a.type, torch.ListType)} - set(_WRITTEN)


def _is_list_update(n: torch.fx.Node) -> bool:
    return (n.op == "call_function" and n.target is torch.ops.higher_order.auto_functionalized_v2
            and bool(n.args) and n.args[0] is adam_step_foreach)


def _splittable(n: torch.fx.Node) -> bool:
    """Every element of every written list is a whole base (no view metadata to carry)."""
    for key in n.kwargs:
        m = _ELEMENT_KEY.match(key)
        if m and m["arg"] in _WRITTEN and m["what"] != "base_index":
            return False
    return True


def split(gm: torch.fx.GraphModule, n: torch.fx.Node, parts: list[list[int]]) -> list[torch.fx.Node]:
    """Replace the list update `n` by one per part (element indices), each with its elements of
    every list and the bases they write; the items of `n`'s result move to the part that writes
    their base."""
    kw = dict(n.kwargs)
    bases = kw["_all_bases"]
    old_val = n.meta.get("val")
    items = {u.args[1]: u for u in n.users if u.target is operator.getitem}
    eager = n.meta.get("eager_input_vals")
    eager_of: dict[torch.fx.Node, object] = {}
    if eager is not None:
        for key, value in kw.items():
            for a, v in zip(value, eager[1][key]) if isinstance(value, (list, tuple)) else [(value, eager[1][key])]:
                if isinstance(a, torch.fx.Node):
                    eager_of[a] = v
    made = []
    for part in parts:
        new_kw: dict = {}
        new_bases: list[torch.fx.Node] = []
        where: dict[int, int] = {}  # old base index -> new

        def base_index(old: int) -> int:
            if old not in where:
                where[old] = len(new_bases)
                new_bases.append(bases[old])
            return where[old]

        for key, value in kw.items():
            if key in _READ:
                new_kw[key] = [value[i] for i in part]
            elif key.startswith("_") and (_ELEMENT_KEY.match(key) or key.endswith("_length") or key == "_all_bases"):
                continue  # rebuilt below
            else:
                new_kw[key] = value
        for name in _WRITTEN:
            length = kw[f"_{name}_length"]
            new_kw[f"_{name}_length"] = len(part) if length else 0
            if length:
                for k, i in enumerate(part):
                    new_kw[f"_{name}_{k}_base_index"] = base_index(kw[f"_{name}_{i}_base_index"])
        new_kw["_all_bases"] = new_bases
        with gm.graph.inserting_before(n):
            node = gm.graph.call_function(n.target, n.args, new_kw)
        node.meta.update({k: copy.copy(v) if k == KEY else v for k, v in n.meta.items()
                          if k not in ("val", "eager_input_vals")})  # a label each
        if old_val is not None:
            node.meta["val"] = (old_val[0], *[old_val[1 + old] for old in where])
        if eager is not None:  # the values the op saw in eager mode, which Inductor's decomposition reads
            node.meta["eager_input_vals"] = (eager[0], torch.fx.map_arg(new_kw, lambda a: eager_of[a]))
        for old, new in where.items():
            if 1 + old in items:
                items[1 + old].args = (node, 1 + new)
        made.append(node)
    assert not n.users, f"{n.name}: items left on the split op"
    gm.graph.erase_node(n)
    return made


def parts_of(sizes: list[int], max_tensors: int, max_chunks: int | None = None, chunk: int | None = None
             ) -> list[list[int]]:
    """Consecutive runs of `sizes`' indices (tensors' element counts), each what one launch of the
    multi-tensor kernel takes: at most `max_tensors` tensors and `max_chunks` chunks of `chunk`
    elements (default :data:`LAUNCH_CHUNKS`, :data:`CHUNK`); a tensor of more chunks is a run alone."""
    max_chunks = LAUNCH_CHUNKS if max_chunks is None else max_chunks
    chunk = CHUNK if chunk is None else chunk
    parts: list[list[int]] = []
    chunks = 0
    for i, size in enumerate(sizes):
        need = -(-size // chunk)
        if not parts or len(parts[-1]) >= max_tensors or chunks + need > max_chunks:
            parts.append([])
            chunks = 0
        parts[-1].append(i)
        chunks += need
    return parts


def run(gm: torch.fx.GraphModule, ctx) -> dict:
    splits = []
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        if not _is_list_update(n) or not _splittable(n):
            continue
        kw = n.kwargs
        params = [kw["_all_bases"][kw[f"_params_{i}_base_index"]] for i in range(kw["_params_length"])]
        towers: dict[str, list[int]] = {}  # by the parameter's tower: its gradient reaches the join, so is labelled one
        for i, p in enumerate(params):
            towers.setdefault(info(p).modality, []).append(i)
        parts = []
        max_tensors = LAUNCH_TENSORS[kernel_lists(kw["state"])]
        for members in towers.values():
            members.sort(key=lambda i: position[kw["grads"][i]])  # in the order the backward makes them
            sizes = [params[i].meta["val"].numel() for i in members]
            parts += [[members[k] for k in ks] for ks in parts_of(sizes, max_tensors)]
        if len(parts) < 2:
            continue
        splits.append({"node": n.name, "towers": {t: len(ix) for t, ix in towers.items()}, "parts": len(parts)})
        split(gm, n, parts)
    if not splits:
        return {"split": 0}
    gm.graph.lint()
    gm.recompile()
    ctx.decisions["updates"] = updates.run(gm, ctx)  # each part right after the last gradient it reads
    ctx.decisions["modality"] = modality.run(gm, ctx)  # and labelled with that tower
    return {"split": len(splits), "lists": splits}
