"""Data pipeline: raw sources -> clean corpus -> dedup -> mined negatives -> train/eval files."""
