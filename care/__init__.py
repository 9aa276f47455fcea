"""care-medical: Chinese medical text embeddings (data pipeline, training, evaluation).

Importing the package registers the OmegaConf resolvers the `conf/` tree uses, and turns off ONNX Runtime's
telemetry for this process and the processes it starts (README "Where outputs and caches go").
"""
import os

# onnxruntime's 1DS telemetry writes a device id to $XDG_CACHE_HOME or ~/.cache/Microsoft/DeveloperTools/
# .onnxruntime when the library is first imported, unless ORT_DISABLE_TELEMETRY=1 (its documented switch) or
# a CI variable (CI=true, GITHUB_ACTIONS, ...) is set: every app imports this package before onnxruntime, so
# the project writes nothing under a user's home.  A value the user set is kept.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from care.paths import register_resolvers

register_resolvers()
