"""Step recompute pass: a whole step's ``memory_budget``, as recomputation inside its one graph.

``compile_step`` hands apollo one inference graph holding the forward and the backward
(step/whole_step.py): no joint graph reaches the checkpoint pass and no partitioner cuts it. With
``options.memory_budget`` set, this pass does their work on that graph:

1. the forward is every node before the graph's first backward node
   (:func:`.modality.backward_nodes`); the values it hands the backward are what later nodes read;
2. :class:`.recompute_planner.Planner` chooses the forward ops the backward re-runs, as on a joint
   graph (:func:`.checkpoint.choose`), from what a partition re-runs by itself
   (:func:`.recompute_planner.fused_for_free`): a fraction budget is of that state's simulated backward
   peak, as the module path's is of min-cut's;
3. each chosen op is copied right before the first later node that needs it, inputs first (the
   order the planner simulates), and the later nodes read the copies: the original dies at its
   last forward reader.

Without a budget the graph stays as traced, unless :data:`FUSED_BASELINE` is on: then it is
rewritten to step 2's starting state, what a partition re-runs by itself, and nothing more.

Random ops are never re-run (their outputs stay saved), nor ops whose values the graph returns; a
copy reads only saved values, graph inputs and other copies. The pass runs before ``updates``,
which then places an optimizer's write into a parameter after the copies that read it.

Reads ``options.memory_budget`` and ``subgraph_compiler``, the nodes' costs (through the planner).
Writes the copies into the graph; returns a :class:`StepRecomputeDecision`. :func:`label`, after
the passes that label towers, marks each copy ``NodeInfo.recomputed`` and ``copy_of``, each saved
value ``NodeInfo.saved``. Design: docs/design/checkpointing.md#the-whole-step-graph.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx

from ..annotations import FUSION, KEY, info
from ..nodes import graph_outputs, storage_node, written_inputs
from . import checkpoint, modality
from .recompute_planner import GLOBAL, Planner, fused_for_free

log = logging.getLogger("apollo_compile")

__all__ = ["FUSED_BASELINE", "StepRecomputeDecision", "label", "run"]

# Without a budget a whole step's graph saves all that autograd saved, where the module path's
# min-cut partition re-runs cheap pointwise work by itself. On, such a step re-runs that work too
# (the plain state below; docs/design/checkpointing.md#whole-step-baseline). Off: on HF CLIP at
# batch 128 it saves half the whole step's surplus memory over reduce-overhead's and costs 3% of
# its step (benchmarks/RESULTS.md#large-batches-bench_whole_step).
FUSED_BASELINE = False


@dataclass
class StepRecomputeDecision(checkpoint.CheckpointDecision):
    """The checkpoint decision of a whole step's graph, and the copies this pass made."""

    copies: dict[str, str] = field(default_factory=dict)  # copy's node name -> the forward node it re-runs
    peak_traced: int = 0  # predicted peak of the graph as traced (nothing re-run): what it holds without a budget

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "peak_traced": self.peak_traced, "copies": len(self.copies)}


