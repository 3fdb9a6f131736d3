"""The device scripts' command lines, checked on the CPU: a misspelt variant in
benchmarks/h200_session.sh would cost a device call (up to 10 of a session's 30 minutes) before
anyone saw the argparse error."""

import os
import re
import shlex
import sys

import pytest
import torch._functorch.config

# the scripts, which conftest.py puts on the import path with their probes
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

import bench_distributed  # noqa: E402
import bench_large_batch  # noqa: E402
import bench_memory  # noqa: E402
import bench_step  # noqa: E402
import bench_whole_step  # noqa: E402


def phase_commands() -> list[tuple[str, list[str]]]:
    """(script, argv) of every bench_step / bench_memory / bench_distributed / bench_whole_step command in
    h200_session.sh."""
    with open(os.path.join(BENCHMARKS, "h200_session.sh")) as f:
        text = f.read().replace("\\\n", " ")  # continuation lines
    commands = []
    for line in text.splitlines():
        m = re.search(r"(?:python|torchrun [-\w ]*?) benchmarks/(bench_memory|bench_step|bench_distributed|bench_whole_step)\.py"
                      r"(.*?)(;;|>|$)", line)
        if m:
            # a phase's own arguments, as `whole-step hf-clip 8` passes them (the script's usage line)
            args = m.group(2).replace('"$model"', "hf-clip").replace('"${@:-8}"', "8")
            args = re.sub(r"\$\{VARIANTS:-([^}]*)\}", r"\1", args)  # the default a phase's VARIANTS= overrides
            commands.append((m.group(1), shlex.split(args)))
    return commands


COMMANDS = phase_commands()


def test_the_session_script_has_its_phases():
    assert len(COMMANDS) >= 7, COMMANDS


@pytest.mark.parametrize("script,argv", COMMANDS, ids=[" ".join(a[:4]) for _, a in COMMANDS])
def test_every_phase_parses(script, argv):
    module = {"bench_memory": bench_memory, "bench_step": bench_step, "bench_distributed": bench_distributed,
              "bench_whole_step": bench_whole_step}[script]
    args = module.parse_args(argv)
    if script == "bench_memory":
        assert set(args.search_variants) <= set(bench_memory.VARIANTS)
        # apollo is searched last, so that a capture that runs out of memory cannot poison the other
        # variants' probes; memorypeak puts it first on purpose, to check that memory comes back
        others = [v for v in args.search_variants if not v.startswith("apollo")]
        if not args.skip_search and not args.out.endswith("mempeak"):
            assert args.search_variants[:len(others)] == others


def test_budget_variants_by_name():
    assert bench_memory.variant_name("apollo-bf16-budget-0.07") == "apollo-bf16-budget-0.07"
    spec = bench_memory.VARIANTS["apollo-bf16-budget-0.07"]
    assert spec.options == {"precision": "bf16", "memory_budget": 0.07} and spec.memory_bound_first
    assert not bench_memory.VARIANTS[bench_memory.variant_name("apollo-bf16-budget-0.4-bytes-per-us")].memory_bound_first
    measured = bench_memory.VARIANTS[bench_memory.variant_name("apollo-bf16-budget-0.5-fw-measured")]
    assert measured.forward_measured and measured.memory_bound_first and not spec.forward_measured
    from apollo_compile.runtime import choice
    from apollo_compile.runtime import capture
    from apollo_compile.runtime.candidates import CandidateChoice
    from apollo_compile.runtime.capture import StaticInputs
    from apollo_compile.runtime.config import MemoryPolicy, RunnerConfig
    from apollo_compile.runtime.instances import GraphFamily

    def unmeasured(graph, will_donate=False):  # what the strategy in effect replays without measuring, or None
        return choice.in_effect().unmeasured(graph.facts(will_donate))

    family = GraphFamily()
    family.backward_donates = True
    budget = MemoryPolicy(lane_memory_ratio=1.1)
    forward = CandidateChoice({"lanes": None, "one_lane": None}, RunnerConfig("g_forward", "forward", memory=budget),
                              family)
    with measured.context():  # the forward measures its candidates
        assert unmeasured(forward) is None
    assert unmeasured(forward)[0] == "one_lane"
    both = bench_memory.VARIANTS[bench_memory.variant_name("apollo-bf16-budget-0.5-lanes-measured")]
    assert both.lanes_measured and not both.forward_measured and not measured.lanes_measured
    backward = CandidateChoice({"lanes": None, "one_lane": None},
                               RunnerConfig("g_backward", "backward", memory=budget), family)
    assert unmeasured(backward, will_donate=True)[0] == "one_lane"
    with both.context():  # no memory-first rule in either graph
        assert unmeasured(forward) is None and unmeasured(backward, will_donate=True) is None
    offloading = bench_memory.VARIANTS[bench_memory.variant_name("apollo-bf16-budget-0.2-offload")]
    assert offloading.options == {"precision": "bf16", "memory_budget": 0.2, "offload_activations": True}
    assert "offload_activations" not in bench_memory.VARIANTS["apollo-bf16-budget-0.05"].options
    assert bench_memory.VARIANTS["eager-bf16-ckpt-offload"].save_on_cpu
    streamed = bench_memory.VARIANTS[bench_memory.variant_name("apollo-bf16-budget-0.05-offload-stream")]
    assert streamed.options == {"precision": "bf16", "memory_budget": 0.05, "offload_activations": True}
    assert streamed.offload_stream and not offloading.offload_stream
    with streamed.context():  # this torch's separate-stream offloading is on around the variant only
        assert torch._functorch.config.activation_offload_separate_stream
    assert not torch._functorch.config.activation_offload_separate_stream
    follows = bench_memory.VARIANTS[bench_memory.variant_name("apollo-bf16-budget-0.5-bw-follows")]
    assert follows.backward_follows and not follows.lanes_measured and not both.backward_follows
    with follows.context():  # the forward measures; the donating backward replays its choice, unmeasured
        assert unmeasured(forward) is None
        family.forward_measured = True
        for chosen in ("lanes", "one_lane"):
            family.forward_chosen = chosen
            assert unmeasured(backward, will_donate=True)[0] == chosen
            # what the runner replays at its capture
            assert backward.choose(StaticInputs([], [], {}), True, capture.DEFAULT) == chosen
    assert unmeasured(forward)[0] == "one_lane"  # the rule is back after the variant
    for bad in ("apollo-bf16-budget-0", "apollo-bf16-budget-1.5", "eager-fp16"):
        with pytest.raises(Exception, match="unknown variant|must be in"):
            bench_memory.variant_name(bad)


