"""Micro-benchmarks: nccl-tests/OSU style tables, the engine modes, the cost-model fit, plots, the report."""
