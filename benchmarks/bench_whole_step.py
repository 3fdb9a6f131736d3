"""The user's whole training step on Hugging Face and timm two-tower models: apollo against
Inductor's reduce-overhead, the loss read every step.

The README's first table (issue 24) is this measurement. Models, with random weights from their
configurations (nothing is downloaded; the step's cost does not depend on the values):

    hf-clip        transformers CLIPModel, ViT-B/16 at 224 px + CLIP's 12-layer text tower (77
                   tokens), its contrastive loss (``return_loss=True``)
    hf-siglip      transformers SiglipModel, base: ViT-B/16 at 224 px + a 12-layer text tower (64
                   tokens), its sigmoid loss
    timm-vit-bert  timm ``vit_base_patch16_224`` (no head) + transformers BertModel base (64 tokens,
                   the [CLS] feature; dropout off), bias-free projections to 512, CLIP's contrastive loss
    hf-llava       transformers LlavaForConditionalGeneration: a CLIP ViT-B/16 vision tower at 224 px
                   (196 image tokens), its projector, an 8-layer Llama of width 1024 (vocabulary
                   32000); 196 image tokens + 64 text tokens, the language-modelling loss on them
                   (issue 24: Inductor reduce-overhead fails on it, so compare eager, inductor, apollo)
    <model>-tiny   the same classes, 2 layers of width 32 at 32 px and 16 tokens, for CPU runs

Each is compiled as the module it is (``torch.compile(model, ...)``) or, in the *-step variants,
as the whole step: apollo finds the towers from the dataflow (pixels and tokens reach their own
matmuls) and names them by module path (``vision_model`` / ``text_model``; ``vision`` / ``text``).

Variants, side by side in ONE process (common.py's method; DESIGN.md: times drift between runs):

    eager          the module as is
    inductor       torch.compile(model): Inductor's default mode, no CUDA graphs
    inductor-ro    torch.compile(model, mode="reduce-overhead")
    apollo         torch.compile(model, backend="apollo", options=--apollo-options)
    apollo-bw-measured  the same with the backward's candidates timed at its capture too, as before
                   session 28 (``ChooseFastest(follow_forward=False)``; runtime/choice.py, NOTE: A
                   donating backward follows its forward): what that measuring costs in memory
    apollo-step    apollo_compile.compile_step(step): the forward, its loss and ``loss.backward()``
                   in one compiled function (one graph where this torch's Dynamo traces the backward;
                   else the module path, with the ApolloFallbackWarning the row records); the
                   optimizer stays outside it
    apollo-step-opt  the same with the optimizer's update inside the graph
                   (``compile_step(step, optimizer=opt)``): the loop calls no ``optimizer.step()``;
                   every parameter in its tower's list (torch's multi-tensor kernel), each list cut
                   into parts run as their gradients complete (``fused_update.py``, NOTE: Small
                   parameters share a launch; ``passes/update_lists.py``)
    apollo-step-opt-inductor  the same with the update as Adam's formula for Inductor to fuse
                   (option ``optimizer_update="inductor"``: a faster graph, a longer compile)
    apollo-step-opt-uncut  apollo-step-opt with each tower's list whole, after its backward
                   (``update_lists.LAUNCH_CHUNKS`` and ``LAUNCH_TENSORS`` unbounded; session 36's layout)
    apollo-step-opt-cut-by-chunks  apollo-step-opt with parts bounded by 320 chunks alone, not 36
                   tensors too (``update_lists.LAUNCH_TENSORS`` unbounded): about the cut to session
                   42, by elements, whose parts took two launches each
    apollo-step-opt-lists-small  apollo-step-opt with only the small parameters (<= 65536 elements)
                   in lists, a Triton op per larger weight (``fused_update.FOREACH_NUMEL = 65536``)
    apollo-step-opt-per-param  apollo-step-opt with an update op for every parameter (a Triton
                   kernel each on CUDA: ``fused_update.FOREACH_NUMEL = 0``; session 35's layout)
    apollo-step-opt-narrow  apollo-step-opt with the weights' gradients made by bf16 matmuls and
                   cast to float32 for the lists (``passes.gradients.WIDE_MATMUL_DEVICES`` empty;
                   the layout before session 38)
    apollo-step-opt-masks-as-traced  apollo-step-opt with attention masks left as the model traced
                   them (no ``passes/attention_masks.py``: a broadcast mask sends SDPA to its float32
                   math path; the tree before session 41)
    apollo-no-first-step-pool  apollo with its first, un-graphed step in the default memory pool,
                   not in one of its own (``runtime.graph_pool.FIRST_STEP_POOL`` empty; the default
                   before session 48: NOTE: The first step in a pool of its own)
    apollo-step-opt-first-step-pool  apollo-step-opt with its first step in a pool of its own
                   ("inference" added to ``FIRST_STEP_POOL``; off by default, no memory effect measured)
    apollo-1lane   apollo with ``max_lanes=1``: every graph on one stream (what lanes cost in memory)
    apollo-side-grads-own, apollo-main-allocated  apollo with ``passes.main_allocated.ENABLED``
                   off (a backward's side lane allocates its own gradients) or on (its last gradients
                   in memory the main lane freed, session 52; on by default since session 53)
    inductor-ro-regional, apollo-regional  regional compilation: every block of a list of blocks
                   of one class compiled on its own (``compile_regions``, as accelerate's), the
                   rest eager; one compiled graph serves every block (runtime/instances.py)

A step is what a training loop runs: ``optimizer.zero_grad(set_to_none=True)``, the forward and
its loss under bf16 autocast (``--no-amp``: fp32), ``backward()``, a fused AdamW step (CUDA; the
plain one on the CPU), and ``loss.item()``, which waits for the step: a loop that logs its loss
every step runs this way. The optimizer runs with ``--lr 0`` by default: the fused kernel does
the same work at any learning rate, and the weights stay the reference's, so the numerics check
after the timed steps compares with eager at the same weights.

Per model and batch size: ``--warmup`` steps (compile, CUDA-graph capture; "compile s"), then
``--steps`` steps, each from an idle GPU (``common.time_steps``): median, p10, p90; then the same
steps queued back to back without reading the loss (``common.time_back_to_back``: "b2b ms").
Memory: the peak allocated and reserved over the whole variant, from the model's copy to the
device through compile, capture and the timed steps (a CUDA graph's pool is allocated while it is
captured, so this is what training needs), less what was still allocated / reserved when the
variant started (what earlier variants left: ``common.left_over``, in the log and JSON); the
timed steps' own peak ("steps' peak"); and what the allocator holds between steps, pool by pool
(``common.memory_held``, in the log and JSON). Numerics as bench_step.py's: one step on another
batch against eager, PASS / PASS* by ``common.compare``.

    PYTHONPATH=. python benchmarks/bench_whole_step.py --models hf-clip --batch 8 32
    python benchmarks/bench_whole_step.py --device cpu --models hf-clip-tiny --batch 2 --steps 2 --warmup 1 \\
        --apollo-options '{"subgraph_compiler": "eager"}'
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # common.py
sys.path.insert(1, str(HERE.parent))  # the repo root, for apollo_compile

import common  # noqa: E402  (the method every benchmark here shares)
from common import fmt, log  # noqa: E402

VARIANTS = ("eager", "inductor", "inductor-ro", "inductor-ro-step", "apollo", "apollo-bw-measured", "apollo-step",
            "apollo-step-1lane", "apollo-step-opt", "apollo-step-opt-inductor", "apollo-step-opt-uncut",
            "apollo-step-opt-lists-small", "apollo-step-opt-per-param", "apollo-step-opt-narrow",
            "apollo-step-opt-masks-as-traced", "apollo-no-first-step-pool", "apollo-step-opt-first-step-pool",
            "apollo-step-opt-cut-by-chunks", "inductor-ro-regional", "apollo-regional", "apollo-1lane",
            "apollo-side-grads-own", "apollo-main-allocated")
BASELINE = "inductor-ro"
MODELS = ("hf-clip", "hf-siglip", "timm-vit-bert", "hf-llava")


# --------------------------------------------------------------------------------------------
# models


def _tower(tiny: bool, **base: Any) -> dict:
    """A tower's config: `base` for the full size, 2 layers of width 32 for "-tiny"."""
    if not tiny:
        return base
    return {**base, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


class TimmBert(nn.Module):
    """timm's ViT-B/16 and BERT base as the two towers of a CLIP-style model: [CLS] features,
    bias-free projections, L2 normalisation and CLIP's symmetric contrastive loss."""

    def __init__(self, tiny: bool) -> None:
        import timm
        from transformers import BertConfig, BertModel

        super().__init__()
        if tiny:
            from timm.models.vision_transformer import VisionTransformer

            self.vision = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                            num_classes=0)
        else:
            self.vision = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0)
        # Dropout off (BERT's default is 0.1): compiled code draws other random masks than eager
        # does, so with it on no compiler's loss could match eager's (every timm row FAILed on the
        # loss to session 41). CLIP's and SigLIP's configs have no dropout by default either.
        cfg = BertConfig(**_tower(tiny, vocab_size=128 if tiny else 30522,
                                  max_position_embeddings=16 if tiny else 512),
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.text = BertModel(cfg, add_pooling_layer=False)
        embed = 16 if tiny else 512
        self.vision_proj = nn.Linear(self.vision.num_features, embed, bias=False)
        self.text_proj = nn.Linear(cfg.hidden_size, embed, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(2.6593))  # log(1 / 0.07)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        image = F.normalize(self.vision_proj(self.vision(pixel_values)), dim=-1)
        text = F.normalize(self.text_proj(self.text(input_ids=input_ids).last_hidden_state[:, 0]), dim=-1)
        logits = self.logit_scale.exp().clamp(max=100.0) * image @ text.t()
        labels = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def build(name: str, seed: int = 0) -> tuple[nn.Module, dict]:
    """(model on the CPU in fp32, its inputs' shape: image size, tokens, vocabulary, EOT id)."""
    base, tiny = name.removesuffix("-tiny"), name.endswith("-tiny")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if base == "hf-clip":
            from transformers import CLIPConfig, CLIPModel

            vocab, tokens = (128, 16) if tiny else (49408, 77)
            text = _tower(tiny, vocab_size=vocab, max_position_embeddings=tokens, bos_token_id=vocab - 2,
                          eos_token_id=vocab - 1, pad_token_id=0)
            vision = _tower(tiny, image_size=32, patch_size=8) if tiny else {"image_size": 224, "patch_size": 16}
            model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16 if tiny else 512))
            image = vision["image_size"]
        elif base == "hf-siglip":
            from transformers import SiglipConfig, SiglipModel

            vocab, tokens = (128, 16) if tiny else (32000, 64)
            text = _tower(tiny, vocab_size=vocab, max_position_embeddings=tokens, bos_token_id=vocab - 2,
                          eos_token_id=vocab - 1, pad_token_id=0)
            vision = _tower(tiny, image_size=32, patch_size=8) if tiny else {"image_size": 224, "patch_size": 16}
            model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision))
            image = vision["image_size"]
        elif base == "timm-vit-bert":
            model = TimmBert(tiny)
            vocab, tokens, image = (128, 16, 32) if tiny else (30522, 64, 224)
        elif base == "hf-llava":
            model, shape = _llava(tiny)
            return model, shape
        else:
            raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)} (each also -tiny)")
    return model, {"image": image, "tokens": tokens, "vocab": vocab}


