"""The one annotation every pass reads and writes: ``node.meta["apollo"]``.

Each pass owns some fields (named beside them) and only reads the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

KEY = "apollo"

FUSION = "fusion"  # label of a node that joins several modalities (a contrastive loss, a fusion layer)


@dataclass
class NodeInfo:
    # modality pass
    modality: str | None = None
    recomputed: bool = False  # a forward op the partitioner recomputes in the backward
    backward: bool = False  # computes gradients (a backward graph's ops, a whole step's backward part)
    # cost pass
    flops: int = 0
    bytes: int = 0
    intensity: float = 0.0  # FLOP per byte
    bound: str = "-"  # "compute", "memory", or "-" for views, placeholders, outputs
    est_us: float = 0.0  # roofline estimate on the planned device
    library: bool = False  # a matmul, convolution or attention kernel (apollo_compile.nodes.is_library_kernel)
    # casts pass (on the Dynamo graph, carried to ATen nodes through meta["custom"])
    cast: str | None = None  # this node is a cast apollo inserted, to this dtype ("bf16", ...)
    # checkpoint pass
    saved: bool = False  # a forward value the backward reads (saved, not recomputed)
    # offload pass
    transfer: str | None = None  # a copy of a saved value "to host" (forward) or "to device" (backward)
    # lanes pass
    lane: int | None = None
    subgraph: int | None = None
    copy_of: str | None = None  # boundary recompute: the node whose value this computes again past a cut


def info(node: torch.fx.Node) -> NodeInfo:
    """The node's annotation, created empty on first access."""
    ann = node.meta.get(KEY)
    if ann is None:
        ann = node.meta[KEY] = NodeInfo()
    return ann
