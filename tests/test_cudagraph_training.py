"""The CUDA-graph runner inside real training, on the CPU: AOTAutograd, autograd and the optimizer
drive apollo's runners exactly as on a GPU, with a fake graph standing in for the CUDA graph.

What this checks that the GPU runs alone did: parameters are used in place (AOTAutograd's static
inputs), the forward's saved activations reach the backward in place and stay valid until it runs,
the loss and the gradients handed out are never rewritten by later replays (kept losses, gradient
accumulation), and training equals eager PyTorch step by step. What it cannot check: stream
ordering and capture itself (the fake graph re-runs the runtime; no CUDA)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import apollo_compile
from apollo_compile import ApolloFallbackWarning
from apollo_compile.runtime import capture, choice
from apollo_compile.runtime.config import LANE_MEMORY_RATIO
from helpers import (TOLERANCE, FakeCapture, assert_same_loss_and_grads, backward_like_eager, runners,  # noqa: F401
                     sgd_like_eager, twins)  # (runners: the fixture)
from models import TwoTower, two_tower_inputs

# One block a tower: what the runner is checked on (two towers' graphs, their saved activations
# and gradients) needs no depth, and each block is graph to trace and plan on every compile.
LAYERS = 1


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_training_through_the_runner_equals_eager(runners, compiler):
    model, ref, compiled = twins(compiler, LAYERS)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    losses = []
    for step in range(5):
        inputs = two_tower_inputs(seed=step)
        loss, ref_loss = compiled(*inputs), ref(*inputs)
        loss.backward()
        ref_loss.backward()
        assert_same_loss_and_grads(loss, ref_loss, model, ref, TOLERANCE[compiler], step)
        if step > 0:  # a replay: AccumulateGrad took the graph's own buffers as .grad, no copy
            graph_memory = {o.data_ptr() for o in runners[1].captured.static_outputs if isinstance(o, torch.Tensor)}
            assert {p.grad.data_ptr() for p in model.parameters()} <= graph_memory
        losses.append((loss.detach(), ref_loss.detach()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    forward, backward = runners
    assert forward.replays == 4 and backward.replays == 4  # call 1 eager, then capture + replays
    assert forward.family is backward.family and forward.family.forward_chosen == forward.chosen == "lanes"
    assert forward.ungraphed_calls == 0 and backward.ungraphed_calls == 0
    assert forward.captured.fixed_ptrs and backward.captured.fixed_ptrs  # parameters / saved activations used in place
    assert backward.summary()["lent_moved"] == 0  # set_to_none: nothing held a gradient at a replay
    for runner in runners:  # each replayed call's host time, of which the launch is a part
        summary = runner.summary()
        assert 0 < summary["launch_host_ms"] <= summary["replay_host_ms"]
    for loss, ref_loss in losses:  # kept losses were never rewritten by later replays
        torch.testing.assert_close(loss, ref_loss, **TOLERANCE[compiler])


def test_the_cache_the_first_step_left_is_released_once_before_the_first_capture(runners, monkeypatch):
    """NOTE: The first, un-graphed step leaves its cache behind."""
    from apollo_compile.runtime import cudagraph

    released = []
    monkeypatch.setattr(cudagraph, "release_cached_segments",
                        lambda: released.append([r.graph is not None for r in runners]))
    model, ref, compiled = twins("eager", LAYERS)
    backward_like_eager(compiled, model, ref, [two_tower_inputs(seed=s) for s in range(4)])
    assert released == [[False, False]]  # once, at the forward's capture, before anything was captured
    assert all(r.graph is not None for r in runners)


def first_step_pools(monkeypatch) -> tuple[list, list]:
    """Stand-ins for the first step's pool (graph_pool.first_step_pool, allocating_in), which need
    CUDA: (the pools opened, the pool each eager call of a runner ran in)."""
    import contextlib

    from apollo_compile.runtime import cudagraph, graph_pool, instances

    opened, ran_in = [], []

    def first_step_pool(device, kind):
        if kind not in graph_pool.FIRST_STEP_POOL:  # the real rule: which graphs open one
            return None
        opened.append(f"pool {len(opened)}")
        return opened[-1]

    @contextlib.contextmanager
    def allocating_in(pool):
        ran_in.append(pool)
        yield

    monkeypatch.setattr(instances, "first_step_pool", first_step_pool)
    monkeypatch.setattr(cudagraph, "allocating_in", allocating_in)
    return opened, ran_in


@pytest.mark.parametrize("order", ["steps", "accumulating", "two forwards first"])
def test_the_first_step_runs_in_a_pool_of_its_own(runners, monkeypatch, order):
    """NOTE: The first step in a pool of its own. The forward's and the backward's first calls run
    in one pool, opened once and closed when the first backward ends, so the capture's release of
    cached memory (before the first capture) finds it closed; so with gradient accumulation too.
    With two forwards before their backwards, the second forward's call (its capture) closes it,
    the first backward runs in the default pool, and nothing else runs un-graphed: from the second
    step on, the second forward replays a family of its own (runtime/instances.py). Training equals
    eager throughout."""
    from apollo_compile.runtime import cudagraph

    opened, ran_in = first_step_pools(monkeypatch)
    at_release = []
    monkeypatch.setattr(cudagraph, "release_cached_segments",
                        lambda: at_release.append(runners[0].family.first_step_pool))
    model, ref, compiled = twins("eager", LAYERS)
    sgd_like_eager(compiled, model, ref, 3, micro_batches=1 if order == "steps" else 2,
                   forwards_first=order == "two forwards first")
    forward, backward = runners
    assert opened == ["pool 0"] and forward.family.first_step_pool is None
    if order == "two forwards first":  # forward 1 in the pool; backward 1 not
        assert ran_in == ["pool 0", None], ran_in
        assert forward.summary()["instances"] == 2 and forward.summary()["ungraphed_calls"] == 0
    else:
        assert ran_in == ["pool 0", "pool 0"] and at_release == [None], ran_in
        assert forward.replays and backward.replays


@pytest.mark.parametrize("opened_by", [{"forward"}, {"forward", "inference"}])
def test_a_whole_steps_first_call_opens_the_pool_only_where_told(runners, monkeypatch, opened_by):
    """compile_step's one graph (an inference graph) runs its first call in the default pool: its
    optimizer state exists before that call, so a pool of its own keeps nothing apart (NOTE: The
    first step in a pool of its own). With "inference" among the kinds that open one
    (bench_whole_step's apollo-step-opt-first-step-pool), its first call opens it and closes it when
    that call ends. Training equals eager either way."""
    from apollo_compile.runtime import graph_pool

    monkeypatch.setattr(graph_pool, "FIRST_STEP_POOL", frozenset(opened_by))
    opened, ran_in = first_step_pools(monkeypatch)
    model, ref, opt, ref_opt, compiled = adamw_inside_the_step()
    for i in range(3):
        inputs = two_tower_inputs(seed=i)
        loss, ref_loss = compiled(*inputs), ref(*inputs)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOLERANCE["eager"])
    (runner,) = runners
    pool = ["pool 0"] if "inference" in opened_by else []
    assert runner.kind == "inference" and opened == pool and ran_in == (pool or [None])
    assert runner.family.first_step_pool is None and runner.replays == 2


@pytest.mark.parametrize("cudagraphs, near_limit", [("auto", False), (True, True)])
def test_cudagraphs_true_reaches_the_runner_as_capture_near_the_limit(runners, cudagraphs, near_limit):
    """NOTE: A capture needs headroom: "auto" checks it, True captures regardless."""
    torch.manual_seed(0)
    compiled = torch.compile(TwoTower(layers=LAYERS), backend="apollo", options={"subgraph_compiler": "eager",
                                                                    "cudagraphs": cudagraphs})
    compiled(*two_tower_inputs(seed=0)).backward()
    assert [r.config.memory.capture_headroom is None for r in runners] == [near_limit, near_limit]


def test_a_whole_step_is_captured_regardless_of_headroom(runners):
    """docs/design/cuda-graphs.md#capture-headroom: a whole step has nothing eager beside its graph,
    and a capture that runs out completes its step un-graphed (tested below); the module path's
    graphs keep the rule (the test above)."""
    _, _, _, _, compiled = adamw_inside_the_step()
    compiled(*two_tower_inputs(seed=0))
    (runner,) = runners
    assert runner.kind == "inference" and runner.config.memory.capture_headroom is None


def test_replay_host_time_leaves_out_the_capturing_call(runners):
    """Capturing and measuring candidates take seconds on a GPU; counted as a replay, they would
    make `replay_host_ms` read far more than a replay's launch takes."""
    import time

    class SlowChoice(choice.Fixed):
        def unmeasured(self, graph):  # stands in for measuring the candidates
            time.sleep(2.0)
            return super().unmeasured(graph)

    model, _, compiled = twins("eager", LAYERS)
    with choice.using(SlowChoice("lanes")):
        for step in range(3):
            compiled(*two_tower_inputs(seed=step)).backward()
            model.zero_grad(set_to_none=True)
    # two replays each: the capturing call's 2 s would read 1000 ms; a replay here takes 4-7 ms, and
    # up to 175 ms while another test process shares the two cores (pytest -n 2)
    for runner in runners:
        assert runner.replays == 2
        assert runner.summary()["replay_host_ms"] < 500


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_backward_takes_over_the_saved_activations_aotautograd_donates(runners, monkeypatch, micro_batches):
    """The forward's outputs are owned by the family and borrowed by what it hands out; the
    backward's capture takes the owners of the saved activations AOTAutograd donates (its own
    numbering of the backward's inputs reaches the runner), and training still equals eager, with
    gradient accumulation too. On the CPU nothing is freed for real: a list stands in for the
    graph pool, which keeps donated memory reserved (the fake graph replays read it)."""
    from apollo_compile.runtime import capture

    monkeypatch.setattr(capture, "in_graph_pool", lambda t: True)
    model, ref, compiled = twins("eager", LAYERS)
    sgd_like_eager(compiled, model, ref, 4, micro_batches)
    forward, backward = runners
    # the fake graph holds what its capture ran on, the donated owners among them (as a pool would)
    pool = {s.data_ptr(): s for s in (x.untyped_storage() for x in backward.graph.static_inputs
                                      if isinstance(x, torch.Tensor)) if s.data_ptr() in backward.captured.donated}
    assert backward.config.donated_idxs and pool, "AOTAutograd donates saved activations of this model"
    assert backward.summary()["donated_bytes"] == sum(s.nbytes() for s in pool.values())
    donated = set(pool)
    captured = backward.captured
    read_in_place = {captured.static_inputs[i].untyped_storage().data_ptr() for i in captured.fixed_ptrs}
    assert donated <= read_in_place and not donated & set(forward.family.owners)
    assert forward.ungraphed_calls == 0 and backward.ungraphed_calls == 0


def test_a_first_backward_that_retains_the_graph_donates_nothing(runners, monkeypatch):
    """AOTAutograd compiles the backward without donated inputs when its first call retains the
    graph: the runner then takes over nothing, and backward twice through each graph stays right."""
    from apollo_compile.runtime import capture

    monkeypatch.setattr(capture, "in_graph_pool", lambda t: True)
    model, ref, compiled = twins("eager", LAYERS)
    for step in range(3):
        inputs = two_tower_inputs(seed=step)
        loss, ref_loss = compiled(*inputs), ref(*inputs)
        loss.backward(retain_graph=True)
        loss.backward()
        ref_loss.backward(retain_graph=True)
        ref_loss.backward()
        assert_same_loss_and_grads(loss, ref_loss, model, ref, TOLERANCE["eager"], step)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    forward, backward = runners
    assert not backward.config.donated_idxs and backward.summary()["donated_bytes"] == 0
    assert forward.family.owners  # the forward's outputs stay the family's
    # 6 backward calls: the first step's two un-graphed (its forward was the graph's first call)
    assert backward.replays == 4 and forward.ungraphed_calls == 0 and backward.ungraphed_calls == 0
    assert backward.captured.fixed_ptrs  # captured reading the captured forward's saved activations in place


@pytest.mark.parametrize("set_to_none", [False, True])
def test_gradient_accumulation_through_the_runner(runners, set_to_none):
    """Two micro-batches per step: the gradients accumulated in .grad are never rewritten by a later
    replay. With set_to_none=True the first micro-batch's .grad is the graph's own buffer (stolen by
    AccumulateGrad), moved out of the graph's memory before the next replay; with False, .grad
    lives on from the eager first call and the graph's gradients are only added into it."""
    model, ref, compiled = twins("eager", LAYERS)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(3):
        for micro in range(2):
            inputs = two_tower_inputs(seed=10 * step + micro)
            compiled(*inputs).backward()
            ref(*inputs).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOLERANCE["eager"], msg=lambda m: f"step {step} {name}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=set_to_none)
    forward, backward = runners
    assert backward.replays == 5 and backward.ungraphed_calls == 0 and forward.ungraphed_calls == 0
    assert (backward.summary()["lent_moved"] > 0) == set_to_none


def test_input_gradients_kept_across_steps_are_moved_not_overwritten(runners):
    """An input that requires grad (saliency maps, adversarial steps): its .grad is the backward
    graph's memory too. Kept across later steps, it is moved to a copy, never overwritten."""
    model, ref, compiled = twins("eager", LAYERS)
    kept, expected = [], []
    for step in range(4):
        images, tokens = two_tower_inputs(seed=step)
        ref_images = images.clone().requires_grad_()
        images.requires_grad_()
        compiled(images, tokens).backward()
        ref(ref_images, tokens).backward()
        kept.append(images)
        expected.append(ref_images.grad)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    for step, (images, grad) in enumerate(zip(kept, expected)):
        torch.testing.assert_close(images.grad, grad, **TOLERANCE["eager"], msg=lambda m: f"step {step}: {m}")
    forward, backward = runners
    assert forward.ungraphed_calls == 0 and backward.ungraphed_calls == 0
    assert backward.summary()["lent_moved"] == 2  # steps 1 and 2 were replays kept past the next one


def test_gradients_from_autograd_grad_kept_across_steps_are_moved_not_overwritten(runners):
    """torch.autograd.grad hands out the backward's outputs as they are (no .grad involved): kept
    past the next step (a gradient penalty's history, say), they are moved to a copy, never
    overwritten, and the graph keeps replaying."""
    model, ref, compiled = twins("eager", LAYERS)
    kept, expected = [], []
    for step in range(4):
        inputs = two_tower_inputs(seed=step)
        kept.append(torch.autograd.grad(compiled(*inputs), list(model.parameters())))
        expected.append(torch.autograd.grad(ref(*inputs), list(ref.parameters())))
    for step, (grads, ref_grads) in enumerate(zip(kept, expected)):
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, **TOLERANCE["eager"], msg=lambda m: f"step {step}: {m}")
    forward, backward = runners
    assert forward.ungraphed_calls == 0 and backward.ungraphed_calls == 0
    assert backward.summary()["lent_moved"] > 0


