"""An image-text dataset stored as two memory-mapped arrays, and a synthetic one to train on.

The layout (one directory; write your own dataset in it and pass ``--data DIR`` to
``examples/train_clip.py``)::

    DIR/
      meta.json    {"n": N, "image_size": H, "context": T, "vocab": V}   (written last)
      images.u8    N x 3 x H x W  uint8, C order, no header  (RGB, channel-first; H == W)
      tokens.i32   N x T          int32, little-endian, C order, no header

* Example ``i`` is image ``images[i]`` with caption ``tokens[i]``; both files are raw arrays
  (``numpy.memmap``), so a dataset larger than memory is read page by page, and the DataLoader's
  worker processes share the page cache instead of copying the data.
* Tokens follow the CLIP convention that the text tower of ``benchmarks/clip.py`` relies on:
  SOT = ``V - 2`` first, the caption's ids in ``[1, V - 2)``, EOT = ``V - 1`` right after the
  caption (the tower pools at the position of the *largest* id), then ``0`` padding up to ``T``.
* ``meta.json`` may hold more keys (the synthetic set records how it was made under
  ``"synthetic"``); the four above are required and must match the model: ``image_size`` its
  input resolution, ``context`` its context length and ``vocab`` its vocabulary size.

Writing one from numpy arrays ``images`` (uint8, N x 3 x H x W) and ``tokens`` (N x T)::

    from data import write_dataset
    write_dataset("my_data", images, tokens, vocab=512)

or by hand: ``np.memmap(DIR/"images.u8", np.uint8, "w+", shape=(N, 3, H, W))[:] = ...``, the
same for ``tokens.i32`` with ``np.int32`` (``"<i4"``), then ``meta.json``.

:func:`make_synthetic` writes a deterministic synthetic dataset in this layout whose pairs are
learnable: every example has a colour class and a pattern class; its image is the colour plus
the pattern (stripes of a class-specific orientation and frequency) plus noise, and its caption
contains the colour's and the pattern's token ids among random filler ids. A contrastive model
can therefore match images to captions, and its loss goes down.

:class:`MemmapImageText` reads any dataset in this layout: ``dataset[i]`` is
``(image float32 3 x H x W, tokens int64 T)``, the image scaled to ``[-1, 1]`` or normalised with
a per-channel ``mean``/``std`` (in 0..1 units, e.g. the CLIP ones).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

META = "meta.json"
IMAGES = "images.u8"
TOKENS = "tokens.i32"
REQUIRED_KEYS = ("n", "image_size", "context", "vocab")
TOKEN_DTYPE = np.dtype("<i4")

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the OpenAI CLIP normalisation, for real photos
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def config_meta(config: Any) -> dict[str, int]:
    """``{"image_size", "context", "vocab"}`` of a model config (``clip.CLIPConfig``) or a mapping."""
    if isinstance(config, Mapping):
        return {k: int(config[k]) for k in ("image_size", "context", "vocab")}
    return {"image_size": int(config.image_size), "context": int(config.context_length),
            "vocab": int(config.vocab_size)}


def read_meta(root: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``meta.json`` of a dataset directory, checked for the required keys."""
    path = Path(root) / META
    with open(path) as f:
        meta = json.load(f)
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{path}: missing key(s) {', '.join(missing)}; required: {', '.join(REQUIRED_KEYS)}")
    for k in REQUIRED_KEYS:
        if not isinstance(meta[k], int) or meta[k] < 1:
            raise ValueError(f"{path}: {k!r} must be a positive int, got {meta[k]!r}")
    return meta


def _write_meta(root: Path, meta: Mapping[str, Any]) -> None:
    tmp = root / f".{META}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(dict(meta), f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, root / META)  # meta.json appears last, and whole: it marks the dataset complete


def write_dataset(root: str | os.PathLike, images: np.ndarray, tokens: np.ndarray, vocab: int,
                  extra: Mapping[str, Any] | None = None) -> Path:
    """Write uint8 ``images`` (N x 3 x H x W) and ``tokens`` (N x T) in the layout; return the directory."""
    images = np.asarray(images)
    tokens = np.asarray(tokens)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1] != 3 or images.shape[2] != images.shape[3]:
        raise ValueError(f"images must be uint8 N x 3 x H x H, got {images.dtype} {images.shape}")
    if tokens.ndim != 2 or tokens.shape[0] != images.shape[0]:
        raise ValueError(f"tokens must be N x T with N = {images.shape[0]}, got {tokens.shape}")
    if tokens.min(initial=0) < 0 or tokens.max(initial=0) >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab})")
    n, _, h, _ = images.shape
    meta = {"n": int(n), "image_size": int(h), "context": int(tokens.shape[1]), "vocab": int(vocab), **(extra or {})}
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / META).unlink(missing_ok=True)  # incomplete until the new meta.json is written
    images.tofile(root / IMAGES)
    tokens.astype(TOKEN_DTYPE).tofile(root / TOKENS)
    _write_meta(root, meta)
    return root


