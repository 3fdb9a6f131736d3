"""apollo in PyTorch's own logging and debugging tools.

- ``TORCH_LOGS="+apollo_compile"`` shows every pass decision, once: ``apollo_compile`` is
  registered with torch._logging (see :func:`register`).
- With ``TORCH_TRACE`` set, each graph's plan is a structured artifact (``apollo_plan_<graph>``)
  that ``tlparse`` lists beside Inductor's.
- ``TORCH_COMPILE_DEBUG=1`` also writes apollo's dumps under PyTorch's debug directory, in
  ``<debug dir>/apollo``.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

log = logging.getLogger("apollo_compile")


def register() -> None:
    """Register ``apollo_compile`` with torch._logging, and apply ``TORCH_LOGS`` to it once.

    torch reads ``TORCH_LOGS`` when it is imported. A name it can import as a module it imports
    right then, registers, and gives a handler when it finishes reading: apollo must not set its
    handler up as well (each decision would print twice). Where torch read the variable without
    importing apollo, apollo reads it again here, once it is registered.
    """
    try:
        from torch._logging import _internal

        _internal.register_log("apollo_compile", "apollo_compile")
        if "apollo" not in os.environ.get("TORCH_LOGS", ""):
            return
        if _called_from(_internal.__file__):
            log.propagate = False  # as torch leaves the logs it set up: the root logger prints nothing twice
        else:
            _internal._init_logs()
    except Exception as e:  # pragma: no cover - private API moved: plain logging still works
        log.debug("apollo: could not register with torch._logging: %s", e)


def _called_from(filename: str) -> bool:
    """Whether a caller up the stack runs code of `filename` (torch importing apollo, here)."""
    target = os.path.normcase(os.path.abspath(filename))
    frame = sys._getframe(1)
    while frame is not None:
        if os.path.normcase(os.path.abspath(frame.f_code.co_filename)) == target:
            return True
        frame = frame.f_back
    return False


def emit_plan(name: str, summary: dict) -> None:
    """The plan as a TORCH_TRACE artifact; free when tracing is off."""
    try:
        from torch._logging import trace_structured
    except ImportError:  # pragma: no cover
        return
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"apollo_plan_{name}", "encoding": "json"},
        payload_fn=lambda: json.dumps(summary, sort_keys=True, default=str),
    )


def debug_dump_dir() -> str | None:
    """Where TORCH_COMPILE_DEBUG=1 wants our dumps, or None when it is off."""
    if os.environ.get("TORCH_COMPILE_DEBUG", "0") != "1":
        return None
    try:
        return os.path.join(torch._dynamo.utils.get_debug_dir(), "apollo")
    except Exception:  # pragma: no cover
        return None
