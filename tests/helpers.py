"""What several test files share: train a model eagerly and under apollo side by side and compare
loss and every gradient; the step ``compile_step`` tests compile; synthetic lane plans for the
performance model; and a fake CUDA graph, so the CUDA-graph runner runs on the CPU."""

from __future__ import annotations

import copy
import operator

import networkx as nx
import pytest
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


def one_layer_hf_zoo(monkeypatch, hf_zoo) -> None:
    """benchmarks/probes/hf_zoo.py's shared configs (TEXT, VISION, LM) with one layer a tower, for
    one test: one graph, lanes and eager's numbers need no depth, and each layer is more model code
    for Dynamo to trace. A test of what repeats per layer (a frame serving several) keeps two."""
    for config in (hf_zoo.TEXT, hf_zoo.VISION, hf_zoo.LM):
        monkeypatch.setitem(config, "num_hidden_layers", 1)


def eager_subgraphs(monkeypatch) -> None:
    """Subgraphs run as ATen ops whatever `subgraph_compiler` says, for one test: the graph is planned
    as for Inductor (its decompositions and joint-graph passes, pointwise recompute counted as fused)
    and only Inductor's code generation, a C++ build per kernel, is left out. For tests of apollo's
    plans; the tests of what Inductor itself makes of a subgraph compile with it."""
    from apollo_compile import pipeline

    build_runtime = pipeline.build_runtime

    def eager(planned, lanes, codegen, name, kind, compiler, *args, **kwargs):
        return build_runtime(planned, lanes, codegen, name, kind, "eager", *args, **kwargs)

    monkeypatch.setattr(pipeline, "build_runtime", eager)


def inductor_entry(monkeypatch, record) -> None:
    """Inductor's ``compile_fx_inner`` calls ``record(gm, example_inputs, kwargs)``, with Inductor's
    config as apollo set it, and returns the graph run as ATen ops, for one test: for tests of what
    apollo hands Inductor (its settings, its inputs), not of the code Inductor generates."""
    import torch._inductor.compile_fx as compile_fx

    from apollo_compile.runtime import subgraphs

    def compile_fx_inner(gm, example_inputs, **kwargs):
        record(gm, example_inputs, kwargs)
        return subgraphs.compile_subgraph(gm, example_inputs, "eager", "inference")

    monkeypatch.setattr(compile_fx, "compile_fx_inner", compile_fx_inner)


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

    def __init__(self, fn, static_inputs, outputs, name=""):
        self.fn, self.static_inputs, self.outputs, self.name = fn, static_inputs, outputs, name

    def replay(self):
        for dst, src in zip(self.outputs, self.fn(list(self.static_inputs))):
            if isinstance(dst, torch.Tensor) and dst is not src:
                for d in range(dst.dim()):  # a broadcast output (stride 0, an expand) has each element once
                    if dst.stride(d) == 0 and dst.size(d) > 1:
                        dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
                with torch.no_grad():
                    dst.copy_(src)


class FakeCapture:
    """A capturer (runtime/capture.py's seam) for the CPU: capturing runs the runtime once and
    returns a FakeGraph; `fail` (a substring of the graph's name, e.g. "backward") makes the
    captures of those graphs raise `error` after running part of the runtime, as a capture that
    runs out of memory midway does. `ms` (candidate -> ms) is what timing reports."""

    def __init__(self, fail: str | None = None, error: type[Exception] = torch.OutOfMemoryError, ms=None):
        self.fail, self.error, self.ms = fail, error, dict(ms or {})
        self.captured: list[str] = []  # the names captured (or tried)

    def capture(self, fn, inputs, pool, name, written_state=()):
        self.captured.append(name)
        replay_inputs = list(inputs)  # a boxed runtime clears `inputs`
        # a capture runs nothing: undo what running it wrote into its inputs (an optimizer's update)
        # and into the optimizer's moments, which the update finds by name (fused_update.written_state)
        written = [x for x in replay_inputs if isinstance(x, torch.Tensor)] + list(written_state)
        before = [(x, x.detach().clone()) for x in written]
        if self.fail is not None and self.fail in name:
            inputs.clear()  # the capture consumed its list, as a runtime that ran out midway has
            raise self.error(f"synthetic: out of memory capturing {name}")
        outputs = fn(inputs)
        with torch.no_grad():
            for x, value in before:
                if not torch.equal(x, value):  # only what it wrote: a copy bumps the version autograd checks
                    x.copy_(value)
        return FakeGraph(fn, replay_inputs, outputs, name), outputs

    def time(self, graph, replays):
        for _ in range(1 + replays):
            graph.replay()
        return next((ms for candidate, ms in self.ms.items() if f"({candidate})" in graph.name), 1.0)


