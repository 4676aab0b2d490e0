"""Context.last_profile (per context and per thread), the module-level last_profile and
``bench --profile``. The checks hold for any kernels: they compare with the shapes and with other
runs, never with kernel specifics."""

from __future__ import annotations

import threading

import pytest

import flash_attention_metal as fam
from flash_attention_metal.cli import bench_profile, main

from conftest import make_inputs

SHAPE = (1, 4, 2, 70, 90, 40)  # batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim


def _forward(ctx, batch=1, causal=False):
    q, k, v, _ = make_inputs(0, batch, *SHAPE[1:])
    ctx.forward(q, k, v, causal=causal)
    return ctx.last_profile


def _backward(ctx, batch=1, causal=False):
    q, k, v, dout = make_inputs(0, batch, *SHAPE[1:])
    out, lse = ctx.forward(q, k, v, causal=causal)
    ctx.backward(dout, q, k, v, out, lse, causal=causal)
    return ctx.last_profile


def _check_records(profile, prefix, batch, backend):
    assert profile.dispatches, "at least one dispatch"
    for d in profile.dispatches:
        assert d.kernel.startswith(prefix)
        assert d.threadgroups[2] == batch
        assert d.threadgroups[1] in (SHAPE[1], SHAPE[2]), "one threadgroup row per query or KV head"
        assert d.threadgroups[0] >= 1 and min(d.threads_per_threadgroup) >= 1
        assert 0 <= d.threadgroup_memory <= 32768  # a pre-pass may need none
        if backend == "cpu":
            assert d.simdgroup_multiply_accumulates >= 0 and d.threadgroup_barriers >= 0
            assert d.seconds > 0
        else:
            assert d.simdgroup_multiply_accumulates is None and d.threadgroup_barriers is None
            assert d.seconds is None
    assert profile.seconds > 0
    assert profile.command_buffers >= 1, "at least one piece"
    assert max(d.threadgroup_memory for d in profile.dispatches) > 0, "the attention kernels tile in it"
    if backend == "cpu":
        assert profile.command_buffers == 1, "the CPU engine runs a pass whole"
        assert profile.seconds == pytest.approx(sum(d.seconds for d in profile.dispatches), rel=1e-9)
        assert sum(d.threadgroup_barriers for d in profile.dispatches) > 0


def test_profile_of_forward_and_backward(ctx):
    fresh = fam.Context(ctx.backend)
    assert fresh.last_profile is None, "no call yet"
    for causal in (False, True):
        _check_records(_forward(fresh, causal=causal), "flash_attention_forward_", 1, fresh.backend)
        _check_records(_backward(fresh, causal=causal), "flash_attention_backward_", 1, fresh.backend)


def test_cpu_counters_are_exact_and_reproducible():
    # Threadgroups are independent: twice the batch executes exactly twice the products and barriers
    # of each kernel; the same call again executes exactly the same; causal never adds work.
    cpu = fam.Context("cpu")
    for run in (_forward, _backward):
        one, again, two, causal = run(cpu), run(cpu), run(cpu, batch=2), run(cpu, causal=True)
        for field in ("simdgroup_multiply_accumulates", "threadgroup_barriers"):
            counts = [getattr(d, field) for d in one.dispatches]
            assert [getattr(d, field) for d in again.dispatches] == counts
            assert [getattr(d, field) for d in two.dispatches] == [2 * c for c in counts]
            assert sum(getattr(d, field) for d in causal.dispatches) <= sum(counts)


def test_cpu_counts_device_reads_only_when_asked(monkeypatch):
    # FLASH_ATTENTION_COUNT_DEVICE_READS=1 (read at each call) turns the per-buffer byte counts on;
    # without it they are absent, and the products and barriers are counted either way, alike.
    cpu = fam.Context("cpu")
    monkeypatch.delenv("FLASH_ATTENTION_COUNT_DEVICE_READS", raising=False)
    plain = _forward(cpu)
    monkeypatch.setenv("FLASH_ATTENTION_COUNT_DEVICE_READS", "1")
    counted = _forward(cpu)
    q, k, v, _ = make_inputs(0, 1, *SHAPE[1:])
    for a, b in zip(plain.dispatches, counted.dispatches):
        assert a.device_bytes_read is None
        assert a.simdgroup_multiply_accumulates == b.simdgroup_multiply_accumulates
        assert a.threadgroup_barriers == b.threadgroup_barriers
    reads = counted.dispatches[0].device_bytes_read
    assert reads[1] >= k.nbytes and reads[2] >= v.nbytes, "every key and value is read"


