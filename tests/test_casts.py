"""The cast pass (``options={"precision": ...}``): numerics against fp32 eager, fp32 master
parameters, one cast per weight, marks in the dumps, fp32 sensitive ops, the keep-fp32 rule,
fp16 with a GradScaler, and autocast left in charge of its regions."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import apollo_compile
from apollo_compile import pipeline
from apollo_compile.devices import DEVICE_SPECS
from apollo_compile.options import ApolloOptions
from apollo_compile.passes import casts
from apollo_compile.pipeline import GraphContext
from models import MLP, TwoTower, two_tower_inputs
from helpers import dynamo_graph

# bf16 keeps 8 significant bits: unit roundoff u = 2**-8 ~ 3.9e-3. A lowered matmul rounds both
# operands (<= 2u relative per product) and accumulates in fp32, and everything the loss is made
# of after the matmuls (norms, softmax, losses, reductions) runs in fp32. Over 20 SGD steps of
# TwoTower the bf16 loss stayed within 0.6% of fp32 eager at every step (3 seeds, observed
# max 5.9e-3 ~ 1.5u; eager bf16 autocast, which also lowers the projections, reached 1.6e-2).
# rtol 2e-2 ~ 5u leaves ~3x margin over the observed drift while still catching a sensitive op
# or a loss left in bf16 (those move the loss by several u at once) or a broken gradient.
BF16_RTOL = 2e-2
STEPS = 20
EAGER = {"subgraph_compiler": "eager"}


def _train(model, fn, steps=STEPS, lr=0.1, on_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = fn(*two_tower_inputs(seed=step))
        loss.backward()
        if on_step is not None:
            on_step(step, loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses)


def _ctx(precision):
    return GraphContext("test_dynamo", "dynamo", ApolloOptions(precision=precision), DEVICE_SPECS["cpu"])


def _cast_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to" and casts.CUSTOM_KEY in
            (n.meta.get("custom") or {})]


def _tensor_vals(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensor_vals(y)]
    return []


def _aten_name(node):
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """TwoTower trained 20 SGD steps in bf16 under apollo, and in fp32 eager from the same init."""
    dump_dir = str(tmp_path_factory.mktemp("casts_dump"))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TwoTower()
    ref = copy.deepcopy(model)
    seen = {}

    def record(step, loss):
        if step == 0:
            seen["plan"] = apollo_compile.last_plan()
            seen["loss_dtype"] = loss.dtype
            seen["grad_dtypes"] = {p.grad.dtype for p in model.parameters()}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "VERIFY", True, raising=False)  # invariants checked after every pass
        compiled = torch.compile(model, backend="apollo",
                                 options={"precision": "bf16", "dump_dir": dump_dir, "strict": True, **EAGER})
        losses = _train(model, compiled, on_step=record)
    ref_losses = _train(ref, ref)
    torch._dynamo.reset()
    return dict(seen, model=model, losses=losses, ref_losses=ref_losses, dump_dir=dump_dir)


# ---------------------------------------------------------------------------- bf16 end to end


def test_bf16_training_tracks_fp32_eager(bf16_run):
    losses, ref = bf16_run["losses"], bf16_run["ref_losses"]
    assert bf16_run["plan"].forward.fallback is None and bf16_run["plan"].backward.fallback is None
    assert bf16_run["loss_dtype"] == torch.float32  # the graph output (the loss) is fp32
    torch.testing.assert_close(losses, ref, rtol=BF16_RTOL, atol=0)
    torch.testing.assert_close(losses[-1], ref[-1], rtol=BF16_RTOL, atol=0)
    assert not torch.equal(losses, ref), "bf16 should not be bit-identical to fp32: were the casts applied?"


def test_parameters_stay_fp32_masters(bf16_run):
    assert {p.dtype for p in bf16_run["model"].parameters()} == {torch.float32}
    assert bf16_run["grad_dtypes"] == {torch.float32}


def test_each_weight_is_cast_once(bf16_run):
    decision = bf16_run["plan"].pre_grad["casts"]
    assert decision["precision"] == "bf16" and decision["changed"]
    per_source = Counter((c["source"], c["to"]) for c in decision["casts"])
    assert max(per_source.values()) == 1, per_source
    # Every weight of every lowered linear/conv is cast, once: 2 towers x 2 blocks x 4 linears x
    # (weight, bias) + the patch-embedding conv's weight and bias.
    assert len(decision["weight_casts"]) == 2 * 2 * 4 * 2 + 2
    assert all("_parameters_" in name for name in decision["weight_casts"])
    assert decision["cast_nodes"] == len(decision["casts"])


def test_listing_and_dump_show_cast_marks(bf16_run):
    plan = bf16_run["plan"]
    decision = plan.pre_grad["casts"]
    fw = plan.forward
    marked = [n for n in fw.gm.graph.nodes if "cast->bf16" in _listing_row(fw.listing, n.name)]
    # Every Dynamo-level cast reached the forward ATen graph as one marked _to_copy to bf16.
    assert len(marked) == decision["cast_nodes"]
    for n in marked:
        assert n.meta["val"].dtype == torch.bfloat16, n.name
    dumped = open(f"{bf16_run['dump_dir']}/{fw.name}.apollo.txt").read()
    assert dumped.count("cast->bf16") == len(marked)
    # The backward casts each weight gradient back to fp32, and says so.
    assert "cast->fp32" in plan.backward.listing


def _listing_row(listing, name):
    for line in listing.splitlines():
        if line.split(" ", 1)[0] == name:
            return line
    return ""


def test_sensitive_ops_run_in_fp32(bf16_run):
    gm = bf16_run["plan"].forward.gm
    sensitive = {"native_layer_norm", "_log_softmax", "nll_loss_forward"}
    seen = Counter()
    for n in gm.graph.nodes:
        name = _aten_name(n)
        if name in sensitive:
            seen[name] += 1
            ins = [t for a in n.all_input_nodes for t in _tensor_vals(a.meta.get("val")) if t.is_floating_point()]
            outs = [t for t in _tensor_vals(n.meta["val"]) if t.is_floating_point()]
            assert {t.dtype for t in ins + outs} == {torch.float32}, n.name
    assert seen == {"native_layer_norm": 10, "_log_softmax": 2, "nll_loss_forward": 2}
    lowered = {_aten_name(n) for n in gm.graph.nodes if n.op == "call_function"
               and any(t.dtype == torch.bfloat16 for t in _tensor_vals(n.meta.get("val")))}
    assert {"addmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu"} <= lowered


class Head(nn.Module):
    """bf16 flows straight into a layer norm and into the loss: both must be cast back up."""

    def __init__(self, width: int = 32, hidden: int = 64, classes: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x, labels):
        logits = self.fc2(F.gelu(self.ln(self.fc1(x))))
        return F.cross_entropy(logits, labels), logits


def test_low_values_are_cast_up_for_sensitive_ops_and_outputs():
    torch.manual_seed(0)
    model = Head()
    x, labels = torch.randn(16, 32), torch.randint(0, 32, (16,))
    ref_loss, ref_logits = model(x, labels)
    loss, logits = torch.compile(model, backend="apollo", options={"precision": "bf16", **EAGER})(x, labels)
    plan = apollo_compile.last_plan()
    decision = plan.pre_grad["casts"]
    assert len(decision["lowered"]) == 2  # fc1, fc2
    assert len(decision["fp32_ops"]) == 2  # the layer norm and the cross entropy
    assert decision["output_casts"] == 1  # the logits go back to the user in fp32
    assert loss.dtype == logits.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=BF16_RTOL, atol=0)
    torch.testing.assert_close(logits, ref_logits, rtol=BF16_RTOL, atol=BF16_RTOL)
    for n in plan.forward.gm.graph.nodes:
        if _aten_name(n) in ("native_layer_norm", "_log_softmax"):
            (inp,) = [a for a in n.all_input_nodes if a.meta["val"].dim() == 2]
            assert inp.meta["val"].dtype == torch.float32
            assert casts.cast_mark(inp) == "fp32"  # the up-cast apollo inserted, marked as such
    assert "cast->fp32" in plan.forward.listing


# ---------------------------------------------------------------------------- the rules


def test_precision_none_and_fp32_leave_the_graph_untouched():
    torch.manual_seed(0)
    gm, _ = dynamo_graph(TwoTower(), *two_tower_inputs())
    code = gm.code
    for precision in (None, "fp32"):
        decision = casts.run(gm, _ctx(precision))
        assert decision["changed"] is False and decision["precision"] == precision
        assert "note" in decision
        assert gm.code == code and not _cast_nodes(gm)
    torch.compile(MLP(), backend="apollo", options=EAGER)(torch.randn(8, 32))
    plan = apollo_compile.last_plan()
    assert plan.pre_grad["casts"]["changed"] is False
    assert "cast->" not in plan.forward.listing
    assert all(t.dtype == torch.float32 for n in plan.forward.gm.graph.nodes
               for t in _tensor_vals(n.meta.get("val")) if t.is_floating_point())


def test_dynamo_graph_rewrite_casts_each_weight_once():
    class Tied(nn.Module):  # one Linear applied twice: its weight feeds two matmuls
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            return self.fc(torch.relu(self.fc(x))).sum()

    torch.manual_seed(0)
    model = Tied()
    x = torch.randn(16, 32)
    gm, example = dynamo_graph(model, x)
    decision = casts.run(gm, _ctx("bf16"))
    assert len(decision["lowered"]) == 2
    low = [n for n in _cast_nodes(gm) if n.args[1] == torch.bfloat16]
    assert Counter(n.args[0].name for n in low) == Counter({"l_x_": 1, **{w: 1 for w in decision["weight_casts"]}})
    assert len(decision["weight_casts"]) == 2  # weight and bias, cast once though used twice
    for n in low:
        assert casts.cast_mark(n) == "bf16"
        assert len(n.users) == (2 if n.name in decision["weight_casts"].values() else 1)
    (up,) = [n for n in _cast_nodes(gm) if n.args[1] == torch.float32]  # the sum is a sensitive op
    assert casts.cast_mark(up) == "fp32" and decision["fp32_ops"] == [next(iter(up.users)).name]
    (out,) = gm(*example)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(x), rtol=BF16_RTOL, atol=0)


def test_tiny_matmul_keeps_fp32_and_says_why():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)  # 4 x 8 x 8: 2*4*8*8 = 512 FLOPs, under one 16x16x16 tile
    x = torch.randn(4, 8)
    out = torch.compile(model, backend="apollo", options={"precision": "bf16", **EAGER})(x)
    torch.testing.assert_close(out, model(x))  # fp32 all the way: exactly eager's numbers
    decision = apollo_compile.last_plan().pre_grad["casts"]
    assert decision["lowered"] == [] and decision["cast_nodes"] == 0
    (kept,) = decision["kept_fp32"]
    assert kept["flops"] == 512 and kept["op"] == "linear"
    assert f"512 FLOPs < {casts.MIN_LOW_FLOPS}" in kept["reason"] and "launch" in kept["reason"]


def test_twotower_keeps_its_tiny_matmuls(bf16_run):
    kept = {k["node"]: k for k in bf16_run["plan"].pre_grad["casts"]["kept_fp32"]}
    assert kept["logits"]["flops"] == 2 * 4 * 16 * 4 and kept["logits"]["op"] == "matmul"
    assert {k["flops"] for k in kept.values()} == {512, 2 * 4 * 32 * 16}  # logits, two projections
    assert all(k["flops"] < casts.MIN_LOW_FLOPS for k in kept.values())


def test_inplace_mutation_invalidates_the_cached_cast():
    w1, w2 = torch.randn(32, 32), torch.randn(32, 32)

    def f(x):
        h = x * 2
        a = h @ w1
        h.add_(1)  # the bf16 copy of h made for the first matmul is stale now
        return a.sum() + (h @ w2).sum()

    x = torch.randn(16, 32)
    gm, example = dynamo_graph(f, x)
    casts.run(gm, _ctx("bf16"))
    h_casts = [n for n in _cast_nodes(gm) if n.args[0].name == "h"]
    assert len(h_casts) == 2
    (out,) = gm(*example)
    torch.testing.assert_close(out, f(x), rtol=BF16_RTOL, atol=1.0)


# ---------------------------------------------------------------------------- fp16, autocast


def test_fp16_trains_with_grad_scaler():
    """fp16 matmuls, convs and attention run on CPU in torch 2.13: the whole loop is tested."""
    torch.manual_seed(0)
    model = TwoTower()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="apollo", options={"precision": "fp16", **EAGER})
    # A scale that fits the fp16 range here, so no step is skipped and trajectories compare.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(10):
        loss = compiled(*two_tower_inputs(seed=step))
        assert loss.dtype == torch.float32
        scaler.scale(loss).backward()
        assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    assert scaler.get_scale() == 2.0**10  # no overflow, no skipped step
    assert apollo_compile.last_plan().pre_grad["casts"]["precision"] == "fp16"
    assert "cast->fp16" in apollo_compile.last_plan().forward.listing
    # fp16 keeps 11 significant bits (u ~ 4.9e-4): closer to fp32 than bf16, same bound holds.
    torch.testing.assert_close(torch.tensor(losses), _train(ref, ref, steps=10), rtol=BF16_RTOL, atol=0)

    # An fp16 overflow in the backward reaches the fp32 .grad as inf: the scaler skips the step.
    before = [p.detach().clone() for p in model.parameters()]
    big = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    big.scale(compiled(*two_tower_inputs(seed=99))).backward()
    big.step(opt)
    big.update()
    assert big.get_scale() < 2.0**24
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


class AutocastMLP(MLP):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        with torch.autocast("cpu", dtype=self.dtype):
            h = self.net(x)
        return h.float().pow(2).mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_regions_stay_the_users(dtype):
    torch.manual_seed(0)
    model = AutocastMLP(dtype)
    x = torch.randn(8, 32)
    out = torch.compile(model, backend="apollo", options={"precision": "bf16", **EAGER})(x)
    torch.testing.assert_close(out, model(x))  # exactly what eager autocast computes
    plan = apollo_compile.last_plan()
    decision = plan.pre_grad["casts"]
    assert decision["lowered"] == [] and len(decision["autocast_ops"]) == 2
    mm_dtypes = {n.meta["val"].dtype for n in plan.forward.gm.graph.nodes if _aten_name(n) in ("addmm", "mm")}
    assert mm_dtypes == {dtype}  # fp16 autocast with precision="bf16" still runs fp16 matmuls
