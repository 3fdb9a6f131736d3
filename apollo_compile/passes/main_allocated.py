"""Main-allocated gradients pass: a backward's side lane writes its last gradients into memory the
main lane has freed.

Reads the :class:`~apollo_compile.lane_plan.LanePlan`, ``NodeInfo.est_us`` and ``meta["val"]``;
cuts the costliest side subgraph and the costliest main subgraph of a backward in two (each head
keeps its id), makes the side tail wait for the main head, and sets the tail's ``main_allocated``
(the gradients it writes into buffers) and ``allocate_after`` (the main head); returns a
:class:`MainAllocated` (what moved, for the dumps and the log). ``runtime/subgraphs.py`` compiles
the tail with one more input per such value, which the value's matmul writes itself
(``apollo::mm_into``, ``apollo_compile/ops/mm_into.py``), and the codegen pass allocates the
buffers on the main lane right after the main head.

[NOTE] The caching allocator hands a freed block only to the stream that made it, so a pool
captured on lanes holds one high-water mark per stream: a side lane whose gradients outgrow the
saved activations it frees grows the pool, while the main lane frees its own tower's activations
and cannot lend them. Allocated by the main lane once it has freed them, the side lane's last
gradients take those blocks. The buffers must come after the main head (allocated earlier, they
raise the main stream's mark), and only matmuls move, each writing its buffer itself (a copy into
the buffer goes through a temporary of its own). The cut, and where the pass applies (a backward,
not memory-first, matmul outputs of at least :data:`MIN_BYTES`, the costliest side subgraph):
docs/design/main-allocated-gradients.md.

On one lane the same subgraphs run and each buffer is allocated right before the tail, so the
program and its results are the same as on lanes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import accumulate

import networkx as nx
import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..annotations import info
from ..lane_plan import LanePlan, Subgraph
from ..nodes import graph_outputs
from ..ops.mm_into import matmul_of
from ..shapes import concrete_numel
from ..tracing import fw_metadata
from .lanes import wire

MIN_BYTES = 1 << 20  # the caching allocator's small-pool limit (kSmallSize)
# The side stream's measured excess over `_side_excess`'s estimate: freed blocks do not fit new
# requests exactly (docs/design/main-allocated-gradients.md#the-cut).
FRAGMENTATION = 1.25

# On by default: it lowers the pool and moves no step time (docs/design/main-allocated-gradients.md#default).
ENABLED = True


@dataclass
class MainAllocated:
    values: dict[int, list[str]] = field(default_factory=dict)  # side subgraph -> values it writes in place
    nbytes: int = 0
    reason: str = ""

    def summary(self) -> dict:
        return {"values": sum(len(v) for v in self.values.values()), "bytes": self.nbytes, "reason": self.reason}


def _static_dense(val) -> bool:
    if not isinstance(val, torch.Tensor):
        return False
    if any(not isinstance(d, int) for d in (*val.shape, *val.stride())) or not isinstance(val.storage_offset(), int):
        return False
    expected = 1  # dense, not overlapping: sorted by stride, each stride is the product of the sizes below it
    for size, stride in sorted(((d, s) for d, s in zip(val.shape, val.stride()) if d != 1), key=lambda ds: ds[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _storage(val) -> StorageWeakRef | None:
    try:
        return StorageWeakRef(val.untyped_storage())
    except Exception:  # a tensor without storage (a sparse or subclass value): treat as aliasing
        return None


def eligible(gm: torch.fx.GraphModule, sg) -> list[torch.fx.Node]:
    """`sg`'s outputs a buffer may take (docs/design/main-allocated-gradients.md#where): graph outputs a matmul makes, of at
    least MIN_BYTES, static, dense, aliasing no graph input and no other graph output."""
    outputs = _output_nodes(gm)
    holders: dict[StorageWeakRef | None, int] = {}  # storage -> graph inputs and distinct outputs on it
    for n in [n for n in gm.graph.nodes if n.op == "placeholder"] + outputs:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            key = _storage(val)
            holders[key] = holders.get(key, 0) + 1
    output_set = set(outputs)
    chosen = []
    for n in sg.outputs:
        val = n.meta.get("val")
        if matmul_of(n) is None or n not in output_set or not _static_dense(val) or _nbytes(n) < MIN_BYTES:
            continue
        key = _storage(val)
        if key is not None and holders.get(key, 0) == 1:
            chosen.append(n)
    return chosen


def _output_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's outputs that are nodes, each once."""
    return list(dict.fromkeys(o for o in graph_outputs(gm) if isinstance(o, torch.fx.Node)))


