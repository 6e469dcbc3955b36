"""The vLLM side of the plugin: the attention backend, the start-up checks and the patches.

Imports run one way: ``backend`` uses ``startup_checks``, two patches (``prefill_gather``,
``context_merge_bound``) and the patches' shared ``_common``; ``patches.backend_selection``
and ``patches.rope_kvcache_fusion`` use ``startup_checks``, and ``backend_selection`` imports
``backend`` lazily, when vLLM asks it for the backend.  Everything here may import vLLM;
nothing below (``vllm_snapmla.ops``, ``kernels``, ``format``) does.
"""
