"""``apollo::mm_into(out, a, b, out_dtype=None)``: ``a @ b`` written into the buffer `out`.

The main-allocated gradients pass (``passes/main_allocated.py``) picks side-lane gradients that a
matmul makes; ``runtime/subgraphs.py`` replaces each such matmul, and the transposes after it
(:func:`matmul_of`), with this op writing into a buffer the main lane allocated. Inductor rejects
``out=`` ops but runs a mutating op on the input it mutates, with no temporary and no copy; a
functional matmul copied into the buffer would go through a temporary of its own
(docs/design/main-allocated-gradients.md#only-matmuls).

Registered here: the schema, one CompositeExplicitAutograd kernel (Python; it runs where the graph
is not replayed as a CUDA graph) and a fake kernel (the op returns nothing). No Inductor lowering:
Inductor calls the kernel as a fallback.
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["MATMULS", "TRANSPOSES", "matmul_of", "mm_into"]

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.mm.dtype)  # what `mm_into` writes in place
TRANSPOSES = (torch.ops.aten.t.default, torch.ops.aten.permute.default)

_LIBRARY = torch.library.Library("apollo", "FRAGMENT")
_LIBRARY.define("mm_into(Tensor(a!) out, Tensor self, Tensor mat2, ScalarType? out_dtype=None) -> ()")


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> None:
    """``a @ b`` written into `out`."""
    if out_dtype is None:
        torch.mm(a, b, out=out)
    elif out.device.type == "cuda":
        torch.ops.aten.mm.dtype_out(a, b, out_dtype, out=out)
    else:  # mm.dtype has CUDA kernels only: the same products, accumulated in out_dtype
        torch.mm(a.to(out_dtype), b.to(out_dtype), out=out)


_LIBRARY.impl("mm_into", _mm_into, "CompositeExplicitAutograd")
torch.library.register_fake("apollo::mm_into", lambda *args, **kwargs: None, lib=_LIBRARY)
mm_into = torch.ops.apollo.mm_into.default


def matmul_of(n: torch.fx.Node) -> tuple[torch.fx.Node, bool, list[torch.fx.Node]] | None:
    """(the matmul that makes `n`, whether `n` is its transpose, the nodes from the matmul up to
    `n`'s input), or None: `n` is a matmul, or transposes of one that nothing else reads (a linear
    layer's weight gradient, as AOTAutograd traces it: ``t(mm(t(dY), X))``, at times ``t(t(mm))``);
    ``(A @ B).T`` is written as ``B.T @ A.T``."""
    chain, x = [], n
    while (x.op == "call_function" and x.target in TRANSPOSES
           and (x.target is torch.ops.aten.t.default or list(x.args[1]) in ([1, 0], [-1, -2]))):
        x = x.args[0]
        if not isinstance(x, torch.fx.Node) or len(x.users) != 1:
            return None
        chain.append(x)
    if x.op != "call_function" or x.target not in MATMULS:
        return None
    return x, len(chain) % 2 == 1, chain
