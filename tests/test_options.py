"""Every bad option is a ValueError naming the key and the valid choices, raised before tracing;
an option that would not take effect where it is given is refused the same way."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apollo_compile import ApolloOptions, ApolloOptionsError, compile_step
from apollo_compile.options import MIN_BUDGET_BYTES, OPTION_PATHS


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


@pytest.mark.parametrize("budget", [5, 2, 1000, MIN_BUDGET_BYTES - 1])
def test_a_small_integer_budget_is_refused(budget):
    """An int memory_budget is bytes: under 1 MiB it is a fraction typed without its point."""
    with pytest.raises(ApolloOptionsError, match=rf"'memory_budget'={budget} is invalid: an int is a byte count, "
                                                 r"and .* pass a fraction as a float in \(0, 1\]"):
        ApolloOptions.from_user({"memory_budget": budget})


@pytest.mark.parametrize("budget", [1, 1.0, 0.5, MIN_BUDGET_BYTES, 2**30, {"vision": 0.3, "text": 1}])
def test_budgets_that_mean_what_they_say(budget):
    assert ApolloOptions.from_user({"memory_budget": budget}).memory_budget == budget


def test_every_option_says_where_it_applies():
    assert set(OPTION_PATHS) == {f.name for f in dataclasses.fields(ApolloOptions)}


@pytest.mark.parametrize("options, match", [
    ({"offload_activations": True}, r"option 'offload_activations' does not apply to compile_step: .* "
                                    r"torch.compile\(model, backend='apollo'"),
    ({"optimizer_update": "inductor"}, r"option 'optimizer_update' does not apply to compile_step: .* "
                                       r"only compile_step\(\.\.\., optimizer=\.\.\.\) puts the update there"),
])
def test_compile_step_refuses_what_it_would_ignore(options, match):
    """A whole step is one inference graph: the joint stage (offloading) never sees it."""
    with pytest.raises(ApolloOptionsError, match=match):
        compile_step(lambda x: x, options=options)


def test_compile_step_takes_a_memory_budget():
    """A whole step plans its recomputation in its own graph (passes/step_recompute.py)."""
    assert "step" in OPTION_PATHS["memory_budget"] and "step+optimizer" in OPTION_PATHS["memory_budget"]
    compile_step(lambda x: x, options={"memory_budget": 0.5})
    opt = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    compile_step(lambda x: x, optimizer=opt, options={"memory_budget": {"vision": 0.3}})


def test_compile_step_with_an_optimizer_refuses_module_path_options():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ApolloOptionsError, match=r"'offload_activations' does not apply to compile_step\(\.\.\., optimizer"):
        compile_step(lambda x: x, optimizer=opt, options={"offload_activations": True})
    compile_step(lambda x: x, optimizer=opt, options={"optimizer_update": "inductor"})  # its path: accepted


def test_the_error_is_the_last_line_a_script_prints(tmp_path):
    """Dynamo appends its hints to the message of what leaves a compiled frame; the option's
    error still prints as the last line, with apollo's frames, not Dynamo's, in the traceback."""
    script = tmp_path / "bad_option.py"
    script.write_text("import torch\nimport apollo_compile\n"
                      "model = torch.compile(torch.nn.Linear(4, 4), backend='apollo', options={'max_lane': 2})\n"
                      "model(torch.randn(2, 4))\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCHDYNAMO_VERBOSE", None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == ("apollo_compile.ApolloOptionsError: apollo: unknown option 'max_lane'; valid options: "
                         "dump_dir, modalities, device, subgraph_compiler, max_lanes, cudagraphs, strict, precision, "
                         "memory_budget, offload_activations, optimizer_update"), done.stderr
    assert "torch/_dynamo/output_graph.py" not in done.stderr  # Dynamo's frames are left out


def test_the_module_path_refuses_the_update_formula():
    """optimizer_update chooses the formula of compile_step's in-graph update: a compiled model has none."""
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="apollo", options={"optimizer_update": "inductor"})
    with pytest.raises(ApolloOptionsError, match=r"'optimizer_update' does not apply to torch.compile\(\.\.\., "
                                                 r"backend='apollo'\): .* only compile_step\(\.\.\., optimizer=\.\.\.\)"):
        compiled(torch.randn(2, 4))
