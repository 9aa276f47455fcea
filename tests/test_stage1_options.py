"""The options a stage-I recipe study needs: the layers a cut tower keeps (build_towers `pick`), the text mix
and per-kind query-tower limits of stage I, in-batch score distillation, and the held-out alignment slice
(val/align_cos, val/align_acc); each off by default and then bit-identical to the code before it."""
# ruff: noqa: F811  (the fixtures imported from _care_helpers are named as test parameters)
from __future__ import annotations

import json
import math
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from _care_helpers import root, tiny, todays_asymmetric, train_overrides  # noqa: F401  (module fixtures: training files, towers)
from omegaconf import OmegaConf, open_dict
from safetensors.torch import load_file

from care.config import load_config, neutral_keys
from care.data.io import read_jsonl, write_jsonl
from care.encoders.builders.towers import build_cut, build_from_spec, default_source, picked_layers
from care.models.towers import Tower, TowerSpec
from care.tools import build_towers
from care.training.care_family import CachedDocuments, CAREFamily, check_cut_folders, tokenize_with_limits
from care.training.care_recipe import run_care, same_text_pairs, stage_config, text_kind, text_mix
from care.training.checkpoint import config_hash
from care.training.gradcache import GradCache
from care.training.losses import AsymmetricLoss
from care.training.validation import alignment_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- 1. the layers a cut keeps ---------------------------------------------------------------------------

def test_spread_rule_is_evenly_spaced_and_keeps_both_ends():
    assert picked_layers(12, 4, "spread") == [0, 4, 7, 11]
    assert picked_layers(12, 6, "spread") == [0, 2, 4, 7, 9, 11]
    assert picked_layers(12, 1, "spread") == [11] and picked_layers(12, 12, "spread") == list(range(12))
    assert picked_layers(12, 4) == picked_layers(12, 4, "first") == [0, 1, 2, 3]
    for total in range(1, 25):
        for n in range(2, total + 1):
            got = picked_layers(total, n, "spread")
            # an independent construction: exact fractions, halves rounded up
            assert got == [math.floor(Fraction(i * (total - 1), n - 1) + Fraction(1, 2)) for i in range(n)]
            gaps = np.diff(got)
            assert got[0] == 0 and got[-1] == total - 1 and gaps.min() >= 1 and gaps.max() - gaps.min() <= 1
    with pytest.raises(ValueError, match="choose one of first, spread"):
        picked_layers(12, 4, "last")


@pytest.fixture(scope="module")
def bert6(tmp_path_factory) -> Path:
    from care.models.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("bert6") / "src", layers=6, seed=5)


def layer_weights(folder: Path, layer: int) -> dict[str, torch.Tensor]:
    """One transformer layer's tensors, read from the safetensors file itself (not through transformers)."""
    prefix = f"encoder.layer.{layer}."
    return {k[len(prefix):]: v for k, v in load_file(folder / "model.safetensors").items() if k.startswith(prefix)}


def test_spread_cut_holds_the_chosen_layers_of_the_source(bert6, tmp_path):
    out = tmp_path / "spread"
    manifest = build_cut(bert6, out, layers=3, pick="spread")
    assert manifest["picked_layers"] == [0, 3, 5] and manifest["pick"] == "spread" and manifest["key"]["pick"] == "spread"
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    source, cut = load_file(bert6 / "model.safetensors"), load_file(out / "model.safetensors")
    assert {k for k in cut if not k.startswith("encoder.layer.")} == {k for k in source if not k.startswith("encoder.")}
    for k, v in cut.items():
        if not k.startswith("encoder.layer."):
            assert torch.equal(v, source[k]), k  # the embeddings, unchanged
    for k, src_layer in enumerate([0, 3, 5]):
        mine, theirs = layer_weights(out, k), layer_weights(bert6, src_layer)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine), k
    assert not torch.equal(layer_weights(out, 1)["output.dense.weight"], layer_weights(bert6, 1)["output.dense.weight"])
    # and the model loads and runs from the folder alone
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(out, add_pooling_layer=False)
    assert model(**AutoTokenizer.from_pretrained(out)(["头痛"], return_tensors="pt")).last_hidden_state.shape[-1] == 64


