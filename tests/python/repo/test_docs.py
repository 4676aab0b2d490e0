"""Every code block of README.md and docs/*.md runs as pasted (docs/contributing.md, "Code blocks").

A fenced block's info string says what is done with it:

- ``python``: run in a fresh interpreter (the repository root as working directory, the CPU
  engine as backend); it must exit 0.
- ``sh run`` or ``bash run``: run with ``bash -eo pipefail`` the same way, ``.venv/bin`` first on
  PATH (so ``python`` is the environment's). Shell blocks without ``run`` (building, installing,
  ``./build.sh test`` itself, MPI launches on several machines) are not run.
- ``output``: what the runnable block just before it prints, compared line by line with times (a
  number followed by s or ms) masked and runs of spaces counted as one, on both sides. A line
  ``...`` matches any number of lines, ``...`` inside a line any text (use it for table columns of
  times and for machine-dependent text such as paths).
- ``c``: a complete C11 program, compiled with ``-Wall -Wextra -Werror`` against the header,
  linked to the built library and run; it must exit 0.
- ``swift``: a complete Swift program, compiled against the built module and run; ``swift
  manifest``: a Package.swift, checked with ``swift package dump-package`` next to a copy of this
  package named ``libFlashAttentionMetal``.
- ``mac-only`` after the language (``python mac-only``, ``swift mac-only``, ``sh mac-only``): needs
  an Apple GPU or Metal; not run here.

Blocks in other languages (``text``, listings without a language) are not code. Every ``python``,
``c`` and ``swift`` block must carry one of the words above, so a new block is never skipped
silently.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[3]
_PAGES = [_ROOT / "README.md", *sorted((_ROOT / "docs").glob("*.md"))]
_LIBRARY = _ROOT / ".build" / "release"
_RUNS = {"python", "sh run", "bash run", "c", "swift", "swift manifest"}
_NOT_RUN_HERE = re.compile(r"^(python|swift|sh|bash|c) mac-only$")
_FENCE = re.compile(r"^```(.*)$")
_TIMEOUT = 300


@dataclass
class Block:
    page: Path
    line: int
    info: str
    text: str
    output: str | None = None

    @property
    def label(self) -> str:
        return f"{self.page.relative_to(_ROOT)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        info, text = opening.group(1).strip(), "\n".join(lines[i + 1:end]) + "\n"
        if info == "output":
            assert blocks and blocks[-1].info in _RUNS and blocks[-1].output is None, \
                f"{page.relative_to(_ROOT)}:{i + 1}: an output block must follow a runnable block"
            blocks[-1].output = text
        else:
            blocks.append(Block(page, i + 1, info, text))
        i = end + 1
    return blocks


_ALL = [block for page in _PAGES for block in _blocks(page)]
_RUNNABLE = [block for block in _ALL if block.info in _RUNS]


def test_every_code_block_says_what_is_done_with_it():
    unmarked = [f"{block.label} ```{block.info}" for block in _ALL
                if block.info.split(" ")[0] in {"python", "c", "swift", "sh", "bash"}
                and block.info not in _RUNS | {"sh", "bash"} and not _NOT_RUN_HERE.match(block.info)]
    assert not unmarked, "unknown info strings (see the module docstring): " + ", ".join(unmarked)


def _environment() -> dict:
    env = dict(os.environ, FLASH_ATTENTION_METAL_BACKEND="cpu", PYTHONUNBUFFERED="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT / "python"), str(_ROOT / "examples"), env.get("PYTHONPATH", "")])
    return env


def _run(command: list[str], cwd: Path, label: str) -> str:
    result = subprocess.run(command, cwd=cwd, env=_environment(), capture_output=True, text=True, timeout=_TIMEOUT)
    assert result.returncode == 0, f"{label} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


_TIME = re.compile(r"\d+(\.\d+)?(e-?\d+)? ?(ms|s)\b")


def _masked(text: str) -> list[str]:
    """Lines with times replaced by <time> and runs of whitespace by one space."""
    return [" ".join(_TIME.sub("<time>", line).split()) for line in text.rstrip("\n").splitlines()]


def _line_matches(expected: str, actual: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, actual) is not None


def _matches(expected: list[str], actual: list[str]) -> bool:
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(_matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and _line_matches(expected[0], actual[0]) and _matches(expected[1:], actual[1:])


def _check_output(block: Block, printed: str) -> None:
    if block.output is not None:
        expected, actual = _masked(block.output), _masked(printed)
        assert _matches(expected, actual), (f"{block.label}: printed\n" + "\n".join(actual)
                                            + "\n\nwhere the page shows\n" + "\n".join(expected))


def _compile_c(block: Block, tmp_path: Path) -> list[str]:
    source = tmp_path / "program.c"
    source.write_text(block.text)
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler})")
    binary = tmp_path / "program"
    _run([compiler, "-std=c11", "-Wall", "-Wextra", "-Werror", "-I",
          str(_ROOT / "Sources" / "CFlashAttentionMetal" / "include"), str(source), "-L", str(_LIBRARY),
          "-lFlashAttentionMetal", f"-Wl,-rpath,{_LIBRARY}", "-lm", "-o", str(binary)], tmp_path, block.label)
    return [str(binary)]


def _compile_swift(block: Block, tmp_path: Path) -> list[str]:
    if shutil.which("swiftc") is None or not (_LIBRARY / "Modules" / "FlashAttentionMetal.swiftmodule").exists():
        pytest.skip("no swiftc, or no release build of the module (./build.sh)")
    source = tmp_path / "main.swift"
    source.write_text(block.text)
    binary = tmp_path / "program"
    maps = [f"-fmodule-map-file={path}" for path in sorted(_LIBRARY.glob("*.build/module.modulemap"))]
    _run(["swiftc", "-Onone", str(source), "-I", str(_LIBRARY / "Modules"),
          *[flag for m in maps for flag in ("-Xcc", m)], "-L", str(_LIBRARY), "-lFlashAttentionMetal",
          "-Xlinker", "-rpath", "-Xlinker", str(_LIBRARY), "-o", str(binary)], tmp_path, block.label)
    return [str(binary)]


def _check_manifest(block: Block, tmp_path: Path) -> None:
    if shutil.which("swift") is None:
        pytest.skip("no swift")
    package = tmp_path / "MyApp"
    package.mkdir()
    (package / "Package.swift").write_text(block.text)
    sources = package / "Sources" / "MyApp"
    sources.mkdir(parents=True)
    (sources / "main.swift").write_text("print(1)\n")
    (tmp_path / "libFlashAttentionMetal").symlink_to(_ROOT)
    _run(["swift", "package", "dump-package"], package, block.label)


@pytest.mark.parametrize("block", _RUNNABLE, ids=[block.label for block in _RUNNABLE])
def test_code_block_runs_as_pasted(block, tmp_path):
    if block.info == "python":
        printed = _run([sys.executable, "-c", block.text], _ROOT, block.label)
    elif block.info in {"sh run", "bash run"}:
        printed = _run(["bash", "-eo", "pipefail", "-c", block.text], _ROOT, block.label)
    elif block.info == "c":
        printed = _run(_compile_c(block, tmp_path), tmp_path, block.label)
    elif block.info == "swift":
        printed = _run(_compile_swift(block, tmp_path), tmp_path, block.label)
    else:
        _check_manifest(block, tmp_path)
        return
    _check_output(block, printed)


def test_the_output_matcher():
    assert _matches(["a", "...", "d ... f"], ["a", "b", "c", "d e f"])
    assert _matches(["took <time>"], _masked("took 12.5 ms"))
    assert _matches(_masked("x   1  ok"), _masked("x 1 ok"))
    assert not _matches(["a", "b"], ["a", "c"])
    assert not _matches(["a"], ["a", "extra"])


# A page named in a Markdown link (not a URL), or as `docs/<name>.md` in code text, relative to the
# page or to the repository root (docs name each other both ways).
_PAGE_REFERENCE = re.compile(r"\]\((?![a-z]+://)([^)#\s]+\.md)(?:#[^)]*)?\)|`(docs/[\w.-]+\.md)`")


def _references(page: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        for match in _PAGE_REFERENCE.finditer(line):
            found.append((number, match.group(1) or match.group(2)))
    return found


@pytest.mark.parametrize("page", _PAGES, ids=lambda page: str(page.relative_to(_ROOT)))
def test_every_page_it_links_to_exists(page):
    missing = [f"{page.relative_to(_ROOT)}:{number}: {target}" for number, target in _references(page)
               if not ((page.parent / target).exists() or (_ROOT / target).exists())]
    assert not missing, "links to pages that do not exist:\n" + "\n".join(missing)


def test_the_link_finder():
    sample = _PAGE_REFERENCE.findall("see [a](docs/a.md#x), `docs/b.md` and [c](http://x.org/c.md)")
    assert [a or b for a, b in sample] == ["docs/a.md", "docs/b.md"]
