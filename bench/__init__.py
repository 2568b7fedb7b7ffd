"""Benchmarks: ``python -m bench.<name>``. Each compares against a baseline measured in the same run and
writes JSON (hardware, versions, shapes, results) to ``bench/results/``."""