def test_first_keeps_the_key_of_before_and_spread_is_another_folder(bert6, tmp_path):
    first = build_cut(bert6, tmp_path / "cut", layers=2)
    assert "pick" not in first["key"] and first["picked_layers"] == [0, 1]
    assert build_cut(bert6, tmp_path / "cut", layers=2, pick="first")["skipped"]  # an explicit default: up to date
    build_towers.main(["cut", str(bert6), str(tmp_path / "cli"), "--layers", "2", "--pick", "spread"])
    assert json.loads((tmp_path / "cli" / "manifest.json").read_text())["picked_layers"] == [0, 5]
    build_from_spec({"tool": "cut", "source": str(bert6), "layers": 2, "pick": "spread", "out": str(tmp_path / "cut")})
    assert json.loads((tmp_path / "cut" / "manifest.json").read_text())["picked_layers"] == [0, 5]


def test_a_folder_cut_otherwise_than_the_config_asks_is_refused(bert6, tmp_path):
    out = tmp_path / "cut"
    build_cut(bert6, out, layers=2)
    model = {"query": {"path": str(out), "build": {"tool": "cut", "layers": 2, "pick": "first", "out": str(out)}},
             "document": {"path": str(bert6)}}
    check_cut_folders(model)  # as asked
    model["query"]["build"]["pick"] = "spread"
    with pytest.raises(ValueError, match=r"cut with layers=2, pick=first, and model.query.build asks layers=2, "
                                         r"pick=spread: give this cut its own folder"):
        check_cut_folders(model)
    model["query"]["path"] = str(bert6)  # a tower of one's own at another path: not the build's folder
    check_cut_folders(model)


def test_spread_cut_of_the_real_me5_keeps_layers_0_4_7_11(tmp_path):
    out = tmp_path / "me5-spread"
    manifest = build_cut(None, out, layers=4, pick="spread")
    assert manifest["source_layers"] == 12 and manifest["picked_layers"] == [0, 4, 7, 11]
    for k, src_layer in enumerate([0, 4, 7, 11]):
        mine, theirs = layer_weights(out, k), layer_weights(default_source(), src_layer)
        assert mine and all(torch.equal(mine[n], theirs[n]) for n in mine), k


# ---- 2. the text mix and per-kind limits -----------------------------------------------------------------

def test_a_texts_kind_is_its_ids_role_else_the_training_files_query_ids():
    assert text_kind("cepilepsyqa:question:1") == text_kind("kuake_qqr:query:7") == "query"
    assert text_kind("chip_sts:sentence:ab12") == "query"
    assert text_kind("cepilepsyqa:answer:1") == text_kind("kuake_qtr:title:9") == "document"
    assert text_kind("cmedir:title:http://a.b/c:d") == "document"  # a native id with colons
    assert text_kind("q12", {"q12"}) == "query" and text_kind("a5", {"q12"}) == "document"
    assert text_kind("src:other:1", {"src:other:1"}) == "query"  # an unknown role: the training file decides
    assert text_kind("cepilepsyqa:answer:1", {"cepilepsyqa:answer:1"}) == "document"  # the role wins


