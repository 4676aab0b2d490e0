"""Property test: random shapes, flags and GQA groupings stay within the accuracy rule."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flash_attention_metal import accuracy

from conftest import assert_within_rule, make_inputs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    seqlen_q=st.integers(1, 80),
    seqlen_k=st.integers(1, 80),
    head_dim=st.integers(1, 256),
    causal=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.01, 2.0)),
    seed=st.integers(0, 2**16),
)
def test_random_problems_within_rule(ctx, batch, kv_heads, group, seqlen_q, seqlen_k, head_dim, causal, scale, seed):
    # The rule compares maxima, which are noise over a handful of elements. Backward uses
    # D = rowsum(dout * out) with out in float16 (FlashAttention-2), so each gradient carries about
    # half an ulp of out times |dout|; the float16 base carries the same kind of error, and over a
    # few dozen elements it can land near zero by chance. Measured on the CPU engine: 4 of 1500 draws
    # with head_dim <= 8 failed, each with a gradient tensor under 32 elements; 1 of 2000 with at
    # least 32 elements; 0 of 2000 with at least 64 elements and 4 rows. Smaller problems are covered
    # by the fixed grid in test_accuracy.py.
    rows = batch * kv_heads * group * seqlen_q
    assume(rows >= 4 and min(rows, batch * kv_heads * seqlen_k) * head_dim >= 64)
    q, k, v, dout = make_inputs(seed, batch, kv_heads * group, kv_heads, seqlen_q, seqlen_k, head_dim)
    label = f"q {q.shape} k {k.shape} causal={causal} scale={scale}"
    out, lse = ctx.forward(q, k, v, causal=causal, softmax_scale=scale)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=causal, softmax_scale=scale), label)
    grads = ctx.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, causal=causal, softmax_scale=scale), label)
