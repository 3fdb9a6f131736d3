"""Checkpoint pass: which forward values the backward reads saved, and which it recomputes.

Runs on the joint forward+backward graph (``JOINT_PASSES``), before the min-cut partitioner
splits it, and only when ``options.memory_budget`` is set (default ``None``: the pass does
nothing at all).

Reads  ``options.memory_budget``; ``node.meta["val"]`` and the module stacks (through the
       modality pass, for per-modality budgets); the roofline cost of each node
       (:func:`apollo_compile.passes.cost.node_cost` on ``ctx.device``).
Writes ``node.meta["recompute"]`` (:class:`torch.utils.checkpoint.CheckpointPolicy`) on the joint
       graph's nodes, which the partitioner honours (see the NOTE below). It leaves no
       ``node.meta["apollo"]`` on the joint graph: the partitioner copies node meta shallowly,
       so an annotation there would be one object shared by a forward node and its recomputed
       copy in the backward.
       :func:`mark_saved` (a graph pass on the forward graph) writes ``NodeInfo.saved`` on the
       values the forward hands to the backward. ``NodeInfo.recomputed`` on the backward graph
       is the modality pass's (``partitioner_tag == "is_forward"``).

The budget bounds the *peak* activation bytes of the backward, predicted by running the
partitioned backward's order symbolically: what is saved for it and what it recomputes, each
value from its creation to its last reader (see the NOTE on the peak). It is a fraction of the
plain partition's (min-cut, untagged) peak, a byte count, or a fraction per modality.
Activation bytes count each saved storage once (a saved view costs its base) and leave out
graph inputs (parameters, user inputs), which are alive anyway. The plain partition is
measured, not guessed: the pass runs the min-cut partitioner on a copy of the joint graph.

The plan, greedy from the plain partition:
1. Candidates are forward ops whose output is saved. Recomputing op ``o`` frees its saved
   outputs and needs its inputs in the backward: each is saved unless it already is, is being
   recomputed, or is a graph input. A move must strictly lower the saved bytes it is meant to
   lower and, on the cheap *groups* estimate of the peak (NOTE on the peak), raise no budgeted
   peak; when a single op does not lower the saved bytes, its newly needed inputs' ops join it
   (up to three rounds), e.g. a GELU with its matmul.
2. Order: memory-bound moves first, compute-bound ones (a matmul, attention, convolution in
   the move) only when no memory-bound move is left; within a tier, most estimated peak bytes
   freed per microsecond of recompute (roofline ``est_us``) first, then most saved bytes per
   microsecond (moves that trade saved bytes for a larger group, which later moves then fill),
   then graph order. ``MEMORY_BOUND_FIRST = False`` drops the tiers (bytes per microsecond
   alone); unmeasured since the peak replaced saved bytes as the budget's measure, so the
   issue's rule stays the default.
3. Stop at the first state whose simulated peak is within budget; when the moves run out
   first, take the state with the lowest simulated peak on the way, or per-block checkpointing
   (:meth:`_Planner.block_plan`) where its peak is lower still; "not met" if that is still over.
   The sequence of states does not depend on the budget, so a smaller budget never predicts a
   larger peak (the first state at or under a smaller budget comes no earlier, and its peak is
   under the larger budget's choice or it is that choice; the fallback is the lowest of all).
   Along the walk every step saves less, so there a smaller budget never saves more.
   Per-block checkpointing that meets the budget with room to spare is relaxed back toward it
   (:meth:`_Planner.relax`: re-run matmuls and attention saved again, most recompute time per
   byte first, each while the simulated peak stays within budget), and replaces the walk's
   plan where it re-runs less (roofline time of the added recompute). On the base CLIP (CPU
   prediction) that beats the walk from budget 0.4 down: 2.13 vs 2.59 ms of recompute at 0.4.
   With relaxation the budget-independence argument no longer covers every case; the tests'
   budget sweep checks the monotone peak on their model, and the CLIP sweep (0.5 .. 0.1) is
   monotone too.
4. Random ops (dropout, bernoulli, rand*, philox/rng ops: anything tagged
   ``nondeterministic_seeded``, attention with dropout) are never recomputed: their outputs are
   saved (MUST_SAVE), so the backward reuses the forward's mask instead of drawing a fresh one.
   Attention without dropout draws nothing and is recomputable (:func:`deterministic_attention`),
   ranked after every other move. (PyTorch's own
   ``activation_memory_budget`` knapsack could pick banned random ops for recomputation,
   which gave wrong gradients; here they are never candidates.)

[NOTE] The peak: why saved bytes alone are not the memory a budget buys

The partitioner's backward re-runs a recomputed value just before its first reader
(``reordering_to_mimic_autograd_engine``), together with every recomputed value it needs that is
not there yet, and each stays until its last reader. A plan that only counts saved bytes happily
recomputes a tower's residual stream: its last block's gradient then pulls every block's
recompute, each of which waits for its own block's gradient, and the backward holds about what
the plain partition saved. Measured: on the base CLIP at batch 8 (CPU, eager subgraphs) such a
plan at budget 0.05 saved 43 of 879 MiB and recomputed one 819 MiB connected chain; on the H200
at batch 64 its whole-run peak (4.34 GiB) was above the same planner's at budget 0.2 (3.61).

So the predicted peak is a simulation of that order (:meth:`_Planner.peaks`, one pass over the
graph per state): the backward's own nodes in joint order, each pulling its missing recomputed
ancestors; saved values live from the start, recomputed ones from their re-run, each until its
last reader. Under Inductor (``subgraph_compiler="inductor"``) a recomputed op holds memory only
if a library kernel (matmul, convolution, attention) writes or reads it: pointwise and reduction
recompute is fused into the kernels that read it (:func:`_materialized`). Towers whose backwards
run on two lanes at once can interleave their peaks, which a one-order simulation does not see.

[NOTE] Fused recompute: Inductor fuses a chain of recomputed pointwise ops into one kernel and
schedules it before the chain's *first* reader, writing every value of it that is read later. A
plan that saves the matmul outputs and recomputes a tower's residual stream therefore
materializes all of the tower's block inputs at the start of its backward. On the H200 (base
CLIP, batch 64, budget 0.05; benchmarks/diag_memory.py) the vision backward's generated code
allocated the (64, 197, 768) fp32 residuals one after another at its top, and the first step
peaked at 2.77 GiB allocated (parameters 0.60; the one-by-one simulation's activations ~0.6).
So under a fusing compiler the simulation re-runs such a group (:meth:`_Planner.fused`) whole at
its first use, holding every member something outside the group reads. Per-block checkpointing,
whose groups end at the saved block inputs, then predicts lower and is chosen below the walk's
reach: the same run's whole-run peak fell from 3.11 to 2.92 GiB, and the largest batch in 20 GiB
from [256, 512) to [512, 1024) (benchmarks/RESULTS.md, session 5).

The simulation decides when to stop; ranking the moves needs something cheaper: *groups*,
recomputed ops connected through what they read of each other (and both holding memory), pulled
together. Estimated peak = saved + the largest group; a move whose merged group grows by more
than the saved bytes it frees is not admitted. Transformers end up with about one group per
block and saved block inputs, what per-block checkpointing does by hand. The CPU tests check
that the simulated peak bounds the real partition's backward, run in its own order.

[NOTE] Offloaded per-block start: with ``offload_activations`` a saved value waits on the host
and the backward copies it back just before its first reader; from there it holds the GPU until
its last reader. Per-block checkpointing starts from what min-cut itself re-runs (cheap ops, to
save GPU bytes), and one such re-run can bring a saved value back early: on the base CLIP min-cut
re-runs the vision stem's norm from its fp32 input, so that input came back for the first block's
re-run and stayed until the stem's own backward, over the whole first block. At batch 512 the
H200's backward peaked 0.144 GiB over eager per-block checkpointing with ``save_on_cpu``
(session 14, benchmarks/offload_memory.py --snapshot: one more block-input-sized buffer live at
the peak). So once per-block checkpointing is chosen under offloading, the plan also tries it
without min-cut's re-runs outside the blocks (everything there saved, as the by-hand variant
does) and takes that where the backward simulates lower on the GPU (:meth:`_Planner.peaks` with
``on_gpu``: each offloaded value from its first reader on) and still meets what was met. The
price is host traffic for what min-cut re-ran. Only this choice uses the on-GPU simulation: the
walk, the choice of per-block checkpointing and the budget's targets count every saved byte, or
the walk would stop at plans that move most activations over PCIe every step.

[NOTE] How min_cut_rematerialization_partition reads the tags (torch 2.11 and 2.13 alike):

    source --inf--> X_in   X is banned from recompute: MUST_SAVE (ignored on views/getitems)
    X_in --inf--> sink      X must be recomputed: MUST_RECOMPUTE / PREFER_RECOMPUTE
    X_in --size--> X_out    cutting this edge saves X

A tag on some nodes only steers the cut; the untagged rest still follows min-cut's own
weights (and it also recomputes cheap ops on its own). So once the budget needs any change,
every forward op gets a tag, and the partition is the one planned here, byte for byte:
planned recomputes MUST_RECOMPUTE; every other forward op MUST_SAVE; views that a recompute
or the backward reads MUST_RECOMPUTE (free; their base is what is saved); nodes that only the
backward uses (weight transposes, detaches) MUST_RECOMPUTE, so they are computed there and
not saved. No ``ac_graph_id`` is set: ``cleanup_recompute_tags`` only rewrites tags between
two user checkpoint regions, and nodes that already carry a user's tag keep it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from ..annotations import info
from ..nodes import (deterministic_attention, is_library_kernel, is_random, is_view, nbytes, node_tensors,
                     storage_node)
from ..tracing import fw_metadata
from . import modality, offload
from .cost import node_cost

log = logging.getLogger("apollo_compile")

__all__ = ["CheckpointDecision", "mark_saved", "run"]

GLOBAL = "*"  # the constraint key of a budget over all modalities
MEMORY_BOUND_FIRST = True  # order rule 2's tiers; False: bytes freed per microsecond alone
_EXPAND_ROUNDS = 3
_RELAX_MISSES = 8  # relax(): refusals in a row before it stops trying (each try is one simulation)


@dataclass
class CheckpointDecision:
    """What the checkpoint pass decided for one joint graph (``ModelPlan.joint["checkpoint"]``)."""

    budget: Any  # as the user gave it
    targets: dict[str, int]  # peak activation bytes allowed: {"*": n}, or {modality: n}
    bytes_before: int  # activation bytes the plain partition saves
    bytes_after: int  # the same, with this pass's tags (what the forward hands the backward)
    peak_before: int = 0  # predicted peak activation bytes of the plain partition's backward
    peak_after: int = 0  # the same, with this pass's tags (NOTE on the peak)
    peak_before_by_modality: dict[str, int] = field(default_factory=dict)  # per target key
    peak_after_by_modality: dict[str, int] = field(default_factory=dict)
    recomputed: list[str] = field(default_factory=list)  # forward ops the backward re-runs (views left out)
    added: list[str] = field(default_factory=list)  # of those, the ones the plain partition saved
    saved: list[str] = field(default_factory=list)  # forward values the backward reads (graph inputs left out)
    extra_us: float = 0.0  # predicted extra backward time: roofline time of the added recomputes
    met: bool = True  # every target reached
    tagged: bool = False  # False: the plain partition already fits; no tag was written
    per_block: bool = False  # per-block checkpointing: below the walk's reach and lower, or re-running less
    relaxed: int = 0  # ops per-block checkpointing re-ran that the budget's room saves instead (relax)
    baseline: str = "min-cut"  # how bytes_before was found
    block_start: str = ""  # per-block under offloading: besides the blocks it re-runs min-cut's choice, or nothing

    def summary(self) -> dict[str, Any]:
        return {"budget": self.budget, "targets": self.targets, "bytes_before": self.bytes_before,
                "bytes_after": self.bytes_after, "peak_before": self.peak_before, "peak_after": self.peak_after,
                "recomputed": len(self.recomputed), "added": len(self.added),
                "extra_us": round(self.extra_us, 2), "met": self.met, "per_block": self.per_block,
                "relaxed": self.relaxed, **({"block_start": self.block_start} if self.block_start else {})}


# ---------------------------------------------------------------------------- node kinds


@contextlib.contextmanager
def attention_recomputed_as_is():
    """Partition with deterministic attention recomputed as it is.

    The min-cut partitioner wraps every recomputed op carrying the random tag in
    ``run_and_save_rng_state`` / ``run_with_rng_state`` (it stashes the generator's state), having
    asked ``has_recomputable_rng_ops``; for the call, that question leaves out
    :func:`deterministic_attention`, which draws nothing. A graph that also recomputes a truly
    random op (a user's checkpoint around dropout) is wrapped as before. The swap is process-wide:
    the partition runs inside Dynamo's compile, under its ``compile_lock``, so no other Dynamo
    compile partitions meanwhile (an ``aot_function`` called directly on another thread would)."""
    from torch._functorch import partitioners

    original = partitioners.has_recomputable_rng_ops

    def has_recomputable_rng_ops(fx_g: torch.fx.GraphModule) -> bool:
        return any(partitioners.must_recompute(n) and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
                   and not deterministic_attention(n) for n in fx_g.graph.nodes)

    partitioners.has_recomputable_rng_ops = has_recomputable_rng_ops
    try:
        yield
    finally:
        partitioners.has_recomputable_rng_ops = original


def _recomputable(node: torch.fx.Node) -> bool:
    """A forward op this pass may move to the backward."""
    if node.op != "call_function" or is_random(node) or "recompute" in node.meta:
        return False
    if not isinstance(node.target, torch._ops.OpOverload):
        return False  # higher-order ops, Python functions on SymInts
    if node.target._schema.is_mutable or node.target.namespace == "_c10d_functional":
        return False
    return bool(node_tensors(node))


def _heavy(node: torch.fx.Node, bound: str) -> bool:
    return bound == "compute" or is_library_kernel(node)


def _materialized(op: torch.fx.Node) -> bool:
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


def _block_of(node: torch.fx.Node) -> str | None:
    """``vision.blocks.3`` for a node of ``vision.blocks.3.mlp.0``: the outermost repeated block
    (module list or sequential entry) it is in, if any."""
    path = modality.innermost_path(node)
    if not path:
        return None
    parts = path.split(".")
    first = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return ".".join(parts[:first + 1]) if first is not None else None


# ---------------------------------------------------------------------------- graph facts


def _outputs(gm: torch.fx.GraphModule) -> list[Any]:
    """The flat outputs of an AOTAutograd graph (None for a gradient that is not there)."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    return list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]


def _num_fwd_outputs(gm: torch.fx.GraphModule) -> int | None:
    """Forward outputs of an AOTAutograd joint graph: (forward outputs..., one grad per primal)."""
    outputs = _outputs(gm)
    primals = [n for n in gm.graph.find_nodes(op="placeholder") if _is_primal(n)]
    n = len(outputs) - len(primals)
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    descs = out_node.meta.get("desc")
    if isinstance(descs, (list, tuple)) and len(descs) == len(outputs):
        by_desc = next((i for i, d in enumerate(descs) if d is None or "Grad" in type(d).__name__), len(descs))
        if by_desc != n:
            log.debug("apollo checkpoint: %d forward outputs by count, %d by desc; using desc", n, by_desc)
            n = by_desc
    return n if 0 < n <= len(outputs) and all(isinstance(o, torch.fx.Node) for o in outputs[:n]) else None


def _is_primal(node: torch.fx.Node) -> bool:
    target = str(node.target)
    return node.op == "placeholder" and "tangents" not in target and "seed" not in target and "offset" not in target


def _static_input_indices() -> list[int] | None:
    meta = fw_metadata()
    return list(getattr(meta, "static_input_indices", None) or []) if meta is not None else None


def _forward_nodes(gm: torch.fx.GraphModule, num_fwd: int) -> set[torch.fx.Node]:
    """Nodes the forward must compute: ancestors of the forward outputs (placeholders included)."""
    fw: set[torch.fx.Node] = set()
    stack = [o for o in _outputs(gm)[:num_fwd] if isinstance(o, torch.fx.Node)]
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


class _Planner:
    """Saved/recomputed states of one joint graph, and the greedy walk between them.

    A *value* is a non-view forward node (a plain op's output, or a getitem of a multi-output
    op); its *op* is the node that runs (the getitem's producer). A state is the set ``R`` of
    forward ops the backward re-runs; the values it saves follow from it.
    """

    def __init__(self, gm: torch.fx.GraphModule, num_fwd: int, spec, labels: dict[torch.fx.Node, str],
                 per_modality: bool, fuses_pointwise: bool = False, on_host=None) -> None:
        self.gm = gm
        self.on_host = on_host  # value -> whether the partition keeps it on the host if saved (offload)
        self.fw = _forward_nodes(gm, num_fwd)
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.key = {n: (labels.get(n) or "fusion") if per_modality else GLOBAL for n in gm.graph.nodes}
        self.cost: dict[torch.fx.Node, tuple[float, bool]] = {}
        for n in self.fw:
            if n.op == "call_function" and not is_view(n) and n.target is not operator.getitem:
                c = node_cost(n, spec)
                self.cost[n] = (c[4], _heavy(n, c[3]))
        self.inputs = {o: self.storages(o.all_input_nodes) for o in self.cost}
        self.bytes = {}
        # What the backward reads directly: inputs of every node outside the forward (tangent
        # closure and nodes only the backward uses), and gradients that are forward values.
        outputs = _outputs(gm)
        direct: list[torch.fx.Node] = []
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output") or n in self.fw:
                continue
            direct.extend(i for i in n.all_input_nodes if i in self.fw)
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
        first = min((self.order[u] for u in tangent_users), default=0)
        self.backward_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n not in self.fw
                               and (self.order[n] >= first or n.target is torch.ops.aten.copy_.default)]
        self.storage = {n: storage_node(n) for n in self.fw}
        self.values: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # op -> the values (storages) it makes
        for n, v in self.storage.items():
            if v is n and n.op != "placeholder":
                self.values.setdefault(self.op(n), []).append(n)
        # what a re-run op holds in the backward (NOTE on the peak): all of its outputs, or, when the
        # subgraph compiler fuses pointwise work into its readers, only what a kernel must write
        self.held = {o: self.nb(o) if not fuses_pointwise or _materialized(o) else 0 for o in self.cost}
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
        """The re-run ops, grouped by what they read of each other (NOTE on the peak)."""
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
        its first reader, so the group is re-run at once (NOTE: Fused recompute)."""
        members: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for o, r in self._components([o for o in rerun if not is_library_kernel(o)], lambda p, o: True).items():
            members.setdefault(r, []).append(o)
        return {o: group for group in members.values() if len(group) > 1 for o in group}

    def peaks(self, saved, rerun, on_gpu: bool = False) -> tuple[dict[str, int], int]:
        """Predicted peak activation bytes of the backward, per key and over all keys.

        The backward is run as the partitioner will order it (``reordering_to_mimic_autograd_
        engine``: its own nodes in joint order, each re-running just before it the recomputed
        values it needs that are not there yet). Saved values live from the start, recomputed
        ops (what they hold: ``self.held``) from their re-run, each until its last reader.
        Under a fusing compiler a fused group (:meth:`fused`) is re-run whole when one of its
        ops is first needed, and holds every value something outside the group reads later.
        With `on_gpu`, saved values that wait on the host (``self.on_host``) live from their first
        reader on, where the backward copies them back (NOTE: Offloaded per-block start)."""
        order: list[torch.fx.Node] = []
        done: set[torch.fx.Node] = set()
        group = self.fused(rerun) if self.fuses_pointwise else {}
        held = self.held
        if group:
            held = dict(held)
            for o, members in group.items():
                if not held[o] and (o in self.read_by_backward
                                    or any(r in rerun and r not in members for r in self.readers.get(o, ()))):
                    held[o] = self.nb(o)
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
                if x in self.fw and (x.op == "placeholder" or self.storage[x] in saved):
                    done.add(x)  # there already: a graph input, a saved value, a view of one
                    continue
                stack.append((x, True))
                if x in group and id(group[x]) not in pulled:  # the whole fused group, now
                    pulled.add(id(group[x]))
                    stack.extend((m, False) for m in reversed(group[x]) if m is not x and m not in done)
                stack.extend((i, False) for i in reversed(x.all_input_nodes) if i not in done)

        for n in self.backward_nodes:
            pull(n)
        owner: dict[torch.fx.Node, torch.fx.Node] = {}  # node -> the saved value / re-run op it holds
        for n in order:
            for i in n.all_input_nodes:
                if i in self.fw and i not in owner:
                    v = self.storage[i]
                    if v in saved:
                        owner[i] = v
                    elif v.op != "placeholder" and self.op(v) in rerun:
                        owner[i] = self.op(v)
        last: dict[torch.fx.Node, int] = {}
        arriving: dict[int, list[torch.fx.Node]] = {}
        away = {v for v in saved if self.on_host(v)} if on_gpu and self.on_host else set()
        for k, n in enumerate(order):
            for i in n.all_input_nodes:
                if i in owner:
                    if owner[i] in away and owner[i] not in last:
                        arriving.setdefault(k, []).append(owner[i])
                    last[owner[i]] = k
        live = self.by_key(saved - away)
        total = sum(live.values())
        peak, peak_total = dict(live), total
        dying: dict[int, list[torch.fx.Node]] = {}
        for x, k in last.items():
            dying.setdefault(k, []).append(x)
        for x in saved - away:
            if x not in last:
                dying.setdefault(-1, []).append(x)
        for x in dying.pop(-1, ()):
            live[self.key[x]] -= self.nb(x)
            total -= self.nb(x)
        for k, n in enumerate(order):
            for x in arriving.get(k, ()):
                live[self.key[x]] = live.get(self.key[x], 0) + self.nb(x)
                total += self.nb(x)
                peak[self.key[x]] = max(peak.get(self.key[x], 0), live[self.key[x]])
                peak_total = max(peak_total, total)
            if n in rerun and n in last:
                live[self.key[n]] = live.get(self.key[n], 0) + held[n]
                total += held[n]
                peak[self.key[n]] = max(peak.get(self.key[n], 0), live[self.key[n]])
                peak_total = max(peak_total, total)
            for x in dying.get(k, ()):
                size = held[x] if x in rerun else self.nb(x)
                live[self.key[x]] -= size
                total -= size
        return dict(sorted(peak.items())), peak_total

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

    def walk(self, start: set[torch.fx.Node], targets: dict[str, int]):
        """Greedy moves from `start` until every target is met; returns the final state, or, when
        the moves run out first, the state with the lowest predicted peak on the way: (re-run ops,
        saved values, met, its :meth:`peaks`).

        Moves are ranked and admitted on the groups estimate (:meth:`_best_move`, cheap); the
        predicted peak that decides when to stop is the simulated backward's (:meth:`peaks`)."""
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
                if o not in self.cost or not _recomputable(o) or self.key[o] not in over:
                    continue
                move = self._best_move(o, saved, rerun, groups, largest, targets)
                if move is not None:
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
        block = {o: _block_of(o) for o in self.cost}
        rerun = set()
        for o, b in block.items():
            if b is not None and _recomputable(o) and all(block.get(r) == b for r in self.readers.get(o, ())):
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
                    and _recomputable(self.op(u)) and not deterministic_attention(self.op(u))}
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
        tier = 2 if deterministic_attention(o) else int(MEMORY_BOUND_FIRST and any(self.cost[x][1] for x in ops))
        return (tier, peak_delta.get(key, 0) / us, delta[key] / us, self.order[o]), ops


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


