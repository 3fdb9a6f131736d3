"""Updates pass: in a whole step with its optimizer inside, each parameter's update runs as soon as
its gradient is complete, not after the whole backward.

Reads and reorders the graph (no annotations); returns how many nodes moved.

AOTAutograd traces the step in program order: the forward, the whole backward, then the optimizer
(``compile_step(..., optimizer=)``), so every gradient is alive at once at the backward's end,
although each is dead once its parameter is updated. This pass moves the update region, the ops
that only feed writes into the parameters and the optimizer's state, next to the gradients they
read (docs/design/step-passes.md#updates):

- an update op that reads a gradient (or another such op) goes right after the last of those it
  reads: the gradient dies there;
- an update op that reads only graph inputs (weight decay, the bias corrections) goes right
  before its first user: a parameter-sized temporary made early would live through the graph;
- a write into an input comes after every reader of that input (docs/design/lanes.md#writes-after-readers);
  a write of a value placed late (the new step counters) and each item taken of a multi-output
  op's result come right after it, so Inductor writes the counters in place in the kernel that
  computes them.

The other nodes keep their order. The update region is found from the dataflow: each write into
an input, and every op the autograd engine did not trace whose users are all in the region. A
graph that writes no input is left as it is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..nodes import readers_of, written_inputs
from .modality import traced_from_autograd


def update_region(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The ops that only feed writes into the step's inputs: each write, and every op the autograd
    engine did not trace whose users are all in the region."""
    region: set[torch.fx.Node] = set()
    for n in reversed(nodes):  # users come after their inputs
        if n.op != "call_function" or traced_from_autograd(n):
            continue
        if written_inputs(n) or (n.users and all(u in region for u in n.users)):
            region.add(n)
    return region


def _follows_its_inputs(n: torch.fx.Node) -> bool:
    """An item of a multi-output op (free: no memory of its own) or a write nothing reads: placed
    right after what it reads, not by its users."""
    return n.target is operator.getitem or (not n.users and bool(written_inputs(n)))


def reordered(nodes: list[torch.fx.Node], region: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """`nodes` with the region's ops moved (see the module docstring); the others keep their order.
    Each region op gets a slot, the base node it follows: the last of the non-input nodes it reads
    (and, for a write, of the other readers of what it writes); an op whose inputs are all graph
    inputs or such ops takes the slot of its first user instead, except an item of its result or
    a write nothing reads, which follow it (`_follows_its_inputs`)."""
    base = [n for n in nodes if n not in region]
    pos = {n: i for i, n in enumerate(base)}
    slot: dict[torch.fx.Node, int] = {}

    def after_what_it_reads(n: torch.fx.Node, default: int) -> int:
        deps = [a for a in n.all_input_nodes if a.op != "placeholder"]
        deps += [r for x in written_inputs(n) for r in readers_of(x) if r is not n]
        return max((pos[a] if a in pos else slot[a] for a in deps), default=default)

    for n in nodes:  # as soon as possible; -1: decided by its users
        if n in region:
            slot[n] = after_what_it_reads(n, -1)
    last = len(base) - 1  # the output node
    needed: dict[torch.fx.Node, int] = {}  # for those: the slot of their first user
    for n in reversed(nodes):  # as late as possible, for those
        if n in region and slot[n] < 0:
            needed[n] = min((needed.get(u, slot[u]) for u in n.users if u in region and needed.get(u, slot[u]) >= 0),
                            default=last)
            if not _follows_its_inputs(n):
                slot[n] = needed[n]
    for n in nodes:  # an item of such an op, and a write nothing reads: right after what they read
        if n in region and slot[n] < 0:
            slot[n] = after_what_it_reads(n, last)
    after: dict[int, list[torch.fx.Node]] = {}
    for n in nodes:
        if n in region:
            after.setdefault(min(slot[n], last), []).append(n)
    order: list[torch.fx.Node] = []
    for i, b in enumerate(base):
        if i == last:  # nothing goes after the output
            order.extend(after.get(i, []))
            order.append(b)
        else:
            order.append(b)
            order.extend(after.get(i, []))
    return order


def run(gm: torch.fx.GraphModule, ctx) -> dict:
    nodes = list(gm.graph.nodes)
    if ctx.kind != "inference" or not any(written_inputs(n) for n in nodes):
        return {"moved": 0}
    region = update_region(nodes)
    order = reordered(nodes, region)
    moved = sum(a is not b for a, b in zip(order, nodes))
    prev = None
    for n in order:
        if prev is not None and prev.next is not n:
            prev.append(n)
        prev = n
    gm.graph.lint()
    gm.recompile()
    return {"moved": moved, "region": len(region)}
