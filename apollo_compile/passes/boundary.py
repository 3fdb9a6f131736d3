"""Boundary recompute: a cheap elementwise value that one subgraph makes and another reads is
computed again where it is read, from what that subgraph reads anyway, instead of being handed
across the cut.

Called by the lanes pass between cutting the graph and wiring the subgraphs' inputs and outputs;
edits the graph (a copy of each recomputed chain before its first reader in the reading subgraph)
and the subgraphs' node lists.

A cut materializes what crosses it: compiled as one graph, Inductor inlines such a value into each
kernel that reads it, while a value read across a cut becomes a subgraph output, a buffer held
until its reader runs (docs/design/lanes.md#boundary-recompute, with the measurement). A value is
recomputed where it is read when:

- it is an elementwise op that draws no random numbers, or a view of one made in the same
  subgraph (an alias left crossing keeps the buffer alive);
- every reader of it in the reading subgraph is elementwise too, or a view read only by such
  readers, so Inductor inlines the recomputation;
- its inputs, through at most :data:`MAX_DEPTH` elementwise ops or views, are values that subgraph
  reads anyway, or graph inputs the graph never writes: no new value crosses, and no
  recomputation reads a parameter after its update;
- that holds in every subgraph that reads it, and no graph output is it.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from ..annotations import info
from ..nodes import in_graph_order, is_elementwise, is_view, nbytes, storage_node, written_inputs

MAX_DEPTH = 4  # elementwise ops and views recomputed per value, along any path to what is at hand


def _chain(value: torch.fx.Node, at_hand: set[torch.fx.Node], depth: int,
           chain: dict[torch.fx.Node, None]) -> bool:
    """Add to `chain` (inputs first) the ops that recompute `value` from `at_hand`; False if some
    input is neither at hand nor recomputable within `depth` more ops."""
    if value in at_hand or value in chain:
        return True
    if depth == 0 or value.target is operator.getitem or not (is_elementwise(value) or is_view(value)):
        return False
    if not all(_chain(a, at_hand, depth - 1, chain) for a in value.all_input_nodes):
        return False
    chain[value] = None
    return True


def recompute_crossings(subgraphs: list, graph: torch.fx.Graph) -> dict:
    """Recompute each cheap crossing value in the subgraphs that read it (see the module docstring).
    Returns how many values no longer cross and the bytes of their buffers (a view and its base
    count once)."""
    home = {n: sg for sg in subgraphs for n in sg.nodes}
    written = {x for n in graph.nodes for x in written_inputs(n)}
    free_inputs = {n for n in graph.nodes if n.op == "placeholder" and n not in written}
    reads: dict[int, set[torch.fx.Node]] = {}  # what each subgraph reads from outside and may read again
    for sg in subgraphs:
        inside = set(sg.nodes)
        reads[sg.id] = {a for n in sg.nodes for a in n.all_input_nodes
                        if a not in inside and storage_node(a) not in written}
    by_id = {sg.id: sg for sg in subgraphs}
    moved, buffers = 0, {}
    for value in [n for sg in subgraphs for n in sg.nodes]:
        src = home.get(value)
        if src is None or not _elementwise_storage(value, src, home):
            continue
        if any(home.get(u) is None for u in value.users):  # a graph output: materialized anyway
            continue
        readers: dict[int, list[torch.fx.Node]] = {}
        for u in value.users:
            if home[u] is not src:
                readers.setdefault(home[u].id, []).append(u)
        if not readers:
            continue
        plans = {}
        for sg_id, users in readers.items():
            if not all(_inlined(u, by_id[sg_id], home, MAX_DEPTH) for u in users):
                break
            chain: dict[torch.fx.Node, None] = {}
            at_hand = (reads[sg_id] - {value}) | free_inputs
            if not all(_chain(a, at_hand, MAX_DEPTH - 1, chain) for a in value.all_input_nodes):
                break
            at = _first_in_graph(users)
            if not _all_before(chain, at):
                break
            plans[sg_id] = ([*chain, value], at)
        else:
            for sg_id, (chain, at) in plans.items():
                _copy_into(by_id[sg_id], chain, readers[sg_id], at, graph, home)
                reads[sg_id].discard(value)  # no longer crosses there: a later chain must not read it
            moved += 1
            buffer = storage_node(value)  # a view's is its base's: counted once
            buffers.setdefault(buffer, nbytes(buffer))
            _drop_if_dead(value, src, graph, home)
    return {"recomputed": moved, "bytes": sum(buffers.values())}


def _elementwise_storage(value: torch.fx.Node, src, home: dict) -> bool:
    """An elementwise value, or a view of one made in the same subgraph (a ``detach`` of it that
    autograd saved for the backward, say): its buffer is freed only when no alias of it crosses."""
    if is_view(value):
        base = storage_node(value)
        return base is not value and home.get(base) is src and is_elementwise(base) and not is_view(base)
    return is_elementwise(value)


def _inlined(reader: torch.fx.Node, sg, home: dict, depth: int) -> bool:
    """`reader` and what reads it through views, all in `sg`, are elementwise: a recomputed value
    they read is inlined into their kernels, not written to a buffer of `sg`'s."""
    if is_elementwise(reader):
        return True
    if depth == 0 or not is_view(reader):
        return False
    return all(home.get(u) is sg and _inlined(u, sg, home, depth - 1) for u in reader.users)


