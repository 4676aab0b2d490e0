"""Gives the package its version: FA_VERSION of the C header, the project's one definition of it
(everything else is in pyproject.toml)."""

import runpy
from pathlib import Path

from setuptools import setup

header = runpy.run_path(str(Path(__file__).resolve().parent / "flash_attention_metal" / "_header.py"))
setup(version=header["version"]())
