"""fused_update.py's Triton kernel against torch's fused Adam kernel, on a GPU (skipped without one:
CI has none; run it on the device machine with ``python -m pytest -q tests/test_fused_update_gpu.py``).

Tolerances: both compute in float32 from the same inputs; the bias corrections differ in rounding
(Triton's ``exp(step * log(beta))`` against ``pow(beta, step)``: ~1e-7 relative), so fp32
parameters agree to ~1e-6 relative after three steps, checked at rtol 1e-5; a bf16 parameter is
stored rounded, where one rounding apart is 2^-8 relative, checked at rtol 1e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("shape", [(), (7,), (768, 3072), (5, 1031)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoupled,amsgrad,maximize,weight_decay",
                         [(True, False, False, 0.01), (False, True, True, 0.05), (True, True, False, 0.0)])
def test_the_triton_update_is_torchs_fused_update(shape, dtype, decoupled, amsgrad, maximize, weight_decay):
    from apollo_compile.ops.fused_update import AdamMoments, adam_step

    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(shape, device="cuda", generator=g).to(dtype)
    state = {k: torch.zeros_like(p) for k in ("m", "v", "vmax")}
    ref_p, ref_state = p.clone(), copy.deepcopy(state)
    moments = AdamMoments("test-triton", [state["m"]], [state["v"]], [state["vmax"]] if amsgrad else None)
    step, ref_step = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    lr = torch.tensor(1e-2, device="cuda")
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    for _ in range(3):
        grad = torch.randn(shape, device="cuda", generator=g).to(dtype)
        step += 1
        ref_step += 1
        adam_step(p, grad, moments.name, 0, step, lr, 0.9, 0.999, weight_decay, 1e-8, maximize, decoupled)
        kernel([ref_p], [grad], [ref_state["m"]], [ref_state["v"]], [ref_state["vmax"]] if amsgrad else [],
               [ref_step], lr=lr, beta1=0.9, beta2=0.999, weight_decay=weight_decay, eps=1e-8, amsgrad=amsgrad,
               maximize=maximize)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(p, ref_p, **tol)
    for key in ("m", "v") + (("vmax",) if amsgrad else ()):
        torch.testing.assert_close(state[key], ref_state[key], **tol)


@pytest.mark.parametrize("shape", [(768, 3072), (5, 1031)])
def test_the_triton_update_reads_a_bf16_gradient_as_its_float32_copy(shape):
    """passes/gradients.py, NOTE: The update reads the gradient as it was computed: a float32
    parameter's update from a bf16 gradient is its update from that gradient cast to float32."""
    from apollo_compile.ops.fused_update import AdamMoments, adam_step

    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(shape, device="cuda", generator=g)
    state = {k: torch.zeros_like(p) for k in ("m", "v")}
    ref_p, ref_state = p.clone(), copy.deepcopy(state)
    moments = AdamMoments("test-bf16-grad", [state["m"], ref_state["m"]], [state["v"], ref_state["v"]])
    step, lr = torch.zeros((), device="cuda"), torch.tensor(1e-2, device="cuda")
    for _ in range(3):
        grad = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
        step += 1
        adam_step(p, grad, moments.name, 0, step, lr, 0.9, 0.999, 0.01, 1e-8, False, True)
        adam_step(ref_p, grad.float(), moments.name, 1, step, lr, 0.9, 0.999, 0.01, 1e-8, False, True)
    torch.testing.assert_close(p, ref_p, rtol=0, atol=0)
    for key in ("m", "v"):
        torch.testing.assert_close(state[key], ref_state[key], rtol=0, atol=0)


@pytest.mark.parametrize("options", [{}, {"subgraph_compiler": "eager"}, {"max_lanes": 1},
                                     {"optimizer_update": "inductor"}])
