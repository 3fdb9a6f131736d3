"""The pieces of the CUDA-graph runner that need no GPU: layout checks, output copies, and capture/replay
logic against a fake graph that rewrites its outputs in place as a real replay does."""

import dataclasses
import warnings

import pytest
import torch

from apollo_compile import ApolloFallbackWarning
from apollo_compile.runtime.candidates import CandidateChoice
from apollo_compile.runtime.capture import StaticInputs, donatable, donating_inputs
from apollo_compile.runtime.config import MemoryPolicy, RunnerConfig
from apollo_compile.runtime.graph_io import OutputCopier
from apollo_compile.runtime.instances import GraphFamily
from helpers import FakeCapture, fake_cuda, fake_cuda_graphs, runner_for


def test_fresh_copies_keep_values_and_strides_in_new_memory():
    tensors = [torch.randn(3, 4).t(), torch.randn(5), torch.randn(2, dtype=torch.bfloat16), torch.randn(4, 6)[:, :3]]
    copies = OutputCopier(tensors)(tensors)
    for src, dst in zip(tensors, copies):
        assert torch.equal(src, dst) and dst.dtype == src.dtype
        assert dst.data_ptr() != src.data_ptr()
    for src, dst in zip(tensors[:3], copies):  # dense layouts keep their strides (a transpose included)
        assert dst.stride() == src.stride()
    # the copies live in new memory: a later write to a source changes no copy
    for src in tensors:
        src.add_(1)
    assert not any(torch.equal(src, dst) for src, dst in zip(tensors, copies))
    # contiguous float32 copies share one allocation (one copy kernel for all of them)
    many = [torch.randn(3), torch.randn(2, 2), torch.randn(1)]
    copies = OutputCopier(many)(many)
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1
    assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(many, copies))


def test_is_non_overlapping():
    from apollo_compile.runtime.graph_io import is_non_overlapping

    assert is_non_overlapping(torch.randn(4, 6)[:, :3])  # gaps are fine
    assert is_non_overlapping(torch.empty_strided((4, 4, 4, 8), (384, 8, 96, 1)))  # a slice of a qkv projection
    assert not is_non_overlapping(torch.randn(3, 1).expand(3, 4))
    assert not is_non_overlapping(torch.randn(10).as_strided((3, 3), (2, 1)))  # rows overlap
    buf = torch.empty_strided((4, 4, 4, 8), (384, 8, 96, 1))
    buf.copy_(torch.randn(4, 4, 4, 8))  # what the runner does with such an input


def test_plans_hold_the_cuda_graph_runner_weakly():
    """A plan outlives dynamo.reset() and recompiles; it must not keep a replaced graph's CUDA graph,
    pool and static outputs allocated (that would inflate every later peak)."""
    import gc
    import weakref

    from apollo_compile.plan import GraphPlan

    runner = runner_for({"lanes": lambda args: args}, "g_forward", "forward")
    plan = GraphPlan("g_forward", "forward", "cuda", gm=None, decisions={}, runner_ref=weakref.ref(runner))
    assert plan.runner is runner and plan.summary()["cuda_graph"]["replays"] == 0
    del runner
    gc.collect()
    assert plan.runner is None and "cuda_graph" not in plan.summary()