def test_a_memory_budget_bounds_what_concurrency_may_cost(runners):
    """With a memory_budget the runners replay a concurrent candidate only within 1.1x of the
    one-stream candidate's capture pool; without one, the fastest (the pools are still reported)."""
    torch.manual_seed(0)
    for options, ratio in (({}, None), ({"memory_budget": 0.5}, LANE_MEMORY_RATIO)):
        runners.clear()
        torch._dynamo.reset()
        compiled = torch.compile(TwoTower(layers=LAYERS), backend="apollo",
                                 options={"subgraph_compiler": "eager", **options})
        compiled(*two_tower_inputs()).backward()
        assert runners and all(r.config.memory.lane_memory_ratio == ratio for r in runners), options


def test_a_whole_step_under_a_budget_measures_its_lanes(runners):
    """A whole step's graph donates nothing (its backward is inside it), so the memory-first rule
    does not apply: under a budget it measures its candidates, lanes among them, each bounded by
    lane_memory_ratio (docs/design/cuda-graphs.md#memory-budget)."""
    from helpers import backward_step

    torch.manual_seed(0)
    compiled = apollo_compile.compile_step(backward_step(TwoTower(layers=LAYERS)),
                                           options={"subgraph_compiler": "eager", "memory_budget": 0.5})
    compiled(*two_tower_inputs(seed=0))
    (runner,) = runners
    assert runner.kind == "inference" and runner.config.memory.lane_memory_ratio == LANE_MEMORY_RATIO
    assert {"lanes", "one_lane"} <= set(runner.candidates) and runner.chooser.memory_first_reason(will_donate=False) is None


