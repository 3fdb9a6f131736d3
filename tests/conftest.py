import gc
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

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


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: Dynamo caches per code object across tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _no_plans_kept():
    """Each test's plans go when it ends: apollo keeps every plan of the process (their graphs,
    runtimes and compiled subgraphs), which only a test that compiled them reads."""
    yield
    import apollo_compile

    apollo_compile.clear_plans()


@pytest.fixture(autouse=True)
def _verify_every_pass(monkeypatch):
    """Every graph compiled in the tests is checked against the invariants after each pass."""
    from apollo_compile import pipeline

    monkeypatch.setattr(pipeline, "VERIFY", True)


@pytest.fixture(autouse=True)
def _no_calibration_from_disk(monkeypatch, tmp_path):
    """Plans must not depend on performance-model fits a GPU run left in this machine's cache."""
    from apollo_compile.perf import calibration

    monkeypatch.setenv("APOLLO_CALIBRATION_FILE", str(tmp_path / "calibration.json"))
    calibration.reset()
    yield
    calibration.reset()


@pytest.fixture(scope="module")
def module_guards(tmp_path_factory):
    """The guards above for a module-scoped fixture, which pytest sets up before them: a model
    compiled once for several tests is compiled from scratch, verified after every pass, and
    planned without a calibration from disk."""
    from apollo_compile import pipeline
    from apollo_compile.perf import calibration

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "VERIFY", True)
        mp.setenv("APOLLO_CALIBRATION_FILE", str(tmp_path_factory.mktemp("calibration") / "calibration.json"))
        calibration.reset()
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()
        calibration.reset()
