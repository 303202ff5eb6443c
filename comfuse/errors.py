"""comfuse's errors and warnings, in one place.

The failure policy: nothing inside comfuse's part of a compilation may give a wrong answer or
crash the user's program. A failure there is reported with ``fallback``: a
``FallbackWarning`` (a ``ComfuseWarning``) naming what failed and what runs instead (the region's own ops, Inductor's
code), or, with ``COMFUSE_STRICT=1``, the exception itself.
"""
from __future__ import annotations

import warnings

from . import settings


class ComfuseWarning(UserWarning):
    """Something was not fused, or ran on a slower path than asked."""


class FallbackWarning(ComfuseWarning):
    """Something inside comfuse failed, and what it was building runs unfused (the region's own
    ops, Inductor's code) instead: the result is right, the speed is not what was asked."""


class KernelMismatch(AssertionError):
    """A generated kernel disagreed with the IR's reference interpreter (COMFUSE_CHECK=1), or
    with its own ops on its first call (COMFUSE_STRICT=1)."""


class UnsupportedLayout(RuntimeError):
    """These tensors cannot go through this kernel (a TMA operand that is not 16-byte aligned
    or not unit-stride along its rows): the call runs unfused and the kernel stays for the
    next call."""


class CaptureError(RuntimeError):
    """The function could not be traced into a graph."""


def summary(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters)."""
    text = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def fallback(what: str, e: BaseException, instead: str, stacklevel: int = 3) -> None:
    """Report a failure inside comfuse: raise ``e`` under COMFUSE_STRICT=1, else warn that
    ``what`` failed (with ``e``'s summary) and ``instead`` runs."""
    if settings.get().strict:
        raise e
    warnings.warn(f"comfuse: {what} ({summary(e)}); {instead} (COMFUSE_STRICT=1 raises instead)", FallbackWarning,
                  stacklevel=stacklevel)


_notices: set[str] = set()


def notice_once(key: str, message: str) -> None:
    """A ComfuseWarning once per process for ``key`` (a notice, not a failure)."""
    if key not in _notices:
        _notices.add(key)
        warnings.warn(message, ComfuseWarning, stacklevel=3)


def forget_notices() -> None:
    """Let every notice be given again (tests start from a clean state)."""
    _notices.clear()
