"""The vLLM side of the plugin: the attention backend, the start-up checks and the patches.

Imports run one way: ``backend`` uses ``startup_checks`` and two patches
(``prefill_gather``, ``context_merge_bound``); ``patches.backend_selection`` uses
``startup_checks`` and, lazily, ``backend``.  Everything here may import vLLM; nothing below
(``vllm_snapmla.ops``, ``kernels``, ``format``) does.
"""
