"""Micro-batches in one graph: ``compile_step(step, optimizer=opt, micro_batches=k)``.

Each test trains the compiled step beside eager gradient accumulation over the same micro-batches
(``(loss_i / k).backward()`` for each slice, then one ``optimizer.step()``) and compares the loss and
every parameter after 3 AdamW steps within ``helpers.TOLERANCE["eager"]``: the eager subgraph
compiler runs the same ATen kernels, and with k a power of two the graph's ``sum(g_i) / k`` is
eager's ``sum(g_i / k)`` exactly (a division by 2^n is exact), so only the graph's own op
decompositions differ (observed: within 3e-7). AdamW runs with ``eps=1e-3``: an element whose
gradient is zero in exact arithmetic (a key projection's bias: softmax ignores a shift) carries
rounding noise, which the default eps of 1e-8 turns into a step of a full lr in a random direction;
eps=1e-3 keeps it at noise while every real gradient still moves its parameter.
"""

from __future__ import annotations

import collections
import copy
import warnings
from collections import Counter

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

import apollo_compile
from apollo_compile import ApolloFallbackWarning, ApolloOptionsError
from apollo_compile.annotations import info
from apollo_compile.nodes import deterministic_attention
from apollo_compile.report.explain import Report
from apollo_compile.runtime import subgraphs
from apollo_compile.step import micro_batches, whole_step
from helpers import TOLERANCE, backward_step, one_layer_hf_zoo
from models import TwoTower, checkpoint_blocks, two_tower_inputs

EAGER = {"subgraph_compiler": "eager"}
TOL = TOLERANCE["eager"]


def train_both(model, make_batch, k, forward, steps=3, **adamw):
    """The compiled micro-batched step and eager accumulation over the same slices, side by side."""
    ref = copy.deepcopy(model)

    def step(*inputs):
        loss = forward(model, inputs)
        loss.backward()
        return loss.detach()

    adamw = {"lr": 1e-2, "eps": 1e-3, **adamw}
    opt, ref_opt = torch.optim.AdamW(model.parameters(), **adamw), torch.optim.AdamW(ref.parameters(), **adamw)
    compiled = apollo_compile.compile_step(step, optimizer=opt, micro_batches=k, options=EAGER)
    for i in range(steps):
        inputs = make_batch(i)
        loss = compiled(*inputs)
        rows = inputs[0].shape[0] // k
        losses = []
        for j in range(k):
            ref_loss = forward(ref, [x[j * rows:(j + 1) * rows] for x in inputs])
            (ref_loss / k).backward()
            losses.append(ref_loss.detach())
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, torch.stack(losses).mean(), **TOL, msg=lambda m: f"step {i} loss: {m}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {i} {name}: {m}")
    return compiled


def micro_batched_graph(k):
    """The last whole-step graph the modality pass found k micro-batches in."""
    graphs = [p.inference for p in apollo_compile.plans()
              if "inference" in p.graphs and p.inference.decisions["modality"].get("micro_batches") == k]
    assert graphs, [p.name for p in apollo_compile.plans()]
    return graphs[-1]


def micro_batch_of(modality: str) -> int | None:
    return int(modality.rsplit("@mb", 1)[1]) if "@mb" in modality else None