def test_replays_hand_out_copies_the_next_replay_does_not_overwrite(monkeypatch):
    """The forward of `loss = (w * x).sum(); saved = w * x`: the parameter w is used in place and
    returned as the caller's tensor, the batch x is copied into a static buffer, the loss (user
    visible) is a fresh copy each replay, the saved activation is the graph's own buffer."""

    def forward(args):
        w, x = args
        args.clear()
        saved = w * x
        return [saved.sum(), w, saved]

    forward._boxed_call = True
    family = GraphFamily()
    runner = runner_for({"lanes": forward}, "f_forward", "forward", family, static_input_idxs={0},
                        user_visible_outputs={0})
    fake_cuda_graphs(monkeypatch)
    w = torch.tensor([1.0, 2.0])
    losses, saved_ptrs = [], []
    for step in range(4):
        x = torch.full((2,), float(step))
        out = runner([w, x])
        assert out[1] is w  # a parameter saved for backward comes back as the caller's own tensor
        torch.testing.assert_close(out[0], (w * x).sum())
        torch.testing.assert_close(out[2], w * x)
        losses.append(out[0])
        saved_ptrs.append(out[2].data_ptr())
        del out  # the backward ran: the saved activations are released
    assert runner.replays == 3 and runner.ungraphed_calls == 0 and runner.captured.copy_idxs == [1]
    # every loss the user kept still holds its own step's value; replays rewrote only the graph's buffers
    assert [float(l) for l in losses] == [0.0, 3.0, 6.0, 9.0]
    assert len(set(saved_ptrs[1:])) == 1  # saved activations: the graph's own static buffer
    assert len({l.data_ptr() for l in losses}) == 4
    # saved activations still held when the forward runs again (a pending backward): that call
    # replays a second family's graph, in memory of its own (runtime/instances.py)
    held = runner([w, torch.ones(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        out = runner([w, torch.full((2,), 5.0)])
    torch.testing.assert_close(held[2], w * 1)  # not overwritten
    torch.testing.assert_close(out[2], w * 5)
    assert out[2].data_ptr() != held[2].data_ptr() and out[1] is w
    summary = runner.summary()
    assert runner.replays == 4 and (summary["instances"], summary["replays"], summary["ungraphed_calls"]) == (2, 5, 0)


def _backward_runner(monkeypatch):
    """A backward runner (saved activation read in place, a grad_output copied in) and its family."""

    def backward(args):
        saved, grad_out = args
        args.clear()
        return [saved * grad_out, grad_out.expand(2).contiguous()]

    backward._boxed_call = True
    family = GraphFamily()
    saved = torch.tensor([1.0, 2.0])
    family.saved_ptrs = {saved.data_ptr()}  # as the forward's capture records it
    runner = runner_for({"lanes": backward}, "f_backward", "backward", family)
    fake_cuda_graphs(monkeypatch)
    return runner, family, saved


def test_backward_lends_its_gradients_in_place_when_nothing_holds_the_last_ones(monkeypatch):
    """zero_grad(set_to_none=True) between steps: every replay hands out the graph's own buffers
    (no copy), as fresh aliases AccumulateGrad can steal."""
    runner, _, saved = _backward_runner(monkeypatch)
    ptrs = []
    for step in range(1, 5):
        grads = runner([saved, torch.tensor(float(step))])
        torch.testing.assert_close(grads[0], saved * step)
        torch.testing.assert_close(grads[1], torch.full((2,), float(step)))
        if step > 1:
            assert all(g is not s for g, s in zip(grads, runner.captured.static_outputs))  # fresh aliases
            ptrs.append([g.data_ptr() for g in grads])
        del grads  # the user dropped them (set_to_none)
    assert ptrs[0] == [s.data_ptr() for s in runner.captured.static_outputs] and ptrs.count(ptrs[0]) == 3
    assert runner.captured.fixed_ptrs == {0: saved.data_ptr()} and runner.captured.copy_idxs == [1]
    assert runner.replays == 3
    assert runner.summary()["lent_moved"] == 0 and runner.ungraphed_calls == 0


def test_gradients_still_held_at_the_next_replay_move_to_a_copy_first(monkeypatch):
    """Accumulation: a parameter's .grad kept from the last backward (AccumulateGrad stores a
    detached alias of what we lent) is moved out of the graph's memory before a replay would
    overwrite it, by the backward or by the forward that shares the pool."""
    import weakref

    runner, family, saved = _backward_runner(monkeypatch)
    param = torch.nn.Parameter(torch.zeros(2))
    family.grad_owners = [weakref.ref(param)]  # as the forward's capture records them
    runner([saved, torch.tensor(1.0)])  # the eager warm-up call
    param.grad = runner([saved, torch.tensor(2.0)])[0].detach()  # what AccumulateGrad does
    user_ref = param.grad  # a reference to the same .grad follows it to the copy
    assert param.grad.data_ptr() == runner.captured.static_outputs[0].data_ptr()
    for step in (3, 4):
        new = runner([saved, torch.tensor(float(step))])[0]
        assert param.grad.data_ptr() != runner.captured.static_outputs[0].data_ptr()  # moved before the replay
        param.grad.add_(new)
        del new
    torch.testing.assert_close(param.grad, saved * (2 + 3 + 4))
    assert user_ref is param.grad
    assert runner.summary()["lent_moved"] == 1 and runner.ungraphed_calls == 0

    # the forward of the same family replays into the same pool: it moves a held gradient too
    def forward(args):
        p, x = args
        args.clear()
        return [(p.detach() + x).sum()]

    forward._boxed_call = True
    fw = runner_for({"lanes": forward}, "f_forward", "forward", family, static_input_idxs={0},
                    user_visible_outputs={0})
    param.grad = runner([saved, torch.tensor(5.0)])[0].detach()
    for _ in range(3):
        fw([param, torch.ones(2)])  # the capture (call 2) records param as a gradient owner
    assert [ref() for ref in family.grad_owners] == [param]
    assert param.grad.data_ptr() != runner.captured.static_outputs[0].data_ptr()
    torch.testing.assert_close(param.grad, saved * 5)


def test_a_view_of_a_lent_gradient_keeps_the_graph_from_overwriting_it(monkeypatch):
    """Something other than our alias holds the memory (a view of .grad): the replay would overwrite
    it and the holder cannot be moved, so that call runs without the CUDA graph, with one warning."""
    runner, _, saved = _backward_runner(monkeypatch)
    runner([saved, torch.tensor(1.0)])
    view = runner([saved, torch.tensor(2.0)])[0].view(2)
    with pytest.warns(ApolloFallbackWarning, match="still referenced"):
        grads = runner([saved, torch.tensor(3.0)])
    torch.testing.assert_close(view, saved * 2)  # not overwritten
    torch.testing.assert_close(grads[0], saved * 3)
    assert runner.ungraphed_calls == 1
    del view, grads
    runner([saved, torch.tensor(4.0)])  # released: replays again
    assert runner.replays == 2


def test_concurrency_is_replayed_only_where_it_pays():
    """A candidate with lanes (or SM quotas) must beat one stream by min_gain: within noise, one
    stream wins, since two lanes hold both towers' temporaries at once."""
    from apollo_compile.runtime.choice import fastest

    # a budget-0.2 backward (ms per replay) and its forward, as measured
    assert fastest({"lanes": 21.633, "one_lane": 21.636}, 0.01) == "one_lane"
    assert fastest({"lanes": 7.10, "one_lane": 7.73}, 0.01) == "lanes"
    assert fastest({"lanes": 15.45, "one_lane": 16.42, "quota:1=24,2=96": 21.24}, 0.01) == "lanes"
    assert fastest({"lanes": 10.0, "one_lane": 11.0, "quota:1=96,2=32": 9.5}, 0.01) == "quota:1=96,2=32"
    assert fastest({"lanes": 12.0, "one_lane": 11.0}, 0.01) == "one_lane"
    assert fastest({"lanes": 3.0}, 0.01) == "lanes"  # no one-stream candidate: the fastest


def test_with_memory_first_concurrency_must_stay_within_the_pool_ratio():
    """Given each candidate's capture pool and a ratio (set when the user gave a memory_budget),
    a concurrent candidate whose pool exceeds one stream's by more than the ratio is not
    replayed, however fast; one whose pool is unknown is judged on time alone."""
    from apollo_compile.runtime.choice import fastest

    ms = {"lanes": 7.0, "one_lane": 8.0, "quota:1=96,2=32": 6.5}
    assert fastest(ms, 0.01) == "quota:1=96,2=32"  # no ratio: time alone
    pools = {"lanes": 105, "one_lane": 100, "quota:1=96,2=32": 130}
    assert fastest(ms, 0.01, pools, 1.1) == "lanes"  # the quota candidate holds 1.3x
    assert fastest(ms, 0.01, {**pools, "lanes": 120}, 1.1) == "one_lane"
    assert fastest(ms, 0.01, {**pools, "lanes": None}, 1.1) == "lanes"
    assert fastest(ms, 0.01, {"lanes": 120, "one_lane": None}, 1.1) == "quota:1=96,2=32"  # no baseline to judge by


def test_memory_first_judges_concurrency_by_the_step_peak_not_the_pool_alone():
    """The 1.1x bound is on the step's peak: what was allocated beside the graph (parameters, the
    forward's saved activations) counts on both sides. Measured: a lanes backward pool
    1.21x one lane's was 1.07x of its step peak."""
    from apollo_compile.runtime.choice import fastest

    ms, pools = {"lanes": 7.0, "one_lane": 8.0}, {"lanes": 121, "one_lane": 100}
    assert fastest(ms, 0.01, pools, 1.1) == "one_lane"  # nothing beside: 1.21x
    assert fastest(ms, 0.01, pools, 1.1, base_bytes=300) == "lanes"  # 421 / 400 = 1.05x
    assert fastest(ms, 0.01, {**pools, "lanes": 150}, 1.1, base_bytes=300) == "one_lane"  # 1.125x


def _borrowing_backward(owners: dict, static_inputs: list, donated_idxs: set, budget: bool = True):
    """A backward as its capture sees it: the family owns the forward's outputs, the static inputs
    borrow them (docs/design/cuda-graphs.md#donation). Returns (static inputs, config, family)."""
    family = GraphFamily()
    family.owners = owners
    fixed = {i: x.data_ptr() for i, x in enumerate(static_inputs) if x.untyped_storage().data_ptr() in owners}
    config = RunnerConfig("g_backward", "backward", donated_idxs=donated_idxs,
                          memory=MemoryPolicy(lane_memory_ratio=1.1 if budget else None))
    return StaticInputs(static_inputs, [], fixed), config, family


def test_a_backward_capture_takes_over_the_memory_of_donated_saved_activations():
    """The final capture runs on a list holding the owners of the saved activations AOTAutograd
    donated, so the runtime frees each at its last reader; the family lets go of them. A storage
    another, undonated, input also reads stays the family's; so does an undonated one."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from apollo_compile.runtime.graph_pool import borrowed, unowned

    owners = {}
    views = []
    for n in (8, 4, 6):  # saved activation (donated), one not donated, one read twice
        storage = torch.arange(float(n)).untyped_storage()
        owners[storage.data_ptr()] = storage
        views.append(unowned(storage))
    full = [borrowed(torch.empty(n), s) for n, s in zip((8, 4, 6), views)]
    static_inputs = [full[0], full[1], full[2][:3], full[2][3:], torch.ones(2)]  # the last: a tangent, copied
    donated_ptr, kept = full[0].untyped_storage().data_ptr(), set(owners) - {full[0].untyped_storage().data_ptr()}
    weak = StorageWeakRef(owners[donated_ptr])
    static, config, family = _borrowing_backward(owners, static_inputs, donated_idxs={0, 2})
    assert donatable(static, config, family)
    donation = donating_inputs(static, config, family, fn=None)
    inputs, donated, freed_on_side_lanes = donation.inputs, donation.donated, donation.local
    assert donated == {donated_ptr} and set(family.owners) == kept and donation.donated_bytes == 8 * 4
    assert freed_on_side_lanes == {}  # no side lanes on the CPU
    assert inputs[0].data_ptr() == static_inputs[0].data_ptr() and inputs[0] is not static_inputs[0]
    assert all(inputs[i] is static_inputs[i] for i in (1, 2, 3, 4))
    assert not weak.expired()
    inputs.clear()  # what the boxed runtime does with what it read last
    assert weak.expired()  # the list held the only owner: freed during the capture
    assert not donatable(static, config, family)  # nothing left to take over


def test_side_lanes_take_over_only_what_their_own_stream_made_and_alone_read():
    """The allocator reuses a freed block only on the stream that made it, so a saved activation
    freed under side lanes is safe only if no other lane could still read it when that stream
    allocates again (cudagraph.py, NOTE: Donation on side lanes). Streams 10 (capture), 11 (side
    lane 1, shared with the forward), 12 (a stream this backward never allocates on)."""
    from apollo_compile.runtime.graph_pool import donations_safe_on_lanes

    donatable = {100: [0], 200: [1], 300: [2, 3], 400: [4], 500: [5], 600: [6]}
    made_on = {100: 10, 200: 11, 300: 11, 400: 11, 500: 12}  # 600: the allocator could not place it
    input_lanes = [frozenset({0, 1}), frozenset({1}), frozenset({1}), frozenset({1}), frozenset({0}),
                   frozenset({1}), frozenset({1})]
    safe, local = donations_safe_on_lanes(donatable, made_on, {1: 11}, input_lanes)
    # 100: made on the capture stream (held by lane 1 to the join, as before); 200 and 300: lane 1's
    # own, read by it alone, freed at their last reader; 400: lane 1's, read on lane 0: withheld;
    # 500: no lane of this backward allocates on stream 12; 600: unknown stream, withheld
    assert safe == {100: [0], 200: [1], 300: [2, 3], 500: [5]}
    assert local == {1: [1, 2, 3]}
    # one lane, or a runtime that cannot say who reads what: nothing changes, nothing is freed early
    assert donations_safe_on_lanes(donatable, made_on, {}, input_lanes) == (donatable, {})
    assert donations_safe_on_lanes(donatable, made_on, {1: 11}, ())[1] == {}


def test_allocation_streams_reads_the_allocator_segments(monkeypatch):
    from apollo_compile.runtime import graph_pool

    segments = [{"address": 1000, "total_size": 100, "stream": 7}, {"address": 500, "total_size": 50, "stream": 8}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert graph_pool.allocation_streams([1000, 1099, 1100, 520, 499, 10]) == {1000: 7, 1099: 7, 520: 8}

    def no_cuda():
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(torch.cuda, "memory_snapshot", no_cuda)
    assert graph_pool.allocation_streams([1000]) == {}


def test_a_side_lane_frees_the_inputs_its_stream_made_at_their_last_reader():
    """keep_alive holds what a side lane reads from another lane until the join; inputs the
    capture says that lane's own stream made are not held (the lane frees them at their last
    reader). Matched by identity, held weakly: a dead one never excuses another tensor."""
    import gc
    import weakref

    from apollo_compile.runtime.streams import LaneRuntime

    rt = LaneRuntime([], [], torch.device("cpu"))
    rt.cuda = True  # keep_alive's bookkeeping only: no stream is touched
    mine, other = torch.ones(2), torch.ones(2)
    rt.free_at_last_reader({1: [mine]})
    ref = weakref.ref(mine)
    rt.keep_alive(1, mine, other)
    rt.keep_alive(0, mine)  # another lane reading it still holds it
    assert [tuple(map(id, vs)) for vs in rt.held] == [(id(other),), (id(mine),)]
    rt.release()
    del mine
    gc.collect()
    assert ref() is None  # the registration did not keep it alive
    rt.free_at_last_reader({})
    rt.keep_alive(1, other)
    assert rt.held == [(other,)]


def test_the_chosen_runtimes_side_lanes_decide_what_the_backward_takes_over():
    """With side lanes, the final capture donates by the stream that made each saved activation;
    withheld memory stays the family's and is reported."""
    from types import SimpleNamespace

    from apollo_compile.runtime.graph_pool import borrowed, unowned

    owners, full = {}, []
    for n in (8, 4):
        storage = torch.arange(float(n)).untyped_storage()
        owners[storage.data_ptr()] = storage
        full.append(borrowed(torch.empty(n), unowned(storage)))
    mine, theirs = (t.untyped_storage().data_ptr() for t in full)
    static, config, family = _borrowing_backward(owners, list(full), donated_idxs={0, 1})

    def lanes(args):
        return args

    lanes.lane_runtime = SimpleNamespace(streams={1: SimpleNamespace(cuda_stream=11)})
    lanes.input_lanes = (frozenset({1}), frozenset({0, 1}))
    donation = donating_inputs(static, config, family, lanes, made_on=lambda ptrs: {mine: 11, theirs: 11})
    assert donation.donated == {mine} and donation.local == {1: [0]} and set(family.owners) == {theirs}
    assert donation.donated_bytes == donation.side_lane_donated_bytes == 8 * 4 and donation.withheld_bytes == 4 * 4
    assert donation.inputs[1] is full[1]


CANDIDATES = {"lanes": lambda args: args, "one_lane": lambda args: args}


def choose(config: RunnerConfig, family: GraphFamily, will_donate: bool, **changes) -> tuple[str, CandidateChoice]:
    """The candidate a graph of `config` (with `changes`) chooses at its capture, and the choice."""
    import dataclasses

    chooser = CandidateChoice(CANDIDATES, dataclasses.replace(config, **changes), family)
    return chooser.choose(StaticInputs([], [], {}), will_donate, FakeCapture()), chooser


def test_under_a_budget_a_donating_backward_replays_one_lane_unmeasured(monkeypatch):
    """Measuring would hold each candidate's pool beside every saved activation, and only one
    stream reuses the donated memory: no capture, no timing, one lane."""
    _, config, family = _borrowing_backward({}, [], donated_idxs={0})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("measured"))
    chosen, chooser = choose(config, family, will_donate=True)
    assert chosen == "one_lane" and chooser.measured_ms == {}
    with pytest.raises(BaseException, match="measured"):  # no budget: time decides (measured on CUDA)
        choose(config, family, will_donate=True, memory=MemoryPolicy())


def test_under_a_budget_the_forward_of_a_donating_backward_replays_one_lane_unmeasured(monkeypatch):
    """The caching allocator reuses a freed block only for the stream that allocated it: the
    backward's capture can reuse the saved activations' memory only if the forward made them on the
    capture stream. Compiling a donating backward tells the family; the forward then replays one
    lane under a budget. Without a budget, or without donation, time decides."""
    family = GraphFamily()
    budget = MemoryPolicy(lane_memory_ratio=1.1)
    forward = runner_for(CANDIDATES, "frame0_0_forward", "forward", family, memory=budget)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("measured"))
    assert forward.chooser.memory_first_reason(will_donate=False) is None  # no backward compiled yet: measure
    runner_for(CANDIDATES, "frame0_0_backward", "backward", family, memory=budget, donated_idxs=set())
    assert not family.backward_donates  # a backward with nothing donated (retain_graph at the first backward)
    runner_for(CANDIDATES, "frame0_0_backward", "backward", family, memory=budget, donated_idxs={3})
    assert family.backward_donates
    chosen, chooser = choose(forward.config, family, will_donate=False)
    assert chosen == "one_lane" and chooser.measured_ms == {}
    with pytest.raises(BaseException, match="measured"):  # no budget: time decides (measured on CUDA)
        choose(forward.config, family, will_donate=False, memory=MemoryPolicy())


