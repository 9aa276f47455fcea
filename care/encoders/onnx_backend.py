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

Two cores run a batch faster as two one-thread halves than as one two-thread whole: ONNX Runtime's
intra-op threads split each operator and wait for each other at every one of its ~400 nodes, while two
concurrent one-thread runs never wait (measured on the evaluation's documents, 2 cores: 2,240 tokens/s one run
at 2 threads, 2 x 1,450 at 1 thread, 1.3x; docs/results.md "Where make run's time goes").  So an fp32 batch
of at least 2 rows a worker is cut into `workers` (torch's thread count) row slices run at once, each by a
one-thread session in its own Python thread (onnxruntime releases the GIL in `run`); a smaller batch (a
query's latency) runs whole in the many-thread session.  A row's vector does not depend on the slice it is
in: every slice keeps the batch's padded length, and a row's arithmetic is the same whichever rows run beside
it (tests/test_inference_backend.py).  int8 is never sliced: its activation scale is one per batch.

`resolve_backend` turns the inference backend setting `auto` into one backend, in one place
(care/encoders/registry.py build_encoder calls it for every model config built for inference).
"""
from __future__ import annotations

import itertools
import logging
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
EXPORTS = 0  # exports made by this process (tests: a second load of a model exports nothing)


def onnx_available() -> bool:
    """Whether the fp32 ONNX backend can run here: onnxruntime to run it, onnx for torch's exporter."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(requested: str, device: str | None, supported: bool = True) -> str:
    """The backend that runs an inference forward pass: `auto` is ONNX Runtime fp32 (`onnx`) on the CPU when
    onnxruntime and onnx import and the model supports it, else torch (a GPU, or no onnxruntime); any other
    value is kept.  Training never comes here: its encoders are built with torch (care/training)."""
    if requested != "auto":
        return requested
    on_cpu = device in (None, "auto") and not torch.cuda.is_available() or str(device).startswith("cpu")
    return "onnx" if supported and on_cpu and onnx_available() else "torch"


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


class OnnxForward:
    """`model(**batch).last_hidden_state` of a Hugging Face encoder, by ONNX Runtime: the model is exported
    (torch.onnx, the TorchScript exporter, dynamic batch and sequence axes), optionally quantised to int8
    (onnxruntime.quantization.quantize_dynamic, per-channel weights), and loaded into a session with as many
    intra-op threads as torch uses when it is built.  `weights` (the folder's weights_digest): the export is
    cached under the cache root (module docstring); None: exported to a temporary folder, removed once loaded
    (a session holds its graph in memory)."""

    def __init__(self, model: torch.nn.Module, example: dict[str, torch.Tensor], int8: bool = False,
                 what: str = "the onnx / onnx_int8 backends", weights: str | None = None):
        try:
            import onnxruntime  # noqa: F401  (loaded in _load; imported here to say what is missing)
        except ImportError as e:
            raise ImportError(f"{what} need onnxruntime and onnx ({INSTALL_HINT})") from e
        self.names = list(example)
        # int8 batches are never sliced (module docstring): one thread a slice, the threads torch has
        self.workers = 1 if int8 else max(1, torch.get_num_threads())
        if weights is None:
            with tempfile.TemporaryDirectory() as tmp:
                path = self._build(model, example, int8, Path(tmp))
                self._load(path)
            return
        self.path = self.cached(model, example, int8, weights)
        self._load(self.path)

    def _load(self, path: Path) -> None:
        """The many-thread session (a small batch, a query's latency) and, with more than one worker, the
        one-thread session every slice of a large batch runs in, both read from `path` now (a temporary
        export is removed once loaded)."""
        import onnxruntime as ort

        def session(threads: int):
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

        self.session = session(torch.get_num_threads())
        self.slice_session = session(1) if self.workers > 1 else None
        self._pool = None

    def cached(self, model: torch.nn.Module, example: dict[str, torch.Tensor], int8: bool, weights: str) -> Path:
        """The cached export's model.onnx, made first when missing (once, whatever number of processes ask)."""
        from filelock import FileLock

        from care.data.io import atomic_folder
        from care.paths import cache_dir

        folder = cache_dir() / ONNX_FOLDER / export_key(weights, model, self.names, int8)
        done = folder / "model.onnx"
        if not done.is_file():
            folder.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(folder) + ".lock"):
                if not done.is_file():  # another process may have made it while this one waited
                    with atomic_folder(folder) as tmp:
                        built = self._build(model, example, int8, tmp)
                        built.rename(tmp / "model.onnx")
        return done

    def _build(self, model: torch.nn.Module, example: dict[str, torch.Tensor], int8: bool, tmp: Path) -> Path:
        path = tmp / "model.fp32.onnx"
        self._export(model, example, path)
        if not int8:
            return path
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantized = tmp / "model.int8.onnx"
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)  # one INFO line per tensor, and advice, to the root logger
        try:
            quantize_dynamic(path, quantized, weight_type=QuantType.QInt8, per_channel=True)
        finally:
            logging.disable(previous)
        path.unlink()
        return quantized

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
        rows = len(feed[self.names[0]])
        if self.slice_session is None or rows < 2 * self.workers:
            return torch.from_numpy(self.session.run(None, feed)[0])
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="onnx-slice")
        bounds = np.linspace(0, rows, self.workers + 1).astype(int)
        slices = [{n: v[a:b] for n, v in feed.items()} for a, b in itertools.pairwise(bounds)]
        parts = self._pool.map(lambda f: self.slice_session.run(None, f)[0], slices)
        return torch.from_numpy(np.concatenate(list(parts)))
