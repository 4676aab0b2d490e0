"""The test tree's own rules: every test module sits in a feature folder, and every entry of the
quick tier (conftest.QUICK_TESTS, ./build.sh test --quick) names a test that exists."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import QUICK_TESTS

TESTS = Path(__file__).resolve().parents[1]


def test_test_modules_live_in_feature_folders():
    stray = sorted(path.name for path in TESTS.glob("test_*.py"))
    assert stray == [], f"move these into a feature folder of tests/python (docs/testing.md): {stray}"


def test_every_quick_entry_names_a_test():
    missing = []
    for path, names in QUICK_TESTS.items():
        module = TESTS / path
        defined = set()
        if module.exists():
            defined = {node.name for node in ast.walk(ast.parse(module.read_text(encoding="utf-8")))
                       if isinstance(node, ast.FunctionDef)}
        missing += [f"{path}::{name}" for name in names if name not in defined]
    assert missing == [], f"quick-tier entries that name no test: {missing}"