def test_under_a_budget_both_graphs_replay_one_lane_unmeasured_in_real_training(runners, monkeypatch):
    """The forward learns that its backward reuses the saved activations from the family: the
    backward is compiled at the first backward, before the forward's second call captures. Under a
    budget neither graph then measures its candidates (timing would need CUDA events: on the CPU
    it would fail the capture and run un-graphed), and training equals eager."""
    from apollo_compile.runtime import capture

    monkeypatch.setattr(capture, "in_graph_pool", lambda t: True)
    torch.manual_seed(0)
    model = TwoTower(layers=LAYERS)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="apollo", options={"subgraph_compiler": "eager", "memory_budget": 0.5})
    with choice.using(choice.ChooseFastest()):  # apollo's own rule, in place of the fixture's fixed "lanes"
        backward_like_eager(compiled, model, ref, [two_tower_inputs(seed=step) for step in range(3)])
    forward, backward = runners
    assert forward.family.backward_donates and backward.summary()["donated_bytes"] > 0
    for runner in (forward, backward):
        assert set(runner.candidates) == {"lanes", "one_lane"}, "the model has two towers: two candidates"
        assert runner.chosen == "one_lane" and runner.summary()["measured_ms"] == {}
        assert runner.replays == 2 and runner.ungraphed_calls == 0 and runner.disabled is None


