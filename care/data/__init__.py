"""The ground floor: everything that knows a file format, and nothing that needs torch.

io (DataError, atomic writes, numbered JSON Lines, text stores), records (the record types every reader
yields), stage_cache (skip a stage whose inputs are unchanged), tasks (retrieval / reranking / STS task
layouts) and sources/ (one reader per real format).
"""
