"""The user's whole training step on Hugging Face and timm two-tower models: apollo against
Inductor's reduce-overhead, the loss read every step (the README's first table).

Models, with random weights from their configurations (nothing is downloaded):

    hf-clip        transformers CLIPModel, ViT-B/16 at 224 px + its 12-layer text tower (77 tokens)
    hf-siglip      transformers SiglipModel, base: ViT-B/16 at 224 px + a 12-layer text tower (64 tokens)
    timm-vit-bert  timm ``vit_base_patch16_224`` + BERT base (64 tokens), CLIP's contrastive loss
    hf-llava       LlavaForConditionalGeneration: a CLIP ViT-B/16 tower, its projector, an 8-layer
                   Llama of width 1024; 196 image tokens + 64 text tokens, the language-model loss
    <model>-tiny   the same classes, 2 layers of width 32 at 32 px and 16 tokens, for CPU runs

Variants (VARIANT_HELP says what each is): the model compiled as a module (eager, inductor,
inductor-ro, apollo, apollo-1lane, regional compilation), the whole step compiled as one graph
(inductor-ro-step, apollo-step, apollo-step-opt with the optimizer's update inside, apollo-step-opt-mb2
and -mb4 with the batch in micro-batches inside that graph), gradient accumulation over the same
micro-batches one call each on the module (apollo-accum2, -accum4), and the memory-saving choices at ``--budget`` (apollo's ``memory_budget``, Inductor's
``activation_memory_budget``, Hugging Face gradient checkpointing).

A step is ``zero_grad(set_to_none=True)``, the forward and loss under bf16 autocast, ``backward()``,
a fused AdamW step (``--lr 0``: the weights stay the reference's) and ``loss.item()``. Timing,
memory (the timed steps' peaks, and the whole run's from before the compile) and numerics against
eager are common.py's variant matrix; results go to ``<out>/whole_step_results.json`` and ``.md``.

    PYTHONPATH=. python benchmarks/bench_whole_step.py --models hf-clip --batch 8 32
    python benchmarks/bench_whole_step.py --device cpu --models hf-clip-tiny --batch 2 --steps 2 --warmup 1 \\
        --apollo-options '{"subgraph_compiler": "eager"}'
"""

from __future__ import annotations

import argparse
import contextlib
import copy
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
from common import log  # noqa: E402

