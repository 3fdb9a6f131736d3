"""place_modalities: towers on their own devices, hooks at their boundaries.

A CPU machine has one device, so CI checks the API (validation, where parameters end up, hooks
traced by Dynamo and training like eager with the hooks in the graph) and the backend's choice for
a graph that spans two CUDA devices (fake tensors). The copies between GPUs and their gradients
are checked on two H200s (benchmarks/bench_distributed.py, the ``placed-*`` variants).
"""

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import apollo_compile
from apollo_compile import ApolloFallbackWarning, ApolloOptionsError, place_modalities
from apollo_compile.backend import cuda_devices, use_cudagraphs
from apollo_compile.options import ApolloOptions
from helpers import assert_trains_like_eager
from models import TwoTower, two_tower_inputs


def batches(step):
    return two_tower_inputs(batch=4, seed=step)


def test_placed_model_trains_like_eager():
    model = place_modalities(TwoTower(), {"vision": "cpu", "text": torch.device("cpu")})
    assert model.apollo_placement.devices == {"vision": torch.device("cpu"), "text": torch.device("cpu")}
    assert model.apollo_placement.output_device == torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        assert_trains_like_eager(model, batches, {"subgraph_compiler": "eager"}, steps=3)
    assert apollo_compile.last_plan().forward.fallback is None


def test_placing_again_replaces_the_hooks():
    model = place_modalities(TwoTower(), {"vision": "cpu", "text": "cpu"})
    first = model.apollo_placement
    assert len(first.handles) == 4
    place_modalities(model, {"vision": "cpu"})
    assert first.handles == [] and len(model.apollo_placement.handles) == 2
    assert len(model.vision._forward_pre_hooks) == 1 and not model.text._forward_pre_hooks


@pytest.mark.parametrize("devices, match", [
    ({"audio": "cpu"}, r"no submodule 'audio' \(its top-level submodules: 'vision', 'text'"),
    ({"vision": "cpu", "vision.blocks": "cpu"}, r"'vision.blocks' lies inside 'vision'"),
    ({"vision": "meta"}, r"device meta \(for 'vision'\) is not supported"),
    ({"vision": "gpu0"}, r"'gpu0' \(for 'vision'\) is not a device"),
    ({"vision": 1.5}, r"must be a str, int or torch.device, got float"),
    ({}, r"non-empty mapping"),
    ({1: "cpu"}, r"paths must be str"),
])
def test_bad_placements_are_named(devices, match):
    with pytest.raises(ApolloOptionsError, match=match):
        place_modalities(TwoTower(), devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a torch without CUDA")
def test_cuda_placement_without_cuda_is_an_error():
    with pytest.raises(ApolloOptionsError, match=r"cuda:1 \(for 'vision'\) needs CUDA"):
        place_modalities(TwoTower(), {"vision": "cuda:1"})


def test_not_a_module_is_an_error():
    with pytest.raises(ApolloOptionsError, match="expects an nn.Module, got dict"):
        place_modalities({}, {"vision": "cpu"})


def test_a_graph_on_two_gpus_runs_ungraphed():
    with FakeTensorMode():
        on_0, on_1 = torch.empty(2, device="cuda:0"), torch.empty(2, device="cuda:1")
    assert cuda_devices([on_0, on_1, on_0, 3]) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert use_cudagraphs(ApolloOptions.from_user({}), [on_0, on_0], "g")
    assert not use_cudagraphs(ApolloOptions.from_user({}), [on_0, on_1], "g")
    with pytest.warns(ApolloFallbackWarning, match=r"g runs without CUDA graphs because its graph spans cuda:0, cuda:1"):
        assert not use_cudagraphs(ApolloOptions.from_user({"cudagraphs": True}), [on_0, on_1], "g")