def test_captured_near_the_limit_both_graphs_replay_one_lane_unmeasured_with_one_warning(monkeypatch):
    """cudagraphs=True captures past the headroom share (docs/design/cuda-graphs.md#capture-headroom),
    where HF CLIP's forward captured on lanes and its backward's capture then ran out: near the
    limit the memory-first rule applies as under a budget, and says so once. Below the share, or
    under the headroom rule, time decides."""
    from apollo_compile.runtime import cudagraph

    family = GraphFamily()
    regardless = MemoryPolicy(capture_headroom=None)
    forward = runner_for(CANDIDATES, "frame0_0_forward", "forward", family, memory=regardless)
    runner_for(CANDIDATES, "frame0_0_backward", "backward", family, memory=regardless, donated_idxs={3})
    monkeypatch.setattr(cudagraph, "memory_pressure", lambda: (int(14.8 * 2**30), 20 * 2**30))
    assert forward.capture_refusal() is None and family.near_limit is None  # 74%: time decides
    monkeypatch.setattr(cudagraph, "memory_pressure", lambda: (int(19.65 * 2**30), 20 * 2**30))
    assert forward.capture_refusal() is None and "98% of the 20.00 GiB" in family.near_limit
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("measured"))
    for config, will_donate in ((forward.config, False), (dataclasses.replace(forward.config, kind="backward"), True)):
        chosen, chooser = choose(config, family, will_donate=will_donate)
        assert chosen == "one_lane" and chooser.measured_ms == {}
        assert chooser.memory_first_reason(will_donate).startswith("near the memory limit")
    headroom = MemoryPolicy()  # cudagraphs="auto": the family is not captured at all, nothing put first
    auto = GraphFamily()
    refused = runner_for(CANDIDATES, "frame1_0_forward", "forward", auto, memory=headroom)
    assert refused.capture_refusal() is not None and auto.near_limit is None
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    fake_cuda(monkeypatch)
    capturer = FakeCapture()
    warned = GraphFamily()
    fw = runner_for(CANDIDATES, "frame2_0_forward", "forward", warned, memory=regardless, capturer=capturer)
    runner_for(CANDIDATES, "frame2_0_backward", "backward", warned, memory=regardless, donated_idxs={3})
    x = torch.arange(3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            fw([x])
    messages = [str(w.message) for w in caught if issubclass(w.category, ApolloFallbackWarning)]
    assert len(messages) == 1 and "frame2_0_forward replays one lane, unmeasured" in messages[0], messages
    assert fw.chosen == "one_lane"


def test_a_donating_backward_replays_its_forwards_measured_choice_unmeasured(monkeypatch):
    """choice.py, NOTE: A donating backward follows its forward: without a budget too. Measuring
    would hold each candidate beside every saved activation; the forward's timing decides. A
    forward that chose unmeasured (or had one candidate), a backward that does not donate, or a
    choice the backward lacks: the backward measures."""
    from apollo_compile.runtime import choice

    _, config, family = _borrowing_backward({}, [], donated_idxs={0}, budget=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("measured"))
    assert choice.in_effect() is choice.DEFAULT
    for chosen in ("lanes", "one_lane"):
        family.forward_chosen, family.forward_measured = chosen, True
        got, chooser = choose(config, family, will_donate=True)
        assert got == chosen and chooser.measured_ms == {}
    for chosen, measured, donating in (("lanes", False, True), ("lanes", True, False), ("quota:1=8", True, True)):
        family.forward_chosen, family.forward_measured = chosen, measured
        with pytest.raises(BaseException, match="measured"):
            choose(config, family, will_donate=donating)
    family.forward_chosen, family.forward_measured = "lanes", True
    with pytest.raises(BaseException, match="measured"):  # the rule before: measure
        choose(config, family, will_donate=True, strategy=choice.ChooseFastest(follow_forward=False))


def test_the_strategy_in_effect_reaches_the_backwards_thread():
    """The autograd engine runs a CUDA backward on a thread of its own: `using` must reach it (a
    contextvar does not: a backward chooses by the default rule inside `using` with one)."""
    import threading

    from apollo_compile.runtime import choice

    outer, inner = choice.Fixed("one_lane"), choice.Fixed("lanes")
    seen = []

    def look():
        seen.append(choice.in_effect())

    with choice.using(outer):
        with choice.using(inner):
            thread = threading.Thread(target=look)
            thread.start()
            thread.join()
        assert choice.in_effect() is outer
    assert seen == [inner] and choice.in_effect() is choice.DEFAULT


def test_a_strategy_decides_which_candidate_replays(monkeypatch):
    """choice.py: a strategy given to the runner, else the one `using` puts in effect, else apollo's
    rule. Fixed replays its candidate unmeasured; ChooseFastest without the memory-first rule
    measures under a budget; following the forward replays the forward's choice in a donating
    backward; a choice the graph lacks is refused."""
    from apollo_compile.runtime import choice

    _, config, family = _borrowing_backward({}, [], donated_idxs={0})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("measured"))

    def chosen(**changes):
        got, chooser = choose(config, family, will_donate=True, **changes)
        assert chooser.measured_ms == {}
        return got

    with choice.using(choice.Fixed("lanes")):
        assert chosen() == "lanes"
        assert chosen(strategy=choice.ChooseFastest()) == "one_lane"  # the runner's own strategy wins
    assert choice.in_effect() is choice.DEFAULT and chosen() == "one_lane"
    for measuring in (choice.ChooseFastest(memory_first=()), choice.ChooseFastest(memory_first=("forward",))):
        with pytest.raises(BaseException, match="measured"):
            chosen(strategy=measuring)
    # no such candidate: chosen as apollo would, or as told
    assert chosen(strategy=choice.Fixed("quota:1=96,2=32")) == "one_lane"
    assert chosen(strategy=choice.Fixed("quota:1=96,2=32", otherwise=choice.Fixed("lanes"))) == "lanes"
    family.forward_measured = True
    for forward_chose in ("lanes", "one_lane"):
        family.forward_chosen = forward_chose
        assert chosen(strategy=choice.ChooseFastest(memory_first=(), follow_forward=True)) == forward_chose
    family.forward_measured = False

    class Wrong(choice.ChooseFastest):
        def unmeasured(self, graph):
            return "quota:1=8", "wrong"

    with pytest.raises(ValueError, match="does not have"):
        chosen(strategy=Wrong())