VARIANT_HELP = {
    "eager": "the module as is",
    "inductor": "torch.compile(model): Inductor's default mode, no CUDA graphs",
    "inductor-ro": 'torch.compile(model, mode="reduce-overhead")',
    "inductor-ro-step": "reduce-overhead on the whole step (forward, loss, backward), Dynamo tracing the backward",
    "apollo": 'torch.compile(model, backend="apollo", options=--apollo-options)',
    "apollo-1lane": "apollo with max_lanes=1: every graph on one stream",
    "apollo-graphs": "apollo with cudagraphs=True: captured however much of the memory limit its first step used "
                     "(no capture headroom rule)",
    "apollo-measure-backward": "apollo with the donating backward timing its own candidates (runtime/choice."
                               "ChooseFastest(follow_forward=False)) instead of replaying its forward's choice",
    "apollo-no-graphs": "apollo with cudagraphs=False: every call un-graphed, on one lane (what a graph the headroom "
                        "rule declines runs)",
    "apollo-step": "apollo_compile.compile_step(step): forward, loss and backward in one graph; AdamW outside",
    "apollo-step-1lane": "apollo-step with max_lanes=1",
    "apollo-step-opt": "compile_step(step, optimizer=opt): the optimizer's update inside the graph",
    "apollo-step-opt-inductor": 'apollo-step-opt with optimizer_update="inductor" (Adam\'s formula for Inductor to fuse)',
    "inductor-ro-regional": "each block of a list of repeated blocks compiled on its own (reduce-overhead), the rest eager",
    "apollo-regional": "the same with apollo",
    "apollo-budget": "apollo with memory_budget=--budget",
    "apollo-step-opt-budget": "apollo-step-opt with memory_budget=--budget",
    "apollo-step-opt-budget-lanes": "apollo-step-opt-budget replaying its lanes, unmeasured (runtime/choice.Fixed): "
                                    "what the budget's memory bound declines",
    "apollo-step-opt-fused-baseline": "apollo-step-opt re-running, without a budget, the pointwise work a partition "
                                      "re-runs by itself (passes.step_recompute.FUSED_BASELINE on)",
    "apollo-step-opt-mb2": "apollo-step-opt with micro_batches=2: the batch in 2 slices inside the one graph",
    "apollo-step-opt-mb4": "apollo-step-opt with micro_batches=4",
    "apollo-accum2": "apollo on the module, the batch in 2 micro-batches one call each (gradient accumulation, "
                     "each loss / 2), then AdamW: what apollo-step-opt-mb2 does in one graph",
    "apollo-accum4": "apollo-accum2 with 4 micro-batches",
    "inductor-ro-amb": "reduce-overhead with Inductor's activation_memory_budget=--budget",
    "inductor-ro-hf-ckpt": "reduce-overhead on the model with its own gradient checkpointing on (HF, timm)",
    "apollo-side-grads-own": "apollo with a backward's side lanes allocating their own gradients "
                             "(passes.main_allocated.ENABLED off)",
    "apollo-main-allocated": "apollo with passes.main_allocated.ENABLED on (the default), beside the row above",
    "apollo-no-first-step-pool": "apollo with its first, un-graphed step in the default pool "
                                 "(runtime.graph_pool.FIRST_STEP_POOL empty)",
    "apollo-step-opt-first-step-pool": 'apollo-step-opt with "inference" graphs\' first steps in a pool of their own too',
}
VARIANTS = tuple(VARIANT_HELP)
BASELINE = "inductor-ro"
MODELS = ("hf-clip", "hf-siglip", "timm-vit-bert", "hf-llava")
DEFAULT_BUDGET = 0.5


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
        # does, so with it on no compiler's loss could match eager's. CLIP's and SigLIP's configs
        # have no dropout by default either.
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
                 "apollo-step-opt-budget", "apollo-step-opt-budget-lanes", "apollo-step-opt-first-step-pool",
                 "apollo-step-opt-fused-baseline", "apollo-step-opt-mb2", "apollo-step-opt-mb4")


def updates_inside(variant: str) -> bool:
    """Whether `variant` compiles the optimizer's update into the step (the loop calls no step())."""
    return variant.startswith("apollo-step-opt")


def step_options(variant: str, options: dict, budget: float) -> dict:
    """apollo's options for a *-step variant: --apollo-options and what the variant adds."""
    extra = {"apollo-step-1lane": {"max_lanes": 1}, "apollo-step-opt-inductor": {"optimizer_update": "inductor"},
             "apollo-step-opt-budget": {"memory_budget": budget},
             "apollo-step-opt-budget-lanes": {"memory_budget": budget}}.get(variant, {})
    return {**options, **extra}