def _patterns(count: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` stripe patterns (size x size, values in [-1, 1]) of distinct orientation and frequency."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    out = np.empty((count, size, size), np.float32)
    for k in range(count):
        angle = np.pi * k / count + rng.uniform(0, np.pi / (2 * count))
        freq = 1.5 + 2.5 * ((k * 5) % count) / max(count - 1, 1)  # 1.5 .. 4 periods per image
        phase = rng.uniform(0, 2 * np.pi)
        out[k] = np.sign(np.sin(2 * np.pi * freq * (np.cos(angle) * xx + np.sin(angle) * yy) + phase))
    return out


def make_synthetic(root: str | os.PathLike, n: int, config: Any, seed: int = 0,
                   colours: int = 8, patterns: int = 8, chunk: int = 1024) -> Path:
    """Write a synthetic dataset of ``n`` examples for ``config`` (a ``clip.CLIPConfig`` or a
    mapping with ``image_size``, ``context``, ``vocab``) in ``root``; deterministic in ``seed``.

    Example ``i`` has colour class ``a`` and pattern class ``b`` (``colours x patterns`` classes,
    64 by default). Image: the class colour + 48 x the class stripe pattern (per channel sign
    drawn per pattern) + Gaussian noise (std 24), clipped to uint8. Caption: SOT, then a random
    length of filler ids with the colour id and the pattern id at random positions, then EOT and
    padding. Class ids are drawn from the vocabulary once per seed, never used as fillers.
    """
    m = config_meta(config)
    size, ctx, vocab = m["image_size"], m["context"], m["vocab"]
    if n < 1:
        raise ValueError("n must be >= 1")
    if ctx < 4:
        raise ValueError("context must be >= 4 (SOT, colour, pattern, EOT)")
    if vocab < colours + patterns + 8:
        raise ValueError(f"vocab {vocab} too small for {colours} + {patterns} class ids and fillers")
    rng = np.random.default_rng(seed)
    sot, eot = vocab - 2, vocab - 1
    ids = rng.permutation(np.arange(1, sot))
    colour_ids, pattern_ids = ids[:colours], ids[colours:colours + patterns]
    fillers = np.sort(ids[colours + patterns:])
    palette = rng.uniform(40, 216, size=(colours, 3)).astype(np.float32)
    signs = rng.choice([-1.0, 1.0], size=(patterns, 3, 1, 1)).astype(np.float32)
    stripes = _patterns(patterns, size, rng)[:, None] * signs  # patterns x 3 x H x W

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / META).unlink(missing_ok=True)
    images = np.memmap(root / IMAGES, np.uint8, "w+", shape=(n, 3, size, size))
    tokens = np.memmap(root / TOKENS, TOKEN_DTYPE, "w+", shape=(n, ctx))
    for start in range(0, n, chunk):
        b = min(chunk, n - start)
        a = rng.integers(0, colours, b)
        p = rng.integers(0, patterns, b)
        img = rng.standard_normal((b, 3, size, size), dtype=np.float32)
        img *= 24.0
        img += palette[a][:, :, None, None]
        img += 48.0 * stripes[p]
        np.clip(img, 0, 255, out=img)
        images[start:start + b] = img.astype(np.uint8)  # truncation: values in [0, 255]

        tok = np.zeros((b, ctx), TOKEN_DTYPE)
        length = rng.integers(2, ctx - 1, b)  # caption ids between SOT and EOT: 2 .. ctx - 2
        body = fillers[rng.integers(0, len(fillers), (b, ctx - 2))]
        pos_a = rng.integers(0, length)
        pos_p = (pos_a + rng.integers(1, length)) % length  # a different position
        rows = np.arange(b)
        body[rows, pos_a] = colour_ids[a]
        body[rows, pos_p] = pattern_ids[p]
        cols = np.arange(ctx - 2)[None, :]
        tok[:, 0] = sot
        tok[:, 1:ctx - 1] = np.where(cols < length[:, None], body, 0)
        tok[rows, 1 + length] = eot
        tokens[start:start + b] = tok
    images.flush()
    tokens.flush()
    del images, tokens
    _write_meta(root, {"n": int(n), "image_size": size, "context": ctx, "vocab": vocab,
                       "synthetic": {"seed": seed, "colours": colours, "patterns": patterns}})
    return root


def ensure_synthetic(root: str | os.PathLike, n: int, config: Any, seed: int = 0) -> tuple[Path, bool]:
    """Make the synthetic dataset in ``root`` unless a complete one for ``config`` is there.

    Returns ``(root, created)``. A *synthetic* dataset there made for another config, size or seed
    is replaced; a user's dataset (no ``"synthetic"`` key in ``meta.json``) is never touched.
    """
    root = Path(root)
    want = config_meta(config)
    if (root / META).exists():
        meta = read_meta(root)
        syn = meta.get("synthetic")
        if syn is None or ({k: meta[k] for k in want} == want and meta["n"] == n and syn.get("seed") == seed):
            return root, False
    return make_synthetic(root, n, config, seed=seed), True


class MemmapImageText(torch.utils.data.Dataset):
    """Image-text pairs of a dataset directory in the layout above.

    ``dataset[i]`` -> ``(image, tokens)``: ``image`` float32 (3, H, W) in ``[-1, 1]`` (``u8 / 127.5 - 1``),
    or ``(u8 / 255 - mean) / std`` per channel when ``mean`` and ``std`` are given; ``tokens``
    int64 (T,). ``__getitems__`` reads a whole batch with one sorted memmap gather (the DataLoader
    calls it when it is given a batch sampler).

    The memmaps are opened lazily in each process, so the dataset pickles cheaply to DataLoader
    workers (an open ``np.memmap`` would be pickled as a full in-memory copy).
    """

    def __init__(self, root: str | os.PathLike, mean: Sequence[float] | None = None,
                 std: Sequence[float] | None = None) -> None:
        self.root = Path(root)
        self.meta = read_meta(self.root)
        self.n = self.meta["n"]
        self.image_size = self.meta["image_size"]
        self.context = self.meta["context"]
        self.vocab = self.meta["vocab"]
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither (then images are scaled to [-1, 1])")
        if mean is not None:
            m, s = (torch.tensor(v, dtype=torch.float32).view(3, 1, 1) for v in (mean, std))
            self.scale, self.shift = 1.0 / (255.0 * s), -m / s  # (u8 / 255 - mean) / std
        else:
            self.scale, self.shift = torch.tensor(1.0 / 127.5), torch.tensor(-1.0)
        for name, itemsize, per in ((IMAGES, 1, 3 * self.image_size ** 2), (TOKENS, 4, self.context)):
            path = self.root / name
            expected = self.n * per * itemsize
            actual = path.stat().st_size if path.exists() else None
            if actual != expected:
                raise ValueError(f"{path}: expected {expected} bytes for meta.json's n={self.n} "
                                 f"({'missing' if actual is None else f'found {actual}'})")
        self._images: np.ndarray | None = None
        self._tokens: np.ndarray | None = None

    def check_compatible(self, config: Any) -> None:
        """Raise ValueError naming the mismatch if the model ``config`` cannot read this dataset."""
        want = config_meta(config)
        bad = [f"{k} {self.meta[k]} (model: {want[k]})" for k in want if self.meta[k] != want[k]]
        if bad:
            raise ValueError(f"dataset {self.root} does not fit the model: {', '.join(bad)}")

    def _open(self) -> tuple[np.ndarray, np.ndarray]:
        if self._images is None:
            s, t = self.image_size, self.context
            self._images = np.memmap(self.root / IMAGES, np.uint8, "r", shape=(self.n, 3, s, s))
            self._tokens = np.memmap(self.root / TOKENS, TOKEN_DTYPE, "r", shape=(self.n, t))
        return self._images, self._tokens

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_images"] = state["_tokens"] = None
        return state

    def __len__(self) -> int:
        return self.n

    def _convert(self, images: np.ndarray, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        img = torch.from_numpy(np.array(images, dtype=np.float32)).mul_(self.scale).add_(self.shift)
        return img, torch.from_numpy(np.array(tokens, dtype=np.int64))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.n <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} examples")
        images, tokens = self._open()
        return self._convert(images[index], tokens[index])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        images, tokens = self._open()
        idx = np.asarray(indices, dtype=np.int64)
        order = np.argsort(idx, kind="stable")  # read the memmap in file order, return in given order
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        img, tok = self._convert(images[idx[order]][inverse], tokens[idx[order]][inverse])
        return list(zip(img.unbind(0), tok.unbind(0)))

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images (B, 3, H, W), tokens (B, T))`` for ``indices``, read in the calling process."""
        items = self.__getitems__(indices)
        return torch.stack([i for i, _ in items]), torch.stack([t for _, t in items])
