"""The exception raised for errors that libFlashAttentionMetal reports."""

from __future__ import annotations


class FlashAttentionError(RuntimeError):
    """An error reported by libFlashAttentionMetal (or by loading it).

    Attributes:
        message: the library's text from ``fa_last_error_message()``, naming the argument and
            the rule that failed.
        status: the ``fa_status`` code as an int (0 = success is never raised); ``None`` when the
            library itself could not be loaded.
        status_name: the status as the library spells it, e.g. ``"FA_STATUS_UNSUPPORTED"``, or
            ``"LIBRARY_NOT_FOUND"`` when the library could not be loaded.
    """

    def __init__(self, message: str, status: int | None = None, status_name: str = "") -> None:
        self.message = message
        self.status = status
        self.status_name = status_name
        super().__init__(f"{status_name}: {message}" if status_name else message)


class ArgumentError(FlashAttentionError, ValueError):
    """An argument the library refused (``FA_STATUS_INVALID_ARGUMENT``, or ``FA_STATUS_UNSUPPORTED``
    for a value outside what its kernels have, such as a head_dim), its message naming the argument
    and the rule. A ValueError, as this package's own checks of values raise, so that a rule the
    library enforces needs no Python copy (``_validation``); and a FlashAttentionError, with the
    status and the library's message."""


class CapacityError(FlashAttentionError, ValueError):
    """A KV-cache length beyond what the cache or its block table holds (cache_seqlens + seqlen_new
    over the capacity), found by the Python layer before anything is written. Both a ValueError
    (this library's rule for a wrong value) and, through FlashAttentionError, a RuntimeError, the
    type FlashAttention raises for it (its test_flash_attn_kvcache_paged_block_table_bounds);
    ``status`` is None and ``status_name`` empty (no library call was made)."""
