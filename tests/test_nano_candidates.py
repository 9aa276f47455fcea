"""Nano candidate lists (data_pipeline/nano/candidates.py) and the BM25 variant that feeds them.

Numbers are held against references written here from docs/nano.md, not against stored outputs: RRF
against a brute-force re-statement of s.7 (and exact `Fraction` sums to show which ties are real), the
safeguard against the seeded formula of s.8, candidate quality against pytrec_eval, and BM25 robertson
against its formula in s.5.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import random
from collections import Counter
from fractions import Fraction

import bm25s
import jieba
import numpy as np
import pytest
import pytrec_eval

from care.retrieval.bm25 import TOKENIZERS, BM25Prepared, BM25Scorer, tokenize, wordseg
from data_pipeline.nano.candidates import (
    CONSTRUCTION_POLICY,
    HYBRID_TOP_K,
    RRF_K,
    SAFEGUARD_SEED,
    NanoAuditError,
    audit,
    candidate_quality,
    fuse,
    hybrid_lists,
    list_counts,
    safeguard_positive,
)

# ---------------------------------------------------------------------------------------------------------
# references


def ranks_of(lists, corpus):
    """{doc: [rank in each list that holds it, in list order]}, ids outside the corpus left out."""
    out: dict[str, list[int]] = {}
    for ranking in lists:
        for doc in dict.fromkeys(ranking):
            if doc in corpus:
                out.setdefault(doc, []).append(ranking.index(doc) + 1)
    return out


def reference_fuse(lists, corpus, rrf_k=RRF_K, top_k=HYBRID_TOP_K):
    """s.7 restated: a float sum per document in list order, then an explicit three-way comparison."""
    ranks = ranks_of(lists, corpus)
    score = {doc: sum(1.0 / (rrf_k + r) for r in rs) for doc, rs in ranks.items()}

    def before(a, b):
        if score[a] != score[b]:
            return -1 if score[a] > score[b] else 1
        if min(ranks[a]) != min(ranks[b]):
            return -1 if min(ranks[a]) < min(ranks[b]) else 1
        return -1 if a < b else (1 if a > b else 0)

    return sorted(ranks, key=functools.cmp_to_key(before))[:min(top_k, len(corpus))]


def exact_scores(lists, corpus, rrf_k=RRF_K):
    return {doc: sum((Fraction(1, rrf_k + r) for r in rs), Fraction(0)) for doc, rs in ranks_of(lists, corpus).items()}


def seeded_choice(positives, split, qid, seed=SAFEGUARD_SEED):
    """docs/nano.md s.8, written out again."""
    return random.Random(f"{seed}\0{split}\0{qid}\0positive_safeguard").choice(sorted(positives))


def corpus_of(n, prefix="d"):
    return [f"{prefix}{i:03d}" for i in range(n)]


# ---------------------------------------------------------------------------------------------------------
# RRF


def test_mirrored_ranks_tie_exactly_and_the_id_decides():
    corpus = {"a", "b", "c"}
    # a: (2, 1), b: (1, 2): equal sums and equal best ranks -> a before b by id, whatever the list order
    assert 1.0 / (RRF_K + 1) + 1.0 / (RRF_K + 2) == 1.0 / (RRF_K + 2) + 1.0 / (RRF_K + 1)
    assert fuse([["b", "a"], ["a", "b"]], corpus) == ["a", "b"]
    assert fuse([["a", "b"], ["b", "a"]], corpus) == ["a", "b"]
    # c only in bm25 and b only in dense, both at rank 1: one term each, equal on both keys -> the id
    assert fuse([["c"], ["b"]], corpus) == ["b", "c"]


def place(placements, length=130):
    """Two lists of `length` filler ids with given docs placed at 1-based ranks: {doc: (bm25, dense)}."""
    bm25, dense = corpus_of(length, "b"), corpus_of(length, "e")
    for doc, (r1, r2) in placements.items():
        if r1:
            bm25[r1 - 1] = doc
        if r2:
            dense[r2 - 1] = doc
    return [bm25, dense], set(bm25) | set(dense)


def test_an_equal_score_goes_to_the_better_single_rank_before_the_id():
    # ranks (5, 20) and (12, 12): 1/105 + 1/120 == 2/112 exactly, and the float sums are equal too
    assert 1.0 / 105 + 1.0 / 120 == 1.0 / 112 + 1.0 / 112
    lists, corpus = place({"zz": (5, 20), "aa": (12, 12)})
    assert [d for d in fuse(lists, corpus, top_k=300) if d in ("aa", "zz")] == ["zz", "aa"]
    # one list only at rank 1 vs both lists at rank 102: 1/101 == 2/202, no fallback rank for the missing list
    assert 1.0 / 101 == 1.0 / 202 + 1.0 / 202
    lists, corpus = place({"zz": (1, None), "aa": (102, 102)})
    assert [d for d in fuse(lists, corpus, top_k=300) if d in ("aa", "zz")] == ["zz", "aa"]


def test_the_sum_is_in_python_floats_not_exact():
    # ranks (80, 120) and (98, 98) tie as fractions (1/180 + 1/220 == 2/198) but not as floats, and HAKARI
    # follows the float (docs/nano.md s.7): (98, 98) comes first although its best rank is worse
    assert Fraction(1, 180) + Fraction(1, 220) == 2 * Fraction(1, 198)
    assert 1.0 / 180 + 1.0 / 220 < 1.0 / 198 + 1.0 / 198
    lists, corpus = place({"aa": (80, 120), "zz": (98, 98)})
    assert [d for d in fuse(lists, corpus, top_k=300) if d in ("aa", "zz")] == ["zz", "aa"]
    # float32 sums would tie them (and the best rank would put "aa" first)
    assert np.float32(1 / 180) + np.float32(1 / 220) == np.float32(1 / 198) + np.float32(1 / 198)


def test_ids_outside_the_corpus_are_skipped_and_do_not_shift_ranks():
    corpus = {"a", "b"}
    # "zz" holds rank 1 in bm25: a keeps rank 2 there (ranks are list positions), b is dense rank 1
    assert fuse([["zz", "a"], ["b", "zz"]], corpus) == ["b", "a"]
    assert "zz" not in fuse([["zz"], ["zz", "a"]], corpus)


def test_top_k_cut_and_a_corpus_smaller_than_top_k():
    docs = corpus_of(150)
    bm25, dense = docs[:], docs[::-1]
    assert len(fuse([bm25, dense], set(docs))) == HYBRID_TOP_K
    assert len(fuse([bm25, dense], set(docs), top_k=7)) == 7
    small = set(docs[:30])
    assert sorted(fuse([docs[:30], docs[:30][::-1]], small)) == sorted(small)  # all 30 ranked


@pytest.mark.parametrize("seed", range(6))
def test_fuse_matches_the_brute_force_reference_on_tie_heavy_lists(seed):
    rng = random.Random(seed)
    ties = Counter()
    for _ in range(60):
        docs = corpus_of(rng.randint(5, 70))
        corpus = set(rng.sample(docs, max(1, len(docs) - rng.randint(0, 5))))  # a few listed ids are not in it
        bm25 = rng.sample(docs, rng.randint(0, len(docs)))
        dense = bm25[:]
        for i in range(0, len(dense) - 1, 2):  # swap neighbours -> mirrored ranks (i, i+1) and (i+1, i)
            if rng.random() < 0.7:
                dense[i], dense[i + 1] = dense[i + 1], dense[i]
        for i in range(len(dense)):  # replace some dense entries: single-list docs at equal ranks
            if rng.random() < 0.2:
                dense[i] = rng.choice(docs)
        dense = list(dict.fromkeys(dense))
        rrf_k = rng.choice([RRF_K, RRF_K, 60, 1])
        top_k = rng.choice([HYBRID_TOP_K, 5, 17])
        got = fuse([bm25, dense], corpus, rrf_k=rrf_k, top_k=top_k)
        assert got == reference_fuse([bm25, dense], corpus, rrf_k=rrf_k, top_k=top_k)
        exact = exact_scores([bm25, dense], corpus, rrf_k)
        by_score = Counter(exact.values())
        ties["tied docs"] += sum(n for n in by_score.values() if n > 1)
        # the float order never contradicts the exact one (only exact ties can come out either way)
        full = fuse([bm25, dense], corpus, rrf_k=rrf_k, top_k=10**6)
        assert all(exact[a] >= exact[b] for a, b in itertools.pairwise(full))
    assert ties["tied docs"] > 200  # the tie-breaks were exercised


# ---------------------------------------------------------------------------------------------------------
# safeguard


def test_safeguard_adds_the_seeded_positive_at_rank_101():
    docs = corpus_of(300)
    ranking = docs[:100]
    positives = {"d150", "d210", "d299", "d123", "d101", "d250", "d180"}
    new, added = safeguard_positive(ranking, positives, len(docs), "cmedqa", "q7")
    chosen = seeded_choice(positives, "cmedqa", "q7")
    assert new == ranking + [chosen] and len(new) == 101
    assert added == {"query_id": "q7", "reason": "missing_positive_in_rrf_top_100", "corpus_id": chosen,
                     "rank": 101}
    assert ranking == docs[:100]  # the input list is left alone


def test_no_safeguard_when_a_positive_is_in_the_top_100_or_none_is_in_the_corpus():
    docs = corpus_of(300)
    assert safeguard_positive(docs[:100], {"d099", "d200"}, 300, "s", "q") == (docs[:100], None)
    assert safeguard_positive(docs[:100], set(), 300, "s", "q") == (docs[:100], None)
    # hybrid_lists drops positives outside the corpus before the safeguard: a query whose only positive is
    # missing from the corpus gets none
    rows, block = hybrid_lists(["q"], {"q": docs[:120]}, {"q": docs[:120]}, {"q": ["gone"]}, docs, "s")
    assert rows["q"] == docs[:100] and block["additions"] == [] and block["query_with_relevance_count"] == 0


def test_the_choice_depends_deterministically_on_split_and_query():
    positives = corpus_of(40, "p")
    ranking = corpus_of(100)
    picks = {}
    for split in ("cmedqa", "medical", "t2"):
        for qid in ("1", "2", "3", "4"):
            _, added = safeguard_positive(ranking, positives, 1000, split, qid)
            again = safeguard_positive(ranking, list(reversed(positives)), 1000, split, qid)[1]
            assert added["corpus_id"] == again["corpus_id"] == seeded_choice(positives, split, qid)
            picks[split, qid] = added["corpus_id"]
    assert len(set(picks.values())) > 4  # split and query id both enter the seed
    _, other_seed = safeguard_positive(ranking, positives, 1000, "cmedqa", "1", seed=1)
    assert other_seed["corpus_id"] == seeded_choice(positives, "cmedqa", "1", seed=1)


def test_safeguard_rank_follows_a_corpus_smaller_than_top_k():
    # lists that miss part of a 30-document corpus: the positive goes at min(100, 30) + 1 = 31 (s.8)
    new, added = safeguard_positive(corpus_of(20), {"d025"}, 30, "s", "q")
    assert new == corpus_of(20) + ["d025"] and added["rank"] == 31


def test_safeguard_rejects_a_ranking_longer_than_the_cut():
    with pytest.raises(ValueError, match="more than"):
        safeguard_positive(corpus_of(101), {"x"}, 500, "s", "q")


# ---------------------------------------------------------------------------------------------------------
# hybrid_lists and the metadata block


def hand_made_split():
    docs = corpus_of(150)
    order = docs[:120]  # both lists agree: the fused top 100 is docs[:100]
    query_ids = ["q1", "q2", "q3", "q4", "q5"]
    lists = {q: order for q in query_ids}
    qrels = {
        "q1": ["d005", "d110"],          # one positive in the top 100, one outside: no safeguard, 1 of 2 covered
        "q2": ["d130", "d140", "d145"],  # none in the top 100: safeguard, 1 of 3 covered
        "q3": ["elsewhere"],             # its positive is not in the corpus: not a query with relevance
        # q4: no qrels at all
        "q5": ["d101", "d000"],          # d000 in the top 100, d101 not: no safeguard, 1 of 2 covered
    }
    return docs, query_ids, lists, qrels


def test_metadata_block_counts_with_the_safeguard():
    docs, query_ids, lists, qrels = hand_made_split()
    rows, block = hybrid_lists(query_ids, lists, lists, qrels, docs, "toy")
    assert list(rows) == query_ids
    chosen = seeded_choice(["d130", "d140", "d145"], "toy", "q2")
    assert rows["q2"] == docs[:100] + [chosen]
    assert all(rows[q] == docs[:100] for q in ("q1", "q3", "q4", "q5"))
    assert block == {
        "candidate_count_min": 100, "candidate_count_max": 101, "candidate_count_mean": 501 / 5,
        "query_with_relevance_count": 3, "covered_query_count": 3, "query_coverage": 1.0,
        "relevant_count": 7, "covered_relevant_count": 3, "relevant_coverage": 3 / 7,
        "construction_policy": CONSTRUCTION_POLICY, "rrf_top_k": 100, "safeguard_rank": 101,
        "safeguard_positive_count": 1, "limited_by_corpus_size_count": 0,
        "additions": [{"query_id": "q2", "reason": "missing_positive_in_rrf_top_100", "corpus_id": chosen,
                       "rank": 101}],
    }
    assert list(block) == ["candidate_count_min", "candidate_count_max", "candidate_count_mean",
                           "query_with_relevance_count", "covered_query_count", "query_coverage",
                           "relevant_count", "covered_relevant_count", "relevant_coverage",
                           "construction_policy", "rrf_top_k", "safeguard_rank", "safeguard_positive_count",
                           "limited_by_corpus_size_count", "additions"]
    assert list_counts(lists) == {"candidate_count_min": 120, "candidate_count_max": 120}
    assert list_counts({}) == {"candidate_count_min": 0, "candidate_count_max": 0}
    audit("toy", query_ids, docs, qrels, rows)


def test_a_corpus_under_100_documents_ranks_everything_without_safeguard():
    docs = corpus_of(30)
    bm25 = {"a": docs, "b": docs[::-1]}
    dense = {"a": docs[::-1], "b": docs}
    qrels = {"a": ["d029"], "b": ["d015", "d016"]}  # d029 is last in a's bm25 list: still ranked
    rows, block = hybrid_lists(["a", "b"], bm25, dense, qrels, docs, "tiny")
    assert all(sorted(row) == docs for row in rows.values())
    assert block["safeguard_positive_count"] == 0 and block["additions"] == []
    assert block["limited_by_corpus_size_count"] == 2
    assert block["candidate_count_min"] == block["candidate_count_max"] == 30
    assert block["relevant_coverage"] == block["query_coverage"] == 1.0
    audit("tiny", ["a", "b"], docs, qrels, rows)
    # lists that leave out 10 of the 30 documents: a short row, but not limited by the corpus size
    bm25["c"] = dense["c"] = docs[:20]
    rows, block = hybrid_lists(["a", "b", "c"], bm25, dense, qrels, docs, "tiny")
    assert len(rows["c"]) == 20 and block["limited_by_corpus_size_count"] == 2


def test_hybrid_lists_refuses_missing_lists_and_duplicate_queries():
    docs = corpus_of(5)
    with pytest.raises(ValueError, match="dense"):
        hybrid_lists(["a"], {"a": docs}, {}, {}, docs, "s")
    with pytest.raises(ValueError, match="duplicates"):
        hybrid_lists(["a", "a"], {"a": docs}, {"a": docs}, {}, docs, "s")


# ---------------------------------------------------------------------------------------------------------
# the audit


@pytest.fixture()
def clean_split():
    docs, query_ids, lists, qrels = hand_made_split()
    rows, _ = hybrid_lists(query_ids, lists, lists, qrels, docs, "toy")
    return docs, query_ids, qrels, rows


def failures_of(split_parts, rows):
    docs, query_ids, qrels, _ = split_parts
    with pytest.raises(NanoAuditError) as err:
        audit("toy", query_ids, docs, qrels, rows)
    assert err.value.split == "toy" and "'toy'" in str(err.value)
    assert all(line in str(err.value) for line in err.value.failures)
    return err.value.failures


def test_audit_passes_a_clean_split(clean_split):
    docs, query_ids, qrels, rows = clean_split
    audit("toy", query_ids, docs, qrels, rows)


@pytest.mark.parametrize("corruption,expected", [
    ("duplicate", ["q1: duplicate candidate"]),
    ("outside", ["q1: candidate not in corpus"]),
    ("short", ["q1: row length 99"]),
    ("101st_not_positive", ["q2: rank 101 candidate 'd120' is not a positive", "q2: no positive in the row",
                            "query coverage"]),
    ("101st_after_positive", ["q1: rank 101 safeguard while a positive is already in the top 100"]),
    ("missing_row", ["q4: missing row"]),
    ("extra_row", ["qX: extra row"]),
    ("no_safeguard", ["q2: missing safeguard", "q2: no positive in the row", "query coverage"]),
    ("order", ["row order"]),
])
def test_audit_names_each_corruption(clean_split, corruption, expected):
    rows = {q: list(r) for q, r in clean_split[3].items()}
    if corruption == "duplicate":
        rows["q1"][6] = rows["q1"][5]
    elif corruption == "outside":
        rows["q1"][3] = "not-a-doc"
    elif corruption == "short":
        rows["q1"].pop()
    elif corruption == "101st_not_positive":
        rows["q2"][100] = "d120"
    elif corruption == "101st_after_positive":
        rows["q1"].append("d110")  # q1's second positive, while d005 is in its top 100
    elif corruption == "missing_row":
        del rows["q4"]
    elif corruption == "extra_row":
        rows["qX"] = rows["q4"]
    elif corruption == "no_safeguard":
        rows["q2"].pop()
    elif corruption == "order":
        rows = dict(reversed(rows.items()))
    failures = failures_of(clean_split, rows)
    for text in expected:
        assert any(text in line for line in failures), (text, failures)
    assert len(failures) == len(expected)  # no unrelated check fired


def test_audit_collects_every_failure_before_raising(clean_split):
    rows = {q: list(r) for q, r in clean_split[3].items()}
    rows["q1"][6] = rows["q1"][5]
    rows["q3"][0] = "not-a-doc"
    rows["q2"][100] = "d120"
    del rows["q4"]
    failures = failures_of(clean_split, rows)
    for text in ("q1: duplicate", "q3: candidate not in corpus", "q2: rank 101", "q4: missing row"):
        assert any(text in line for line in failures), (text, failures)


def test_audit_small_corpus_rows_must_hold_the_whole_corpus():
    docs = corpus_of(30)
    qrels = {"a": ["d001"]}
    audit("tiny", ["a"], docs, qrels, {"a": docs[::-1]})
    with pytest.raises(NanoAuditError, match="row length 29, expected 30"):
        audit("tiny", ["a"], docs, qrels, {"a": docs[:29]})


# ---------------------------------------------------------------------------------------------------------
# candidate quality against pytrec_eval


def pytrec_reference(lists, qrels):
    judged = {q: {d: 1 for d in pos} for q, pos in qrels.items() if pos}
    run = {q: {d: float(len(row) - i) for i, d in enumerate(row)} for q, row in lists.items() if row}
    got = pytrec_eval.RelevanceEvaluator(judged, {"ndcg_cut_10", "recall_100"}).evaluate(run)
    # pytrec_eval leaves out the qrels queries the run lacks: they score 0 on the card (docs/nano.md s.11)
    return {q: got.get(q, {"ndcg_cut_10": 0.0, "recall_100": 0.0}) for q in judged}


@pytest.mark.parametrize("seed", range(4))
def test_candidate_quality_matches_pytrec_eval(seed):
    rng = random.Random(seed)
    docs = corpus_of(400)
    qrels, lists = {}, {}
    for i in range(60):
        qid = f"q{i}"
        qrels[qid] = rng.sample(docs, rng.choice([1, 1, 2, 3, 5, 12, 30]))
        if i % 13 == 5:
            continue  # no candidate row
        row = rng.sample(docs, rng.choice([0, 8, 50, 100, 101, 150]))
        if i % 4 == 0 and len(row) >= 101:  # rank 101 holds a positive that the top 100 lack
            row = [d for d in row if d not in qrels[qid]][:100] + [qrels[qid][0]]
        if i % 5 == 0 and row:  # push a positive to the top to make nDCG non-trivial
            row.insert(rng.randrange(min(10, len(row))), qrels[qid][-1])
            row = list(dict.fromkeys(row))
        lists[qid] = row
    qrels["empty"] = []  # no positive: not evaluated
    lists["not_in_qrels"] = docs[:10]
    ours = candidate_quality(lists, qrels)
    ref = pytrec_reference(lists, qrels)
    assert ours["queries"] == len(ref) == 60 and set(ours["per_query"]) == set(ref)
    for qid, values in ref.items():
        assert ours["per_query"][qid]["ndcg_at_10"] == pytest.approx(values["ndcg_cut_10"], abs=1e-12), qid
        assert ours["per_query"][qid]["recall_at_100"] == pytest.approx(values["recall_100"], abs=1e-12), qid
    assert ours["ndcg_at_10"] == pytest.approx(np.mean([v["ndcg_cut_10"] for v in ref.values()]), abs=1e-12)
    assert ours["recall_at_100"] == pytest.approx(np.mean([v["recall_100"] for v in ref.values()]), abs=1e-12)
    covered = sum(len(set(lists.get(q, [])[:100]) & set(pos)) for q, pos in qrels.items())
    assert ours["relevant_coverage_at_100"] == pytest.approx(covered / sum(len(p) for p in qrels.values()))
    assert ours["relevant_coverage_at_100"] != pytest.approx(ours["recall_at_100"])  # micro vs macro


def test_rank_101_never_counts_and_a_missing_row_scores_zero():
    docs = corpus_of(200)
    row = docs[:100] + ["p"]
    got = candidate_quality({"a": row}, {"a": ["p"], "b": ["d000"]})
    assert got["per_query"]["a"] == {"ndcg_at_10": 0.0, "recall_at_100": 0.0}
    assert got["per_query"]["b"] == {"ndcg_at_10": 0.0, "recall_at_100": 0.0}
    # a document repeated in a row counts once (pytrec_eval's run is a dict, so it cannot repeat either)
    assert candidate_quality({"a": ["p", "p", "x"]}, {"a": ["p", "x"]})["per_query"]["a"]["ndcg_at_10"] == \
        pytest.approx((1 + 1 / math.log2(3)) / (1 + 1 / math.log2(3)))
    assert candidate_quality({"a": ["p", "p"]}, {"a": ["p", "q"]})["per_query"]["a"]["ndcg_at_10"] == \
        pytest.approx(1 / (1 + 1 / math.log2(3)))
    got = candidate_quality({"a": ["x", "p"]}, {"a": ["p", "q"]})
    assert got["per_query"]["a"]["ndcg_at_10"] == pytest.approx((1 / math.log2(3)) / (1 + 1 / math.log2(3)))
    assert got["per_query"]["a"]["recall_at_100"] == 0.5


# ---------------------------------------------------------------------------------------------------------
# wordseg and the BM25 variants


def test_wordseg_keeps_punctuation_space_and_case():
    text = "患者BMI为28，建议 控制饮食。"
    tokens = wordseg(text)
    assert tokens == [t for t in jieba.cut(text) if t]
    assert {"BMI", "，", " ", "。"} <= set(tokens)
    assert "".join(tokens) == text  # nothing dropped, nothing changed
    assert "bmi" in tokenize(text) and "，" not in tokenize(text)  # the default tokenizer differs
    assert TOKENIZERS == {"words": tokenize, "wordseg": wordseg}
    assert wordseg("") == []


def test_wordseg_segments_long_texts_in_4000_character_chunks():
    sentence = "高血压患者应当低盐饮食并规律监测血压，"
    head = (sentence * 400)[:3998]
    text = (head + "糖尿病患者需要控制血糖。" + sentence * 400)[:9000]
    assert len(text) == 9000
    chunks = [text[:4000], text[4000:8000], text[8000:]]
    expected = [t for chunk in chunks for t in jieba.cut(chunk) if t]
    assert wordseg(text) == expected
    assert wordseg(text) != [t for t in jieba.cut(text) if t]  # "糖尿病" straddles the boundary: it matters


ZH_DOCS = [
    "高血压患者需要低盐饮食，并按时服用降压药。",
    "糖尿病患者应监测血糖，控制饮食和体重。",
    "感冒患者多喝水，注意休息。",
    "患者BMI为28，属于超重，建议减重。",
    "儿童发热时可以物理降温。",
    "高血压和糖尿病患者都要定期复查。",
]
ZH_QUERIES = ["高血压患者饮食", "糖尿病 血糖 血糖", "患者", "BMI超重", "完全无关的词ZZZ", ""]


def robertson_reference(query_tokens, doc_tokens, k1=1.5, b=0.75):
    """docs/nano.md s.5's formula; a query token counts once per occurrence, as bm25s sums over the list."""
    n = len(doc_tokens)
    avgdl = sum(map(len, doc_tokens)) / n
    counts = [Counter(d) for d in doc_tokens]
    df = Counter(t for c in counts for t in c)
    out = np.zeros(n)
    for t in query_tokens:
        if t not in df:
            continue  # out of vocabulary: dropped
        idf = math.log(max(1.0, (n - df[t] + 0.5) / (df[t] + 0.5)))
        for j, c in enumerate(counts):
            tf = c[t]
            out[j] += idf * tf / (k1 * (1 - b + b * len(doc_tokens[j]) / avgdl) + tf)
    return out