@pytest.mark.parametrize("dynamic", [True, None])
def test_a_graph_with_symbolic_sizes_replays_only_at_the_shapes_it_was_captured_at(runners, dynamic):
    """dynamic=True, or Dynamo's automatic dynamic shapes (None: a second batch size recompiles the
    graph with a symbolic batch): the capture holds the sizes of its call, so a call at another
    batch size runs without the CUDA graph, with one warning (the forward's: its backward runs
    un-graphed because it did), and training equals eager throughout. Before, the next replay copied a batch of 5 into the static buffer of a batch of 6
    and failed (a batch of 1 would have broadcast into it)."""
    torch.manual_seed(0)
    model = TwoTower(layers=LAYERS)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="apollo", options={"subgraph_compiler": "eager"}, dynamic=dynamic)
    sizes = (3, 4, 6, 6, 5, 6, 5) if dynamic is None else (4, 6, 6, 5, 6, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backward_like_eager(compiled, model, ref, [two_tower_inputs(batch=b, seed=k) for k, b in enumerate(sizes)])
    symbolic = [r for r in runners if r.config.symbolic]
    assert [r.kind for r in symbolic] == ["forward", "backward"]
    for runner in symbolic:  # eager at 4, captured at 6 and replayed twice more, eager at 5 twice
        assert (runner.replays, runner.ungraphed_calls) == (3, 2), runner.kind
        assert runner.captured.captured_shapes is not None and runner.disabled is None
    messages = [str(w.message) for w in caught if "input shapes other than" in str(w.message)]
    assert len(messages) == 1 and messages[0].split()[1] == symbolic[0].name, messages
    assert not [r for r in runners if not r.config.symbolic and r.ungraphed_calls], "static graphs replay throughout"


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "unmarked"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_whole_step_gradients_are_lent_not_copied(runners, accumulate, marked, monkeypatch):
    """compile_step's one graph replays like a backward: its new .grad tensors are the graph's own
    memory (no parameter-sized copy per step); with gradient accumulation over two calls the second
    call's graph reads them in place and its sums are written back into them. The loss, held across
    steps, is a copy. "unmarked": traced as torch 2.11 traces it, with no ``autograd_backward``
    marks (every output of a step would then be copied, per step)."""
    if not marked:
        monkeypatch.setattr(torch.fx.traceback, "_mark_autograd_backward", lambda: None, raising=False)  # none on 2.11
    torch.manual_seed(0)
    model = TwoTower(layers=LAYERS)
    ref = copy.deepcopy(model)

    def step(images, tokens):
        loss = model(images, tokens)
        loss.backward()
        return loss.detach()

    compiled = apollo_compile.compile_step(step, options={"subgraph_compiler": "eager"})
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    held = []
    for i in range(6):
        inputs = two_tower_inputs(seed=i)
        loss, ref_loss = compiled(*inputs), ref(*inputs)
        ref_loss.backward()
        assert_same_loss_and_grads(loss, ref_loss.detach(), model, ref, TOLERANCE["eager"], i)
        held.append((loss, float(loss)))
        if (i + 1) % accumulate == 0:
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad(set_to_none=True)
    assert all(float(loss) == value for loss, value in held)
    assert len(runners) == accumulate  # .grad None, and (accumulating) .grad present: a graph each
    params = sum(1 for _ in model.parameters())
    for runner in runners:
        assert runner.kind == "inference" and runner.replays > 0 and runner.ungraphed_calls == 0
        # every gradient (new, or the sum written back into .grad) is lent; the loss alone is copied
        assert len(runner.captured.lent_idxs) >= params and len(runner.captured.copied_out_idxs) == 1


def adamw_inside_the_step():
    """(model, its eager twin, an AdamW for each, compile_step(step, optimizer=the model's AdamW))."""
    from helpers import backward_step

    torch.manual_seed(0)
    model = TwoTower(layers=LAYERS)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4) for m in (model, ref))
    compiled = apollo_compile.compile_step(backward_step(model), optimizer=opt, options={"subgraph_compiler": "eager"})
    return model, ref, opt, ref_opt, compiled


