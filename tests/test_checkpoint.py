"""The checkpoint pass (``memory_budget``): what the backward recomputes instead of saving.

Numerics against eager on CPU with the eager subgraph compiler; the plan's properties (budget
met, monotone in the budget, predicted bytes = the bytes the partition really saves, random
ops never recomputed) on a joint graph captured once and re-planned per budget.
"""

import copy
import re
import warnings
import weakref
from unittest import mock

import pytest
import torch
from functorch.compile import min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

import apollo_compile
from apollo_compile import ApolloFallbackWarning, pipeline
from apollo_compile.devices import DEVICE_SPECS
from apollo_compile.nodes import is_library_kernel
from apollo_compile.options import ApolloOptions
from apollo_compile.passes import checkpoint, recompute_planner
from helpers import assert_trains_like_eager, inductor_entry
from models import TwoTower, two_tower_inputs

EAGER = {"subgraph_compiler": "eager"}


def batches(step):
    return two_tower_inputs(batch=4, seed=step)


def storage_bytes(nodes) -> int:
    """Activation bytes of saved values: each storage once, graph inputs left out."""
    roots = {checkpoint.storage_node(n) for n in nodes if isinstance(n, torch.fx.Node)}
    return sum(checkpoint.nbytes(r) for r in roots if r.op != "placeholder")


def column(listing: str, name: str) -> dict[str, str]:
    """node -> the cell of a left-aligned column of a dump listing, cut at the header's field starts."""
    header, *rows = listing.splitlines()[1:]
    start = re.search(rf"(?<!\S){re.escape(name)}(?!\S)", header).start()
    end = re.compile(r"\S").search(header, start + len(name)).start()
    return {row.split()[0]: row[start:end].strip() for row in rows}