def test_the_measured_times_go_to_the_strategy():
    """ChooseFastest.choose is `fastest` over what was measured, with the graph's memory bound."""
    from apollo_compile.runtime.choice import ChooseFastest, GraphFacts

    ms, pools = {"lanes": 10.0, "one_lane": 11.0}, {"lanes": 130, "one_lane": 100}
    assert ChooseFastest().choose(GraphFacts("g", "forward", tuple(ms)), ms, pools, 0) == "lanes"
    budget = GraphFacts("g", "forward", tuple(ms), lane_memory_ratio=1.1)
    assert ChooseFastest().choose(budget, ms, pools, 0) == "one_lane"
    assert ChooseFastest(min_gain=0.2).choose(GraphFacts("g", "forward", tuple(ms)), ms, pools, 0) == "one_lane"


def test_each_capture_gets_cublas_workspaces_of_its_own(monkeypatch):
    """cuBLAS's cached workspaces are dropped right before and right after every capture (also one
    that fails), as CUDA-graph trees do: the graph's workspaces are then allocated in its own pool,
    and die with a measured candidate instead of staying allocated."""
    from apollo_compile.runtime.capture import CudaCapture

    events = []

    class FakeCaptureContext:
        def __init__(self, graph, pool=None):
            pass

        def __enter__(self):
            events.append("capture")

        def __exit__(self, *exc):
            events.append("end")

    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: events.append("clear"), raising=False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", FakeCaptureContext)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    _, outputs = CudaCapture().capture(lambda args: [args[0] * 2], [torch.ones(2)], None, "g (lanes)")
    assert events == ["clear", "capture", "end", "clear"] and torch.equal(outputs[0], torch.full((2,), 2.0))

    def fails(args):
        raise RuntimeError("capture failed")

    events.clear()
    with pytest.raises(RuntimeError, match="capture failed"):
        CudaCapture().capture(fails, [torch.ones(2)], None, "g (lanes)")
    assert events == ["clear", "capture", "end", "clear"]


