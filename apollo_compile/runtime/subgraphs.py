"""Cut a subgraph out of the full graph as its own GraphModule and compile it.

Each subgraph takes its inputs as a list (boxed calling convention) and returns its outputs in
the order the codegen pass expects. ``inductor`` compiles it with ``compile_fx_inner`` (what
Inductor itself runs on each AOTAutograd graph), ``eager`` runs the ATen ops as they are. Two
values are written into memory the subgraph is handed rather than a buffer of its own: a
main-allocated gradient (``mm_into``) and an elementwise chain's result where the chain is the last
reader of an input (:func:`written_in_place`).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Callable

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from ..annotations import info
from ..lane_plan import Subgraph
from ..nodes import is_elementwise, readers_of, storage_node
from ..ops.mm_into import matmul_of, mm_into
from ..tracing import fw_metadata


def extract(gm: torch.fx.GraphModule, sg: Subgraph) -> torch.fx.GraphModule:
    """`sg` as a graph of its own: its inputs, then a buffer per value in ``sg.main_allocated``,
    which the value's matmul writes (``apollo::mm_into``) and which stands for the value after
    (passes/main_allocated.py)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in sg.inputs:
        ph = graph.placeholder(n.name)
        ph.meta = dict(n.meta)
        env[n] = ph
    written: dict[torch.fx.Node, torch.fx.Node] = {}  # value -> the buffer it is written into
    for n in sg.main_allocated:
        ph = graph.placeholder(f"{n.name}_buffer")
        ph.meta = {"val": n.meta["val"]}
        written[n] = ph
    matmuls = {n: matmul_of(n) for n in written}
    into = written_in_place(sg)
    folded = {x for _, _, chain in matmuls.values() for x in chain}  # made by the mm_into of the value they make
    for n in sg.nodes:
        if n in folded:
            continue
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:  # a lifted constant (HF LLaVA's): the subgraph module holds it too
                env[a] = graph.get_attr(a.target)
                env[a].meta = dict(a.meta)
        if n in written:  # the matmul writes the buffer itself: no temporary of its size
            m, transposed, _ = matmuls[n]
            a, b = (env[x] for x in m.args[:2])
            if transposed:  # (a @ b).T == b.T @ a.T
                a, b = (_transposed(graph, x) for x in (b, a))
            graph.call_function(mm_into, (written[n], a, b, *m.args[2:])).meta = {"val": None}
            env[n] = written[n]
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
        if n in into:  # the value goes into a dying input's memory: no buffer of its own
            copy = graph.call_function(torch.ops.aten.copy_.default, (env[into[n]], env[n]))
            copy.meta = {"val": into[n].meta["val"]}
            env[n] = copy
    out = graph.output(tuple(env[n] for n in sg.outputs))
    out.meta["user_visible_output_idxs"] = list(range(len(sg.outputs)))
    sub = torch.fx.GraphModule(gm, graph, class_name=f"Subgraph{sg.id}")
    return sub


def written_in_place(sg: Subgraph) -> dict[torch.fx.Node, torch.fx.Node]:
    """value -> the input of `sg` whose memory it is written into.
    An elementwise chain in `sg` that is the only reader of an input's memory ends by writing its
    value there: the sum of micro-batches' gradients takes the first micro-batch's memory rather
    than a buffer of its own (docs/design/whole-step.md#what-micro-batches-cost). Inductor fuses the
    chain and the ``copy_`` into one kernel writing the input. The input is a value of this graph
    that nothing else reads (not a graph input, not returned, no other view of its memory read),
    made by an op whose output aliases nothing (:func:`_fresh`); the chain has its shape, dtype and
    strides throughout. An input another lane made qualifies too: `sg` waits for the subgraph that
    made it, which never reads it again, and the runtime holds it until the lanes join
    (``keep_alive``), so its stream cannot reuse the block before then, and the chain's result
    costs nothing beside it (docs/design/lanes.md#staggered-sums)."""
    inside, found = set(sg.nodes), {}
    for a in sg.inputs:
        base = storage_node(a)
        if base in inside or not _fresh(base):
            continue
        readers = readers_of(base)
        if len(readers) != 1 or readers[0] not in inside:
            continue
        x = readers[0]
        views = [v for v in x.all_input_nodes if storage_node(v) is base]
        # the chain reads the input itself: a view made in the subgraph would be written through
        if len(views) != 1 or views[0] in inside or not _same_layout(x, views[0]):
            continue
        while len(x.users) == 1 and (u := next(iter(x.users))) in inside and _same_layout(u, views[0]):
            x = u
        if x not in found:
            found[x] = views[0]
    return found