def assert_one_chain_per_micro_batch(graph, k):
    """Every micro-batch's nodes are labelled with it; no subgraph holds two micro-batches; the
    micro-batches run on lanes of their own (at least two), side by side: each chain's first
    subgraph waits for no other micro-batch's, and a later one waits for another micro-batch's
    subgraph only where it sums the gradients that subgraph made (``fusion`` nodes on the chain's
    lane: docs/design/lanes.md#staggered-sums)."""
    assert graph.fallback is None
    cut = graph.decisions["lanes"]
    owner: dict[int, int] = {}
    lanes: dict[int, set[int]] = {}
    for sg in cut.subgraphs:
        found = {micro_batch_of(info(n).modality) for n in sg.nodes} - {None}
        assert len(found) <= 1, (sg.id, found)
        if found:
            owner[sg.id] = found.pop()
            lanes.setdefault(owner[sg.id], set()).add(sg.lane)
    assert sorted(lanes) == list(range(k)), lanes
    for i in range(k):
        for j in range(i + 1, k):
            assert not lanes[i] & lanes[j], lanes
    assert len(set().union(*lanes.values())) >= 2, lanes
    order = {n: i for i, n in enumerate(graph.gm.graph.nodes)}
    first = {mb: min((s for s, m in owner.items() if m == mb), key=lambda s: order[cut.subgraphs[s].nodes[0]])
             for mb in range(k)}
    for sg_id, mb in owner.items():
        waits_for = {owner[a] for a in nx.ancestors(cut.dag, sg_id) if a in owner} - {mb}
        if sg_id == first[mb]:
            assert not waits_for, (sg_id, mb, waits_for)
        direct = {owner[a] for a in cut.dag.predecessors(sg_id) if a in owner} - {mb}
        if direct:
            assert any(info(n).modality == "fusion" for n in cut.subgraphs[sg_id].nodes), (sg_id, mb, direct)


# ---------------------------------------------------------------------------- training


@pytest.mark.parametrize("k", [2, 4])
def test_two_tower_trains_like_eager_accumulation(k):
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        compiled = train_both(TwoTower(layers=1), lambda i: two_tower_inputs(batch=8, seed=i), k,
                              lambda m, inputs: m(*inputs))
    assert compiled.fallback_reason is None and compiled.update is not None
    assert len(whole_step_graphs := [p for p in apollo_compile.plans() if "inference" in p.graphs]) == 1, \
        whole_step_graphs  # one graph for all steps
    graph = micro_batched_graph(k)
    assert_one_chain_per_micro_batch(graph, k)
    modalities = {info(n).modality for n in graph.gm.graph.nodes}
    assert {f"{tower}@mb{i}" for tower in ("vision", "text") for i in range(k)} <= modalities


def test_batches_of_other_sizes_keep_one_chain_per_micro_batch():
    """A second batch size recompiles the step with a dynamic batch dimension: the slices' sizes
    are then computed in the graph from the batch's, read by every micro-batch, and must not join
    the chains (modality.py, rule 5)."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    train_both(TwoTower(layers=1), lambda i: two_tower_inputs(batch=(8, 12, 16)[i], seed=i), 2,
               lambda m, inputs: m(*inputs))
    graphs = [p.inference for p in apollo_compile.plans() if "inference" in p.graphs]
    assert len(graphs) == 2, [p.name for p in apollo_compile.plans()]
    for graph in graphs:
        assert graph.decisions["modality"]["micro_batches"] == 2
        assert_one_chain_per_micro_batch(graph, 2)


def test_the_users_checkpoints_in_micro_batches_take_the_module_path():
    """AOTAutograd re-runs the user's checkpoints of one backward only: torch 2.13 refuses a second
    backward that re-runs ops, and torch 2.11 would keep every later micro-batch's checkpointed
    values saved, so apollo refuses the graph there (whole_step.py, NOTE: The user's checkpoints in
    a whole step). The step takes the module path, where each micro-batch's backward re-runs its
    own checkpoints, with one warning saying why, and trains as eager accumulation does."""
    torch.manual_seed(0)
    apollo_compile.clear_plans()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = train_both(checkpoint_blocks(TwoTower(layers=1)), lambda i: two_tower_inputs(batch=8, seed=i), 2,
                              lambda m, inputs: m(*inputs))
    mine = [str(w.message) for w in caught if issubclass(w.category, ApolloFallbackWarning)]
    assert len(mine) == 1 and "compile_step" in mine[0], mine
    why = ("disjoint backward regions that require recomputation" if whole_step._marks_autograd_backward()
           else "CheckpointAfterBackward")
    assert "WholeStepNotCompiled" in compiled.fallback_reason and why in compiled.fallback_reason, \
        compiled.fallback_reason
    backward = [p.graphs["backward"].gm for p in apollo_compile.plans() if "backward" in p.graphs]
    rerun = [sum(deterministic_attention(n) and "backward" not in str(n.target) for n in gm.graph.nodes)
             for gm in backward]
    assert rerun and all(r == 2 for r in rerun), rerun  # each tower's one block runs again in each backward


def tiny_llava():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "LlavaForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no LlavaForConditionalGeneration")
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, image_size=32, patch_size=8)
    text = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=127, image_seq_length=16))


def llava_batch(i, batch=4):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(1, 120, (batch, 24), generator=g)
    ids[:, 2:18] = 127  # the 16 image tokens the vision tower's patches replace
    return torch.randn(batch, 3, 32, 32, generator=g), ids


def test_hugging_face_llava_trains_like_eager_accumulation(k=2):
    """HF LLaVA (a CLIP vision tower, its projector, Llama) is one chain: its micro-batches are the
    branches (four of them: the two-tower test, at a fraction of the compile time). Its first call
    runs on the module path (the output-capturing hooks, installed under a lock:
    docs/whole-step.md), the later ones as one graph. weight_decay=0: the parameters the loss
    does not reach (the last vision layer) get zero gradients in a whole step, where eager leaves
    them None and AdamW skips them; with decay the graph's step would shrink them."""
    model = tiny_llava()
    apollo_compile.clear_plans()

    def forward(m, inputs):
        pixel_values, input_ids = inputs
        return m(pixel_values=pixel_values, input_ids=input_ids, labels=input_ids).loss

    compiled = train_both(model, llava_batch, k, forward, weight_decay=0.0)
    assert compiled.fallback_reason is None
    assert_one_chain_per_micro_batch(micro_batched_graph(k), k)


