"""Benchmarks of vllm-snapmla; run each from the repository root: python -m benchmarks.<name>."""
