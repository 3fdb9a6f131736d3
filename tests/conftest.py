import contextlib
import gc
import os
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(os.path.dirname(TESTS), "benchmarks")
# the tests' helpers and models; the benchmark scripts and their probes, which tests run on the CPU
# so that a slip in one does not cost a device call
sys.path[:0] = [TESTS, BENCHMARKS, os.path.join(BENCHMARKS, "probes")]

# One intra-op thread per test process. The suite runs as two workers on two cores (pytest -n 2):
# with a thread per core each, an OpenMP thread waiting for a core the other worker holds stalls
# the ops of these tiny models, and both workers crawl. Eager and apollo share the process, so
# every comparison still runs both sides alike.
torch.set_num_threads(1)

# The garbage collector's full passes walk every live object, and a worker holds a million of them
# (torch, transformers, what compiling leaves cached): at Python's default thresholds they took a
# fifth of the suite's time. Objects alive once the tests are collected (modules, their functions
# and classes) are frozen out of those passes, and collections run less often. A test that needs
# an object gone calls gc.collect() itself.
gc.set_threshold(50_000, 20, 100)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def _guards(mp: pytest.MonkeyPatch, calibration_file):
    """Each compile starts from scratch (Dynamo caches per code object across tests), every graph
    is checked against the invariants after each pass, and plans do not depend on
    performance-model fits a GPU run left in this machine's cache."""
    from apollo_compile import pipeline
    from apollo_compile.perf import calibration

    mp.setattr(pipeline, "VERIFY", True)
    mp.setenv("APOLLO_CALIBRATION_FILE", str(calibration_file))
    calibration.reset()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    calibration.reset()


@pytest.fixture(autouse=True)
def _guarded(monkeypatch, tmp_path):
    with _guards(monkeypatch, tmp_path / "calibration.json"):
        yield


@pytest.fixture(autouse=True)
def _no_plans_kept():
    """Each test's plans go when it ends: apollo keeps every plan of the process (their graphs,
    runtimes and compiled subgraphs), which only a test that compiled them reads."""
    yield
    import apollo_compile

    apollo_compile.clear_plans()


@pytest.fixture(scope="module")
def module_guards(tmp_path_factory):
    """The guards for a module-scoped fixture, which pytest sets up before the per-test ones: a
    model compiled once for several tests is compiled from scratch, verified after every pass, and
    planned without a calibration from disk."""
    with pytest.MonkeyPatch.context() as mp, _guards(mp, tmp_path_factory.mktemp("calibration") / "calibration.json"):
        yield
