"""The performance model calibrates itself from what the CUDA-graph runner measures.

On CUDA the runner times every candidate runtime of a graph it captures (lanes, one lane, SM
quotas: ``runtime/cudagraph.py``). :func:`record` refits the model's two interference parameters
for that device from those times (``PerfModel.fit_overlap_penalty``: how much two lanes on plain
streams slow each other; ``PerfModel.fit_quota_penalty``: the same between quota lanes), and
:func:`defaults` hands later plans on the same device the median of the fits in place of the
priors: recompiles and other graphs in this process, and later processes.

Reads and writes a JSON file beside Inductor's on-disk cache
(``<inductor cache dir>/apollo_compile/calibration.json``); ``APOLLO_CALIBRATION_FILE`` names
another file, an empty value keeps the fits in this process only.

Why it matters: a quota split predicted (with calibrated interference) to lose to plain streams
is not captured and timed at all (``pipeline.quota_candidates``), and every capture costs compile
time and, for each new stream, a cuBLAS workspace that stays allocated
(docs/design/performance-model.md#calibration).
"""

from __future__ import annotations

import json
import logging
import os
import statistics

import torch

from ..devices import DeviceSpec
from .model import parse_quota_name

log = logging.getLogger("apollo_compile")

PARAMETERS = ("overlap_penalty", "quota_penalty")
KEEP = 8  # fits kept per device and parameter; the model uses their median

_FITS: dict[str, dict[str, list[float]]] = {}  # device key -> parameter -> fitted values, newest last
_LOADED: set[str] = set()  # files already merged into _FITS


def device_key(spec: DeviceSpec) -> str:
    """Fits depend on the chip and on the kernels torch generates for it."""
    return f"{spec.name}/torch-{'.'.join(torch.__version__.split('.')[:2])}"


def path() -> str | None:
    explicit = os.environ.get("APOLLO_CALIBRATION_FILE")
    if explicit is not None:
        return explicit or None
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "apollo_compile", "calibration.json")


def _load() -> None:
    file = path()
    if file is None or file in _LOADED:
        return
    _LOADED.add(file)
    try:
        with open(file) as f:
            stored = json.load(f)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:  # a damaged cache must not stop compilation
        log.warning("apollo: ignoring the calibration file %s: %s", file, e)
        return
    for key, params in stored.items():
        for name, values in params.items():
            if name in PARAMETERS:
                mine = _FITS.setdefault(key, {}).setdefault(name, [])
                mine[:0] = [float(v) for v in values]
                del mine[:-KEEP]


def _save() -> None:
    file = path()
    if file is None:
        return
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        tmp = f"{file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(_FITS, f, indent=1, sort_keys=True)
        os.replace(tmp, file)
    except OSError as e:
        log.warning("apollo: could not write the calibration file %s: %s", file, e)


def defaults(spec: DeviceSpec) -> dict[str, float]:
    """PerfModel keyword arguments fitted on this device so far (empty before any measurement)."""
    _load()
    fits = _FITS.get(device_key(spec), {})
    return {name: statistics.median(values) for name, values in fits.items() if values}


def record(spec: DeviceSpec, plan, model, measured_ms: dict[str, float]) -> dict[str, float]:
    """Refit the interference parameters from one graph's measured candidates; return the fits.

    ``plan`` is the graph's LanePlan, ``model`` the PerfModel that planned it, ``measured_ms``
    candidate name -> ms per replay (``CudaGraphRunner.measured_ms``). The overlap penalty needs
    "lanes" and "one_lane"; each quota candidate ("quota:...") gives a quota penalty relative to
    "one_lane".
    """
    one = measured_ms.get("one_lane")
    if not one or plan is None or model is None:
        return {}
    fitted: dict[str, float] = {}
    if measured_ms.get("lanes"):
        fitted["overlap_penalty"] = model.fit_overlap_penalty(measured_ms["lanes"] * 1e3, one * 1e3, plan=plan)
    quota_fits = [model.fit_quota_penalty(parse_quota_name(name), ms * 1e3, one * 1e3, plan)
                  for name, ms in measured_ms.items() if name.startswith("quota:") and ms]
    if quota_fits:
        fitted["quota_penalty"] = statistics.median(quota_fits)
    if not fitted:
        return {}
    _load()
    fits = _FITS.setdefault(device_key(spec), {})
    for name, value in fitted.items():
        values = fits.setdefault(name, [])
        values.append(float(value))
        del values[:-KEEP]
    _save()
    log.info("apollo: calibrated %s from %s: %s", device_key(spec), measured_ms, fitted)
    return fitted


def reset() -> None:
    """Forget the fits of this process (the file stays): for tests."""
    _FITS.clear()
    _LOADED.clear()