def recomputed_rows(listing: str) -> dict[str, str]:
    """node -> modality, for the backward listing's call_function rows marked ``*`` (recomputed). A
    value the boundary recompute moved past a cut is found under its original's name too (its copy's
    mark ``copy-of-<node>``), with the modality of the first copy listed."""
    ops, mods = column(listing, "op"), column(listing, "modality")
    rows = {n: m for n, m in mods.items() if m.endswith("*") and ops[n] != "placeholder"}
    for line in listing.splitlines()[2:]:
        cells = line.split()
        origin = [m[len("copy-of-"):] for m in cells[-1].split(",") if m.startswith("copy-of-")]
        if origin and cells[0] in rows:
            rows.setdefault(origin[0], rows[cells[0]])
    return rows


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.35, 0.2])
def test_budget_trains_like_eager_and_is_honoured(budget):
    """0.2 is below what this 2-layer model can reach (each tower's MLP block is recomputed as one
    group, about a quarter of the plain peak): the plan with the lowest predicted peak, reported
    as not met."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)  # every graph runs apollo's runtime
        assert_trains_like_eager(TwoTower(), batches, {**EAGER, "memory_budget": budget}, steps=2)
    plan = apollo_compile.last_plan()
    decision = plan.joint["checkpoint"]
    assert decision.targets["*"] == int(budget * decision.peak_before)
    assert decision.peak_after <= decision.targets["*"] if budget >= 0.35 else not decision.met
    # The forward graph hands the backward exactly what the pass predicted.
    assert plan.forward.fallback is None
    assert plan.forward.decisions["saved"]["bytes"] == decision.bytes_after
    assert plan.backward.fallback is None
    # the forward's dump (its .apollo.json is this summary) reports the predicted bytes, before and after
    summary = plan.forward.summary()
    assert summary["checkpoint"] == decision.summary() and summary["saved"]["bytes"] == decision.bytes_after
    assert {"bytes_before", "bytes_after", "peak_before", "peak_after"} <= set(summary["checkpoint"])
    if budget == 1.0:  # the plain partition fits its own size: nothing is tagged
        assert not decision.tagged and decision.added == [] and decision.extra_us == 0
        return
    assert decision.tagged and decision.added and decision.extra_us > 0
    assert decision.bytes_after < decision.bytes_before and decision.peak_after < decision.peak_before
    # Dumps: `saved` marks in the forward listing, `*` on the recomputed ops in the backward one.
    saved_rows = [line for line in plan.forward.listing.splitlines() if line.endswith("saved")]
    assert len(saved_rows) == plan.forward.decisions["saved"]["values"]
    assert {line.split()[0] for line in saved_rows} >= set(decision.saved)
    assert set(decision.added) <= set(recomputed_rows(plan.backward.listing))


@pytest.mark.parametrize("budget", [None, 0.5, 0.2])
def test_recomputation_keeps_the_towers_backward_side_by_side(budget):
    """With the CLIP loss recomputed from the saved logits, the backward once labelled the whole
    loss region by one tower (nothing in it has a module path or a labelled input), so the other
    tower's lane waited for that tower's: on the H200 the budgeted backward's lanes ran no faster
    than one stream. Values the forward computed keep the forward's labels, and the two towers'
    backward subgraphs do not wait for each other (both wait for the small loss region)."""
    import importlib.util
    import os
    import sys

    import networkx as nx

    from apollo_compile.annotations import info

    # the benchmark model, tiny: its loss is what the bug needed (TwoTower's does not show it);
    # loaded under its own name, so no other test's `import clip` is affected
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "clip.py")
    spec = importlib.util.spec_from_file_location("apollo_test_benchmark_clip", path)
    clip = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(clip)

    options = {**EAGER, **({"memory_budget": budget} if budget is not None else {})}
    compiled = torch.compile(clip.build("tiny"), backend="apollo", options=options)
    compiled(*clip.make_batch(4, config="tiny")).backward()
    plan = apollo_compile.last_plan()
    lanes = plan.backward.decisions["lanes"]
    main = {tower: max((sg for sg in lanes.subgraphs if any(info(n).modality == tower for n in sg.nodes)),
                       key=lambda sg: sg.est_us) for tower in ("vision", "text")}
    assert main["vision"].lane != main["text"].lane  # one of them shares the main lane (the costliest)
    assert not nx.has_path(lanes.dag, main["vision"].id, main["text"].id)
    assert not nx.has_path(lanes.dag, main["text"].id, main["vision"].id)
    serial, concurrent = lanes.predicted_us()
    assert concurrent < 0.8 * serial


def test_bytes_per_microsecond_order_trains_like_eager_and_meets_the_budget(monkeypatch):
    """MEMORY_BOUND_FIRST = False (matmuls compete on bytes per microsecond; an experiment the
    benchmark runs): the same guarantees, a plan of its own."""
    torch.manual_seed(0)
    monkeypatch.setattr(checkpoint, "MEMORY_BOUND_FIRST", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        assert_trains_like_eager(TwoTower(), batches, {**EAGER, "memory_budget": 0.4}, steps=2)
    decision = apollo_compile.last_plan().joint["checkpoint"]
    assert decision.met and decision.added and decision.peak_after <= decision.targets["*"]


def test_cheap_memory_bound_ops_go_first():
    """At a mild budget only memory-bound ops are recomputed; matmuls and attention stay saved."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)  # no graph falls back
        compiled = torch.compile(TwoTower(), backend="apollo", options={**EAGER, "memory_budget": 0.8})
        compiled(*batches(0)).backward()
    decision = apollo_compile.last_plan().joint["checkpoint"]
    assert decision.met and decision.added
    heavy = ("mm", "addmm", "convolution", "attention")
    assert not [n for n in decision.added if n.rstrip("_0123456789") in heavy or "attention" in n], decision.added


def test_dropout_small_budget_matches_eager_with_same_seed():
    # Apollo's forward draws the dropout masks in eager's order (test_backend checks that without a
    # budget); saving the random ops' outputs keeps the backward on the same masks.
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)  # no graph falls back
        assert_trains_like_eager(TwoTower(dropout=0.3), batches, {**EAGER, "memory_budget": 0.2}, steps=2, seed=100)
    plan = apollo_compile.last_plan()
    decision = plan.joint["checkpoint"]
    assert decision.added and decision.bytes_after < decision.bytes_before
    bw_ops = [n for n in plan.backward.gm.graph.nodes if n.op == "call_function"]
    assert not [n for n in bw_ops if checkpoint.is_random(n)], "a random op was re-run in the backward"
    assert not [n for n in bw_ops if "rng" in str(n.target)], "the partitioner had to replay RNG state"


