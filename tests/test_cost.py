"""Tests for the cost pass on small ATen graphs captured from AOTAutograd (CPU, planning for an H200)."""

from __future__ import annotations

import math
import operator
import types

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.proxy_tensor import make_fx

from apollo_compile.annotations import info
from apollo_compile.devices import DEVICE_SPECS
from apollo_compile.passes import cost

H200 = DEVICE_SPECS["H200"]
CTX = types.SimpleNamespace(device=H200)
aten = torch.ops.aten


def capture(fn, *inputs, dynamic: bool = False) -> list[torch.fx.GraphModule]:
    """The forward and backward ATen graphs AOTAutograd makes for `fn` (forward first)."""
    graphs: list[torch.fx.GraphModule] = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)
    out = torch.compile(fn, backend=backend, dynamic=dynamic)(*inputs)
    out.sum().backward()
    torch._dynamo.reset()
    assert len(graphs) == 2
    return graphs


def calls(gm: torch.fx.GraphModule, *targets) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def shape(node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(int(d) for d in node.meta["val"].shape)


def mm_flops(node: torch.fx.Node) -> int:
    """2*M*N*K from the operand shapes, independently of the pass."""
    a, b = node.args[-2:]
    (m, k), (k2, n) = shape(a), shape(b)
    assert k == k2
    return 2 * m * n * k


def check_all_annotated(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        ann = node.meta.get("apollo")
        assert ann is not None, node
        if ann.bound == "-":
            assert (ann.flops, ann.bytes, ann.est_us) == (0, 0, 0.0), node
        else:
            assert ann.bound in ("compute", "memory"), node
            assert ann.est_us >= H200.launch_us > 0, node
            assert ann.bytes > 0, node
        if node.op in ("placeholder", "output") or node.target is operator.getitem:
            assert ann.bound == "-", node


@pytest.fixture(scope="module")
def linear_graphs():
    torch.manual_seed(0)
    return capture(nn.Linear(16, 8), torch.randn(4, 16))


def test_linear_mm_flops_exact(linear_graphs):
    fw, bw = linear_graphs
    summaries = [cost.run(fw, CTX), cost.run(bw, CTX)]
    addmm = calls(fw, aten.addmm.default)
    assert len(addmm) == 1
    assert info(addmm[0]).flops == 2 * 4 * 8 * 16 == mm_flops(addmm[0])
    mms = calls(bw, aten.mm.default)
    assert mms, bw.graph
    for node in mms:
        assert info(node).flops == mm_flops(node) == 2 * 4 * 8 * 16
    for gm, summary in zip(linear_graphs, summaries):
        check_all_annotated(gm)
        anns = [info(n) for n in gm.graph.nodes]
        assert summary["flops"] == sum(a.flops for a in anns)
        assert summary["bytes"] == sum(a.bytes for a in anns)
        assert summary["est_us"] == pytest.approx(sum(a.est_us for a in anns))
        assert summary["compute_bound"] == sum(a.bound == "compute" for a in anns)
        assert summary["memory_bound"] == sum(a.bound == "memory" for a in anns) > 0
    # addmm bytes: bias (8) + x (4x16) + weight view (16x8) read, out (4x8) written, fp32.
    assert info(addmm[0]).bytes == 4 * (8 + 4 * 16 + 16 * 8 + 4 * 8)


def test_views_are_free(linear_graphs):
    fw, _ = linear_graphs
    cost.run(fw, CTX)
    (t,) = calls(fw, aten.t.default)
    ann = info(t)
    assert (ann.flops, ann.bytes, ann.intensity, ann.bound, ann.est_us) == (0, 0, 0.0, "-", 0.0)
    assert cost.node_cost(t, H200) == (0, 0, 0.0, "-", 0.0)


def test_layernorm_gelu_memory_bound():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, requires_grad=True)
    fw, bw = capture(nn.Sequential(nn.LayerNorm(16), nn.GELU()), x)
    cost.run(fw, CTX)
    cost.run(bw, CTX)
    check_all_annotated(fw)
    check_all_annotated(bw)
    (gelu,) = calls(fw, aten.gelu.default)
    assert info(gelu).flops == 2 * 3 * 16  # one per output element
    assert info(gelu).bytes == 2 * 4 * 2 * 3 * 16  # read + write fp32
    (ln,) = calls(fw, aten.native_layer_norm.default)
    for node in (gelu, ln, *calls(bw, aten.gelu_backward.default, aten.native_layer_norm_backward.default)):
        assert info(node).bound == "memory", node
        assert info(node).est_us > 0
    for node in calls(fw, operator.getitem):
        assert info(node).bound == "-"


def test_matmul_and_add():
    torch.manual_seed(0)
    a = torch.randn(8, 32, requires_grad=True)
    b = torch.randn(32, 16, requires_grad=True)
    fw, bw = capture(lambda a, b: a @ b + 1.0, a, b)
    cost.run(fw, CTX)
    cost.run(bw, CTX)
    check_all_annotated(fw)
    check_all_annotated(bw)
    (mm,) = calls(fw, aten.mm.default)
    assert info(mm).flops == 2 * 8 * 16 * 32
    assert len(calls(bw, aten.mm.default)) == 2
    for node in calls(bw, aten.mm.default):
        assert info(node).flops == mm_flops(node) == 2 * 8 * 16 * 32
    (add,) = calls(fw, aten.add.Tensor)
    assert info(add).bound == "memory"
    assert info(add).flops == 8 * 16


def test_big_bf16_matmul_is_compute_bound_add_is_memory_bound():
    # Fake tensors: only shapes and dtypes matter, nothing is allocated or computed.
    def f(a, b, c):
        return torch.mm(a, b) + c

    n = 4096
    with torch._subclasses.FakeTensorMode():
        args = [torch.empty(n, n, dtype=torch.bfloat16) for _ in range(3)]
        gm = make_fx(f)(*args)
    summary = cost.run(gm, CTX)
    check_all_annotated(gm)
    (mm,) = calls(gm, aten.mm.default)
    (add,) = calls(gm, aten.add.Tensor)
    flops, nbytes, intensity, bound, est_us = cost.node_cost(mm, H200)
    assert flops == 2 * n**3
    assert nbytes == 3 * n * n * 2
    assert intensity == pytest.approx(flops / nbytes)
    assert bound == "compute"
    peak = H200.peak_flops(torch.bfloat16, matmul=True)
    assert est_us == pytest.approx(flops / peak * 1e6 + H200.launch_us)
    assert info(add).bound == "memory"
    assert info(add).est_us == pytest.approx(3 * n * n * 2 / H200.bandwidth * 1e6 + H200.launch_us)
    assert summary["compute_bound"] == 1 and summary["memory_bound"] == 1
    assert summary["flops"] == 2 * n**3 + n * n


def test_symbolic_shapes_use_hints():
    def f(a, b):
        return torch.mm(a, b).relu()

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(6, 5), torch.randn(5, 7))
    (mm,) = calls(gm, aten.mm.default)
    assert isinstance(mm.meta["val"].shape[0], torch.SymInt)
    cost.run(gm, CTX)
    check_all_annotated(gm)
    assert info(mm).flops == 2 * 6 * 7 * 5
    assert info(mm).bytes == 4 * (6 * 5 + 5 * 7 + 6 * 7)
    (relu,) = calls(gm, aten.relu.default)
    assert info(relu).flops == 6 * 7


