"""client/forward_context.py: the step's metadata is the innermost block's, on this thread only, while the block runs."""

from __future__ import annotations

import threading

import pytest

from dspark_sidecar.client.forward_context import (
    LOCAL_SOURCE, get_forward_context, is_forward_context_available, set_forward_context,
)


def test_a_nested_block_s_metadata_is_read_and_the_outer_one_s_comes_back_even_after_an_error():
    assert not is_forward_context_available()
    with set_forward_context("outer", phase=1) as outer:
        assert LOCAL_SOURCE.available() and LOCAL_SOURCE.attn_metadata() == "outer" and outer.extra == {"phase": 1}
        with pytest.raises(KeyError):
            with set_forward_context("inner"):
                assert get_forward_context().attn_metadata == "inner"
                raise KeyError("the forward raised")
        assert get_forward_context() is outer  # a step read after the failed one saw "inner"'s metadata
    assert not is_forward_context_available()
    with pytest.raises(RuntimeError, match="no forward context is set"):
        get_forward_context()


def test_another_thread_s_forward_is_not_this_one_s():
    """Tests run several fake engine ranks as threads of one process: each must read its own step's metadata."""
    seen: dict = {}
    inside, done = threading.Event(), threading.Event()

    def rank1():
        with set_forward_context("rank 1's"):
            inside.set()
            done.wait(10)
            seen[1] = get_forward_context().attn_metadata

    t = threading.Thread(target=rank1)
    t.start()
    assert inside.wait(10)
    with set_forward_context("rank 0's"):
        seen[0] = get_forward_context().attn_metadata
    seen["0 after"] = is_forward_context_available()
    done.set()
    t.join(10)
    assert seen == {0: "rank 0's", 1: "rank 1's", "0 after": False}, seen


def test_a_context_that_holds_no_attention_metadata_reads_as_none():
    """A forward context of another engine version without attn_metadata: read as a step with no metadata (the
    shim falls back), not an AttributeError out of the shim's phase 1 into the engine's forward."""
    from dspark_sidecar.client.forward_context import ForwardContextSource

    class OtherContext:
        no_compile_layers: dict = {}

    source = ForwardContextSource(lambda: True, OtherContext)
    assert source.attn_metadata() is None
