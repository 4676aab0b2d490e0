"""Loading libFlashAttentionMetal with cffi (ABI mode).

The declarations come from the shipped C header, the text between its ``FA_CDEF_BEGIN`` and
``FA_CDEF_END`` markers, so the binding cannot drift from the ABI. cffi releases the GIL during
every call into the library.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import cffi

from ._header import HEADER_NAME, PACKAGE_DIR, REPO_ROOT, header_candidates
from .errors import ArgumentError, FlashAttentionError

LIBRARY_ENV = "FLASH_ATTENTION_METAL_LIBRARY"

_CDEF_BEGIN = "/* FA_CDEF_BEGIN */"
_CDEF_END = "/* FA_CDEF_END */"


def library_file_name() -> str:
    """The platform's file name of the library: ``.dylib`` on macOS, ``.so`` elsewhere."""
    return "libFlashAttentionMetal.dylib" if sys.platform == "darwin" else "libFlashAttentionMetal.so"


def library_candidates() -> list[Path]:
    """Where the library is looked for, in order.

    ``$FLASH_ATTENTION_METAL_LIBRARY`` (a file path) alone when it is set, since a user who names a
    file means that file; otherwise next to the package, then the SwiftPM release build tree of the
    repository (``.build/release``).
    """
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return [Path(override)]
    name = library_file_name()
    return [PACKAGE_DIR / name, REPO_ROOT / ".build" / "release" / name]


def extract_cdef(header_text: str) -> str:
    """The declarations between the FA_CDEF markers of the header text.

    Raises FlashAttentionError when a marker is missing.
    """
    begin = header_text.find(_CDEF_BEGIN)
    end = header_text.find(_CDEF_END)
    if begin < 0 or end < begin:
        raise FlashAttentionError(
            f"the C header has no {_CDEF_BEGIN} ... {_CDEF_END} section", status_name="BAD_HEADER"
        )
    return header_text[begin + len(_CDEF_BEGIN) : end]


def _find_first(candidates: list[Path]) -> Path | None:
    return next((path for path in candidates if path.is_file()), None)


def missing_symbols(lib) -> list[str]:
    """The names the cdef declares that the loaded library does not define, sorted.

    cffi resolves ABI-mode symbols lazily, so without this check a file that loads but is some
    other library would fail only on its first call, with cffi's AttributeError.
    """
    missing = []
    for name in sorted(dir(lib)):
        try:
            getattr(lib, name)
        except AttributeError:
            missing.append(name)
    return missing


class NativeLibrary:
    """The loaded library: ``ffi`` (the cffi FFI with the header's cdef), ``lib`` (its functions)
    and ``path`` (the file that was loaded)."""

    def __init__(self, ffi: cffi.FFI, lib, path: Path, header_path: Path) -> None:
        self.ffi = ffi
        self.lib = lib
        self.path = path
        self.header_path = header_path

    def raise_for_status(self, status: int) -> None:
        """Raises FlashAttentionError with this thread's last library message unless status is 0:
        an ``ArgumentError`` (also a ValueError) for a refused argument.

        Must run on the thread that made the failing call: the message is thread-local.
        """
        if status == self.lib.FA_STATUS_SUCCESS:
            return
        message = self.ffi.string(self.lib.fa_last_error_message()).decode("utf-8", "replace")
        name = self.ffi.string(self.lib.fa_status_name(status)).decode("ascii", "replace")
        refused = status in (self.lib.FA_STATUS_INVALID_ARGUMENT, self.lib.FA_STATUS_UNSUPPORTED)
        raise (ArgumentError if refused else FlashAttentionError)(
            message or "the library reported an error without a message", status, name)


def load() -> NativeLibrary:
    """Finds the header and the library and loads them (no caching; see ``native()``).

    Raises FlashAttentionError (status_name ``LIBRARY_NOT_FOUND`` or ``HEADER_NOT_FOUND``) with the
    paths tried and the fix: run ``./build.sh`` at the repository root; ``LIBRARY_NOT_LOADABLE``
    when the file cannot be loaded or lacks any function the header declares (it is not
    libFlashAttentionMetal, or a build older than the header).
    """
    header_path = _find_first(header_candidates())
    if header_path is None:
        tried = ", ".join(str(p) for p in header_candidates())
        raise FlashAttentionError(
            f"C header {HEADER_NAME} not found (tried {tried}); run ./build.sh at the repository root",
            status_name="HEADER_NOT_FOUND",
        )
    library_path = _find_first(library_candidates())
    if library_path is None:
        tried = ", ".join(str(p) for p in library_candidates())
        raise FlashAttentionError(
            f"{library_file_name()} not found (tried {tried}); run ./build.sh at the repository "
            f"root to build it, or set {LIBRARY_ENV} to the path of a built library",
            status_name="LIBRARY_NOT_FOUND",
        )
    ffi = cffi.FFI()
    ffi.cdef(extract_cdef(header_path.read_text(encoding="utf-8")))
    try:
        lib = ffi.dlopen(str(library_path))
    except OSError as error:
        raise FlashAttentionError(
            f"cannot load {library_path}: {error}; rebuild it with ./build.sh",
            status_name="LIBRARY_NOT_LOADABLE",
        ) from error
    missing = missing_symbols(lib)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise FlashAttentionError(
            f"{library_path} is not {library_file_name()}: it lacks {shown} declared by {header_path}; "
            f"set {LIBRARY_ENV} to a library built by ./build.sh (or rebuild it if it is an old build)",
            status_name="LIBRARY_NOT_LOADABLE",
        )
    return NativeLibrary(ffi, lib, library_path.resolve(), header_path.resolve())


_lock = threading.Lock()
_native: NativeLibrary | None = None


def native() -> NativeLibrary:
    """The library, loaded once per process on first use (thread-safe)."""
    global _native
    with _lock:
        if _native is None:
            _native = load()
        return _native
