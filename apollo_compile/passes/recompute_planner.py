"""Recompute planner: the checkpoint pass's search for the forward ops the backward re-runs.

:mod:`apollo_compile.passes.checkpoint` runs it on the joint graph and writes the state it picks
as the partitioner's tags. A *state* is the set of forward ops the backward re-runs;
:class:`Planner` derives the values it saves, predicts the backward's peak activation bytes by
simulating the partitioned backward (:meth:`Planner.peaks`), walks greedily from the plain
partition toward a budget (:meth:`Planner.walk`) and builds per-block checkpointing
(:meth:`Planner.block_plan`, :meth:`Planner.relax`; with offloading, ``peaks(on_gpu=True)``). Op
costs are roofline times (:func:`apollo_compile.passes.cost.node_cost`) computed here on the joint
graph, which the cost pass never sees.

[NOTE] The peak is simulated, not summed: the partitioner's backward re-runs a recomputed value
just before its first reader, with every recomputed ancestor it needs, and each stays until its
last reader, so a plan that counts only saved bytes can recompute a whole residual stream at once
and hold what it saved. :meth:`Planner.peaks` runs that order; under Inductor only values a
library kernel writes or reads hold memory, and a fused chain of recomputed pointwise ops is
re-run whole at its first use (:meth:`Planner.fused`). The moves are ranked by a cheaper estimate,
saved bytes plus the largest connected group of recomputes (docs/design/checkpointing.md#peak,
#fused-recompute).

[NOTE] Under offloading, per-block checkpointing is also tried without min-cut's own re-runs
outside the blocks, which can bring an offloaded value back to the GPU early; it is taken where the
on-GPU simulation is lower (docs/design/checkpointing.md#offloaded-block-start).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

from ..nodes import (deterministic_attention, graph_outputs, is_library_kernel, is_random, is_view, nbytes, node_tensors,
                     storage_node)
from . import modality
from .cost import node_cost

__all__ = ["GLOBAL", "Planner", "block_of", "fused_for_free", "materialized", "recomputable"]

GLOBAL = "*"  # the constraint key of a budget over all modalities
_EXPAND_ROUNDS = 3
_RELAX_MISSES = 8  # relax(): refusals in a row before it stops trying (each try is one simulation)


# ---------------------------------------------------------------------------- node kinds


def recomputable(node: torch.fx.Node) -> bool:
    """A forward op the planner may move to the backward."""
    if node.op != "call_function" or is_random(node) or "recompute" in node.meta:
        return False
    if not isinstance(node.target, torch._ops.OpOverload):
        return False  # higher-order ops, Python functions on SymInts
    if node.target._schema.is_mutable or node.target.namespace == "_c10d_functional":
        return False
    return bool(node_tensors(node))


def _heavy(node: torch.fx.Node, bound: str) -> bool:
    return bound == "compute" or is_library_kernel(node)


def materialized(op: torch.fx.Node) -> bool:
    """Whether a compiler that fuses pointwise work (Inductor) still writes `op`'s output to memory
    when it is re-run: a library kernel's output, or an input of one (directly or through views
    and getitems). Pointwise and reduction work that only feeds fused kernels is recomputed inside
    them. (Inductor may still realize a value read by many kernels: the prediction is a model.)"""
    if is_library_kernel(op):
        return True
    stack, seen = list(op.users), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op != "call_function":
            continue
        if u.target is operator.getitem or is_view(u):
            stack.extend(u.users)
        elif is_library_kernel(u):
            return True
    return False


def block_of(node: torch.fx.Node) -> str | None:
    """``vision.blocks.3`` for a node of ``vision.blocks.3.mlp.0``: the outermost repeated block
    (module list or sequential entry) it is in, if any. An index after a Python attribute is no
    block: a model a compiled function reaches through its closure, as ``compile_step``'s does
    (``fn.__closure__.0.cell_contents.vision.blocks.3``)."""
    path = modality.innermost_path(node)
    if not path:
        return None
    parts = path.split(".")
    first = next((i for i, part in enumerate(parts) if part.isdigit() and not (i and parts[i - 1].startswith("__"))),
                 None)
    return ".".join(parts[:first + 1]) if first is not None else None


# ---------------------------------------------------------------------------- graph facts


def _forward_nodes(gm: torch.fx.GraphModule, num_fwd: int) -> set[torch.fx.Node]:
    """Nodes the forward must compute: ancestors of the forward outputs (placeholders included)."""
    fw: set[torch.fx.Node] = set()
    stack = [o for o in graph_outputs(gm)[:num_fwd] if isinstance(o, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n in fw:
            continue
        fw.add(n)
        stack.extend(n.all_input_nodes)
    # A multi-output op's other results (attention's logsumexp, layer norm's mean/rstd) are the
    # forward's too, even when only the backward reads them.
    fw.update([u for n in fw for u in n.users if u.target is operator.getitem])
    return fw


# ---------------------------------------------------------------------------- the plan


class Planner:
    """Saved/recomputed states of one joint graph, and the greedy walk between them.

    A *value* is a non-view forward node (a plain op's output, or a getitem of a multi-output
    op); its *op* is the node that runs (the getitem's producer). A state is the set ``R`` of
    forward ops the backward re-runs; the values it saves follow from it.

    A whole step's graph (passes/step_recompute.py) has no tangents and no forward outputs to
    count: it passes `forward`, the nodes before its backward (then `num_fwd` is unused, and every
    other op is the backward's, in graph order), and `pinned`, forward ops never re-run (their
    values live to the graph's end anyway).
    """

    def __init__(self, gm: torch.fx.GraphModule, num_fwd: int | None, spec, labels: dict[torch.fx.Node, str],
                 per_modality: bool, fuses_pointwise: bool = False, on_host=None,
                 memory_bound_first: bool = True, forward: set[torch.fx.Node] | None = None,
                 pinned: frozenset[torch.fx.Node] = frozenset()) -> None:
        self.gm = gm
        self.on_host = on_host  # value -> whether the partition keeps it on the host if saved (offload)
        self.memory_bound_first = memory_bound_first  # the checkpoint pass's MEMORY_BOUND_FIRST (rule 2)
        self.fw = _forward_nodes(gm, num_fwd) if forward is None else set(forward)
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.key = {n: (labels.get(n) or "fusion") if per_modality else GLOBAL for n in gm.graph.nodes}
        self.cost: dict[torch.fx.Node, tuple[float, bool]] = {}
        for n in self.fw:
            if n.op == "call_function" and not is_view(n) and n.target is not operator.getitem and n not in pinned:
                c = node_cost(n, spec)
                self.cost[n] = (c[4], _heavy(n, c[3]))
        self.inputs = {o: self.storages(o.all_input_nodes) for o in self.cost}
        self.bytes = {}
        # What the backward reads directly: inputs of every node outside the forward (tangent
        # closure and nodes only the backward uses), and gradients that are forward values.
        outputs = graph_outputs(gm)
        direct: list[torch.fx.Node] = []
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output") or n in self.fw:
                continue
            direct.extend(i for i in n.all_input_nodes if i in self.fw)
        if forward is None:
            direct.extend(o for o in outputs[num_fwd:] if isinstance(o, torch.fx.Node) and o in self.fw)
        self.direct = self.storages(direct)
        self.readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # op -> ops reading one of its values
        for o, values in self.inputs.items():
            for v in values:
                self.readers.setdefault(self.op(v), []).append(o)
        # the backward's own nodes in joint order from its first (a tangent's first reader), as
        # reordering_to_mimic_autograd_engine walks them; earlier ones (detaches of forward values)
        # run when a later node needs them; the forward value each node's memory is
        tangent_users = [u for n in gm.graph.find_nodes(op="placeholder") if "tangents" in str(n.target)
                         for u in n.users]
        first = min((self.order[u] for u in tangent_users), default=0) if forward is None else 0
        self.backward_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n not in self.fw
                               and (self.order[n] >= first or n.target is torch.ops.aten.copy_.default)]
        self.storage = {n: storage_node(n) for n in self.fw}
        self.values: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # op -> the values (storages) it makes
        for n, v in self.storage.items():
            if v is n and n.op != "placeholder":
                self.values.setdefault(self.op(n), []).append(n)
        # what a re-run op holds in the backward (docs/design/checkpointing.md#peak): all of its outputs, or, when the
        # subgraph compiler fuses pointwise work into its readers, only what a kernel must write
        self.held = {o: self.nb(o) if not fuses_pointwise or materialized(o) else 0 for o in self.cost}
        self.fuses_pointwise = fuses_pointwise
        self.read_by_backward = {self.op(v) for v in self.direct}

    def storages(self, nodes, fw_only: bool = True) -> list[torch.fx.Node]:
        """The distinct storages `nodes` are, graph inputs left out."""
        out: dict[torch.fx.Node, None] = {}
        for n in nodes:
            v = storage_node(n)
            if v.op != "placeholder" and (v in self.fw or not fw_only) and node_tensors(v):
                out.setdefault(v, None)
        return list(out)

    def op(self, value: torch.fx.Node) -> torch.fx.Node:
        return value.args[0] if value.target is operator.getitem else value

    def nb(self, value: torch.fx.Node) -> int:
        if value not in self.bytes:
            self.bytes[value] = nbytes(value)
        return self.bytes[value]

    def close(self, recompute: set[torch.fx.Node]) -> tuple[set[torch.fx.Node], set[torch.fx.Node]]:
        """(saved values, ops actually re-run) of the state `recompute`."""
        needed: set[torch.fx.Node] = set()
        stack = list(self.direct)
        while stack:
            v = stack.pop()
            if v in needed:
                continue
            needed.add(v)
            if self.op(v) in recompute:
                stack.extend(self.inputs.get(self.op(v), ()))
        saved = {v for v in needed if self.op(v) not in recompute}
        rerun = {self.op(v) for v in needed if self.op(v) in recompute}
        return saved, rerun

    def by_key(self, saved) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in saved:
            out[self.key[v]] = out.get(self.key[v], 0) + self.nb(v)
        return dict(sorted(out.items()))

    def _components(self, ops, joined) -> dict[torch.fx.Node, torch.fx.Node]:
        """Each of `ops` -> its component's root, ops linked where one reads the other's value and
        ``joined(producer, reader)`` agrees."""
        parent = {o: o for o in ops}

        def find(x):
            while parent[x] is not x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for o in parent:
            for v in self.inputs.get(o, ()):
                p = self.op(v)
                if p in parent and joined(p, o) and find(p) is not find(o):
                    parent[find(p)] = find(o)
        return {o: find(o) for o in parent}

    def groups(self, rerun: set[torch.fx.Node]) -> "_Groups":
        """The re-run ops, grouped by what they read of each other (docs/design/checkpointing.md#peak)."""
        # fused pointwise work (holding nothing) does not chain groups together
        root = self._components(rerun, lambda p, o: self.held[p] and self.held[o])
        size: dict[torch.fx.Node, dict[str, int]] = {}
        for o, r in root.items():
            per_key = size.setdefault(r, {})
            per_key[self.key[o]] = per_key.get(self.key[o], 0) + self.held[o]
        return _Groups(root, size)

    def fused(self, rerun: set[torch.fx.Node]) -> dict[torch.fx.Node, list[torch.fx.Node]]:
        """Re-run ops that a fusing compiler computes in one kernel: pointwise and reduction ops
        (no library kernel) connected through what they read of each other, each op -> its group
        (groups of two or more only). Inductor fuses such a chain whole and schedules it before
        its first reader, so the group is re-run at once (docs/design/checkpointing.md#fused-recompute)."""
        members: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for o, r in self._components([o for o in rerun if not is_library_kernel(o)], lambda p, o: True).items():
            members.setdefault(r, []).append(o)
        return {o: group for group in members.values() if len(group) > 1 for o in group}

    def peaks(self, saved, rerun, on_gpu: bool = False) -> tuple[dict[str, int], int]:
        """Predicted peak activation bytes of the backward, per key and over all keys
        (:func:`backward_peaks`)."""
        return backward_peaks(self, saved, rerun, on_gpu)

    def _move(self, ops: set[torch.fx.Node], saved: set[torch.fx.Node], rerun: set[torch.fx.Node]):
        """Bytes change per key and the values newly saved if `ops` join the recomputed set."""
        delta: dict[str, int] = {}
        for v in (v for o in ops for v in self.values.get(o, ()) if v in saved):
            delta[self.key[v]] = delta.get(self.key[v], 0) - self.nb(v)
        new: dict[torch.fx.Node, None] = {}
        stack = [u for o in ops for u in self.inputs[o]]
        seen: set[torch.fx.Node] = set()
        while stack:
            u = stack.pop()
            if u in seen or u in saved:
                continue
            seen.add(u)
            if self.op(u) in rerun:
                continue  # re-run already; it makes u too
            if self.op(u) in ops:
                stack.extend(self.inputs[self.op(u)])
                continue
            new[u] = None
            delta[self.key[u]] = delta.get(self.key[u], 0) + self.nb(u)
        return delta, list(new)

    def _merged(self, ops: set[torch.fx.Node], groups: "_Groups") -> dict[str, int]:
        """Bytes per key of the group `ops` would form with the groups they read or are read by."""
        roots = {groups.root[p] for o in ops if self.held[o]
                 for p in [self.op(v) for v in self.inputs[o]] + self.readers.get(o, [])
                 if p in groups.root and self.held[p]}
        out: dict[str, int] = {}
        for o in ops:
            out[self.key[o]] = out.get(self.key[o], 0) + self.held[o]
        for r in roots:
            for k, n in groups.size[r].items():
                out[k] = out.get(k, 0) + n
        return out

    def walk(self, start: set[torch.fx.Node], targets: dict[str, int],
             admit: Callable[[torch.fx.Node], bool] | None = None):
        """Greedy moves from `start` until every target is met; returns the final state, or, when
        the moves run out first, the state with the lowest predicted peak on the way: (re-run ops,
        saved values, met, its :meth:`peaks`).

        Moves are ranked and admitted on the groups estimate (:meth:`_best_move`, cheap); the
        predicted peak that decides when to stop is the simulated backward's (:meth:`peaks`).
        `admit` (an op -> bool), if given, refuses every move with an op it refuses."""
        recompute = set(start)
        saved, rerun = self.close(recompute)
        best = None
        while True:
            now, total = self.peaks(saved, rerun)
            excess = sum(max(0, now.get(k, 0) - t) for k, t in targets.items())
            if not excess:
                return rerun, saved, True, (now, total)
            if best is None or excess < best[0]:
                best = (excess, rerun, saved, (now, total))
            over = {k for k, t in targets.items() if now.get(k, 0) > t}
            groups = self.groups(rerun)
            largest = groups.largest()
            moves = []
            for o in sorted({self.op(v) for v in saved}, key=self.order.__getitem__):
                if o not in self.cost or not recomputable(o) or self.key[o] not in over:
                    continue
                move = self._best_move(o, saved, rerun, groups, largest, targets)
                if move is not None and (admit is None or all(admit(x) for x in move[1])):
                    moves.append(move)
            if not moves:
                return best[1], best[2], False, best[3]
            recompute |= min(moves, key=lambda m: m[0])[1]
            saved, rerun = self.close(recompute)
            recompute = set(rerun)

    def block_plan(self) -> set[torch.fx.Node]:
        """Per-block checkpointing, as a state: inside each repeated block (a module path with an
        index, ``vision.blocks.3``) every recomputable op is re-run except those whose values
        another block or the rest of the forward reads, so only what flows between blocks stays
        saved. A greedy walk never gets there (each step alone must look good); it is the plan of
        lowest peak for a stack of blocks, at the cost of re-running the blocks' forward."""
        block = {o: block_of(o) for o in self.cost}
        rerun = set()
        for o, b in block.items():
            if b is not None and recomputable(o) and all(block.get(r) == b for r in self.readers.get(o, ())):
                rerun.add(o)
        return rerun

    def relax(self, rerun: set[torch.fx.Node], targets: dict[str, int]):
        """From a state that meets `targets` with room to spare (per-block checkpointing
        overshoots: 0.152x of the base CLIP's plain peak for a budget of 0.3), save again the
        re-run library kernels (matmuls, attention) that cost the most time per byte they make,
        one at a time, each kept only if the simulated peak still meets every target: the time
        back that the budget leaves room for. Gives up after ``_RELAX_MISSES`` refusals in a row.
        Returns (re-run ops, saved values, :meth:`peaks`)."""
        saved, rerun = self.close(rerun)
        state = (rerun, saved, self.peaks(saved, rerun))

        def time_per_byte(o):
            return self.cost[o][0] / max(1, sum(self.nb(v) for v in self.values.get(o, ())))

        misses = 0
        for o in sorted((o for o in rerun if is_library_kernel(o)), key=lambda o: (-time_per_byte(o), self.order[o])):
            if o not in state[0]:
                continue  # no longer re-run: what read it is saved now
            trial_saved, trial_rerun = self.close(state[0] - {o})
            now, total = self.peaks(trial_saved, trial_rerun)
            if all(now.get(k, 0) <= t for k, t in targets.items()):
                state, misses = (trial_rerun, trial_saved, (now, total)), 0
            else:
                misses += 1
                if misses >= _RELAX_MISSES:
                    break
        return state

    def extra_us(self, rerun: set[torch.fx.Node], plain_rerun: set[torch.fx.Node]) -> float:
        """Predicted extra backward time of a state: roofline time of what it re-runs beyond the
        plain partition (summed in graph order, so equal states compare equal)."""
        return sum(self.cost[o][0] for o in sorted(rerun - plain_rerun, key=self.order.__getitem__))

    def _best_move(self, o, saved, rerun, groups, largest, targets):
        key = self.key[o]
        ops = {o}
        for _ in range(_EXPAND_ROUNDS + 1):
            delta, new = self._move(ops, saved, rerun)
            if delta.get(key, 0) < 0:
                break
            grow = {self.op(u) for u in new if self.op(u) in self.cost and self.key[self.op(u)] == key
                    and recomputable(self.op(u)) and not deterministic_attention(self.op(u))}
            if not grow:
                return None
            ops |= grow
        else:
            return None
        merged = self._merged(ops, groups)
        peak_delta = {k: delta.get(k, 0) + max(0, merged.get(k, 0) - largest.get(k, 0))
                      for k in set(delta) | set(merged)}
        if any(d > 0 for k, d in peak_delta.items() if k in targets or k == key):
            return None  # a larger group than the saved bytes it frees
        us = max(sum(self.cost[x][0] for x in ops), 1e-9)
        # attention last and only as a move of its own, so the moves before it are the ones made
        # without attention recompute (taken among the matmuls, it led the walk on the 4-layer test
        # model to a 1.7x higher peak: re-run early, it keeps q, k and v longer)
        tier = 2 if deterministic_attention(o) else int(self.memory_bound_first and any(self.cost[x][1] for x in ops))
        return (tier, peak_delta.get(key, 0) / us, delta[key] / us, self.order[o]), ops


def backward_peaks(planner: Planner, saved, rerun, on_gpu: bool = False) -> tuple[dict[str, int], int]:
    """Predicted peak activation bytes of the backward, per key and over all keys.

    The backward is run as the partitioner will order it (``reordering_to_mimic_autograd_
    engine``: its own nodes in joint order, each re-running just before it the recomputed
    values it needs that are not there yet). Saved values live from the start, recomputed
    ops (what they hold: ``planner.held``) from their re-run, each until its last reader.
    Under a fusing compiler a fused group (:meth:`Planner.fused`) is re-run whole when one of its
    ops is first needed, and holds every value something outside the group reads later.
    With `on_gpu`, saved values that wait on the host (``planner.on_host``) live from their first
    reader on, where the backward copies them back (docs/design/checkpointing.md#offloaded-block-start)."""
    order: list[torch.fx.Node] = []
    done: set[torch.fx.Node] = set()
    group = planner.fused(rerun) if planner.fuses_pointwise else {}
    held = planner.held
    if group:
        held = dict(held)
        for o, members in group.items():
            if not held[o] and (o in planner.read_by_backward
                                or any(r in rerun and r not in members for r in planner.readers.get(o, ()))):
                held[o] = planner.nb(o)
    pulled: set[int] = set()

    def pull(n: torch.fx.Node) -> None:  # n and the recomputed values it needs, inputs first
        stack = [(n, False)]
        while stack:
            x, expanded = stack.pop()
            if x in done:
                continue
            if expanded:
                done.add(x)
                order.append(x)
                continue
            if x in planner.fw and (x.op == "placeholder" or planner.storage[x] in saved):
                done.add(x)  # there already: a graph input, a saved value, a view of one
                continue
            stack.append((x, True))
            if x in group and id(group[x]) not in pulled:  # the whole fused group, now
                pulled.add(id(group[x]))
                stack.extend((m, False) for m in reversed(group[x]) if m is not x and m not in done)
            stack.extend((i, False) for i in reversed(x.all_input_nodes) if i not in done)

    for n in planner.backward_nodes:
        pull(n)
    owner: dict[torch.fx.Node, torch.fx.Node] = {}  # node -> the saved value / re-run op it holds
    for n in order:
        for i in n.all_input_nodes:
            if i in planner.fw and i not in owner:
                v = planner.storage[i]
                if v in saved:
                    owner[i] = v
                elif v.op != "placeholder" and planner.op(v) in rerun:
                    owner[i] = planner.op(v)
    last: dict[torch.fx.Node, int] = {}
    arriving: dict[int, list[torch.fx.Node]] = {}
    away = {v for v in saved if planner.on_host(v)} if on_gpu and planner.on_host else set()
    for k, n in enumerate(order):
        for i in n.all_input_nodes:
            if i in owner:
                if owner[i] in away and owner[i] not in last:
                    arriving.setdefault(k, []).append(owner[i])
                last[owner[i]] = k
    live = planner.by_key(saved - away)
    total = sum(live.values())
    peak, peak_total = dict(live), total
    dying: dict[int, list[torch.fx.Node]] = {}
    for x, k in last.items():
        dying.setdefault(k, []).append(x)
    for x in saved - away:
        if x not in last:
            dying.setdefault(-1, []).append(x)
    for x in dying.pop(-1, ()):
        live[planner.key[x]] -= planner.nb(x)
        total -= planner.nb(x)
    for k, n in enumerate(order):
        for x in arriving.get(k, ()):
            live[planner.key[x]] = live.get(planner.key[x], 0) + planner.nb(x)
            total += planner.nb(x)
            peak[planner.key[x]] = max(peak.get(planner.key[x], 0), live[planner.key[x]])
            peak_total = max(peak_total, total)
        if n in rerun and n in last:
            live[planner.key[n]] = live.get(planner.key[n], 0) + held[n]
            total += held[n]
            peak[planner.key[n]] = max(peak.get(planner.key[n], 0), live[planner.key[n]])
            peak_total = max(peak_total, total)
        for x in dying.get(k, ()):
            size = held[x] if x in rerun else planner.nb(x)
            live[planner.key[x]] -= size
            total -= size
    return dict(sorted(peak.items())), peak_total


@dataclass
class _Groups:
    root: dict[torch.fx.Node, torch.fx.Node]  # re-run op -> its group's representative
    size: dict[torch.fx.Node, dict[str, int]]  # representative -> bytes of the group's values per key

    def largest(self) -> dict[str, int]:
        """Per key, the most bytes one group holds of it."""
        out: dict[str, int] = {}
        for per_key in self.size.values():
            for k, n in per_key.items():
                out[k] = max(out.get(k, 0), n)
        return out


def fused_for_free(planner: Planner, keys) -> set[torch.fx.Node]:
    """The re-runs a partition under a fusing compiler makes by itself, as a state: the walk to
    the lowest peak of `keys` with moves of ops that hold nothing when re-run (pointwise work
    no library kernel reads, which Inductor fuses into the backward's kernels). Min-cut re-runs
    such ops unasked where that saves bytes (a GELU from its matmul's output); a whole step's
    graph, which no partitioner cuts, starts from them
    (docs/design/checkpointing.md#whole-step-baseline). Without a fusing compiler every
    re-run op holds its output: nothing."""
    if not planner.fuses_pointwise:
        return set()
    block = {o: block_of(o) for o in planner.cost}

    def free(o: torch.fx.Node) -> bool:  # and read within its block: a block's output re-run
        # this way would chain every block's recompute into one fused group (#fused-recompute)
        return not planner.held[o] and all(block.get(r) == block[o] for r in planner.readers.get(o, ()))

    return planner.walk(set(), dict.fromkeys(keys, 0), admit=free)[0]
