import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


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
