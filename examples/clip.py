"""A tiny CLIP-style model and a batch for it, for ``python -m apollo_compile report``:

    python -m apollo_compile report examples/clip.py:build --out report.html --trace trace.json
    python -m apollo_compile report examples/clip.py:build --out report.html --option device=H200

The model is ``benchmarks/clip.py``'s "tiny" configuration (two 2-layer towers, projections,
contrastive loss); ``forward(images, tokens)`` returns the loss, so the report covers the forward
and the backward graph.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import clip  # noqa: E402  (benchmarks/clip.py)


def build(batch: int = 8):
    """(model, (images, tokens)): the tiny CLIP-style model and one batch."""
    return clip.build(config="tiny"), clip.make_batch(batch, config="tiny")


if __name__ == "__main__":
    model, (images, tokens) = build()
    print(model.__class__.__name__, tuple(images.shape), tuple(tokens.shape), float(model(images, tokens)))