def test_per_modality_budget_recomputes_only_vision():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)  # no graph falls back
        assert_trains_like_eager(TwoTower(), batches, {**EAGER, "memory_budget": {"vision": 0.5, "text": 1.0}},
                                 steps=2)
    plan = apollo_compile.last_plan()
    decision = plan.joint["checkpoint"]
    assert decision.met and decision.added
    after, before = decision.peak_after_by_modality, decision.peak_before_by_modality
    assert after["vision"] <= decision.targets["vision"] < before["vision"]
    assert after["text"] == before["text"]
    assert plan.forward.decisions["saved"]["bytes"] == decision.bytes_after
    rows = recomputed_rows(plan.backward.listing)
    # vision's values only; one the text tower's gradient reads too runs as a join (fusion*)
    assert "vision*" in {rows[name] for name in decision.added} <= {"vision*", "fusion*"}


def test_memory_budget_none_changes_nothing(monkeypatch):
    """With the default budget the pass is inert: same plans, listings and runtime as without it."""

    def compile_once():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TwoTower(width=16, embed=8, layers=1)
        compiled = torch.compile(model, backend="apollo", options={**EAGER, "memory_budget": None})
        compiled(*two_tower_inputs(batch=2)).backward()
        plan = apollo_compile.last_plan()
        graphs = [plan.forward, plan.backward]
        tags = [n.name for g in graphs for n in g.gm.graph.nodes if "recompute" in n.meta]
        return plan, [g.listing for g in graphs], [g.runtime_source for g in graphs], tags

    plan, listings, sources, tags = compile_once()
    assert plan.joint["checkpoint"] is None and plan.forward.decisions["saved"] is None
    assert tags == [] and "saved" not in listings[0]
    monkeypatch.setattr(pipeline, "JOINT_PASSES", [p for p in pipeline.JOINT_PASSES if p[0] != "checkpoint"])
    monkeypatch.setattr(pipeline, "GRAPH_PASSES", [p for p in pipeline.GRAPH_PASSES if p[0] != "saved"])
    _, listings_without, sources_without, _ = compile_once()
    assert listings == listings_without and sources == sources_without


# ---------------------------------------------------------------------------- planner properties


def deepcopy_graph(gm):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 deep-copying pytree specs
        return copy.deepcopy(gm.graph)


def capture_joint(model, monkeypatch, inputs=None):
    """The joint graph of one training step (on `inputs`, default `batches(0)`), as the checkpoint
    pass would see it. The spy replaces the joint passes only while it captures."""
    captured = {}

    def spy(gm, ctx):
        captured["gm"] = torch.fx.GraphModule(gm, deepcopy_graph(gm))

    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "JOINT_PASSES", [("spy", spy)])
        compiled = torch.compile(model, backend="apollo", options=EAGER)
        compiled(*(inputs if inputs is not None else batches(0))).backward()
    return captured["gm"]


_JOINTS: dict[tuple, torch.fx.GraphModule] = {}


def shared_joint(monkeypatch, **model_kwargs):
    """The joint graph of ``TwoTower(**model_kwargs)`` on `batches(0)`, captured once for the
    module: the planner tests only read it (each plans on a copy), and a capture compiles a step."""
    key = tuple(sorted(model_kwargs.items()))
    if key not in _JOINTS:
        torch.manual_seed(0)
        _JOINTS[key] = capture_joint(TwoTower(**model_kwargs), monkeypatch)
    return _JOINTS[key]


# joint graph -> checkpoint.run's trial partition of it, untagged (checkpoint._plain_partition)
_PLAIN = weakref.WeakKeyDictionary()