def _fresh(n: torch.fx.Node) -> bool:
    """Whether `n` is a tensor of its own: the output of an ATen op that writes nothing and returns
    no alias, or an item of such an op's tuple (a layer norm's or a convolution's weight gradient)."""
    if n.op == "call_function" and n.target is operator.getitem:
        n = n.args[0]
    target = getattr(n, "target", None)
    return (n.op == "call_function" and isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and not any(r.alias_info is not None for r in target._schema.returns))


def _same_layout(n: torch.fx.Node, like: torch.fx.Node) -> bool:
    """Whether `n` is an elementwise op whose tensor has `like`'s shape, dtype, strides and device."""
    if not is_elementwise(n):
        return False
    v, w = n.meta.get("val"), like.meta.get("val")
    if not isinstance(w, torch.Tensor) or v.dtype != w.dtype or v.device != w.device or v.dim() != w.dim():
        return False
    # symbolic sizes compare without a guard: equal only where the shape environment knows it
    return all(statically_known_true(sym_eq(x, y)) for x, y in ((tuple(v.shape), tuple(w.shape)),
                                                                  (tuple(v.stride()), tuple(w.stride()))))


def _transposed(graph: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
    t = graph.call_function(torch.ops.aten.t.default, (x,))
    t.meta = {"val": x.meta["val"].t()}
    return t


def example_inputs(sg: Subgraph) -> list:
    return [n.meta.get("val") for n in sg.inputs] + [n.meta["val"] for n in sg.main_allocated]


def inductor_config(host_copies: bool = False, symbolic: bool = False, free_at_last_use: bool = False):
    """The Inductor settings apollo compiles with: random ops stay ATen calls on torch's generator.

    Inductor otherwise lowers ``rand`` only after its joint-graph pass rewrote it to seeded
    ``inductor_random`` with one fused seed buffer per graph, and asserts if not; apollo cuts the
    graph into subgraphs, and its checkpoint pass saves random outputs rather than recompute them.
    With the fallback, random ops draw from torch's generator in graph order, like eager ATen.

    A subgraph that copies saved values to the host or back (offload pass) keeps the graph's
    order (NOTE: Host copies keep their place). It, and every subgraph of a graph compiled with a
    memory budget or offloading (`free_at_last_use`, MemoryPolicy.free_at_last_use), frees each
    buffer at its last use (NOTE: Memory first frees at once). A subgraph with symbolic sizes skips Inductor's FX
    graph cache: a cached entry's guards name the sizes' sources in the whole graph (``L['images']``),
    which a subgraph's inputs do not have, and looking one up raised KeyError (dynamic=True with a
    memory_budget, the second run on a machine)."""
    from torch._inductor import config

    changes: dict = {"fallback_random": True}
    if host_copies:
        changes["reorder_for_peak_memory"] = False
    if host_copies or free_at_last_use:
        changes["allow_buffer_reuse"] = False
    if symbolic:
        changes["fx_graph_cache"] = False
    return config.patch(**changes)


# [NOTE] Host copies keep their place. The partitioner puts each copy of an offloaded value to the
# host right after the value's last forward use, so that its GPU memory is free for the rest of the
# forward. Inductor's reorder_for_peak_memory counts a host buffer as memory like a GPU one: moving
# the copy frees nothing in its estimate, and the order it picks puts the copies late, raising the
# forward's peak (benchmarks/RESULTS.md, offloading). So a subgraph with host copies keeps the
# graph's order.


# [NOTE] Memory first frees at once. Inductor's wrapper keeps a buffer past its last use when a later
# buffer of the same size, dtype and device can take its memory (allow_buffer_reuse): no `del` at the
# last use, the storage handed on under the new name at the reuse. Until then the caching allocator
# counts it, and in a backward that recomputes block after block several such buffers wait at once.
# Freed at its last use, the buffer goes back to the caching allocator, which serves the next one
# from it: the same kernels run, only the wrapper's bookkeeping differs (and a CUDA-graph replay
# does none of it). So a graph whose user asked for memory (a memory_budget, or offloading:
# MemoryPolicy.free_at_last_use) compiles without the reuse (benchmarks/RESULTS.md, offloading).


def has_symbolic_sizes(inputs: list) -> bool:
    """Whether any input is a SymInt or a tensor with a symbolic size (dynamic shapes)."""
    return any(isinstance(x, torch.SymInt)
               or (isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape))
               for x in inputs)