def test_text_mix_counts_repeats_and_seeds():
    texts = [f"q{i}" for i in range(4)] + [f"d{i}" for i in range(16)]
    kinds = {t: "query" if t[0] == "q" else "document" for t in texts}
    assert text_mix(texts, kinds, 0.2, seed=0) == texts  # the natural share: every text once, in order
    mixed = text_mix(texts, kinds, 0.5, seed=0)
    uses = Counter(mixed)
    assert len(mixed) == 20 and sum(kinds[t] == "query" for t in mixed) == 10
    assert sorted(uses[f"q{i}"] for i in range(4)) == [2, 2, 3, 3]  # 10 entries over 4 texts: as even as can be
    assert sum(t in uses for t in texts if t[0] == "d") == 10 and max(uses[t] for t in texts if t[0] == "d") == 1
    assert mixed == sorted(mixed, key=texts.index)  # store order
    assert mixed == text_mix(texts, kinds, 0.5, seed=0) and mixed != text_mix(texts, kinds, 0.5, seed=1)
    assert set(text_mix(texts, kinds, 0.0, seed=0)) == {t for t in texts if t[0] == "d"}
    assert Counter(text_mix(texts, kinds, 1.0, seed=0)) == dict.fromkeys(texts[:4], 5)
    with pytest.raises(ValueError, match="asks for 8 query texts and stage I has none"):
        text_mix(texts[4:], kinds, 0.5, seed=0)


def stage1_cfg(root, run, *extra):
    return stage_config(load_config("train", train_overrides(root, run, *extra)), "stage1", run)


def test_stage1_files_with_the_options(root, tmp_path):
    """The fixture's ids (q…, a…) carry no role: its questions are the training file's query_ids."""
    run = tmp_path / "run"
    c = stage1_cfg(root, run, "model.stages.stage1.query_share=0.5", "model.stages.stage1.heldout_texts=5")
    rows = list(read_jsonl(c.data.texts))
    questions = {r["query_id"] for r in read_jsonl(root / "train.jsonl")}
    assert all(r["kind"] == ("query" if r["id"] in questions else "document") for r in rows)
    held = {r["id"] for r in rows if r.get("heldout")}
    examples = [r["query_id"] for r in read_jsonl(c.data.examples)]
    assert len(held) == 5 and not held & set(examples)
    assert len(examples) == len(rows) - 5 and sum(e in questions for e in examples) == int(0.5 * len(examples) + 0.5)
    composition = json.loads((run / "stage1-data" / "composition.json").read_text())
    assert sum(composition["examples"].values()) == len(examples) and sum(composition["heldout"].values()) == 5
    assert [r["text"] for r in rows] == [r["text"] for r in read_jsonl(stage1_cfg(root, tmp_path / "plain").data.texts)]
    # the held-out slice does not depend on the mix (the same pool and seed)
    other = stage1_cfg(root, tmp_path / "other", "model.stages.stage1.query_share=0.9",
                       "model.stages.stage1.heldout_texts=5")
    assert {r["id"] for r in read_jsonl(other.data.texts) if r.get("heldout")} == held
    for bad, match in (("query_share=1.5", "a share from 0 to 1"), ("heldout_texts=-1", "an integer >= 0"),
                       ("document_text_max_length=0", "an integer >= 1")):
        with pytest.raises(ValueError, match=match):
            stage1_cfg(root, tmp_path / "bad", f"model.stages.stage1.{bad}")