def plan_and_partition(joint, budget):
    """(decision, bytes the min-cut partition really saves, backward ops re-run, the backward's
    peak activation bytes) for `budget`. The pass's trial partition of the untagged graph is the
    same for every budget on one joint graph (a copy of it, CSE'd alike): run once, then reused."""
    gm = torch.fx.GraphModule(joint, deepcopy_graph(joint))
    ctx = pipeline.GraphContext("sweep_joint", "joint", ApolloOptions.from_user({**EAGER, "memory_budget": budget}),
                                DEVICE_SPECS["H200"])
    trial = checkpoint._plain_partition

    def plain_once(gm, num_fwd):
        if joint not in _PLAIN:
            _PLAIN[joint] = (num_fwd, trial(gm, num_fwd))
        assert _PLAIN[joint][0] == num_fwd
        saved, rerun = _PLAIN[joint][1]
        return set(saved), set(rerun)

    with mock.patch.object(checkpoint, "_plain_partition", plain_once):
        decision = checkpoint.run(gm, ctx)
    for n in gm.graph.nodes:  # random ops are never left recomputable
        if checkpoint.is_random(n):
            assert n.meta.get("recompute") in (None, CheckpointPolicy.MUST_SAVE), n
    with checkpoint.attention_recomputed_as_is():  # as apollo's partition hook calls it
        fw, bw = min_cut_rematerialization_partition(gm, None, num_fwd_outputs=1)
    out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
    rerun = [n for n in bw.graph.nodes if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward"]
    # saved activations by name, each charged its storage in the forward (graph inputs left out)
    roots = {n.name: checkpoint.storage_node(n) for n in out[1:] if isinstance(n, torch.fx.Node)}
    saved = {name: root for name, root in roots.items() if root.op != "placeholder"}
    return decision, storage_bytes(out[1:]), rerun, backward_activation_peak(bw, saved)


def backward_activation_peak(bw, saved) -> int:
    """Most activation bytes the backward holds at once, run in its own order: the saved values
    (`saved`: placeholder name -> its storage in the forward) and the recomputed values, each
    storage from its creation (saved: the start) to its last reader. What a budget bounds."""
    import operator

    nodes = list(bw.graph.nodes)
    base = {}
    for n in nodes:
        if n.op == "placeholder":
            base[n] = saved.get(n.name)
            continue
        b = checkpoint.storage_node(n)
        if b.target is operator.getitem and b.args[0].op == "call_function":
            b = b.args[0]  # a piece of a multi-output op (layer norm's mean) lives with its outputs
        if b.op == "placeholder":
            b = saved.get(b.name)
        elif b.meta.get("partitioner_tag") != "is_forward":
            b = None  # the backward's own values: gradients, temporaries
        base[n] = b
    last = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            if base[a] is not None:
                last[base[a]] = i
    live = sum(checkpoint.nbytes(r) for r in set(saved.values()))
    peak = live
    for i, n in enumerate(nodes):
        if n.op == "call_function" and base[n] is n:
            live += checkpoint.nbytes(n)
            peak = max(peak, live)
        live -= sum(checkpoint.nbytes(r) for r, j in last.items() if j == i)
    return peak


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_budget_sweep_is_met_exact_and_monotone(dropout, monkeypatch):
    joint = shared_joint(monkeypatch, dropout=dropout, layers=4)
    previous = None
    for budget in [1.0, 0.9, 0.7, 0.5, 0.35, 0.25, 0.15, 0.1, 0.05]:
        decision, actual, rerun, backward_peak = plan_and_partition(joint, budget)
        if decision.tagged:
            assert actual == decision.bytes_after, budget  # the tags force the planned partition
            # the predicted peak bounds what the backward holds (a plan that saved little but
            # recomputed each tower in one piece once held nearly all of it at once)
            assert backward_peak <= decision.peak_after, budget
        assert decision.bytes_after <= decision.bytes_before and decision.peak_after <= decision.peak_before
        if decision.met:
            assert decision.peak_after <= decision.targets["*"], budget
        else:  # below what the walk and per-block checkpointing reach on this model
            assert budget <= (0.25 if dropout else 0.15), budget
        if previous is not None:
            assert decision.peak_after <= previous.peak_after, budget
            if not decision.per_block and not previous.per_block:  # along the walk: each step saves less, recomputes more
                assert decision.bytes_after <= previous.bytes_after, budget
                assert set(previous.added) <= set(decision.added) and decision.extra_us >= previous.extra_us - 1e-9
        assert not [n for n in rerun if checkpoint.is_random(n)]
        previous = decision


def test_byte_budget(monkeypatch):
    """A byte budget (at least 1 MiB, options.py) on a step whose activations are several times it."""
    torch.manual_seed(0)
    joint = capture_joint(TwoTower(width=64), monkeypatch, two_tower_inputs(batch=64, seed=0))
    budget = 2 * 2**20
    decision, actual, _, _ = plan_and_partition(joint, budget)
    assert decision.targets == {"*": budget} and decision.met and decision.bytes_before > 3 * budget
    assert actual == decision.bytes_after and decision.peak_after <= budget


def test_dropout_under_inductor_compiles_and_recompute_changes_no_gradient():
    """With Inductor compiling the subgraphs, random ops stay ATen calls on torch's generator
    (subgraphs.inductor_config): a dropout model runs apollo's runtime (Inductor's seeded random
    ops failed to lower in apollo's subgraphs, and such models fell back to eager ATen), and a
    budget that recomputes changes no gradient: the backward uses the forward's masks. (The masks
    are not eager's: Inductor decomposes dropout into rand < p where eager draws bernoulli; the
    eager-compiler tests above check equality with eager.) One layer a tower: each has its dropouts."""
    from helpers import TOLERANCE

    torch.manual_seed(0)
    base = TwoTower(width=16, embed=8, layers=1, dropout=0.3)
    results = []
    for options in ({}, {"memory_budget": 0.2}):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ApolloFallbackWarning)  # no graph falls back
            compiled = torch.compile(model, backend="apollo", options={"subgraph_compiler": "inductor", **options})
            torch.manual_seed(7)
            loss = compiled(*batches(0))
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert apollo_compile.last_plan().joint["checkpoint"].added
    (loss_full, grads_full), (loss_small, grads_small) = results
    tol = TOLERANCE["inductor"]
    torch.testing.assert_close(loss_small, loss_full, **tol)
    for name, g in grads_full.items():
        torch.testing.assert_close(grads_small[name], g, **tol, msg=lambda m: f"{name}: {m}")


