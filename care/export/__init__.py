"""Exporting trained models: the model card (README.md) every training run's final/ gets, generated from
its care_training.json, the data pipeline's stats and evaluate.py's summary.json (care.export.card, which
assembles it from care.export.provenance and care.export.card_sections), and the sentence-transformers
files of a model folder (care.encoders.st_folder).

Layering: this package sits above care.models / care.encoders / care.data and below care.training and
the apps (train.py, evaluate.py), which call it; it imports neither care.training nor care.evaluation."""
