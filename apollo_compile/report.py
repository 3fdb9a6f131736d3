"""Explain what apollo decides for a model: a text table, one HTML page, a Chrome trace.

    report = apollo_compile.explain(model, images, tokens, options={"device": "H200"})
    report = apollo_compile.explain(hf_model, **batch, options={"device": "H200"})  # keyword inputs
    print(report)                       # one row per compiled graph
    report.save_html("report.html")     # graphs, lane timelines, memory arenas; one file, no network
    report.save_trace("trace.json")     # the predicted timeline for ui.perfetto.dev / chrome://tracing

or from a shell: ``python -m apollo_compile report examples/clip.py:build --out report.html``.

Everything here reads the plans the backend recorded (:mod:`apollo_compile.plan`): the node
annotations, the :class:`~apollo_compile.passes.lanes.LanePlan` and the
:class:`~apollo_compile.passes.memory_plan.MemoryPlan`. Nothing is re-planned.

Predicted times come from the cost labels the same way :meth:`LanePlan.predicted_us` computes
them: a subgraph starts when the last of its DAG predecessors ends (same-lane program order is
part of the DAG). Measured times can be attached with :meth:`Report.add_measured`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import textwrap
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx

from . import dump
from . import plan as plan_store
from .annotations import info
from .fallback import ApolloFallbackWarning
from .options import ApolloOptions
from .plan import GraphPlan, ModelPlan
from .report_html import render_page
from .report_stats import (CANDIDATE_NAMES, MEASURED_NOTE, TOP_OPS_RANKING, GraphStats, candidate_rows,
                           describe_candidate, dominant_modality, format_bytes, format_flops, graph_stats,
                           largest_ops, op_cost, predicted_timeline)

__all__ = ["GraphStats", "Report", "candidate_rows", "dominant_modality", "explain", "format_bytes", "graph_stats",
           "largest_ops", "loss_of", "predicted_timeline", "CANDIDATE_NAMES", "MEASURED_NOTE", "TOP_OPS_RANKING",
           "describe_candidate", "format_flops", "op_cost"]

_GRAPH_KINDS = ("forward", "backward", "inference")


# ----------------------------------------------------------------------------------------------
# explain()
# ----------------------------------------------------------------------------------------------


def explain(model: torch.nn.Module, *args: Any, options: Mapping[str, Any] | None = None,
            **kwargs: Any) -> "Report":
    """Compile `model` with apollo, run it once as ``model(*args, **kwargs)``, and report what was planned.

    ``args`` and ``kwargs`` are the model's inputs, as the model is called: ``explain(model, images,
    tokens)``, or a Hugging Face batch by keyword, ``explain(model, **batch)`` with ``input_ids=``,
    ``pixel_values=``, ``return_loss=True``. ``options`` is apollo's options dict, as
    ``torch.compile(model, backend="apollo", options=options)`` takes it (``{"device": "H200",
    "subgraph_compiler": "eager"}``); it is validated before anything is compiled.

    ``torch._dynamo.reset()`` runs first so that graphs cached by an earlier compilation are
    compiled (and planned) again. One forward runs; if it returns a loss, one backward runs from
    it too, so that the backward graph is planned and reported as well. The loss is the output
    itself when it is a one-element tensor that requires grad, else the output's ``loss``: the
    ``.loss`` of a Hugging Face ``ModelOutput`` (``return_loss=True``, ``labels=``) or the
    ``"loss"`` of a dict, again when it is a one-element tensor that requires grad. The gradients
    that backward computes are discarded: every parameter's ``.grad`` is restored to what it was
    before the call. The report holds every plan (:func:`apollo_compile.plans`) made during the
    call, and the fallback warnings raised (they are re-issued to the caller as well).
    """
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"explain(): options must be a dict of apollo options (as torch.compile(..., "
                        f"options=) takes it) or None, got {type(options).__name__}: {options!r}")
    options = dict(options or {})
    ApolloOptions.from_user(options)  # a bad key or value raises here, naming it, before any tracing
    _check_model_keywords(model, kwargs)
    before = {id(p) for p in plan_store.plans()}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="apollo", options=options or None)
    saved_grads = {p: (None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()}
    backward_from = None
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = compiled(*args, **kwargs)
            loss, backward_from = loss_of(out)
            if loss is not None:
                loss.backward()
    finally:
        for p, g in saved_grads.items():
            p.grad = g
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    messages = [str(w.message) for w in caught if issubclass(w.category, ApolloFallbackWarning)]
    new = [p for p in plan_store.plans() if id(p) not in before]
    return Report(new, options, backward_from is not None, messages, backward_from=backward_from)


def loss_of(out: Any) -> tuple[torch.Tensor | None, str | None]:
    """(loss, where it was found) in a model's output, or (None, None): the output itself when it
    is a one-element tensor that requires grad; else ``out.loss`` (a Hugging Face ``ModelOutput``,
    any object) or ``out["loss"]`` of a dict, under the same condition."""
    if isinstance(out, torch.Tensor):
        loss, where = out, "the output"
    elif getattr(out, "loss", None) is not None:  # a ModelOutput (a mapping too) or any object
        loss, where = out.loss, "output.loss"
    elif isinstance(out, Mapping):
        loss, where = out.get("loss"), "output['loss']"
    else:
        return None, None
    if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1:
        return loss, where
    return None, None


_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(ApolloOptions))


def _check_model_keywords(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Keywords of explain() are the model's inputs; one that is an apollo option the model's
    forward does not name was meant for ``options=`` (explain's signature before it took keyword
    inputs): a TypeError when forward takes no ``**kwargs``, else a warning."""
    stray = [k for k in kwargs if k in _OPTION_NAMES]
    if not stray:
        return
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    named = {k for k, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    stray = [k for k in stray if k not in named]
    if not stray:
        return
    hint = (f"{', '.join(map(repr, stray))} {'is an apollo option' if len(stray) == 1 else 'are apollo options'}, "
            f"not an input that {type(model).__name__}.forward names: explain()'s keywords are the model's inputs; "
            f"pass apollo's options as explain(model, *inputs, options={{{', '.join(f'{k!r}: ...' for k in stray)}}})")
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        warnings.warn(f"explain(): {hint}; they go to the model as inputs", UserWarning, stacklevel=3)
    else:
        raise TypeError(f"explain(): {hint}")


# ----------------------------------------------------------------------------------------------
# Numbers per graph
# ----------------------------------------------------------------------------------------------


def _lanes_text(lanes: dict[int, list[str]]) -> str:
    return " | ".join(f"lane {k}: {', '.join(v)}" for k, v in lanes.items()) or "-"


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


@dataclass
class Report:
    """The plans of one :func:`explain` call; ``str(report)`` is the text table."""

    plans: list[ModelPlan]
    options: dict[str, Any] = field(default_factory=dict)
    ran_backward: bool = False
    fallback_warnings: list[str] = field(default_factory=list)
    measured: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    backward_from: str | None = None  # where explain() found the loss it ran the backward from

    @property
    def graphs(self) -> list[GraphPlan]:
        """Every planned ATen graph: per Dynamo graph, forward, backward, inference."""
        out = []
        for mp in self.plans:
            out += [mp.graphs[k] for k in _GRAPH_KINDS if k in mp.graphs]
            out += [g for k, g in mp.graphs.items() if k not in _GRAPH_KINDS]
        return out

    def graph(self, name: str) -> GraphPlan:
        for gp in self.graphs:
            if gp.name == name:
                return gp
        raise KeyError(f"no graph named {name!r} in this report; graphs: {', '.join(g.name for g in self.graphs)}")

    def stats(self) -> list[GraphStats]:
        return [graph_stats(gp) for gp in self.graphs]

    def add_measured(self, graph_name: str, timings: dict[int, tuple[float, float]]) -> None:
        """Attach measured (start_us, end_us) per subgraph id of graph `graph_name`.

        They are drawn under the predicted lanes in :meth:`save_html` and written as a second set
        of threads by :meth:`save_trace`. Times are relative to the graph's start.
        """
        gp = self.graph(graph_name)
        n_sg = len(gp.lanes.subgraphs) if gp.lanes is not None else 0
        clean: dict[int, tuple[float, float]] = {}
        for sg_id, (start, end) in timings.items():
            if not 0 <= int(sg_id) < n_sg:
                raise KeyError(f"graph {graph_name} has no subgraph {sg_id} (it has {n_sg})")
            if end < start:
                raise ValueError(f"graph {graph_name} subgraph {sg_id}: end {end} is before start {start}")
            clean[int(sg_id)] = (float(start), float(end))
        self.measured[graph_name] = clean

    # -- text -------------------------------------------------------------------------------

    def __str__(self) -> str:
        stats = self.stats()
        devices = sorted({s.device for s in stats})
        head = (f"apollo explain: {len(stats)} graph(s) from {len(self.plans)} Dynamo graph(s), planned for "
                f"{', '.join(devices) or '-'}; ran {self.ran_text()}")
        if not stats:
            return head + "\n(no graph was planned)\n" + "".join(f"warning: {w}\n" for w in self.fallback_warnings)
        rows = [("graph", "kind", "lanes", "subgraphs", "serial µs", "concurrent µs", "speedup", "waits",
                 "arena", "no reuse", "compute", "memory", "recomputed", "casts", "fallback")]
        for s in stats:
            rows.append((s.name, s.kind, str(len(s.lanes)), str(s.subgraphs), f"{s.serial_us:.1f}",
                         f"{s.concurrent_us:.1f}", f"{s.speedup:.2f}x" if s.speedup else "-", str(s.waits),
                         format_bytes(s.arena_bytes), format_bytes(s.total_bytes), str(s.compute), str(s.memory),
                         str(s.recomputed), str(s.casts), "yes" if s.fallback else "-"))
        lines = [head, *_table(rows, right={2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13})]
        width = max(len(s.name) for s in stats)
        lines.append("lanes (modalities):")
        lines += [f"  {s.name.ljust(width)}  {_lanes_text(s.lanes)}" for s in stats]
        for name, timings in self.measured.items():
            if timings:
                span = max(e for _, e in timings.values()) - min(s for s, _ in timings.values())
                lines.append(f"measured: {name}: {span:.1f} µs over {len(timings)} subgraph(s)")
        tops = [(gp.name, largest_ops(gp.gm.graph.nodes, 5)) for gp in self.graphs if gp.lanes is not None]
        if any(ops for _, ops in tops):
            lines.append(f"top ops ({TOP_OPS_RANKING}):")
            lines += [f"  {name.ljust(width)}  " + ", ".join(
                f"{n.name} [sg {info(n).subgraph}] {format_flops(info(n).flops)} {format_bytes(info(n).bytes)}"
                for n in ops) for name, ops in tops if ops]
        any_candidates = False
        for gp in self.graphs:
            rows = candidate_rows(gp)
            if rows:
                any_candidates = True
                lines.append(f"candidates: {gp.name}: " + ", ".join(
                    f"{name} {pred} µs" + (f" / measured {ms} ms" if ms != "-" else "")
                    + (f", pool {pool}" if pool != "-" else "") + (f" ({note})" if note else "")
                    for name, pred, ms, pool, note in rows))
        if any_candidates:
            lines += textwrap.wrap(f"{CANDIDATE_NAMES}. µs: predicted by the performance model; {MEASURED_NOTE}.",
                                   width=110, initial_indent="  ", subsequent_indent="  ")
        for s in stats:
            if s.fallback:
                lines.append(f"fallback: {s.name}: {s.fallback}")
        for mp in self.plans:
            if not mp.graphs:
                lines.append(f"fallback: {mp.name}: no ATen graph was planned (the Dynamo graph runs as traced)")
        return "\n".join(lines) + "\n"

    def ran_text(self) -> str:
        """What explain() ran: "forward only" or "forward + backward (from output.loss)"."""
        if not self.ran_backward:
            return "forward only"
        return "forward + backward" + (f" (from {self.backward_from})" if self.backward_from else "")

    def __repr__(self) -> str:
        return f"Report(graphs={[g.name for g in self.graphs]})"

    # -- trace ------------------------------------------------------------------------------

    def to_trace(self) -> dict[str, Any]:
        """Chrome/Perfetto trace: one process per graph, one thread per lane, ph "X" per subgraph."""
        events: list[dict[str, Any]] = []
        for pid, gp in enumerate(self.graphs, start=1):
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{gp.name} ({gp.kind})"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
            lp = gp.lanes
            if lp is None:
                continue
            rows = [("predicted", predicted_timeline(lp), 0)]
            if self.measured.get(gp.name):
                rows.append(("measured", self.measured[gp.name], 1000))
            for cat, times, tid_base in rows:
                for lane, mods in sorted(lp.lanes.items()):
                    events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid_base + lane,
                                   "args": {"name": f"lane {lane} {cat}: {', '.join(mods)}"}})
                for sg_id, (start, end) in sorted(times.items(), key=lambda kv: kv[1]):
                    sg = lp.subgraphs[sg_id]
                    events.append({
                        "name": f"sg {sg_id} {dominant_modality(sg.nodes) or ''}".strip(), "cat": cat, "ph": "X",
                        "pid": pid, "tid": tid_base + sg.lane, "ts": round(start, 3), "dur": round(end - start, 3),
                        "args": {"subgraph": sg_id, "lane": sg.lane, "nodes": len(sg.nodes),
                                 "est_us": round(sg.est_us, 3),
                                 "waits_for": sorted(lp.dag.predecessors(sg_id)),
                                 "largest_ops": [f"{n.name} ({dump.format_target(n)}, {op_cost(n)})"
                                                 for n in largest_ops(sg.nodes, 5)]},
                    })
        return {"traceEvents": events,
                "otherData": {"producer": "apollo_compile.report",
                              "options": {k: repr(v) for k, v in self.options.items()}}}

    def save_trace(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.to_trace(), f, indent=1)
        return path

    # -- html -------------------------------------------------------------------------------

    def to_html(self) -> str:
        return render_page(self)

    def save_html(self, path: str) -> str:
        """Write one self-contained HTML page (inline CSS, JS and SVG; nothing is fetched)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_html())
        return path
