"""Element strides for the C ABI (``_layout``), without the library: which views are read in place,
with which strides, and which are copied."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from flash_attention_metal import _layout


def _elements(view: np.ndarray, strides) -> np.ndarray:
    """Gathers view's elements through the ABI's addressing from the start of its first element."""
    base = np.lib.stride_tricks.as_strided(view, shape=(view.size * 64,), strides=(view.itemsize,))
    b, h, s, d = np.indices(view.shape)
    if strides == _layout.CONTIGUOUS:
        strides = (view.shape[1] * view.shape[2] * view.shape[3], view.shape[2] * view.shape[3], view.shape[3])
    return base[b * strides[0] + h * strides[1] + s * strides[2] + d]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_contiguous_is_all_zero_and_bshd_views_get_their_strides(dtype):
    x = np.arange(2 * 5 * 3 * 4).reshape(2, 5, 3, 4).astype(dtype)  # (B, L, H, D)
    assert _layout.element_strides(x) == _layout.CONTIGUOUS
    view = x.transpose(0, 2, 1, 3)  # (B, H, L, D) view
    assert _layout.element_strides(view) == (60, 4, 12)
    np.testing.assert_array_equal(_elements(view, (60, 4, 12)), view)


def test_packed_qkv_slice():
    qkv = np.zeros((2, 7, 3, 4, 8), np.float16)  # (B, L, 3, H, D)
    q = qkv[:, :, 1].transpose(0, 2, 1, 3)
    strides = _layout.element_strides(q)
    assert strides == (7 * 3 * 4 * 8, 8, 3 * 4 * 8)
    qkv[...] = np.arange(qkv.size).reshape(qkv.shape)
    np.testing.assert_array_equal(_elements(q, strides), q)


def test_axes_of_length_one_get_a_positive_stride_past_the_tensor():
    # NumPy leaves the stride of a length-1 axis arbitrary (here 0, or a parent's stride): the ABI
    # never steps along it, so it gets the tensor's span, which keeps it >= 1 and clear of overlap.
    every_other_row = np.zeros((3, 4, 10, 8), np.float32)[1:2, :, ::2]
    zero_stride = np.lib.stride_tricks.as_strided(every_other_row, strides=(0,) + every_other_row.strides[1:])
    one_head = np.zeros((2, 1, 6, 8), np.float32)[:, :, ::3]
    for view in (every_other_row, zero_stride, one_head):
        strides = _layout.element_strides(view)
        assert strides is not None and all(s >= 1 for s in strides)
        span = view.shape[3] + sum((n - 1) * s for n, s in zip(view.shape[:3], strides))
        assert all(s >= span for n, s in zip(view.shape[:3], strides) if n == 1)
        np.testing.assert_array_equal(_elements(view, strides), view)


@pytest.mark.parametrize("make", [
    pytest.param(lambda x: x[..., ::2], id="strided last axis"),
    pytest.param(lambda x: x[:, :, ::-1], id="negative stride"),
    pytest.param(lambda x: np.broadcast_to(x[:, :1], x.shape), id="zero stride"),
    pytest.param(lambda x: np.frombuffer(b"\0" + x.tobytes(), x.dtype, offset=1).reshape(x.shape), id="misaligned"),
])
def test_views_the_abi_cannot_address_are_copied(make):
    x = np.arange(2 * 3 * 5 * 8, dtype=np.float32).reshape(2, 3, 5, 8)
    view = make(x)
    assert _layout.element_strides(view) is None
    tensor = _layout.as_input(view, "bhsd")
    assert tensor.strides == _layout.CONTIGUOUS and tensor.array.flags.c_contiguous
    np.testing.assert_array_equal(tensor.array, view)


def test_inputs_in_place_point_at_their_first_element():
    qkv = np.zeros((1, 5, 3, 2, 4), ml_dtypes.bfloat16)
    k = qkv[:, :, 1]
    tensor = _layout.as_input(k, "bshd")
    assert tensor.address == k.ctypes.data and not tensor.array.flags.owndata


def test_outputs_follow_the_memory_order_of_their_input():
    bshd_storage = np.zeros((2, 7, 3, 8), np.float16).transpose(0, 2, 1, 3)  # bhsd shape, bshd memory
    out = _layout.new_output(bshd_storage, 5)
    assert out.shape == (2, 3, 7, 5) and out.transpose(0, 2, 1, 3).flags.c_contiguous
    strided_last = np.zeros((2, 3, 8, 7), np.float16).transpose(0, 1, 3, 2)
    out = _layout.new_output(strided_last, 4)
    assert out.shape == (2, 3, 7, 4) and out.flags.c_contiguous
    assert _layout.as_output(out, "bhsd").strides == _layout.CONTIGUOUS
