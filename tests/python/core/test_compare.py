"""bench --compare: the peers side by side, the JSON record, and the peak-memory measurement."""

from __future__ import annotations

import argparse
import importlib.util
import json

import numpy as np
import pytest

from flash_attention_metal.cli import _peak_memory, compare
from flash_attention_metal.cli.peers import PEERS, Case

from test_cli import _cli


def test_peer_list_is_checked_while_parsing():
    assert compare.peer_list("mlx, Torch,numpy,mlx") == ["mlx", "torch", "numpy"]
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated list of mlx, torch, numpy"):
        compare.peer_list("mlx,jax")


def test_json_without_compare_is_a_usage_error(tmp_path, capsys):
    from flash_attention_metal.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["bench", "--json", str(tmp_path / "record.json")])
    assert caught.value.code == 2 and "argument --json: needs --compare" in capsys.readouterr().err


def test_cases_cover_prefill_decode_causal_gqa_and_both_head_dims():
    args = argparse.Namespace(seqlens=None, head_dim=None, causal="both", heads=8, batch=1)
    cases = compare.cases(args, "cpu")
    assert {c.head_dim for c in cases} == set(compare.HEAD_DIMS)
    assert {c.seqlen_k for c in cases} == set(compare.CPU_SEQLENS)
    kinds = {(c.kind, c.num_kv_heads, c.seqlen_q == 1, c.causal) for c in cases}
    assert kinds == {("prefill", 8, False, False), ("prefill", 8, False, True), ("prefill GQA", 2, False, True),
                     ("decode GQA", 2, True, False)}
    with pytest.raises(ValueError, match="must be square"):
        Case("x", 1, 1, 1, 2, 3, 8, True)


def test_flop_count_of_forward_and_backward():
    case = Case("prefill", 2, 3, 3, 5, 5, 7, False)
    assert case.flops("forward") == 4 * 2 * 3 * 5 * 5 * 7
    assert case.flops("fwd+bwd") == 3.5 * case.flops("forward")


def test_peak_growth_sees_an_allocation():
    megabytes = 64

    def allocate():
        block = np.ones(megabytes * 2**20, dtype=np.uint8)  # touched, so resident
        return int(block[-1])

    assert _peak_memory.peak_growth(allocate) >= (megabytes - 4) * 2**20


def test_memory_ratio_is_a_plain_ratio_above_the_resolution():
    assert _peak_memory.memory_ratio(8192, 2048, 1024) == "4.0"


def test_memory_ratio_is_a_lower_bound_when_the_library_growth_rounds_to_zero():
    assert _peak_memory.memory_ratio(64 * 1024 * 1024, 0, 1024) == "> 65536"


def test_memory_ratio_is_not_available_when_neither_grew():
    assert _peak_memory.memory_ratio(0, 0, 1024) == "n/a"


def test_compare_runs_every_installed_peer_and_writes_the_record(tmp_path):
    record_path = tmp_path / "record.json"
    result = _cli("bench", "--backend", "cpu", "--compare", ",".join(PEERS), "--seqlens", "16", "--heads", "4",
                  "--head-dim", "32", "--repeats", "1", "--causal", "on", "--json", str(record_path))
    assert result.returncode == 0, result.stderr
    record = json.loads(record_path.read_text())
    assert record["schema"] == compare.SCHEMA
    assert record["machine"]["architecture"] and record["machine"]["os"]
    assert record["implementations"]["library"]["device"].startswith("cpu: ")
    installed = [name for name in PEERS if importlib.util.find_spec({"mlx": "mlx.core"}.get(name, name))]
    for name in PEERS:
        info = record["implementations"][name]
        assert info["available"] == (name in installed), info
        if not info["available"]:
            assert f"{name}: {info['reason']}; skipped" in result.stdout
    assert [r["label"] for r in record["results"]] == [
        "prefill B1 H4/4 16x16 D32 causal", "prefill GQA B1 H4/1 16x16 D32 causal", "decode GQA B1 H4/1 1x16 D32"]
    for r in record["results"]:
        assert set(r["implementations"]) == {"library", *installed}
        for name, figures in r["implementations"].items():
            assert "error" not in figures, (name, figures)
            for operation in ("forward", "fwd+bwd"):
                entry = figures[operation]
                assert entry["ms"] > 0 and entry["tflops"] == pytest.approx(r["flops"][operation] / entry["ms"] / 1e9)
                assert entry["peak_memory_bytes"] >= 0, entry
                assert (entry["device_ms"] > 0) if name == "library" else ("device_ms" not in entry), entry
    assert all(line in result.stdout for line in compare.LEGEND), "the table's columns are explained"
    # Every peer row carries its time ratio to the library's row of the same case and operation.
    rows = [line.split() for line in result.stdout.splitlines()]
    for name in installed:
        peer_rows = [row for row in rows if row and row[0] == name]
        assert len(peer_rows) == 2 * len(record["results"]), result.stdout
        assert all(float(row[5]) > 0 for row in peer_rows), result.stdout
