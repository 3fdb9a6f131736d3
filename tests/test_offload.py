"""The offload pass (``offload_activations``): saved values wait for the backward on the host.

On the CPU "the host" is the same device, so the copies move nothing; what CI checks is that the
partitioner inserts them where apollo asked, that every pass, the lane runtime and Inductor take
graphs with them, and that training stays equal to eager. The memory it frees is measured on a GPU
(benchmarks/bench_memory.py, benchmarks/RESULTS.md; docs/design/checkpointing.md#offload).
"""

import copy
import warnings

import pytest
import torch
import torch._inductor.config
from torch._subclasses.fake_tensor import FakeTensorMode

import apollo_compile
from apollo_compile import ApolloFallbackWarning
from apollo_compile.options import ApolloOptions, ApolloOptionsError
from apollo_compile.passes import checkpoint, offload
from apollo_compile.runtime import subgraphs
from helpers import TOLERANCE, assert_same_loss_and_grads, assert_trains_like_eager, eager_subgraphs
from models import TwoTower, VisionTower, two_tower_inputs


@pytest.fixture
def every_value(monkeypatch):
    """The test models' activations are a few KiB, under offload.MIN_BYTES: offload them all."""
    monkeypatch.setattr(offload, "MIN_BYTES", 0)


def batches(step):
    return two_tower_inputs(batch=4, seed=step)


