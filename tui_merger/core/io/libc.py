"""C library functions the engine calls through ctypes (which lets other Python threads run during
the call): each loaded once, None where this system has no such function (not Linux, not glibc)."""

from __future__ import annotations

import functools


@functools.cache
def function(name: str, restype: str | None, *argtypes: str):
    """libc's ``name`` with ctypes types given by name ("c_int", "c_void_p", ...), or None."""
    try:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
        fn.restype = getattr(ctypes, restype) if restype else None
        fn.argtypes = [getattr(ctypes, a) for a in argtypes]
        return fn
    except (OSError, AttributeError, TypeError):
        return None
