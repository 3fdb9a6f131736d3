"""The one warning category for every path where apollo steps aside, so users can filter it, and
the one way a graph's fallback is announced."""

import warnings

REPORT_HINT = "please report it with the dump (options={'dump_dir': ...}) at the apollo_compile issue tracker"


class ApolloFallbackWarning(UserWarning):
    """apollo ran a graph (or a call) through a fallback path; the message says why."""


def warn_fallback(name: str, path: str, reason: BaseException | str) -> None:
    """One warning: graph `name` runs on `path` instead of apollo's runtime, and why."""
    why = reason if isinstance(reason, str) else f"{type(reason).__name__}: {reason}"
    warnings.warn(f"apollo: graph {name} runs on {path} instead of apollo's runtime because {why}; "
                  f"training stays correct, but {REPORT_HINT}", ApolloFallbackWarning, stacklevel=2)
