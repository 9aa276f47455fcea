"""The ONNX Runtime forward pass shared by the encoders that offer an `onnx` backend: the dense encoder
(care/encoders/dense.py: `onnx`, `onnx_int8`) and a CARE query tower (care/encoders/care.py: `onnx`).

Only the backbone runs in ONNX Runtime: `model(**batch).last_hidden_state`.  Tokenisation, pooling,
normalisation and any Matryoshka cut stay the encoder's own torch code, so the two backends differ in the
network's arithmetic alone (fp32: vectors within ~1e-6) and never in how a vector is made from it (last-token
pooling, care/models/pooling.py, branches on the mask, which a traced graph would freeze).
"""
from __future__ import annotations

import logging
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

INSTALL_HINT = "pip install onnxruntime==1.32.0 onnx==1.23.2"


def padded_example(tokenize: Callable[[list[str]], dict]) -> dict[str, torch.Tensor]:
    """A batch to trace the export with: two texts of different lengths, so it holds padding (with none,
    transformers would trace the attention mask away and every padded batch would be wrong)."""
    return dict(tokenize(["a", "a " * 8]))


class OnnxForward:
    """`model(**batch).last_hidden_state` of a Hugging Face encoder, by ONNX Runtime: the model is exported
    (torch.onnx, the TorchScript exporter, dynamic batch and sequence axes), optionally quantised to int8
    (onnxruntime.quantization.quantize_dynamic, per-channel weights), loaded into a session with as many
    intra-op threads as torch uses when it is built, and the files removed: a session holds its graph in
    memory."""

    def __init__(self, model: torch.nn.Module, example: dict[str, torch.Tensor], int8: bool = False,
                 what: str = "the onnx / onnx_int8 backends"):
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise ImportError(f"{what} need onnxruntime and onnx ({INSTALL_HINT})") from e
        self.names = list(example)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.onnx"
            self._export(model, example, path)
            if int8:
                from onnxruntime.quantization import QuantType, quantize_dynamic

                quantized = Path(tmp) / "model.int8.onnx"
                previous = logging.root.manager.disable
                logging.disable(logging.WARNING)  # one INFO line per tensor, and advice, to the root logger
                try:
                    quantize_dynamic(path, quantized, weight_type=QuantType.QInt8, per_channel=True)
                finally:
                    logging.disable(previous)
                path = quantized
            options = ort.SessionOptions()
            options.intra_op_num_threads = torch.get_num_threads()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def _export(self, model: torch.nn.Module, example: dict[str, torch.Tensor], path: Path) -> None:
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
                              output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17,
                              dynamo=False)

    def __call__(self, **batch: torch.Tensor) -> torch.Tensor:
        feed = {n: batch[n].cpu().numpy() for n in self.names}
        return torch.from_numpy(self.session.run(None, feed)[0])
