"""Dedup matching: normalisation, clusters and keep rule, MinHash recall/precision on planted duplicates
against brute-force exact Jaccard, semantic search against brute-force numpy cosine, the embedding cache."""
from __future__ import annotations

import random

import numpy as np
import pytest
from datasketch import MinHash, MinHashLSH
from scipy.sparse import csr_matrix

from care.config import load_config
from care.encoders import build_encoder
from care.encoders.cache import EmbeddingCache, embed
from data_pipeline.dedup.clusters import clusters_from_edges, survivors
from data_pipeline.dedup.exact import exact_clusters
from data_pipeline.dedup.minhash import BACKENDS, choose_bands_rows, minhash_pairs, s_curve
from data_pipeline.dedup.normalize import Normalizer
from data_pipeline.dedup.semantic import cosine_pairs, nearest_neighbour_cosine
from data_pipeline.planted import plant, shared_texts

# ---- references written independently of the code under test ----------------------------------------

def ref_components(n: int, edges) -> list[list[int]]:
    """Components by depth-first search over an adjacency list (not scipy, not union-find)."""
    adj = {i: set() for i in range(n)}
    for a, b in edges:
        adj[a].add(b), adj[b].add(a)
    seen, comps = set(), []
    for start in range(n):
        if start in seen:
            continue
        stack, comp = [start], []
        seen.add(start)
        while stack:
            v = stack.pop()
            comp.append(v)
            for w in adj[v] - seen:
                seen.add(w), stack.append(w)
        comps.append(sorted(comp))
    return comps


def ref_jaccard_pairs(texts: list[str], n: int, threshold: float) -> dict[tuple[int, int], float]:
    """Every pair with character n-gram Jaccard >= threshold, from a sparse incidence matrix X:
    |A & B| = (X X^T)_ij, |A | B| = |A| + |B| - |A & B|."""
    vocab: dict[str, int] = {}
    rows, cols = [], []
    for r, t in enumerate(texts):
        grams = {t[i:i + n] for i in range(max(1, len(t) - n + 1))}
        for g in grams:
            rows.append(r), cols.append(vocab.setdefault(g, len(vocab)))
    x = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(texts), len(vocab)))
    size = np.asarray(x.sum(1)).ravel()
    inter = (x @ x.T).tocoo()
    a, b, k = inter.row, inter.col, inter.data
    upper = a < b
    a, b, k = a[upper], b[upper], k[upper]
    j = k / (size[a] + size[b] - k)
    return {(int(u), int(v)): float(s) for u, v, s in zip(a, b, j) if s >= threshold}


# ---- 1. exact: normalisation ----------------------------------------------------------------------------

def test_normalizer_cases():
    norm = Normalizer()
    assert norm("ＨＩＶ检测　１２３") == "hiv检测 123"             # full-width letters, digits, ideographic space
    assert norm("  糖尿病\t\n  怎么办  ") == "糖尿病 怎么办"        # whitespace runs collapse, ends stripped
    assert norm("高血压，怎么办？") == "高血压,怎么办?"             # full-width punctuation folds, is kept
    assert Normalizer(strip_punctuation=True)("高血压，怎么办？。【注意】") == "高血压怎么办注意"
    assert Normalizer(lowercase=False)("ＨＩＶ") == "HIV"
    assert Normalizer(nfkc=False)("ＨＩＶ") == "ｈｉｖ"              # str.lower folds full-width case only
    assert Normalizer(collapse_whitespace=False)(" a  b ") == " a  b "


def test_exact_clusters_follow_normalisation():
    texts = ["高血压怎么办", "其他问题", "高血压怎么办 ", "ＨＩＶ检测", "hiv检测", "高血压怎么办"]
    clusters = exact_clusters([Normalizer()(t) for t in texts])
    assert [(c.kept, c.removed) for c in clusters] == [(0, [2, 5]), (3, [4])]
    assert [(c.kept, c.removed) for c in exact_clusters(texts)] == [(0, [5])]  # raw: only verbatim copies


# ---- clusters and keep rule -------------------------------------------------------------------------------

