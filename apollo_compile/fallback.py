"""The one warning category for every path where apollo steps aside, so users can filter it."""


class ApolloFallbackWarning(UserWarning):
    """apollo ran a graph (or a call) through a fallback path; the message says why."""
