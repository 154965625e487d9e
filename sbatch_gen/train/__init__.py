"""The companion trainer the rendered scripts launch: ``python -m sbatch_gen.train``.

Importing this package does not import torch (the stop-file fast exit runs before it).
"""
