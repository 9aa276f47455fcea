"""Stage 1: exact duplicates, i.e. texts whose normalised form has the same MD5."""
from __future__ import annotations

from collections.abc import Sequence

from data_pipeline.dedup.clusters import Cluster
from data_pipeline.dedup.normalize import normalised_md5


def exact_clusters(normalised: Sequence[str]) -> list[Cluster]:
    """One cluster per MD5 shared by two or more texts; the first occurrence is kept."""
    groups: dict[str, list[int]] = {}
    for i, text in enumerate(normalised):
        groups.setdefault(normalised_md5(text), []).append(i)
    return [Cluster(g[0], g[1:], 1.0) for g in groups.values() if len(g) > 1]