def _llava(tiny: bool) -> tuple[nn.Module, dict]:
    """LLaVA with random weights (module docstring); its image tokens are the vocabulary's last id."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vocab, image, patch = (128, 32, 8) if tiny else (32000, 224, 16)
    vision = CLIPVisionConfig(**_tower(tiny, image_size=image, patch_size=patch))
    width = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4} if tiny \
        else {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16}
    text = LlamaConfig(vocab_size=vocab, max_position_embeddings=512, num_key_value_heads=width["num_attention_heads"],
                       **width)
    image_tokens = (image // patch) ** 2  # the "default" feature strategy drops the CLS token
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                      image_token_index=vocab - 1, image_seq_length=image_tokens))
    text_tokens = 16 if tiny else 64
    return model, {"image": image, "tokens": image_tokens + text_tokens, "vocab": vocab, "image_tokens": image_tokens}


def make_batch(shape: dict, batch: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, input_ids), drawn on the CPU from `seed`: standard-normal images, random token
    ids ending in the EOT id (the vocabulary's last)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, shape["image"], shape["image"], generator=g)
    ids = torch.randint(1, shape["vocab"] - 2, (batch, shape["tokens"]), generator=g)
    if "image_tokens" in shape:  # LLaVA: the image's tokens after the first, where its features go
        ids[:, 1:1 + shape["image_tokens"]] = shape["vocab"] - 1
    else:
        ids[:, -1] = shape["vocab"] - 1
    return pixels.to(device), ids.to(device)


def loss_fn(name: str, step_fn: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(pixel_values, input_ids) -> the loss, through `step_fn` (the model, compiled or not)."""
    if name.startswith("hf-llava"):
        return lambda pixels, ids: step_fn(input_ids=ids, pixel_values=pixels, labels=ids).loss
    if name.startswith("hf-"):
        return lambda pixels, ids: step_fn(input_ids=ids, pixel_values=pixels, return_loss=True).loss
    return step_fn


