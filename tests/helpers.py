"""What several test files share: train a model eagerly and under apollo side by side and compare
loss and every gradient; the step ``compile_step`` tests compile; synthetic lane plans for the
performance model; and a fake CUDA graph, so the CUDA-graph runner runs on the CPU."""

from __future__ import annotations

import copy
import operator

import networkx as nx
import torch
import torch.fx

from apollo_compile.annotations import KEY, NodeInfo
from apollo_compile.devices import DEVICE_SPECS
from apollo_compile.lane_plan import LanePlan, Subgraph

H200 = DEVICE_SPECS["H200"]

# fp32 on CPU. The eager subgraph compiler runs the same ATen kernels as eager PyTorch, only
# split differently, so results agree to float rounding (observed: bit-identical). Inductor
# fuses and reorders reductions: a few ulps per op, which five SGD steps on tiny models keep
# well under 1e-4 relative (observed ~1e-6).
TOLERANCE = {"eager": dict(rtol=1e-5, atol=1e-6), "inductor": dict(rtol=1e-4, atol=1e-5)}


def assert_same_loss_and_grads(loss, ref_loss, model, ref, tol: dict, step: int) -> None:
    """The loss and every parameter's gradient of `model` equal `ref`'s within `tol`."""
    torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"step {step} loss: {m}")
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m: f"step {step} grad {name}: {m}")


def assert_trains_like_eager(model, make_inputs, options=None, steps=3, lr=0.1, tol=None, seed=None):
    """Several SGD steps: loss and every parameter gradient match eager at every step. With `seed`,
    torch is reseeded (seed + step) before each forward, so random ops (dropout) draw alike."""
    options = dict(options or {})
    tol = tol or TOLERANCE[options.get("subgraph_compiler", "inductor")]
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="apollo", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        inputs = make_inputs(step)
        if seed is not None:
            torch.manual_seed(seed + step)
        loss = compiled(*inputs)
        if seed is not None:
            torch.manual_seed(seed + step)
        ref_loss = ref(*inputs)
        loss.backward()
        ref_loss.backward()
        assert_same_loss_and_grads(loss, ref_loss, model, ref, tol, step)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return compiled


def backward_step(model):
    """The step the whole-step tests compile: the forward, ``loss.backward()``, the loss detached."""

    def step(images, tokens):
        loss = model(images, tokens)
        loss.backward()
        return loss.detach()

    return step


def cost_nodes(graph: torch.fx.Graph, parts: list[tuple[str, float]]) -> list[torch.fx.Node]:
    """Fake compute nodes carrying cost annotations: (bound, est_us) each."""
    out = []
    for bound, us in parts:
        n = graph.call_function(operator.add, (1, 1))
        n.meta[KEY] = NodeInfo(bound=bound, est_us=us)
        out.append(n)
    return out


def make_plan(subgraphs: list[tuple[int, list[tuple[str, float]]]], edges: list[tuple[int, int]]) -> LanePlan:
    """A lane plan of synthetic subgraphs, each (lane, [(bound, est_us), ...]), with `edges` between
    them (indices into `subgraphs`)."""
    graph = torch.fx.Graph()
    sgs = [Subgraph(i, lane, cost_nodes(graph, parts)) for i, (lane, parts) in enumerate(subgraphs)]
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(sgs)))
    dag.add_edges_from(edges)
    lanes: dict[int, list[str]] = {}
    for sg in sgs:
        lanes.setdefault(sg.lane, [f"m{sg.lane}"])
    return LanePlan(lanes, sgs, dag, list(nx.lexicographical_topological_sort(dag)))


def two_tower_plan(heavy: float = 6000.0, light: float = 2000.0) -> LanePlan:
    """Forward of a two-tower model: lane 1 heavy, lane 2 light, then a join on lane 0."""
    return make_plan(
        [(1, [("compute", heavy * 0.8), ("memory", heavy * 0.2)]),
         (2, [("compute", light * 0.6), ("memory", light * 0.4)]),
         (0, [("memory", 300.0)])],
        [(0, 2), (1, 2)])


def replace_pass(monkeypatch, name: str, fn) -> None:
    """Run `fn` in place of the pipeline's graph pass `name` for one test."""
    from apollo_compile import pipeline

    monkeypatch.setattr(pipeline, "GRAPH_PASSES", [(n, fn if n == name else f) for n, f in pipeline.GRAPH_PASSES])


class FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: a replay re-runs the runtime on the static
    inputs and writes the results into the captured output tensors, in place, as a CUDA-graph
    replay rewrites the same memory."""

    def __init__(self, fn, static_inputs, outputs):
        self.fn, self.static_inputs, self.outputs = fn, static_inputs, outputs

    def replay(self):
        for dst, src in zip(self.outputs, self.fn(list(self.static_inputs))):
            if isinstance(dst, torch.Tensor) and dst is not src:
                for d in range(dst.dim()):  # a broadcast output (stride 0, an expand) has each element once
                    if dst.stride(d) == 0 and dst.size(d) > 1:
                        dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
                with torch.no_grad():
                    dst.copy_(src)


def fake_cuda_graphs(monkeypatch) -> None:
    """CudaGraphRunner captures FakeGraphs, and the CUDA calls around capture are no-ops, for one test."""
    from apollo_compile.runtime.cudagraph import CudaGraphRunner

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())

    def capture_one(self, fn, pool, inputs=None):
        inputs = list(self.static_inputs) if inputs is None else inputs
        # a capture runs nothing: undo what running it wrote into its inputs (an optimizer's update)
        # and into the optimizer's moments, which the update finds by name (fused_update.written_state)
        written = [x for x in inputs if isinstance(x, torch.Tensor)]
        written += self.written_state() if self.written_state is not None else []
        before = [(x, x.detach().clone()) for x in written]
        outputs = fn(inputs)
        with torch.no_grad():
            for x, value in before:
                if not torch.equal(x, value):  # only what it wrote: a copy bumps the version autograd checks
                    x.copy_(value)
        return FakeGraph(fn, self.static_inputs, outputs), outputs

    monkeypatch.setattr(CudaGraphRunner, "_capture_one", capture_one)


def dynamo_graph(model, *inputs):
    """The Dynamo FX graph of `model` and its example inputs (no AOTAutograd, no apollo)."""
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(model, backend=capture)(*inputs)
    assert len(captured) == 1
    return captured[0]
