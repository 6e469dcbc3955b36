"""Contributor tools for the Hopper kernels (profiling helpers), run with
``python -m tools.<name>``."""
