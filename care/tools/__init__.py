"""Command lines that build model folders: `build_me5` (the offline multilingual-e5-small, `make model`) and
`build_towers` (the asymmetric encoders' tower folders).  The builds themselves live in care.encoders.build, so
the model registry can build a configured folder on first use without importing upward."""