STEP_VARIANTS = ("inductor-ro-step", "apollo-step", "apollo-step-1lane", "apollo-step-opt", "apollo-step-opt-inductor",
                 "apollo-step-opt-uncut", "apollo-step-opt-lists-small", "apollo-step-opt-per-param",
                 "apollo-step-opt-narrow", "apollo-step-opt-masks-as-traced", "apollo-step-opt-first-step-pool",
                 "apollo-step-opt-cut-by-chunks")
# how the update and its gradients are laid out (fused_update.py, NOTE: Small parameters share a launch;
# passes/gradients.py, NOTE: A weight's gradient leaves its matmul in float32), or which passes run, per variant:
# "module.NAME" of apollo_compile -> the value it has while the variant's step is traced
UPDATE_LAYOUT = {"apollo-step-opt-uncut": {"passes.update_lists.LAUNCH_CHUNKS": sys.maxsize,
                                           "passes.update_lists.LAUNCH_TENSORS": dict.fromkeys(range(1, 6), sys.maxsize)},
                 "apollo-step-opt-cut-by-chunks": {"passes.update_lists.LAUNCH_TENSORS": dict.fromkeys(range(1, 6),
                                                                                                     sys.maxsize)},
                 "apollo-step-opt-lists-small": {"fused_update.FOREACH_NUMEL": 65536},
                 "apollo-step-opt-per-param": {"fused_update.FOREACH_NUMEL": 0},
                 "apollo-step-opt-narrow": {"passes.gradients.WIDE_MATMUL_DEVICES": frozenset()},
                 "apollo-step-opt-masks-as-traced": {"pipeline.PRE_GRAD_PASSES": "without:attention_masks"}}


