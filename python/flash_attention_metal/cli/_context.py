"""The Context a command runs on: --backend, else the default backend's environment variable."""

from __future__ import annotations

from .._default import default_backend
from ..context import Context


def context_for(backend: str | None) -> Context:
    """A Context on ``backend``, or on ``$FLASH_ATTENTION_METAL_BACKEND`` (default auto) if None."""
    return Context(backend if backend is not None else default_backend())
