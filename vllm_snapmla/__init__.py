"""SnapMLA for vLLM: the ``fp8_snapmla`` KV-cache dtype for MLA models.

vLLM loads ``register`` (entry point ``vllm.general_plugins: snapmla``) in every process it
starts; after that ``--kv-cache-dtype fp8_snapmla`` is accepted and served by
``vllm_snapmla.integration.backend.SnapMLABackend``.  Importing this package does not import vLLM.
"""

__version__ = "0.1.0"

SUPPORTED_VLLM_VERSION = "0.26.0"

_registered = False


def register() -> None:
    """Patch vLLM for ``fp8_snapmla``; idempotent and does not initialise CUDA."""
    global _registered
    if _registered:
        return
    import vllm

    # A local build tag (0.26.0+cu130, a vendor's rebuild) is the same vLLM source.
    if vllm.__version__.split("+")[0] != SUPPORTED_VLLM_VERSION:
        raise RuntimeError(
            f"vllm-snapmla {__version__} patches private internals of vLLM "
            f"{SUPPORTED_VLLM_VERSION}, but vLLM {vllm.__version__} is installed. Install "
            f"vllm=={SUPPORTED_VLLM_VERSION}, or a vllm-snapmla release made for vLLM "
            f"{vllm.__version__}.")
    from vllm_snapmla.integration import patches

    patches.apply_all()
    _registered = True
