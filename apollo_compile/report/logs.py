"""apollo in PyTorch's own logging and debugging tools.

- ``TORCH_LOGS="+apollo_compile"`` shows every pass decision (``apollo_compile`` is registered
  with torch._logging; ``TORCH_LOGS`` is read when torch is imported, before apollo is, so it is
  read again once apollo is registered — only when it names apollo).
- With ``TORCH_TRACE`` set, each graph's plan is a structured artifact (``apollo_plan_<graph>``)
  that ``tlparse`` lists beside Inductor's.
- ``TORCH_COMPILE_DEBUG=1`` also writes apollo's dumps under PyTorch's debug directory, in
  ``<debug dir>/apollo``.
"""

from __future__ import annotations

import json
import logging
import os

import torch

log = logging.getLogger("apollo_compile")


def register() -> None:
    try:
        from torch._logging import _internal

        _internal.register_log("apollo_compile", "apollo_compile")
        if "apollo" in os.environ.get("TORCH_LOGS", ""):
            _internal._init_logs()
    except Exception as e:  # pragma: no cover - private API moved: plain logging still works
        log.debug("apollo: could not register with torch._logging: %s", e)


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
