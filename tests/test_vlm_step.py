"""A vision-language model's whole step as one graph, and what compile_step does where a step cannot be.

- Hugging Face LLaVA and PaliGemma (tiny, random weights: benchmarks/probes/hf_zoo.py's builders)
  with AdamW inside ``compile_step`` trace as one graph, with no fallback warning, and train like
  eager. Numerics as tests/test_hf_zoo.py states them: the loss and every parameter after 3 AdamW
  steps within rtol 1e-4 / atol 1e-5 per element of eager's for-loop AdamW (an element whose
  eager gradient was only rounding noise: within 2 lr per step), or within twice torch's own fused
  AdamW's distance from it (PASS*).
- The stand-in for ``torch._check_tensor_all`` (step/stand_ins.py) is in place only during a whole
  step's call, keeps the check (on the device), and leaves torch's function to everything else.
- On the module path the optimizer's eager step uses torch's list kernels where they exist
  (step/eager_update.py); this machine has none, so the tests name the CPU as such a device.
- The fallback warning names where the step broke.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import apollo_compile
from apollo_compile import ApolloFallbackWarning
from apollo_compile.step import eager_update, stand_ins
from helpers import one_layer_hf_zoo

EAGER = {"subgraph_compiler": "eager"}


def _hf_zoo():
    transformers = pytest.importorskip("transformers")
    import hf_zoo

    return transformers, hf_zoo


@pytest.mark.parametrize("name", ["llava", "paligemma"])
def test_a_vision_language_step_with_adamw_is_one_graph_and_trains_like_eager(name, monkeypatch):
    """LLaVA's first call installs HF's output-capturing hooks under a lock and runs on the module
    path; its second and third are one graph (whole_step.py, NOTE: Code only a first call runs).
    PaliGemma is one graph from its first call. On torch 2.11 both need the check's stand-in. One
    layer a tower (helpers.one_layer_hf_zoo)."""
    transformers, hf_zoo = _hf_zoo()
    one_layer_hf_zoo(monkeypatch, hf_zoo)
    if not hasattr(transformers, hf_zoo.MODEL_CLASSES[name]):
        pytest.skip(f"transformers {transformers.__version__} has no {hf_zoo.MODEL_CLASSES[name]}")
    out = hf_zoo.run_one(name, "apollo", "step-opt", steps=3, options=EAGER, rtol=1e-4, atol=1e-5)
    assert out.status in ("PASS", "PASS*"), (out.status, out.worst_grad, out.grad_err, out.fused_err, out.error)
    assert not out.warnings, out.warnings  # no "does not trace as one graph", nor any other
    assert out.graphs[-1].endswith("[i:1]"), out.graphs  # the last calls' graph: forward, backward and update
    if name == "paligemma":
        assert out.graphs == ["frame0_0[i:1]"], out.graphs


class PlaceholderScatter(nn.Module):
    """Image features scattered into the text's placeholder positions after HF's count check, as
    LLaVA does: ``torch._check_tensor_all(count * width == features.numel())``, then
    ``masked_scatter``."""

    def __init__(self):
        super().__init__()
        self.vision, self.text, self.head = nn.Linear(6, 4), nn.Embedding(10, 4), nn.Linear(4, 1)

    def forward(self, pixels, ids):
        features = self.vision(pixels)
        embeds = self.text(ids)
        mask = ids == 9
        torch._check_tensor_all(mask.sum() * embeds.shape[-1] == features.numel())
        embeds = embeds.masked_scatter(mask.unsqueeze(-1), features)
        return self.head(embeds).square().mean()


def _placeholder_inputs(seed, images=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 9, (2, 5), generator=g)
    ids[0, :images] = 9
    return torch.randn(images, 6, generator=g), ids


def test_the_checks_stand_in_is_traced_kept_and_put_back():
    """With the stand-in the step is one graph and trains like eager; the check still raises on
    inputs whose counts disagree; torch's own function is back after every call."""
    own = torch._check_tensor_all
    torch.manual_seed(0)
    model = PlaceholderScatter()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    def step(pixels, ids):
        loss = model(pixels, ids)
        loss.backward()
        return loss.detach()

    with pytest.warns(ApolloFallbackWarning, match="SGD's update"):  # it runs after the graph, said once
        compiled = apollo_compile.compile_step(step, optimizer=opt, options=EAGER)
    assert set(compiled.stand_ins) == set(stand_ins.STAND_INS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApolloFallbackWarning)
        for i in range(3):
            loss = compiled(*_placeholder_inputs(i))
            assert torch._check_tensor_all is own
            ref_loss = ref(*_placeholder_inputs(i))
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert compiled.fallback_reason is None and compiled.first_call_reason is None
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    pixels, ids = _placeholder_inputs(7)
    ids[1, 0] = 9  # three placeholders, two images' features
    with pytest.raises(RuntimeError):
        compiled(pixels, ids)
    assert torch._check_tensor_all is own


