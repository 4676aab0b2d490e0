"""Progress display for long commands: tqdm, else rich, else a plain counter on stderr."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator


def track(items: Iterable, total: int, description: str) -> Iterator:
    """Yields ``items`` while showing progress on stderr."""
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
    for index, item in enumerate(items, start=1):
        print(f"\r{description} {index}/{total}", end="", file=sys.stderr, flush=True)
        yield item
    print(file=sys.stderr)