def _nbytes(n: torch.fx.Node) -> int:
    val = n.meta.get("val")
    return concrete_numel(val) * val.element_size() if isinstance(val, torch.Tensor) else 0


def _donated(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The backward's inputs whose memory its capture frees at their last reader: AOTAutograd's
    donated saved activations."""
    meta = fw_metadata()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if meta is not None and getattr(meta, "bw_donated_idxs", None) is not None:
        return {placeholders[i] for i in meta.bw_donated_idxs if i < len(placeholders)}
    # outside AOTAutograd (tests): every saved value but parameters and the outputs' gradients
    return {n for n in placeholders if not n.name.startswith(("primals", "tangents"))}


def _freed_by(gm: torch.fx.GraphModule, plan: LanePlan, sg: Subgraph) -> set[torch.fx.Node]:
    """The saved activations `sg` frees: donated inputs it reads that no other subgraph reads."""
    donated = _donated(gm)
    elsewhere = {a for other in plan.subgraphs if other is not sg for a in other.inputs}
    return {a for a in sg.inputs if a in donated and a not in elsewhere}


def _freed_by_prefix(gm: torch.fx.GraphModule, plan: LanePlan, main: Subgraph) -> list[int]:
    """freed[q]: bytes of saved activations that `main`'s first q nodes read last (`_freed_by`):
    what the main lane has freed once those nodes ran."""
    own = _freed_by(gm, plan, main)
    last: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(main.nodes):
        for a in n.all_input_nodes:
            if a in own:
                last[a] = i
    freed = [0] * (len(main.nodes) + 1)
    for a, i in last.items():
        freed[i + 1] += _nbytes(a)
    for q in range(1, len(freed)):
        freed[q] += freed[q - 1]
    return freed


def _net_freed_by_prefix(gm: torch.fx.GraphModule, plan: LanePlan, main: Subgraph) -> list[int]:
    """net[q]: what `main`'s first q nodes have freed (`_freed_by_prefix`) less the graph outputs
    they made (its own tower's gradients, which take the freed memory first): how far the main
    stream has fallen below the mark it held at the backward's start."""
    freed = _freed_by_prefix(gm, plan, main)
    outputs = set(_output_nodes(gm))
    net, made = [0], 0
    for i, n in enumerate(main.nodes):
        made += _nbytes(n) if n in outputs else 0
        net.append(freed[i + 1] - made)
    return net


def _side_excess(gm: torch.fx.GraphModule, plan: LanePlan, side: Subgraph) -> int:
    """How far the side subgraph's gradients outgrow the large blocks it frees: its graph outputs
    of at least MIN_BYTES less its saved activations of that size that no other subgraph reads
    (made on its lane in the forward; smaller ones sit in the small pool, which no gradient fits)."""
    outputs = set(_output_nodes(gm))
    grads = [n for n in side.outputs if n in outputs and _nbytes(n) >= MIN_BYTES]
    reused = sum(b for a in _freed_by(gm, plan, side) if (b := _nbytes(a)) >= MIN_BYTES)
    return max(0, sum(_nbytes(n) for n in grads) - reused)


def _cuts(nodes: list[torch.fx.Node]) -> list[bool]:
    """ok[k]: a subgraph may be cut before nodes[k], unless that takes an item of an op before the
    cut (docs/design/lanes.md#items-with-tuple)."""
    pos = {n: i for i, n in enumerate(nodes)}
    return [not (n.target is operator.getitem and n.args and pos.get(n.args[0], k) < k) for k, n in enumerate(nodes)]


def _split(plan: LanePlan, sg: Subgraph, k: int) -> Subgraph:
    """Cut `sg` before its k-th node: `sg` keeps the head, a new subgraph on its lane takes the rest."""
    tail = Subgraph(len(plan.subgraphs), sg.lane, sg.nodes[k:])
    sg.nodes = sg.nodes[:k]
    for n in tail.nodes:
        info(n).subgraph = tail.id
    plan.subgraphs.append(tail)
    plan.dag.add_node(tail.id)
    for succ in list(plan.dag.successors(sg.id)):
        plan.dag.add_edge(tail.id, succ)
    plan.dag.add_edge(sg.id, tail.id)
    return tail


def choose(gm: torch.fx.GraphModule, plan: LanePlan, kind: str, memory_first: bool) -> MainAllocated:
    if not ENABLED:
        return MainAllocated(reason="turned off")
    if kind != "backward":
        return MainAllocated(reason=f"a {kind} graph's side-lane outputs stay on their lane")
    if memory_first:
        return MainAllocated(reason="memory first: the graph replays one lane")
    side = [sg for sg in plan.subgraphs if sg.lane != 0]
    main = [sg for sg in plan.subgraphs if sg.lane == 0]
    if not side or not main:
        return MainAllocated(reason="no side lane")
    S = max(side, key=lambda sg: (sg.est_us, -sg.id))  # the costliest side subgraph
    M = max(main, key=lambda sg: (sg.est_us, -sg.id))  # ... and the main lane's, whose frees it takes
    if nx.has_path(plan.dag, S.id, M.id) or nx.has_path(plan.dag, M.id, S.id):
        return MainAllocated(reason="the costliest side and main subgraphs do not run side by side")
    candidates = set(eligible(gm, S))
    if not candidates:
        return MainAllocated(reason=f"no side-lane gradient of {MIN_BYTES >> 20} MiB or more")
    net = _net_freed_by_prefix(gm, plan, M)
    est_s, est_m = ([*accumulate((info(n).est_us for n in sg.nodes), initial=0.0)] for sg in (S, M))
    need = _side_excess(gm, plan, S) * FRAGMENTATION
    best: tuple[int, int, int] | None = None  # (bytes moved, p, q)
    # a gradient counts for a tail that holds its matmul (and the transposes after it) too
    pos = {n: i for i, n in enumerate(S.nodes)}
    starts: dict[int, list[torch.fx.Node]] = {}
    for c in list(candidates):
        m, _, chain = matmul_of(c)
        if all(x in pos for x in (m, *chain)):
            starts.setdefault(min(pos[x] for x in (m, *chain, c)), []).append(c)
        else:
            candidates.discard(c)
    cut_s, cut_m = _cuts(S.nodes), _cuts(M.nodes)
    moved = 0
    for p in range(len(S.nodes) - 1, 0, -1):  # the side lane's tail S.nodes[p:] writes main's buffers
        moved += sum(_nbytes(c) for c in starts.get(p, ()))
        if not moved or not cut_s[p]:
            continue
        # the shortest main head that has freed that much, net of what it made
        q = next((q for q in range(1, len(M.nodes) + 1) if net[q] >= moved and
                  (q == len(M.nodes) or cut_m[q])), None)
        if q is None:
            continue
        # the tail may wait for the head, but must not end after the main subgraph, by estimate
        if max(est_s[p], est_m[q]) + est_s[-1] - est_s[p] > est_m[-1]:
            continue
        if best is None or best[0] < need:  # the fewest bytes that cover the need, else the most
            best = (moved, p, q)
    if best is None:
        return MainAllocated(reason="the main lane frees too little, soon enough, for the side lane's gradients")
    moved, p, q = best
    tail = _split(plan, S, p)
    origin = {tail.id: S.id}  # a new subgraph launches where the one it was cut from did
    if q < len(M.nodes):
        origin[_split(plan, M, q).id] = M.id
    plan.dag.add_edge(M.id, tail.id)
    old_pos = {sg_id: i for i, sg_id in enumerate(plan.order)}
    plan.dag = wire(plan.subgraphs, list(gm.graph.nodes), plan.dag)
    plan.order = list(nx.lexicographical_topological_sort(
        plan.dag, key=lambda i: (old_pos[origin.get(i, i)], i)))
    inside = set(tail.nodes)
    tail.main_allocated = [n for n in tail.outputs if n in candidates
                           and all(x in inside for x in matmul_of(n)[2])]
    tail.allocate_after = M.id
    return MainAllocated({tail.id: [n.name for n in tail.main_allocated]},
                         sum(_nbytes(n) for n in tail.main_allocated),
                         f"the side lane's last gradients in memory the main lane frees first "
                         f"(subgraph {tail.id} after {M.id})")


def run(gm: torch.fx.GraphModule, ctx) -> MainAllocated:
    return choose(gm, ctx.decisions["lanes"], ctx.kind, ctx.options.memory_first)
