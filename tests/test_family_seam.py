"""The family seam (issues #34, #42): every "which family is this model?" is answered by care/families.py alone.

- A grep over every source file of the library, the stages, the benchmarks and the apps finds no family
  branch outside care/families.py: no `kind` compared with a family's name, no config probed for its towers'
  keys, no table keyed by family names, no second default kind (at 017c3b3 it found 39, on 35 lines of 15
  files).  The scanner is held to hand-written lines that are and are not branches (the independent
  reference).
- A walk of the same files' syntax trees finds no class probe: no `isinstance` / `issubclass` of a class a
  family names (its encoder or trainer), no `getattr` / `hasattr` on an encoder (what an encoder is, it says
  through the Encoder interface, care/encoders/base.py).  At ece40fe it found 14 (the mteb adapter 13,
  validation 1); the walker is held to hand-written lines too.
- `register_family` is the one way into FAMILIES, and refuses a malformed family in one line.
- The registry recognises each family from a model config and from a folder written as the project writes
  it (conftest.py's tiny BERT; an M3 folder saved by care.models.m3; CARE towers built by
  care.encoders.builders.towers with a training record), and every hook it names imports from its own layer
  (docs/design.md, "Layers").
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from care.families import (
    FAMILIES,
    HOOK_LAYERS,
    PAIR_SCORES,
    TWO_TOWERS,
    Family,
    family_of,
    hook,
    register_family,
    tower_configs,
)
from care.paths import PROJECT_ROOT

REGISTRY = PROJECT_ROOT / "care" / "families.py"
NAMES = "|".join(re.escape(n) for n in FAMILIES)
SIDES = "|".join(TWO_TOWERS)
BRANCHES = [  # (what, pattern): each a way the code at 017c3b3 asked "which family?"
    ("kind compared with a family name",
     re.compile(rf"""\bkind\b[^#\n]*?(==|!=|\bin\b)\s*[(\[{{]?\s*["']({NAMES})["']""")),
    ("a family name compared with a kind", re.compile(rf"""["']({NAMES})["']\s*(==|!=)[^#\n]*\bkind\b""")),
    ("a config probed for a tower's key", re.compile(rf"""["']({SIDES})["']\s+(not\s+)?in\s+(?![(\[{{])[A-Za-z_]""")),
    ("a second default kind", re.compile(rf"""get\(\s*["']kind["']\s*,\s*["']({NAMES})["']""")),
    ("a table keyed by family names", re.compile(rf"""\{{\s*["']({NAMES})["']\s*:[^{{}}]*?["']({NAMES})["']\s*:""")),
]


def sources() -> list[Path]:
    """Every Python source of the library, the stages, the benchmarks and the apps, but the registry."""
    found = [p for d in ("care", "data_pipeline", "bench") for p in sorted((PROJECT_ROOT / d).rglob("*.py"))]
    return [p for p in found + sorted(PROJECT_ROOT.glob("*.py")) if p != REGISTRY]


def family_branches(text: str) -> list[tuple[int, str]]:
    """(line, what) for every family branch in a source text."""
    hits = set()
    for what, pattern in BRANCHES:
        for m in pattern.finditer(text):
            hits.add((text.count("\n", 0, m.start()) + 1, what))
    return sorted(hits)


@pytest.mark.parametrize(("line", "branch"), [
    ('if model.get("kind") == "care":', True),
    ('if kind in ("dense", "m3"):', True),
    ('if "care" == cfg.model.kind:', True),
    ('paths = [...] if "query" in cfg.model else [cfg.model.path]', True),
    ('if "query" in model and "document" in model:', True),
    ('kind = c.get("kind", "dense")', True),
    ('TAGS = {"m3": "bge-m3",\n        "care": "care"}', True),
    ('if method == "dense":', False),                       # a head, not a family
    ('if "dense" not in self.heads:', False),
    ('weights = {"dense": 1.0, "sparse": 1.0, "colbert": 1.0}', False),
    ('for side in ("query", "document"):', False),
    ('if kind == "cross-encoder":', False),                  # a teacher's kind
    ('return {**model, "kind": "m3", "path": "."}', False),  # writing a config names its family
])
def test_the_scanner_tells_family_branches_from_other_code(line, branch):
    assert bool(family_branches(line)) is branch


