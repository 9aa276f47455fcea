"""The training-examples file has one reader (care/data/examples.py): every bad row is one DataError naming
file, line and field, the same from each of the five places that read the file (the mine stage, the score
stage, the FlagEmbedding export, the trainer's TrainingGroups, the Nano stage's leakage check); every optional
field round-trips exactly; and no other module parses the file's rows itself.

The references are written here, not taken from the reader: the expected (line, field) of each bad row is
stated by hand from docs/design.md ("Files between stages") and the reader's docstring, the round trip is
compared with the bytes json.dumps gives, and the grep walks the source's syntax trees for any loop over a
JSON Lines reader whose rows are indexed by the file's id fields.
"""
from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from care.config import load_config
from care.data.io import DataError
from care.training.data import TrainingGroups
from data_pipeline import build, mining, score
from data_pipeline.nano import stage as nano_stage

ROOT = Path(__file__).resolve().parents[1]
TEXTS = {"q1": "头痛怎么办", "q2": "发烧吃什么药", "p1": "多休息", "p2": "布洛芬", "n1": "刷牙", "n2": "跑步",
         "n3": "喝水"}
# A row with every field the format knows (docs/design.md, "Files between stages"; the reader's docstring).
GOOD = {"query_id": "q1", "pos_ids": ["p1"], "pos_scores": [0.91], "neg_ids": ["n1", "n2"],
        "neg_scores": [0.88, 0.5], "rule": "qa", "pool": "answers", "fallback": 1}


def _leakage_options() -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(load_config("data_pipeline").build.leakage, resolve=True)


# Each reader of the file, called on folder/examples.jsonl with folder/texts.jsonl as its text store.
CALLERS = {
    "mine": lambda d: mining.read_examples(d / "examples.jsonl", TEXTS),
    "score": lambda d: score.read_training(d / "examples.jsonl", TEXTS),
    "export_flag": lambda d: build.export_flag(d / "examples.jsonl", d / "texts.jsonl", d / "flag.jsonl"),
    "training": lambda d: TrainingGroups(d / "texts.jsonl", d / "examples.jsonl", group_size=2),
    "nano_leakage": lambda d: nano_stage.leakage_check({}, d, _leakage_options()),
}


def _folder(tmp: Path, lines: list[str]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "texts.jsonl").write_text("".join(json.dumps({"id": k, "text": v}, ensure_ascii=False) + "\n"
                                             for k, v in TEXTS.items()), encoding="utf-8")
    (tmp / "examples.jsonl").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return tmp


def _bad(**change) -> dict:
    row = {**GOOD, "query_id": "q2", "pos_ids": ["p2"]}
    row.update(change)
    return {k: v for k, v in row.items() if v is not DROP}


DROP = object()
TEACHER = {"teacher_pos_scores": [2.5], "teacher_neg_scores": [1.0, -0.5]}
# name -> (line 3 of the file, the field its error must name); line 1 is GOOD, line 2 blank.
CASES = {
    "bad_json": ('{"query_id": "q2", "pos_ids": ["p2"]', None),
    "not_an_object": ('["q2", ["p2"]]', None),
    "no_query_id": (_bad(query_id=DROP), "query_id"),
    "query_id_a_number": (_bad(query_id=7), "query_id"),
    "pos_ids_a_string": (_bad(pos_ids="p2"), "pos_ids"),
    "no_positive": (_bad(pos_ids=[], pos_scores=[]), "pos_ids"),
    "neg_id_a_number": (_bad(neg_ids=["n1", 3]), "neg_ids"),
    "unknown_query": (_bad(query_id="q-nope"), "query_id"),
    "unknown_positive": (_bad(pos_ids=["p-nope"]), "pos_ids"),
    "unknown_negative": (_bad(neg_ids=["n1", "n-nope"]), "neg_ids"),
    "neg_scores_short": (_bad(neg_scores=[0.9]), "neg_scores"),
    "neg_scores_text": (_bad(neg_scores=["high", 0.1]), "neg_scores"),
    "pos_scores_long": (_bad(pos_scores=[0.9, 0.8]), "pos_scores"),
    "pos_scores_nan": (_bad(pos_scores=[math.nan]), "pos_scores"),
    "pool_a_number": (_bad(pool=3), "pool"),
    "rule_a_list": (_bad(rule=["qa"]), "rule"),
    "fallback_too_many": (_bad(fallback=3), "fallback"),
    "fallback_negative": (_bad(fallback=-1), "fallback"),
    "teacher_half": (_bad(teacher_pos_scores=[1.0]), "teacher_neg_scores"),
    "teacher_on_some_lines": (_bad(**TEACHER), "teacher_pos_scores"),
}


