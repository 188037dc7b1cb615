"""Endpoints and who may register memory: unix sockets by default, loopback TCP as an option, same node only."""

from __future__ import annotations

import pytest

from dspark_sidecar.server.config import ServeConfig, ServeConfigError
from dspark_sidecar.server.healthcheck import check
from dspark_sidecar.server.servicer import _same_node
from helpers.sidecar_proc import SidecarProcess, free_port_block


@pytest.mark.parametrize("peer,local", [
    ("unix:/tmp/x/rank0.sock", True), ("unix:", True),
    ("ipv4:127.0.0.1:51234", True), ("ipv6:[::1]:51234", True),
    ("ipv4:10.1.2.3:51234", False), ("ipv6:[2001:db8::1]:443", False), ("dns:example.org:80", False),
])
def test_only_same_node_peers_may_register_memory(peer, local):
    assert _same_node(peer) is local


def test_tcp_off_loopback_needs_allow_remote():
    with pytest.raises(ServeConfigError, match="--tcp-host: 10.0.0.5 is not a loopback address"):
        ServeConfig(tcp_host="10.0.0.5", tcp_base_port=7000)
    assert ServeConfig(tcp_host="10.0.0.5", tcp_base_port=7000, allow_remote=True).endpoints(1)[1] == "10.0.0.5:7001"
    assert ServeConfig(tcp_host="::1", tcp_base_port=7000).endpoints(0)[1] == "[::1]:7000"  # IPv6 literal bracketed


def test_rank_serves_on_its_unix_socket_and_loopback_tcp(tmp_path, tiny_ckpt):
    port = free_port_block(2)
    with SidecarProcess(tmp_path, tp=2, checkpoint=tiny_ckpt, extra_args=["--tcp-base-port", str(port)]) as sc:
        assert sc.health() == ["SERVING", "SERVING"]
        assert [check(f"127.0.0.1:{port + r}") for r in range(2)] == ["SERVING", "SERVING"]