@pytest.mark.parametrize("lists", [False, True])
def test_the_step_with_the_update_inside_trains_like_eager_on_the_gpu(options, lists, monkeypatch):
    """compile_step with AdamW inside, on CUDA (one CUDA graph; the Triton update, or the formula), against eager
    AdamW(fused=True): loss and every parameter after each of four steps (tolerances as
    tests/test_optimizer_step.py: eps=1e-4). With `lists`, the small parameters' updates share an
    adam_step_foreach per tower on CUDA too (fused_update.py, NOTE: Small parameters share a launch;
    FOREACH_NUMEL 512 leaves the test model's weights to the Triton kernel)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import apollo_compile
    from apollo_compile.ops import fused_update
    from models import TwoTower, two_tower_inputs

    if lists:
        monkeypatch.setattr(fused_update, "FOREACH_DEVICES", frozenset({"cpu", "cuda"}))
        monkeypatch.setattr(fused_update, "FOREACH_NUMEL", 512)

    def step(images, tokens):  # test_whole_step.backward_step (whose module needs expecttest)
        loss = model(images, tokens)
        loss.backward()
        return loss.detach()

    torch.manual_seed(0)
    model = TwoTower(layers=2).cuda()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.05, fused=True)
                    for m in (model, ref))
    torch._dynamo.reset()
    compiled = apollo_compile.compile_step(step, optimizer=opt, options=options)
    for i in range(4):
        inputs = [x.cuda() for x in two_tower_inputs(seed=i)]
        loss = compiled(*inputs)
        ref_loss = ref(*inputs)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=5e-5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=5e-5, msg=lambda m: f"step {i} param {name}: {m}")
    assert compiled.fallback_reason is None


@pytest.mark.parametrize("options", [{}, {"subgraph_compiler": "eager"}])
def test_under_bf16_autocast_the_weights_gradients_leave_their_matmuls_in_float32(options, monkeypatch):
    """passes/gradients.py, NOTE: A weight's gradient leaves its matmul in float32, on CUDA (its
    default there), with the update lists inside the step: each linear weight's gradient is an
    aten::mm.dtype node (cuBLAS writing float32), lowered by Inductor or run as the ATen op, and the
    step trains as the same step with bf16 matmuls and float32 casts. Tolerances as the CPU twin in
    tests/test_optimizer_step.py says: after the first step every parameter within lr * 2**-8 =
    3.9e-5 of the casts' (only the weights' gradients differ, by bf16's rounding of the matmul's
    output); then bf16's noise takes over and the losses stay within 1e-2. The first loss is
    eager's within 1e-2 (Inductor's bf16 rounding differs from eager's)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import apollo_compile
    from apollo_compile.passes import gradients
    from models import TwoTower, two_tower_inputs

    def step_of(m):
        def step(images, tokens):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(images, tokens)
            loss.backward()
            return loss.detach()

        return step

    def trained(wide: bool):
        monkeypatch.setattr(gradients, "WIDE_MATMUL_DEVICES", frozenset({"cuda"} if wide else ()))
        torch.manual_seed(0)
        model = TwoTower(layers=2).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.05, fused=True)
        torch._dynamo.reset()
        apollo_compile.clear_plans()
        compiled = apollo_compile.compile_step(step_of(model), optimizer=opt, options=options)
        losses = [compiled(*[x.cuda() for x in two_tower_inputs(seed=0)])]
        after_one = [p.detach().clone() for p in model.parameters()]
        losses += [compiled(*[x.cuda() for x in two_tower_inputs(seed=i)]) for i in (1, 2)]
        assert compiled.fallback_reason is None
        gm = apollo_compile.last_plan().inference.gm
        return model, after_one, torch.stack(losses), sum(n.target is torch.ops.aten.mm.dtype for n in gm.graph.nodes)

    model, params, losses, wide = trained(True)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert wide == linears, (wide, linears)
    _, ref_params, ref_losses, narrow = trained(False)
    assert narrow == 0
    for (name, _), p, q in zip(model.named_parameters(), params, ref_params):
        torch.testing.assert_close(p, q, rtol=0, atol=4e-5, msg=lambda m: f"param {name}: {m}")
    torch.testing.assert_close(losses, ref_losses, rtol=1e-2, atol=0)
    torch.manual_seed(0)
    eager = TwoTower(layers=2).cuda()
    torch.testing.assert_close(losses[0], step_of(eager)(*[x.cuda() for x in two_tower_inputs(seed=0)]),
                               rtol=1e-2, atol=0)


def test_on_the_module_path_the_backward_returns_float32_weight_gradients_from_their_matmuls(monkeypatch):
    """The same rewrite in a module-compiled model's backward graph (torch.compile(model,
    backend="apollo"), CUDA graphs, Inductor subgraphs), against the same model with the casts: each
    linear weight's .grad within bf16's rounding of the matmul output (2**-8 relative), every other
    gradient as the casts' (Inductor compiles the rest of both backward graphs alike; 1e-4)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import apollo_compile
    from apollo_compile.passes import gradients
    from models import TwoTower, two_tower_inputs

    def grads(wide: bool):
        monkeypatch.setattr(gradients, "WIDE_MATMUL_DEVICES", frozenset({"cuda"} if wide else ()))
        torch.manual_seed(0)
        model = TwoTower(layers=2).cuda()
        torch._dynamo.reset()
        apollo_compile.clear_plans()
        compiled = torch.compile(model, backend="apollo")
        for i in range(3):  # warm-up, capture, replay
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(*[x.cuda() for x in two_tower_inputs(seed=0)])
            loss.backward()
        backward = apollo_compile.last_plan().backward
        assert backward.fallback is None
        wide_nodes = sum(n.target is torch.ops.aten.mm.dtype for n in backward.gm.graph.nodes)
        return model, {n: p.grad.clone() for n, p in model.named_parameters()}, wide_nodes

    model, wide, count = grads(True)
    _, narrow, none = grads(False)
    linear = {n + ".weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert count == len(linear) and none == 0
    for name, g in wide.items():
        tol = dict(rtol=2**-8, atol=1e-6) if name in linear else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g, narrow[name], **tol, msg=lambda m: f"{name}: {m}")
