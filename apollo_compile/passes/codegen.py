"""Codegen pass: turn a :class:`~apollo_compile.lane_plan.LanePlan` into a readable Python runtime.

Reads the lane plan and ``NodeInfo`` (modality, est_us); returns a
:class:`~apollo_compile.lane_plan.RuntimeSource` whose ``text`` is the program that runs (the
runner ``exec``s exactly this text) and is dumped as ``*.runtime.py``. When the plan has side
lanes, ``one_lane`` holds the same subgraphs issued on one stream (``*.one_lane.runtime.py``): on
CUDA both are captured and the faster one replayed.

Two phases, as in apex torchsched: :func:`schedule` emits symbolic ops (launch, wait, record,
keep-alive); :func:`render` prints them. Records are only rendered for events some lane waits on.
How values are freed (at their last reader's launch; across lanes only after the join) and where a
side lane's main-allocated buffers come from: docs/design/lanes.md#freeing,
#freeing-across-lanes and #main-allocated.

[NOTE] Waits are pruned with vector clocks::

    lane 1:  s0 ──rec──────────────► s2 (reads s1)      s2 waits on s1's event; it need not
    lane 2:        s1 (reads s0) ─rec┘                   wait on s0: s1 already waited on it.

Each lane keeps, per other lane, the last launch it is known to be ordered after; waiting on an
event inherits what the recording lane knew when it recorded.
"""

from __future__ import annotations

import dataclasses
import itertools
import textwrap

import torch.fx

from ..annotations import info
from ..lane_plan import LanePlan, Op, RuntimeSource

HEADER = '''\
# apollo_compile runtime for {name}
# Constructed by apollo_compile.passes.codegen: {n_sg} subgraph(s) on {n_lanes} lane(s), {n_waits} cross-lane wait(s).
{lane_lines}
# Names are the FX node names of the {name} graph; subgraph_<i> is subgraph i compiled.
'''


def producer_lane(plan: LanePlan, node: torch.fx.Node) -> int:
    """The lane whose stream made `node`'s value: graph inputs arrive on the main lane."""
    sg = info(node).subgraph
    return plan.subgraphs[sg].lane if sg is not None else 0


def input_lanes(plan: LanePlan, placeholders: list[torch.fx.Node]) -> tuple[frozenset[int], ...]:
    """Per graph input, the lanes that read it: a backward's capture frees a saved activation on
    the lane that made it only if no other lane reads it (docs/design/cuda-graphs.md#donation-on-side-lanes)."""
    readers: dict[torch.fx.Node, set[int]] = {p: set() for p in placeholders}
    for sg in plan.subgraphs:
        for n in sg.inputs:
            if n in readers:
                readers[n].add(sg.lane)
    return tuple(frozenset(readers[p]) for p in placeholders)


def one_lane(plan: LanePlan) -> LanePlan:
    """The same subgraphs, in the same order, all on the main lane: the single-stream candidate."""
    subgraphs = [dataclasses.replace(sg, lane=0) for sg in plan.subgraphs]
    mods = sorted({m for ms in plan.lanes.values() for m in ms})
    return LanePlan({0: mods}, subgraphs, plan.dag, plan.order, "one-lane candidate")


def schedule(plan: LanePlan, output_nodes: list[torch.fx.Node]) -> list[Op]:
    """Symbolic ops in launch order (phase one)."""
    pos = {sg_id: i for i, sg_id in enumerate(plan.order)}
    lanes = sorted({sg.lane for sg in plan.subgraphs} | {0})  # lane 0 joins even when it launches nothing
    clock = {lane: {other: -1 for other in lanes} for lane in lanes}  # lane -> other -> last pos known done
    clock_at_record: dict[int, dict[int, int]] = {}
    last_use: dict[torch.fx.Node, int] = {}
    for sg_id in plan.order:
        for n in plan.subgraphs[sg_id].inputs:
            last_use[n] = sg_id
    keep_forever = set(output_nodes)
    ops: list[Op] = []
    for sg_id in plan.order:
        sg = plan.subgraphs[sg_id]
        for dep in sorted(plan.dag.predecessors(sg_id), key=pos.get):
            dep_lane = plan.lane_of(dep)
            if dep_lane == sg.lane or clock[sg.lane][dep_lane] >= pos[dep]:
                continue
            ops.append(Op("wait", sg.lane, dep))
            for other, p in clock_at_record[dep].items():
                clock[sg.lane][other] = max(clock[sg.lane][other], p)
        cross = tuple(n.name for n in sg.inputs if producer_lane(plan, n) != sg.lane)
        if cross:  # held before the launch lets go of its names
            ops.append(Op("keep", sg.lane, sg_id, cross))
        dead = tuple(n.name for n in sg.inputs if last_use[n] == sg_id and n not in keep_forever)
        ops.append(Op("launch", sg.lane, sg_id, tuple(n.name for n in sg.outputs), dead))
        clock[sg.lane][sg.lane] = pos[sg_id]
        clock_at_record[sg_id] = dict(clock[sg.lane])
        ops.append(Op("record", sg.lane, sg_id))
    # join: the main lane waits for the last launch of every side lane
    for lane in lanes:
        if lane == 0:
            continue
        last = max((sg_id for sg_id in plan.order if plan.lane_of(sg_id) == lane), key=pos.get)
        if clock[0][lane] < pos[last]:
            ops.append(Op("join", 0, last))
            clock[0][lane] = pos[last]
    if any(op.kind == "keep" for op in ops):
        ops.append(Op("release", 0))
    return ops