def test_the_stand_ins_are_put_back_where_the_body_raises():
    own = {name: getattr(torch, name) for name in stand_ins.STAND_INS}
    chosen = dict(stand_ins.STAND_INS)
    with pytest.raises(ValueError):
        with stand_ins.whole_step_stand_ins(chosen):
            assert torch._check_tensor_all is stand_ins.check_tensor_all
            raise ValueError
    assert {name: getattr(torch, name) for name in stand_ins.STAND_INS} == own


def test_a_stand_in_is_set_on_every_torch():
    """Where Dynamo has a handler of its own (torch 2.13) it reads the check on the host, which a
    CUDA graph cannot capture: the device-side stand-in is set there too."""
    assert set(stand_ins.needed()) == set(stand_ins.STAND_INS)


def test_the_check_stand_in_raises_eagerly_as_torch_does():
    stand_ins.check_tensor_all(torch.tensor([True, True]))
    with pytest.raises(RuntimeError):
        stand_ins.check_tensor_all(torch.tensor([True, False]))
    with pytest.raises(TypeError):
        stand_ins.check_tensor_all(torch.tensor([1, 1]))


# --- the optimizer's eager step on the module path ---------------------------------------------

@pytest.fixture
def cpu_has_list_kernels(monkeypatch):
    """The CPU named a device with list kernels (CUDA's role; this machine has no CUDA)."""
    monkeypatch.setattr(eager_update, "list_kernel_devices", lambda: {"cpu"})


def _params():
    return [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(2))]


def test_without_list_kernels_the_eager_step_is_the_users():
    """On the CPU torch has no foreach kernels: every group keeps its own settings."""
    opt = torch.optim.SGD(_params(), lr=0.1, foreach=False)
    assert eager_update.settings(opt, in_graph_update=False) == [{}]


def test_which_groups_step_with_list_kernels(cpu_has_list_kernels):
    assert eager_update.settings(torch.optim.SGD(_params(), lr=0.1, foreach=False), False) == [{"foreach": True}]
    assert eager_update.settings(torch.optim.SGD(_params(), lr=0.1), False) == [{"foreach": True}]  # None
    assert eager_update.settings(torch.optim.RMSprop(_params(), lr=0.1), False) == [{"foreach": True}]
    # Adam whose update apollo traces: the graph's own kernel
    fused = [{"fused": True, "foreach": False}]
    assert eager_update.settings(torch.optim.AdamW(_params(), foreach=False), True) == fused
    assert eager_update.settings(torch.optim.AdamW(_params(), foreach=False), False) == [{"foreach": True}]
    capturable = torch.optim.AdamW(_params(), foreach=False, capturable=True)
    assert eager_update.settings(capturable, True) == [{"foreach": True}]
    # already fast, or not torch's to change
    assert eager_update.settings(torch.optim.SGD(_params(), lr=0.1, foreach=True), False) == [{}]
    assert eager_update.settings(torch.optim.Adam(_params(), fused=True), True) == [{}]
    assert eager_update.settings(torch.optim.Adam(_params(), differentiable=True), True) == [{}]
    assert eager_update.settings(torch.optim.LBFGS(_params()), False) == [{}]

    class MySGD(torch.optim.SGD):
        pass

    assert eager_update.settings(MySGD(_params(), lr=0.1, foreach=False), False) == [{}]
    # an Adam whose step counters do not lie on their parameters' device (on CUDA: a host tensor,
    # as a non-capturable Adam's own step makes them; here a checkpoint's Python number): foreach
    opt = torch.optim.Adam(_params())
    opt.state[opt.param_groups[0]["params"][0]]["step"] = 1.0
    assert eager_update.settings(opt, True) == [{"foreach": True}]