def test_each_candidate_reports_the_memory_its_capture_pool_holds(monkeypatch):
    """Measuring the candidates times their replays and reads each capture's private pool from the
    allocator (temporaries included, which a replay's max_memory_allocated does not show); the
    fastest wins, and the summary carries both."""
    import itertools

    pools = itertools.count(1)
    reserved = {(0, 1): 6 << 20, (0, 2): 4 << 20}  # lanes' pool holds both towers' temporaries
    fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(pools)))
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [
        {"segment_pool_id": pool, "total_size": size} for pool, size in reserved.items()] + [
        {"segment_pool_id": (0, 0), "total_size": 1 << 30}])  # eager memory: not a pool's

    def lanes(args):
        return [args[0] * 2]

    def one_lane(args):
        return [args[0] * 2]

    capturer = FakeCapture(ms={"lanes": 4.0, "one_lane": 5.0})
    static = StaticInputs([torch.ones(2)], [0], {})
    config = RunnerConfig("g_forward", "forward")
    chooser = CandidateChoice({"lanes": lanes, "one_lane": one_lane}, config, GraphFamily())
    assert chooser.choose(static, False, capturer) == "lanes"
    assert chooser.measured_ms == {"lanes": 4.0, "one_lane": 5.0}
    assert chooser.candidate_pool_bytes == {"lanes": 6 << 20, "one_lane": 4 << 20}
    pools = itertools.count(1)  # the same two pools again  # noqa: F841 (read by the graph_pool_handle stub)
    # a memory_budget puts memory first: lanes hold 1.5x one lane's pool
    budget = RunnerConfig("g_forward", "forward", memory=MemoryPolicy(lane_memory_ratio=1.1))
    chooser = CandidateChoice({"lanes": lanes, "one_lane": one_lane}, budget, GraphFamily())
    assert chooser.choose(static, False, capturer) == "one_lane"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the allocator answers on CUDA")