def _drop_if_dead(value: torch.fx.Node, sg, graph: torch.fx.Graph, home: dict) -> None:
    """Erase `value`, and then each elementwise op or view of `sg` it read that nothing reads any more."""
    stack = [value]
    while stack:
        n = stack.pop()
        if n.users or home.get(n) is not sg or not (is_elementwise(n) or is_view(n)):
            continue
        inputs = n.all_input_nodes
        sg.nodes.remove(n)
        del home[n]
        graph.erase_node(n)
        stack.extend(inputs)


def _first_in_graph(users: list[torch.fx.Node]) -> torch.fx.Node:
    """The first of `users` in the graph's order. A subgraph's own node list is in an order of its
    own (a valid one, not always the graph's: OWL-ViT's backward), so its first reader there may
    come after another of its readers in the graph, which the copy must precede too."""
    return in_graph_order(users)[0]


def _all_before(chain: list[torch.fx.Node], at: torch.fx.Node) -> bool:
    """Whether every input of `chain` from outside it comes before `at` in the graph: a value the
    reading subgraph reads anyway may be made after its reader of the crossing value."""
    needed = {a for n in chain for a in n.all_input_nodes} - set(chain)
    return in_graph_order([*needed, at])[-1] is at


def _copy_into(sg, chain: list[torch.fx.Node], users: list[torch.fx.Node], at: torch.fx.Node,
               graph: torch.fx.Graph, home: dict) -> None:
    """Copy `chain` (inputs first; its last op is the crossing value) into `sg` before the first of
    `users` in `sg`'s order and, in the graph, before `at` (the first of them in the graph's), and
    point `users` at the copy."""
    position = {n: i for i, n in enumerate(sg.nodes)}
    first = min(users, key=position.__getitem__)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    with graph.inserting_before(at):
        for n in chain:
            c = graph.node_copy(n, lambda a: copies.get(a, a))
            c.meta = dict(n.meta)
            c.meta["apollo"] = dataclasses.replace(info(n), lane=sg.lane, subgraph=sg.id, recomputed=True,
                                                   modality=info(first).modality, backward=info(first).backward,
                                                   copy_of=info(n).copy_of or n.name)
            copies[n] = c
            home[c] = sg
    at = position[first]
    sg.nodes[at:at] = list(copies.values())
    value = chain[-1]
    for u in users:
        u.replace_input_with(value, copies[value])