def test_a_budget_frees_each_buffer_at_its_last_use(monkeypatch):
    """runtime/subgraphs.py, NOTE: Memory first frees at once: with a memory budget, every subgraph Inductor compiles has
    allow_buffer_reuse off (the wrapper deletes a buffer at its last use rather than hold it for a
    later same-size one); without one, Inductor's default stands. Read at Inductor's entry
    (helpers.inductor_entry)."""
    seen = []
    inductor_entry(monkeypatch, lambda gm, inputs, kwargs: seen.append(torch._inductor.config.allow_buffer_reuse))
    default = torch._inductor.config.allow_buffer_reuse
    for options, expected in (({"memory_budget": 0.3}, False), ({}, default)):
        torch._dynamo.reset()
        seen.clear()
        torch.manual_seed(0)
        compiled = torch.compile(TwoTower(width=16, embed=8, layers=1), backend="apollo",
                                 options={"subgraph_compiler": "inductor", **options})
        with warnings.catch_warnings():
            warnings.simplefilter("error", ApolloFallbackWarning)
            compiled(*two_tower_inputs(batch=2)).backward()
        plan = apollo_compile.last_plan()
        assert len(seen) == sum(len(g.lanes.subgraphs) for g in (plan.forward, plan.backward)), options
        assert set(seen) == {expected}, (options, seen)