def trained_with_adamw_inside(steps: int):
    """`adamw_inside_the_step()` trained `steps` steps beside its eager twin: after each, the
    parameters and every step counter as eager's and no .grad left (the step consumes them).
    Returns the model. Tolerances: tests/test_optimizer_step.py's module docstring."""
    model, ref, opt, ref_opt, compiled = adamw_inside_the_step()
    for i in range(steps):
        inputs = two_tower_inputs(seed=i)
        compiled(*inputs)
        ref(*inputs).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=5e-5, msg=lambda m: f"step {i}: {m}")
            assert float(opt.state[p]["step"]) == i + 1 and p.grad is None
    return model


def test_a_whole_step_with_its_optimizer_inside_replays_the_update_once_per_call(runners):
    """compile_step(..., optimizer=): the replay writes the parameters, step counters (static inputs)
    and AdamW's moments in place, once per call; nothing is copied back, no gradient is handed out (the step
    consumes them), and the loss is the one output, copied. Tolerances: tests/test_optimizer_step.py's
    module docstring."""
    model = trained_with_adamw_inside(5)
    (runner,) = runners
    assert runner.kind == "inference" and runner.replays == 4 and runner.ungraphed_calls == 0
    params = sum(1 for _ in model.parameters())
    assert len(runner.config.written_idxs) == params + 1  # each parameter; the group's counters
    # and, not inputs, the two moments of each (fused_update.py, NOTE: The moments are not graph inputs)
    assert len({id(t) for t in runner.config.written_state()}) == 2 * params
    assert runner.config.written_idxs <= set(runner.captured.fixed_ptrs) and not runner.captured.written_copied
    assert len(runner.captured.copied_out_idxs) == 1 and not runner.captured.lent_idxs


