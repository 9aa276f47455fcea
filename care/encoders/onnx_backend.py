"""The ONNX Runtime forward pass shared by the encoders that offer an `onnx` backend: the dense encoder
(care/encoders/dense.py: `onnx`, `onnx_int8`), an M3 encoder's backbone (care/encoders/m3.py) and a CARE
query tower (care/encoders/care.py: `onnx`).

Only the backbone runs in ONNX Runtime: `model(**batch).last_hidden_state`.  Tokenisation, pooling,
normalisation, M3's heads and any Matryoshka cut stay the encoder's own torch code, so the two backends
differ in the network's arithmetic alone (fp32: vectors within ~1e-6) and never in how a vector is made from
it (last-token pooling, care/models/pooling.py, branches on the mask, which a traced graph would freeze).

An export is made once per model folder: `<cache root>/onnx/<key>/model.onnx`, the key a digest of the
folder's weights (care.models.hub.weights_digest) and of everything the export depends on (EXPORT_SETTINGS,
int8, the input names, the torch and transformers versions).  It is written whole (care.data.io.atomic_folder)
under a lock (filelock), so processes loading the same model at once export it once; a later load reads the
file (seconds) instead of exporting again (10-20 s for me5_small).  `EXPORTS` counts this process's exports.

The folder is not trusted because it exists: beside model.onnx, `digests.json` records the size and
whole-content xxh3_128 of every file the export wrote, and every load checks them before a session is made
(`verify_export`; each file's digest memoised by its identity, care.models.hub.memoised_digest, so an unchanged
export is read once).  A file changed on disk, truncated, emptied or missing, or a folder from before digests
were recorded, is exported again with one line on stderr, instead of giving wrong vectors (a flipped weight
byte) or an `InvalidProtobuf` traceback on every later run.  The export's digest enters the encoder side's
identity (`export_identity`), so the embedding cache keys vectors by the export that made them.

Two cores run a batch faster as two one-thread halves than as one two-thread whole: ONNX Runtime's
intra-op threads split each operator and wait for each other at every one of its ~400 nodes, while two
concurrent one-thread runs never wait (measured on the evaluation's documents, 2 cores: 2,240 tokens/s one run
at 2 threads, 2 x 1,450 at 1 thread, 1.3x; docs/results.md "Where make run's time goes").  So an fp32 model
has ONE session, with one intra-op thread, and a batch of 2 rows or more is cut into up to `workers` (torch's
thread count) row slices run at once in it, each from its own Python thread (a session's `run` is
thread-safe and releases the GIL); one row runs alone, on one thread, which at batch 1 is also the faster
(docs/care.md, "Query latency").  One session, not a many-thread one beside a one-thread one: the second
held its own copy of the weights, +440 MB peak RSS on me5_small for nothing the first could not do
(docs/models.md, "Memory").  A row's vector does not depend on the slice it is in: every slice keeps the
batch's padded length, and a row's arithmetic is the same whichever rows run beside it and however many
threads run it (tests/test_inference_backend.py).  int8 is never sliced (its activation scale is one per
batch): its session has torch's thread count.

`resolve_backend` turns the inference backend setting `auto` into one backend, in one place
(care/encoders/registry.py build_encoder calls it for every model config built for inference).
"""
from __future__ import annotations

import errno
import itertools
import logging
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

INSTALL_HINT = "pip install onnxruntime==1.32.0 onnx==1.23.2"
#: what an export depends on besides the weights: a change here makes a new cached export
EXPORT_SETTINGS = {"exporter": "torchscript", "opset": 17, "output": "last_hidden_state", "axes": "batch,tokens"}
ONNX_FOLDER = "onnx"  # under the cache root (care.paths.cache_dir)
DIGESTS = "digests.json"  # beside model.onnx: every exported file's size and xxh3_128 (verify_export)
ONNX_BACKENDS = ("onnx", "onnx_int8")
EXPORTS = 0  # exports made by this process (tests: a second load of a model exports nothing)
_SAID: set[str] = set()  # lines said once per process (resolve_backend's fallback)