# ---------------------------------------------------------------------------- the pass


def _plain_partition(gm: torch.fx.GraphModule, num_fwd: int):
    """Run the untagged min-cut partition on a copy: (names saved, names recomputed)."""
    from functorch.compile import min_cut_rematerialization_partition

    with warnings.catch_warnings():  # deep-copying the codegen's pytree specs warns on torch 2.13
        warnings.simplefilter("ignore", FutureWarning)
        trial = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    kwargs: dict[str, Any] = {"num_fwd_outputs": num_fwd}
    static = _static_input_indices()
    if static is not None:
        kwargs["static_lifetime_input_indices"] = static
    fw, bw = min_cut_rematerialization_partition(trial, None, **kwargs)
    fw_out = _outputs(fw)
    saved = {n.name for n in fw_out[num_fwd:] if isinstance(n, torch.fx.Node)}
    rerun = {n.name for n in bw.graph.nodes
             if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward"}
    return saved, rerun


def _cse(gm: torch.fx.GraphModule) -> None:
    """What the partitioner does first, done here so the plan sees the graph it will cut."""
    gm.graph.eliminate_dead_code()
    try:
        from torch._functorch import config as functorch_config
        from torch._functorch.compile_utils import fx_graph_cse

        if functorch_config.cse:
            gm.graph = fx_graph_cse(gm.graph)
    except Exception as e:  # pragma: no cover - private API moved; the partitioner will CSE anyway
        log.debug("apollo checkpoint: CSE skipped (%s)", e)
    gm.recompile()


def _targets(budget: Any, before: dict[str, int], total: int) -> dict[str, int]:
    if isinstance(budget, Mapping):
        return {m: int(frac * before.get(m, 0)) for m, frac in sorted(budget.items())}
    if isinstance(budget, float) or budget == 1:
        return {GLOBAL: int(budget * total)}
    return {GLOBAL: int(budget)}


def run(gm: torch.fx.GraphModule, ctx) -> CheckpointDecision | None:
    """Tag the joint graph so the partition keeps activations within ``ctx.options.memory_budget``."""
    budget = ctx.options.memory_budget
    if budget is None:
        return None
    _cse(gm)
    num_fwd = _num_fwd_outputs(gm)
    if num_fwd is None:
        log.warning("apollo: memory_budget ignored for %s: cannot tell its forward outputs apart", ctx.name)
        return None
    per_modality = isinstance(budget, Mapping)
    labels = modality.labels_of(gm, ctx) if per_modality else {}
    on_host = None
    if ctx.options.offload_activations:
        model_outputs = set(_outputs(gm)[:num_fwd])
        on_host = lambda v: offload.waits_on_host(v, model_outputs)  # noqa: E731
    planner = _Planner(gm, num_fwd, ctx.device, labels, per_modality,
                       fuses_pointwise=ctx.options.subgraph_compiler == "inductor", on_host=on_host)
    by_name = {n.name: n for n in gm.graph.nodes}

    try:
        saved_names, rerun_names = _plain_partition(gm, num_fwd)
        baseline = "min-cut"
    except Exception as e:  # the plan still works from "recompute nothing"
        log.warning("apollo: memory_budget: trial partition failed (%s: %s); measuring from no recomputation",
                    type(e).__name__, e)
        saved_names, rerun_names, baseline = None, set(), "no-recompute"
    start = {by_name[s] for s in rerun_names if s in by_name and by_name[s] in planner.cost}
    if saved_names is None:
        plain_saved, _ = planner.close(start)
    else:
        plain_saved = set(planner.storages((by_name[s] for s in saved_names if s in by_name), fw_only=False))
    _, plain_rerun = planner.close(start)
    before, peak_before = planner.peaks(plain_saved, plain_rerun)
    bytes_before = sum(planner.by_key(plain_saved).values())
    targets = _targets(budget, before, peak_before)

    decision = CheckpointDecision(budget=budget, targets=targets, bytes_before=bytes_before, bytes_after=bytes_before,
                                  peak_before=peak_before, peak_after=peak_before,
                                  peak_before_by_modality=dict(before), peak_after_by_modality=dict(before),
                                  recomputed=_names(plain_rerun), saved=_names(plain_saved), baseline=baseline)
    if all(before.get(k, 0) <= t for k, t in targets.items()):
        return decision  # the plain partition fits: leave it as it is

    rerun, saved, met, (after, peak_after) = planner.walk(start, targets)
    if not per_modality:
        # per-block checkpointing, relaxed back toward the budget where it has room: below the
        # walk's reach, taken if it peaks lower; within it, if it re-runs less (predicted time)
        block_saved, block_rerun = planner.close(start | planner.block_plan())
        block_after, block_peak = planner.peaks(block_saved, block_rerun)
        block_met = all(block_after.get(k, 0) <= t for k, t in targets.items())
        relaxed = 0
        if block_met:
            kept = len(block_rerun)
            block_rerun, block_saved, (block_after, block_peak) = planner.relax(block_rerun, targets)
            relaxed = kept - len(block_rerun)
        if met:
            better = block_met and planner.extra_us(block_rerun, plain_rerun) < planner.extra_us(rerun, plain_rerun)
        else:
            better = block_peak < peak_after
        if better:
            saved, rerun, after, peak_after, met = block_saved, block_rerun, block_after, block_peak, block_met
            decision.per_block, decision.relaxed = True, relaxed
            if on_host is not None:
                decision.block_start = "min-cut"
                offloaded = _offloaded_block_start(planner, start, saved, rerun, targets, met)
                if offloaded is not None:
                    saved, rerun, after, peak_after, met = offloaded
                    decision.block_start = "nothing"
    _tag(gm, planner, num_fwd, rerun)
    added = rerun - plain_rerun
    decision.bytes_after = sum(planner.by_key(saved).values())
    decision.peak_after_by_modality, decision.peak_after = after, peak_after
    decision.recomputed = _names(rerun)
    decision.added = _names(added)
    decision.saved = _names(saved)
    decision.extra_us = planner.extra_us(rerun, plain_rerun)
    decision.met = met
    decision.tagged = True
    if not met:
        log.warning("apollo: memory_budget %r not reached for %s: predicted peak %d of %d activation bytes "
                    "(%d saved; random ops are never recomputed, so their outputs and inputs stay, "
                    "and recomputing more would hold a larger group at once)",
                    budget, ctx.name, decision.peak_after, peak_before, decision.bytes_after)
    log.info("apollo: %s checkpoint: predicted peak activations %d -> %d bytes (saved %d -> %d), "
             "%d ops recomputed, +%.1f us", ctx.name, peak_before, decision.peak_after, bytes_before,
             decision.bytes_after, len(added), decision.extra_us)
    return decision


def _offloaded_block_start(planner: _Planner, start: set[torch.fx.Node], saved: set[torch.fx.Node],
                           rerun: set[torch.fx.Node], targets: dict[str, int], met: bool):
    """Per-block checkpointing (`rerun`, from min-cut's own re-runs `start`, saving `saved`) when
    saved values wait on the host: the same without min-cut's re-runs outside the blocks, if its
    backward simulates lower on the GPU and it still meets `targets` where `rerun` did (NOTE:
    Offloaded per-block start). Returns (saved, re-run, peaks per key, peak, met), or None to keep
    `rerun`."""
    trial_saved, trial_rerun = planner.close(rerun - (start - planner.block_plan()))
    if trial_rerun == rerun:
        return None
    if planner.peaks(trial_saved, trial_rerun, on_gpu=True)[1] >= planner.peaks(saved, rerun, on_gpu=True)[1]:
        return None
    after, peak = planner.peaks(trial_saved, trial_rerun)
    trial_met = all(after.get(k, 0) <= t for k, t in targets.items())
    if met and not trial_met:
        return None
    return trial_saved, trial_rerun, after, peak, trial_met


def _names(nodes) -> list[str]:
    return sorted(n.name for n in nodes)


def _is_alias(node: torch.fx.Node) -> bool:
    """A view, or a piece of a view op that returns several (split, unbind)."""
    return is_view(node) or (node.target is operator.getitem and is_view(node.args[0]))


def _tangent_closure(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes that depend on a tangent: they can only run in the backward."""
    closure: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and "tangents" in str(n.target)) or any(i in closure for i in n.all_input_nodes):
            closure.add(n)
    return closure


def _tag(gm: torch.fx.GraphModule, planner: _Planner, num_fwd: int, rerun: set) -> None:
    """Write the state as CheckpointPolicy tags that force exactly this partition (NOTE above)."""
    fw = planner.fw
    # Views on a path from a saved or recomputed value to a reader in the backward.
    readers = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and (n not in fw or n in rerun)]
    grads = [o for o in _outputs(gm)[num_fwd:] if isinstance(o, torch.fx.Node)]
    stack = [i for r in readers for i in r.all_input_nodes] + grads
    aliases: set[torch.fx.Node] = set()
    while stack:
        v = stack.pop()
        if v in aliases or v not in fw or not _is_alias(v):
            continue
        aliases.add(v)
        stack.extend(v.all_input_nodes)
    tangent_side = _tangent_closure(gm)
    for n in gm.graph.nodes:
        if n.op != "call_function" or "recompute" in n.meta or is_random(n) or not node_tensors(n):
            continue  # a user's checkpoint tag stays; random ops come below; SymInts are min-cut's
        if n not in fw:
            mutable = isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
            if n not in tangent_side and not mutable:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE  # only the backward reads it: run it there
            continue
        if _is_alias(n):
            if n in aliases:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        elif n.target is operator.getitem:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE if n.args[0] in rerun else CheckpointPolicy.MUST_SAVE
        else:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE if n in rerun else CheckpointPolicy.MUST_SAVE
    for n in gm.graph.nodes:  # random ops (and what they return) are saved, whoever reads them
        if n.op == "call_function" and "recompute" not in n.meta and is_random(n) and n in fw:
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            for u in n.users:
                if u.target is operator.getitem and "recompute" not in u.meta:
                    u.meta["recompute"] = CheckpointPolicy.MUST_SAVE


# ---------------------------------------------------------------------------- forward graph


def mark_saved(gm: torch.fx.GraphModule, ctx) -> dict | None:
    """Mark ``NodeInfo.saved`` on the values the forward graph hands to the backward.

    They are the forward graph's outputs after the user-visible ones (AOTAutograd's
    ``fw_metadata.num_forward``). Only with a memory budget, so plain dumps stay as they were.
    Returns the count and the activation bytes (each storage once, graph inputs left out).
    """
    if ctx.kind != "forward" or ctx.options.memory_budget is None:
        return None
    meta = fw_metadata()
    if meta is None:
        return None
    n_user = getattr(meta, "num_forward", None)
    if n_user is None:
        n_user = meta.num_forward_returns + getattr(meta, "num_outputs_rng_offset", 0)
    n_user += len(getattr(meta, "tokens", None) or ())
    values = [o for o in _outputs(gm)[n_user:] if isinstance(o, torch.fx.Node) and node_tensors(o)]
    storages: dict[torch.fx.Node, None] = {}
    for v in values:
        info(v).saved = True
        s = storage_node(v)
        if s.op != "placeholder":
            storages.setdefault(s, None)
    return {"values": len(values), "bytes": sum(nbytes(s) for s in storages)}
