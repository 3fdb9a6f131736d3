"""apollo composes with PyTorch's distributed engines: DDP (with Dynamo's bucket splitting) and FSDP2.

Every scenario is a real two-process job on CPU over ``gloo``, loopback only: this file, run as a
script, is the per-rank worker; the tests launch two copies of it torchrun-style (RANK, WORLD_SIZE,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT), each in its own session, bounded by TIMEOUT_S and
killed (process group, by pid) if they overrun. Each scenario runs once per module (a fixture) and
several tests read its result.

What "trains like eager" means here. The contrastive loss of ``TwoTower`` couples the examples of a
batch, so a data-parallel step (each rank: the contrastive loss of its own shard; DDP averages the
gradients over ranks, FSDP2 reduce-scatters their average) optimises the *mean of the per-shard
losses*. The reference is that objective in one process, eagerly, on the full global batch:
``mean(model(shard) for shard in global_batch.chunk(world))``, one backward, SGD. The per-rank loss is
therefore left unscaled (a mean over the local shard): DDP's division by the world size is the
1/world of the reference's mean. Each rank computes the reference itself (same seed, one thread),
and the test compares, at every step: the rank's local loss with the reference's loss on that
shard, every gradient after the all-reduce (FSDP2: the full tensor of the sharded gradient) and
every parameter after the SGD step, with tests/helpers.TOLERANCE; and the two ranks with each
other.

Not done on CPU: peak memory per rank and throughput (GPU figures: benchmarks/bench_distributed.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORLD = 2
STEPS = 3
LR = 0.1
GLOBAL_BATCH = 8
TIMEOUT_S = 240  # per scenario, both ranks together: compile + 3 steps + reference

SCENARIOS = {
    # name: (engine, subgraph compiler, model width, DDP bucket_cap_mb, layers a tower); one layer a
    # tower where depth adds nothing the test reads (each scenario is two processes compiling)
    "ddp_eager": ("ddp", "eager", 32, None, 1),
    # DDPOptimizer refuses bucket_cap_mb < 1 (its first bucket is DDP's 1 MiB default and must
    # not exceed the others), so the model is widened to ~3 MB of parameters to get 4 buckets.
    "ddp_split": ("ddp", "eager", 128, 1.0, 2),
    # one layer a tower: the model test_backend compiles with Inductor, whose kernels it then finds built
    "ddp_inductor": ("ddp", "inductor", 32, None, 1),
    "fsdp2": ("fsdp2", "eager", 32, None, 1),
    # DDP's Python reducer under compiled autograd: the backward, gradient all-reduces included, is
    # one graph that apollo compiles (the way to overlap the all-reduces with the backward)
    "ddp_compiled_autograd": ("ddp-ca", "eager", 32, None, 1),
}


# ------------------------------------------------------------------------------------------
# the worker (one rank)


def _import_fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:  # older torch: the composable API's home before it moved
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy: the full tensor of an FSDP2 DTensor (a collective), else the tensor."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().clone()


def worker(scenario: str, out: Path) -> None:
    import torch.distributed as dist

    sys.path[:0] = [str(ROOT), str(HERE), str(ROOT / "benchmarks")]
    import apollo_compile  # noqa: F401  (registers backend="apollo")
    from bench_step import compiled_autograd
    from models import TwoTower, two_tower_inputs

    engine, compiler, width, bucket_cap_mb, layers = SCENARIOS[scenario]
    torch.set_num_threads(1)
    # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; collectives give up before the launcher does
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TwoTower(width=width, layers=layers)
    if engine == "fsdp2":
        # fully_shard rejects 0-d parameters ("Change logit_scale to a 1D tensor with numel equal
        # to 1"); the forward broadcasts a (1,) scale the same way. Done before the copy: the
        # reference has the same parameters.
        model.logit_scale = torch.nn.Parameter(model.logit_scale.detach().reshape(1))
    ref = copy.deepcopy(model)
    backward_context = contextlib.nullcontext
    if engine in ("ddp", "ddp-ca"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        # the default, DDPOptimizer splits at buckets; the Python reducer is chosen when DDP is built
        torch._dynamo.config.optimize_ddp = True if engine == "ddp" else "python_reducer"
        kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        wrapped = DDP(model, **kwargs)
        if engine == "ddp-ca":
            backward_compiler = torch.compile(backend="apollo", options={"subgraph_compiler": compiler})
            backward_context = lambda: compiled_autograd(backward_compiler)  # noqa: E731
    else:
        fully_shard = _import_fully_shard()
        for block in [*model.vision.blocks, *model.text.blocks]:
            fully_shard(block)
        wrapped = fully_shard(model)
    before = len(apollo_compile.plans())
    compiled = torch.compile(wrapped, backend="apollo", options={"subgraph_compiler": compiler})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    names = [n for n, _ in ref.named_parameters()]
    steps, times = [], []
    for step in range(STEPS):
        images, tokens = two_tower_inputs(GLOBAL_BATCH, seed=step)
        shards = list(zip(images.chunk(world), tokens.chunk(world)))
        t0 = time.perf_counter()
        loss = compiled(*shards[rank])
        with backward_context():
            loss.backward()
        times.append(time.perf_counter() - t0)
        shard_losses = [ref(*s) for s in shards]
        torch.stack(shard_losses).mean().backward()
        rec = {
            "loss": loss.detach().clone(), "ref_loss": shard_losses[rank].detach().clone(),
            "grads": {n: None if p.grad is None else _full(p.grad) for n, p in zip(names, model.parameters())},
            "ref_grads": {n: None if p.grad is None else _full(p.grad) for n, p in zip(names, ref.parameters())},
        }
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        rec["params"] = {n: _full(p) for n, p in zip(names, model.parameters())}
        rec["ref_params"] = {n: _full(p) for n, p in zip(names, ref.parameters())}
        steps.append(rec)
    plans = [
        {"name": p.name,
         "graphs": {kind: {"fallback": g.fallback, "lanes": None if g.lanes is None else dict(g.lanes.lanes),
                           "all_reduces": sum("all_reduce" in str(n.target) for n in g.gm.graph.nodes)}
                    for kind, g in p.graphs.items()}}
        for p in apollo_compile.plans()[before:]
    ]
    torch.save({"steps": steps, "plans": plans, "step_s": times, "torch": torch.__version__},
               out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# the launcher


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    """End a worker we started, and its children (Inductor's compile workers), by its group id."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def launch(scenario: str, out: Path, timeout_s: float = TIMEOUT_S) -> dict:
    """Run the scenario on WORLD ranks; return {"ranks": [rank results], "wall_s": ...}."""
    for attempt in range(2):  # a second try only if the free port was taken meanwhile
        port = _free_port()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        procs, logs = [], []
        start = time.monotonic()
        try:
            for rank in range(WORLD):
                log = open(out / f"rank{rank}.log", "w")
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--scenario", scenario, "--out", str(out)],
                    env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, cwd=str(ROOT)))
            # until both exit, one fails (its peer would wait in a collective), or time is up
            while time.monotonic() - start < timeout_s:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                _kill(p)
            for log in logs:
                log.close()
        wall = time.monotonic() - start
        texts = [(out / f"rank{r}.log").read_text() for r in range(WORLD)]
        if attempt == 0 and any("address already in use" in t.lower() for t in texts):
            continue
        break
    codes = [p.returncode for p in procs]  # -9: killed here (timed out, or its peer failed first)
    if any(c != 0 for c in codes):
        why = f"timed out after {timeout_s:.0f} s" if wall >= timeout_s else f"exit codes {codes}"
        tails = "\n".join(f"--- rank {r} (last lines)\n" + "\n".join(t.splitlines()[-40:]) for r, t in enumerate(texts))
        raise AssertionError(f"distributed scenario {scenario!r} failed: {why}\n{tails}")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    print(f"{scenario}: {wall:.1f} s wall for {WORLD} ranks; "
          f"step s (rank 0, first incl. compile): {[round(t, 3) for t in ranks[0]['step_s']]}")
    return {"ranks": ranks, "wall_s": wall}