def test_diag_memory_sums_each_pool_and_the_free_bytes_no_large_request_can_use():
    """Inside a capture the allocator cannot release a live pool's segments: free blocks too small
    for the next large request are stranded there. pools() shows them per pool."""
    import diag_memory

    MiB = 1 << 20
    segments = [
        {"segment_pool_id": (0, 3), "total_size": 1024 * MiB, "allocated_size": 600 * MiB, "stream": 7,
         "blocks": [{"size": 600 * MiB, "state": "active_allocated"}, {"size": 424 * MiB, "state": "inactive"}]},
        {"segment_pool_id": (0, 3), "total_size": 2 * MiB, "allocated_size": 0, "stream": 7, "segment_type": "small",
         "blocks": [{"size": 2 * MiB, "state": "inactive"}]},  # freed blocks of 1 MiB and less
        {"segment_pool_id": (0, 3), "total_size": 2048 * MiB, "allocated_size": 1024 * MiB, "stream": 0,
         "blocks": [{"size": 1024 * MiB, "state": "inactive"}, {"size": 1024 * MiB, "state": "active_allocated"}]},
        {"segment_pool_id": (0, 0), "total_size": 20 * MiB, "allocated_size": 20 * MiB,
         "blocks": [{"size": 20 * MiB, "state": "active_allocated"}]},
    ]
    summary = diag_memory.pools(segments)
    graph = summary["(0, 3)"]
    assert graph["segments"] == 3 and graph["reserved"] == 3074 * MiB and graph["allocated"] == 1624 * MiB
    assert graph["free"] == 1450 * MiB and graph["largest_free"] == 1024 * MiB
    assert graph["free_in_blocks_under_512MiB"] == 426 * MiB
    assert summary["(0, 0)"]["free"] == 0
    assert graph["by_stream"] == {0: {"reserved": 2048 * MiB, "allocated": 1024 * MiB, "small": 0},
                                  7: {"reserved": 1026 * MiB, "allocated": 600 * MiB, "small": 2 * MiB}}
    text = diag_memory.pools_text("at the out-of-memory error", summary)
    assert "pool (0, 3): 3 segments, reserved 3.00 GiB" in text and "[2048, 1024, 2]" in text
    assert ("by stream (reserved/allocated GiB, of it in small segments): 0: 2.00/1.00 (0.00), "
            "7: 1.00/0.59 (0.00)") in text  # lanes: a mark each
    assert text.count("by stream") == 1  # the default pool's one stream gets no such line


def test_diag_memory_finds_each_phase_peak_and_what_is_alive_there():
    """diag_memory.py's analysis of an allocator trace: phases bracketed by marker allocations, each
    phase's peak, and what is alive at it grouped by the generated file and line that allocated it."""
    import diag_memory

    def alloc(addr, size, file="/tmp/torchinductor_x/ab/cfw.py", line=10):
        return {"action": "alloc", "addr": addr, "size": size, "frames": [{"filename": file, "line": line, "name": "call"}]}

    def free(addr):
        return {"action": "free_completed", "addr": addr}

    mark = lambda k: {"action": "alloc", "addr": 900 + k, "size": diag_memory.MARK + 512 * k, "frames": []}  # noqa: E731
    trace = [mark(0), alloc(1, 1000), alloc(2, 3000, line=11), free(2), alloc(3, 500), mark(1),
             alloc(4, 4000, file="/tmp/torchinductor_x/cd/cbw.py", line=7), free(1), free(4), mark(2)]
    phases = [{"phase": "forward", "marker": 0, "max_allocated_gib": 0.0, "allocated_after_gib": 0.0},
              {"phase": "backward", "marker": 1, "max_allocated_gib": 0.0, "allocated_after_gib": 0.0}]
    report, text = diag_memory.summarize(trace, phases, 2)
    forward, backward = report
    assert forward["trace_peak_gib"] * 2**30 == 4000  # 1 and 2 alive together
    assert {g.split(" ")[0]: round(b * 2**30) for g, b, _ in forward["top"]} == {"cfw.py:10": 1000, "cfw.py:11": 3000}
    assert backward["trace_peak_gib"] * 2**30 == 5500  # 1, 3 and 4
    assert backward["by_file"] == {"cfw.py": 1500 / 2**30, "cbw.py": 4000 / 2**30}
    assert "== backward" in text


