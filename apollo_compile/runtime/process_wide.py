"""A setting that ``with using(value):`` blocks push for every thread of the process.

Not a contextvar: the autograd engine runs a CUDA backward on a thread of its own, where a
contextvar set around the training loop is unset, and a backward captures (and so reads its
strategy and capturer) on that thread. ``choice.using`` and ``capture.using`` are built on it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Generic, Iterator, TypeVar

__all__ = ["ProcessWide"]

T = TypeVar("T")


class ProcessWide(Generic[T]):
    """A stack of values; the innermost block's value is in effect on every thread."""

    def __init__(self) -> None:
        self._values: list[T] = []
        self._lock = threading.Lock()

    def innermost(self, default: T) -> T:
        """The innermost :meth:`using` block's value, else `default`."""
        return self._values[-1] if self._values else default

    @contextlib.contextmanager
    def using(self, value: T) -> Iterator[T]:
        """`value` is in effect inside this block (blocks may end out of order across threads)."""
        with self._lock:
            self._values.append(value)
        try:
            yield value
        finally:
            with self._lock:
                for i in range(len(self._values) - 1, -1, -1):
                    if self._values[i] is value:
                        del self._values[i]
                        break
