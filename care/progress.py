"""The one progress bar of the project: tqdm.auto (a line in a terminal or a log, a widget in a notebook), shown
unless the caller's `show_progress` turns it off.  Every long loop goes through `progress` instead of importing
tqdm, so a caller that asks for no bars (validation inside a training run, the mteb adapter, tests) gets none
from any layer below it.  Here, at the bottom of the library (it imports nothing of the project), so every
layer and the stages can use it.

    for x in progress(items, desc="encode", unit="batch", enabled=show_progress): ...
    with progress(total=n, desc="score", unit="pair", enabled=show_progress) as bar: ... bar.update(k)
"""
from __future__ import annotations

from collections.abc import Iterable

from tqdm.auto import tqdm


def progress(iterable: Iterable | None = None, *, desc: str | None = None, total: int | None = None,
             enabled: bool = True, unit: str = "it", leave: bool = True, **options) -> tqdm:
    """A tqdm bar over `iterable` (or one updated by hand, given `total`), silent when not `enabled`: it then
    yields the same items and accepts the same calls (update, close, as a context manager).  `options` go to
    tqdm as they are (initial, mininterval, ...)."""
    return tqdm(iterable, desc=desc, total=total, disable=not enabled, unit=unit, leave=leave, **options)
