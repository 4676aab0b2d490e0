"""benchmarks/compare_reference.py: the printed memory ratio stays honest at the resolution limit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_reference.py"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("compare_reference", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_memory_ratio_is_a_plain_ratio_above_the_resolution(compare):
    assert compare.memory_ratio(8192, 2048, 1024).strip() == "4.0"


def test_memory_ratio_is_a_lower_bound_when_the_library_growth_rounds_to_zero(compare):
    ratio = compare.memory_ratio(64 * 1024 * 1024, 0, 1024)
    assert ratio.strip() == "> 65536" and len(ratio) == 8
    assert "inf" not in ratio


def test_memory_ratio_is_not_available_when_neither_grew(compare):
    assert compare.memory_ratio(0, 0, 1024).strip() == "n/a"