def test_no_family_branch_outside_the_registry():
    found = [f"{p.relative_to(PROJECT_ROOT)}:{line}: {what}" for p in sources()
             for line, what in family_branches(p.read_text(encoding="utf-8"))]
    assert found == [], f"{len(found)} family branches outside care/families.py:\n" + "\n".join(found)


# ---- class probes (issue #42) ---------------------------------------------------------------------------

def family_classes() -> set[str]:
    """The names of the classes the families name (their encoder and trainer hooks): what a probe tests for."""
    return {spec.partition(":")[2] for f in FAMILIES.values() for spec in (f.encoder, f.trainer) if spec}


def _last_name(node: ast.AST) -> str:
    """`encoder` of `encoder`, `self.encoder`, `model.cross_encoder`; "" for anything else."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def class_probes(text: str, classes: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every class probe in a source text: isinstance / issubclass against one of `classes`
    (a name or a tuple of names, plain or dotted), getattr / hasattr on an object whose name says it is an
    encoder (`encoder`, `self.encoder`, `cross_encoder`, ...)."""
    hits = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
            continue
        fn = node.func.id
        if fn in ("isinstance", "issubclass") and len(node.args) == 2:
            target = node.args[1]
            names = {_last_name(e) for e in (target.elts if isinstance(target, ast.Tuple) else [target])}
            for name in sorted(names & classes):
                hits.append((node.lineno, f"{fn} of {name}"))
        elif fn in ("getattr", "hasattr") and "encoder" in _last_name(node.args[0]).lower():
            attr = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
            hits.append((node.lineno, f"{fn} {attr!r} of an encoder"))
    return sorted(set(hits))


@pytest.mark.parametrize(("line", "probe"), [
    ("if isinstance(encoder, CAREEncoder): pass", True),
    ("if isinstance(enc, (HFDenseEncoder, M3Encoder)): pass", True),
    ("ok = isinstance(x, care.encoders.cross_encoder.CrossEncoder)", True),
    ("ok = issubclass(cls, CAREFamily)", True),
    ('towers = getattr(encoder, "towers", None)', True),
    ('n = getattr(self.encoder, "truncate_dim", None)', True),
    ('if hasattr(cross_encoder, "score_pairs"): pass', True),
    ("if isinstance(encoder, Encoder): pass", False),           # the interface itself, not a family's class
    ("model = encoder if isinstance(encoder, MtebEncoder) else MtebEncoder(encoder)", False),  # an adapter
    ('inner = getattr(module, "model", module)', False),      # a torch module, not an encoder
    ('if getattr(task, "care_data", None): pass', False),
    ("if isinstance(towers, Mapping): pass", False),
])
def test_the_walker_tells_class_probes_from_other_code(line, probe):
    assert bool(class_probes(line, family_classes())) is probe


def test_the_walker_knows_every_family_class():
    assert {"HFDenseEncoder", "M3Encoder", "CAREEncoder", "CrossEncoder", "CAREFamily"} <= family_classes()


def test_no_class_probe_outside_the_registry():
    classes = family_classes()
    found = [f"{p.relative_to(PROJECT_ROOT)}:{line}: {what}" for p in sources()
             for line, what in class_probes(p.read_text(encoding="utf-8"), classes)]
    assert found == [], f"{len(found)} class probes outside care/families.py:\n" + "\n".join(found)


def test_register_family_is_checked():
    """The one entry point refuses a malformed family in one line; a family it takes is found by its kind."""
    base = {"towers": (), "tag": "t", "description": "d", "encoder": "m:C"}
    bad = [(Family("dense", **base), "registered already"),
           (Family("x1", **{**base, "towers": ("query",)}), "towers="),
           (Family("x2", **base, outputs=("dense", "bm25")), "outputs="),
           (Family("x3", **base, outputs=("dense", PAIR_SCORES)), "come alone"),
           (Family("x4", **{**base, "encoder": "no_colon"}), "encoder hook")]
    for family, message in bad:
        with pytest.raises(ValueError, match=message):
            register_family(family)
        assert family.name == "dense" or family.name not in FAMILIES
    try:
        assert register_family(Family("x5", **base, outputs=("sparse",))) is FAMILIES["x5"]
        assert family_of({"kind": "x5"}).outputs == ("sparse",) and not family_of({"kind": "x5"}).cross_encoder
    finally:
        FAMILIES.pop("x5", None)