def test_bm25_robertson_wordseg_scores_match_the_formula():
    scorer = BM25Scorer(method="robertson", tokenizer="wordseg")
    prepared = scorer.prepare(ZH_QUERIES, ZH_DOCS)
    doc_tokens = [wordseg(d) for d in ZH_DOCS]
    assert sum("患者" in d for d in doc_tokens) == 5  # in most documents: its idf is clamped to 0
    assert prepared.index.method == "robertson"
    docs_idx = list(range(len(ZH_DOCS)))
    for qi, query in enumerate(ZH_QUERIES):
        want = robertson_reference(wordseg(query), doc_tokens)
        got = prepared.score("bm25", qi, docs_idx)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=query)
    assert np.all(prepared.score("bm25", ZH_QUERIES.index("患者"), docs_idx) == 0)
    assert np.all(prepared.score("bm25", ZH_QUERIES.index("完全无关的词ZZZ"), docs_idx) == 0)
    # the repeated "血糖" counts twice
    twice = robertson_reference(["糖尿病", " ", "血糖", " ", "血糖"], doc_tokens)
    once = robertson_reference(["糖尿病", " ", "血糖"], doc_tokens)
    np.testing.assert_allclose(prepared.score("bm25", 1, docs_idx), twice, rtol=1e-5)
    assert not np.allclose(twice, once)
    idx, scores = prepared.search(len(ZH_DOCS))["bm25"]
    for qi, query in enumerate(ZH_QUERIES):
        want = robertson_reference(wordseg(query), doc_tokens)
        np.testing.assert_allclose(scores[qi], want[idx[qi]], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(scores[qi], np.sort(want)[::-1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tokenizer", ["words", "wordseg"])
def test_out_of_vocabulary_and_empty_queries_score_zero(tokenizer):
    scorer = BM25Scorer(tokenizer=tokenizer)
    prepared = scorer.prepare(["ZZZ 无关", "", "！？"], ZH_DOCS)  # punctuation unseen in ZH_DOCS
    idx, scores = prepared.search(3)["bm25"]
    assert idx.shape == scores.shape == (3, 3) and np.all(scores == 0)
    for qi in range(3):
        assert np.all(prepared.score("bm25", qi, range(len(ZH_DOCS))) == 0)
    scorer.time_documents(ZH_DOCS)
    assert scorer.time_query("ZZZ") >= 0 and scorer.time_query("") >= 0


def test_the_default_scorer_is_unchanged():
    scorer = BM25Scorer()
    assert (scorer.k1, scorer.b, scorer.method, scorer.tokenizer) == (1.5, 0.75, "lucene", "words")
    assert scorer.tokenize is tokenize
    old_blob = json.dumps({"bm25s": bm25s.__version__, "jieba": jieba.__version__, "k1": 1.5, "b": 0.75})
    assert scorer.fingerprint == hashlib.sha256(old_blob.encode()).hexdigest()[:16]
    fingerprints = {scorer.fingerprint, BM25Scorer(method="robertson").fingerprint,
                    BM25Scorer(tokenizer="wordseg").fingerprint,
                    BM25Scorer(method="robertson", tokenizer="wordseg").fingerprint, BM25Scorer(k1=1.2).fingerprint}
    assert len(fingerprints) == 5
    # scores as before: bm25s' defaults (Lucene) over the project's tokens, through get_scores
    old = bm25s.BM25(k1=1.5, b=0.75)
    old.index([tokenize(d) for d in ZH_DOCS], show_progress=False)
    prepared = scorer.prepare(ZH_QUERIES[:4], ZH_DOCS)
    assert prepared.index.method == "lucene"
    for qi, query in enumerate(ZH_QUERIES[:4]):
        np.testing.assert_array_equal(prepared.score("bm25", qi, range(len(ZH_DOCS))), old.get_scores(tokenize(query)))
    assert isinstance(prepared, BM25Prepared) and prepared.tokenizer is tokenize


def test_unknown_tokenizer_or_method_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="words, wordseg"):
        BM25Scorer(tokenizer="regex")
    with pytest.raises(ValueError, match="robertson"):
        BM25Scorer(method="okapi")
