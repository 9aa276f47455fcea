"""CARE's LoRA on the document tower: the projections it adapts, and its merge into a folder that reloads."""
# ruff: noqa: F811  (the fixtures imported from _care_helpers are named as test parameters)
from __future__ import annotations

import copy
import json

import pytest
import torch
from _care_helpers import DOCUMENT, stage2_family, texts, towers  # noqa: F401  (texts, towers: fixtures)
from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer

from care.models.tiny import tiny_bert, tiny_qwen3
from care.models.towers import Tower, TowerSpec
from care.training.care_family import lora_targets

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- 5. LoRA placement and merge ------------------------------------------------------------------------

def test_lora_targets_every_attention_and_mlp_projection():
    bert, _ = tiny_bert(hidden=32, layers=2)
    qwen, _ = tiny_qwen3(hidden=64, layers=2)
    bert_projections = ["attention.self.query", "attention.self.key", "attention.self.value",
                        "attention.output.dense", "intermediate.dense", "output.dense"]
    qwen_projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    expected = {"bert": {f"encoder.layer.{i}.{p}" for i in range(2) for p in bert_projections},
                "qwen3": {f"layers.{i}.{p}" for i in range(2) for p in qwen_projections}}
    for name, model in (("bert", bert), ("qwen3", qwen)):
        targets = lora_targets(model)
        assert set(targets) == expected[name] and len(targets) == len(expected[name]), name
        linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        assert linear == expected[name]  # every linear layer of these models is one of them
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(copy.deepcopy(qwen), LoraConfig(r=4, target_modules=lora_targets(qwen)))
    adapted = {n.removeprefix("base_model.model.") for n, m in wrapped.named_modules() if hasattr(m, "lora_A")}
    assert adapted == expected["qwen3"]  # peft placed an adapter on each of them
    with pytest.raises(ValueError, match="no linear layer inside numbered transformer blocks"):
        lora_targets(nn.Sequential(nn.Linear(4, 4)))


def test_the_merged_document_tower_equals_the_adapter_and_every_folder_reloads(towers, texts, tmp_path):
    from peft import PeftModel

    family = stage2_family(towers, tmp_path)
    query, document = family.query_module, family.document_module
    torch.manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter (peft starts lora_B at zero: a merge of nothing)
        for name, p in document.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    document.eval()
    out = family.save([query, document], tmp_path / "saved")
    assert {p.name for p in out.iterdir()} == {"query", "document", "document_adapter"}
    spec = TowerSpec(path=str(out / "document"), **DOCUMENT)
    merged = Tower.load(spec, "model.document").eval()
    base = Tower.load(TowerSpec(path=str(towers / "seed0" / "document"), **DOCUMENT), "model.document").eval()
    reloaded = copy.deepcopy(base)
    reloaded.model = PeftModel.from_pretrained(reloaded.model, out / "document_adapter").eval()
    batch = document.tokenize(texts)
    with torch.no_grad():
        live, from_merged = document(**batch)["dense"], merged(**batch)["dense"][:, :32]
        from_adapter, start = reloaded(**batch)["dense"][:, :32], base(**batch)["dense"][:, :32]
    torch.testing.assert_close(from_merged, live, atol=1e-5, rtol=0)
    torch.testing.assert_close(from_adapter, live, atol=1e-5, rtol=0)
    assert (start - live).abs().max() > 1e-3  # the control: the adapter does change the tower
    for side, source in (("query", towers / "seed0" / "query"), ("document", towers / "seed0" / "document")):
        tok, original = AutoTokenizer.from_pretrained(out / side), AutoTokenizer.from_pretrained(source)
        assert tok(texts)["input_ids"] == original(texts)["input_ids"], side
        assert json.loads((out / side / "config.json").read_text())["hidden_size"] == (32 if side == "query" else 64)
    assert not any("lora" in k for k in safe_open(out / "document" / "model.safetensors", "np").keys())  # noqa: SIM118