# ------------------------------------------------------------------------------------------
# checks


def assert_trains_like_eager(result: dict, compiler: str) -> None:
    from helpers import TOLERANCE

    tol = TOLERANCE[compiler]
    for rank, res in enumerate(result["ranks"]):
        for step, rec in enumerate(res["steps"]):
            where = f"rank {rank} step {step}"
            torch.testing.assert_close(rec["loss"].reshape(()), rec["ref_loss"], **tol,
                                       msg=lambda m: f"{where} loss: {m}")
            for kind in ("grads", "params"):
                for name, ref in rec[f"ref_{kind}"].items():
                    got = rec[kind][name]
                    assert (got is None) == (ref is None), f"{where} {kind} {name}: one of them is None"
                    if ref is not None:
                        torch.testing.assert_close(got.reshape(ref.shape), ref, **tol,
                                                   msg=lambda m: f"{where} {kind[:-1]} {name}: {m}")
    # after the all-reduce (or the reduce-scatter + full_tensor) the ranks hold the same values
    r0, r1 = result["ranks"]
    for step, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        for name in a["params"]:
            torch.testing.assert_close(a["params"][name], b["params"][name], rtol=0, atol=0,
                                       msg=lambda m: f"step {step} param {name} differs between ranks: {m}")


def fallbacks(result: dict) -> list[str]:
    return [f"{p['name']}_{kind}: {g['fallback']}" for p in result["ranks"][0]["plans"]
            for kind, g in p["graphs"].items() if g["fallback"]]


