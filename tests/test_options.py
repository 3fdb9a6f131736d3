"""Every bad option is a ValueError naming the key and the valid choices, raised before tracing."""

import pytest
import torch

from apollo_compile import ApolloOptions, ApolloOptionsError


@pytest.mark.parametrize(
    "options, match",
    [
        ({"dumpdir": "x"}, r"unknown option 'dumpdir'; valid options: dump_dir, modalities"),
        ({"subgraph_compiler": "tvm"}, r"'subgraph_compiler'='tvm' is invalid; expected one of inductor, eager"),
        ({"max_lanes": 0}, r"'max_lanes'=0 is invalid; expected an int >= 1"),
        ({"max_lanes": "2"}, r"'max_lanes'='2' is invalid"),
        ({"max_lanes": True}, r"'max_lanes'=True is invalid"),
        ({"optimizer_update": "triton"}, r"'optimizer_update'='triton' is invalid; expected one of 'kernel', 'inductor'"),
        ({"cudagraphs": "yes"}, r"'cudagraphs'='yes' is invalid; expected 'auto', True or False"),
        ({"strict": 1}, r"'strict'=1 is invalid; expected True or False"),
        ({"device": "TPU"}, r"'device'='TPU' is invalid; expected one of H200, H100, A100, cpu"),
        ({"modalities": {"vision": 3}}, r"'modalities'=.* is invalid; expected a dict of module-path prefix"),
        ({"modalities": ["vision"]}, r"'modalities'=.* is invalid"),
        ({"dump_dir": 5}, r"'dump_dir'=5 is invalid"),
    ],
)
def test_invalid_options(options, match):
    with pytest.raises(ValueError, match=match):
        ApolloOptions.from_user(options)


def test_options_not_a_dict():
    with pytest.raises(ValueError, match="options must be a dict"):
        ApolloOptions.from_user(["dump_dir"])


@pytest.mark.parametrize("mode", ["max-autotune", "max-autotune-no-cudagraphs", "fast"])
def test_unsupported_modes(mode):
    with pytest.raises(ValueError, match=rf"mode='{mode}' is not supported; valid modes: 'default', 'reduce-overhead'"):
        ApolloOptions.from_user(None, mode)


def test_defaults_and_frozen():
    opts = ApolloOptions.from_user({"max_lanes": 2, "modalities": {"a": "b"}})
    assert opts.max_lanes == 2 and opts.subgraph_compiler == "inductor" and opts.cudagraphs == "auto"
    with pytest.raises(Exception):
        opts.max_lanes = 3  # frozen


def test_dump_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("APOLLO_DUMP_DIR", str(tmp_path))
    assert ApolloOptions.from_user({}).dump_dir == str(tmp_path)
    assert ApolloOptions.from_user({"dump_dir": "elsewhere"}).dump_dir == "elsewhere"


def test_torch_compile_raises_value_error_before_tracing(monkeypatch):
    """Through torch.compile the error arrives as our ValueError, and nothing was traced."""
    import torch._functorch.aot_autograd as aot

    traced = []
    monkeypatch.setattr(aot, "aot_module_simplified", lambda *a, **k: traced.append(1))
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="apollo", options={"max_lane": 2})
    with pytest.raises(ValueError, match="unknown option 'max_lane'") as raised:
        compiled(torch.randn(2, 4))
    assert raised.type is ApolloOptionsError  # itself, not wrapped in Dynamo's BackendCompilerFailed
    assert traced == []
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="apollo", mode="max-autotune")
    with pytest.raises(ApolloOptionsError, match="mode='max-autotune'"):
        compiled(torch.randn(2, 4))


def test_unsupported_device_is_refused():
    compiled = torch.compile(torch.nn.Linear(4, 4, device="meta"), backend="apollo")
    with pytest.raises(ValueError, match="device 'meta' is not supported"):
        compiled(torch.randn(2, 4, device="meta"))
