"""M3 checkpoints in FlagEmbedding's folder format (care.models.m3: the module and its folder).

    python -m care.tools.build_m3 tiny OUT [--hidden 64] [--layers 2]
        a tiny random M3 checkpoint, bert-base-chinese vocabulary (tests, smoke runs)
    python -m care.tools.build_m3 init OUT --backbone PATH [--colbert-dim -1] [--seed 0]
        any Hugging Face encoder folder with freshly initialised (seeded) heads: the starting point for
        training from a plain encoder
"""
from __future__ import annotations

import argparse

from care.errors import app_errors
from care.models.m3 import M3Model, tiny_m3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tiny = sub.add_parser("tiny", help="a tiny random M3 checkpoint (bert-base-chinese vocabulary)")
    tiny.add_argument("out_dir")
    tiny.add_argument("--hidden", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    init = sub.add_parser("init", help="an M3 checkpoint from any HF encoder folder, with fresh heads")
    init.add_argument("out_dir")
    init.add_argument("--backbone", required=True)
    init.add_argument("--colbert-dim", type=int, default=-1, help="-1: the hidden size (as bge-m3)")
    init.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    with app_errors("python -m care.tools.build_m3", writes_to=a.out_dir, resumes=False):
        if a.cmd == "tiny":
            model = tiny_m3(hidden=a.hidden, layers=a.layers)
        else:
            model = M3Model.from_backbone(a.backbone, colbert_dim=a.colbert_dim, seed=a.seed)
        print(model.save(a.out_dir))


if __name__ == "__main__":
    main()
