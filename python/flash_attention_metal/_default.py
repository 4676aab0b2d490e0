"""The default Context behind the module-level functions, created on first use."""

from __future__ import annotations

import os
import threading

from .context import Context, normalize_backend

BACKEND_ENV = "FLASH_ATTENTION_METAL_BACKEND"

_lock = threading.Lock()
_context: Context | None = None


def default_backend() -> str:
    """The backend named by ``$FLASH_ATTENTION_METAL_BACKEND`` ("auto" when unset or blank),
    normalized as ``Context`` normalizes its argument.

    Raises ValueError naming the variable when it holds anything but auto, metal or cpu.
    """
    value = os.environ.get(BACKEND_ENV, "")
    return normalize_backend(value, BACKEND_ENV) if value.strip() else "auto"


def default_context() -> Context:
    """The process-wide Context, created on first call (thread-safe) on ``default_backend()``."""
    global _context
    with _lock:
        if _context is None:
            _context = Context(default_backend())
        return _context


def existing_default_context() -> Context | None:
    """The process-wide Context if it has been created, else None (creates nothing)."""
    with _lock:
        return _context
