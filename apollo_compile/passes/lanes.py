"""Lanes pass: split a labelled graph into concurrent subgraphs, one lane per independent branch.

Reads ``NodeInfo.modality`` and ``NodeInfo.est_us``; writes ``NodeInfo.lane`` and
``NodeInfo.subgraph``; returns a :class:`~apollo_compile.lane_plan.LanePlan` (the subgraphs and
their dependency DAG). Between cutting the graph (:func:`segment`) and wiring the subgraphs'
inputs and outputs (:func:`wire`), ``boundary.py`` recomputes a cheap elementwise value where it
is read rather than hand it across a cut; a subgraph left with no nodes is dropped (:func:`drop_empty`).

Lane 0 is the main lane (the caller's stream): joins (``fusion``) run there. Every other modality
gets a lane of its own, except that a modality fed by exactly one other modality continues on that
modality's lane, so a chain never pays a cross-lane synchronisation. Once the graph is cut, the
costliest side lane's subgraphs move to the main lane (:func:`costliest_on_main`): the caching
allocator reuses a freed block only on the stream that made it, and the capture stream is the one
whose blocks a CUDA graph reuses.

The rules the cut keeps, each with its reason in docs/design/lanes.md:

- the subgraph DAG stays acyclic (#acyclic);
- a lane waits for another where it reads it, not where the graph lists the read (#wait-where-read);
- a write into an input comes after every earlier reader of it (#writes-after-readers);
- an item of a multi-output op stays in that op's subgraph (#items-with-tuple);
- every symbol a subgraph's sizes name is bound by one of its inputs (#symbols);
- a backward keeps its forward's tower on the main lane (#costliest-on-main);
- a sum of micro-batches' gradients runs on its later chain's lane, as soon as both exist
  (#staggered-sums).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import networkx as nx
import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_symbols, is_symbol_binding_fx_node

from ..annotations import FUSION, info
from ..lane_plan import COMPUTE_OPS, LanePlan, Subgraph
from ..nodes import is_elementwise, is_random, readers_of, written_inputs
from . import boundary

# A chain whose gradients a later micro-batch's sums read is cut into about this many subgraphs,
# so each sum waits for the part of the chain that made its operand, not for the whole chain
# (docs/design/lanes.md#staggered-sums).
STAGGER_PIECES = 8


def assign_lanes(nodes: list[torch.fx.Node], max_lanes: int | None) -> tuple[dict[str, int], str]:
    """modality -> lane (the module docstring says how), and why this many lanes."""
    compute = [n for n in nodes if n.op in COMPUTE_OPS]
    order: list[str] = []
    feeders: dict[str, set[str]] = {}
    for n in compute:
        m = info(n).modality
        if m == FUSION:
            continue
        if m not in feeders:
            order.append(m)
            feeders[m] = set()
        for arg in n.all_input_nodes:
            am = info(arg).modality
            # a gradient reading a forward value (saved, recomputed, or in the same whole-step
            # graph) reads it like an input: a tower's gradient reading the other tower's
            # features (the logits' gradient) is no chain
            if arg.op in COMPUTE_OPS and am not in (m, FUSION) and info(arg).backward >= info(n).backward:
                feeders[m].add(am)
    # chain merging: a modality fed by exactly one other continues on its lane, when it is that
    # modality's only such follower
    followers: dict[str, list[str]] = {m: [] for m in order}
    for m in order:
        if len(feeders[m]) == 1:
            followers[next(iter(feeders[m]))].append(m)
    lane_root: dict[str, str] = {}
    for m in order:
        src = next(iter(feeders[m])) if len(feeders[m]) == 1 else None
        # a feeder met later in graph order (two modalities feeding each other, as a tower's
        # recomputed forward values feed its projection's gradients) cannot be followed
        follows = src is not None and src in lane_root and len(followers[src]) == 1
        lane_root[m] = lane_root[src] if follows else m
    roots = list(dict.fromkeys(lane_root[m] for m in order))
    if len(roots) < 2:
        return {m: 0 for m in order} | {FUSION: 0}, "one branch: nothing runs concurrently"
    cost = {r: 0.0 for r in roots}
    for n in compute:
        m = info(n).modality
        if m != FUSION:
            cost[lane_root[m]] += info(n).est_us
    reason = f"{len(roots)} independent branches"
    if max_lanes is not None and len(roots) > max_lanes:
        # keep the max_lanes costliest branches on lanes of their own (the costliest then moves to
        # the main lane: costliest_on_main), the rest on the main lane
        kept = sorted(roots, key=lambda r: (-cost[r], roots.index(r)))[:max_lanes] if max_lanes > 1 else []
        roots_lane = {r: (kept.index(r) + 1 if r in kept else 0) for r in roots}
        reason += f", limited to max_lanes={max_lanes}"
    else:
        roots_lane = {r: i + 1 for i, r in enumerate(roots)}
    if max_lanes == 1:
        roots_lane = {r: 0 for r in roots}
    lane = {m: roots_lane[lane_root[m]] for m in order}
    lane[FUSION] = 0
    return lane, reason


def micro_batch_sums(nodes: list[torch.fx.Node], lane_of: dict[str, int]) -> dict[torch.fx.Node, int]:
    """A sum joining micro-batch chains' gradients -> the lane of its later operand
    (docs/design/lanes.md#staggered-sums): an elementwise ``add`` labelled a join whose two operands
    are on different lanes, each a micro-batch's value (``<label>@mb<i>``) or such a sum."""
    pos = {n: i for i, n in enumerate(nodes)}
    sums: dict[torch.fx.Node, int] = {}

    def chain_lane(a: torch.fx.Node) -> int | None:
        if a in sums:
            return sums[a]
        return lane_of.get(info(a).modality) if "@mb" in (info(a).modality or "") else None

    for n in nodes:
        if info(n).modality != FUSION or n.target is not torch.ops.aten.add.Tensor or not is_elementwise(n):
            continue
        operands = [a for a in n.args[:2] if isinstance(a, torch.fx.Node)]
        if len(set(operands)) != 2:
            continue
        earlier, later = (chain_lane(a) for a in sorted(operands, key=pos.__getitem__))
        if None not in (earlier, later) and earlier != later:
            sums[n] = later
    return sums


def scaled_sums(sums: dict[torch.fx.Node, int]) -> dict[torch.fx.Node, torch.fx.Node]:
    """The mean's scale of a micro-batch sum -> that sum: the one elementwise op that reads only the
    last sum of a gradient (``sum / k``). Placed right after its sum, on the sum's lane, it fuses
    with the sum into one pass written into the earlier gradient, rather than a pass of its own over
    every gradient once the lanes join (docs/design/lanes.md#staggered-sums)."""
    scales = {}
    for s in sums:
        if len(s.users) != 1:
            continue
        d = next(iter(s.users))
        # is_elementwise: pure, not random, writes nothing
        if d not in sums and info(d).modality == FUSION and is_elementwise(d) and d.all_input_nodes == [s]:
            scales[d] = s
    return scales


def segment(nodes: list[torch.fx.Node], lane_of: dict[str, int],
            lane_of_node: dict[torch.fx.Node, int] | None = None) -> tuple[list[Subgraph], nx.DiGraph]:
    """Cut the graph into per-lane subgraphs with an acyclic dependency DAG
    (docs/design/lanes.md#acyclic); `wire` then gives them their inputs and outputs. A node that
    reads another lane's value only for its own lane's later use is placed with that use
    (docs/design/lanes.md#wait-where-read). `lane_of_node` places nodes off their modality's lane
    (micro-batch sums): such a node starts a subgraph where it waits for another lane, and the lane
    that made its other operand is cut after it, in :data:`STAGGER_PIECES` parts by cost
    (docs/design/lanes.md#staggered-sums)."""
    subgraphs: list[Subgraph] = []
    dag = nx.DiGraph()
    open_sg: dict[int, Subgraph] = {}
    closed: set[int] = set()  # lanes whose open subgraph takes no more nodes
    held: dict[torch.fx.Node, None] = {}  # placed with their first reader, graph order
    placed_on = dict(lane_of_node or {})

    def lane_for(n: torch.fx.Node) -> int:
        return placed_on.get(n, lane_of.get(info(n).modality, 0))

    # the operands a sum reads from another lane, and the cost of a piece of their lane
    cut_after = {a for n, lane in placed_on.items() for a in n.args[:2]
                 if isinstance(a, torch.fx.Node) and lane_for(a) != lane}
    lane_cost: dict[int, float] = {}
    for n in nodes:
        if n.op in COMPUTE_OPS:
            lane = lane_for(n)
            lane_cost[lane] = lane_cost.get(lane, 0.0) + info(n).est_us
    piece_us = {lane: cost / STAGGER_PIECES for lane, cost in lane_cost.items()}

    def take_held(n: torch.fx.Node, chain: list[torch.fx.Node]) -> None:
        """The held nodes `n` reads, transitively, each after those it reads, out of `held`."""
        for a in n.all_input_nodes:
            if a in held:
                del held[a]
                take_held(a, chain)
                chain.append(a)

    def place(n: torch.fx.Node) -> None:
        if (producer := multi_output_producer(n)) is not None:  # docs/design/lanes.md#items-with-tuple
            home = subgraphs[info(producer).subgraph]
            home.nodes.append(n)
            info(n).lane, info(n).subgraph = home.lane, home.id
            return
        chain: list[torch.fx.Node] = []
        take_held(n, chain)
        lane = lane_for(n)
        deps = {info(a).subgraph for a in n.all_input_nodes if info(a).subgraph is not None}
        through_held = {info(a).subgraph for h in chain for a in h.all_input_nodes if info(a).subgraph is not None}
        # a write into a graph input waits for every earlier reader of that input
        # (docs/design/lanes.md#writes-after-readers)
        deps |= {info(r).subgraph for x in written_inputs(n) for r in readers_of(x)
                 if r is not n and info(r).subgraph is not None}
        deps |= through_held
        cur = open_sg.get(lane)
        waits_here = through_held | (deps if n in placed_on else set())
        if (cur is None or lane in closed or any(d != cur.id and nx.has_path(dag, cur.id, d) for d in deps)
                # what the held nodes (or a sum placed off its modality's lane) wait for starts a
                # new subgraph rather than hold up the open one
                or any(d != cur.id and not nx.has_path(dag, d, cur.id) for d in waits_here)):
            new = Subgraph(len(subgraphs), lane)
            subgraphs.append(new)
            dag.add_node(new.id)
            if cur is not None:
                dag.add_edge(cur.id, new.id)
            cur = open_sg[lane] = new
            closed.discard(lane)
        for m in (*chain, n):
            cur.nodes.append(m)
            info(m).lane, info(m).subgraph = lane, cur.id
        for d in deps:
            if d != cur.id:
                dag.add_edge(d, cur.id)
        if n in cut_after and cur.est_us >= piece_us.get(lane, 0.0):
            closed.add(lane)

    def place_held(h: torch.fx.Node) -> None:
        if h in held:
            del held[h]
            place(h)

    for n in nodes:
        if n.op not in COMPUTE_OPS:
            continue
        if held and (n.is_impure() or written_inputs(n)):  # every reader before a write, as in the graph
            for h in list(held):
                place_held(h)
        if n not in placed_on and waits_across_lanes(n, lane_of, lane_for):
            held[n] = None
        else:
            place(n)
    for h in list(held):  # read by nothing that comes later (the graph's outputs only)
        place_held(h)
    return subgraphs, dag


def waits_across_lanes(n: torch.fx.Node, lane_of: dict[str, int],
                       lane_for: Callable[[torch.fx.Node], int] | None = None) -> bool:
    """Whether `n` reads a value another lane makes and only its own lane reads `n` (docs/design/lanes.md#wait-where-read): a pure op with one tensor value, not a join (which
    waits for its towers whatever it reads). `lane_for`: a node's lane, where not its modality's."""
    lane_for = lane_for or (lambda x: lane_of.get(info(x).modality, 0))
    lane = lane_for(n)
    if (info(n).modality == FUSION or n.op != "call_function" or n.target is operator.getitem
            or n.is_impure() or is_random(n) or written_inputs(n)
            or not isinstance(n.meta.get("val"), torch.Tensor) or not n.users):
        return False
    if any(u.op not in COMPUTE_OPS or lane_for(u) != lane for u in n.users):
        return False
    return any(a.op in COMPUTE_OPS and lane_for(a) != lane for a in n.all_input_nodes)


def wire(subgraphs: list[Subgraph], nodes: list[torch.fx.Node], dag: nx.DiGraph) -> nx.DiGraph:
    """Each subgraph's inputs (values from outside, first-use order) and outputs (values read
    outside); the DAG without the edges others imply."""
    for sg in subgraphs:
        inside = set(sg.nodes)
        seen: dict[torch.fx.Node, None] = {}
        for n in sg.nodes:
            for a in n.all_input_nodes:
                if a not in inside and a.op != "get_attr":  # a constant: each subgraph reads its own (extract)
                    seen.setdefault(a, None)
        sg.inputs = list(seen)
    bind_symbols(subgraphs, nodes, dag)
    read = {a for sg in subgraphs for a in sg.inputs}
    for sg in subgraphs:
        inside = set(sg.nodes)
        sg.outputs = [n for n in sg.nodes if n in read or any(u not in inside for u in n.users)]
    # drop edges implied by others so the runtime waits on as few events as possible
    return nx.transitive_reduction(dag) if dag.number_of_edges() else dag


def multi_output_producer(n: torch.fx.Node) -> torch.fx.Node | None:
    """The op whose tuple or list `n` takes an item of (``operator.getitem``), where that op is
    already in a subgraph; else None."""
    if n.target is not operator.getitem or not isinstance(n.args[0], torch.fx.Node):
        return None
    producer = n.args[0]
    return producer if producer.op in COMPUTE_OPS and info(producer).subgraph is not None else None


def _symbols(val) -> set[sympy.Symbol]:
    """The free symbols of a ``meta["val"]``; none for a value torch cannot look into."""
    try:
        return set(free_symbols(val))
    except AssertionError:  # an opaque value: torch knows no sizes in it
        return set()


def plain_symbols(val) -> set[sympy.Symbol]:
    """The symbols Inductor binds from an input of this value: a SymInt (SymFloat) that is one
    symbol, a tensor's sizes and strides that are one symbol each (``codegen_input_symbol_assignment``).

    A SymInt input of a forward is bound to its placeholder expression, before the shape
    environment's replacements (torch's ``_get_placeholder_expr``), a backward's to the replaced
    one: where the two differ (Dynamo passed the batch size twice, ``s52`` known equal to ``s34``,
    and the subgraph's sizes say ``s34``) it binds neither for certain, and counts for none."""
    if isinstance(val, (torch.SymInt, torch.SymFloat)):
        expr = val.node.expr
        raw = getattr(val.node, "_expr", expr)
        return {expr} if isinstance(expr, sympy.Symbol) and raw == expr else set()
    if isinstance(val, torch.Tensor) and not val.is_sparse:
        dims = [*val.shape, *val.stride()]
    else:
        return set()
    symbolic = [d.node.expr for d in dims if isinstance(d, (torch.SymInt, torch.SymFloat))]
    return {e for e in symbolic if isinstance(e, sympy.Symbol)}


def symbol_binders(nodes: list[torch.fx.Node]) -> dict[sympy.Symbol, torch.fx.Node]:
    """Symbol -> the first node of the graph that binds it: the op making an unbacked symbol
    (torch's ``is_symbol_binding_fx_node``), else the first placeholder that binds it for certain
    (`plain_symbols`: a SymInt, or a tensor with the symbol as a plain size or stride). Graph inputs
    first: any subgraph can take them."""
    binders: dict[sympy.Symbol, torch.fx.Node] = {}
    for n in nodes:  # a SymInt placeholder binds what plain_symbols says it does, below
        if n.op != "placeholder" and "val" in n.meta and (s := is_symbol_binding_fx_node(n)) is not None:
            binders.setdefault(s, n)
    for n in nodes:
        if n.op == "placeholder":
            for s in sorted(plain_symbols(n.meta.get("val")), key=str):
                binders.setdefault(s, n)
    return binders


def unbound_symbols(sg: Subgraph) -> set[sympy.Symbol]:
    """Symbols in the sizes of `sg`'s inputs and values that no input of it binds and no node of
    it makes (an unbacked symbol made inside is Inductor's to define)."""
    needed = set().union(*(_symbols(n.meta.get("val")) for n in [*sg.inputs, *sg.nodes]))
    bound = set().union(*(plain_symbols(n.meta.get("val")) for n in sg.inputs))
    made = {s for n in sg.nodes if "val" in n.meta and (s := is_symbol_binding_fx_node(n)) is not None}
    return needed - bound - made


def bind_symbols(subgraphs: list[Subgraph], nodes: list[torch.fx.Node], dag: nx.DiGraph) -> None:
    """Append to each subgraph's inputs, in graph order, the binders of the symbols it needs but
    cannot bind (docs/design/lanes.md#symbols); a binder another subgraph makes is ordered before it. A
    binder that would close a cycle is left out: Inductor then fails and the graph falls back."""
    binders: dict[sympy.Symbol, torch.fx.Node] | None = None
    pos = {n: i for i, n in enumerate(nodes)}
    for sg in subgraphs:
        missing = unbound_symbols(sg)
        if not missing:
            continue
        binders = symbol_binders(nodes) if binders is None else binders
        extra = {binders[s] for s in missing if s in binders} - set(sg.inputs)
        for b in sorted(extra, key=pos.__getitem__):
            src = info(b).subgraph
            if src is not None:
                if nx.has_path(dag, sg.id, src):
                    continue
                dag.add_edge(src, sg.id)
            sg.inputs.append(b)


def drop_empty(subgraphs: list[Subgraph], dag: nx.DiGraph) -> tuple[list[Subgraph], nx.DiGraph]:
    """The subgraphs the boundary recompute left without nodes (each of its values copied into
    its readers) dropped, and the rest renumbered from 0 in their order, in the subgraphs, their
    nodes' annotations and the DAG: codegen would launch an empty subgraph, and another lane
    would wait for it. An empty subgraph's predecessors come straight before its successors, so
    every happens-before it carried holds."""
    empty = [sg.id for sg in subgraphs if not sg.nodes]
    if not empty:
        return subgraphs, dag
    dag = dag.copy()
    for sg_id in empty:
        dag.add_edges_from((p, s) for p in dag.predecessors(sg_id) for s in dag.successors(sg_id))
        dag.remove_node(sg_id)
    kept = [sg for sg in subgraphs if sg.nodes]
    new_id = {sg.id: i for i, sg in enumerate(kept)}
    for sg in kept:
        sg.id = new_id[sg.id]
        for n in sg.nodes:
            info(n).subgraph = sg.id
    return kept, nx.relabel_nodes(dag, new_id)


def costliest_on_main(subgraphs: list[Subgraph], lane_of: dict[str, int],
                      forward_main: frozenset[str] = frozenset()) -> tuple[dict[str, int], set[int], str]:
    """Move the costliest side lane's subgraphs (in place) and modalities to lane 0, when there are
    two or more side lanes (docs/design/lanes.md#costliest-on-main); the
    remaining side lanes are renumbered from 1 in order. A backward passes `forward_main`, the
    modalities on its forward's main lane: the side lane holding one of them moves instead (the
    costliest such), so each tower stays on one stream across the two graphs. Returns (lane_of,
    the moved subgraphs' ids, reason suffix)."""
    cost: dict[int, float] = {}
    for sg in subgraphs:
        if sg.lane != 0:
            cost[sg.lane] = cost.get(sg.lane, 0.0) + sg.est_us
    if len(cost) < 2:
        return lane_of, set(), ""
    followed = {lane for m, lane in lane_of.items() if m in forward_main and lane in cost}
    heavy = min(followed or cost, key=lambda lane: (-cost[lane], lane))
    renumber = {lane: i for i, lane in enumerate([0] + sorted(set(cost) - {heavy}))} | {heavy: 0}
    moved_ids = {sg.id for sg in subgraphs if sg.lane == heavy}
    for sg in subgraphs:
        sg.lane = renumber[sg.lane]
        for n in sg.nodes:
            info(n).lane = sg.lane
    names = ", ".join(sorted(m for m, lane in lane_of.items() if lane == heavy))
    why = (f"; {names} on the main lane, as in the forward" if followed
           else f"; the costliest ({names}) on the main lane")
    return {m: renumber[lane] for m, lane in lane_of.items()}, moved_ids, why


def run(gm: torch.fx.GraphModule, ctx) -> LanePlan:
    nodes = list(gm.graph.nodes)
    for n in nodes:
        info(n).lane = info(n).subgraph = None
    lane_of, reason = assign_lanes(nodes, ctx.options.max_lanes)
    micro_batched = (ctx.decisions.get("modality") or {}).get("micro_batches")
    sums = micro_batch_sums(nodes, lane_of) if micro_batched else {}
    scales = scaled_sums(sums)
    for scale, total in scales.items():
        total.append(scale)  # reads nothing else: graph order stays topological
    if scales:
        nodes = list(gm.graph.nodes)
    subgraphs, dag = segment(nodes, lane_of, {**sums, **{d: sums[t] for d, t in scales.items()}})
    recomputed = boundary.recompute_crossings(subgraphs, gm.graph)  # docs/design/lanes.md#boundary-recompute
    if recomputed["recomputed"]:
        gm.graph.lint()
        gm.recompile()
        nodes = list(gm.graph.nodes)
        subgraphs, dag = drop_empty(subgraphs, dag)
    dag = wire(subgraphs, nodes, dag)
    lane_of, moved, why = costliest_on_main(subgraphs, lane_of, frozenset(getattr(ctx, "forward_main_lane", None) or ()))
    reason += why
    if sums:
        pieces = sum(1 for sg in subgraphs if any(n in sums for n in sg.nodes))
        reason += (f"; {len(sums)} gradient sums on their later micro-batch's lane, as each gradient is made, "
                   f"in {pieces} subgraphs")
    lanes: dict[int, list[str]] = {}
    for m, lane in sorted(lane_of.items(), key=lambda kv: (kv[1], kv[0])):
        lanes.setdefault(lane, []).append(m)
    used = {sg.lane for sg in subgraphs}
    lanes = {k: v for k, v in lanes.items() if k in used}
    # on the main lane, launch the joins' subgraphs before the moved tower's whenever the DAG allows:
    # one stream runs them in launch order, and another lane may be waiting for a join
    order = list(nx.lexicographical_topological_sort(dag, key=lambda i: (i in moved, i)))
    return LanePlan(lanes, subgraphs, dag, order, reason, recomputed)
