"""SidecarConnection.open: a GetStatus that does not complete leaves no half-open link behind."""

from __future__ import annotations

import pytest

from dspark_sidecar.client.connection import SidecarConnection


class _Channel:
    """A channel whose GetStatus is interrupted (Ctrl-C, SystemExit) before the answer; records close()."""

    def __init__(self, raises: BaseException) -> None:
        self.raises, self.closed = raises, False

    def _call(self, *args, **kw):
        raise self.raises

    def unary_unary(self, *args, **kw):
        return self._call

    unary_stream = stream_unary = stream_stream = unary_unary

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("raises", [KeyboardInterrupt(), SystemExit(1)], ids=["ctrl_c", "exit"])
def test_an_open_interrupted_before_the_status_leaves_the_link_closed(raises):
    """Only grpc.RpcError closed the fresh channel: an interrupt in GetStatus left the stub set with no status,
    and the shim's next readiness check found the link open and went on with no StatusReport (its serving
    state, refusal and limits unread) over a channel nobody would close."""
    channels: list[_Channel] = []

    def factory(target: str, options: list) -> _Channel:
        channels.append(_Channel(raises))
        return channels[-1]

    conn = SidecarConnection("unix:/nonexistent", channel_factory=factory)  # type: ignore[arg-type]
    with pytest.raises(type(raises)):
        conn.open(1.0)
    assert not conn.is_open and conn.status is None
    assert channels[0].closed
