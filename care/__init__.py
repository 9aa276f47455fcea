"""care-medical: Chinese medical text embeddings (data pipeline, training, evaluation).

Importing the package registers the OmegaConf resolvers the `conf/` tree uses.
"""
from care.paths import register_resolvers

register_resolvers()
