"""A vLLM-shaped forward context for the harness: the attention metadata of the step being run."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


@dataclass
class ForwardContext:
    """What the engine sets around one model forward (vLLM's ForwardContext, reduced to what the shim reads).

    attn_metadata is None for profiling / dummy runs (vLLM's convention), else the step's metadata.
    """

    attn_metadata: Any
    extra: dict[str, Any] = field(default_factory=dict)


# Thread-local like the engine's own: each engine rank process runs one model forward at a time,
# but tests drive several fake ranks as threads of one process.
_state = threading.local()


def is_forward_context_available() -> bool:
    return getattr(_state, "ctx", None) is not None


def get_forward_context() -> ForwardContext:
    ctx = getattr(_state, "ctx", None)
    if ctx is None:
        raise RuntimeError("no forward context is set (call inside set_forward_context)")
    return ctx


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any, **extra: Any) -> Iterator[ForwardContext]:
    """Make `attn_metadata` the current step's metadata for the duration of the block (nests)."""
    prev = getattr(_state, "ctx", None)
    ctx = ForwardContext(attn_metadata, dict(extra))
    _state.ctx = ctx
    try:
        yield ctx
    finally:
        _state.ctx = prev


@dataclass(frozen=True)
class ForwardContextSource:
    """How the shim reads an engine's forward context: this module's, or vLLM's (see vllm_plugin)."""

    available: Callable[[], bool]
    get: Callable[[], Any]  # -> object with .attn_metadata

    def attn_metadata(self) -> Any:
        # None (a step the shim falls back on) where the context has none: another engine version's context raised
        # AttributeError out of the shim's phase 1 into the engine's forward
        return getattr(self.get(), "attn_metadata", None)


LOCAL_SOURCE = ForwardContextSource(is_forward_context_available, get_forward_context)