def run(gm: torch.fx.GraphModule, ctx) -> StepRecomputeDecision | None:
    """Re-run forward ops in the backward of a whole step's graph so its saved activations keep
    within ``ctx.options.memory_budget`` (the module docstring says how); without a budget, with
    :data:`FUSED_BASELINE` on, re-run what a partition would by itself."""
    budget = ctx.options.memory_budget
    fuses_pointwise = ctx.options.subgraph_compiler == "inductor"
    baseline_only = budget is None and FUSED_BASELINE and fuses_pointwise
    if ctx.kind != "inference" or (budget is None and not baseline_only):
        return None
    nodes = list(gm.graph.nodes)
    backward = modality.backward_nodes(gm, ctx.kind)
    first = next((i for i, n in enumerate(nodes) if n in backward), None)
    if first is None:
        return None  # no backward (an inference graph of the module path): nothing is saved for one
    forward = {n for n in nodes[:first] if n.op in ("placeholder", "call_function")}
    later = [n for n in nodes[first:] if n.op != "output"]
    per_modality = isinstance(budget, Mapping)
    labels = modality.labels_of(gm, ctx) if per_modality else {}
    planner = Planner(gm, None, ctx.device, labels, per_modality,
                      fuses_pointwise=fuses_pointwise,
                      memory_bound_first=checkpoint.MEMORY_BOUND_FIRST, forward=forward,
                      pinned=_pinned(gm, nodes, forward, later))
    traced_saved, traced_rerun = planner.close(set())
    traced, peak_traced = planner.peaks(traced_saved, traced_rerun)
    start = fused_for_free(planner, sorted(budget) if per_modality else [GLOBAL])
    plain_saved, plain_rerun = planner.close(start)
    before, peak_before = planner.peaks(plain_saved, plain_rerun)
    bytes_before = sum(planner.by_key(plain_saved).values())
    if baseline_only:
        return _fused_baseline(gm, planner, later, (plain_saved, plain_rerun, before, peak_before),
                               sum(planner.by_key(traced_saved).values()), peak_traced, ctx.name)
    targets = checkpoint.targets_of(budget, before, peak_before, ctx.name)
    decision = StepRecomputeDecision(  # "after" is the graph as traced until a state is recorded
        budget=budget, targets=targets, bytes_before=bytes_before,
        bytes_after=sum(planner.by_key(traced_saved).values()), peak_before=peak_before, peak_after=peak_traced,
        peak_before_by_modality=dict(before), peak_after_by_modality=dict(traced),
        saved=sorted(v.name for v in traced_saved), baseline="fused-pointwise" if plain_rerun else "no-recompute",
        peak_traced=peak_traced)
    if all(traced.get(k, 0) <= t for k, t in targets.items()):
        return decision  # within the budget as traced: nothing to copy
    if all(before.get(k, 0) <= t for k, t in targets.items()):
        state = (plain_saved, plain_rerun, before, peak_before, True)  # the plain state is within it
    else:
        state = checkpoint.choose(planner, plain_rerun, plain_rerun, targets, per_modality, decision)
    # extra_us and `added` count what goes beyond the baseline's re-runs, which Inductor fuses
    # into their readers, as the module path's count beyond min-cut's
    checkpoint.record(decision, planner, plain_rerun, state)
    decision.copies = _rewrite(gm, planner, state[1], later)
    gm.graph.lint()
    gm.recompile()
    if not decision.met:
        log.warning("apollo: memory_budget %r not reached for %s: predicted peak %d of %d activation bytes "
                    "(random ops are never recomputed, nor values the step returns)",
                    budget, ctx.name, decision.peak_after, peak_before)
    log.info("apollo: %s recompute: predicted peak activations %d -> %d bytes (%d as traced; saved %d -> %d), "
             "%d ops recomputed (%d copies), +%.1f us", ctx.name, peak_before, decision.peak_after, peak_traced,
             bytes_before, decision.bytes_after, len(decision.recomputed), len(decision.copies), decision.extra_us)
    return decision


def _fused_baseline(gm: torch.fx.GraphModule, planner: Planner, later: list[torch.fx.Node], plain: tuple,
                    bytes_traced: int, peak_traced: int, name: str) -> StepRecomputeDecision:
    """The graph rewritten to the plain state (`plain`: saved, re-run, peaks per key, peak), no
    budget: `before` is the graph as traced, `after` that state; nothing beyond it is re-run."""
    saved, rerun, after, peak_after = plain
    decision = StepRecomputeDecision(
        budget=None, targets={}, bytes_before=bytes_traced, bytes_after=bytes_traced, peak_before=peak_traced,
        peak_after=peak_traced, baseline="fused-pointwise", peak_traced=peak_traced)
    if not rerun:
        return decision
    checkpoint.record(decision, planner, rerun, (saved, rerun, after, peak_after, True))
    decision.copies = _rewrite(gm, planner, rerun, later)
    gm.graph.lint()
    gm.recompile()
    log.info("apollo: %s re-runs what a partition would, no budget: predicted peak activations %d -> %d bytes, "
             "%d ops recomputed (%d copies)", name, peak_traced, peak_after, len(decision.recomputed),
             len(decision.copies))
    return decision