def missing_packages() -> list[str]:
    """Of onnxruntime (runs an export) and onnx (torch's exporter writes with it), those that cannot be
    imported here."""
    missing = []
    for name in ("onnxruntime", "onnx"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def onnx_available() -> bool:
    """Whether the fp32 ONNX backend can run here: onnxruntime to run it, onnx for torch's exporter."""
    return not missing_packages()


def require_onnx(what: str) -> None:
    """MissingPackage (one line at the app's edge, care/errors.py) when `what` (a backend setting) cannot run
    here for want of onnxruntime or onnx."""
    from care.errors import MissingPackage

    if missing := missing_packages():
        raise MissingPackage(f"{what} needs {' and '.join(missing)}, which cannot be imported here: install "
                             f"{'it' if len(missing) == 1 else 'them'} ({INSTALL_HINT}) or use backend=torch")


def resolve_backend(requested: str, device: str | None, supported: bool = True) -> str:
    """The backend that runs an inference forward pass: `auto` is ONNX Runtime fp32 (`onnx`) on the CPU when
    onnxruntime and onnx import and the model supports it, else torch (a GPU, or no onnxruntime: said once
    per process on stderr, with how to install it); any other value is kept, an ONNX one refused in one line
    when onnxruntime or onnx is missing.  Training never comes here: its encoders are built with torch
    (care/training)."""
    if requested in ONNX_BACKENDS:
        require_onnx(f"backend={requested}")
    if requested != "auto":
        return requested
    on_cpu = device in (None, "auto") and not torch.cuda.is_available() or str(device).startswith("cpu")
    if not (supported and on_cpu):
        return "torch"
    if missing := missing_packages():
        line = (f"backend auto: running torch, not ONNX Runtime: {' and '.join(missing)} cannot be imported "
                f"({INSTALL_HINT} for the faster CPU path, or backend=torch to say so)")
        if line not in _SAID:
            _SAID.add(line)
            print(line, file=sys.stderr, flush=True)
        return "torch"
    return "onnx"


def padded_example(tokenize: Callable[[list[str]], dict]) -> dict[str, torch.Tensor]:
    """A batch to trace the export with: two texts of different lengths, so it holds padding (with none,
    transformers would trace the attention mask away and every padded batch would be wrong)."""
    return dict(tokenize(["a", "a " * 8]))


def export_key(weights: str, model: torch.nn.Module, names: list[str], int8: bool) -> str:
    import transformers

    from care.data.io import json_digest

    key = {**EXPORT_SETTINGS, "weights": weights, "class": type(model).__name__, "inputs": names, "int8": int8,
           "torch": torch.__version__, "transformers": transformers.__version__}
    return json_digest(key, 24, sort_keys=True)


def record_export(folder: Path) -> str:
    """Write `folder`/digests.json: the size and whole-content xxh3_128 of every file the export wrote (before
    the folder is published); the export's digest."""
    from care.data.io import file_digest, write_json

    files = {f.name: {"size": f.stat().st_size, "xxh3_128": file_digest(f, "xxh3_128", chars=None)}
             for f in sorted(folder.iterdir()) if f.is_file() and f.name != DIGESTS}
    write_json(folder / DIGESTS, {"files": files})
    return _digest_of(files)


def _digest_of(files: dict) -> str:
    from care.data.io import json_digest

    return json_digest(files, 16, sort_keys=True)


def verify_export(folder: Path) -> tuple[str | None, str]:
    """(the export's digest, "") when every file digests.json records is in `folder` with its size and
    xxh3_128 (each memoised by the file's identity: an unchanged export is read once), else (None, what is
    wrong): "missing" when there is no export yet."""
    from care.data.io import read_json
    from care.models.hub import memoised_digest

    if not (folder / "model.onnx").is_file():
        return None, "missing"
    try:
        files = read_json(folder / DIGESTS)["files"]
        recorded = {name: (int(f["size"]), str(f["xxh3_128"])) for name, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, f"has no readable {DIGESTS} (an export made before its files' digests were recorded, or torn)"
    if "model.onnx" not in recorded:
        return None, f"has a {DIGESTS} that does not record model.onnx"
    for name, (size, digest) in sorted(recorded.items()):
        f = folder / name
        if not f.is_file():
            return None, f"lacks {name}"
        if (now := f.stat().st_size) != size:
            return None, f"{name} is {now:,} bytes, {size:,} when it was exported (truncated or changed)"
        if memoised_digest(f) != digest:
            return None, f"{name} does not match the digest recorded when it was exported (changed on disk)"
    return _digest_of(files), ""


def export_identity(forward: OnnxForward | None) -> dict:
    """What an encoder side's identity adds for its ONNX forward pass: the digest of the export it runs, so the
    embedding cache keys vectors by the export that made them (nothing for a torch side)."""
    return {} if forward is None else {"export": forward.digest}


class OnnxForward:
    """`model(**batch).last_hidden_state` of a Hugging Face encoder, by ONNX Runtime: the model is exported
    (torch.onnx, the TorchScript exporter, dynamic batch and sequence axes), optionally quantised to int8
    (onnxruntime.quantization.quantize_dynamic, per-channel weights), and loaded into a session with as many
    intra-op threads as torch uses when it is built (int8), or one and the batch cut into that many slices
    run at once (fp32, module docstring).  `weights` (the folder's weights_digest): the export is
    cached under the cache root (module docstring); None: exported to a temporary folder, removed once loaded
    (a session holds its graph in memory)."""

    def __init__(self, model: torch.nn.Module, example: dict[str, torch.Tensor], int8: bool = False,
                 what: str = "the onnx / onnx_int8 backends", weights: str | None = None):
        self.digest = ""  # the export's (export_identity), set once it is verified or made
        require_onnx(what)  # before any export: one line saying how to install it
        self.names = list(example)
        # int8 batches are never sliced (module docstring): one thread a slice, as many slices as torch has threads
        self.workers = 1 if int8 else max(1, torch.get_num_threads())
        self.threads = torch.get_num_threads() if int8 else 1  # the session's intra-op threads
        if weights is None:
            with tempfile.TemporaryDirectory() as tmp:
                self.digest = self._build(model, example, int8, Path(tmp))
                self._load(Path(tmp) / "model.onnx")
            return
        self.path = self.cached(model, example, int8, weights)
        self._load(self.path)

    def _load(self, path: Path) -> None:
        """The one session every batch and slice runs in, read from `path` now (a temporary export is removed
        once loaded)."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self._pool = None

    def cached(self, model: torch.nn.Module, example: dict[str, torch.Tensor], int8: bool, weights: str) -> Path:
        """The cached export's model.onnx, verified against the digests recorded when it was written
        (verify_export); made first when missing, made again (one line) when it fails them: once, whatever
        number of processes ask."""
        from filelock import FileLock

        from care.data.io import atomic_folder
        from care.errors import is_full_disk
        from care.paths import cache_dir

        folder = cache_dir() / ONNX_FOLDER / export_key(weights, model, self.names, int8)
        digest, problem = verify_export(folder)
        if digest is None:
            folder.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(folder) + ".lock"):
                # another process may have made (or remade) it while this one waited
                digest, problem = verify_export(folder)
                if digest is None:
                    if problem != "missing":
                        print(f"ONNX export {folder} {problem}: exporting it again", file=sys.stderr, flush=True)
                    try:
                        with atomic_folder(folder) as tmp:
                            digest = self._build(model, example, int8, tmp)
                    except Exception as e:
                        if is_full_disk(e):  # torch's writer names no file: say the export's, not the app's disk
                            raise OSError(errno.ENOSPC, "No space left on device", str(folder)) from e
                        raise
        self.digest = digest
        return folder / "model.onnx"

    def _build(self, model: torch.nn.Module, example: dict[str, torch.Tensor], int8: bool, tmp: Path) -> str:
        """The export written to `tmp`/model.onnx with its digests.json (record_export); its digest."""
        path = tmp / "model.fp32.onnx"
        self._export(model, example, path)
        if int8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantized = tmp / "model.int8.onnx"
            previous = logging.root.manager.disable
            logging.disable(logging.WARNING)  # one INFO line per tensor, and advice, to the root logger
            try:
                quantize_dynamic(path, quantized, weight_type=QuantType.QInt8, per_channel=True)
            finally:
                logging.disable(previous)
            path.unlink()
            path = quantized
        path.rename(tmp / "model.onnx")
        return record_export(tmp)

    def _export(self, model: torch.nn.Module, example: dict[str, torch.Tensor], path: Path) -> None:
        global EXPORTS
        names = self.names

        class LastHidden(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, *inputs):
                return self.model(**dict(zip(names, inputs))).last_hidden_state

        axes = {n: {0: "batch", 1: "tokens"} for n in [*names, "last_hidden_state"]}
        with warnings.catch_warnings(), torch.no_grad():  # the TorchScript exporter warns of its deprecation
            warnings.simplefilter("ignore")
            torch.onnx.export(LastHidden().eval(), tuple(example[n] for n in names), str(path), input_names=names,
                              output_names=["last_hidden_state"], dynamic_axes=axes,
                              opset_version=EXPORT_SETTINGS["opset"], dynamo=False)
        EXPORTS += 1

    def __call__(self, **batch: torch.Tensor) -> torch.Tensor:
        feed = {n: batch[n].cpu().numpy() for n in self.names}
        cuts = min(self.workers, len(feed[self.names[0]]))
        if cuts < 2:
            return torch.from_numpy(self.session.run(None, feed)[0])
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="onnx-slice")
        bounds = np.linspace(0, len(feed[self.names[0]]), cuts + 1).astype(int)
        slices = [{n: v[a:b] for n, v in feed.items()} for a, b in itertools.pairwise(bounds)]
        parts = self._pool.map(lambda f: self.session.run(None, f)[0], slices)
        return torch.from_numpy(np.concatenate(list(parts)))