def assert_no_fallback(result: dict) -> None:
    """Every graph ran apollo's own runtime, DDP bucket graphs with no lane-0 subgraph and Blocks
    recompiled with dynamic shapes among them (codegen and the memory plan handle both)."""
    found = fallbacks(result)
    assert not found, "apollo fell back on graphs:\n" + "\n".join(found)


# ------------------------------------------------------------------------------------------
# the tests


def _run(scenario: str, tmp_path_factory) -> dict:
    return launch(scenario, tmp_path_factory.mktemp(scenario))


@pytest.fixture(scope="module")
def ddp_eager(tmp_path_factory):
    return _run("ddp_eager", tmp_path_factory)


@pytest.fixture(scope="module")
def ddp_split(tmp_path_factory):
    return _run("ddp_split", tmp_path_factory)


@pytest.fixture(scope="module")
def ddp_compiled_autograd(tmp_path_factory):
    return _run("ddp_compiled_autograd", tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    try:
        _import_fully_shard()
    except ImportError as e:
        pytest.skip(f"FSDP2 fully_shard is not importable in torch {torch.__version__}: {e}")
    return _run("fsdp2", tmp_path_factory)


needs_gloo = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this build")
pytestmark = [needs_gloo]


def test_ddp_trains_like_eager(ddp_eager):
    assert_trains_like_eager(ddp_eager, "eager")


def test_ddp_one_graph_plans_both_towers(ddp_eager):
    """Bucket cap above the model's size: one Dynamo graph, apollo gives each tower a lane."""
    plans = ddp_eager["ranks"][0]["plans"]
    assert len(plans) == 1, [p["name"] for p in plans]
    assert not fallbacks(ddp_eager), fallbacks(ddp_eager)
    for kind in ("forward", "backward"):
        lanes = plans[0]["graphs"][kind]["lanes"]
        mods = {m for ms in lanes.values() for m in ms}
        assert len(lanes) >= 2 and {"vision", "text"} <= mods, (kind, lanes)


def test_ddp_bucket_split_trains_like_eager(ddp_split):
    """optimize_ddp splits the graph at DDP's buckets: several apollo graphs, gradients still right."""
    plans = ddp_split["ranks"][0]["plans"]
    assert len(plans) > 1, f"expected one graph per DDP bucket, got {[p['name'] for p in plans]}"
    assert all(set(p["graphs"]) == {"forward", "backward"} for p in plans), plans
    assert_trains_like_eager(ddp_split, "eager")


def test_ddp_bucket_split_no_fallback(ddp_split):
    assert_no_fallback(ddp_split)


def test_ddp_bucket_split_graph_names_unique(ddp_split):
    names = [p["name"] for p in ddp_split["ranks"][0]["plans"]]
    assert len(set(names)) == len(names), names


def test_ddp_compiled_autograd_trains_like_eager(ddp_compiled_autograd):
    """DDP's Python reducer under compiled autograd: apollo compiles the forward, and the whole
    backward arrives as one more graph with DDP's gradient all-reduces in it (functional
    collectives), so that they can run while the rest of the backward does (on GPUs: variant
    ddp-apollo-ca of benchmarks/bench_distributed.py, not measured yet)."""
    assert_trains_like_eager(ddp_compiled_autograd, "eager")
    assert not fallbacks(ddp_compiled_autograd), fallbacks(ddp_compiled_autograd)
    graphs = [g for p in ddp_compiled_autograd["ranks"][0]["plans"] for g in p["graphs"].values()]
    assert any(g["all_reduces"] > 0 for g in graphs), graphs


def test_ddp_inductor_trains_like_eager(tmp_path_factory):
    """The default subgraph compiler once, one layer a tower (about 40 s of C++ builds on 2 shared
    cores; under 10 s where test_backend's Inductor case built the same kernels first)."""
    result = _run("ddp_inductor", tmp_path_factory)
    assert_trains_like_eager(result, "inductor")
    assert not fallbacks(result), fallbacks(result)


def test_fsdp2_trains_like_eager(fsdp2):
    """fully_shard per Block and on the root, the root compiled with apollo, on CPU over gloo.

    Dynamo does not trace FSDP2's hooks (torch._dynamo.config.skip_fsdp_hooks): it breaks the
    graph at every fully_shard'ed Block, so apollo sees per-Block graphs and the glue between
    them; the two towers never share a graph and cannot overlap under per-Block FSDP2."""
    assert len(fsdp2["ranks"][0]["plans"]) > 1
    assert_trains_like_eager(fsdp2, "eager")


def test_fsdp2_no_fallback(fsdp2):
    assert_no_fallback(fsdp2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one rank of a distributed apollo scenario")
    parser.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    worker(args.scenario, args.out)
