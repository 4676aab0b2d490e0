"""python/pyproject.toml: every package directory and data file is declared, in forms current
setuptools accepts without deprecation warnings."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import flash_attention_metal as fam

tomllib = pytest.importorskip("tomllib")

_PACKAGE_DIR = Path(fam.__file__).resolve().parent
_PYPROJECT = _PACKAGE_DIR.parent / "pyproject.toml"


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads(_PYPROJECT.read_text(encoding="utf-8"))


def test_license_is_an_spdx_string_and_setuptools_supports_it(project):
    assert isinstance(project["project"]["license"], str), "project.license as a table is deprecated"
    floors = [re.fullmatch(r"setuptools>=(\d+).*", r) for r in project["build-system"]["requires"]]
    assert any(f and int(f.group(1)) >= 77 for f in floors), "SPDX license strings need setuptools >= 77"


def test_every_package_directory_is_listed(project):
    listed = set(project["tool"]["setuptools"]["packages"])
    directories = {
        ".".join((_PACKAGE_DIR.name, *path.relative_to(_PACKAGE_DIR).parts))
        for path in [_PACKAGE_DIR, *_PACKAGE_DIR.rglob("*")]
        if path.is_dir() and path.name != "__pycache__"
    }
    assert directories <= listed, f"not in [tool.setuptools] packages: {sorted(directories - listed)}"


def test_every_data_file_is_package_data_of_its_own_package(project):
    package_data = project["tool"]["setuptools"]["package-data"]
    for path in _PACKAGE_DIR.rglob("*.npz"):
        package = ".".join((_PACKAGE_DIR.name, *path.parent.relative_to(_PACKAGE_DIR).parts))
        patterns = package_data.get(package, [])
        assert any(fnmatch.fnmatch(path.name, p) for p in patterns), f"{path.name} not in package-data of {package}"


def test_one_version_everywhere(project):
    """FA_VERSION of the C header is the only definition: the library's fa_version(), the package's
    __version__ and its installed metadata all report it, and pyproject.toml states none."""
    from importlib import metadata

    from flash_attention_metal import _header, _native

    assert project["project"]["dynamic"] == ["version"] and "version" not in project["project"]
    header = _header.header_version(_header.header_candidates()[-1].read_text(encoding="utf-8"))
    loaded = _native.native()
    assert loaded.ffi.string(loaded.lib.fa_version()).decode() == header
    assert fam.__version__ == header
    assert metadata.version("flash_attention_metal") == header
    definitions = [path for path in (_PACKAGE_DIR.parent.parent / "Sources").rglob("*.[ch]")
                   if re.search(r'#define FA_VERSION "', path.read_text(encoding="utf-8"))]
    assert [path.name for path in definitions] == ["flash_attention_metal.h"]


def _setup_definitions(checkout: Path) -> dict:
    """python/setup.py's definitions, without its setup() call, as if it sat in ``checkout``/python."""
    source = (_PACKAGE_DIR.parent / "setup.py").read_text(encoding="utf-8").split("\nheader = runpy.run_path(")[0]
    (checkout / "python" / "flash_attention_metal").mkdir(parents=True)
    namespace = {"__file__": str(checkout / "python" / "setup.py"), "__name__": "setup_under_test"}
    exec(compile(source, "setup.py", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("case", ["no checkout", "no swift", "swift fails"])
def test_pip_install_without_a_library_builds_it_or_says_how(case, tmp_path, monkeypatch):
    """`pip install ./python` from a clean checkout builds the library with `swift build` (setup.py's
    built_library); where it cannot, it stops with a message naming what to do (Swift, ./build.sh
    or FLASH_ATTENTION_METAL_PREBUILT), never a traceback."""
    monkeypatch.delenv("FLASH_ATTENTION_METAL_PREBUILT", raising=False)
    tools = tmp_path / "bin"
    tools.mkdir()
    monkeypatch.setenv("PATH", str(tools))
    checkout = tmp_path / "checkout"
    setup = _setup_definitions(checkout)
    if case != "no checkout":
        (checkout / "Package.swift").write_text("// a checkout\n")
    if case == "swift fails":
        (tools / "swift").write_text("#!/bin/sh\nexit 3\n")
        (tools / "swift").chmod(0o755)
    with pytest.raises(SystemExit) as stopped:
        setup["built_library"]()
    message = str(stopped.value)
    assert "FLASH_ATTENTION_METAL_PREBUILT" in message
    expected = {"no checkout": "install from a checkout", "no swift": "Swift 5.9 or later on PATH",
                "swift fails": "`build -c release -debug-info-format none --product FlashAttentionMetal` failed"}[case]
    assert expected in message and ("./build.sh" in message or case == "no checkout")


def test_the_wheel_carries_the_library_the_header_and_the_swift_runtime(tmp_path):
    """`pip wheel ./python` with FLASH_ATTENTION_METAL_PREBUILT (python/setup.py): a py3-none-<platform>
    wheel holding the library and the C header and, on Linux, the Swift runtime libraries the
    library loads, which its RUNPATH's $ORIGIN finds where no toolchain is installed. The install
    into a fresh venv with the toolchain hidden is `./build.sh wheel` (.ci/run, outside this suite)."""
    from flash_attention_metal import _native

    library = _native.native().path
    # setuptools' in-tree build folder: what an earlier build left there would go into the wheel.
    shutil.rmtree(_PACKAGE_DIR.parent / "build", ignore_errors=True)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                             str(tmp_path), str(_PACKAGE_DIR.parent)],
                            env=dict(os.environ, FLASH_ATTENTION_METAL_PREBUILT=str(library)),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [wheel] = tmp_path.glob("flash_attention_metal-*.whl")
    assert re.search(r"-py3-none-(linux|manylinux|macosx)_\w+\.whl$", wheel.name), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"flash_attention_metal/{library.name}", "flash_attention_metal/flash_attention_metal.h",
            "flash_attention_metal/__init__.py"} <= names
    assert not [name for name in names if "_mlx_ext" in name], "the MLX extension is built for one Python and MLX"
    if sys.platform.startswith("linux"):
        needed = subprocess.run(["ldd", str(library)], capture_output=True, text=True, check=True).stdout
        runtime = set(re.findall(r"(libswift\w*\.so|libdispatch\.so|libBlocksRuntime\.so) => \S*/swift/", needed))
        assert "libswiftCore.so" in runtime
        assert {f"flash_attention_metal/{name}" for name in runtime} <= names
        dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
        assert re.search(r"RUNPATH.*\$ORIGIN", dynamic), dynamic
