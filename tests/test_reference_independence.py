"""The shared test references (tests/_*.py) are written independently of the code they check: none repeats a
statement of care/ or data_pipeline/ verbatim, so a slip there is not copied into the reference that should
catch it (issue #34.5: the mining reference was once the production walk line for line).

The reference here is plain text comparison: every statement line of a helper, whitespace removed, against
every line of the production sources.  A few lines must be shared because they are an interface, not logic;
they are listed with the reason.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_CHARS = 40  # shorter lines (a loop header, a return) are too common to mean a copy
# (helper, line without whitespace) -> why it must equal a production line
INTERFACE = {
    # the candidates of document mode are the FAISS rows mine_pool builds from `docs`: their order is given
    ("_mining_helpers.py", 'self.docs=list(dict.fromkeys(pforexinexamplesforpinex["pos_ids"]ifpnotinremoved))'):
        "the row order of the document index",
    ("_mining_helpers.py", "def__init__(self,examples:list[dict],texts:dict[str,str],cluster_of:dict[str,int],"):
        "PoolMiner's constructor signature",
    # the bit-for-bit reference of the loss before its options must promote dtypes exactly as it did
    ("_care_helpers.py", 'dtype=torch.promote_types(torch.promote_types(q["dense"].dtype,p["dense"].dtype),torch.float32)'):
        "the loss's dtype contract",
    ("_care_helpers.py", 'qv,pv=q["dense"].to(dtype),p["dense"].to(dtype)'): "the loss's dtype contract",
    # the fourth family written in the tests (#42.3) is an Encoder: these lines are the interface it implements
    ("_sparse_family.py", "defencode(self,texts,side,batch_size,heads,show_progress)->Embeddings:"):
        "Encoder.encode's signature",
    ("_sparse_family.py", 'return{"query":self.model,"document":self.model}'): "Encoder.networks of one backbone",
    ("_sparse_family.py", "returnsum(p.numel()forpinself.model.parameters())"): "online parameters of one backbone",
}


def _key(line: str) -> str:
    return re.sub(r"\s+", "", line)


def _statements(text: str) -> list[str]:
    return [k for k in map(_key, text.splitlines())
            if len(k) >= MIN_CHARS and not k.startswith(("#", "from", "import", '"', "'"))]


def copied_lines(helpers: list[Path], production: list[Path]) -> dict[str, list[str]]:
    prod = {k for p in production for k in _statements(p.read_text(encoding="utf-8"))}
    out = {}
    for h in helpers:
        same = [k for k in _statements(h.read_text(encoding="utf-8")) if k in prod and (h.name, k) not in INTERFACE]
        if same:
            out[h.name] = same
    return out


def test_no_reference_helper_repeats_production_code():
    production = [p for d in ("care", "data_pipeline") for p in (ROOT / d).rglob("*.py")]
    copied = copied_lines(sorted((ROOT / "tests").glob("_*.py")), production)
    assert not copied, f"write these references from the rules, not from the code they check: {copied}"


def test_the_comparison_finds_a_copy(tmp_path):
    """Not vacuous: a helper holding a line of data_pipeline/negatives.py is found, whitespace aside."""
    line = next(x for x in (ROOT / "data_pipeline" / "negatives.py").read_text(encoding="utf-8").splitlines()
                if len(_key(x)) >= MIN_CHARS and "np." in x)
    (tmp_path / "_copy.py").write_text("def f():\n    " + "  ".join(line.split()) + "\n", encoding="utf-8")
    assert copied_lines([tmp_path / "_copy.py"], [ROOT / "data_pipeline" / "negatives.py"]) == {
        "_copy.py": [_key(line)]}
