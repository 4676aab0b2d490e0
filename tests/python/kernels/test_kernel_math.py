"""Every float math function the kernels call is precise:: explicitly: a host's compile options pick
fast or precise for the unqualified ones (MTLCompileOptions.mathFloatingPointFunctions, fast by
default from macOS 15; MLX's compile sets only mathMode), and every front end must give the same
bits. A static scan of Shaders/ (comments removed); the planted case shows it can fail."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
#: MSL math functions whose fast and precise forms differ (MSL specification, math functions).
_FUNCTIONS = ("exp", "exp2", "exp10", "log", "log2", "log10", "pow", "powr", "sqrt", "rsqrt", "tanh", "sinh",
              "cosh", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "divide")
_CALL = re.compile(r"(?<![\w:.])((?:\w+::)*)(" + "|".join(_FUNCTIONS) + r")\s*\(")


def unqualified_calls(text: str) -> list[str]:
    """The math calls in `text` that are not precise::, comments removed."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.DOTALL)
    return [m.group(0) for m in _CALL.finditer(code) if m.group(1) not in ("precise::", "metal::precise::")]


def test_kernels_call_only_precise_math_functions():
    sources = sorted(ROOT.glob("Shaders/*.metal")) + sorted(ROOT.glob("Shaders/*.h"))
    assert sources
    found = {path.name: calls for path in sources if (calls := unqualified_calls(path.read_text()))}
    assert found == {}
    assert "precise::exp2(" in (ROOT / "Shaders" / "flash_attention_scores.h").read_text()


def test_the_scan_finds_an_unqualified_call():
    assert unqualified_calls("float f(float x) { return exp2(x) + precise::log(x); } // tanh(x)") == ["exp2("]
    assert unqualified_calls("x = metal::tanh(y); z = fast::exp(y); w = precise::exp(y);") == ["metal::tanh(", "fast::exp("]