def _line(spec) -> str:
    return spec if isinstance(spec, str) else json.dumps(spec, ensure_ascii=False)


# How many examples each caller says it read (its return value; the export counts the lines it wrote).
READ = {"mine": len, "score": len, "export_flag": lambda n: n, "training": len,
        "nano_leakage": lambda stats: stats["training_examples"]}


@pytest.mark.parametrize("caller", CALLERS)
def test_a_good_file_is_read_by_every_caller(tmp_path, caller):
    """Both examples reach the caller (a reader that read nothing, or skipped the line after the blank one,
    fails here); the export writes one line per example."""
    folder = _folder(tmp_path, [json.dumps(GOOD), "", json.dumps({**GOOD, "query_id": "q2"})])
    assert READ[caller](CALLERS[caller](folder)) == 2
    if caller == "export_flag":
        rows = [json.loads(line) for line in (folder / "flag.jsonl").read_text(encoding="utf-8").splitlines()]
        assert [r["query"] for r in rows] == [TEXTS["q1"], TEXTS["q2"]]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("caller", CALLERS)
def test_every_caller_refuses_a_bad_row_naming_file_line_and_field(tmp_path, caller, case):
    """One rule set: the same bad row is refused by every reader of the file, with its file's line (the
    blank line 2 counts) and the field at fault, in one line."""
    line, field = CASES[case]
    folder = _folder(tmp_path, [json.dumps(GOOD), "", _line(line)])
    with pytest.raises(DataError) as err:
        CALLERS[caller](folder)
    e = err.value
    assert (e.path, e.line, e.field) == (str(folder / "examples.jsonl"), 3, field), str(e)
    assert "\n" not in str(e) and str(folder / "examples.jsonl") in str(e)
    assert not (folder / "flag.jsonl").exists()


@pytest.mark.parametrize("caller", CALLERS)
def test_every_caller_refuses_a_file_dropping_teacher_scores(tmp_path, caller):
    """Teacher scores go on every line or none: the first line has them, line 3 not."""
    folder = _folder(tmp_path, [json.dumps({**GOOD, **TEACHER}), "", json.dumps(_bad())])
    with pytest.raises(DataError) as err:
        CALLERS[caller](folder)
    assert (err.value.line, err.value.field) == (3, "teacher_pos_scores")


@pytest.mark.parametrize("caller", CALLERS)
def test_every_caller_refuses_a_file_without_examples(tmp_path, caller):
    folder = _folder(tmp_path, ["", "  "])
    with pytest.raises(DataError, match="no training examples") as err:
        CALLERS[caller](folder)
    assert (err.value.path, err.value.line) == (str(folder / "examples.jsonl"), None)


# ---- the reader and writer themselves ---------------------------------------------------------------------

FULL = [{**GOOD, **TEACHER, "extra": {"kept": [1, "二"]}, "fallback": 0},
        {"query_id": "q2", "pos_ids": ["p2", "p1"], "pos_scores": [1, 0.25], "neg_ids": [], "neg_scores": [],
         "rule": None, "pool": None, "fallback": 0, "teacher_pos_scores": [0, -3.5], "teacher_neg_scores": []}]


def test_every_optional_field_round_trips_exactly(tmp_path):
    from care.data.examples import read_example_rows, write_examples

    path = tmp_path / "train.jsonl"
    assert write_examples(path, FULL) == len(FULL)
    want = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in FULL)
    assert path.read_text(encoding="utf-8") == want  # the bytes json gives: nothing added, dropped, reordered
    rows = read_example_rows(path, TEXTS)
    assert [line for line, _ in rows] == [1, 2] and [r for _, r in rows] == FULL
    for r, f in zip(rows, FULL):  # types too (an int score stays an int, null stays null)
        assert json.dumps(r[1]) == json.dumps(f)
    again = tmp_path / "again.jsonl"
    write_examples(again, [r for _, r in rows])
    assert again.read_bytes() == path.read_bytes()


def test_the_score_stage_keeps_every_field_it_does_not_write(tmp_path):
    """stage score writes each input row again plus its teacher fields: the rest is untouched."""
    folder = _folder(tmp_path, [json.dumps(r, ensure_ascii=False) for r in FULL])
    rows = score.read_training(folder / "examples.jsonl", TEXTS)
    assert rows == FULL


