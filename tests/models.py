"""Small models the tests train: a CLIP-style two-tower model (a variant that does work only on its
first call; its blocks under the user's checkpoints), a single-branch MLP, a model with a graph
break, and tiny Hugging Face CLIP and SigLIP models. Sizes are tiny so that CPU CI compiles and trains them quickly."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block (attention + MLP)."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(b, t, c)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class VisionTower(nn.Module):
    def __init__(self, image: int = 16, patch: int = 8, width: int = 32, layers: int = 2, heads: int = 4,
                 dropout: float = 0.0, stem_norm: bool = False) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, width, patch, stride=patch)
        # stem_norm: CLIP's vision stem, a class token before the patches and a norm after them
        self.cls = nn.Parameter(torch.randn(1, 1, width) * 0.02) if stem_norm else None
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + int(stem_norm), width) * 0.02)
        self.ln_pre = nn.LayerNorm(width) if stem_norm else None
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        if self.ln_pre is not None:
            x = self.ln_pre(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos)
        else:
            x = x + self.pos
        for block in self.blocks:
            x = block(x)
        return self.ln(x).mean(dim=1)


class TextTower(nn.Module):
    def __init__(self, vocab: int = 64, context: int = 8, width: int = 32, layers: int = 2, heads: int = 4,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, context, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.ln(x)[:, -1]


class TwoTower(nn.Module):
    """CLIP-style model: two encoders, linear projections, symmetric contrastive loss."""

    def __init__(self, width: int = 32, embed: int = 16, layers: int = 2, dropout: float = 0.0,
                 stem_norm: bool = False) -> None:
        super().__init__()
        self.vision = VisionTower(width=width, layers=layers, dropout=dropout, stem_norm=stem_norm)
        self.text = TextTower(width=width, layers=layers, dropout=dropout)
        self.vision_proj = nn.Linear(width, embed, bias=False)
        self.text_proj = nn.Linear(width, embed, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        v = F.normalize(self.vision_proj(self.vision(images)), dim=-1)
        t = F.normalize(self.text_proj(self.text(tokens)), dim=-1)
        logits = self.logit_scale.exp() * v @ t.t()
        labels = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


class MLP(nn.Module):
    """A single branch: nothing to run concurrently."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()


class GraphBreakModel(nn.Module):
    """Two graphs: a print() between the halves makes Dynamo break the graph."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        print("", end="")  # graph break
        return self.second(h).square().mean()


class Checkpointed(nn.Module):
    """A layer under the user's own activation checkpoint, as Hugging Face's
    ``gradient_checkpointing_enable()`` wraps each encoder layer."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)


def checkpoint_blocks(model: TwoTower) -> TwoTower:
    """`model` with each block of both towers under the user's checkpoint."""
    for tower in (model.vision, model.text):
        tower.blocks = nn.ModuleList(Checkpointed(b) for b in tower.blocks)
    return model


def two_tower_inputs(batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 64, (batch, 8), generator=g)


_HOOKS_LOCK = threading.Lock()


class HookedOnFirstCall(TwoTower):
    """Does work on its first call under a ``threading.Lock``, which Dynamo cannot enter, as Hugging
    Face's output-capturing models install their hooks (LLaVA)."""

    def forward(self, images, tokens):
        if not getattr(self, "hooks_installed", False):
            with _HOOKS_LOCK:
                self.hooks_installed = True
        return super().forward(images, tokens)


def tiny_hf(kind: str):
    """A one-layer Hugging Face ``"clip"`` or ``"siglip"`` model, width 32 (skips the test without
    transformers)."""
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=16)
    vision = dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                  num_attention_heads=4, num_channels=3)
    torch.manual_seed(0)
    if kind == "clip":
        return transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision,
                                                               projection_dim=16))
    return transformers.SiglipModel(transformers.SiglipConfig(text_config=text, vision_config=vision))
