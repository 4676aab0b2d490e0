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