def test_the_groups_own_settings_are_back_after_the_step(cpu_has_list_kernels):
    opt = torch.optim.SGD(_params(), lr=0.1, foreach=False)
    del opt.param_groups[0]["fused"]  # a key the group lacks is removed again
    with pytest.raises(ValueError):
        with eager_update.list_kernels(opt, False) as chosen:
            assert chosen == [{"foreach": True}] and opt.param_groups[0]["foreach"] is True
            raise ValueError
    assert opt.param_groups[0]["foreach"] is False and "fused" not in opt.param_groups[0]


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).square().mean()


def _spy_step(opt):
    """Record each group's foreach / fused as ``opt.step()`` sees them."""
    seen, step = [], opt.step

    def spied(*args, **kwargs):
        seen.append([(g.get("foreach"), g.get("fused")) for g in opt.param_groups])
        return step(*args, **kwargs)

    opt.step = spied
    return seen


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_on_the_module_path_the_update_uses_list_kernels_and_trains_like_eager(kind, cpu_has_list_kernels):
    """A graph break in the step: the module path, the optimizer stepped eagerly after it with
    foreach (SGD: the loop's values exactly) or, for the AdamW whose update the graph would run,
    the fused kernel (within the for-loop's rounding: rtol 1e-4 / atol 5e-5, eps 1e-4 as in
    tests/test_optimizer_step.py); the user's settings are back after each call."""
    torch.manual_seed(0)
    model = _Two()
    ref = copy.deepcopy(model)
    if kind == "sgd":
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=False) for m in (model, ref))
        tol, want = dict(rtol=0, atol=0), (True, None)
    else:
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4, foreach=False) for m in (model, ref))
        tol, want = dict(rtol=1e-4, atol=5e-5), (False, True)
    seen = _spy_step(opt)

    def step(x):
        loss = model(x)
        torch._dynamo.graph_break()
        loss.backward()
        return loss.detach()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ApolloFallbackWarning)  # SGD's update outside, the graph break
        compiled = apollo_compile.compile_step(step, optimizer=opt, options=EAGER)
        for i in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
            compiled(x)
            ref(x).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    assert compiled.fallback_reason is not None
    assert seen == [[want]] * 3, seen
    assert opt.param_groups[0]["foreach"] is False and not opt.param_groups[0]["fused"]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **tol)


# --- the warning names the break ---------------------------------------------------------------

_LOCK = threading.Lock()


def _locked_forward(model, x):
    with _LOCK:  # on every call: Dynamo cannot enter a lock
        return model(x)


def test_the_fallback_warning_says_where_the_step_broke():
    torch.manual_seed(0)
    model = _Two()

    def step(x):
        loss = _locked_forward(model, x)
        loss.backward()
        return loss.detach()

    compiled = apollo_compile.compile_step(step, options=EAGER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(2):
            compiled(torch.randn(5, 4))
    mine = [str(w.message) for w in caught if issubclass(w.category, ApolloFallbackWarning)]
    assert len(mine) == 1, mine
    assert "Unsupported context manager" in mine[0]
    assert "tests/test_vlm_step.py:" in mine[0] and "in _locked_forward" in mine[0], mine[0]