def test_a_whole_step_with_its_optimizer_inside_is_timed_and_trains_like_eager(runners, monkeypatch):
    """Its candidates are captured and timed like any graph's, though each timing replay applies the
    update once more (the fake graph's replays do write the parameters and AdamW's state): what
    they wrote is put back from the host (graph_io.WrittenInputs), so training stays eager's."""

    # each candidate captured, replayed once, then timing_replays times (FakeCapture.time)
    with choice.using(choice.ChooseFastest()), capture.using(FakeCapture(ms={"one_lane": 1.0, "lanes": 2.0})):
        trained_with_adamw_inside(4)
    (runner,) = runners
    assert set(runner.summary()["measured_ms"]) == {"lanes", "one_lane"} and runner.chosen == "one_lane"
    assert runner.replays == 3 and runner.ungraphed_calls == 0


def test_a_checkpoint_loaded_into_the_optimizer_keeps_its_graph(runners):
    """optimizer.load_state_dict (resuming) swaps in new state tensors; the graph reads AdamW's state
    in place, so the loaded values are copied into the tensors it captured: training goes on as
    eager's does after the same load, and no call runs un-graphed."""
    model, ref, opt, ref_opt, compiled = adamw_inside_the_step()
    saved = None
    for i in range(6):
        if i == 4:  # back to the checkpoint taken after step 1: both optimizers
            opt.load_state_dict(saved)
            ref_opt.load_state_dict(saved_ref)
        inputs = two_tower_inputs(seed=i)
        compiled(*inputs)
        ref(*inputs).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        if i == 1:
            saved, saved_ref = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref_opt.state_dict())
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=5e-5, msg=lambda m: f"step {i}: {m}")
    assert [float(opt.state[p]["step"]) for p in model.parameters()][:1] == [4.0]  # 2 + steps 4 and 5
    (runner,) = runners
    assert runner.replays == 5 and runner.ungraphed_calls == 0