def test_tokenize_with_limits_equals_the_towers_own_at_one_limit(tiny, root):
    texts = [r["text"] for r in read_jsonl(root / "texts.jsonl")][:10]
    query = Tower.load(TowerSpec(path=str(tiny / "query"), max_length=64), "q")
    document = Tower.load(TowerSpec(path=str(tiny / "document"), pooling="last_token", padding_side="left",
                                    append_eos=True, max_length=64), "d")
    for tower in (query, document):
        want = tower.tokenize(texts, 24)
        got = tokenize_with_limits(tower, texts, [24] * len(texts))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_stage1_tokenizes_each_kind_at_its_limit(root, tiny, tmp_path):
    c = stage1_cfg(root, tmp_path / "run", f"model.query.path={tiny / 'query'}", f"model.document.path={tiny / 'document'}",
                   "model.stages.stage1.query_text_max_length=40", "model.stages.stage1.document_text_max_length=100")
    family = CAREFamily(c)
    kinds = {r["text"]: r["kind"] for r in read_jsonl(c.data.texts)}
    texts = [t for t in kinds if kinds[t] == "query"][:3] + [t for t in kinds if kinds[t] == "document"][:3]
    batch = family.tokenize(texts, ["query"] * 6, 64)  # the loop's limit; care_tiny's query max_length is 64
    prompted = family.prompts.apply(texts, "query", family.task)
    tok = family.query_module.tokenizer
    for i, t in enumerate(texts):
        limit = 40 if kinds[t] == "query" else 100  # above the tower's max_length: not capped
        want = tok(prompted[i], truncation=True, max_length=limit)["input_ids"]
        n = int(batch["attention_mask"][i].sum())
        assert batch["input_ids"][i, :n].tolist() == want
    assert int(batch["attention_mask"].sum(1).max()) == 100  # the answers are longer than 100 tokens
    plain = CAREFamily(stage1_cfg(root, tmp_path / "plain", f"model.query.path={tiny / 'query'}",
                                  f"model.document.path={tiny / 'document'}"))
    assert int(plain.tokenize(texts, ["query"] * 6, 64)["attention_mask"].sum(1).max()) == 64  # the control
    with pytest.raises(ValueError, match="document_text_max_length=600: the query tower has 512 positions"):
        CAREFamily(stage1_cfg(root, tmp_path / "long", f"model.query.path={tiny / 'query'}",
                              f"model.document.path={tiny / 'document'}", "model.stages.stage1.document_text_max_length=600"))


# ---- 3. in-batch score distillation ----------------------------------------------------------------------

def log_softmax(x: np.ndarray) -> np.ndarray:
    top = x.max(1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(1, keepdims=True))


def score_distill_reference(q, p, group, temperature) -> float:
    """KL(softmax(d_i . p_j / T) || softmax(q_i . p_j / T)) + the target's entropy, d_i = p[i x group]."""
    targets = np.exp(log_softmax(p[::group] @ p.T / temperature))
    return float(-(targets * log_softmax(q @ p.T / temperature)).sum(1).mean())


