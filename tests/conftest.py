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
