"""Duplicate pairs -> clusters -> which text each cluster keeps.

Every stage reduces its finding to edges (i, j, similarity) between positions in its input; clusters are
the connected components of that graph (scipy's union-find-equivalent `connected_components`), so a
chain a~b~c lands in one cluster even when a and c are not similar themselves (as in the source system).

Keep rule: the member that comes first in the stage's input keeps the cluster.  Stages pass their
survivors on in input order, so across all three stages the earliest text of a group is the one kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components


@dataclass
class Cluster:
    kept: int            # position (in the stage's input) of the text kept
    removed: list[int]   # positions of the others, ascending
    min_edge: float      # the weakest similarity among the edges that joined the cluster

    @property
    def size(self) -> int:
        return 1 + len(self.removed)


def clusters_from_edges(n: int, rows, cols, sims) -> list[Cluster]:
    """Connected components with more than one member, ordered by their kept position."""
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    sims = np.asarray(sims, dtype=np.float64)
    if n == 0 or len(rows) == 0:
        return []
    graph = coo_matrix((np.ones(len(rows), dtype=np.int8), (rows, cols)), shape=(n, n))
    _, label = connected_components(graph, directed=False)
    min_edge = np.full(label.max() + 1, np.inf)
    np.minimum.at(min_edge, label[rows], sims)
    order = np.argsort(label, kind="stable")  # members grouped by component, ascending position inside
    bounds = np.flatnonzero(np.diff(label[order])) + 1
    clusters = []
    for members in np.split(order, bounds):
        if len(members) > 1:
            clusters.append(Cluster(int(members[0]), members[1:].tolist(), float(min_edge[label[members[0]]])))
    return sorted(clusters, key=lambda c: c.kept)


def survivors(n: int, clusters: list[Cluster]) -> np.ndarray:
    """Positions that stay, ascending (input order preserved)."""
    keep = np.ones(n, dtype=bool)
    for c in clusters:
        keep[c.removed] = False
    return np.flatnonzero(keep)