def unit(rng, n, d):
    x = rng.normal(size=(n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("group,temperature", [(1, None), (1, 0.05), (3, 0.2)])
def test_score_distillation_matches_the_formula(group, temperature):
    rng = np.random.default_rng(group)
    q, p = unit(rng, 5, 8), unit(rng, 5 * group, 16)[:, :8]  # cut document vectors
    loss = AsymmetricLoss(temperature=0.1, mse_weight=0.5, group_size=group, score_distill_weight=0.7,
                          score_distill_temperature=temperature)
    out = loss({"dense": torch.from_numpy(q)}, {"dense": torch.from_numpy(p)})
    t = temperature or 0.1
    term = score_distill_reference(q, p, group, t)
    assert float(out["score_distill"]) == pytest.approx(term, rel=1e-12)
    assert float(out["loss"]) == pytest.approx(float(out["infonce"]) + 0.5 * float(out["mse"]) + 0.7 * term, rel=1e-12)
    assert loss.score_distill.temperature == t
    # the control: a target from the query's own scores would be another value
    wrong = float(-(np.exp(log_softmax(q @ p.T / t)) * log_softmax(q @ p.T / t)).sum(1).mean())
    assert abs(wrong - term) > 1e-3


def test_the_document_target_carries_no_gradient():
    rng = np.random.default_rng(0)
    q0, p0 = torch.from_numpy(unit(rng, 4, 8)), torch.from_numpy(unit(rng, 4, 8))
    loss = AsymmetricLoss(temperature=0.1, mse_weight=0.0, group_size=1, score_distill_weight=1.0)
    q, p = q0.clone().requires_grad_(), p0.clone().requires_grad_()
    loss({"dense": q}, {"dense": p})["score_distill"].backward()
    # the reference: the target built from detached document vectors, by hand
    qr, pr = q0.clone().requires_grad_(), p0.clone().requires_grad_()
    targets = torch.softmax(pr.detach() @ pr.detach().T / 0.1, -1)
    (-(targets * torch.log_softmax(qr @ pr.T / 0.1, -1)).sum(-1).mean()).backward()
    torch.testing.assert_close(q.grad, qr.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(p.grad, pr.grad, rtol=1e-12, atol=0)
    # the control: a target that kept its gradient would move the documents otherwise
    pg = p0.clone().requires_grad_()
    live = torch.softmax(pg @ pg.T / 0.1, -1)
    (-(live * torch.log_softmax(q0 @ pg.T / 0.1, -1)).sum(-1).mean()).backward()
    assert float((pg.grad - pr.grad).abs().max()) > 1e-6


def stage1_step(tiny: Path, weight: float, cached: bool, chunk: int = 3):
    """(losses, query-tower grads) of one stage-I step: a float64 query tower (dropout 0.1) against cached
    document vectors (rows of a table), plain autograd over the same chunks or GradCache."""
    texts = ["癫痫病人可以怀孕吗", "头痛发烧怎么办", "孩子咳嗽有痰吃什么药", "高血压能治愈吗", "失眠怎么调理", "胃疼吃什么药",
             "糖尿病人能吃西瓜吗"]
    rng = np.random.default_rng(3)
    documents = CachedDocuments(unit(rng, 7, 64)[:, :32])
    query = Tower.load(TowerSpec(path=str(tiny / "query")), "model.query", torch.float64).train()
    qb, rows = query.tokenize(texts), {"rows": torch.arange(7)}
    loss_fn = AsymmetricLoss(temperature=0.1, mse_weight=1.0, group_size=1, score_distill_weight=weight)
    torch.manual_seed(11)
    if cached:
        losses = GradCache(loss_fn, chunk_size=chunk).step(query, qb, rows, passage_model=documents)
    else:
        reps = torch.cat([query(**{k: v[s:s + chunk] for k, v in qb.items()})["dense"] for s in range(0, 7, chunk)])
        out = loss_fn({"dense": reps}, documents(**rows))
        out["loss"].backward()
        losses = {k: float(v.detach()) for k, v in out.items()}
    return losses, {n: p.grad.clone() for n, p in query.named_parameters()}


def test_gradcache_with_score_distillation_equals_the_plain_step(tiny):
    (ref_loss, ref), (gc_loss, got) = stage1_step(tiny, 0.5, False), stage1_step(tiny, 0.5, True)
    assert set(ref_loss) == set(gc_loss) == {"loss", "infonce", "mse", "score_distill"}
    for k in ref_loss:
        assert gc_loss[k] == pytest.approx(ref_loss[k], rel=1e-12), k
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)
    # the control: the term moves the gradient (it is not a no-op the equality would pass anyway)
    _, without = stage1_step(tiny, 0.0, False)
    assert max(float((ref[n] - without[n]).abs().max()) for n in ref) > 1e-6


def test_score_distillation_off_is_bit_identical_to_the_loss_before():
    rng = np.random.default_rng(2)
    q0, p0 = torch.from_numpy(unit(rng, 4, 16)).float(), torch.from_numpy(unit(rng, 4, 24)[:, :16]).float()
    loss = AsymmetricLoss(temperature=0.1, mse_weight=1.0, group_size=1, score_distill_weight=0.0,
                          score_distill_temperature=None)
    results = []
    for forward in (loss, lambda q, p: todays_asymmetric(loss, q, p)):
        q, p = q0.clone().requires_grad_(), p0.clone().requires_grad_()
        out = forward({"dense": q}, {"dense": p})
        out["loss"].backward()
        results.append((out, q.grad, p.grad))
    (new, *new_grads), (old, *old_grads) = results
    assert set(new) == set(old) and all(torch.equal(new[k], old[k]) for k in old)
    assert all(torch.equal(a, b) for a, b in zip(new_grads, old_grads))


# ---- 4. the held-out alignment slice ---------------------------------------------------------------------

def test_alignment_metrics_match_a_loop():
    rng = np.random.default_rng(4)
    q = unit(rng, 6, 8)
    d = 0.8 * q + 0.3 * rng.normal(size=(6, 8))
    d[5] = d[4]  # text 4's and 5's document vectors tie for both queries: a miss for one of them at least
    kinds = ["query", "document", "query", "document", "document", "query"]
    got = alignment_metrics(q, d, kinds)
    cos = [float(q[i] @ d[i] / np.linalg.norm(q[i]) / np.linalg.norm(d[i])) for i in range(6)]
    hits = [all(q[i] @ d[i] > q[i] @ d[j] for j in range(6) if j != i) for i in range(6)]
    assert got["align_cos"] == pytest.approx(np.mean(cos), rel=1e-12)
    assert got["align_acc"] == pytest.approx(np.mean(hits), rel=1e-12) and not (hits[4] and hits[5])
    assert got["align_cos_query"] == pytest.approx(np.mean([cos[i] for i in (0, 2, 5)]), rel=1e-12)
    assert got["align_cos_document"] == pytest.approx(np.mean([cos[i] for i in (1, 3, 4)]), rel=1e-12)
    assert alignment_metrics(q, q * 3.0)["align_cos"] == pytest.approx(1.0)  # a cosine: length does not count


def dev_task(root: Path, path: Path) -> Path:
    """A tiny reranking task in C-MTEB's layout over the fixture's texts (as validation.task reads it)."""
    texts = {r["id"]: r["text"] for r in read_jsonl(root / "texts.jsonl")}
    rows = [{"query": texts[e["query_id"]], "positive": [texts[e["pos_ids"][0]]],
             "negative": [texts[n] for n in e["neg_ids"][:3]]} for e in list(read_jsonl(root / "train.jsonl"))[:4]]
    write_jsonl(path, rows)
    return path


def without(cfg, keys: tuple[str, ...]):
    """`cfg` without the `keys` of model.stages.stage1 (as the code before them saw it)."""
    with open_dict(cfg):
        for key in keys:
            *parents, leaf = key.split(".")
            node = OmegaConf.select(cfg.model.stages.stage1, ".".join(parents)) if parents else cfg.model.stages.stage1
            del node[leaf]
    return cfg


def stage1_run(root: Path, tiny: Path, run: Path, *extra: str, drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A tiny stage-I run (care_tiny: 4 steps of 8, GradCache, float64) through the recipe, without the
    `drop` keys of model.stages.stage1; its final query tower."""
    cfg = load_config("train", train_overrides(root, run, f"model.query.path={tiny / 'query'}",
                                               f"model.document.path={tiny / 'document'}", "++trainer.dtype=float64",
                                               "model.stage=stage1", *extra))
    run_care(without(cfg, drop))
    return load_file(run / "stage1" / "final" / "query" / "model.safetensors")


def test_heldout_slice_is_logged_beside_the_dev_metric(root, tiny, tmp_path):
    run = tmp_path / "run"
    task = dev_task(root, tmp_path / "dev.jsonl")
    stage1_run(root, tiny, run, "model.stages.stage1.heldout_texts=6", f"validation.task={task}",
               "validation.build_from=null", "validation.every_steps=2")
    rows = list(read_jsonl(run / "stage1" / "metrics.jsonl"))
    align = [r for r in rows if "val/align_cos" in r]
    assert [r["step"] for r in align] == [0, 2, 4]
    assert [r["step"] for r in rows if "val/map_cut_10" in r] == [0, 2, 4]  # the dev task, as before
    for r in align:
        assert -1 <= r["val/align_cos"] <= 1 and 0 <= r["val/align_acc"] <= 1
        assert {"val/align_cos_query", "val/align_cos_document"} <= set(r)
    assert align[-1]["val/align_cos"] != align[0]["val/align_cos"]  # the query tower moved
    record = json.loads((run / "stage1" / "final" / "care_training.json").read_text())
    assert record["validation"]["metric"] == "map_cut_10"  # early stopping keeps validation.metric
    # the value at the best step (final/ holds that model), recomputed from the saved query tower and the
    # document tower's own vectors
    texts_path = run / "stage1-data" / "texts.jsonl"
    held = [r for r in read_jsonl(texts_path) if r.get("heldout")]
    assert len(held) == 6
    cfg = load_config("train", train_overrides(root, tmp_path / "check", f"model.query.path={tiny / 'query'}",
                                               f"model.document.path={tiny / 'document'}",
                                               "model.stages.stage1.heldout_texts=6"))
    family = CAREFamily(stage_config(cfg, "stage1", tmp_path / "check"))
    saved = Tower.load(TowerSpec(path=str(run / "stage1" / "final" / "query"), max_length=64), "q", torch.float64).eval()
    texts = [r["text"] for r in held]
    with torch.no_grad():
        q = saved(**saved.tokenize(family.prompts.apply(texts, "query", "retrieval"), 64))["dense"].numpy()
    d = family.document_module.table[[family.row[t] for t in texts]].double().numpy()
    expected = alignment_metrics(q, d, [r["kind"] for r in held])
    at_best = next(r for r in align if r["step"] == record["validation"]["best_step"])
    assert at_best["val/align_cos"] == pytest.approx(expected["align_cos"], rel=1e-9)
    assert at_best["val/align_acc"] == expected["align_acc"]


def test_a_stages_validation_block_and_a_fixed_budget(root, tiny, tmp_path):
    """model.stages.<stage>.validation takes over train.yaml's validation for that stage (as its trainer block
    does), and patience null never stops a run (care_me5's fixed stage-I budget); the control, patience 1,
    stops at the first validation without an improvement (min_delta 10: none counts after the first)."""
    task = dev_task(root, tmp_path / "dev.jsonl")

    def steps(run: str, block: str) -> tuple[list[int], int]:
        stage1_run(root, tiny, tmp_path / run, f"validation.task={task}", "validation.build_from=null",
                   "validation.every_steps=3", "validation.min_delta=10", f"+model.stages.stage1.validation={block}")
        rows = list(read_jsonl(tmp_path / run / "stage1" / "metrics.jsonl"))
        return [r["step"] for r in rows if "val/map_cut_10" in r], max(r["step"] for r in rows if "loss/loss" in r)

    assert steps("fixed", "{every_steps: 1, patience: null}") == ([0, 1, 2, 3, 4], 4)
    assert steps("stops", "{every_steps: 1, patience: 1}") == ([0, 1], 1)


# ---- every option off: the weights of the code before the options ----------------------------------------

# A tiny stage-I run (stage1_run, no option) by the code before the options existed (git HEAD d95a321, with
# the other engineers' edits of the time): its loss curve and per-tensor sums of the final query tower.
BEFORE = {"loss": [3.915716071380984, 3.855063523167231, 3.6585272368652504, 3.8111615569912676],
          "sums": {"embeddings.word_embeddings.weight": -0.6767614063039442,
                   "embeddings.position_embeddings.weight": -2.36529695280252,
                   "encoder.layer.0.attention.self.query.weight": -0.7218859924625383,
                   "encoder.layer.1.intermediate.dense.weight": -1.0848389934675586,
                   "encoder.layer.1.output.dense.weight": 1.0341252335448272,
                   "encoder.layer.1.attention.output.LayerNorm.weight": 32.0006109960492}}
OPTION_KEYS = ("query_share", "query_text_max_length", "document_text_max_length", "heldout_texts",
               "loss.score_distill_weight", "loss.score_distill_temperature")


def test_options_off_give_the_weights_of_the_code_before_them(root, tiny, tmp_path, monkeypatch):
    # an empty embedding cache, as the run pinned had: the document vectors computed by the float64 tower (the
    # cache's key does not hold the dtype, and other tests of this module fill it from a float32 tower)
    monkeypatch.setenv("CARE_CACHE", str(tmp_path / "cache"))
    defaults = stage1_run(root, tiny, tmp_path / "defaults")  # the model config's explicit defaults
    losses = [r["loss/loss"] for r in read_jsonl(tmp_path / "defaults" / "stage1" / "metrics.jsonl") if "loss/loss" in r]
    assert losses == pytest.approx(BEFORE["loss"], rel=1e-9)
    for k, v in BEFORE["sums"].items():
        assert float(defaults[k].double().sum()) == pytest.approx(v, rel=1e-9), k
    # the keys deleted from the config (as the code before them saw it): the same weights, bit for bit
    absent = stage1_run(root, tiny, tmp_path / "absent", drop=OPTION_KEYS)
    recorded = json.loads((tmp_path / "absent" / "stage1" / "final" / "care_training.json").read_text())
    stage1 = recorded["config"]["model"]["stages"]["stage1"]
    assert "query_share" not in stage1 and "score_distill_weight" not in stage1["loss"]
    assert defaults.keys() == absent.keys() and all(torch.equal(defaults[k], absent[k]) for k in defaults)
    for name in ("texts.jsonl", "train.jsonl"):  # and stage I's files are today's, byte for byte
        data = tmp_path / "defaults" / "stage1-data" / name
        assert data.read_bytes() == (tmp_path / "absent" / "stage1-data" / name).read_bytes()
    same_text_pairs(str(root / "texts.jsonl"), [], tmp_path / "plain")
    assert all((tmp_path / "plain" / n).read_bytes() == (tmp_path / "defaults" / "stage1-data" / n).read_bytes()
               for n in ("texts.jsonl", "train.jsonl"))
    assert not (tmp_path / "defaults" / "stage1-data" / "composition.json").exists()
    # the control: an option on moves the weights (the comparison above can fail)
    on = stage1_run(root, tiny, tmp_path / "on", "model.stages.stage1.loss.score_distill_weight=1.0")
    assert any(not torch.equal(defaults[k], on[k]) for k in defaults)
    assert float(on["encoder.layer.1.output.dense.weight"].double().sum()) != pytest.approx(
        BEFORE["sums"]["encoder.layer.1.output.dense.weight"], rel=1e-9)


def test_options_off_leave_the_stage_hash_as_before(root, tiny, tmp_path):
    """At their neutral values the new keys are left out of the run hash (care.config.NEUTRAL): a run folder
    begun before them keeps its config hash (it resumes, and a finished one is recognised)."""
    def stage1(*extra, drop=()):
        cfg = load_config("train", train_overrides(root, tmp_path / "run", f"model.query.path={tiny / 'query'}",
                                                   f"model.document.path={tiny / 'document'}", *extra))
        return stage_config(without(cfg, drop), "stage1", tmp_path / "run")

    defaults, absent = stage1(), stage1(drop=OPTION_KEYS)
    assert defaults.model.stages.stage1.heldout_texts == 0 and "heldout_texts" not in absent.model.stages.stage1
    assert config_hash(defaults) == config_hash(absent)
    # the control: a key away from its neutral value moves the hash
    on = stage1("model.stages.stage1.loss.score_distill_temperature=0.05")
    assert on.loss.score_distill_temperature == 0.05 and config_hash(on) != config_hash(defaults)
    # care_me5's cut: pick=first is a neutral key of the stage config, spread (care_me5's default) is not
    me5 = ["model=care_me5", "model.stages.stage1.extra_texts=[]"]
    first = stage_config(load_config("train", train_overrides(root, tmp_path / "m", *me5, "model.query.build.pick=first")),
                         "stage1", tmp_path / "m")
    spread = stage_config(load_config("train", train_overrides(root, tmp_path / "m", *me5)), "stage1", tmp_path / "m")
    assert "model.query.build.pick" in neutral_keys(OmegaConf.to_container(first))
    assert spread.model.query.build.pick == "spread" and "model.query.build.pick" not in neutral_keys(
        OmegaConf.to_container(spread))
