"""Measurements of this machine: the code behind ``scripts/benchmark.py`` and the
calibration of ``parallel.plan``."""