def test_hugging_face_paligemma_trains_like_eager_accumulation(monkeypatch):
    """PaliGemma (a SigLIP vision tower, its projector, Gemma), called as Hugging Face models are,
    ``model(**batch)``: every tensor of the batch dict (ids, mask, token types, labels, pixels) is
    sliced. benchmarks/probes/hf_zoo.py builds it (one layer a tower: helpers.one_layer_hf_zoo) and
    its batches (labels ignore the image tokens); weight_decay=0 as for LLaVA."""
    transformers = pytest.importorskip("transformers")
    import hf_zoo

    if not hasattr(transformers, hf_zoo.MODEL_CLASSES["paligemma"]):
        pytest.skip(f"transformers {transformers.__version__} has no {hf_zoo.MODEL_CLASSES['paligemma']}")
    one_layer_hf_zoo(monkeypatch, hf_zoo)
    build, inputs = hf_zoo.MODELS["paligemma"]()
    torch.manual_seed(0)
    apollo_compile.clear_plans()

    def step(**batch):
        loss = model(**batch).loss
        loss.backward()
        return loss.detach()

    model = build()
    ref = copy.deepcopy(model)
    adamw = {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.0}
    opt, ref_opt = torch.optim.AdamW(model.parameters(), **adamw), torch.optim.AdamW(ref.parameters(), **adamw)
    compiled = apollo_compile.compile_step(step, optimizer=opt, micro_batches=2, options=EAGER)
    for i in range(3):
        batch = inputs(i)
        loss = compiled(**batch)
        rows = batch["input_ids"].shape[0] // 2
        losses = []
        for j in range(2):
            ref_loss = ref(**{name: x[j * rows:(j + 1) * rows] for name, x in batch.items()}).loss
            (ref_loss / 2).backward()
            losses.append(ref_loss.detach())
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, torch.stack(losses).mean(), **TOL)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {i} {name}: {m}")
    assert compiled.fallback_reason is None
    assert_one_chain_per_micro_batch(micro_batched_graph(2), 2)


