"""FLASH_ATTENTION_METAL_BACKEND picks the default context's backend (checked in fresh processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import flash_attention_metal as fam

_PROBE = """
import numpy as np, flash_attention_metal as fam
try:
    context = fam.default_context()
except Exception as error:
    print(type(error).__name__, error)
else:
    q = np.ones((1, 1, 2, 4), dtype=np.float16)
    print("backend", context.backend, fam.attention(q, q, q).shape)
"""


def _probe(value: str | None) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(fam.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    env.pop(fam.BACKEND_ENV, None)
    if value is not None:
        env[fam.BACKEND_ENV] = value
    result = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_cpu_selected_by_environment():
    assert _probe("cpu") == "backend cpu (1, 1, 2, 4)"


def test_upper_case_value_is_accepted():
    assert _probe("CPU") == "backend cpu (1, 1, 2, 4)"


def test_unset_means_auto():
    expected = "metal" if sys.platform == "darwin" and fam.default_context().backend == "metal" else "cpu"
    assert _probe(None) == f"backend {expected} (1, 1, 2, 4)"


@pytest.mark.skipif(sys.platform == "darwin", reason="Metal may be available on macOS")
def test_metal_selected_off_apple_fails_with_backend_unavailable():
    assert _probe("metal").startswith("FlashAttentionError FA_STATUS_BACKEND_UNAVAILABLE")


def test_invalid_value_names_the_variable():
    assert _probe("cuda") == (f"ValueError {fam.BACKEND_ENV} must be one of 'auto', 'metal', 'cpu' "
                              "(case and surrounding spaces ignored), got 'cuda'")


def test_surrounding_spaces_are_ignored():
    assert _probe(" CPU ") == "backend cpu (1, 1, 2, 4)"


def test_blank_means_auto():
    assert _probe("  ") == _probe(None)
