"""Benchmarks for sbatch-gen: ``python -m bench [NAME ...] [--quick]`` (``make bench`` runs them all).

Every number is a ratio of two things measured side by side in the same run on the same machine
(this machine is shared and noisy; absolute times are reported for context only). Results go to
``bench/results/<name>.md`` (+ ``.json`` with the raw numbers, + ``.png`` plots).
"""