def test_what_each_family_gives():
    """Each family's outputs, and its encoder's heads the same (the first: what it gives by default)."""
    assert {n: f.outputs for n, f in FAMILIES.items() if n in ("dense", "m3", "care", "reranker")} == {
        "dense": ("dense",), "m3": ("dense", "sparse", "colbert"), "care": ("dense",), "reranker": (PAIR_SCORES,)}
    assert [n for n, f in FAMILIES.items() if f.cross_encoder] == ["reranker"]
    assert all(f.embeds != f.cross_encoder for f in FAMILIES.values())


# ---- recognition ----------------------------------------------------------------------------------------

def test_each_family_from_a_config():
    assert family_of({"kind": "care", "query": {}, "document": {}}).towers == TWO_TOWERS
    assert family_of({"kind": "m3", "path": "p"}).name == "m3"
    assert family_of({"path": "p"}).name == "dense"  # no kind: the default
    with pytest.raises(ValueError, match="unknown model kind 'colbert'"):
        family_of({"kind": "colbert"})
    assert tower_configs({"kind": "care", "query": {"path": "q"}, "document": {"path": "d"}}) == [
        {"path": "q"}, {"path": "d"}]
    assert tower_configs({"kind": "dense", "path": "p"}) == [{"kind": "dense", "path": "p"}]


def test_each_family_from_a_written_folder(tiny_bert_dir, tmp_path):
    from care.data.io import write_json
    from care.encoders.builders.towers import build_tiny
    from care.encoders.registry import TRAINING_RECORD, detect
    from care.models.m3 import M3Model

    assert family_of(detect(tiny_bert_dir, {})).name == "dense"
    M3Model.from_backbone(str(tiny_bert_dir), "cls", seed=0).save(tmp_path / "m3")
    assert family_of(detect(tmp_path / "m3", {"kind": "dense"})).name == "m3"  # its head files say so
    build_tiny(tmp_path / "care")
    write_json(tmp_path / "care" / TRAINING_RECORD, {"model": {
        "kind": "care", "name": "c", "query": {"path": "query"}, "document": {"path": "document"}}})
    found = detect(tmp_path / "care", {"kind": "dense"})
    assert family_of(found).name == "care"
    assert [t["path"] for t in tower_configs(found)] == [str(tmp_path / "care" / s) for s in TWO_TOWERS]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_hook_imports_from_its_own_layer(name):
    family = FAMILIES[name]
    for what, layer in HOOK_LAYERS.items():
        spec = getattr(family, what)
        if spec is not None:
            assert spec.startswith(layer), f"{name}.{what} = {spec} lives outside {layer}"
            assert hook(family, what) is not None


def test_the_reranker_from_a_config_and_a_written_folder(tmp_path):
    """Issue #35: the cross-encoder family, from its config and from a folder the trainer writes (a tiny
    reranker with a training record); a foreign one-label classifier folder is left to the config given."""
    from care.data.io import write_json
    from care.encoders.registry import TRAINING_RECORD, detect
    from care.models.tiny import save_tiny

    family = family_of({"kind": "reranker", "path": "p"})
    assert family.name == "reranker" and family.cross_encoder and family.towers == () and not family.cuts
    assert not any(f.cross_encoder for f in FAMILIES.values() if f.name != "reranker")
    folder = save_tiny(tmp_path / "reranker", "reranker")
    assert family_of(detect(folder, {"kind": "reranker"})).name == "reranker"
    write_json(folder / TRAINING_RECORD, {"model": {"kind": "reranker", "name": "r", "path": "."}})
    found = detect(folder, {"kind": "dense"})  # its training record says what it is
    assert family_of(found).name == "reranker" and found["path"] == str(folder.resolve())
