"""Model folders built here rather than downloaded, each built on first use and kept up to date the same way
(folder: locked, atomic, skipped when its manifest matches): the offline multilingual-e5-small (me5) and the
tower folders of asymmetric encoders (towers: the tiny pair, a BERT-family model cut to N layers).  Their
command lines are care.tools.build_me5 and care.tools.build_towers.
"""
