"""What every patch shares: the dtype name, the marker that makes patches idempotent."""

from __future__ import annotations

import typing

from vllm_snapmla import format as fmt

KV_CACHE_DTYPE = fmt.KV_CACHE_DTYPE
LOGGER_NAME = "vllm.snapmla"   # inside vLLM's logger tree, so vLLM's handlers print it
# A wrapper carries the function it wraps under this attribute: a second apply is a no-op.
_WRAPPED = "__snapmla_wrapped__"


def is_ours(fn) -> bool:
    return getattr(fn, _WRAPPED, None) is not None


def mark_wrapper(wrapper, original) -> None:
    setattr(wrapper, _WRAPPED, original)


def literal_options(tp) -> tuple:
    """The strings of a ``Literal[...]``, also inside ``Optional``/``X | None``."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    return tuple(o for arg in typing.get_args(tp) for o in literal_options(arg))
