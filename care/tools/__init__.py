"""Command lines that build model folders: `build_me5` (the offline multilingual-e5-small, `make model`),
`build_towers` (the asymmetric encoders' tower folders) and `build_m3` (tiny or fresh-headed M3 checkpoints).  The builds themselves live in care.encoders.builders, so
the model registry can build a configured folder on first use without importing upward."""