class WholeStep:
    """Forward, loss and ``loss.backward()`` under autocast compiled as one graph (the *-step
    variants): apollo_compile.compile_step, or reduce-overhead with Dynamo's backward tracing on
    around its calls (what compile_step does for apollo). Calling it runs the backward too."""

    runs_backward = True

    def __init__(self, variant: str, name: str, model: nn.Module, device: torch.device, amp: bool,
                 options: dict, optimizer: torch.optim.Optimizer | None = None, budget: float = DEFAULT_BUDGET) -> None:
        import apollo_compile

        f = loss_fn(name, model)

        def step(pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            with common.autocast(device, amp):
                loss = f(pixels, ids)
            loss.backward()
            return loss.detach()

        self.optimizer = None
        if variant == "inductor-ro-step":
            self.step = torch.compile(step, mode="reduce-overhead", fullgraph=True)
            self.trace_backward = True
        else:
            self.optimizer = optimizer if updates_inside(variant) else None  # its update in the graph
            inside = {"optimizer": optimizer} if self.optimizer is not None else {}
            if "-mb" in variant:  # the step's gradients are the micro-batches' mean: the batch's own
                inside["micro_batches"] = int(variant.rsplit("-mb", 1)[1])
            self.step = apollo_compile.compile_step(step, options=step_options(variant, options, budget), **inside)
            self.trace_backward = False  # compile_step turns it on itself

    def __call__(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.trace_backward:
            with torch._dynamo.config.patch(trace_autograd_ops=True):
                return self.step(pixels, ids)
        return self.step(pixels, ids)


def compiled_loss(variant: str, name: str, model: nn.Module, device: torch.device, args,
                  optimizer: torch.optim.Optimizer) -> tuple[Callable, Callable]:
    """(what `variant` compiled, batch -> the loss through it): a WholeStep for the *-step variants
    (both), else the model compiled as a module and its loss function."""
    budget = getattr(args, "budget", DEFAULT_BUDGET)
    if variant in STEP_VARIANTS:
        f = WholeStep(variant, name, model, device, args.amp, dict(args.apollo_options), optimizer, budget)
        return f, f
    if variant.startswith("apollo-accum"):
        compiled = compile_variant("apollo", model, dict(args.apollo_options), budget)
        f = Accumulated(loss_fn(name, compiled), int(variant.removeprefix("apollo-accum")), device, args.amp)
        return compiled, f
    compiled = compile_variant(variant, model, dict(args.apollo_options), budget)
    return compiled, loss_fn(name, compiled)


class Accumulated:
    """Gradient accumulation as users write it: `f` (batch -> loss) on k slices of dimension 0,
    one call each, each loss divided by k before its backward, so the gradients are the
    micro-batches' mean (compile_step's micro_batches= in one graph does the same). Returns the
    mean loss; runs its backwards itself."""

    runs_backward = True

    def __init__(self, f: Callable, k: int, device: torch.device, amp: bool) -> None:
        self.f, self.k, self.device, self.amp = f, k, device, amp

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        total = None
        for piece in zip(*(t.chunk(self.k) for t in batch)):
            with common.autocast(self.device, self.amp):
                loss = self.f(*piece)
            (loss / self.k).backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total / self.k


def with_backward(f: Callable, device: torch.device, amp: bool) -> Callable:
    """batch -> the loss, its backward run: `f` itself where it runs its own (a WholeStep), else
    `f` under autocast and ``loss.backward()``."""
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


def enable_checkpointing(model: nn.Module) -> None:
    """The model's own gradient checkpointing (non-reentrant): Hugging Face's
    ``gradient_checkpointing_enable``, timm's ``set_grad_checkpointing`` for TimmBert's vision tower."""
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if isinstance(model, TimmBert):
        model.vision.set_grad_checkpointing(True)
        model.text.gradient_checkpointing_enable(**kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(**kwargs)
    else:
        raise ValueError(f"{type(model).__name__} has no gradient checkpointing of its own")


def compile_variant(variant: str, model: nn.Module, options: dict, budget: float = DEFAULT_BUDGET) -> Callable:
    """The module compiled as `variant` says (not the *-step variants: compiled_loss)."""
    if variant == "eager":
        return model
    if variant == "inductor":
        return torch.compile(model)
    if variant in ("inductor-ro", "inductor-ro-amb"):  # the budget is runtime_for's, around compile and run
        return torch.compile(model, mode="reduce-overhead")
    if variant == "inductor-ro-hf-ckpt":
        enable_checkpointing(model)
        return torch.compile(model, mode="reduce-overhead")
    if variant == "inductor-ro-regional":
        return compile_regions(model, mode="reduce-overhead")
    if variant.startswith("apollo") and variant not in STEP_VARIANTS:
        import apollo_compile  # noqa: F401  (importing registers backend="apollo")

        if variant == "apollo-regional":
            return compile_regions(model, backend="apollo", options=options)
        extra = {"apollo-1lane": {"max_lanes": 1}, "apollo-budget": {"memory_budget": budget},
                 "apollo-graphs": {"cudagraphs": True}, "apollo-no-graphs": {"cudagraphs": False}}.get(variant, {})
        return torch.compile(model, backend="apollo", options={**options, **extra})
    raise ValueError(f"unknown variant {variant!r}")


def runtime_for(variant: str, budget: float = DEFAULT_BUDGET) -> contextlib.AbstractContextManager:
    """What a variant runs under, for the whole variant (compile and steps): Inductor's
    activation_memory_budget, the memory pool apollo's first steps run in
    (runtime/graph_pool.py, FIRST_STEP_POOL), or whether a backward's side lanes write their
    gradients into main-allocated memory (passes/main_allocated.py), the runtime it replays, or
    whether a whole step without a budget re-runs pointwise work (passes/step_recompute.py)."""
    if variant == "inductor-ro-amb":
        return torch._functorch.config.patch(activation_memory_budget=budget)
    if variant.endswith("-first-step-pool"):
        from apollo_compile.runtime import graph_pool

        kinds = frozenset() if variant.endswith("-no-first-step-pool") else graph_pool.FIRST_STEP_POOL | {"inference"}
        return mock.patch.object(graph_pool, "FIRST_STEP_POOL", kinds)
    if variant.endswith("-fused-baseline"):
        from apollo_compile.passes import step_recompute

        return mock.patch.object(step_recompute, "FUSED_BASELINE", True)
    if variant.endswith("-budget-lanes"):
        from apollo_compile.runtime import choice

        return choice.using(choice.Fixed("lanes"))
    if variant == "apollo-measure-backward":
        from apollo_compile.runtime import choice

        return choice.using(choice.ChooseFastest(follow_forward=False))
    if variant in ("apollo-side-grads-own", "apollo-main-allocated"):
        from apollo_compile.passes import main_allocated

        return mock.patch.object(main_allocated, "ENABLED", variant == "apollo-main-allocated")
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# the matrix


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


def trial(variant: str, name: str, base: nn.Module, batch: tuple, numerics_batch: tuple | None, args,
          device: torch.device) -> common.Trial:
    """The user's whole step as `variant` compiles it: zero_grad, forward and backward, AdamW's
    step (unless inside), and ``loss.item()`` when the loss is read."""
    model = copy.deepcopy(base).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True if device.type == "cuda" else None)
    step_fn, f = compiled_loss(variant, name, model, device, args, optimizer)
    update_inside = updates_inside(variant)  # the compiled step runs optimizer.step() itself
    forward_backward = with_backward(f, device, args.amp)

    def whole_step(read_loss: bool = True) -> float | torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(*batch)
        if not update_inside:
            optimizer.step()
        return loss.item() if read_loss else loss  # a loop that logs its loss waits for the step here

    numerics = None if numerics_batch is None else (
        lambda: loss_and_grads(model, f, numerics_batch, device, args.amp))
    return common.Trial(whole_step, numerics, keep=step_fn)


def cells(models: list[str], batches: list[int], args, device: torch.device):
    for name in models:
        base, shape = build(name, args.seed)  # stays on the CPU; copies go to the device
        log(f"\n##### {name}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters")
        for batch_size in batches:
            batch = make_batch(shape, batch_size, device, args.seed)
            numerics_batch = make_batch(shape, batch_size, device, args.seed + 1)
            yield common.Cell(f"{name}, batch {batch_size}", {"model": name, "batch": batch_size},
                              lambda: reference(base, name, numerics_batch, device, args.amp),
                              {"name": name, "base": base, "batch": batch, "numerics": numerics_batch})


def run_variant(cell: common.Cell, variant: str, ref: dict | None, args, device: torch.device) -> dict:
    data = cell.data
    return common.measure(
        variant, lambda: trial(variant, data["name"], data["base"], data["batch"], data["numerics"], args, device),
        ref, device, warmup=args.warmup, steps=args.steps, precision="bf16" if args.amp else "fp32",
        apollo=variant.startswith("apollo"), context=runtime_for(variant, args.budget))


# --------------------------------------------------------------------------------------------
# reporting


def markdown_table(results: list[dict]) -> str:
    return common.matrix_table(results, BASELINE, lead=("model", "batch"))


def report(env: dict, results: list[dict], out_dir: Path) -> str:
    precision = "bf16" if env["amp"] != "fp32" else "fp32"
    head = [
        f"# apollo whole-step benchmark: {', '.join(env['models'])}, {env['amp']}",
        "",
        common.header_line(env),
        f"{env['warmup']} warm-up + {env['steps']} timed steps of zero_grad + forward + backward + AdamW "
        f"(lr {env['lr']:g}) + loss.item(), each from an idle GPU, then back to back without loss.item() (b2b); "
        f"ratio = {BASELINE} median / variant median (>1: faster); peak and reserved over the timed steps; "
        f"whole-run reserved from before the compile (compile, capture, steps); budget {env['budget']:g}; "
        f"numerics vs eager, {common.tolerance_text(precision)}.",
        *(f"- {e['model']}, batch {e['batch']}: bf16 noise floor: dloss {f['loss_abs_diff']:.1e}, grad "
          f"{f['grad_rel_err_max']:.1e}" for e in results if (f := e.get("bf16_noise_floor"))),
    ]
    return common.write_results(out_dir, "whole_step", env, head, [markdown_table(results)], results=results)


# --------------------------------------------------------------------------------------------


def model_name(name: str) -> str:
    if name.removesuffix("-tiny") not in MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {name!r}; choose from {', '.join(MODELS)} (each also -tiny)")
    return name


def budget_fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--budget must be in (0, 1], not {text}")
    return value


def add_step_args(p: argparse.ArgumentParser) -> None:
    """The flags a whole step needs (this script's and bench_large_batch.py's)."""
    p.add_argument("--lr", type=float, default=0.0, help="AdamW's learning rate (0: the weights stay the reference's)")
    p.add_argument("--budget", type=budget_fraction, default=DEFAULT_BUDGET,
                   help=f"the *-budget and -amb variants' memory budget (default {DEFAULT_BUDGET})")
    p.add_argument("--apollo-options", type=json.loads, default={},
                   help='JSON options for backend="apollo", e.g. \'{"subgraph_compiler": "eager"}\'')


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="variants:\n" + "\n".join(f"  {k:32} {v}" for k, v in VARIANT_HELP.items()))
    p.add_argument("--models", nargs="+", default=list(MODELS[:3]), type=model_name, metavar="MODEL",
                   help=f"{', '.join(MODELS)}, each also -tiny (default: the three two-tower ones)")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="VARIANT")
    add_step_args(p)
    common.add_run_args(p, steps=30, warmup=5)
    return common.parse_run_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if (setup := common.device_and_out_dir(args)) is None:
        return 2
    device, out_dir = setup
    env = common.environment(device, models=args.models, amp="bf16 autocast" if args.amp else "fp32",
                             steps=args.steps, warmup=args.warmup, lr=args.lr, budget=args.budget,
                             optimizer="AdamW" + (" (fused)" if device.type == "cuda" else ""),
                             apollo_options=args.apollo_options)
    log(common.header_line(env))
    log(f"models {args.models} | {env['amp']} | batches {args.batch} | variants {args.variants} | out {out_dir}")
    results: list[dict] = []
    common.run_matrix(cells(args.models, args.batch, args, device), args.variants,
                      lambda cell, variant, ref: run_variant(cell, variant, ref, args, device), device, results,
                      on_update=lambda: report(env, results, out_dir))
    text = report(env, results, out_dir)
    log(f"\nwrote {out_dir / 'whole_step_results.json'} and {out_dir / 'whole_step_results.md'}\n")
    log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
