"""The command line: info, check (real input, fallback, failure exit status) and bench."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal.cli import _measure, bench, check, main


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(fam.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "flash_attention_metal", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_info_reports_version_backend_device_and_library():
    result = _cli("info", "--backend", "cpu")
    assert result.returncode == 0, result.stderr
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in result.stdout.splitlines())
    assert fields["backend"] == "cpu"
    assert fields["library"].endswith(("libFlashAttentionMetal.so", "libFlashAttentionMetal.dylib"))
    assert fields["max head_dim"] == "576"
    # One version, the header's FA_VERSION: the package's and the loaded library's agree.
    assert fields["version"] == fam.__version__ and fam.__version__.count(".") == 2
    assert fields["device"]
    assert fields["note"] == "-"
    # The CPU engine plans the decode chunks for the nominal GPU (exported plans, on a Mac, for its
    # GPU: then a "plan gpu cores" row says so).
    if "FLASH_ATTENTION_GPU_CORES" not in os.environ:
        assert fields["gpu cores"].startswith("10 (the nominal GPU")
    # Off a Mac no matrix units: the exported plans keep the simdgroup kernels, saying why.
    if "FLASH_ATTENTION_TENSOR_OPS" not in os.environ and sys.platform != "darwin":
        assert fields["tensor ops"] == ("simdgroup kernels: no Metal device, and the host named no architecture; "
                                        "the host compiled no tensor-op library (exported plans: PyTorch MPS, MLX GPU)")


def test_info_says_why_auto_runs_on_the_cpu():
    """auto on a machine without a usable Metal device names the reason (off Apple: no Metal)."""
    result = _cli("info", "--backend", "auto")
    assert result.returncode == 0, result.stderr
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in result.stdout.splitlines())
    if fields["backend"] == "metal":
        assert fields["note"].startswith("kernels ")
    else:
        assert fields["note"].startswith("the CPU engine runs the kernels: ")


def test_check_on_the_builtin_real_input_passes():
    assert check.BUILTIN_INPUT.is_file(), "the built-in input data/minilm_attention.npz is missing"
    result = _cli("check", "--backend", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "real attention inputs" in result.stdout
    with np.load(check.BUILTIN_INPUT) as data:
        runs = 2 * len(data["cases"])
    assert f"{runs} of {runs} runs within the accuracy rule" in result.stdout


def test_check_falls_back_to_seeded_random_input_only_without_a_path(tmp_path):
    cases, source = check.load_cases(None, builtin=tmp_path / "missing.npz")
    assert "not found: using seeded random" in source
    assert all(c.q.shape == (1, 12, c.q.shape[2], 32) and c.q.dtype == np.float16 for c in cases)
    again, _ = check.load_cases(None, builtin=tmp_path / "missing.npz")
    np.testing.assert_array_equal(cases[0].q, again[0].q)
    with pytest.raises(FileNotFoundError, match="no such file"):
        check.load_cases(tmp_path / "missing.npz")


def test_check_input_that_does_not_exist_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["check", "--input", str(tmp_path / "missing.npz")])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and f"argument --input: no such file: '{tmp_path / 'missing.npz'}'" in err


def _write_npz(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_check_input_in_every_dtype(tmp_path, capsys, dtype):
    """Real MiniLM inputs cast to bfloat16 (np.savez stores it as 'V2') or float32 pass the rule."""
    with np.load(check.BUILTIN_INPUT) as data:
        name = str(data["cases"][0])
        parts = {f"{name}_{p}": data[f"{name}_{p}"].astype(getattr(ml_dtypes, dtype, None) or dtype)
                 for p in ("q", "k", "v", "dout")}
    path = _write_npz(tmp_path / "input.npz", cases=np.array([name]), **parts)
    assert main(["check", "--backend", "cpu", "--input", str(path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(name)]
    assert [row[2] for row in rows] == [dtype, dtype] and all(row[-1] == "ok" for row in rows)


@pytest.mark.parametrize("content, lacks", [
    ("text", "is not an .npz archive"),
    ("npy", "holds a single array, not an .npz archive"),
    ("no cases", "lacks the array 'cases'"),
    ("no dout", "lacks tiny_dout"),
    ("float32", "tiny_k is float16 of shape (1, 2, 3, 4); check needs float16, bfloat16 or float32"),
    ("float64", "tiny_q is float64 of shape (1, 2, 3, 4); check needs float16, bfloat16 or float32"),
])
def test_check_input_without_the_expected_content_is_one_line_and_exit_1(tmp_path, capsys, content, lacks):
    half = np.zeros((1, 2, 3, 4), dtype=np.float16)
    parts = {f"tiny_{p}": half for p in ("q", "k", "v")}
    path = tmp_path / "input.npz"
    if content == "text":
        path.write_text("not an archive\n")
    elif content == "npy":
        path = tmp_path / "input.npy"
        np.save(path, half)
    elif content == "no cases":
        _write_npz(path, **parts)
    elif content == "no dout":
        _write_npz(path, cases=np.array(["tiny"]), **parts)
    else:
        _write_npz(path, cases=np.array(["tiny"]), **{**parts, "tiny_q": half.astype(content),
                                                      "tiny_dout": half})
    assert main(["check", "--backend", "cpu", "--input", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: ") and lacks in captured.err, captured.err


class _SlowFirstCallContext:
    """Exact results (the float64 reference) whose very first call takes a second, like one-time set-up."""

    backend, device = "cpu", "stub"

    def __init__(self):
        self.calls = 0

    def _first_is_slow(self):
        self.calls += 1
        if self.calls == 1:
            time.sleep(1.0)

    def forward(self, q, k, v, *, causal=False):
        self._first_is_slow()
        out, lse = fam.reference.forward(q, k, v, causal=causal)
        return out.astype(np.float16), lse.astype(np.float32)

    def backward(self, dout, q, k, v, out, lse, *, causal=False):
        self._first_is_slow()
        return tuple(g.astype(np.float16) for g in fam.reference.backward(dout, q, k, v, causal=causal))


def test_check_warms_up_before_the_first_timed_row(tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng(1)
    parts = {f"tiny_{part}": rng.standard_normal((1, 2, 5, 8)).astype(np.float16) for part in ("q", "k", "v", "dout")}
    np.savez(tmp_path / "tiny.npz", cases=np.array(["tiny"]), **parts)
    monkeypatch.setattr(check, "context_for", lambda backend: _SlowFirstCallContext())
    assert main(["check", "--input", str(tmp_path / "tiny.npz")]) == 0
    first_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny "))
    forward_ms = float(first_row.split()[4])
    assert forward_ms < 500, first_row  # the one-second first call was the warm-up, not timed


class _WrongContext:
    """Returns zeros: every gradient and out are far outside the rule."""

    backend, device = "cpu", "stub"

    def forward(self, q, k, v, *, causal):
        return np.zeros_like(q), np.zeros(q.shape[:3], dtype=np.float32)

    def backward(self, dout, q, k, v, out, lse, *, causal):
        return np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)


def test_check_fails_on_wrong_results(tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng(0)
    parts = {f"tiny_{part}": rng.standard_normal((1, 12, 9, 32)).astype(np.float16) for part in ("q", "k", "v", "dout")}
    np.savez(tmp_path / "tiny.npz", cases=np.array(["tiny"]), **parts)
    monkeypatch.setattr(check, "context_for", lambda backend: _WrongContext())
    assert main(["check", "--input", str(tmp_path / "tiny.npz")]) == 1
    output = capsys.readouterr().out
    assert output.count("FAIL") == 2 and "0 of 2 runs within the accuracy rule" in output


def test_bench_times_and_counts_flops(tmp_path):
    result = _cli("bench", "--backend", "cpu", "--seqlens", "16", "33", "--heads", "2", "--head-dim", "32",
                  "--repeats", "1")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["16"], ["33"])]
    assert [(r[0], r[1]) for r in rows] == [("16", "False"), ("16", "True"), ("33", "False"), ("33", "True")]
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows)


def test_flop_count_follows_flash_attention():
    assert _measure.forward_flops(2, 3, 5, 7, 11, causal=False) == 4 * 2 * 3 * 5 * 7 * 11
    assert _measure.forward_flops(2, 3, 5, 7, 11, causal=True) == 2 * 2 * 3 * 5 * 7 * 11
    result = bench.Result(seqlen=8, causal=False, forward_ms=1.0, backward_ms=2.0, forward_flops=1e9)
    assert result.forward_tflops == pytest.approx(1.0)  # 1e9 FLOP in 1 ms
    assert result.backward_tflops == pytest.approx(1.25)  # 2.5e9 FLOP in 2 ms


def test_bench_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    results = [bench.Result(n, c, 1.0 + n, 2.0 + n, 1e9 * n) for n in (16, 32) for c in (False, True)]
    bench.plot(results, path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_without_a_suffix_prints_the_file_it_wrote(tmp_path):
    pytest.importorskip("matplotlib")
    result = _cli("bench", "--backend", "cpu", "--seqlens", "16", "--heads", "1", "--head-dim", "8",
                  "--repeats", "1", "--causal", "off", "--plot", str(tmp_path / "chart"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"plot saved to {tmp_path / 'chart.png'}"
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "chart").exists()


def test_bench_plot_in_a_format_matplotlib_cannot_write_is_a_usage_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as caught:
        main(["bench", "--backend", "cpu", "--plot", str(tmp_path / "chart.nope")])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "argument --plot: matplotlib cannot write .nope files" in err


def test_throughput_is_shown_in_gflops_below_one_tflops():
    assert _measure.throughput_unit([0.002, 0.5]) == (1e3, "GFLOP/s")
    assert _measure.throughput_unit([0.5, 3.0]) == (1.0, "TFLOP/s")


def test_bench_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, default in [("--batch", "1"), ("--heads", "8"), ("--head-dim", "64"), ("--repeats", "3"),
                            ("--causal", "both")]:
        assert re.search(re.escape(option) + r".*?\(default: " + default, text), option


def test_the_matplotlib_hint_is_the_documented_wording():
    page = (Path(__file__).resolve().parents[3] / "docs" / "python.md").read_text()
    assert _measure.MATPLOTLIB_HINT in page


@pytest.mark.parametrize("option, value, rule", [
    ("--seqlens", "-5", "must be an integer in 1..4294967295"),
    ("--seqlens", "0", "must be an integer in 1..4294967295"),
    ("--seqlens", "5000000000", "must be an integer in 1..4294967295"),
    ("--seqlens", "ten", "must be an integer, got 'ten'"),
    ("--batch", "0", "must be an integer in 1..4294967295"),
    ("--heads", "-1", "must be an integer in 1..4294967295"),
    ("--head-dim", "0", "must be in 1..576 (the library's largest head_dim), got 0"),
    ("--head-dim", "-3", "must be in 1..576 (the library's largest head_dim), got -3"),
    ("--repeats", "0", "must be an integer in 1..4294967295"),
])
def test_bench_rejects_bad_sizes_while_parsing(capsys, option, value, rule):
    with pytest.raises(SystemExit) as caught:
        main(["bench", "--backend", "cpu", option, value])
    assert caught.value.code == 2
    assert f"argument {option}: {rule}" in capsys.readouterr().err


def test_bench_plot_directory_must_exist_before_running(tmp_path, capsys):
    target = tmp_path / "missing" / "bench.png"
    with pytest.raises(SystemExit) as caught:
        main(["bench", "--backend", "cpu", "--plot", str(target)])
    assert caught.value.code == 2
    assert f"argument --plot: the directory '{target.parent}'" in capsys.readouterr().err


def test_bench_head_dim_above_the_library_limit_is_a_usage_error_before_any_progress(ctx, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["bench", "--backend", "cpu", "--head-dim", str(ctx.max_head_dim + 1)])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("usage: python -m flash_attention_metal bench")
    assert captured.err.endswith(f"error: argument --head-dim: must be in 1..{ctx.max_head_dim} (the library's "
                                 f"largest head_dim), got {ctx.max_head_dim + 1}\n")
    assert captured.out == ""


class _NoMemory:
    def standard_normal(self, shape):
        raise MemoryError


def test_bench_out_of_memory_is_a_clean_error_on_its_own_line(monkeypatch, capsys):
    monkeypatch.setattr(_measure.np.random, "default_rng", lambda seed: _NoMemory())
    assert main(["bench", "--backend", "cpu", "--seqlens", "4000000000", "--repeats", "1"]) == 1
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: cannot allocate the inputs of seqlen 4000000000")
    assert "use smaller --seqlens" in errors[0]


def test_backend_option_is_normalized_like_the_context():
    from flash_attention_metal.cli import build_parser

    assert build_parser().parse_args(["info", "--backend", " CPU "]).backend == "cpu"


def test_bench_decode_times_decode_shapes_and_reports_the_dispatches(capsys):
    # At most 8 query rows take the decode kernel and its combine at any length.
    assert main(["bench", "--decode", "--backend", "cpu", "--seqlens", "40", "600", "--query-rows", "1", "3",
                 "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "decode, B=1 H=4 H_kv=2 D=32, causal" in out
    rows = {(r[0], r[1]): r for r in (line.split() for line in out.splitlines()) if r[:1] in (["1"], ["3"])}
    assert sorted(rows) == [("1", "40"), ("1", "600"), ("3", "40"), ("3", "600")]
    for (_, keys), r in rows.items():
        assert float(r[2]) > 0 and float(r[3]) == pytest.approx(2 * 2 * int(keys) * 32 * 2 / 1e6, abs=0.01)
        assert int(r[5]) >= 1
    assert rows[("1", "40")][6:] == ["flash_attention_forward_decode_f16_d32", "+", "flash_attention_forward_combine_f16"]
    assert rows[("1", "600")][6:] == ["flash_attention_forward_decode_f16_d32", "+", "flash_attention_forward_combine_f16"]


@pytest.mark.parametrize("options, message", [
    (["--decode", "--heads", "6", "--kv-heads", "4"], "argument --kv-heads: must divide --heads (6), got 4"),
    (["--decode", "--plot", "x.png"], "argument --plot: not allowed with --decode"),
    (["--kv-heads", "2"], "argument --kv-heads: needs --decode"),
    (["--query-rows", "2"], "argument --query-rows: needs --decode"),
])
def test_bench_decode_checks_its_options(capsys, options, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--backend", "cpu", *options])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_m5_check_runs_off_apple_gpus_and_says_so():
    """m5-check (docs/tensor-ops.md, "What an M5 owner should run") on the CPU engine: the device
    line and the reason say it is not an Apple GPU, and each head_dim gets its paths and times."""
    env_free = {k: v for k, v in os.environ.items() if k != "FLASH_ATTENTION_TENSOR_OPS"}
    env_free["PYTHONPATH"] = os.pathsep.join(
        [str(Path(fam.__file__).resolve().parent.parent), env_free.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-m", "flash_attention_metal", "m5-check", "--backend", "cpu",
                             "--head-dims", "64", "96", "--seqlen", "16", "--heads", "1", "--repeats", "1"],
                            env=env_free, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "not an Apple GPU" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in ("64", "96")}
    assert set(rows) == {"64", "96"}
    for row in rows.values():
        assert row[1:3] == ["simdgroup", "simdgroup"]
        assert all(float(x) > 0 for x in row[3:5] + row[6:8])
    assert any(line.startswith("why (head_dim 64, 96): not an Apple GPU") for line in lines)


def test_m5_check_reasons_follow_the_override_and_the_path():
    from types import SimpleNamespace

    from flash_attention_metal.cli.m5_check import path_name, reason

    engine = SimpleNamespace(backend="cpu", device="CPU engine", note="")
    mac = SimpleNamespace(backend="metal", device="Apple M5 Max", note="")
    assert path_name(("flash_attention_forward_tensor_f16_d128",)) == "tensor ops"
    assert path_name(("flash_attention_forward_f16_d128",)) == "simdgroup"
    assert "=0 forbids" in reason(mac, False, "0")
    assert "=1 forces" in reason(engine, True, "1") and "emulation" in reason(engine, True, "1")
    assert "but none ran" in reason(mac, False, "1")
    assert reason(engine, False, None).startswith("not an Apple GPU")
    assert "the plan chose them" in reason(mac, True, None)
    assert "macOS 26.2" in reason(mac, False, None)