def test_memory_report_says_what_each_apollo_row_planned_and_replayed():
    """Under the table, a line per apollo row: the checkpoint plan and, per graph, each candidate's
    replay time and capture pool, the runtime chosen, what measuring left allocated, and the saved
    activations' memory a backward took over."""
    graph = {"cuda_graph": {"chosen": "lanes", "measured_ms": {"lanes": 7.0, "one_lane": 7.5},
                            "candidate_pool_bytes": {"lanes": 3 << 30, "one_lane": 2 << 30},
                            "measuring_left_bytes": 1 << 29}}
    row = {"variant": "apollo-bf16-budget-0.3", "apollo": [{
        "plan": "frame0_0", "graphs": {"forward": graph, "backward": {"cuda_graph": {
            "chosen": "one_lane", "measured_ms": {}, "measuring_left_bytes": 0, "donated_bytes": 3 << 29}}},
        "checkpoint": {"peak_before": 1000, "peak_after": 296, "per_block": True, "relaxed": 130, "met": True}}]}
    notes = bench_memory.runtime_notes([{"batch": 64, "variants": [{"variant": "eager-fp32"}, row]}])
    assert notes == ("- batch 64, apollo-bf16-budget-0.3: checkpoint: predicted peak 0.296x of the plain "
                     "partition's (per-block, 130 saved back); forward: lanes [lanes 7.00 ms / 3.00 GiB, "
                     "one_lane 7.50 ms / 2.00 GiB], measuring left 0.50 GiB; backward: one_lane [unmeasured], "
                     "measuring left 0.00 GiB, saved activations reused 1.50 GiB")


def test_a_probe_that_ran_without_its_cuda_graphs_is_no_pass(monkeypatch):
    """A capture that runs out of memory falls back to the un-graphed runtime (correct, warned):
    the search must not count that as apollo training at the batch."""
    import apollo_compile

    class Graph:
        def __init__(self, cuda_graph):
            self.cuda_graph = cuda_graph

        def summary(self):
            return {"cuda_graph": self.cuda_graph}

    class Plan:
        name = "frame0_0"
        graphs = {"forward": Graph({"disabled": None, "ungraphed_calls": 0}),
                  "backward": Graph({"disabled": "OutOfMemoryError: CUDA out of memory", "ungraphed_calls": 4})}

    monkeypatch.setattr(apollo_compile, "plans", lambda: [Plan()])
    assert bench_memory.ungraphed_runners() == ["frame0_0 backward: OutOfMemoryError: CUDA out of memory"]
    assert bench_memory.ungraphed_runners(by_design=True) == []
    Plan.graphs = {"forward": Graph(None), "backward": Graph({"disabled": None, "ungraphed_calls": 0})}
    assert bench_memory.ungraphed_runners() == []
    # too close to the limit to capture, on purpose (cudagraph.py, NOTE: A capture needs headroom): trains
    why = "its first step peaked at 17.55 GiB, 88% of the 20.00 GiB this process may hold"
    Plan.graphs = {kind: Graph({"disabled": why, "capture_refused": why, "ungraphed_calls": 4})
                   for kind in ("forward", "backward")}
    assert bench_memory.ungraphed_runners() == []
    assert bench_memory.ungraphed_runners(by_design=True) == [f"frame0_0 forward: {why}", f"frame0_0 backward: {why}"]
    search = {"variant": "apollo-bf16-budget-0.05", "largest_ok": 1152, "smallest_fail": 1280, "stop": "budget",
              "probes_run": 2, "peak_at_largest_gib": 17.6,
              "records": [{"batch": 1152, "source": "probe", "status": "ok", "pass": True,
                           "ungraphed_by_design": [why]},
                          {"batch": 1280, "source": "probe", "status": "OOM", "pass": False}]}
    assert "un-graphed by design at 1152" in bench_memory.search_table([search], 20)


def test_search_at_probes_the_listed_batches_in_order(monkeypatch, capsys):
    """--search-at: exactly the listed batches, in order, none already known (main phase or an earlier
    probe) twice, at most --search-probes of them; the bracket comes from what was measured."""
    import torch

    probed = []

    def fake_probe(spec, base, b, args, device):
        probed.append(b)
        ok = b <= 1200
        return {"batch": b, "source": "probe", "status": "ok" if ok else "OOM", "pass": ok,
                "peak_alloc_gib": b / 64, "wall_s": 0.0}

    monkeypatch.setattr(bench_memory, "probe", fake_probe)
    fits = {"status": "ok", "peak_alloc_all_gib": 15.0, "peak_reserved_all_gib": 16.0}  # decides a pass at 20 GiB

    def search(argv, main_rows=()):
        probed.clear()
        args = bench_memory.parse_args(["--batch", "--variants", "eager-bf16", *argv])
        res = {}
        bench_memory.search_variant(bench_memory.VARIANTS["eager-bf16"], None, args, torch.device("cpu"),
                                    list(main_rows), 1.0, res, on_update=lambda: None)
        return list(probed), (res["largest_ok"], res["smallest_fail"], res["probes_run"], res["stop"])

    assert search(["--search-at", "1152", "1280", "1216", "1280"]) == (
        [1152, 1280, 1216], (1152, 1216, 3, "listed batches probed"))
    assert search(["--search-at", "1152", "1280", "1216", "--search-probes", "2"], [(1152, fits)]) == (
        [1280, 1216], (1152, 1216, 2, "listed batches probed"))
    assert search(["--search-at", "1152", "1280", "1216", "--search-probes", "2"]) == (
        [1152, 1280], (1152, 1280, 2, "probe budget spent"))
    capsys.readouterr()
    bench_memory.announce_plan(bench_memory.parse_args(["--batch", "--variants", "apollo-bf16", "--search-at", "1152",
                                                        "1280", "1216", "--search-probes", "2"]))
    assert "up to 2 in the search (2 probes x 1;" in capsys.readouterr().out
    for argv in (["--skip-search", "--search-at", "1152"], ["--search-at", "1152", "0"]):
        with pytest.raises(SystemExit):
            bench_memory.parse_args(argv)


