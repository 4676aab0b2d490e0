"""The command line of the fixture makers."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Optional

import numpy as np


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
