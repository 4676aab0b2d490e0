"""Errors from the library and from loading it become FlashAttentionError with the library's text."""

from __future__ import annotations


import numpy as np
import pytest

import flash_attention_metal as fam
from conftest import METAL_MAY_EXIST
from flash_attention_metal import _native


def test_unknown_backend_name_is_a_value_error():
    with pytest.raises(ValueError, match=r"backend must be one of 'auto', 'metal', 'cpu' \(case and surrounding "
                                         r"spaces ignored\), got 'gpu'"):
        fam.Context("gpu")


def test_backend_names_are_trimmed_and_case_insensitive_like_the_variable():
    context = fam.Context(" CPU ")
    assert context.backend == "cpu" and context.requested_backend == "cpu"
    if not METAL_MAY_EXIST:
        with pytest.raises(fam.FlashAttentionError) as caught:
            fam.Context("METAL")
        assert caught.value.status_name == "FA_STATUS_BACKEND_UNAVAILABLE"


@pytest.mark.parametrize("backend", [None, 1, b"cpu"])
def test_backend_of_the_wrong_type_is_a_type_error(backend):
    with pytest.raises(TypeError, match=f"backend must be a str .*got {type(backend).__name__}"):
        fam.Context(backend)


@pytest.mark.skipif(METAL_MAY_EXIST, reason="Metal may be available on macOS and in the stand-in build")
def test_metal_backend_off_apple_is_backend_unavailable():
    with pytest.raises(fam.FlashAttentionError) as caught:
        fam.Context("metal")
    error = caught.value
    assert error.status_name == "FA_STATUS_BACKEND_UNAVAILABLE"
    assert error.status == 3
    assert error.message and error.message in str(error)


def test_library_error_carries_status_and_message(ctx):
    loaded = _native.native()
    ffi, lib = loaded.ffi, loaded.lib
    problem = ctx._problem(fam.context._validation.Shape(1, 1, 1, 4, 4, 8), False, 0.5)
    buffer = np.zeros(32, dtype=np.float16)
    lse = np.zeros(4, dtype=np.float32)
    half = ffi.from_buffer("uint16_t[]", buffer)
    status = lib.fa_forward(ctx._handle, problem, ffi.NULL, half, half, half, ffi.from_buffer("float[]", lse))
    with pytest.raises(fam.FlashAttentionError) as caught:
        loaded.raise_for_status(status)
    assert caught.value.status_name == "FA_STATUS_INVALID_ARGUMENT"
    assert caught.value.message


def test_library_rejects_head_dim_beyond_the_kernels(ctx):
    loaded = _native.native()
    ffi, lib = loaded.ffi, loaded.lib
    head_dim = ctx.max_head_dim + 1
    problem = ctx._problem(fam.context._validation.Shape(1, 1, 1, 1, 1, head_dim), False, 0.5)
    half = ffi.from_buffer("uint16_t[]", np.zeros(head_dim, dtype=np.float16))
    lse = ffi.from_buffer("float[]", np.zeros(1, dtype=np.float32))
    with pytest.raises(fam.FlashAttentionError) as caught:
        loaded.raise_for_status(lib.fa_forward(ctx._handle, problem, half, half, half, half, lse))
    assert caught.value.status_name in ("FA_STATUS_UNSUPPORTED", "FA_STATUS_INVALID_ARGUMENT")
    assert "head_dim" in caught.value.message


def test_missing_library_says_to_run_build_sh(monkeypatch, tmp_path):
    missing = tmp_path / "libFlashAttentionMetal.so"
    monkeypatch.setenv(fam.LIBRARY_ENV, str(missing))
    with pytest.raises(fam.FlashAttentionError, match=r"\./build\.sh") as caught:
        _native.load()
    assert caught.value.status_name == "LIBRARY_NOT_FOUND"
    assert str(missing) in caught.value.message


def test_cdef_comes_from_the_header_markers():
    header = _native.header_candidates()
    path = next(p for p in header if p.is_file())
    cdef = _native.extract_cdef(path.read_text())
    assert "fa_forward" in cdef and "FA_CDEF" not in cdef and "#" not in cdef
    with pytest.raises(fam.FlashAttentionError, match="FA_CDEF_BEGIN"):
        _native.extract_cdef("int f(void);")


def test_a_loadable_file_that_is_not_the_library_is_rejected_at_load(monkeypatch):
    # Any shared object without the fa_* functions will do; cffi's own extension is always present.
    import _cffi_backend

    other = _cffi_backend.__file__
    monkeypatch.setenv(fam.LIBRARY_ENV, other)
    with pytest.raises(fam.FlashAttentionError) as caught:
        _native.load()
    assert caught.value.status_name == "LIBRARY_NOT_LOADABLE"
    assert other in caught.value.message
    assert f"is not {_native.library_file_name()}" in caught.value.message
    assert "fa_version" in caught.value.message or "more" in caught.value.message