def train(options):
    """TwoTower, one layer a tower (Inductor builds half the kernels of two), trained like eager."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)  # no graph falls back
        assert_trains_like_eager(TwoTower(layers=1), batches, options, steps=3)
    return apollo_compile.last_plan()


@pytest.mark.parametrize("options", [
    {"offload_activations": True},
    {"offload_activations": True, "memory_budget": 0.3},
    {"offload_activations": True, "subgraph_compiler": "eager"},
], ids=["inductor", "inductor-budget", "eager-subgraphs"])
def test_trains_like_eager_and_every_offloaded_value_comes_back(options, every_value):
    plan = train(options)
    sent, back = plan.forward.summary()["offload"], plan.backward.summary()["offload"]
    assert sent["to_host"] > 0 and sent == {"to_host": back["to_device"], "bytes": back["bytes"]}
    assert plan.joint["offload"]["candidates"] >= sent["to_host"]
    listing = plan.forward.listing + plan.backward.listing
    assert listing.count("to-host") == sent["to_host"] and listing.count("to-device") == back["to_device"]
    # each copy to the host follows the last forward use of what it copies (the GPU memory is free
    # from there on), and each copy back precedes the first backward use
    fw = list(plan.forward.gm.graph.nodes)
    for copy_node in (n for n in fw if offload.transfer_of(n) == "to host"):
        source = copy_node.args[0]
        assert all(fw.index(u) < fw.index(copy_node) for u in source.users if u is not copy_node and u.op != "output")
    bw = list(plan.backward.gm.graph.nodes)
    for copy_node in (n for n in bw if offload.transfer_of(n) == "to device"):
        assert all(bw.index(u) > bw.index(copy_node) for u in copy_node.users)
    # the memory plan places device buffers only: a copy on the host takes no arena bytes
    placed = {p.buffer.name: p.buffer.nbytes for p in plan.forward.memory.placements}
    host = [n.name for n in fw if offload.transfer_of(n) == "to host"]
    assert host and all(placed[name] == 0 for name in host)


def backward_peak(backward: torch.fx.GraphModule) -> int:
    """The most bytes the backward graph's own values hold at once, run in its order: each storage
    (a copy back from the host included; views belong to their base) from the node that makes it
    to its last reader. Graph inputs are left out: this is what the backward itself brings back
    from the host and computes."""
    nodes = list(backward.graph.nodes)
    index = {n: k for k, n in enumerate(nodes)}
    last: dict[torch.fx.Node, int] = {}
    for n in nodes:
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor):
            s = checkpoint.storage_node(n)
            if s.op != "placeholder":
                last[s] = max([last.get(s, index[s])] + [index[u] for u in n.users])
    return max(sum(offload.nbytes(s) for s, end in last.items() if index[s] <= k <= end) for k in range(len(nodes)))


def test_per_block_offloading_leaves_the_stem_on_the_host_until_its_backward(every_value, monkeypatch):
    # NOTE: Offloaded per-block start: min-cut re-runs a stem norm (CLIP's ln_pre) from its saved
    # input, which then came back for the first block's re-run and stayed until the stem's backward.
    # A plan for Inductor, its subgraphs run eagerly (helpers.eager_subgraphs)
    eager_subgraphs(monkeypatch)
    class Tower(torch.nn.Module):  # one tower, so the backward peaks in its first block
        def __init__(self):
            super().__init__()
            self.vision = VisionTower(layers=4, stem_norm=True)

        def forward(self, images):
            return self.vision(images).square().mean()

    def stem_batches(step):
        return two_tower_inputs(batch=4, seed=step)[:1]

    options = {"offload_activations": True, "memory_budget": 0.05}

    def plan():
        torch._dynamo.reset()  # a second model of the same class would reuse the first's graphs
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ApolloFallbackWarning)
            assert_trains_like_eager(Tower(), stem_batches, options, steps=2)
        return apollo_compile.last_plan()

    chosen = plan()
    decision = chosen.joint["checkpoint"]
    assert decision.per_block and decision.block_start == "nothing"
    monkeypatch.setattr(checkpoint, "_offloaded_block_start", lambda *args: None)  # per-block as min-cut starts it
    from_min_cut = plan()
    assert from_min_cut.joint["checkpoint"].block_start == "min-cut"
    # min-cut's start holds the stem norm's input (and its statistics) across the first block
    stem_input = 4 * 5 * 32 * 4  # batch 4, a class token and 4 patches, width 32, fp32
    assert backward_peak(from_min_cut.backward.gm) - backward_peak(chosen.backward.gm) >= stem_input


def test_dropout_with_offloading_matches_eager_with_same_seed(every_value):
    # the saved dropout masks are offloaded like any value: the backward must read the same masks.
    # The eager subgraph compiler draws them in eager's order (as test_checkpoint's dropout test)
    torch.manual_seed(0)
    options = {"offload_activations": True, "memory_budget": 0.2, "subgraph_compiler": "eager"}
    assert_trains_like_eager(TwoTower(dropout=0.3), batches, options, steps=2, seed=100)
    assert apollo_compile.last_plan().forward.summary()["offload"]["to_host"] > 0


def test_dynamic_shapes_offload_at_the_traced_sizes(every_value, monkeypatch):
    # sizes are symbolic: the size threshold reads their hints (the traced inputs' sizes). A plan
    # for Inductor, its subgraphs run eagerly (helpers.eager_subgraphs)
    eager_subgraphs(monkeypatch)
    model = TwoTower(width=16, embed=8, layers=1)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="apollo", dynamic=True,
                             options={"offload_activations": True, "memory_budget": 0.5})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        for batch in (4, 6, 5):
            inputs = two_tower_inputs(batch=batch)
            loss, ref_loss = compiled(*inputs), ref(*inputs)
            loss.backward()
            ref_loss.backward()
            assert_same_loss_and_grads(loss, ref_loss, model, ref, TOLERANCE["inductor"], batch)
            model.zero_grad()
            ref.zero_grad()
    assert apollo_compile.last_plan().forward.summary()["offload"]["to_host"] > 0


def test_small_values_stay_put(monkeypatch):
    # at the default MIN_BYTES nothing in the test model is worth a transfer (a plan for Inductor,
    # its subgraphs run eagerly: helpers.eager_subgraphs)
    eager_subgraphs(monkeypatch)
    plan = train({"offload_activations": True})
    assert plan.forward.summary()["offload"] == {"to_host": 0, "bytes": 0}
    assert "to-host" not in plan.forward.listing


def test_off_by_default_marks_nothing(monkeypatch):
    eager_subgraphs(monkeypatch)  # a plan for Inductor, its subgraphs run eagerly
    plan = train({})
    assert plan.joint.get("offload") is None and "offload" not in plan.forward.summary()
    assert not any("should_offload" in n.meta for n in plan.forward.gm.graph.nodes)


def test_host_copies_keep_their_place_in_inductor():
    # NOTE: Host copies keep their place: Inductor's peak-memory reordering moved them late
    # and NOTE: Memory first frees at once: no buffer waits past its last use for a reuse
    with subgraphs.inductor_config(host_copies=True):
        assert torch._inductor.config.reorder_for_peak_memory is False
        assert torch._inductor.config.allow_buffer_reuse is False
        assert torch._inductor.config.fallback_random is True
    before = (torch._inductor.config.reorder_for_peak_memory, torch._inductor.config.allow_buffer_reuse)
    with subgraphs.inductor_config(free_at_last_use=True):  # a budget without copies keeps the reordering
        assert torch._inductor.config.allow_buffer_reuse is False
        assert torch._inductor.config.reorder_for_peak_memory == before[0]
    with subgraphs.inductor_config():
        assert (torch._inductor.config.reorder_for_peak_memory, torch._inductor.config.allow_buffer_reuse) == before

    def with_copy(x):
        return torch.ops.prims.device_put.default(x, torch.device("cpu")) + 1

    assert subgraphs.has_host_copies(torch.fx.symbolic_trace(with_copy))
    assert not subgraphs.has_host_copies(torch.fx.symbolic_trace(lambda x: x + 1))

    # a copy from the host back to a GPU is one too; a copy between two GPUs (place_modalities) is not
    def moved(x):
        return torch.ops.prims.device_put.default(x, torch.device("cuda", 1))

    with FakeTensorMode():
        on_host, on_gpu = torch.empty(2), torch.empty(2, device="cuda:0")
    for x, expected in [(on_host, True), (on_gpu, False)]:
        gm = torch.fx.symbolic_trace(moved)
        next(iter(gm.graph.nodes)).meta["val"] = x
        assert subgraphs.has_host_copies(gm) is expected, x.device


@pytest.mark.parametrize("options,match", [
    ({"offload_activations": 1}, "offload_activations"),
    ({"offload_activations": True, "cudagraphs": True}, "cannot be replayed as a CUDA graph"),
])
def test_bad_offload_options(options, match):
    with pytest.raises(ApolloOptionsError, match=match):
        ApolloOptions.from_user(options)


def test_needs_partitioner_offloading(monkeypatch):
    monkeypatch.setattr(apollo_compile.options, "partitioner_offloads", lambda: False)  # as on PyTorch < 2.9
    with pytest.raises(ApolloOptionsError, match="needs PyTorch 2.9"):
        ApolloOptions.from_user({"offload_activations": True})