def test_each_thread_sees_its_own_last_call(ctx):
    shared = fam.Context(ctx.backend)
    both_called = threading.Barrier(2)
    seen = {}

    def worker(batch):
        q, k, v, _ = make_inputs(batch, batch, *SHAPE[1:])
        shared.forward(q, k, v)
        both_called.wait()  # both calls are done before either thread reads its profile
        seen[batch] = shared.last_profile

    threads = [threading.Thread(target=worker, args=(batch,)) for batch in (1, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen[1].dispatches[0].threadgroups[2] == 1
    assert seen[3].dispatches[0].threadgroups[2] == 3
    assert shared.last_profile is None, "the main thread made no call"


def test_module_level_last_profile_follows_the_default_context():
    q, k, v, _ = make_inputs(0, 2, *SHAPE[1:])
    fam.forward(q, k, v)
    profile = fam.last_profile()
    assert profile.dispatches[0].kernel.startswith("flash_attention_forward_")
    assert profile.dispatches[0].threadgroups[2] == 2
    assert profile == fam.default_context().last_profile


def test_bench_profile_prints_every_measured_call(capsys):
    status = main(["bench", "--backend", "cpu", "--seqlens", "16", "40", "--heads", "2", "--head-dim", "32",
                   "--repeats", "1", "--causal", "on", "--profile"])
    assert status == 0
    out = capsys.readouterr().out
    table = out[out.index("profile of the last run"):].splitlines()[1:]
    assert table[0].split() == ["call", "kernel", "grid", "threads", "tg", "memory", "B", "MMAs", "barriers",
                                "seconds"]
    calls = [line.split()[:3] for line in table if not line.startswith(" ")]
    assert calls[1:] == [["forward", "16", "causal"], ["backward", "16", "causal"],
                         ["forward", "40", "causal"], ["backward", "40", "causal"]]
    kernels = [line.split()[-7] for line in table[1:] if "(call total)" not in line]
    assert all(k.startswith("flash_attention_") for k in kernels)
    assert sum("(call total)" in line for line in table) == 4
    for line in table[1:]:
        if "(call total)" not in line:
            grid, threads, memory, mmas, barriers, seconds = line.split()[-6:]
            assert int(grid.split("x")[2]) == 1 and 0 <= int(memory) <= 32768
            assert int(mmas) >= 0 and int(barriers) >= 0 and float(seconds) > 0


def test_profile_table_marks_what_metal_cannot_measure():
    dispatch = fam.DispatchProfile("flash_attention_forward_f16_d64", (4, 8, 2), (128, 1, 1), 12288, None, None, None)
    text = bench_profile.format_profiles({"forward 512": fam.Profile(0.0025, [dispatch])})
    row = text.splitlines()[1].split()
    assert row == ["forward", "512", "flash_attention_forward_f16_d64", "4x8x2", "128x1x1", "12288", "n/a", "n/a", "n/a"]
    assert text.splitlines()[2].split() == ["(call", "total)", "1", "command", "buffer", "0.002500"]
    split = bench_profile.format_profiles({"forward 512": fam.Profile(0.0025, [dispatch], command_buffers=6)})
    assert split.splitlines()[2].split() == ["(call", "total)", "6", "command", "buffers", "0.002500"]


def test_profile_names_the_specialisation_of_each_kernel(ctx):
    """The forward kernel is compiled for the call's features (docs/specialisation.md)."""
    q, k, v, _ = make_inputs(0, 1, *SHAPE[1:])
    ctx.forward(q, k, v)
    off = {"fa_mask_type": 0, "fa_has_softcap": 0, "fa_has_alibi": 0, "fa_has_sinks": 0, "fa_has_dropout": 0}
    assert ctx.last_profile.dispatches[0].specialization == off
    ctx.forward(q, k, v, softcap=30.0)
    assert ctx.last_profile.dispatches[0].specialization == {**off, "fa_has_softcap": 1}
