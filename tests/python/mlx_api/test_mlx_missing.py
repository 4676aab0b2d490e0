"""Without MLX: the package imports (it never imports MLX itself) and ``flash_attention_metal.mlx``
raises an ImportError that names the extra to install. Runs in child processes in which importing
``mlx`` fails, so it needs no MLX and holds whether MLX is installed or not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

_PYPROJECT = Path(__file__).resolve().parents[3] / "python" / "pyproject.toml"


def _run(code: str) -> subprocess.CompletedProcess:
    # sys.modules["mlx"] = None makes every `import mlx...` raise ImportError.
    return subprocess.run([sys.executable, "-c", "import sys; sys.modules['mlx'] = None\n" + code],
                          capture_output=True, text=True)


def test_the_package_imports_without_mlx_and_does_not_import_it():
    result = _run("import flash_attention_metal\nprint(any(m.split('.')[0] == 'mlx' for m in sys.modules if sys.modules[m]))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_mlx_module_names_the_extra_when_mlx_is_missing():
    result = _run("import flash_attention_metal.mlx")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: flash_attention_metal.mlx needs MLX"), last
    assert "'mlx' extra" in last and "pip install -e 'python[mlx]'" in last, last


def test_the_mlx_extra_and_the_test_extra_install_mlx():
    extras = tomllib.loads(_PYPROJECT.read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for name in ("mlx", "test"):
        assert any(requirement.startswith("mlx[cpu]>=") for requirement in extras[name]), name