def fake_cuda(monkeypatch) -> None:
    """The CUDA calls around a capture are no-ops, for one test."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())


def fake_cuda_graphs(monkeypatch, capturer: FakeCapture | None = None) -> FakeCapture:
    """Runners capture FakeGraphs (capture.DEFAULT, the seam a runner without a capturer of its own
    uses), and the CUDA calls around capture are no-ops, for one test."""
    from apollo_compile.runtime import capture

    fake_cuda(monkeypatch)
    capturer = capturer if capturer is not None else FakeCapture()
    monkeypatch.setattr(capture, "DEFAULT", capturer)
    return capturer


def runner_for(candidates, name: str, kind: str, family=None, **config):
    """A CUDA-graph runner of `candidates` for a graph `name` of `kind`, configured by `config`
    (RunnerConfig's fields), in `family` (default: a new one)."""
    from apollo_compile.runtime.config import RunnerConfig
    from apollo_compile.runtime.cudagraph import CudaGraphRunner
    from apollo_compile.runtime.instances import GraphFamily

    return CudaGraphRunner(candidates, family if family is not None else GraphFamily(),
                           RunnerConfig(name, kind, **config))


# The CUDA-graph runner inside real training on the CPU (tests/test_cudagraph_training.py, test_instances.py)

@pytest.fixture
def runners(monkeypatch):
    """Every apollo graph compiled in the test gets a CUDA-graph runner with a fake graph, which
    replays "lanes" unmeasured (timing needs CUDA events)."""
    from apollo_compile import pipeline
    from apollo_compile.runtime import choice
    from apollo_compile.runtime.cudagraph import CudaGraphRunner
    from apollo_compile.runtime.instances import GraphFamily

    made: list = []
    fake_cuda_graphs(monkeypatch)
    monkeypatch.setattr(pipeline, "quota_candidates", lambda ctx: {})  # no green contexts on a CPU
    families: dict[int, object] = {}
    original = pipeline.compile_graph

    def compile_graph(gm, example_inputs, kind, name, options, spec, device, model_plan, family=None,
                      whole_step=False):
        family = families.setdefault(id(model_plan), GraphFamily())  # forward and backward share one
        fn = original(gm, example_inputs, kind, name, options, spec, device, model_plan, family, whole_step)
        runner = getattr(fn, "inner", fn)  # inside first_call.FirstCallFallback
        assert isinstance(runner, CudaGraphRunner), model_plan.graphs[kind].fallback
        made.append(runner)
        return fn

    monkeypatch.setattr(pipeline, "compile_graph", compile_graph)
    with choice.using(choice.Fixed("lanes")):
        yield made


def twins(compiler: str, layers: int = 2):
    """(model, its eager twin with the same weights, the model compiled with apollo); `layers`
    blocks a tower."""
    from models import TwoTower

    torch.manual_seed(0)
    model = TwoTower(layers=layers)
    ref = copy.deepcopy(model)
    return model, ref, torch.compile(model, backend="apollo", options={"subgraph_compiler": compiler})


def backward_like_eager(compiled, model, ref, batches) -> None:
    """One backward per batch through `compiled` and its eager twin `ref`: the loss and every
    gradient match; then zero_grad(set_to_none=True)."""
    for step, inputs in enumerate(batches):
        loss, ref_loss = compiled(*inputs), ref(*inputs)
        loss.backward()
        ref_loss.backward()
        assert_same_loss_and_grads(loss, ref_loss, model, ref, TOLERANCE["eager"], step)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def sgd_like_eager(compiled, model, ref, steps: int, micro_batches: int = 1, forwards_first: bool = False,
                   make_inputs=None) -> None:
    """`steps` SGD steps through `compiled` and its eager twin `ref`, each over `micro_batches`
    micro-batches (gradients accumulated; `forwards_first`: every micro-batch's forward before
    their backwards) of `make_inputs(seed)`: after each step the loss and every gradient match."""
    from models import two_tower_inputs

    make_inputs = make_inputs or (lambda seed: two_tower_inputs(seed=seed))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(steps):
        batches = [make_inputs(10 * step + micro) for micro in range(micro_batches)]
        forwards = [(compiled(*inputs), ref(*inputs)) for inputs in batches] if forwards_first else None
        for k, inputs in enumerate(batches):
            loss, ref_loss = forwards[k] if forwards_first else (compiled(*inputs), ref(*inputs))
            loss.backward()
            ref_loss.backward()
        assert_same_loss_and_grads(loss, ref_loss, model, ref, TOLERANCE["eager"], step)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)


def dynamo_graph(model, *inputs):
    """The Dynamo FX graph of `model` and its example inputs (no AOTAutograd, no apollo)."""
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(model, backend=capture)(*inputs)
    assert len(captured) == 1
    return captured[0]


def graph_args(gm):
    """Inputs for a graph from its placeholders' metadata (integer inputs are zeros: valid ids)."""
    gen = torch.Generator().manual_seed(0)
    args = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta["val"]
            if v.dtype.is_floating_point:
                args.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype).normal_(generator=gen))
            else:
                args.append(torch.zeros(v.shape, dtype=v.dtype))
    return args


def assert_runtimes_equal_the_graph(graph) -> None:
    """Every runtime of a planned graph returns exactly what the graph computes on the same inputs."""
    args = graph_args(graph.gm)
    expected = graph.gm(*args)
    for name, run in graph.runtimes.items():
        got = run(list(args))
        assert len(got) == len(expected), name
        for g, e in zip(got, expected):
            if isinstance(e, torch.Tensor):
                torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
            else:
                assert g == e
