"""Checkpoint pass: which forward values the backward reads saved, and which it recomputes.

Runs on the joint forward+backward graph (``JOINT_PASSES``), before the min-cut partitioner
splits it, and only when ``options.memory_budget`` is set (default ``None``: the pass does nothing).

Reads  ``options.memory_budget``; ``node.meta["val"]`` and the module stacks (through the
       modality pass, for per-modality budgets); the roofline cost of each node
       (:func:`apollo_compile.passes.cost.node_cost` on ``ctx.device``).
Writes ``node.meta["recompute"]`` (:class:`torch.utils.checkpoint.CheckpointPolicy`) on the joint
       graph's nodes, which the partitioner honours; no ``node.meta["apollo"]`` there (the
       partitioner copies meta shallowly, so a forward node and its recomputed copy would share
       one). :func:`mark_saved` (a pass on the forward graph) writes ``NodeInfo.saved``.

The budget bounds the backward's *peak* activation bytes, simulated over the partitioned
backward's order, as a fraction of the plain min-cut partition's peak, a byte count, or a fraction
per modality. The plan walks greedily from the plain partition (memory-bound moves first, most
bytes freed per microsecond of recompute), stops at the first state within budget, and otherwise
takes the lowest peak seen or per-block checkpointing, relaxed back toward the budget. Random ops
are never recomputed, so the backward reuses the forward's mask. The rules and their reasons:
docs/design/checkpointing.md (#plan, #budget); the search is :mod:`.recompute_planner`.

[NOTE] Once the budget needs any change, every forward op gets a tag: a tag on some nodes only
steers min-cut, whose untagged rest follows its own weights. Planned recomputes and views they
read are MUST_RECOMPUTE, every other forward op MUST_SAVE, nodes only the backward uses
MUST_RECOMPUTE; so the partition is the planned one, byte for byte (docs/design/checkpointing.md#tags).
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
from ..nodes import deterministic_attention, graph_outputs, is_random, is_view, nbytes, node_tensors, storage_node
from ..tracing import fw_metadata
from . import modality, offload
from .recompute_planner import GLOBAL, Planner

log = logging.getLogger("apollo_compile")

__all__ = ["CheckpointDecision", "attention_recomputed_as_is", "choose", "mark_saved", "num_fwd_outputs",
           "record", "run", "targets_of"]

MEMORY_BOUND_FIRST = True  # order rule 2's tiers; False: bytes freed per microsecond alone


@dataclass
class CheckpointDecision:
    """What the checkpoint pass decided for one joint graph (``ModelPlan.joint["checkpoint"]``)."""

    budget: Any  # as the user gave it
    targets: dict[str, int]  # peak activation bytes allowed: {"*": n}, or {modality: n}
    bytes_before: int  # activation bytes the plain partition saves
    bytes_after: int  # the same, with this pass's tags (what the forward hands the backward)
    peak_before: int = 0  # predicted peak activation bytes of the plain partition's backward
    peak_after: int = 0  # the same, with this pass's tags (docs/design/checkpointing.md#peak)
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


# ---------------------------------------------------------------------------- partitioner hook


@contextlib.contextmanager
def attention_recomputed_as_is():
    """Partition, or rematerialize a whole step's graph, with deterministic attention recomputed
    as it is.

    The min-cut partitioner wraps every recomputed op carrying the random tag in
    ``run_and_save_rng_state`` / ``run_with_rng_state`` (it stashes the generator's state), having
    asked ``has_recomputable_rng_ops``; for the call, that question leaves out
    :func:`deterministic_attention`, which draws nothing. A graph that also recomputes a truly
    random op (a user's checkpoint around dropout) is wrapped as before. AOTAutograd asks the same
    question of a forward-loss-backward graph (a whole step's: ``compile_step``) before it
    rematerializes the user's checkpoints there, and refuses any random op outright: without this,
    every attention layer under Hugging Face's ``gradient_checkpointing_enable()`` keeps such a step
    off one graph. The swap is process-wide: apollo's backend runs inside Dynamo's compile, under
    its ``compile_lock``, so no other Dynamo compile partitions meanwhile (an ``aot_function``
    called directly on another thread would)."""
    from torch._functorch import partitioners

    original = partitioners.has_recomputable_rng_ops

    def has_recomputable_rng_ops(fx_g: torch.fx.GraphModule) -> bool:
        return any(partitioners.must_recompute(n) and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
                   and not deterministic_attention(n) for n in fx_g.graph.nodes)

    holders = [partitioners] + [m for m in _remat_modules() if getattr(m, "has_recomputable_rng_ops", None) is original]
    for module in holders:
        module.has_recomputable_rng_ops = has_recomputable_rng_ops
    try:
        yield
    finally:
        for module in holders:
            module.has_recomputable_rng_ops = original


def _remat_modules() -> list:
    """The modules that import ``has_recomputable_rng_ops`` by name: AOTAutograd's rematerialization
    of a forward-loss-backward graph (torch 2.13; absent from older torches). Imported here, before
    the swap: imported first inside it (AOTAutograd imports it lazily), it would keep the swapped
    function for good."""
    try:
        from torch._functorch._activation_checkpointing import remat_using_tags_for_fwd_loss_bwd_graph_pass
    except ImportError:
        return []
    return [remat_using_tags_for_fwd_loss_bwd_graph_pass]


# ---------------------------------------------------------------------------- graph facts


def num_fwd_outputs(gm: torch.fx.GraphModule) -> int | None:
    """Forward outputs of an AOTAutograd joint graph: (forward outputs..., one grad per primal)."""
    outputs = graph_outputs(gm)
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
    fw_out = graph_outputs(fw)
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


def targets_of(budget: Any, before: dict[str, int], total: int, name: str = "") -> dict[str, int]:
    """Peak activation bytes a budget allows, per key: of the plain peak `total` (or per modality,
    of `before`), or the byte count itself. A tower the budget names that graph `name` saves
    nothing of gets a warning: a misspelt tower would otherwise be ignored without a word."""
    if isinstance(budget, Mapping):
        towers = sorted(m for m, n in before.items() if n)
        if missing := sorted(set(budget) - set(towers)):
            log.warning("apollo: memory_budget names %s, of which %s saves no activations (its towers: %s); "
                        "that part of the budget applies to nothing here", ", ".join(map(repr, missing)),
                        name or "this graph", ", ".join(towers) or "none")
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
    num_fwd = num_fwd_outputs(gm)
    if num_fwd is None:
        log.warning("apollo: memory_budget ignored for %s: cannot tell its forward outputs apart", ctx.name)
        return None
    per_modality = isinstance(budget, Mapping)
    labels = modality.labels_of(gm, ctx) if per_modality else {}
    on_host = None
    if ctx.options.offload_activations:
        model_outputs = set(graph_outputs(gm)[:num_fwd])
        on_host = lambda v: offload.waits_on_host(v, model_outputs)  # noqa: E731
    planner = Planner(gm, num_fwd, ctx.device, labels, per_modality,
                      fuses_pointwise=ctx.options.subgraph_compiler == "inductor", on_host=on_host,
                      memory_bound_first=MEMORY_BOUND_FIRST)
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
    targets = targets_of(budget, before, peak_before, ctx.name)

    decision = CheckpointDecision(budget=budget, targets=targets, bytes_before=bytes_before, bytes_after=bytes_before,
                                  peak_before=peak_before, peak_after=peak_before,
                                  peak_before_by_modality=dict(before), peak_after_by_modality=dict(before),
                                  recomputed=_names(plain_rerun), saved=_names(plain_saved), baseline=baseline)
    if all(before.get(k, 0) <= t for k, t in targets.items()):
        return decision  # the plain partition fits: leave it as it is

    state = choose(planner, start, plain_rerun, targets, per_modality, decision)
    _tag(gm, planner, num_fwd, state[1])
    record(decision, planner, plain_rerun, state)
    if not decision.met:
        log.warning("apollo: memory_budget %r not reached for %s: predicted peak %d of %d activation bytes "
                    "(%d saved; random ops are never recomputed, so their outputs and inputs stay, "
                    "and recomputing more would hold a larger group at once)",
                    budget, ctx.name, decision.peak_after, peak_before, decision.bytes_after)
    log.info("apollo: %s checkpoint: predicted peak activations %d -> %d bytes (saved %d -> %d), "
             "%d ops recomputed, +%.1f us", ctx.name, peak_before, decision.peak_after, bytes_before,
             decision.bytes_after, len(decision.added), decision.extra_us)
    return decision


def choose(planner: Planner, start: set[torch.fx.Node], plain_rerun: set[torch.fx.Node], targets: dict[str, int],
           per_modality: bool, decision: CheckpointDecision):
    """The state a budget of `targets` takes, from the re-runs `start` (the plain partition's
    `plain_rerun`): the greedy walk's, or, for one budget over all modalities, per-block
    checkpointing relaxed back toward it: below the walk's reach, taken if it peaks lower; within
    it, if it re-runs less (predicted time). Writes ``per_block``, ``relaxed`` and ``block_start``
    on `decision`; returns (saved values, re-run ops, peaks per key, peak, met)."""
    rerun, saved, met, (after, peak_after) = planner.walk(start, targets)
    if per_modality:
        return saved, rerun, after, peak_after, met
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
        if planner.on_host is not None:
            decision.block_start = "min-cut"
            offloaded = _offloaded_block_start(planner, start, saved, rerun, targets, met)
            if offloaded is not None:
                saved, rerun, after, peak_after, met = offloaded
                decision.block_start = "nothing"
    return saved, rerun, after, peak_after, met


def record(decision: CheckpointDecision, planner: Planner, plain_rerun: set[torch.fx.Node], state) -> None:
    """Write the state :func:`choose` returned on `decision`: bytes and peaks after, what is re-run."""
    saved, rerun, after, peak_after, met = state
    decision.bytes_after = sum(planner.by_key(saved).values())
    decision.peak_after_by_modality, decision.peak_after = after, peak_after
    decision.recomputed = _names(rerun)
    decision.added = _names(rerun - plain_rerun)
    decision.saved = _names(saved)
    decision.extra_us = planner.extra_us(rerun, plain_rerun)
    decision.met = met
    decision.tagged = True


def _offloaded_block_start(planner: Planner, start: set[torch.fx.Node], saved: set[torch.fx.Node],
                           rerun: set[torch.fx.Node], targets: dict[str, int], met: bool):
    """Per-block checkpointing (`rerun`, from min-cut's own re-runs `start`, saving `saved`) when
    saved values wait on the host: the same without min-cut's re-runs outside the blocks, if its
    backward simulates lower on the GPU and it still meets `targets` where `rerun` did
    (docs/design/checkpointing.md#offloaded-block-start). Returns (saved, re-run, peaks per key, peak, met), or None to keep
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


def _tag(gm: torch.fx.GraphModule, planner: Planner, num_fwd: int, rerun: set) -> None:
    """Write the state as CheckpointPolicy tags that force exactly this partition (module docstring, [NOTE])."""
    fw = planner.fw
    # Views on a path from a saved or recomputed value to a reader in the backward.
    readers = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and (n not in fw or n in rerun)]
    grads = [o for o in graph_outputs(gm)[num_fwd:] if isinstance(o, torch.fx.Node)]
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
    values = [o for o in graph_outputs(gm)[n_user:] if isinstance(o, torch.fx.Node) and node_tensors(o)]
    storages: dict[torch.fx.Node, None] = {}
    for v in values:
        info(v).saved = True
        s = storage_node(v)
        if s.op != "placeholder":
            storages.setdefault(s, None)
    return {"values": len(values), "bytes": sum(nbytes(s) for s in storages)}
