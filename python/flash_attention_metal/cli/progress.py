"""Progress display for long commands: tqdm, else rich, else a plain counter on stderr."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator


def track(items: Iterable, total: int, description: str) -> Iterator:
    """Yields ``items`` while showing progress on stderr.

    Close the generator (``contextlib.closing``) when the loop can end early: closing removes the
    progress line, so whatever is printed next starts on a line of its own.
    """
    try:
        from tqdm import tqdm
    except ImportError:
        pass
    else:
        yield from tqdm(items, total=total, desc=description, file=sys.stderr, leave=False)
        return
    try:
        from rich.progress import track as rich_track
    except ImportError:
        pass
    else:
        yield from rich_track(items, total=total, description=description, transient=True)
        return
    try:
        for index, item in enumerate(items, start=1):
            print(f"\r{description} {index}/{total}", end="", file=sys.stderr, flush=True)
            yield item
    finally:
        print(file=sys.stderr, flush=True)