def test_clusters_match_reference_components_and_keep_earliest():
    rng = np.random.default_rng(0)
    n = 300
    edges = rng.integers(0, n, size=(220, 2))
    edges = edges[edges[:, 0] != edges[:, 1]]
    sims = rng.uniform(0.8, 1.0, len(edges))
    clusters = clusters_from_edges(n, edges[:, 0], edges[:, 1], sims)
    ref = [c for c in ref_components(n, edges.tolist()) if len(c) > 1]
    assert sorted([c.kept] + c.removed for c in clusters) == sorted(ref)
    for c in clusters:
        assert c.kept < min(c.removed)                   # the earliest member is kept
        members = set([c.kept] + c.removed)
        inside = [s for (a, b), s in zip(edges.tolist(), sims) if a in members]
        assert c.min_edge == pytest.approx(min(inside))
    kept = survivors(n, clusters)
    assert len(kept) == n - sum(len(c.removed) for c in clusters)
    assert list(kept) == sorted(kept)                    # input order preserved
    assert clusters_from_edges(5, [], [], []) == []


# ---- 2. MinHash -------------------------------------------------------------------------------------------

def test_bands_rows_reach_target_and_are_tightest():
    b, r = choose_bands_rows(0.8, 128, 0.95)
    assert b * r <= 128
    assert 1 - (1 - 0.8 ** r) ** b >= 0.95
    assert 1 - (1 - 0.8 ** (r + 1)) ** (128 // (r + 1)) < 0.95   # one more row would miss the target
    assert s_curve(0.5, b, r) < 0.2                                # and unrelated pairs stay rare


def test_s_curve_matches_datasketch_lsh_empirically():
    """Sets of exact Jaccard 0.8 (80 shared + 10 own elements each): the share of pairs an LSH with the
    chosen bands x rows makes candidates is the S-curve's value, within sampling error."""
    b, r = choose_bands_rows(0.8, 128, 0.95)

    def sketch(p, side):
        m = MinHash(num_perm=128, seed=3)
        m.update_batch([f"{p}-s{k}".encode() for k in range(80)] + [f"{p}-{side}{k}".encode() for k in range(10)])
        return m

    pairs = 400
    lsh = MinHashLSH(num_perm=128, params=(b, r))
    for p in range(pairs):
        lsh.insert(p, sketch(p, "b"))
    caught = sum(p in lsh.query(sketch(p, "a")) for p in range(pairs))
    expected = float(s_curve(0.8, b, r))
    assert abs(caught / pairs - expected) < 4 * np.sqrt(expected * (1 - expected) / pairs) + 0.01


@pytest.fixture(scope="module")
def planted():
    texts = random.Random(0).sample(shared_texts(), 1500)
    rows, pairs = plant(texts, n_exact=40, n_variant=40, n_near=400, ngram=2, near_range=(0.6, 1.0), seed=1)
    return rows, pairs


def test_planted_generator(planted):
    rows, pairs = planted
    by_id = {r["id"]: r["text"] for r in rows}
    norm = Normalizer()
    assert len(rows) == 1500 + 480 and len(by_id) == len(rows)
    for p in pairs:
        a, b = by_id[p.original], by_id[p.copy]
        if p.kind == "exact":
            assert a == b
        elif p.kind == "variant":
            assert a != b and norm(a) == norm(b)
        else:
            ga = {a[i:i + 2] for i in range(max(1, len(a) - 1))}
            gb = {b[i:i + 2] for i in range(max(1, len(b) - 1))}
            assert p.jaccard == pytest.approx(len(ga & gb) / len(ga | gb))
    near = [p.jaccard for p in pairs if p.kind == "near"]
    assert 0.1 < np.mean(np.array(near) >= 0.8) < 0.9    # both sides of the threshold are planted


@pytest.mark.parametrize("backend", BACKENDS)
def test_minhash_recall_and_precision_on_planted(planted, backend):
    rows, pairs = planted
    norm = Normalizer()
    texts = [norm(r["text"]) for r in rows]
    res = minhash_pairs(texts, ngram=2, threshold=0.8, show_progress=False, backend=backend)
    found = {(int(a), int(b)): s for a, b, s in zip(res.rows, res.cols, res.sims)}
    ref = ref_jaccard_pairs(texts, 2, 0.8)
    hit = set(found) & set(ref)
    assert len(found) == len(hit), "every merged pair must truly have Jaccard >= 0.8"      # precision 1.0
    assert len(hit) / len(ref) >= 0.95                                                      # recall
    assert all(found[p] == pytest.approx(ref[p]) for p in hit)
    # planted near duplicates at J >= 0.8 end in one cluster with their original
    pos = {r["id"]: i for i, r in enumerate(rows)}
    clusters = clusters_from_edges(len(texts), res.rows, res.cols, res.sims)
    label = np.arange(len(texts))
    for c in clusters:
        label[c.removed] = c.kept
    planted_hi = [(pos[p.original], pos[p.copy]) for p in pairs if p.kind == "near"
                  and (min(pos[p.original], pos[p.copy]), max(pos[p.original], pos[p.copy])) in ref]
    assert len(planted_hi) > 100
    assert np.mean([label[a] == label[b] for a, b in planted_hi]) >= 0.95
    # exact copies and normalisation variants all fall to the exact stage
    groups = {c.kept: set(c.removed) | {c.kept} for c in exact_clusters(texts)}
    member = {i: k for k, g in groups.items() for i in g}
    for p in pairs:
        if p.kind != "near":
            assert member.get(pos[p.original]) is not None
            assert member.get(pos[p.original]) == member.get(pos[p.copy])


# ---- 3. semantic ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_vectors(tiny_bert_dir):
    # mean pooling: a random-weight tiny BERT's CLS vectors all have cosine ~0.99998, mean-pooled ones spread
    cfg = load_config("data_pipeline", ["model=tiny_bert", f"model.path={tiny_bert_dir}", "model.pooling=mean"])
    enc = build_encoder(cfg.model)
    texts = random.Random(2).sample([t for t in shared_texts() if len(t) < 60], 160)
    texts += texts[:5]   # exact copies: cosine 1 ties with the self match
    return enc, texts, enc.encode_documents(texts).dense


def test_semantic_pairs_match_bruteforce_cosine(tiny_vectors):
    _, _, v = tiny_vectors
    x = v.astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    full = x @ x.T                                      # fine for a test-sized N
    iu = np.triu_indices(len(x), 1)
    threshold = float(np.quantile(full[iu], 0.99))
    ref = {(int(a), int(b)) for a, b in zip(*iu) if full[a, b] >= threshold}
    near = {(int(a), int(b)) for a, b in zip(*iu) if abs(full[a, b] - threshold) < 1e-5}
    for search, topk in (("range", 64), ("topk", 2)):   # topk=2 forces the k-doubling path
        got = cosine_pairs(v, threshold, search=search, topk=topk, block=37, use_gpu=False, show_progress=False)
        pairs = set(zip(got.rows.tolist(), got.cols.tolist()))
        assert pairs - near == ref - near, search
        assert np.allclose(got.sims, full[got.rows, got.cols], atol=1e-5)
        assert got.method == search and got.saturated == 0
    np.fill_diagonal(full, -np.inf)
    nn = nearest_neighbour_cosine(v, block=50, use_gpu=False, show_progress=False)
    assert np.allclose(nn, full.max(1), atol=1e-5)


def test_embeddings_are_cached_by_encoder_and_text(tiny_vectors, tmp_path):
    enc, texts, v = tiny_vectors
    calls = []

    class Spy:
        name = enc.name
        default_heads = enc.default_heads  # what embed() asks when no heads are named

        def side_fingerprint(self, side, task=None):
            return enc.side_fingerprint(side, task)

        def encode_documents(self, batch, **kw):
            calls.append(len(batch))
            return enc.encode_documents(batch, **kw)

    def cached(n):
        cache = EmbeddingCache(tmp_path)
        return embed(Spy(), texts[:n], "document", cache).dense, cache.hits, cache.misses

    first, hits, encoded = cached(100)
    assert calls == [100] and (hits, encoded) == (0, 100)
    again, hits, encoded = cached(100)
    assert calls == [100] and (hits, encoded) == (100, 0)
    np.testing.assert_array_equal(first, again)
    grown, _, encoded = cached(101)
    assert calls == [100, 1] and encoded == 1
    np.testing.assert_allclose(grown, v[:101], atol=1e-5)
