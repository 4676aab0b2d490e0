"""Where the C header is, and the version it defines (``FA_VERSION``, the project's one definition
of its version: the library's ``fa_version()``, this package's ``__version__`` and its metadata).

Standard library only: ``python/setup.py`` runs this file by path, before the package's
dependencies exist, to give the package its version.
"""

from __future__ import annotations

import re
from pathlib import Path

HEADER_NAME = "flash_attention_metal.h"

PACKAGE_DIR = Path(__file__).resolve().parent
# python/flash_attention_metal -> python -> repository root (an editable or in-tree checkout).
REPO_ROOT = PACKAGE_DIR.parent.parent

_VERSION_LINE = re.compile(r'^#define FA_VERSION "(\d+\.\d+\.\d+)"$', re.MULTILINE)


def header_candidates() -> list[Path]:
    """Where the C header is looked for, in order: next to the package, then the source tree."""
    return [PACKAGE_DIR / HEADER_NAME, REPO_ROOT / "Sources" / "CFlashAttentionMetal" / "include" / HEADER_NAME]


def find_header() -> Path | None:
    """The first candidate that exists, or None."""
    return next((path for path in header_candidates() if path.is_file()), None)


def header_version(text: str) -> str:
    """The ``FA_VERSION`` that header ``text`` defines; ValueError when it defines none."""
    match = _VERSION_LINE.search(text)
    if match is None:
        raise ValueError('the C header defines no FA_VERSION "MAJOR.MINOR.PATCH" line')
    return match.group(1)


def version() -> str:
    """The version of the header this package uses; ValueError when no header is found (a package
    copied without its header)."""
    header = find_header()
    if header is None:
        tried = ", ".join(str(path) for path in header_candidates())
        raise ValueError(f"C header {HEADER_NAME} not found (tried {tried}); run ./build.sh at the repository root")
    return header_version(header.read_text(encoding="utf-8"))
