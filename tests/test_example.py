"""examples/train_clip.py and examples/data.py: the README's main command, on CPU with small settings.

The training runs are subprocesses (``python examples/train_clip.py ...``), as a user runs them;
their stdout is a pipe, so the script's progress bar prints plain lines (on a terminal it redraws
one). They share one small synthetic dataset (512 examples).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_clip.py"
TINY = {"image_size": 32, "context": 16, "vocab": 512}  # benchmarks/clip.py's "tiny" config
N = 512


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # importable by that name: pickling its classes needs it
    spec.loader.exec_module(module)
    return module


data = _load("apollo_example_data", ROOT / "examples" / "data.py")


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clip_data") / "synthetic"
    data.make_synthetic(root, N, TINY, seed=0)
    return root


def run_example(*args: str, cwd: Path, timeout: float = 180) -> str:
    """Run train_clip.py with ``args``; return its stdout (fail with stdout+stderr on error)."""
    code = (f"import sys; sys.argv = [{str(SCRIPT)!r}, *sys.argv[1:]]; "
            f"import runpy; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    # one intra-op thread: on a small shared CI machine, OpenMP threads waiting for a busy core
    # make steps 100x slower; the data workers still run in parallel
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


def common(dataset_dir: Path) -> list[str]:
    return ["--data", str(dataset_dir), "--synthetic-n", str(N), "--workers", "2"]


def losses(metrics: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, metrics.read_text().splitlines())]


def prediction(stdout: str) -> tuple[dict[int, float], float, int]:
    """(bucket -> predicted GiB, limit GiB, chosen bucket) from the printed prediction line."""
    line = next(l for l in stdout.splitlines() if l.startswith("memory prediction"))
    table = {int(b): float(g) for b, g in re.findall(r"(\d+): ([\d.]+) GiB", line)}
    limit, chosen = re.search(r"limit ([\d.]+) GiB -> batch (\d+)", line).groups()
    return table, float(limit), int(chosen)


# --- the dataset ---------------------------------------------------------------------------------


def test_synthetic_layout_and_reader(tmp_path, dataset_dir):
    meta = json.loads((dataset_dir / "meta.json").read_text())
    assert {k: meta[k] for k in ("n", "image_size", "context", "vocab")} == {"n": N, **TINY}
    assert (dataset_dir / "images.u8").stat().st_size == N * 3 * 32 * 32
    assert (dataset_dir / "tokens.i32").stat().st_size == N * 16 * 4
    raw = np.memmap(dataset_dir / "tokens.i32", "<i4", "r", shape=(N, 16))
    assert (raw[:, 0] == 510).all() and ((raw == 511).sum(1) == 1).all()  # SOT first, one EOT
    assert (raw.argmax(1) == (raw == 511).argmax(1)).all()  # the EOT is the largest id (pooling)

    ds = data.MemmapImageText(dataset_dir)
    assert len(ds) == N
    image, tokens = ds[7]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert tokens.shape == (16,) and tokens.dtype == torch.int64
    assert -1.0 <= image.min() and image.max() <= 1.0
    batch = ds.__getitems__([9, 2, 7])
    assert torch.equal(batch[2][0], image) and torch.equal(batch[2][1], tokens)
    ds_std = data.MemmapImageText(dataset_dir, mean=data.CLIP_MEAN, std=data.CLIP_STD)
    u8 = torch.from_numpy(np.array(np.memmap(dataset_dir / "images.u8", np.uint8, "r", shape=(N, 3, 32, 32))[7]))
    expected = (u8 / 255 - torch.tensor(data.CLIP_MEAN).view(3, 1, 1)) / torch.tensor(data.CLIP_STD).view(3, 1, 1)
    torch.testing.assert_close(ds_std[7][0], expected)
    blob = pickle.dumps(ds)  # after reads: the memmaps are open
    assert len(blob) < 10_000  # workers get paths, not a copy of the arrays
    assert torch.equal(pickle.loads(blob)[7][0], image)

    # deterministic: the same seed writes the same bytes
    again = data.make_synthetic(tmp_path / "again", N, TINY, seed=0)
    for name in ("images.u8", "tokens.i32"):
        assert (again / name).read_bytes() == (dataset_dir / name).read_bytes()

    # learnable: the images of one caption's colour token share a colour
    first = np.array(np.memmap(dataset_dir / "images.u8", np.uint8, "r", shape=(N, 3, 32, 32)), np.float32)
    means = first.mean((2, 3))
    by_token: dict[int, list[int]] = {}
    for i, row in enumerate(np.asarray(raw)):
        for t in set(row.tolist()) - {0, 510, 511}:
            by_token.setdefault(t, []).append(i)
    frequent = sorted(by_token, key=lambda t: -len(by_token[t]))[:16]  # the 8 colour + 8 pattern ids
    spreads = sorted(means[by_token[t]].std(0).mean() for t in frequent)
    assert spreads[0] < 0.5 * means.std(0).mean()  # some class token pins the mean colour down

    # a user's dataset in the same layout, written with the helper, and a broken one
    imgs = np.zeros((4, 3, 8, 8), np.uint8)
    toks = np.zeros((4, 5), np.int64)
    toks[:, 0], toks[:, 1] = 30, 31
    own = data.write_dataset(tmp_path / "own", imgs, toks, vocab=32)
    assert len(data.MemmapImageText(own)) == 4
    with pytest.raises(ValueError, match="image_size 8"):
        data.MemmapImageText(own).check_compatible(TINY)
    (own / "tokens.i32").write_bytes(b"\0" * 12)
    with pytest.raises(ValueError, match="expected 80 bytes"):
        data.MemmapImageText(own)


def test_bucket_choice_and_sampler():
    saved_path, saved_mods = list(sys.path), {k: sys.modules.get(k) for k in ("clip", "data")}
    try:
        train = _load("apollo_example_train_clip", SCRIPT)
    finally:
        sys.path[:] = saved_path
        for k, v in saved_mods.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    predicted = train.predict_bytes(plan_bytes=800, probe_batch=8, per_sample_input=10, static=1000,
                                    buckets=(8, 16, 32))
    assert predicted == {8: 1000 + 8 * 110, 16: 1000 + 16 * 110, 32: 1000 + 32 * 110}
    assert train.choose_bucket(predicted, limit=3000) == 16
    assert train.choose_bucket(predicted, limit=10**9) == 32
    assert train.choose_bucket(predicted, limit=1) == 8  # nothing fits: the smallest

    sampler = train.BucketBatchSampler(n=70, batch=16, seed=3)
    epoch0 = list(sampler)
    assert len(epoch0) == 4 and all(len(b) == 16 for b in epoch0)  # the partial batch is dropped
    assert len({i for b in epoch0 for i in b}) == 64
    sampler.set_epoch(0, start=2)
    assert list(sampler) == epoch0[2:]
    sampler.set_epoch(1)
    assert list(sampler) != epoch0


# --- training runs -------------------------------------------------------------------------------


def test_default_dataset_created_and_eager_run(tmp_path):
    """``--backend eager --steps 6`` from a fresh directory: ./data/clip_synthetic appears."""
    out = run_example("--backend", "eager", "--steps", "6", "--workers", "2", "--synthetic-n", str(N),
                      cwd=tmp_path)
    root = tmp_path / "data" / "clip_synthetic"
    ds = data.MemmapImageText(root)
    ds.check_compatible(TINY)
    assert len(ds) == N and ds[0][0].shape == (3, 32, 32)
    table, limit, chosen = prediction(out)
    assert limit == 4.0 and chosen == 32 and set(table) == {8, 16, 32}
    summary = next(l for l in out.splitlines() if l.startswith("summary:"))
    assert re.search(r"final loss \d+\.\d+ \| batch 32 \| median step [\d.]+ ms over 4 steps", summary), summary
    assert "samples/s" in summary and "peak RSS" in summary
    assert re.search(r"^\[#{24}\] step 6/6  epoch 0  loss \d", out, re.M), out  # the progress bar's last line
    assert "compiles the batch" not in out  # eager compiles nothing


def test_apollo_run_respects_memory_limit(tmp_path, dataset_dir):
    """apollo (eager subgraphs) with a tiny limit: the chosen bucket is the largest predicted to fit."""
    metrics = tmp_path / "m.jsonl"
    out = run_example("--backend", "apollo", "--subgraph-compiler", "eager", "--steps", "6",
                      "--memory-limit-gib", "0.006", "--metrics", str(metrics), *common(dataset_dir),
                      cwd=tmp_path)
    table, limit, chosen = prediction(out)
    assert limit == 0.006 and set(table) == {8, 16, 32}
    assert table[8] < table[16] < table[32]
    fitting = [b for b, gib in table.items() if gib <= limit]
    assert chosen == (max(fitting) if fitting else 8)
    assert chosen < 32, table  # the limit sits below the largest bucket's prediction
    assert f"training: batch {chosen}," in out
    assert len(losses(metrics)) == 6
    assert re.search(r"forward : \d lane\(s\)", out) and re.search(r"backward: \d lane\(s\)", out), out
    # before the first step, what it compiles (or that the probe did); the bar after it
    notice = out.index(f"step 0 compiles the batch-{chosen}" if chosen != 8 else "step 0 runs the batch-8 graph")
    assert notice < out.index("step 0: ") < out.index("] step 6/6")

    # a limit nothing fits: the smallest bucket, said so
    out = run_example("--backend", "eager", "--steps", "1", "--memory-limit-gib", "0.0001",
                      *common(dataset_dir), cwd=tmp_path)
    assert prediction(out)[2] == 8 and "none fits" in out


def test_memory_passes_from_the_command_line(tmp_path, dataset_dir):
    """--memory-budget and --offload-activations reach apollo's options; the summary reports both
    (the tiny model's saved values are under offload.MIN_BYTES: none moves)."""
    metrics = tmp_path / "m.jsonl"
    out = run_example("--backend", "apollo", "--subgraph-compiler", "eager", "--steps", "3", "--batch", "8",
                      "--memory-budget", "0.3", "--offload-activations", "--metrics", str(metrics),
                      *common(dataset_dir), cwd=tmp_path)
    assert len(losses(metrics)) == 3 and all(math.isfinite(loss) for _, loss in losses(metrics))
    assert re.search(r"memory  : budget 0\.3: predicted peak activations [\d.]+ of [\d.]+ MiB", out), out
    assert "offload : 0 saved values" in out, out


def test_loss_decreases(tmp_path, dataset_dir):
    metrics = tmp_path / "m.jsonl"
    run_example("--backend", "eager", "--steps", "30", "--batch", "32", "--metrics", str(metrics),
                *common(dataset_dir), cwd=tmp_path)
    values = [loss for _, loss in losses(metrics)]
    assert len(values) == 30
    first, last = np.mean(values[:5]), np.mean(values[-5:])
    assert last < first - 0.5, values


def test_resume_continues_like_an_uninterrupted_run(tmp_path, dataset_dir):
    args = ["--backend", "eager", "--batch", "8", *common(dataset_dir)]
    full, part = tmp_path / "full.pt", tmp_path / "part.pt"
    m_full, m_part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    run_example("--steps", "6", "--checkpoint", str(full), "--metrics", str(m_full), *args, cwd=tmp_path)
    run_example("--steps", "3", "--checkpoint", str(part), "--save-every", "2", "--metrics", str(m_part),
                *args, cwd=tmp_path)
    assert torch.load(part, weights_only=True)["step"] == 3
    out = run_example("--steps", "6", "--resume", "--checkpoint", str(part), "--metrics", str(m_part),
                      "--backend", "eager", *common(dataset_dir), cwd=tmp_path)  # batch from the checkpoint
    assert "resumed from" in out and "step 3" in out and "steps 3..5" in out

    a, b = torch.load(full, weights_only=True), torch.load(part, weights_only=True)
    assert a["step"] == b["step"] == 6 and b["batch"] == 8
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert losses(m_part) == losses(m_full)  # steps 0..5, the same losses, in order
