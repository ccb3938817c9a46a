"""Errors raised by paged.kvcache.

All of them subclass `ValueError` (bad input at a boundary) except
`KVCacheIntegrityError`, which reports a broken internal invariant found by a
`check_integrity()` call and therefore is an `AssertionError`-like bug report.
"""

from __future__ import annotations


class KVCacheError(ValueError):
    """Base class for misuse of the KV cache API; the pool is left unchanged."""


class NotEnoughBlocksError(KVCacheError):
    """More blocks were requested than the free queue holds."""


class BlockStateError(KVCacheError):
    """An operation does not fit a block's state (double free, re-hash, ...)."""


class UnknownRequestError(KVCacheError, KeyError):
    """A request id that the manager does not know was given where one is required."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class KVCacheIntegrityError(AssertionError):
    """An internal invariant of the block pool or a manager does not hold."""