def test_fused_recompute_holds_memory_only_where_a_library_kernel_reads_it(monkeypatch):
    """Under Inductor a recomputed op costs memory only if a library kernel (matmul, attention)
    writes or reads it; pointwise work that only feeds other fused kernels is recomputed inside
    them. Eager subgraphs hold every recomputed value."""
    joint = shared_joint(monkeypatch)
    gm = torch.fx.GraphModule(joint, deepcopy_graph(joint))
    num_fwd = checkpoint.num_fwd_outputs(gm)
    fused = recompute_planner.Planner(gm, num_fwd, DEVICE_SPECS["H200"], {}, False, fuses_pointwise=True)
    eager = recompute_planner.Planner(gm, num_fwd, DEVICE_SPECS["H200"], {}, False)
    assert all(eager.held[o] == checkpoint.nbytes(o) for o in eager.cost)
    by_name = {o.name: o for o in fused.cost}
    assert fused.held[by_name["addmm"]] > 0  # a matmul writes its output
    gelu = next(o for name, o in by_name.items() if name.startswith("gelu"))
    assert fused.held[gelu] > 0  # read by the next matmul
    # layer norm's output feeds the qkv matmul; the residual add feeds only the next layer norm and add
    pointwise_only = [o for o in fused.cost if o.target is torch.ops.aten.add.Tensor
                      and not recompute_planner.materialized(o)]
    assert pointwise_only and all(fused.held[o] == 0 for o in pointwise_only)


def test_on_gpu_the_peak_counts_offloaded_values_from_their_first_reader(monkeypatch):
    """docs/design/checkpointing.md#offloaded-block-start: with ``on_gpu`` a saved value that waits on the host holds
    the GPU from its first backward reader on, not from the backward's start. Nothing offloaded:
    the same peak; everything offloaded: lower, and never below the largest saved value, which
    comes back at some point."""
    joint = shared_joint(monkeypatch)
    gm = torch.fx.GraphModule(joint, deepcopy_graph(joint))
    planner = recompute_planner.Planner(gm, checkpoint.num_fwd_outputs(gm), DEVICE_SPECS["H200"], {}, False)
    saved, rerun = planner.close(set())
    _, everything = planner.peaks(saved, rerun)
    assert planner.peaks(saved, rerun, on_gpu=True)[1] == everything  # no on_host: nothing offloaded
    planner.on_host = lambda v: False
    assert planner.peaks(saved, rerun, on_gpu=True)[1] == everything
    planner.on_host = lambda v: True
    _, on_gpu = planner.peaks(saved, rerun, on_gpu=True)
    assert max(planner.nb(v) for v in saved) <= on_gpu < everything


def test_a_fused_recompute_chain_is_rerun_whole_at_its_first_use(monkeypatch):
    """Inductor fuses a chain of recomputed pointwise ops (a tower's residual stream, its matmul
    outputs saved) into one kernel scheduled before the chain's first reader, writing every value
    read later: on the H200 such a plan (budget 0.05, base CLIP, batch 64) peaked at 2.77 GiB
    allocated in its first step (parameters 0.60), where pulling each value when needed predicted
    about 0.6 GiB of activations. The
    simulation re-runs the group whole; per-block checkpointing, whose groups end at saved block
    inputs, then has the lower predicted peak."""
    joint = shared_joint(monkeypatch, dropout=0.0, layers=4)
    gm = torch.fx.GraphModule(joint, deepcopy_graph(joint))
    planner = recompute_planner.Planner(gm, checkpoint.num_fwd_outputs(gm), DEVICE_SPECS["H200"], {}, False,
                                        fuses_pointwise=True)
    pointwise = {o for o in planner.cost if recompute_planner.recomputable(o) and not is_library_kernel(o)}
    saved, rerun = planner.close(pointwise)
    group = planner.fused(rerun)
    residual = [o for o in rerun if o.target is torch.ops.aten.add.Tensor
                and recompute_planner.block_of(o) is not None
                and recompute_planner.block_of(o).startswith("vision.blocks.")]
    assert {recompute_planner.block_of(o) for o in residual} == {f"vision.blocks.{i}" for i in range(4)}
    assert all(group[o] is group[residual[0]] for o in residual)  # one chain through every block
    _, whole = planner.peaks(saved, rerun)
    monkeypatch.setattr(planner, "fused", lambda rerun: {})
    _, one_by_one = planner.peaks(saved, rerun)
    assert whole > one_by_one

    ctx = pipeline.GraphContext("fused_joint", "joint", ApolloOptions.from_user(
        {**EAGER, "subgraph_compiler": "inductor", "memory_budget": 0.05}), DEVICE_SPECS["H200"])
    decision = checkpoint.run(torch.fx.GraphModule(joint, deepcopy_graph(joint)), ctx)
    assert decision.per_block and decision.peak_after < decision.peak_before


