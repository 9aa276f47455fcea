"""Training (docs/design.md, "Layers"): losses, exact GradCache, cross-process gathering, and the trainer loop.

Kept import-free so `import care.training.losses` does not pull in accelerate or the trainer.
"""
