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