def test_the_step_table_reports_back_to_back_steps_beside_the_idle_gpu_latency():
    """bench_step's back-to-back column: every queued step runs, and the table's rows (a failed
    one too) keep one cell per header."""
    import torch

    calls = []
    b2b = bench_step.time_back_to_back(lambda: calls.append(1), 4, torch.device("cpu"), rounds=3)
    assert len(calls) == 12 and len(b2b["rounds_ms"]) == 3 and b2b["ms"] >= 0 and b2b["host_ms"] >= 0
    numerics = {"loss_abs_diff": 0.0, "grad_rel_err_max": 0.0, "pass": True, "params_within_bf16_noise": 0}
    ok = {"variant": "inductor-ro", "status": "ok", "median_ms": 8.0, "p10_ms": 7.0, "p90_ms": 9.0,
          "back_to_back_ms": 6.0, "back_to_back_host_ms": 4.0, "compile_s": 1.0, "numerics": numerics}
    fast = dict(ok, variant="apollo", median_ms=6.0, back_to_back_ms=5.0)
    failed = {"variant": "apollo-1lane", "status": "OOM", "error": "CUDA out of memory"}
    table = bench_step.markdown_table([{"batch": 8, "variants": [ok, fast, failed]}]).splitlines()
    width = table[0].count("|")
    assert all(line.count("|") == width for line in table)
    assert "| 8 | apollo | 6.00 | 7.00 | 9.00 | 1.33x | 5.00 | 1.20x | 4.00 |" in table[3]
    # memory as a ratio to the baseline's
    ok.update(peak_alloc_gib=2.0, peak_reserved_gib=4.0)
    fast.update(peak_alloc_gib=2.1, peak_reserved_gib=5.0)
    table = bench_step.markdown_table([{"batch": 8, "variants": [ok, fast]}]).splitlines()
    assert "| 2.10 | 1.05x | 5.00 | 1.25x |" in table[3]


def test_compiled_autograd_variants_hand_the_backward_to_their_compiler():
    """bench_step's -ca variants (the host-time experiment): train_step runs the backward under
    compiled autograd, whose graph apollo compiles (as an inference graph: the gradients are its
    outputs, one lane); gradients stay eager's. The eager subgraph compiler: the hand-off is under
    test, not Inductor."""
    import copy

    import apollo_compile
    import clip

    torch._dynamo.reset()
    apollo_compile.clear_plans()
    torch.manual_seed(0)
    base = clip.build("tiny")
    batch = clip.make_batch(2, torch.device("cpu"), "tiny")
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    step_fn = bench_step.compile_variant("apollo-ca", model, {"subgraph_compiler": "eager"})
    assert isinstance(step_fn, bench_step.CompiledAutogradStep)
    for _ in range(2):
        loss = bench_step.train_step(model, step_fn, batch, torch.device("cpu"), amp=False)
        ref_loss = bench_step.train_step(ref, ref, batch, torch.device("cpu"), amp=False)
        # fp32: apollo's subgraphs differ from eager's arithmetic by the order of their sums alone
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
    kinds = [(plan.forward is not None, plan.backward is not None, plan.inference is not None)
             for plan in apollo_compile.plans()]
    assert (True, False, False) in kinds  # the forward: AOTAutograd's backward is never compiled
    assert (False, False, True) in kinds  # compiled autograd's graph, apollo's too
    torch._dynamo.reset()