def _pinned(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], forward: set[torch.fx.Node],
            later: list[torch.fx.Node]) -> frozenset[torch.fx.Node]:
    """Forward ops the backward never re-runs: those whose values the graph returns (alive to its
    end anyway), those reading a graph input the graph writes before the last later node that
    reads a forward value (a copy there would read the written value), and those whose sizes
    depend on values (``nonzero``: the copy would bind the same unbacked symbol twice)."""
    pinned = set()
    for o in graph_outputs(gm):
        if isinstance(o, torch.fx.Node):
            s = storage_node(o)
            pinned.add(s.args[0] if s.target is operator.getitem else s)
    position = {n: i for i, n in enumerate(nodes)}
    last = max((position[n] for n in later if any(a in forward and a.op != "placeholder" for a in n.all_input_nodes)),
               default=-1)
    early_writes = {x for n in nodes[:last] for x in written_inputs(n)}
    pinned |= {n for x in early_writes for n in x.users if n in forward}
    pinned |= {n for n in forward if n.meta.get("unbacked_bindings")}  # a copy would bind its symbols again
    return frozenset(pinned)


def _rewrite(gm: torch.fx.GraphModule, planner: Planner, rerun: set[torch.fx.Node],
             later: list[torch.fx.Node]) -> dict[str, str]:
    """Copy the re-run ops before the first of `later` that reads them (inputs first) and point
    `later` at the copies. Returns copy name -> original name."""
    copies: dict[torch.fx.Node, torch.fx.Node] = {}

    def recomputed(x: torch.fx.Node) -> bool:
        if x not in planner.fw or x.op != "call_function":
            return False
        s = planner.storage[x]
        return s.op != "placeholder" and planner.op(s) in rerun

    def copy_of(value: torch.fx.Node, at: torch.fx.Node) -> torch.fx.Node:
        stack = [(value, False)]
        while stack:
            x, inputs_done = stack.pop()
            if x in copies or not recomputed(x):
                continue
            if not inputs_done:
                stack.append((x, True))
                stack.extend((a, False) for a in reversed(x.all_input_nodes))
                continue
            with gm.graph.inserting_before(at):
                c = gm.graph.node_copy(x, lambda a: copies.get(a, a))
            c.meta = dict(x.meta)
            ann = dataclasses.replace(x.meta[KEY]) if KEY in x.meta else info(c)
            c.meta[KEY] = dataclasses.replace(ann, recomputed=True, copy_of=x.name)
            copies[x] = c
        return copies.get(value, value)

    for n in later:
        for a in n.all_input_nodes:
            c = copy_of(a, n)
            if c is not a:
                n.replace_input_with(a, c)
    return {c.name: x.name for x, c in copies.items()}


def label(gm: torch.fx.GraphModule, ctx) -> dict | None:
    """After the towers are labelled: each copy is ``recomputed`` (the modality pass labels a
    whole step's nodes afresh) and, read by several towers' gradients, a join (``fusion``), as the
    modality pass labels a backward graph's recomputed values; each saved value is ``saved``."""
    decision = ctx.decisions.get("recompute")
    if decision is None or not decision.copies:
        return None
    by_name = {n.name: n for n in gm.graph.nodes}
    for name, original in decision.copies.items():
        a = info(by_name[name])
        a.recomputed, a.copy_of = True, original
        towers = {info(u).modality for u in by_name[name].users if u.op != "output"} | {a.modality}
        if len(towers - {FUSION}) > 1:
            a.modality = FUSION
    for name in decision.saved:
        if name in by_name:
            info(by_name[name]).saved = True
    return {"recomputed": len(decision.copies), "saved": len(decision.saved)}