def test_pool_bytes_without_cuda_is_none(monkeypatch):
    """As a CPU build's allocator answers (a CUDA build without a GPU answers no segments: 0)."""
    from apollo_compile.runtime.graph_pool import pool_bytes

    def no_cuda():
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(torch.cuda, "memory_snapshot", no_cuda)
    assert pool_bytes((0, 1)) is None


def _reference_ptrs_equal(tensors, ptrs, indices):
    """torch._C._tensors_data_ptrs_at_indices_equal as documented (CUDA builds have it in C++)."""
    for i in indices:
        if not isinstance(tensors[i], torch.Tensor):
            raise TypeError("not a tensor")
        if tensors[i].data_ptr() != ptrs[i]:
            return False
    return True


@pytest.mark.parametrize("check", ["python", "reference", "torch"])
def test_inputs_in_place_checks_only_the_fixed_positions(monkeypatch, check):
    """The pre-launch check of inputs captured in place (graph_io.Addresses, which a captured
    graph's `inputs_in_place` asks): what moved, what did not, what is no longer a tensor; the
    other inputs (copied in) may live anywhere."""
    from apollo_compile.runtime import graph_io

    if check == "torch" and graph_io.data_ptrs_equal is None:
        pytest.skip("this torch build has no _tensors_data_ptrs_at_indices_equal (CUDA builds do)")
    if check != "torch":
        monkeypatch.setattr(graph_io, "data_ptrs_equal", None if check == "python" else _reference_ptrs_equal)
    a, b, c = torch.zeros(2), torch.ones(3), torch.arange(4.0)
    fixed = graph_io.Addresses({1: a.data_ptr(), 3: b.data_ptr()})
    assert fixed.hold([c.clone(), a, 7, b])
    assert fixed.hold([c, a, c, b, c])  # the copied-in positions may be anything
    assert not fixed.hold([c, a, 7, a.clone()])
    assert not fixed.hold([c, 5, 7, b])
    fixed = graph_io.Addresses({0: c.data_ptr()})  # a new capture lays the check out again
    assert fixed.hold([c]) and not fixed.hold([a])
    assert graph_io.Addresses({}).hold([a, b])


