"""apollo_compile: a torch.compile backend that trains multimodal models faster and leaner on
one GPU by running independent towers concurrently (spatial multiplexing).

    model = torch.compile(model, backend="apollo")

The backend is registered through the ``torch_dynamo_backends`` entry point, so after
``pip install`` no import is needed. Importing this package registers it only when the entry
point is not installed (running from a source tree).
"""

from __future__ import annotations

from . import ops as _ops  # noqa: F401  registers apollo's custom ops (torch.ops.apollo.*)
from .report import logs as _logs
from .backend import apollo_backend
from .fallback import ApolloFallbackWarning
from .options import ApolloOptions, ApolloOptionsError
from .placement import ModalityPlacement, place_modalities
from .plan import GraphPlan, ModelPlan, clear_plans, last_plan, plans
from .report.explain import Report, explain
from .step.whole_step import compile_step

__version__ = "0.1.0"
__all__ = [
    "ApolloFallbackWarning", "ApolloOptions", "ApolloOptionsError", "GraphPlan", "ModelPlan", "apollo_backend",
    "clear_plans", "compile_step", "last_plan", "ModalityPlacement", "place_modalities", "plans", "Report", "explain",
]


def _register_if_missing() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if "apollo" in _COMPILER_FNS:
        return
    if "apollo" in _BACKENDS:  # the installed entry point knows it; torch loads it on lookup
        return
    register_backend(apollo_backend, name="apollo")


_register_if_missing()
_logs.register()
