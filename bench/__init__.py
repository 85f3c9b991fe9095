"""Benchmarks (docs/BENCHMARKS.md): each reports ratios against a baseline measured in the same run.

Each module is runnable (``python -m bench.<name>``), writes its JSON to
``bench/results/`` (git-ignored), and the figures worth keeping go to
``docs/BENCHMARKS.md``. ``fast_upstream``, ``passthrough``, ``serving`` and
``load`` are the servers and load generators the overhead benchmark runs.
"""
