"""Dense forward and backward over >= 2048 keys with many query rows, values checked under the
accuracy rule.

Some faults only show at this length: O or dV accumulated in float16 stay within the rule on every
grid shape of test_accuracy.py (at most 257 keys) and fail it from about 2048 keys, where their
rounding error has grown past twice a framework's. Each case covers several properties, because
one forward and backward pair over 2048 x 2048 costs tens of seconds on the CPU engine. Measured on
2 shared cores (nice, beside other work): the module 87 s wall, 46 s CPU (f16 39 s, bf16 28 s,
f32 16 s, the few-rows forward 2 s).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from flash_attention_metal import accuracy

from conftest import assert_within_rule, judge, make_inputs

# (label, dtype, (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim), options)
CASES = [
    # float16, head_dim 64, causal, GQA 2:1 (dK/dV sum 2 x 2048 rows), a key count not a multiple
    # of any key tile.
    ("f16-D64-causal-gqa", np.float16, (1, 2, 1, 2048, 2085, 64), dict(causal=True)),
    # bfloat16, head_dim 128, not causal, a sliding window that cuts tiles on both sides.
    ("bf16-D128-window", ml_dtypes.bfloat16, (1, 1, 1, 2048, 2048, 128), dict(window_size=(700, 300))),
    # float32, head_dim 64, not causal, a boolean key-padding mask per batch (one row length ending
    # inside a tile), more keys than queries.
    ("f32-D64-mask", np.float32, (2, 1, 1, 512, 2080, 64), "padding"),
]


def _options(spec, batch: int, seqlen_q: int, seqlen_k: int) -> dict:
    if spec != "padding":
        return spec
    lengths = [seqlen_k, 1543]
    mask = np.zeros((batch, 1, seqlen_q, seqlen_k), bool)
    for b, length in enumerate(lengths):
        mask[b, :, :, :length] = True
    return dict(attn_mask=mask)


@pytest.mark.parametrize("label, dtype, shape, spec", CASES, ids=[c[0] for c in CASES])
def test_long_forward_and_backward_within_rule(ctx, label, dtype, shape, spec):
    q, k, v, dout = make_inputs(sum(shape), *shape, dtype=dtype)
    options = _options(spec, shape[0], shape[3], shape[4])
    judge(ctx, q, k, v, dout, options, label)


def test_long_forward_of_few_rows_within_rule(ctx):
    # The forward alone over 4100 keys (a few seconds): every row's O sums 4100 products, the
    # length at which float16 accumulation of O fails the rule. 65 rows: up to 64 the plan may split
    # the keys into chunks (FA_SPLIT_TILED_MAX_QUERY_ROWS), each too short to show that rounding.
    q, k, v, _ = make_inputs(3, 1, 2, 2, 65, 4100, 64)
    out, lse = ctx.forward(q, k, v)
    assert ctx.last_profile.dispatches[0].kernel.startswith("flash_attention_forward_f16")
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse), "forward 65 x 4100")