def test_training_groups_read_pool_rule_and_teacher_scores(tmp_path):
    folder = _folder(tmp_path, [json.dumps(r, ensure_ascii=False) for r in FULL])
    data = TrainingGroups(folder / "texts.jsonl", folder / "examples.jsonl", group_size=2)
    got = [(e["query_id"], e["pos_ids"], e["neg_ids"], e["pool"], e["rule"], e["teacher"], e["line"])
           for e in data.examples]
    assert got == [("q1", ["p1"], ["n1", "n2"], "answers", "qa", ([2.5], [1.0, -0.5]), 1),
                   ("q2", ["p2", "p1"], [], None, None, ([0.0, -3.5], []), 2)]


def test_the_writer_refuses_what_the_reader_would(tmp_path):
    from care.data.examples import write_examples

    path = tmp_path / "train.jsonl"
    with pytest.raises(DataError) as err:
        write_examples(path, [GOOD, {**GOOD, "neg_scores": [0.1]}])
    assert (err.value.path, err.value.line, err.value.field) == (str(path), 2, "neg_scores")
    with pytest.raises(DataError, match="teacher scores on some lines only"):
        write_examples(path, [GOOD, {**GOOD, **TEACHER}])
    assert not path.exists()


# ---- no other parser of the file -----------------------------------------------------------------------------

ID_FIELDS = {"pos_ids", "neg_ids"}
# Fields of the import stage's files that also carry a query_id (candidates.jsonl, pairs.jsonl): a loop that
# reads one of them reads another format.
OTHER_FORMATS = {"candidates", "source", "split", "text1_id", "text2_id"}
LINE_READERS = {"read_jsonl", "read_jsonl_numbered", "loads", "load_rows", "rows"}


def _callee(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return None


def _examples_fields(keys: set) -> bool:
    return bool(keys & ID_FIELDS) or ("query_id" in keys and not keys & OTHER_FORMATS)


def _keys_read(body: list[ast.AST], rows: set[str]) -> set:
    """The constant keys the loop body reads from its row variables (row["k"], row.get("k"))."""
    keys = set()
    for b in body:
        for sub in ast.walk(b):
            if isinstance(sub, ast.Subscript):
                key, owner = sub.slice, sub.value
            elif _callee(sub) == "get" and sub.args and isinstance(sub.func, ast.Attribute):
                key, owner = sub.args[0], sub.func.value
            else:
                continue
            if isinstance(key, ast.Constant) and isinstance(owner, ast.Name) and owner.id in rows:
                keys.add(key.value)
    return keys


def _parses_examples(tree: ast.AST) -> list[int]:
    """Lines of loops (statements and comprehensions) over a JSON Lines reader whose rows are read by the
    examples file's id fields (row["pos_ids"], row.get("query_id")), or of a reader told to require them."""
    hits = []
    for node in ast.walk(tree):
        if _callee(node) in LINE_READERS:
            names = {c.value for a in node.args[1:] + [k.value for k in node.keywords]
                     for c in ast.walk(a) if isinstance(c, ast.Constant)}
            if _examples_fields(names):
                hits.append(node.lineno)
        loops = ([(node.target, node.iter, node.body)] if isinstance(node, ast.For) else
                 [(g.target, g.iter, [node]) for g in node.generators]
                 if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)) else [])
        for target, it, body in loops:
            rows = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            if _callee(it) in LINE_READERS and _examples_fields(_keys_read(body, rows)):
                hits.append(node.lineno)
    return sorted(set(hits))


def test_no_module_parses_examples_rows_itself():
    files = [p for d in ("care", "data_pipeline", "bench") for p in (ROOT / d).rglob("*.py")]
    files += [ROOT / f for f in ("train.py", "evaluate.py", "encode.py")]
    found = {str(p.relative_to(ROOT)): lines for p in files
             if p != ROOT / "care" / "data" / "examples.py"
             and (lines := _parses_examples(ast.parse(p.read_text(encoding="utf-8"))))}
    assert not found, f"parse the training-examples file with care.data.examples.read_example_rows: {found}"


def test_the_grep_finds_a_parser():
    """The check above is not vacuous: the readers it replaced are found."""
    old = '''
def read_training(path, texts):
    for line, row in read_jsonl_numbered(path, ("query_id", "pos_ids", "neg_ids")):
        pass
def rows(path):
    return [r["pos_ids"] for _, r in read_jsonl_numbered(path)]
def plain(path):
    for row in read_jsonl(path):
        if row.get("query_id") in seen:
            pass
def candidates(path):
    for row in read_jsonl(path):
        print(row["query_id"], row["candidates"])
'''
    assert _parses_examples(ast.parse(old)) == [3, 6, 8]