def test_distributed_rank0_variants_run_on_the_cpu(tmp_path):
    """bench_distributed.py's placement rows run end to end as a world of one on the CPU (both
    towers on the CPU): the rank-0 path, its global-batch reference and its table row."""
    import json
    import subprocess

    cmd = [sys.executable, os.path.join(BENCHMARKS, "bench_distributed.py"), "--device", "cpu", "--config", "tiny",
           "--batch", "2", "--steps", "1", "--warmup", "1", "--variants", "onegpu-apollo", "placed-apollo",
           "--apollo-options", '{"subgraph_compiler": "eager"}', "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "distributed_results.jsonl").read_text())["results"][0]["variants"]
    assert [(r["variant"], r["status"], r["numerics"]["pass"]) for r in rows] == [
        ("onegpu-apollo", "ok", True), ("placed-apollo", "ok", True)], rows
    assert "placed-apollo" in done.stdout and "vs 1-GPU eager" in done.stdout


def test_capture_recovery_runs_its_loop_on_the_cpu(tmp_path, capsys):
    """benchmarks/probes/capture_recovery.py (a device diagnostic) runs end to end on the CPU, so a slip in
    it does not cost a device call: every step trains, each graph's state is reported. The eager
    subgraph compiler: the loop is under test, not Inductor."""
    import json

    import capture_recovery

    assert capture_recovery.main(["--device", "cpu", "--config", "tiny", "--batch", "2", "--steps", "2",
                                  "--apollo-options", '{"subgraph_compiler": "eager"}', "--out", str(tmp_path)]) == 0
    steps = json.loads((tmp_path / "capture_recovery.json").read_text())["steps"]
    assert [s["status"] for s in steps] == ["ok", "ok"] and all(s["graphs"] for s in steps)
    assert "steps lost: none" in capsys.readouterr().out


def test_whole_step_oom_runs_its_loop_on_the_cpu(capsys):
    """benchmarks/probes/whole_step_oom.py (a device diagnostic) on the CPU: the step whose first
    call ran out of memory before a write trains on the module path as eager AdamW, and the
    subgraph compiler the probe armed is put back (an error after a write: test_optimizer_step.py)."""
    import whole_step_oom

    from apollo_compile.runtime import runner

    original = runner.compile_subgraph
    assert whole_step_oom.main(["--cpu", "--steps", "2", "--batch", "2"]) == 0
    assert runner.compile_subgraph is original
    out = capsys.readouterr().out
    assert "PASS" in out and "ran out of memory before it wrote" in out


def test_host_split_profiles_the_host_in_steps_queued_back_to_back(monkeypatch):
    """host_split.py --b2b-profile (a device diagnostic), on the CPU with the synchronizes stubbed:
    it times the steps, counts garbage collections in them and lists cProfile's top functions."""
    import torch

    import clip
    import common
    import host_split

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    train_step = common.train_step
    monkeypatch.setattr(common, "train_step",
                        lambda model, f, batch, device, amp: train_step(model, f, batch, torch.device("cpu"), False))
    model = clip.build("tiny")
    text = host_split.b2b_profile(model, model, clip.make_batch(2, "cpu", "tiny"), steps=2, top=5)
    assert text.startswith("host ") and "garbage collections in 2 steps" in text
    assert "run_backward" in text  # the profile's table, loss.backward() among its top functions


def test_offload_memory_itemises_the_peak_of_a_trace():
    """benchmarks/probes/offload_memory.py (a device diagnostic): the live set at a trace's peak, from
    allocations and completed frees as the CUDA allocator records them."""
    import offload_memory

    def ev(action, addr, size, where="/tmp/torchinductor_root/ab/cwrap.py"):
        return {"action": action, "addr": addr, "size": size,
                "frames": [{"filename": "??", "line": 0, "name": "torch::unwind::unwind()"},
                           {"filename": "/x/torch/_ops.py", "line": 1, "name": "__call__"},
                           {"filename": where, "line": addr, "name": "call"}]}

    gib = 2**30
    trace = [ev("alloc", 1, gib), ev("alloc", 2, 2 * gib), ev("free_requested", 1, gib), ev("free_completed", 1, gib),
             ev("alloc", 3, 3 * gib), ev("free_completed", 2, 2 * gib), ev("alloc", 4, gib), ev("segment_alloc", 9, 8 * gib)]
    peak, largest, sizes = offload_memory.peak_allocations(trace)
    assert peak == 5 * gib  # buffers 2 and 3, before 2 is freed
    assert [a["gib"] for a in largest] == [3.0, 2.0]
    assert [(s["bytes"], s["count"]) for s in sizes] == [(3 * gib, 1), (2 * gib, 1)]
    assert largest[0]["where"] == ["/tmp/torchinductor_root/ab/cwrap.py:3 call"]  # C++ and torch's frames left out


def test_offload_memory_keeps_whole_wrappers_that_copy_to_the_host(tmp_path):
    """--code-dir copies each host-copying wrapper whole, so that a snapshot's wrapper line numbers
    point into the copy; wrappers without a copy in their `call` are left out."""
    import offload_memory

    cache, out = tmp_path / "cache", tmp_path / "code"
    cache.mkdir()
    (cache / "copies.py").write_text("kernel = 1\n\ndef call(args):\n    buf0.copy_(cpu_offload_x, True)\n")
    (cache / "plain.py").write_text("def call(args):\n    return args\n")
    assert offload_memory.host_copy_wrappers(str(cache), 0, out) == ["copies.py"]
    assert (out / "copies.py").read_text().splitlines()[3] == "    buf0.copy_(cpu_offload_x, True)"


def test_common_judges_gradients_against_eager_and_bf16_noise():
    """benchmarks/common.py, the numerics every table's PASS / PASS* / FAIL comes from, and the row a
    failing variant becomes."""
    import torch

    import common

    ones = {"w": torch.ones(4), "b": torch.ones(2)}
    off = {"w": torch.full((4,), 1.05), "b": torch.ones(2)}  # 5% off: over GRAD_RTOL's 2e-2
    plain = common.reference(1.0, ones)  # no fp32 step: no noise floor to excuse anything
    assert common.verdict(common.compare(1.0, ones, plain, "bf16")) == "PASS"
    assert common.verdict(common.compare(1.0, off, plain, "bf16")) == "FAIL"
    # a gradient zero in exact arithmetic (rounding noise, 1e-8 of the others) is judged against the
    # largest gradient's norm: twice its reference is no error that matters; 1e-3 of the largest is
    unused = common.reference(1.0, {"w": torch.ones(4), "b": None})  # a parameter the loss does not reach
    assert common.verdict(common.compare(1.0, {"w": torch.ones(4), "b": torch.zeros(2)}, unused, "fp32")) == "PASS"
    assert common.verdict(common.compare(1.0, {"w": torch.ones(4), "b": torch.ones(2)}, unused, "fp32")) == "FAIL"
    tiny = common.reference(1.0, {"w": torch.ones(4), "k_bias": torch.full((2,), 1e-8)})
    assert common.verdict(common.compare(1.0, {"w": torch.ones(4), "k_bias": torch.full((2,), 2e-8)}, tiny, "fp32")) == "PASS"
    assert common.verdict(common.compare(1.0, {"w": torch.ones(4), "k_bias": torch.full((2,), 2e-3)}, tiny, "fp32")) == "FAIL"
    # eager bf16 is 3.8% from eager fp32 on w: 1.05 is within 2x that of fp32's 1.04, so w is excused
    noisy = common.reference(1.0, ones, fp32=(1.0, {"w": torch.full((4,), 1.04), "b": torch.ones(2)}))
    n = common.compare(1.0, off, noisy, "bf16")
    assert common.verdict(n) == "PASS*" and n["params_within_bf16_noise"] == ["w"]
    assert noisy["noise_summary"]["grad_rel_err_worst_param"] == "w"
    assert common.verdict(common.compare(1.2, ones, noisy, "bf16")) == "FAIL"  # the loss 20% off
    # a parameter over both rules is listed with what tells rounding from a bug
    far = common.compare(1.0, {"w": torch.full((4,), 1.2), "b": torch.ones(2)}, noisy, "bf16")
    assert common.numerics_text(far).splitlines()[1] == \
        "    w: 2.0e-01 from eager, 1.5e-01 from fp32 (eager bf16 3.8e-02), 1.0e+00 of the largest gradient"
    # the loss by the same rule: eager bf16's 2.00 is 0.04 from fp32's 2.04; 2.07 is 0.03 from it (within 2x),
    # 2.15 is 0.11 from it (not), both over LOSS_RTOL's 1e-2 * 2.00 from eager bf16
    noisy_loss = common.reference(2.0, ones, fp32=(2.04, ones))
    within = common.compare(2.07, ones, noisy_loss, "bf16")
    assert common.verdict(within) == "PASS*" and within["params_within_bf16_noise"] == ["loss"]
    assert common.verdict(common.compare(2.15, ones, noisy_loss, "bf16")) == "FAIL"
    assert common.numerics_cell(n) == "PASS* (dloss 0.0e+00, grad 5.0e-02)"

    assert common.spread([3.0, 1.0, 2.0])["median_ms"] == 2.0

    def runs_out():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    row = common.guarded(runs_out, "apollo", say=lambda *a: None, setup="x")
    assert (row["variant"], row["status"], row["setup"]) == ("apollo", "OOM", "x") and "Traceback" in row["traceback"]
    assert common.failed_cells(8, row, 5) == ["8", "apollo", "OOM", "", "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"]


def test_whole_step_benchmark_runs_on_the_cpu(tmp_path):
    """bench_whole_step.py (the README's table) end to end on the CPU with the tiny HF CLIP: every
    row trains and matches eager, the module compiled, the step compiled whole (compile_step) and
    each layer compiled on its own alike; the tiny timm ViT + BERT (where timm is installed) on the
    module path, which is what its builder and loss need."""
    import importlib.util
    import json

    runs = [("hf-clip-tiny", ("eager", "apollo", "apollo-step", "apollo-step-opt", "apollo-regional"))]
    if importlib.util.find_spec("timm"):
        runs.append(("timm-vit-bert-tiny", ("eager", "apollo")))
    for model, variants in runs:
        out = tmp_path / model
        argv = ["--device", "cpu", "--models", model, "--batch", "2", "--steps", "1", "--warmup", "1",
                "--variants", *variants, "--apollo-options", '{"subgraph_compiler": "eager"}', "--out", str(out)]
        assert bench_whole_step.main(argv) == 0
        (entry,) = json.loads((out / "whole_step_results.json").read_text())["results"]
        rows = [(entry["model"], r["variant"], r["status"], r["numerics"]["pass"]) for r in entry["variants"]]
        assert rows == [(model, v, "ok", True) for v in variants], rows
    assert "| hf-clip-tiny | 2 | apollo |" in (tmp_path / "hf-clip-tiny" / "whole_step_results.md").read_text()
    with pytest.raises(SystemExit):
        bench_whole_step.parse_args(["--models", "hf-bert"])


def test_whole_step_benchmark_runs_llava_on_the_cpu(tmp_path):
    """The LLaVA rows (eager, Inductor's default mode, apollo) on the tiny config: its image
    tokens placed, its language-modelling loss, numerics against eager."""
    import json

    argv = ["--device", "cpu", "--models", "hf-llava-tiny", "--batch", "2", "--steps", "1", "--warmup", "1",
            "--variants", "eager", "inductor", "apollo", "--apollo-options", '{"subgraph_compiler": "eager"}',
            "--out", str(tmp_path)]
    assert bench_whole_step.main(argv) == 0
    (entry,) = json.loads((tmp_path / "whole_step_results.json").read_text())["results"]
    assert [(r["variant"], r["status"], r["numerics"]["pass"]) for r in entry["variants"]] == [
        ("eager", "ok", True), ("inductor", "ok", True), ("apollo", "ok", True)]


def test_large_batch_search_doubles_then_bisects_and_tries_each_batch_once():
    """bench_large_batch.search: doubling from the start until a batch fails (halving while the
    first fails), then bisection to 1/resolution of the largest batch that trains."""
    def search(limit, start=64, max_batch=4096, resolution=16):
        return bench_large_batch.search(lambda b: b <= limit, start, max_batch, resolution)

    found = search(300)
    assert [b for b, _ in found["tries"]] == [64, 128, 256, 512, 384, 320, 288, 304]
    assert (found["largest"], found["smallest_failing"]) == (288, 304) and 304 - 288 <= 288 // 16
    assert len({b for b, _ in found["tries"]}) == len(found["tries"])
    low = search(20)
    assert [b for b, _ in low["tries"]][:3] == [64, 32, 16] and low["largest"] == 20
    assert search(0)["largest"] is None and search(0)["stop"].startswith("nothing trains")
    top = search(10_000, max_batch=1000)
    assert (top["largest"], top["smallest_failing"]) == (1000, None) and top["tries"][-1] == (1000, True)
    listed = bench_large_batch.listed(lambda b: b <= 300, [256, 384, 320])
    assert (listed["largest"], listed["smallest_failing"]) == (256, 320)


def test_large_batch_says_whether_apollo_replayed_its_cuda_graphs():
    """A try trains even where a capture fell back (un-graphed, warned): the table must say it did not
    replay as CUDA graphs, and why; a capture declined near the limit is un-graphed by design."""
    cuda = torch.device("cuda", 0)  # a device object only: graphed() reads the row
    graph = {"replays": 5, "disabled": None, "ungraphed_calls": 0, "capture_refused": None}
    row = {"apollo": [{"plan": "frame0_0", "graphs": {"forward": {"cuda_graph": graph},
                                                      "backward": {"cuda_graph": dict(graph)}}}]}
    assert bench_large_batch.graphed("apollo", row, cuda) == (True, [])
    row["apollo"][0]["graphs"]["backward"]["cuda_graph"].update(disabled="OutOfMemoryError: CUDA out of memory")
    assert bench_large_batch.graphed("apollo", row, cuda) == (
        False, ["frame0_0 backward: OutOfMemoryError: CUDA out of memory"])
    row["apollo"][0]["graphs"]["backward"] = {"cuda_graph": dict(graph, capture_refused="82% of the cap")}
    assert bench_large_batch.graphed("apollo", row, cuda) == (
        False, ["frame0_0 backward: un-graphed by design: 82% of the cap"])
    assert bench_large_batch.graphed("apollo", {"apollo": []}, cuda)[0] is False  # no plan: nothing graphed
    assert bench_large_batch.graphed("apollo", row, torch.device("cpu")) == (None, [])
    assert bench_large_batch.graphed("eager", row, cuda) == (None, [])


def test_large_batch_runs_each_try_in_a_process_of_its_own_on_the_cpu(tmp_path):
    """bench_large_batch.py end to end on the CPU (no allocator to cap: --max-batch bounds the
    search at one try; the search itself is tested above): the try runs in a fresh process and
    trains, the table and JSON come out."""
    import json

    argv = ["--device", "cpu", "--models", "hf-clip-tiny", "--variants", "apollo", "--start", "2", "--max-batch", "2",
            "--steps", "1", "--warmup", "1", "--apollo-options", '{"subgraph_compiler": "eager"}', "--out", str(tmp_path)]
    assert bench_large_batch.main(argv) == 0
    (search,) = json.loads((tmp_path / "large_batch_results.json").read_text())["searches"]
    assert (search["variant"], search["largest"], search["smallest_failing"]) == ("apollo", 2, None)
    assert [(r["batch"], r["status"], r["trained"], r["steps_run"]) for r in search["records"]] == [(2, "ok", True, 2)]
    assert (tmp_path / "tries" / "hf-clip-tiny-nocap-apollo-2.log").exists()
    assert "| hf-clip-tiny | none | apollo | 2 | - |" in (tmp_path / "large_batch_results.md").read_text()
    for bad in (["--device", "cpu", "--cap-gib", "20"], ["--variants", "apollo-bw-measured"], ["--start", "0"]):
        with pytest.raises(SystemExit):
            bench_large_batch.parse_args(bad)


def test_the_step_host_probe_runs_on_the_cpu(tmp_path):
    """probes/step_host.py (h200_session.sh step-host): the optimizer-inside step's host split, on
    the CPU without its CUDA-graph stamps: a row with the step's time and the profile, written as
    each variant finishes; with --skip-guards-too the same steps again under torch's stance that
    skips Dynamo's guard checks."""
    import json

    import step_host

    out = tmp_path / "host"
    assert step_host.main(["--device", "cpu", "--models", "hf-clip-tiny", "--batch", "2", "--steps", "2", "--warmup",
                           "2", "--variants", "apollo-step-opt", "--apollo-options",
                           '{"subgraph_compiler": "eager"}', "--top", "3", "--skip-guards-too", "--out", str(out)]) == 0
    (row,) = json.loads((out / "step_host.json").read_text())
    assert row["variant"] == "apollo-step-opt" and row["step"] > 0 and "ncalls" in row["profile"]
    assert row["step (guards skipped)"] > 0


def test_the_step_host_probe_times_module_variants_under_their_runtime(tmp_path, monkeypatch):
    """probes/step_host.py takes the module-compiled variants too (the loop runs their backward),
    each under the runtime bench_whole_step gives it: apollo-no-first-step-pool with
    graph_pool.FIRST_STEP_POOL empty while it runs, and the default again for the next."""
    import json

    import step_host

    from apollo_compile.runtime import graph_pool

    seen, real = [], step_host.training_step

    def spy(variant, *args):
        seen.append((variant, graph_pool.FIRST_STEP_POOL))
        return real(variant, *args)

    monkeypatch.setattr(step_host, "training_step", spy)
    out = tmp_path / "host"
    assert step_host.main(["--device", "cpu", "--models", "hf-clip-tiny", "--batch", "2", "--steps", "2", "--warmup",
                           "2", "--variants", "apollo-no-first-step-pool", "apollo", "--apollo-options",
                           '{"subgraph_compiler": "eager"}', "--top", "3", "--out", str(out)]) == 0
    assert seen == [("apollo-no-first-step-pool", frozenset()), ("apollo", {"forward"})]
    rows = json.loads((out / "step_host.json").read_text())
    assert [r["variant"] for r in rows] == ["apollo-no-first-step-pool", "apollo"] and all(r["step"] > 0 for r in rows)


class _Event:
    """A profiler event as torch's kineto results give it, for step_kernels.timeline."""

    def __init__(self, name, start, end, on_gpu, stream=7, annotation=False):
        self._name, self._start, self._end, self._gpu, self._stream, self._annotation = (
            name, start, end, on_gpu, stream, annotation)

    def name(self):
        return self._name

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._end

    def duration_ns(self):
        return self._end - self._start

    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self._gpu else torch.autograd.DeviceType.CPU

    def device_resource_id(self):
        return self._stream

    def is_user_annotation(self):
        return self._annotation


def test_the_step_timeline_counts_kernels_not_the_ranges_marked_on_the_gpu():
    """probes/step_kernels.py's timeline: per step (the probe's CPU-side range), the span from the
    first kernel to the last, the time some kernel runs (overlaps counted once), the summed kernel
    time, the busiest stream and the sums by kind. The ranges the profiler also puts on the GPU's
    timeline (the step's own mark, ``Optimizer.step#AdamW.step``) are no kernels: counted, they made
    every step look busy from its start to its end."""
    import step_kernels as sk

    mark = sk.STEP_MARK
    events = [_Event(f"{mark}0", 0, 10_000, False), _Event(f"{mark}0", 0, 10_000, True, annotation=True),
              _Event("Optimizer.step#AdamW.step", 0, 9_000, True),
              _Event("nvjet_sm90_tst_64x64_NNT", 1_000, 3_000, True, stream=7),
              _Event("triton_poi_fused__to_copy_3", 2_000, 4_000, True, stream=9),
              _Event("void multi_tensor_apply_kernel<FusedAdamMathFunctor>", 5_000, 6_000, True, stream=7),
              _Event(f"{mark}1", 20_000, 30_000, False),
              _Event("nvjet_sm90_tst_64x64_NNT", 21_000, 23_000, True, stream=7),
              _Event("triton_poi_fused__to_copy_3", 21_000, 23_000, True, stream=9)]
    row = sk.timeline(events)
    # step 0: span 1-6 us, busy 1-4 and 5-6 (4 us), sum 5 us, stream 7 3 us; step 1: 2, 2, 4, 2
    assert row["span"] == (5 + 2) / 2 and row["busy"] == (4 + 2) / 2 and row["sum"] == (5 + 4) / 2
    assert row["busiest stream"] == (3 + 2) / 2 and row["streams"] == 2 and row["kernels"] == (3 + 2) / 2
    assert row["matmul"] == 2 and row["triton"] == 2 and row["update"] == 0.5 and row["other"] == 0
    assert sk.kind("Memcpy DtoD (Device -> Device)") == "copy" and sk.busy_ns([(0, 10), (5, 15), (20, 21)]) == 16


@pytest.mark.parametrize("variant, kinds", [("apollo-no-first-step-pool", set()),
                                            ("apollo-step-opt-first-step-pool", {"forward", "inference"})])
def test_the_first_step_pool_variants_set_which_graphs_open_it_for_their_run_alone(variant, kinds):
    """bench_whole_step's *-first-step-pool variants run with runtime.graph_pool.FIRST_STEP_POOL
    (the kinds of graph whose first call opens a pool of its own; forwards by default)
    as they say and leave it as it was; the others leave it alone."""
    from apollo_compile.runtime import graph_pool

    assert graph_pool.FIRST_STEP_POOL == {"forward"}
    with bench_whole_step.runtime_for(variant):
        assert graph_pool.FIRST_STEP_POOL == kinds
    with bench_whole_step.runtime_for("apollo-step-opt" if "step-opt" in variant else "apollo"):
        assert graph_pool.FIRST_STEP_POOL == {"forward"}
    assert graph_pool.FIRST_STEP_POOL == {"forward"}
    assert variant in bench_whole_step.VARIANTS and (variant in bench_whole_step.STEP_VARIANTS) == variant.startswith("apollo-step")


def test_the_interleaved_probe_gives_each_module_copy_graphs_of_its_own(tmp_path):
    """probes/interleaved_ab.py (h200_session.sh first-step-pool-interleaved) times variants with
    their steps interleaved in one process. Dynamo keys graphs by code object, so two copies of a
    module-compiled model would share one compile and the second run the first's CUDA graphs'
    fallback; each copy compiles its own (OwnCode), and both copies' rows come out."""
    import json

    import interleaved_ab

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = tmp_path / "ab"
    assert interleaved_ab.main(["--device", "cpu", "--models", "hf-clip-tiny", "--batch", "2", "--steps", "2",
                                "--rounds", "2", "--warmup", "2", "--variants", "apollo", "apollo",
                                "--apollo-options", '{"subgraph_compiler": "eager"}', "--out", str(out)]) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # one compile per copy
    rows = json.loads((out / "interleaved_ab.json").read_text())
    assert [(r["copy"], r["variant"]) for r in rows] == [(0, "apollo"), (1, "apollo")]
    assert all(len(r["loaded_all"]) == 4 and len(r["b2b_all"]) == 2 for r in rows)