class TokenModel(torch.nn.Module):
    """A tiny language model whose loss is a token sum over a count it is given, as Hugging Face's
    ``num_items_in_batch`` makes it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

    def forward(self, ids, labels, num_items):
        logits = self.head(torch.tanh(self.embed(ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / num_items


def test_a_token_mean_over_the_whole_batch_takes_its_count_over_k():
    """The documented recipe for a token-mean loss with ignored tokens (docs/whole-step.md#micro-batches):
    the step divides its token sum by the full batch's count over k, a 0-d tensor every micro-batch
    gets unchanged; the average over micro-batches is then the full batch's token mean, trained here
    beside the unsplit eager step, though the micro-batches hold 3 and 8 of the 11 counted tokens."""
    torch.manual_seed(0)
    model, k = TokenModel(), 2
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)

    def step(ids, labels, num_items):
        loss = model(ids, labels, num_items)
        loss.backward()
        return loss.detach()

    compiled = apollo_compile.compile_step(step, optimizer=opt, micro_batches=k, options=EAGER)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 32, (4, 5), generator=g)
        labels = ids.roll(-1, dims=1)
        labels[:2, 1:] = -100  # micro-batch 0 counts 3 tokens, micro-batch 1 counts 8
        labels[1, 1] = 3
        labels[2:, 0] = -100
        count = (labels != -100).sum()
        loss = compiled(ids, labels, count / k)
        ref_loss = F.cross_entropy(ref.head(torch.tanh(ref.embed(ids))).flatten(0, 1), labels.flatten(),
                                   ignore_index=-100)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {i} {name}: {m}")


def test_micro_batched_lanes_listing():
    """A golden summary of a micro-batched whole step (two-tower, k=2): each micro-batch's towers
    and its loss on lanes of their own, each gradient's sum and its scale by 1/k on the lane of the
    second micro-batch's tower that made it (``fusion`` there), the mean loss and AdamW's update on
    the main lane after both chains."""
    torch.manual_seed(0)
    model = TwoTower(width=16, embed=8, layers=1)
    opt = torch.optim.AdamW(model.parameters())
    step = apollo_compile.compile_step(backward_step(model), optimizer=opt, micro_batches=2,
                                       options={**EAGER, "device": "H200"})
    step(*two_tower_inputs(batch=4))
    graph = micro_batched_graph(2)
    report = str(Report(apollo_compile.plans()))  # what apollo_compile's report shows of the lanes
    assert "lane 0: fusion, vision@mb1 | lane 1: vision@mb0 | lane 2: text@mb0 | lane 3: fusion@mb0" in report, report
    counts = Counter((info(n).lane, info(n).modality, "backward" if info(n).backward else "forward")
                     for n in graph.gm.graph.nodes if n.op == "call_function")
    listing = "\n".join(f"lane {lane}  {modality:<12} {part:<8} {n} ops"
                        for (lane, modality, part), n in sorted(counts.items()))
    assert_expected_inline(listing, """\
lane 0  fusion       backward 112 ops
lane 0  fusion       forward  40 ops
lane 0  vision@mb1   backward 110 ops
lane 0  vision@mb1   forward  59 ops
lane 1  vision@mb0   backward 113 ops
lane 1  vision@mb0   forward  59 ops
lane 2  text@mb0     backward 100 ops
lane 2  text@mb0     forward  56 ops
lane 3  fusion@mb0   backward 10 ops
lane 3  fusion@mb0   forward  16 ops
lane 4  fusion       backward 34 ops
lane 4  text@mb1     backward 100 ops
lane 4  text@mb1     forward  56 ops
lane 5  fusion@mb1   backward 10 ops
lane 5  fusion@mb1   forward  16 ops""")


def test_each_gradient_is_summed_on_its_lane_into_the_earlier_one():
    """docs/design/lanes.md#staggered-sums: the sum of two micro-batches' gradients runs on the
    lane of the micro-batch that made the later one, in a subgraph that writes it, scaled by 1/k,
    into the earlier gradient's memory (one buffer per parameter, as eager accumulation keeps, and
    one pass over it), and the earlier micro-batch's lanes are cut so that no sum waits for a whole
    chain."""
    torch.manual_seed(0)
    model = TwoTower(width=16, embed=8, layers=2)
    step = apollo_compile.compile_step(backward_step(model), optimizer=torch.optim.AdamW(model.parameters()),
                                       micro_batches=2, options=EAGER)
    step(*two_tower_inputs(batch=4))
    graph = micro_batched_graph(2)
    cut = graph.decisions["lanes"]
    sums = [n for n in graph.gm.graph.nodes if n.target is torch.ops.aten.add.Tensor and info(n).modality == "fusion"
            and all(isinstance(a, torch.fx.Node) for a in n.args[:2])
            and [micro_batch_of(info(a).modality) for a in n.args[:2]] in ([0, 1], [1, 0])]
    assert len(sums) == sum(1 for p in model.parameters() if p.requires_grad), len(sums)
    for n in sums:
        earlier, later = sorted(n.args[:2], key=lambda a: micro_batch_of(info(a).modality))
        assert info(n).lane == info(later).lane != info(earlier).lane, n
        into = subgraphs.written_in_place(cut.subgraphs[info(n).subgraph])
        (scale,) = n.users
        assert scale.target is torch.ops.aten.div.Tensor and into.get(scale) is earlier, (n, scale, into)
    chain_lanes = {info(a).lane for n in sums for a in n.args[:2] if micro_batch_of(info(a).modality) == 0}
    for lane in chain_lanes:
        assert sum(sg.lane == lane for sg in cut.subgraphs) > 1, lane


# ---------------------------------------------------------------------------- what k and the batch may be


def test_micro_batches_1_is_the_plain_step():
    model = TwoTower(layers=1)
    opt = torch.optim.AdamW(model.parameters())
    assert type(apollo_compile.compile_step(backward_step(model), optimizer=opt, micro_batches=1)) is \
        whole_step.CompiledStep


@pytest.mark.parametrize("k, match", [(0, "int >= 1"), (-2, "int >= 1"), (1.5, "int >= 1"), (True, "int >= 1"),
                                      ("4", "int >= 1"), ("auto", "'auto' is not implemented")])
def test_bad_micro_batch_counts_raise(k, match):
    model = TwoTower(layers=1)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ApolloOptionsError, match=match):
        apollo_compile.compile_step(backward_step(model), optimizer=opt, micro_batches=k)


def test_micro_batches_need_the_optimizer():
    with pytest.raises(ApolloOptionsError, match="needs optimizer="):
        apollo_compile.compile_step(backward_step(TwoTower(layers=1)), micro_batches=2)


def test_a_batch_that_does_not_cut_evenly_raises_before_tracing():
    apollo_compile.clear_plans()
    model = TwoTower(layers=1)
    step = apollo_compile.compile_step(backward_step(model), optimizer=torch.optim.AdamW(model.parameters()),
                                       micro_batches=4)
    images, tokens = two_tower_inputs(batch=6)
    with pytest.raises(ApolloOptionsError, match="dimension 0 of argument 0 is 6, not divisible by 4"):
        step(images, tokens)
    with pytest.raises(ApolloOptionsError, match="argument 1 has 4 rows and argument 0 8"):
        step(two_tower_inputs(batch=8)[0], two_tower_inputs(batch=4)[1])
    with pytest.raises(ApolloOptionsError, match="needs a tensor argument with a batch dimension"):
        step(torch.tensor(1.0), None)
    with pytest.raises(ApolloOptionsError, match="argument 0 is a UserDict; pass dict"):
        step(collections.UserDict(images=images), tokens)
    assert not apollo_compile.plans()


def test_slices_and_results():
    """What each micro-batch gets (dimension 0 of every tensor with one, in lists and dicts too;
    the rest unchanged) and what the step returns (floating 0-d tensors averaged, other tensors
    stacked, other values as a tuple of the k)."""
    seen = []

    def step(x, extra, *, scale, batch):
        seen.append((x, extra, scale, batch["ids"]))
        return {"loss": x.sum(), "rows": x[:, 0], "count": torch.tensor(x.shape[0]), "tag": len(seen)}

    x, ids = torch.arange(12.0).reshape(4, 3), torch.arange(4)
    out = micro_batches.split(step, 2, list)(x, "same", scale=torch.tensor(2.0), batch={"ids": ids})
    assert [s[0].tolist() for s in seen] == [x[:2].tolist(), x[2:].tolist()]
    assert [s[3].tolist() for s in seen] == [[0, 1], [2, 3]]
    assert all(s[1] == "same" and s[2].item() == 2.0 for s in seen)
    assert out["loss"].item() == x.sum().item() / 2
    assert out["rows"].tolist() == [[0.0, 3.0], [6.0, 9.0]]
    assert out["count"].tolist() == [2, 2]
    assert out["tag"] == (1, 2)
