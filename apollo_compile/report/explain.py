"""Explain what apollo decides for a model: a text table, one HTML page, a Chrome trace.

    report = apollo_compile.explain(model, images, tokens, options={"device": "H200"})
    report = apollo_compile.explain(hf_model, **batch, options={"device": "H200"})  # keyword inputs
    print(report)                       # one row per compiled graph
    report.save_html("report.html")     # graphs, lane timelines, memory arenas; one file, no network
    report.save_trace("trace.json")     # the predicted timeline for ui.perfetto.dev / chrome://tracing

or from a shell: ``python -m apollo_compile report examples/clip.py:build --out report.html``.

Everything here reads the plans the backend recorded (:mod:`apollo_compile.plan`): the node
annotations, the lane plan and the memory plan. Nothing is re-planned. :class:`Report` is the
report's data (:mod:`.model`) with its renderings (:mod:`.text`, :mod:`.html_page`, :mod:`.trace`).

Predicted times come from the cost labels the same way :meth:`LanePlan.predicted_us` computes
them: a subgraph starts when the last of its DAG predecessors ends (same-lane program order is
part of the DAG). Measured times can be attached with :meth:`Report.add_measured`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings
from typing import Any, Mapping

import torch

from .. import plan as plan_store
from ..fallback import ApolloFallbackWarning
from ..options import ApolloOptions
from .html_page import render_page
from .model import ReportData
from .text import render_text
from .trace import render_trace

__all__ = ["Report", "explain", "loss_of"]


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
    forward does not name is most likely meant for ``options=``: a TypeError when forward takes no
    ``**kwargs``, else a warning (the model may read it)."""
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


class Report(ReportData):
    """The plans of one :func:`explain` call (:class:`~.model.ReportData`) and their renderings:
    ``str(report)`` is the text table, :meth:`save_html` the page, :meth:`save_trace` the trace."""

    def __str__(self) -> str:
        return render_text(self)

    def __repr__(self) -> str:
        return f"Report(graphs={[g.name for g in self.graphs]})"

    def to_trace(self) -> dict[str, Any]:
        """Chrome/Perfetto trace: one process per graph, one thread per lane, ph "X" per subgraph."""
        return render_trace(self)

    def save_trace(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.to_trace(), f, indent=1)
        return path

    def to_html(self) -> str:
        return render_page(self)

    def save_html(self, path: str) -> str:
        """Write one self-contained HTML page (inline CSS, JS and SVG; nothing is fetched)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_html())
        return path
