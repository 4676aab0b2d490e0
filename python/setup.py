"""Gives the package its version (FA_VERSION of the C header, the project's one definition of it) and
puts the native library into wheels and non-editable installs, so that `pip install ./python` and
`pip wheel ./python` work from a checkout without build.sh (everything else is in pyproject.toml).

The library comes from, in order: $FLASH_ATTENTION_METAL_PREBUILT (a built libFlashAttentionMetal
.so/.dylib, with its .metallib files beside it); the one build.sh links next to the package; else
`swift build -c release` (as build.sh runs it) in the checkout this package sits in. The C header comes from the
checkout. On Linux the Swift runtime libraries the library needs are copied beside it: its RUNPATH
ends with $ORIGIN, so a machine without the Swift toolchain loads them from the package. Editable
installs (build.sh's) keep using the package folder as it is.
"""

import os
import platform
import re
import runpy
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PACKAGE = HERE / "flash_attention_metal"
CHECKOUT = HERE.parent
LIBRARY = "libFlashAttentionMetal.dylib" if platform.system() == "Darwin" else "libFlashAttentionMetal.so"
HEADER = CHECKOUT / "Sources" / "CFlashAttentionMetal" / "include" / "flash_attention_metal.h"
PREBUILT_ENV = "FLASH_ATTENTION_METAL_PREBUILT"


def built_library() -> Path:
    """The native library to install (see the module docstring), built with SwiftPM if need be."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        path = Path(prebuilt).resolve()
        if not path.is_file():
            raise SystemExit(f"{PREBUILT_ENV}={prebuilt!r} is not a file (a built {LIBRARY})")
        return path
    linked = PACKAGE / LIBRARY
    if linked.is_file():
        return linked.resolve()
    if not (CHECKOUT / "Package.swift").is_file():
        raise SystemExit(f"no {LIBRARY}: set {PREBUILT_ENV} to a built one, or install from a checkout of the "
                         "repository (python/ beside Package.swift), where Swift 5.9 or later builds it")
    swift = shutil.which("swift")
    if swift is None:
        raise SystemExit(f"building {LIBRARY} needs Swift 5.9 or later on PATH (https://www.swift.org/install); "
                         f"or run ./build.sh in the checkout first (it links the library next to the package), or "
                         f"set {PREBUILT_ENV} to a built one")
    command = [swift, "build", "-c", "release", "-debug-info-format", "none", "--product", "FlashAttentionMetal"]
    if subprocess.run(command, cwd=CHECKOUT).returncode != 0:
        raise SystemExit(f"`{' '.join(command[1:])}` failed in {CHECKOUT} (its output is above); ./build.sh "
                         f"builds the same and says what it needs, or set {PREBUILT_ENV} to a built {LIBRARY}")
    return CHECKOUT / ".build" / "release" / LIBRARY


def swift_runtime(library: Path) -> list[Path]:
    """The shared libraries of the Swift toolchain that `library` loads (Linux; none on macOS, whose
    Swift runtime is part of the OS), as ldd resolves them."""
    if platform.system() != "Linux":
        return []
    listing = subprocess.run(["ldd", str(library)], capture_output=True, text=True, check=True).stdout
    paths = [Path(p) for p in re.findall(r"=>\s*(\S+)\s*\(", listing)]
    return [p for p in paths if "/swift/" in str(p) and p.name.startswith(("libswift", "libdispatch",
                                                                             "libBlocksRuntime"))]


class BuildPyWithLibrary(build_py):
    """build_py, then the library, its .metallib files, the header and (Linux) the Swift runtime
    into the built package; nothing more in editable mode."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "flash_attention_metal"
        # The MLX extension build.sh puts beside the package is built against one Python and one
        # MLX: not for a wheel (flash_attention_metal.mlx then takes its pure-Python path).
        for extension in target.glob("_mlx_ext*"):
            extension.unlink()
        library = built_library()
        shutil.copyfile(library, target / LIBRARY)
        for metallib in library.parent.glob("flash_attention-*.metallib"):
            shutil.copyfile(metallib.resolve(), target / metallib.name)
        shutil.copyfile(HEADER if HEADER.is_file() else (PACKAGE / HEADER.name).resolve(), target / HEADER.name)
        for runtime in swift_runtime(library):
            shutil.copyfile(runtime, target / runtime.name)


class NativeDistribution(Distribution):
    """Has a native library: its files go to platlib and its wheel is not pure."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """A wheel for this platform (it carries a native library), for any Python 3 (cffi, no
    extension module)."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


header = runpy.run_path(str(PACKAGE / "_header.py"))
setup(version=header["version"](), distclass=NativeDistribution,
      cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel})