def is_host_copy(node: torch.fx.Node) -> bool:
    """Whether `node` moves a value between host and device (the offload pass's copies). A copy
    between two GPUs (``place_modalities``) is the same op, ``prims.device_put``, but is not one."""
    if node.op != "call_function" or node.target is not torch.ops.prims.device_put.default:
        return False
    source = getattr(node.args[0], "meta", {}).get("val")
    return torch.device(node.args[1]).type == "cpu" or (isinstance(source, torch.Tensor) and source.device.type == "cpu")


def has_host_copies(sub: torch.fx.GraphModule) -> bool:
    """Whether `sub` holds a copy between host and device (`is_host_copy`)."""
    return any(is_host_copy(n) for n in sub.graph.nodes)


@contextlib.contextmanager
def no_donated_inputs():
    """Tell Inductor that none of a subgraph's inputs is donated.

    Inductor reads the donated inputs (saved activations it may overwrite in place once read) from
    the tracing context, numbered over the whole backward's inputs, while a subgraph numbers its
    own: its input 3 may be a gradient another subgraph still reads. And a CUDA-graph capture step
    replays each candidate runtime several times before the real replay, which must still find
    the saved activations intact. The runner reuses donated memory itself
    (docs/design/cuda-graphs.md#donation), in the final capture only."""
    meta = fw_metadata()
    if meta is None or not getattr(meta, "bw_donated_idxs", None):
        yield
        return
    whole = meta.bw_donated_idxs
    meta.bw_donated_idxs = []
    try:
        yield
    finally:
        meta.bw_donated_idxs = whole


def compile_subgraph(sub: torch.fx.GraphModule, inputs: list, compiler: str, kind: str,
                     free_at_last_use: bool = False) -> Callable[[list], tuple]:
    if compiler == "eager":
        def run_boxed(args: list) -> tuple:
            inputs = list(args)
            args.clear()  # as Inductor's compiled code does: the caller's list holds nothing after
            return sub.forward(*inputs)

        run_boxed._boxed_call = True
        return run_boxed
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    # Inductor reports each compiled graph's output strides to AOTAutograd through the tracing
    # context, once per graph; a subgraph must not: its outputs keep the strides in meta["val"]
    # (they are all marked user-visible), so AOTAutograd's own view of the graph stays right.
    isolate = contextlib.nullcontext()
    if torch._guards.TracingContext.try_get() is not None:
        isolate = torch._guards.TracingContext.report_output_strides()
    with isolate, no_donated_inputs(), inductor_config(host_copies=has_host_copies(sub), free_at_last_use=free_at_last_use,
                                                       symbolic=has_symbolic_sizes(inputs)):
        return compile_fx_inner(
            sub,
            inputs,
            cudagraphs=BoxedBool(False),
            is_backward=kind == "backward",
            is_inference=kind == "inference",
        )
