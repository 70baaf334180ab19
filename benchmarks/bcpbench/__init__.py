"""Helpers of the side-by-side benchmark (``benchmarks/run.py``): the state under test, the
checkpointers compared, the disk's own floors, the worker processes and the report."""