def test_dynamic_linear_capture():
    torch.manual_seed(0)
    fw, bw = capture(nn.Linear(16, 8), torch.randn(4, 3, 16), dynamic=True)
    cost.run(fw, CTX)
    cost.run(bw, CTX)
    check_all_annotated(fw)
    check_all_annotated(bw)
    (addmm,) = calls(fw, aten.addmm.default)
    assert info(addmm).flops == 2 * 12 * 8 * 16
    for node in calls(fw, operator.mul):  # SymInt arithmetic is free
        assert info(node).bound == "-"


def test_unknown_ops_never_raise():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 4)

    def mystery(t):
        return t

    a = g.call_function(mystery, (x,))  # no meta at all
    b = g.call_function(aten.neg.default, (x,))  # an aten op without meta["val"]
    c = g.call_function(aten.mm.default, (x, a))  # registry op whose operand has no meta
    c.meta["val"] = torch.empty(4, 4)
    d = g.call_function(aten.cos.default, (x,))
    d.meta["val"] = ("not", "a", "tensor")
    g.output((a, b, c, d))
    gm = torch.fx.GraphModule(nn.Module(), g)
    summary = cost.run(gm, CTX)
    for node in gm.graph.nodes:
        assert "apollo" in node.meta
    assert info(a).bound == "-"  # a Python function with no tensor output: free
    assert info(b).bound == "memory" and info(b).bytes == 64
    assert info(c).bound in ("compute", "memory") and info(c).est_us > 0
    assert info(d).bytes == 64
    assert math.isfinite(summary["est_us"])
    assert cost.run(gm, CTX) == summary  # deterministic
