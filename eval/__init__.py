"""Accuracy evidence for the ``fp8_snapmla`` KV cache.

The scripts are modules of this package, run from the repository root as
``python -m eval.<script>`` (see ``eval/README.md``); code two of them need lives in
``eval.common``.
"""