@pytest.mark.parametrize("fails", ["forward", "backward"])
def test_a_capture_that_runs_out_of_memory_loses_no_step(runners, monkeypatch, fails):
    """docs/design/cuda-graphs.md#a-failed-capture: a capture that raises torch.OutOfMemoryError
    midway (after the runtime consumed the list it captures on) leaves that step completed
    un-graphed, on the caller's untouched inputs, once what the capture held is released; one
    warning names it, and training goes on like eager's (loss and every gradient, SGD steps)."""
    from apollo_compile.runtime import cudagraph

    released = []
    monkeypatch.setattr(cudagraph, "release_cached_segments", lambda: released.append([r.graph for r in runners]))
    capturer = FakeCapture(fail=f"_{fails} (")  # the graph's name, then its candidate's
    model, ref, compiled = twins("eager", LAYERS)
    with capture.using(capturer), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sgd_like_eager(compiled, model, ref, 4)
    forward, backward = runners
    failed = forward if fails == "forward" else backward
    assert [name for name in capturer.captured if f"_{fails} (" in name] == [f"{failed.name} (lanes)"]  # once
    assert failed.disabled.startswith("OutOfMemoryError") and failed.replays == 0
    messages = [str(w.message) for w in caught if issubclass(w.category, ApolloFallbackWarning)]
    assert len([m for m in messages if m.startswith(f"apollo: {failed.name}")]) == 1, messages
    assert "CUDA-graph capture failed (OutOfMemoryError" in next(m for m in messages if failed.name in m)
    assert released[-1] == [None, None] or fails == "backward"  # released before the retry, no graph alive
    if fails == "forward":  # no graph uses the pool the failed capture opened; the backward follows
        assert forward.family.pool is None and backward.replays == 0
        assert "its forward's CUDA-graph capture failed" in backward.disabled
    else:  # the forward replayed until its backward failed, then let its graph go
        assert forward.replays == 1 and forward.graph is None and "backward's CUDA-graph capture failed" in \
            forward.disabled
    assert forward.ungraphed_calls + backward.ungraphed_calls > 0


def test_a_family_declined_for_headroom_counts_and_warns_for_both_graphs_with_one_batch_reused(runners, monkeypatch):
    """A forward saves an input it was given as-is (the token ids an embedding's backward reads);
    a batch reused every step keeps that address alive. It is not an activation the forward wrote,
    so it must not route later backwards as the first step's warm-up: declined for headroom, the
    backward counts its un-graphed calls and warns, as the forward does."""
    from apollo_compile.runtime import cudagraph

    monkeypatch.setattr(cudagraph, "memory_pressure", lambda: (int(17.6 * 2**30), 20 * 2**30))
    model, ref, compiled = twins("eager", LAYERS)
    inputs = two_tower_inputs(seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backward_like_eager(compiled, model, ref, [inputs] * 4)
    forward, backward = runners
    assert forward.capture_refused and backward.capture_refused == forward.capture_refused
    assert forward.ungraphed_calls == backward.ungraphed_calls == 3
    declined = [str(w.message) for w in caught if issubclass(w.category, ApolloFallbackWarning)]
    assert len(declined) == 2 and all("88% of the 20.00 GiB" in m for m in declined), declined
