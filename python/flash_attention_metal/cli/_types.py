"""argparse type functions: each checks one rule and names it, so that bad options fail before any
work starts (argparse adds the option's name to the message)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..context import normalize_backend

UINT32_MAX = 2**32 - 1


def positive_int(text: str) -> int:
    """An integer 1..2**32 - 1 (the C ABI's dimensions are uint32)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 1 <= value <= UINT32_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in 1..{UINT32_MAX} (2**32 - 1), got {value}")
    return value


def head_dim(text: str) -> int:
    """An integer from 1; the upper bound, the library's largest head_dim, is checked once the
    library is loaded (``bench.check_head_dim``), and named here too when it can be."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be in {head_dim_range()}, got {value}")
    return value


def head_dim_range(largest: int | None = None) -> str:
    """"1..N (the library's largest head_dim)", N read from the library unless given."""
    if largest is None:
        from .._native import native
        from ..errors import FlashAttentionError

        try:
            largest = int(native().lib.fa_max_head_dim())
        except FlashAttentionError:
            return "1..the library's largest head_dim (see `info`)"
    return f"1..{largest} (the library's largest head_dim)"


def backend(text: str) -> str:
    """A backend name, normalized as ``Context`` normalizes it (case and spaces ignored)."""
    try:
        return normalize_backend(text, "the backend")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def input_file(text: str) -> Path:
    """A path to an existing file: a file the user names must be there (no silent fallback)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}" if not path.exists() else f"{text!r} is not a file")
    return path


def output_file(text: str) -> Path:
    """A path to write to whose parent directory exists (checked before the work that fills it)."""
    path = Path(text)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"the directory {str(parent)!r} of {text!r} does not exist")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file name")
    return path