def _render_output(arg) -> str:
    if isinstance(arg, torch.fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_render_output(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    return repr(arg)


def render(plan: LanePlan, ops: list[Op], name: str, placeholders: list[str], output_arg) -> RuntimeSource:
    """Print the ops as Python (phase two): consecutive ops of one lane share a stream block."""
    waited = {op.subgraph for op in ops if op.kind in ("wait", "join")}
    side_lanes = sorted({sg.lane for sg in plan.subgraphs if sg.lane != 0})
    lane_lines = "\n".join(
        f"#   lane {lane}: {'main stream' if lane == 0 else 'side stream'} [{', '.join(mods)}]"
        for lane, mods in sorted(plan.lanes.items())
    )
    n_waits = sum(op.kind in ("wait", "join") for op in ops)
    lines = [HEADER.format(name=name, n_sg=len(plan.subgraphs), n_lanes=len(plan.lanes), n_waits=n_waits,
                           lane_lines=lane_lines)]
    lines.append("def run(args):")
    if placeholders:
        lines.append("    " + _wrap("(", placeholders, ") = args").replace("\n", "\n    "))
    lines.append("    args.clear()")
    if side_lanes:
        lines.append(f"    rt.fork({side_lanes})  # side lanes start after the caller's pending work")
    for lane, group in itertools.groupby(ops, key=lambda op: op.lane):
        body = [text for op in group if (text := _render_op(plan, op, waited))]
        body = [line for text in body for line in text.split("\n")]
        if lane == 0:
            lines.extend("    " + line for line in body)
        elif body:
            lines.append(f"    with rt.lane({lane}):")
            lines.extend("        " + line for line in body)
    out = _render_output(output_arg)
    lines.append("    return " + (_wrap(out[0], out[1:-1].split(", "), out[-1]).replace("\n", "\n    ")
                                   if len(out) > 80 else out))
    return RuntimeSource("\n".join(lines) + "\n", ops, side_lanes, n_waits)


def _render_op(plan: LanePlan, op: Op, waited: set[int]) -> str:
    if op.kind == "wait":
        return f"rt.wait({op.subgraph})  # needs subgraph {op.subgraph} (lane {plan.lane_of(op.subgraph)})"
    if op.kind == "join":
        return f"rt.wait({op.subgraph})  # join: lane {plan.lane_of(op.subgraph)} is done"
    if op.kind == "record":
        return f"rt.record({op.subgraph})" if op.subgraph in waited else ""
    if op.kind == "keep":  # values read on another lane than the one that made them
        return _wrap(f"rt.keep_alive({op.lane}, ", list(op.names), ")")
    if op.kind == "release":
        return "rt.release()  # every lane has joined: values read across lanes may be freed"
    sg = plan.subgraphs[op.subgraph]
    mods = ", ".join(sorted({info(n).modality for n in sg.nodes}))
    head = f"# subgraph {sg.id}: {mods} | {len(sg.nodes)} nodes | est {sg.est_us:.1f} us\n"
    if sg.lane == 0:  # on one lane the buffers come right before their writer
        head += "".join(line + "\n" for line in _allocations(sg))
    names = [n.name for n in sg.inputs] + [n.name for n in sg.main_allocated]
    # a side lane's buffers allocated once this main-lane subgraph has freed what it read last
    after = "".join("\n" + line for other in plan.subgraphs if other.lane != 0 and other.allocate_after == sg.id
                    for line in _allocations(other)) if sg.lane == 0 else ""
    if not op.last_read:
        args = _wrap(f"subgraph_{sg.id}([", names, "])")
        return head + (_wrap("(", list(op.names), f") = {args}") if op.names else args) + after
    # the list is the only holder of what this subgraph reads last: it frees each as it goes
    inputs = _wrap(f"inputs_{sg.id} = [", names, "]")
    dead = _wrap("del (", list(op.last_read), ")")
    call = f"subgraph_{sg.id}(inputs_{sg.id})"
    return head + f"{inputs}\n{dead}\n" + (_wrap("(", list(op.names), f") = {call}") if op.names else call) + after


def _allocations(sg) -> list[str]:
    """The buffers `sg` writes its main-allocated outputs into (passes/main_allocated.py)."""
    lines = []
    for n in sg.main_allocated:
        val = n.meta["val"]
        dtype = str(val.dtype).removeprefix("torch.")
        lines.append(f"{n.name} = rt.empty({tuple(val.shape)}, {tuple(val.stride())}, {dtype!r})"
                     f"  # written by subgraph {sg.id}")
    return lines


def _wrap(open_: str, names: list[str], close: str, width: int = 96) -> str:
    """``open_ + ", ".join(names) + close``, broken inside the brackets at `width` columns."""
    joined = ", ".join(names) + ("," if open_ == "(" and len(names) == 1 else "")  # a 1-tuple
    if len(open_ + joined + close) <= width:
        return open_ + joined + close
    body = textwrap.wrap(joined, width=width - 4, break_long_words=False, break_on_hyphens=False)
    return open_.rstrip() + "\n    " + "\n    ".join(body) + "\n" + close


def run(gm: torch.fx.GraphModule, ctx) -> RuntimeSource:
    plan: LanePlan = ctx.decisions["lanes"]
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    output_arg = out_node.args[0]
    outputs = list(out_node.all_input_nodes)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [n.name for n in placeholders]
    source = render(plan, schedule(plan, outputs), ctx.name, names, output_arg)
    source.input_lanes = input_lanes(plan, placeholders)
    if source.side_lanes:
        single = one_lane(plan)
        source.one_lane = render(single, schedule(single, outputs), ctx.name, names, output_arg)
        source.one_lane.input_lanes = input_lanes(single, placeholders)
    return source