def layout_value(current: Any, value: Any) -> Any:
    """An UPDATE_LAYOUT value: as given, or ``"without:NAME"``: the pass list `current` less pass NAME."""
    if isinstance(value, str) and value.startswith("without:"):
        return [entry for entry in current if entry[0] != value.removeprefix("without:")]
    return value


def updates_inside(variant: str) -> bool:
    """Whether `variant` compiles the optimizer's update into the step (the loop calls no step())."""
    return variant.startswith("apollo-step-opt")


class WholeStep:
    """Forward, loss and ``loss.backward()`` under autocast compiled as one graph (the *-step
    variants): apollo_compile.compile_step, or reduce-overhead with Dynamo's backward tracing on
    around its calls (what compile_step does for apollo). Calling it runs the backward too, so
    `train_step` and the timed step skip their own."""

    runs_backward = True

    def __init__(self, variant: str, name: str, model: nn.Module, device: torch.device, amp: bool,
                 options: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
        import apollo_compile

        f = loss_fn(name, model)

        def step(pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            with common.autocast(device, amp):
                loss = f(pixels, ids)
            loss.backward()
            return loss.detach()

        if variant == "inductor-ro-step":
            self.step = torch.compile(step, mode="reduce-overhead", fullgraph=True)
            self.trace_backward = True
        else:
            extra = {"max_lanes": 1} if variant == "apollo-step-1lane" else {}
            if variant == "apollo-step-opt-inductor":
                extra = {"optimizer_update": "inductor"}
            self.optimizer = optimizer if updates_inside(variant) else None  # its update in the graph
            inside = {"optimizer": optimizer} if self.optimizer is not None else {}
            self.step = apollo_compile.compile_step(step, options={**options, **extra}, **inside)
            self.trace_backward = False  # compile_step turns it on itself
        # "module.NAME" -> (the apollo_compile module, NAME, the value), looked up once, not per step
        self.layout = [(module, name, layout_value(getattr(module, name), value))
                       for module, name, value in ((importlib.import_module("apollo_compile." + key.rpartition(".")[0]),
                                                    key.rpartition(".")[2], value)
                                                   for key, value in UPDATE_LAYOUT.get(variant, {}).items())]

    def __call__(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.trace_backward:
            with torch._dynamo.config.patch(trace_autograd_ops=True):
                return self.step(pixels, ids)
        if self.layout:  # read where the step is traced: at its first call, and at any recompile
            held = [getattr(module, name) for module, name, _ in self.layout]
            try:
                for module, name, value in self.layout:
                    setattr(module, name, value)
                return self.step(pixels, ids)
            finally:
                for (module, name, _), value in zip(self.layout, held):
                    setattr(module, name, value)
        return self.step(pixels, ids)


def compiled_loss(variant: str, name: str, model: nn.Module, device: torch.device, args,
                  optimizer: torch.optim.Optimizer) -> tuple[Callable, Callable]:
    """(what `variant` compiled, batch -> the loss through it): a WholeStep for the *-step variants
    (both), else the model compiled as a module and its loss function."""
    if variant in STEP_VARIANTS:
        f = WholeStep(variant, name, model, device, args.amp, dict(args.apollo_options), optimizer)
        return f, f
    compiled = compile_variant(variant, model, args)
    return compiled, loss_fn(name, compiled)


def with_backward(f: Callable, device: torch.device, amp: bool) -> Callable:
    """batch -> the loss, its backward run: `f` itself where it runs its own (a WholeStep: forward
    and backward, one compiled step), else `f` under autocast and ``loss.backward()``."""
    if getattr(f, "runs_backward", False):
        return f

    def forward_backward(*batch) -> torch.Tensor:
        with common.autocast(device, amp):
            loss = f(*batch)
        loss.backward()
        return loss

    return forward_backward


def loss_and_grads(model: nn.Module, f: Callable, batch: tuple, device: torch.device, amp: bool):
    """common.loss_and_grads; for a WholeStep, which runs its backward itself, the same by hand."""
    if not getattr(f, "runs_backward", False):
        return common.loss_and_grads(model, f, batch, device, amp)
    model.zero_grad(set_to_none=True)
    optimizer = getattr(f, "optimizer", None)
    if optimizer is not None:  # the step consumed its gradients: read them off AdamW's first moment
        return loss_and_grads_from_update(model, f, optimizer, batch)
    loss = float(f(*batch).float().cpu())
    grads = {n: None if p.grad is None else common.cpu_fp32(p.grad) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss, grads


def loss_and_grads_from_update(model: nn.Module, f: Callable, optimizer: torch.optim.Optimizer, batch: tuple):
    """The loss and the gradients a step with the optimizer inside used, which it leaves nowhere:
    AdamW's first moment moves from m0 to m1 = beta1 * m0 + (1 - beta1) * g, so g = (m1 - beta1 *
    m0) / (1 - beta1), in float64 (the rounding this adds is ~1e-6 of m0, far under the 0.02 the
    check allows)."""
    beta1 = optimizer.param_groups[0]["betas"][0]
    before = {n: common.cpu_fp32(optimizer.state[p]["exp_avg"]).double() if "exp_avg" in optimizer.state[p] else None
              for n, p in model.named_parameters()}
    loss = float(f(*batch).float().cpu())
    grads = {}
    for n, p in model.named_parameters():
        m1 = optimizer.state[p].get("exp_avg")
        if m1 is None or before[n] is None:
            grads[n] = None
            continue
        grads[n] = ((common.cpu_fp32(m1).double() - beta1 * before[n]) / (1 - beta1)).float()
    return loss, grads


def compile_regions(model: nn.Module, **compile_kwargs) -> nn.Module:
    """Regional compilation (accelerate's ``compile_regions``, PyTorch's regional compilation
    recipe): each block of every outermost ``nn.ModuleList`` whose blocks share one class compiled
    on its own, in place; the rest runs eagerly. Dynamo compiles the block's forward once (twice:
    the first block's graph is specialized) and every block calls it with its own parameters."""
    blocks = 0

    def visit(module: nn.Module) -> None:
        nonlocal blocks
        for child in module.children():
            if isinstance(child, nn.ModuleList) and len(child) > 1 and len({type(b) for b in child}) == 1:
                for block in child:
                    block.compile(**compile_kwargs)
                    blocks += 1
            else:
                visit(child)

    visit(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no list of repeated blocks to compile")
    return model


def compile_variant(variant: str, model: nn.Module, args) -> Callable:
    if variant == "eager":
        return model
    if variant == "inductor":
        return torch.compile(model)
    if variant == "inductor-ro":
        return torch.compile(model, mode="reduce-overhead")
    if variant == "inductor-ro-regional":
        return compile_regions(model, mode="reduce-overhead")
    if variant in ("apollo", "apollo-bw-measured", "apollo-no-first-step-pool", "apollo-regional", "apollo-1lane",
                   "apollo-side-grads-own", "apollo-main-allocated"):
        import apollo_compile  # noqa: F401  (importing registers backend="apollo")

        if variant == "apollo-1lane":  # every graph on one stream: what lanes cost in memory
            return torch.compile(model, backend="apollo", options={**args.apollo_options, "max_lanes": 1})

        if variant == "apollo-regional":
            return compile_regions(model, backend="apollo", options=dict(args.apollo_options))
        return torch.compile(model, backend="apollo", options=dict(args.apollo_options))
    raise ValueError(f"unknown variant {variant!r}")


# --------------------------------------------------------------------------------------------
# one variant, one model and batch size


def reference(base: nn.Module, name: str, batch: tuple, device: torch.device, amp: bool) -> dict:
    model = copy.deepcopy(base).to(device)
    f = loss_fn(name, model)
    loss, grads = common.loss_and_grads(model, f, batch, device, amp)
    fp32 = None
    if amp:
        with common.no_tf32():
            fp32 = common.loss_and_grads(model, f, batch, device, False)
    del model, f
    common.free_device_memory(device)
    return common.reference(loss, grads, fp32)


def runtime_for(variant: str) -> contextlib.AbstractContextManager:
    """What a variant's runners run under, for the whole variant: the candidate-choosing rule they
    use at their capture (runtime/choice.py), the memory pool their first step runs in
    (runtime/graph_pool.py, FIRST_STEP_POOL), or whether a backward's side lanes write their
    gradients into main-allocated memory (passes/main_allocated.py)."""
    if variant.endswith("-first-step-pool"):  # which graphs' first calls open a pool of their own
        from apollo_compile.runtime import graph_pool

        kinds = frozenset() if variant.endswith("-no-first-step-pool") else graph_pool.FIRST_STEP_POOL | {"inference"}
        return mock.patch.object(graph_pool, "FIRST_STEP_POOL", kinds)
    if variant in ("apollo-side-grads-own", "apollo-main-allocated"):  # compiled (so planned) inside the block
        from apollo_compile.passes import main_allocated

        return mock.patch.object(main_allocated, "ENABLED", variant == "apollo-main-allocated")
    if variant != "apollo-bw-measured":
        return contextlib.nullcontext()
    from apollo_compile.runtime import choice

    return choice.using(choice.ChooseFastest(follow_forward=False))


def run_variant(variant: str, name: str, base: nn.Module, batch: tuple, numerics_batch: tuple, ref: dict, args,
                device: torch.device) -> dict:
    row: dict[str, Any] = {"variant": variant, "status": "ok"}
    with common.diagnostics_for(row, variant, variant.startswith("apollo")) as keep, runtime_for(variant):
        row["left_over"] = left = common.left_over(device)  # earlier variants' memory, not this one's
        if left is not None and left["allocated_gib"] > 0.01:
            log(f"  [{variant}] left over from earlier variants: {left['allocated_gib']:.2f} GiB allocated, "
                f"{left['reserved_gib']:.2f} reserved; largest tensors {left['largest_tensors']}; live blocks "
                f"{left['allocated_blocks']}")
        common.reset_peaks(device)
        model = copy.deepcopy(base).to(device)
        cuda = device.type == "cuda"
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True if cuda else None)
        step_fn, f = compiled_loss(variant, name, model, device, args, optimizer)
        keep.append(step_fn)  # see common.apollo_diagnostics
        update_inside = updates_inside(variant)  # the compiled step runs optimizer.step() itself
        forward_backward = with_backward(f, device, args.amp)

        def whole_step(read_loss: bool = True) -> float | torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = forward_backward(*batch)
            if not update_inside:
                optimizer.step()
            return loss.item() if read_loss else loss  # a loop that logs its loss waits for the step here

        row.update(common.warm_up(whole_step, args.warmup, device))
        log(f"  [{variant}] compile + {args.warmup} warm-up steps: {row['compile_s']:.1f} s")
        row["peak_alloc_gib"], row["peak_reserved_gib"] = common.read_peaks(device)  # compile and capture
        common.reset_peaks(device)
        row.update(common.spread(common.time_steps(whole_step, args.steps, device)))
        b2b = common.time_back_to_back(functools.partial(whole_step, False), args.steps, device)
        row.update(back_to_back_ms=b2b["ms"], back_to_back_rounds_ms=b2b["rounds_ms"], back_to_back_host_ms=b2b["host_ms"])
        row["steady_peak_alloc_gib"], row["steady_peak_reserved_gib"] = common.read_peaks(device)
        if row["peak_alloc_gib"] is not None:  # the whole run's peak: compile, capture and the timed steps,
            for kind in ("alloc", "reserved"):  # less what earlier variants left (as if run alone)
                before = left["allocated_gib" if kind == "alloc" else "reserved_gib"]
                for key in (f"peak_{kind}_gib", f"steady_peak_{kind}_gib"):
                    row[key] -= before
                row[f"peak_{kind}_gib"] = max(row[f"peak_{kind}_gib"], row[f"steady_peak_{kind}_gib"])
        row["held"] = common.memory_held(device)
        log(f"  [{variant}] {args.steps} steps: {common.spread_text(row)}; back to back {b2b['ms']:.2f} ms "
            f"(host {b2b['host_ms']:.2f})"
            + (f"; whole run {common.peaks_text(row['peak_alloc_gib'], row['peak_reserved_gib'])}, timed steps "
               f"{common.peaks_text(row['steady_peak_alloc_gib'], row['steady_peak_reserved_gib'])}"
               if row["peak_alloc_gib"] is not None else ""))
        if row["held"] is not None:
            log(f"  [{variant}] {common.memory_held_text(row['held'])}")
        loss, grads = loss_and_grads(model, f, numerics_batch, device, args.amp)
        row["numerics"] = n = common.compare(loss, grads, ref, "bf16" if args.amp else "fp32")
        log(f"  [{variant}] numerics {common.verdict(n)}: {common.numerics_text(n)}")
    return row


# --------------------------------------------------------------------------------------------
# reporting


HEADER = ["model", "batch", "variant", "median ms", "p10", "p90", f"vs {BASELINE}", "b2b ms", f"b2b vs {BASELINE}",
          "whole-run peak GiB", f"peak vs {BASELINE}", "steps' peak GiB", "reserved GiB", f"reserved vs {BASELINE}",
          "compile s", "numerics"]


def markdown_table(results: list[dict]) -> str:
    rows = []
    for entry in results:
        ok = {r["variant"]: r for r in entry["variants"] if r["status"] == "ok"}
        base = ok.get(BASELINE)
        for r in entry["variants"]:
            if r["status"] != "ok":
                rows.append([entry["model"]] + common.failed_cells(entry["batch"], r, len(HEADER) - 1))
                continue
            speed = base["median_ms"] / r["median_ms"] if base else None
            b2b = r.get("back_to_back_ms")
            b2b_ratio = base["back_to_back_ms"] / b2b if base and b2b and base.get("back_to_back_ms") else None
            rows.append([
                entry["model"], str(entry["batch"]), r["variant"], f"{r['median_ms']:.2f}", f"{r['p10_ms']:.2f}",
                f"{r['p90_ms']:.2f}", fmt(speed, ".2f", "x"), fmt(b2b, ".2f"), fmt(b2b_ratio, ".2f", "x"),
                fmt(r.get("peak_alloc_gib"), ".2f"), fmt(common.memory_ratio(r, base, "peak_alloc_gib"), ".2f", "x"),
                fmt(r.get("steady_peak_alloc_gib"), ".2f"), fmt(r.get("peak_reserved_gib"), ".2f"),
                fmt(common.memory_ratio(r, base, "peak_reserved_gib"), ".2f", "x"),
                f"{r['compile_s']:.1f}", common.numerics_cell(r["numerics"]),
            ])
    return common.markdown(HEADER, rows)


def report(env: dict, results: list[dict], out_dir: Path) -> str:
    precision = "bf16" if env["amp"] != "fp32" else "fp32"
    head = [
        f"# apollo whole-step benchmark: {', '.join(env['models'])}, {env['amp']}",
        "",
        common.header_line(env),
        f"{env['warmup']} warm-up + {env['steps']} timed steps of zero_grad + forward + backward + AdamW "
        f"(lr {env['lr']:g}) + loss.item(), each from an idle GPU, then back to back without loss.item() (b2b); ratio = {BASELINE} median / variant median "
        f"(>1: faster); peak over the whole variant, compile and capture included; numerics vs eager, "
        f"{common.tolerance_text(precision)}.",
        *(f"- {e['model']}, batch {e['batch']}: bf16 noise floor: dloss {f['loss_abs_diff']:.1e}, grad "
          f"{f['grad_rel_err_max']:.1e}" for e in results if (f := e.get("bf16_noise_floor"))),
    ]
    text = "\n".join(head) + "\n\n" + markdown_table(results) + "\n"
    (out_dir / "whole_step_results.md").write_text(text)
    (out_dir / "whole_step_results.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
    return text


# --------------------------------------------------------------------------------------------


def model_name(name: str) -> str:
    if name.removesuffix("-tiny") not in MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {name!r}; choose from {', '.join(MODELS)} (each also -tiny)")
    return name


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS[:3]), type=model_name, metavar="MODEL",
                   help=f"{', '.join(MODELS)}, each also -tiny (default: the three two-tower ones)")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--lr", type=float, default=0.0, help="AdamW's learning rate (0: the weights stay the reference's)")
    p.add_argument("--apollo-options", type=json.loads, default={},
                   help='JSON options for backend="apollo", e.g. \'{"subgraph_compiler": "eager"}\'')
    common.add_run_args(p, steps=30, warmup=5)
    return common.parse_run_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if (setup := common.device_and_out_dir(args)) is None:
        return 2
    device, out_dir = setup
    env = common.environment(device, models=args.models, amp="bf16 autocast" if args.amp else "fp32",
                             steps=args.steps, warmup=args.warmup, lr=args.lr, optimizer="AdamW"
                             + (" (fused)" if device.type == "cuda" else ""), apollo_options=args.apollo_options)
    log(common.header_line(env))
    log(f"models {args.models} | {env['amp']} | batches {args.batch} | variants {args.variants} | out {out_dir}")
    results: list[dict] = []
    for name in args.models:
        base, shape = build(name, args.seed)  # stays on the CPU; copies go to the device
        log(f"\n##### {name}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters")
        for batch_size in args.batch:
            log(f"\n=== {name}, batch {batch_size} ===")
            entry: dict[str, Any] = {"model": name, "batch": batch_size, "variants": []}
            results.append(entry)
            batch = make_batch(shape, batch_size, device, args.seed)
            numerics_batch = make_batch(shape, batch_size, device, args.seed + 1)
            ref = common.batch_reference(entry, functools.partial(reference, base, name, numerics_batch, device,
                                                                  args.amp))
            if ref is not None:
                for variant in args.variants:
                    log(f"--- {name}, batch {batch_size}, {variant}")
                    entry["variants"].append(common.guarded(functools.partial(
                        run_variant, variant, name, base, batch, numerics_batch, ref, args, device), variant))
                    common.free_device_memory(device)
                    report(env, results, out_dir)  # after every variant: a cut run keeps what was measured
            del batch, numerics_batch, ref
            common.free_device_memory(device)
    text = report(env, results, out_dir)
    log(f"\nwrote {out_dir / 'whole_step_results.json'} and {out_dir / 'whole_step_results.md'}\n")
    log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