def test_below_the_walks_reach_blocks_are_checkpointed_and_attention_recomputed():
    """A budget under what the greedy walk reaches gets per-block checkpointing when its predicted
    peak is lower: each block's ops re-run, attention included (no dropout: it draws nothing), only
    what flows between blocks saved. Gradients stay eager's."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)  # every graph runs apollo's runtime
        assert_trains_like_eager(TwoTower(layers=4), batches, {**EAGER, "memory_budget": 0.05}, steps=2)
    decision = apollo_compile.last_plan().joint["checkpoint"]
    assert decision.per_block and not decision.met
    assert [n for n in decision.added if "attention" in n]
    assert decision.peak_after < 0.25 * decision.peak_before  # the walk alone stopped at 0.25 here


def test_room_under_the_budget_buys_back_recompute_time(monkeypatch):
    """Per-block checkpointing meets a budget with room to spare; the pass then saves again the
    library kernels that cost the most time per byte while the predicted peak stays within the
    budget (relax): less predicted recompute time than per-block alone, budget still met, the
    real backward still bounded, gradients still eager's."""
    joint = shared_joint(monkeypatch, dropout=0.0, layers=4)
    relaxed, _, _, backward_peak = plan_and_partition(joint, 0.25)
    per_block, _, _, _ = plan_and_partition(joint, 0.1)  # out of reach: per-block as it is
    assert per_block.per_block and not per_block.met and per_block.relaxed == 0
    assert relaxed.per_block and relaxed.met and relaxed.relaxed > 0
    assert per_block.peak_after < relaxed.peak_after <= relaxed.targets["*"]
    assert relaxed.extra_us < per_block.extra_us and backward_peak <= relaxed.peak_after
    torch.manual_seed(0)
    assert_trains_like_eager(TwoTower(layers=4), batches, {**EAGER, "memory_budget": 0.25}, steps=2)
    assert apollo_compile.last_plan().joint["checkpoint"].relaxed > 0


def test_attention_with_dropout_is_never_recomputed():
    """The CUDA attention kernels' dropout draws random numbers: only dropout_p == 0 is recomputable."""
    aten = torch.ops.aten
    for op, p_index in ((aten._scaled_dot_product_flash_attention.default, 3),
                        (aten._scaled_dot_product_efficient_attention.default, 5),
                        (aten._scaled_dot_product_cudnn_attention.default, 5),
                        (aten._scaled_dot_product_flash_attention_for_cpu.default, 3)):
        for p, deterministic in ((0.0, True), (0.1, False)):
            graph = torch.fx.Graph()
            q, k, v = (graph.placeholder(name) for name in "qkv")
            args = [q, k, v] + [None] * (p_index - 3) + [p]
            if op is aten._scaled_dot_product_efficient_attention.default or op is aten._scaled_dot_product_cudnn_attention.default:
                args[4] = True  # compute_log_sumexp
            attn = graph.call_function(op, tuple(args))
            assert checkpoint.deterministic_attention(attn) is deterministic, (op, p)
            assert checkpoint.is_random(attn) is not deterministic, (op, p)
        default = graph.call_function(aten._scaled_dot_product_flash_attention.default, (q, k, v))
        assert checkpoint.deterministic_attention(default)  # dropout_p defaults to 0


def test_deterministic_attention_is_recomputable_wherever_torch_asks():
    """The min-cut partitioner and AOTAutograd's forward-loss-backward rematerialization (a whole
    step's graph) both ask ``has_recomputable_rng_ops``; the second imports it by name, so the swap
    must reach it however early it was imported, and put back the original after."""
    from torch._functorch import partitioners

    remat = pytest.importorskip("torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass")
    original = partitioners.has_recomputable_rng_ops
    assert remat.has_recomputable_rng_ops is original  # imported before the swap, as any program may
    with checkpoint.attention_recomputed_as_is():
        assert partitioners.has_recomputable_rng_ops is not original
        assert remat.has_recomputable_rng_ops is partitioners.has_recomputable_rng_ops
    assert partitioners.has_recomputable_rng_ops is original and remat.has_recomputable_rng_ops is original