def test_memory_pressure_without_cuda_is_none_and_refuses_nothing():
    """No CUDA to ask (a CPU build): the headroom check refuses no capture (docs/design/cuda-graphs.md
    #capture-headroom); the runner captures only on CUDA anyway."""
    from apollo_compile.runtime import graph_pool

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine has an allocator to ask")
    assert graph_pool.memory_pressure() is None
    runner = runner_for({"lanes": lambda args: args}, "g_forward", "forward")
    assert runner.capture_refusal() is None and runner.family.capture_refused is None


def test_host_values_are_cpu_tensors_with_data_beside_device_ones():
    """Meta tensors stand in for CUDA ones: a CPU scalar among them is a value a replay would not
    read again; an empty CPU tensor (compiled autograd's size carriers) holds none; with every
    input on the CPU (the tests' fake graphs) nothing is a host value."""
    from apollo_compile.runtime.graph_io import host_values

    device, scalar, sizes = torch.empty(3, device="meta"), torch.tensor(2.5, dtype=torch.float64), torch.empty(0, 4)
    assert host_values([device, scalar, 7, sizes]) == [1]
    assert host_values([sizes, device]) == []
    assert host_values([scalar, torch.ones(2)]) == []


def test_a_graph_reading_a_host_value_is_never_captured(monkeypatch):
    """`loss * t` with t a Python float Dynamo has seen change (a 0-dim CPU tensor): on a GPU a
    replay kept the captured t (benchmarks/probes/scalar_input_probe.py). The runner runs such a graph
    without its CUDA graph from the call that would capture it, with one warning."""
    from apollo_compile.runtime import cudagraph

    def forward(args):
        x, t = args
        args.clear()
        return [x * t]

    forward._boxed_call = True
    runner = runner_for({"lanes": forward}, "f_forward", "forward")
    fake_cuda_graphs(monkeypatch)
    # the CPU stands in for the device: input 1 is the host value
    monkeypatch.setattr(cudagraph, "host_values", lambda args: [1])
    x = torch.ones(2)
    with pytest.warns(ApolloFallbackWarning, match="input 1 is a CPU tensor"):
        outs = [runner([x, torch.tensor(t)])[0] for t in (0.5, 1.5, 2.5, 3.5)]
    assert [float(o[0]) for o in outs] == [0.5, 1.5, 2.5, 3.5]
    assert runner.graph is None and runner.replays == 0 and runner.ungraphed_calls == 3
