"""Static memory plan for the buffers that cross subgraph boundaries.

Subgraphs on different lanes (CUDA streams) run concurrently, so the caching allocator's
stream-ordered reuse is not enough to share memory safely between them: the plan places one arena
up front and gives every boundary buffer a fixed byte offset. Two buffers may share bytes only if
one is *certainly* dead before the other is born in every interleaving the DAG allows.

Pure algorithm (networkx only, no torch) so that it can be property-tested on random DAGs.

[NOTE] Dead-before means strict ancestors in the happens-before DAG. Buffer A is dead before
buffer B iff A's producer and every consumer of A are *strict* ancestors of B's producer::

    s1 --A--> s2 --B--> s3        s2 reads A and writes B: sharing bytes, its first store
                                  into B could clobber A before its last load.

Program order is not enough across lanes: two lanes order each other only where an event wait (a
DAG edge) says so; within one lane the caller encodes program order as chain edges. So the planner
looks at ancestors in the DAG, never at lane ids or list positions
(docs/design/lanes.md#memory-plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Iterator, Sequence

import networkx as nx

__all__ = [
    "Buffer",
    "Placement",
    "MemoryPlan",
    "dead_before",
    "may_be_live_together",
    "plan_memory",
    "check_plan",
]

Node = Hashable  # a subgraph id (int) or a sentinel such as "output"


@dataclass(frozen=True)
class Buffer:
    """A tensor that crosses subgraph boundaries; live from its producer's start to its last consumer's end."""

    name: str
    nbytes: int
    producer: int | str  # subgraph id (dag node) whose start makes the buffer live
    consumers: tuple = ()  # dag nodes that read it; a sink node models "outlives the graph"
    lane: int = 0  # informational only: safety comes from the DAG, never from lanes

    def footprint(self) -> tuple:
        """Every subgraph during which the buffer may be live (producer and consumers)."""
        return (self.producer, *self.consumers)


@dataclass(frozen=True)
class Placement:
    """Where a buffer lives in the arena."""

    buffer: Buffer
    offset: int  # byte offset in the arena, a multiple of the plan's alignment


@dataclass
class MemoryPlan:
    """The arena layout; `placements` follow the input order of the buffers.

    Treat `placements` as immutable: `offset_of` uses an index built at construction (make a new
    plan, e.g. with `dataclasses.replace`, to change it).
    """

    placements: list[Placement]
    arena_bytes: int  # size of the arena: max(offset + aligned size)
    total_bytes: int  # sum of the aligned buffer sizes, i.e. what no reuse would need
    alignment: int = 512
    # buffer name -> consumers that are not ordered before another consumer (shown by to_text)
    last_consumers: dict[str, tuple] = field(default_factory=dict)
    _by_name: dict[str, Placement] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_name = {p.buffer.name: p for p in self.placements}

    def offset_of(self, name: str) -> int:
        """Byte offset of the buffer called `name` (KeyError names the buffer if unknown)."""
        try:
            return self._by_name[name].offset
        except KeyError:
            raise KeyError(f"no buffer named {name!r} in this memory plan") from None

    @property
    def saved_fraction(self) -> float:
        """Share of `total_bytes` that reuse saves (0.0 when there is nothing to place)."""
        return 1.0 - self.arena_bytes / self.total_bytes if self.total_bytes else 0.0

    def to_text(self) -> str:
        """A deterministic table (rows by offset, then name) plus a summary line; no addresses."""
        header = ("buffer", "bytes", "offset", "producer", "last consumers", "lane")
        rows = []
        for p in sorted(self.placements, key=lambda p: (p.offset, p.buffer.name)):
            b = p.buffer
            last = self.last_consumers.get(b.name)
            if last is None:
                last = _sorted_nodes(set(b.consumers))
            rows.append((b.name, str(b.nbytes), str(p.offset), str(b.producer),
                         ", ".join(map(str, last)) or "-", str(b.lane)))
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
        numeric = {1, 2, 5}

        def fmt(cells: Sequence[str]) -> str:
            out = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
            return "  ".join(out).rstrip()

        lines = [fmt(header), "  ".join("-" * w for w in widths)]
        lines += [fmt(r) for r in rows]
        lines.append(f"arena {self.arena_bytes} bytes vs {self.total_bytes} bytes without reuse "
                     f"({100.0 * self.saved_fraction:.1f}% saved)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """A JSON-serialisable dict (node ids kept as they are: ints or strings)."""
        return {
            "alignment": self.alignment,
            "arena_bytes": self.arena_bytes,
            "total_bytes": self.total_bytes,
            "placements": [
                {
                    "name": p.buffer.name,
                    "nbytes": p.buffer.nbytes,
                    "offset": p.offset,
                    "producer": p.buffer.producer,
                    "consumers": list(p.buffer.consumers),
                    "last_consumers": list(self.last_consumers.get(p.buffer.name, ())),
                    "lane": p.buffer.lane,
                }
                for p in self.placements
            ],
        }


# ----------------------------------------------------------------------------------------------
# Liveness relation (reference versions: one nx.ancestors call each, fine for a few queries)
# ----------------------------------------------------------------------------------------------


def dead_before(a: Buffer, b: Buffer, dag: nx.DiGraph) -> bool:
    """True iff `a` is dead before `b` is born in every interleaving the DAG allows.

    That is: a's producer and all of a's consumers are strict ancestors of b's producer (see the
    [NOTE] in the module docstring for why "equal" does not count).
    """
    ancestors = nx.ancestors(dag, b.producer)  # strict: never contains b.producer itself
    return all(n in ancestors for n in a.footprint())


def may_be_live_together(a: Buffer, b: Buffer, dag: nx.DiGraph) -> bool:
    """True iff some interleaving has `a` and `b` live at the same time (so they can't share bytes)."""
    return not dead_before(a, b, dag) and not dead_before(b, a, dag)


# ----------------------------------------------------------------------------------------------
# Planner
# ----------------------------------------------------------------------------------------------


def _align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _node_key(n: Any) -> tuple:
    # Ints first in numeric order, then everything else by its text: deterministic for mixed ids.
    if isinstance(n, int) and not isinstance(n, bool):
        return (0, n, "")
    return (1, 0, str(n))


def _sorted_nodes(nodes: Iterable[Any]) -> tuple:
    return tuple(sorted(nodes, key=_node_key))


def _set_bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of `mask`, lowest first (via the binary string: fast in CPython)."""
    s = format(mask, "b")[::-1]
    j = s.find("1")
    while j != -1:
        yield j
        j = s.find("1", j + 1)


def _ancestor_masks(dag: nx.DiGraph) -> tuple[dict[Any, int], dict[Any, int]]:
    """Bit per node and strict-ancestor bitmask per node, in one topological sweep.

    O(V + E) big-int ORs instead of one nx.ancestors traversal per node.
    """
    try:
        order = list(nx.topological_sort(dag))
    except nx.NetworkXUnfeasible:
        raise ValueError("memory plan: the happens-before graph has a cycle") from None
    bit = {n: 1 << i for i, n in enumerate(order)}
    anc: dict[Any, int] = {}
    for n in order:
        m = 0
        for p in dag.predecessors(n):
            m |= anc[p] | bit[p]
        anc[n] = m
    return bit, anc


def _validate(dag: nx.DiGraph, buffers: Sequence[Buffer], alignment: int) -> None:
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"memory plan: alignment must be a positive int, got {alignment!r}")
    seen: set[str] = set()
    for b in buffers:
        if b.name in seen:
            raise ValueError(f"memory plan: two buffers are called {b.name!r}")
        seen.add(b.name)
        if not isinstance(b.nbytes, int) or b.nbytes < 0:
            raise ValueError(f"memory plan: buffer {b.name!r} has invalid size {b.nbytes!r}")
        for n in b.footprint():
            if n not in dag:
                raise ValueError(f"memory plan: buffer {b.name!r} uses subgraph {n!r}, which is not in the DAG")


def plan_memory(dag: nx.DiGraph, buffers: Sequence[Buffer], alignment: int = 512) -> MemoryPlan:
    """Give each buffer an aligned arena offset so that possibly-live-together buffers never overlap.

    Greedy by size (as in the TFLite / tinygrad planners): largest buffers first (ties by name, so
    the plan does not depend on input order), each at the lowest aligned offset clear of every
    already-placed buffer it conflicts with. Zero-byte buffers sit at offset 0 and conflict with
    nothing.

    Cost: ancestor bitmasks in O(V + E); conflicts in O(B * P) big-int ops (P = distinct
    producers), as one bitmask of conflicting buffers per buffer; placement O(B * k log k) with k
    conflicting buffers already placed. No O(B^3) step, and ~2000 buffers take well under a second.
    """
    buffers = list(buffers)
    _validate(dag, buffers, alignment)
    bit, anc = _ancestor_masks(dag)

    # Footprint bitmask: subgraphs during which the buffer may be live.
    footprint = {b.name: _or_bits(bit, b.footprint()) for b in buffers}

    # Last consumers: those no other consumer of the same buffer waits for (for the report only).
    last_consumers: dict[str, tuple] = {}
    for b in buffers:
        cons = set(b.consumers)
        last_consumers[b.name] = _sorted_nodes(
            c for c in cons if not any(anc[d] & bit[c] for d in cons if d != c))

    # Buffers that take space, in placement order; bit i of a conflict mask is order[i].
    order = sorted((b for b in buffers if b.nbytes > 0), key=lambda b: (-b.nbytes, b.name))
    producers = _sorted_nodes({b.producer for b in order})

    # dead(a, p): a is dead before anything produced by p is born  <=>  footprint(a) ⊆ anc(p).
    # born_with[p]: buffers (as a bitmask) whose producer is p.
    # not_dead_at[p]: buffers that are NOT dead before p starts.
    born_with = dict.fromkeys(producers, 0)
    not_dead_at = dict.fromkeys(producers, 0)
    for i, b in enumerate(order):
        born_with[b.producer] |= 1 << i
    alive_at_births: list[int] = []  # per buffer: buffers born while it may still be live
    for i, b in enumerate(order):
        fp = footprint[b.name]
        m = 0
        for p in producers:
            if fp & ~anc[p]:  # some footprint node is not a strict ancestor of p
                m |= born_with[p]
                not_dead_at[p] |= 1 << i
        alive_at_births.append(m)
    # a and b conflict iff neither is dead before the other is born (symmetric by construction).
    conflicts = [alive_at_births[i] & not_dead_at[b.producer] & ~(1 << i) for i, b in enumerate(order)]

    offset: dict[str, int] = {b.name: 0 for b in buffers}
    starts: list[int] = []
    ends: list[int] = []  # aligned ends, so every candidate offset stays aligned
    for i, b in enumerate(order):
        size = _align_up(b.nbytes, alignment)
        placed = conflicts[i] & ((1 << i) - 1)  # bits below i are the buffers placed so far
        intervals = sorted((starts[j], ends[j]) for j in _set_bits(placed))
        cand = 0
        for s, e in intervals:
            if s >= cand + size:
                break  # the gap before this interval fits; later ones start even later
            if e > cand:
                cand = e
        offset[b.name] = cand
        starts.append(cand)
        ends.append(cand + size)

    placements = [Placement(b, offset[b.name]) for b in buffers]
    arena = max(ends, default=0)
    total = sum(_align_up(b.nbytes, alignment) for b in buffers)
    return MemoryPlan(placements, arena, total, alignment, last_consumers)


def _or_bits(bit: dict[Any, int], nodes: Iterable[Any]) -> int:
    m = 0
    for n in nodes:
        m |= bit[n]
    return m


# ----------------------------------------------------------------------------------------------
# Invariant checker
# ----------------------------------------------------------------------------------------------


def check_plan(plan: MemoryPlan, dag: nx.DiGraph) -> list[str]:
    """Violations of the plan's invariants; an empty list means the plan is safe.

    Checks: offsets non-negative and aligned, every buffer inside the arena, and no two buffers
    that may be live together share a byte. Independent of the planner's bitmask machinery: it
    sweeps byte ranges by offset and asks `nx.ancestors` (cached per producer) only for pairs that
    overlap in memory.
    """
    problems: list[str] = []
    for p in plan.placements:
        b = p.buffer
        if p.offset < 0:
            problems.append(f"{b.name}: negative offset {p.offset}")
        if plan.alignment > 0 and p.offset % plan.alignment:
            problems.append(f"{b.name}: offset {p.offset} is not a multiple of {plan.alignment}")
        if b.nbytes > 0 and p.offset + b.nbytes > plan.arena_bytes:
            problems.append(f"{b.name}: [{p.offset}, {p.offset + b.nbytes}) exceeds the arena "
                            f"of {plan.arena_bytes} bytes")

    ancestors: dict[Any, set] = {}

    def anc(n: Any) -> set:
        if n not in ancestors:
            ancestors[n] = nx.ancestors(dag, n)
        return ancestors[n]

    def dead(a: Buffer, b: Buffer) -> bool:
        return all(n in anc(b.producer) for n in a.footprint())

    # Sweep by offset: compare each buffer only with the earlier-starting ones still "open" at its start.
    spans = sorted((p for p in plan.placements if p.buffer.nbytes > 0), key=lambda p: (p.offset, p.buffer.name))
    open_: list[Placement] = []
    for p in spans:
        open_ = [q for q in open_ if q.offset + q.buffer.nbytes > p.offset]
        for q in open_:
            a, b = q.buffer, p.buffer
            if not dead(a, b) and not dead(b, a):
                problems.append(
                    f"{a.name} [{q.offset}, {q.offset + a.nbytes}) and {b.name} [{p.offset}, "
                    f"{p.offset + b.nbytes}) overlap but may be live together "
                    f"(producers {a.producer!r} and {b.producer!r})")
        open_.append(p)
    return problems
