"""Build the tower folders of CARE-style asymmetric encoders (a configured tower is also built on first use).

    python -m care.tools.build_towers tiny OUT [--seed S] [--force]
    python -m care.tools.build_towers cut SRC OUT --layers N [--pick first|spread] [--force]

`tiny`: OUT/query (a tiny BERT) and OUT/document (a tiny, wider Qwen3), seeded random weights, for tests.
`cut`: a BertModel-family folder cut to N of its layers (the first N, or N spread over the depth).  What each
folder holds and how it is checked: care.encoders.builders.towers.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from care.encoders.builders.towers import PICKS, build_cut, build_tiny
from care.errors import app_errors


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="tool", required=True)
    tiny = sub.add_parser("tiny", help="OUT/query (tiny BERT) and OUT/document (tiny Qwen3)")
    tiny.add_argument("out", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    cut = sub.add_parser("cut", help="a BertModel-family folder cut to N of its layers")
    cut.add_argument("source", type=Path)
    cut.add_argument("out", type=Path)
    cut.add_argument("--layers", type=int, required=True)
    cut.add_argument("--pick", choices=PICKS, default="first",
                     help="first: layers 0..N-1 (default); spread: N layers evenly over the depth, first and last kept")
    for p in (tiny, cut):
        p.add_argument("--force", action="store_true", help="rebuild even when OUT is up to date")
    a = ap.parse_args(argv)
    with app_errors(f"build_towers {a.tool}", writes_to=a.out, extra=(FileExistsError,), status=2):
        if a.tool == "tiny":
            build_tiny(a.out, seed=a.seed, force=a.force)
        else:
            build_cut(a.source, a.out, layers=a.layers, force=a.force, pick=a.pick)


if __name__ == "__main__":
    main()
