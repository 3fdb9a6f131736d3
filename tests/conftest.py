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


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: Dynamo caches per code object across tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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
