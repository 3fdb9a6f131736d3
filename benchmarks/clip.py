"""CLIP-style two-tower model for benchmarks, in plain ``torch.nn`` (no transformers).

The "base" configuration is the benchmark model of docs/DESIGN.md:

* ``vision``: ViT-B/16 — 224px images, 16x16 patch conv, 12 pre-norm blocks of width 768 with
  12 heads and a 4x MLP. Pooling: a learnable **class token** (CLIP style: ``ln_pre`` after the
  embeddings, ``ln_post`` on the class token's output).
* ``text``: 77 tokens, vocabulary 49408, 12 pre-norm blocks of width 512 with 8 heads and a 4x
  MLP, causal self-attention (``F.scaled_dot_product_attention(is_causal=True)``). Pooling: the
  **EOT token** — the position of the largest token id, as in CLIP, where EOT = vocab - 1.
* ``vision_proj`` / ``text_proj``: bias-free linear projections to 512, then L2 normalisation.
* a learnable logit scale (init log(1/0.07), the exponentiated scale clamped at 100) and the
  symmetric contrastive cross-entropy loss, computed inside ``forward(images, tokens)``, which
  returns the scalar loss. The whole training step's forward is therefore one ``nn.Module`` call.

The top-level submodules are named ``vision``, ``text``, ``vision_proj`` and ``text_proj``: apollo's
default modality assignment (one modality per top-level submodule) finds the two towers.

"tiny" is a 2-layer, narrow version with the same structure, for CPU smoke runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class CLIPConfig:
    image_size: int
    patch_size: int
    vision_width: int
    vision_layers: int
    vision_heads: int
    context_length: int
    vocab_size: int
    text_width: int
    text_layers: int
    text_heads: int
    embed_dim: int
    mlp_ratio: int = 4


CONFIGS: dict[str, CLIPConfig] = {
    "base": CLIPConfig(
        image_size=224, patch_size=16, vision_width=768, vision_layers=12, vision_heads=12,
        context_length=77, vocab_size=49408, text_width=512, text_layers=12, text_heads=8,
        embed_dim=512,
    ),
    "tiny": CLIPConfig(
        image_size=32, patch_size=8, vision_width=64, vision_layers=2, vision_heads=4,
        context_length=16, vocab_size=512, text_width=48, text_layers=2, text_heads=4,
        embed_dim=32,
    ),
}


def get_config(config: str | CLIPConfig) -> CLIPConfig:
    if isinstance(config, CLIPConfig):
        return config
    try:
        return CONFIGS[config]
    except KeyError:
        raise ValueError(f"unknown config {config!r}; choose from {', '.join(CONFIGS)}") from None


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int, mlp_ratio: int, causal: bool) -> None:
        super().__init__()
        assert width % heads == 0, (width, heads)
        self.heads = heads
        self.causal = causal
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, mlp_ratio * width),
            nn.GELU(),
            nn.Linear(mlp_ratio * width, width),
        )

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (b, t, 3c) -> 3 x (b, heads, t, head_dim)
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    """ViT: patch conv, class token + learned positions, pre-norm blocks, class-token output."""

    def __init__(self, cfg: CLIPConfig) -> None:
        super().__init__()
        width = cfg.vision_width
        num_patches = (cfg.image_size // cfg.patch_size) ** 2
        scale = width ** -0.5
        self.patch_embed = nn.Conv2d(3, width, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.class_token = nn.Parameter(scale * torch.randn(width))
        self.pos_embed = nn.Parameter(scale * torch.randn(num_patches + 1, width))
        self.ln_pre = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(
            Block(width, cfg.vision_heads, cfg.mlp_ratio, causal=False) for _ in range(cfg.vision_layers)
        )
        self.ln_post = nn.LayerNorm(width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (b, patches, width)
        cls = self.class_token.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.ln_pre(x)
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x[:, 0])  # class token


class TextTransformer(nn.Module):
    """Causal text transformer; the output is the final-norm feature at the EOT token."""

    def __init__(self, cfg: CLIPConfig) -> None:
        super().__init__()
        width = cfg.text_width
        self.token_embed = nn.Embedding(cfg.vocab_size, width)
        self.pos_embed = nn.Parameter(0.01 * torch.randn(cfg.context_length, width))
        self.blocks = nn.ModuleList(
            Block(width, cfg.text_heads, cfg.mlp_ratio, causal=True) for _ in range(cfg.text_layers)
        )
        self.ln_final = nn.LayerNorm(width)
        nn.init.normal_(self.token_embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embed(tokens) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        x = self.ln_final(x)
        eot = tokens.argmax(dim=-1)  # EOT has the largest id (vocab - 1)
        return x[torch.arange(x.shape[0], device=x.device), eot]


class CLIP(nn.Module):
    def __init__(self, cfg: CLIPConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision = VisionTransformer(cfg)
        self.text = TextTransformer(cfg)
        self.vision_proj = nn.Linear(cfg.vision_width, cfg.embed_dim, bias=False)
        self.text_proj = nn.Linear(cfg.text_width, cfg.embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self._init_weights()

    def _init_weights(self) -> None:
        # CLIP-like scaled normal init for the transformer blocks and projections.
        for tower, width, layers in (
            (self.vision, self.config.vision_width, self.config.vision_layers),
            (self.text, self.config.text_width, self.config.text_layers),
        ):
            proj_std = width ** -0.5 * (2 * layers) ** -0.5
            for block in tower.blocks:
                nn.init.normal_(block.qkv.weight, std=width ** -0.5)
                nn.init.normal_(block.out_proj.weight, std=proj_std)
                nn.init.normal_(block.mlp[0].weight, std=(2 * width) ** -0.5)
                nn.init.normal_(block.mlp[2].weight, std=proj_std)
        nn.init.normal_(self.vision_proj.weight, std=self.config.vision_width ** -0.5)
        nn.init.normal_(self.text_proj.weight, std=self.config.text_width ** -0.5)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        image_features = F.normalize(self.vision_proj(self.vision(images)), dim=-1)
        text_features = F.normalize(self.text_proj(self.text(tokens)), dim=-1)
        scale = self.logit_scale.exp().clamp(max=100.0)
        logits = scale * image_features @ text_features.t()  # (images, texts)
        labels = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def build(
    config: str | CLIPConfig = "base",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> CLIP:
    """The model with weights drawn from `seed` on the CPU (identical on every device), then moved."""
    cfg = get_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIP(cfg)
    return model.to(device=device, dtype=dtype)


def make_batch(
    batch: int,
    device: str | torch.device = "cpu",
    config: str | CLIPConfig = "base",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, tokens) of `batch` examples, drawn on the CPU from `seed`, then moved.

    images: float32 (batch, 3, H, W), standard normal. tokens: int64 (batch, context), CLIP
    layout: SOT (vocab - 2), random ids, EOT (vocab - 1) at a random length, zero padding after.
    """
    cfg = get_config(config)
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, cfg.image_size, cfg.image_size, generator=g)
    ctx, sot, eot = cfg.context_length, cfg.vocab_size - 2, cfg.vocab_size - 1
    tokens = torch.randint(1, sot, (batch, ctx), generator=g)
    lengths = torch.randint(2, ctx + 1, (batch,), generator=g)  # including SOT and EOT
    positions = torch.arange(ctx).expand(batch, ctx)
    tokens[:, 0] = sot
    tokens = torch.where(positions == (lengths - 1)[:, None], torch.full_like(tokens, eot), tokens)
    tokens = torch.where(positions >= lengths[:, None], torch.zeros_like(tokens), tokens)
    return images.to(device), tokens.to(device)
