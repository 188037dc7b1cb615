"""The FlyDSL host runner on CPU: lazy import, the seed's refusals, KV layout checks, stale binding, launch plan."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dspark_sidecar.kernels.flydsl import runner as rn
from dspark_sidecar.kernels.flydsl import toolchain
from dspark_sidecar.server.refusal import EngineFacts, HostFacts

PAGE = 16
GOOD_HOST = HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4)
GOOD_ENGINE = EngineFacts(tp_size=4, dp_size=1, pp_size=1, speculative_method="dspark", num_speculative_tokens=7)


def mx(n, k):
    return rn.MXLinear(torch.zeros(n, k, dtype=torch.uint8), torch.zeros(n, k // 32, dtype=torch.uint8))


def layer():
    bf = torch.bfloat16
    return rn.LayerWeights(
        qkv=mx(2304, 6144), o=mx(6144, 2048), gate_up=mx(6144, 6144), down=mx(6144, 3072),
        input_norm=torch.zeros(6144, dtype=bf), post_norm=torch.zeros(6144, dtype=bf),
        q_norm=torch.zeros(128, dtype=bf), k_norm=torch.zeros(128, dtype=bf),
    )


def kv_layers(pages=4, dtype=torch.bfloat16):
    return [torch.zeros(2, pages, PAGE, 1, 128, dtype=dtype) for _ in range(5)]


def peers():
    rx = [torch.zeros(8, 4) for _ in range(4)]
    fl = [torch.zeros(8, dtype=torch.int32) for _ in range(4)]
    return rn.PeerBuffers(rx, fl, rx[0], fl[0], torch.zeros(1, dtype=torch.int32))


def make(host=GOOD_HOST, engine=GOOD_ENGINE, kv=None, peer=True):
    return rn.DrafterRunner(
        [layer()] * 5, torch.zeros(6144, dtype=torch.bfloat16), kv if kv is not None else kv_layers(),
        peers() if peer else None, rank=0, page_size=PAGE, max_positions=64, engine=engine, host=host,
    )


def test_imports_without_flydsl():
    code = (
        "import sys; sys.modules['flydsl'] = None\n"
        "import dspark_sidecar.kernels.flydsl.runner as r\n"
        "import dspark_sidecar.kernels.flydsl.toolchain as t\n"
        "assert r.FlyDSLUnsupported and not t.flydsl_available() is None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "host, engine, reason",
    [
        (HostFacts(False, True, 4), GOOD_ENGINE, "not gfx950"),
        (HostFacts(True, False, 4), GOOD_ENGINE, "FlyDSL not installed"),
        (GOOD_HOST, EngineFacts(2, 1, 1, "dspark", 7), "TP 2 != 4"),
        (GOOD_HOST, EngineFacts(4, 2, 1, "dspark", 7), "DP > 1"),
        (GOOD_HOST, EngineFacts(4, 1, 2, "dspark", 7), "PP > 1"),
        (GOOD_HOST, EngineFacts(4, 1, 1, "eagle", 7), "no DSpark draft"),
        (GOOD_HOST, EngineFacts(4, 1, 1, "dspark", 5), "7 speculative tokens required"),
    ],
)
def test_refuses_with_the_seed_reasons(host, engine, reason):
    with pytest.raises(rn.FlyDSLUnsupported) as exc:
        make(host=host, engine=engine)
    assert str(exc.value) == reason


def test_refuses_unbindable_kv_and_missing_peers():
    with pytest.raises(rn.FlyDSLUnsupported, match="dtype"):
        make(kv=kv_layers(dtype=torch.float16))
    with pytest.raises(rn.FlyDSLUnsupported, match="page size"):
        make(kv=[torch.zeros(2, 4, 32, 1, 128, dtype=torch.bfloat16)] * 5)
    with pytest.raises(rn.FlyDSLUnsupported, match="contiguous"):
        make(kv=[torch.zeros(2, 8, PAGE, 1, 128, dtype=torch.bfloat16)[:, ::2]] * 5)
    with pytest.raises(rn.FlyDSLUnsupported, match="exchange buffers"):
        make(peer=False)


def test_host_probe_on_this_machine_refuses_not_gfx950():
    # On a CPU-only machine the first check fails, whatever else is installed.
    assert toolchain.on_gfx950() is False
    with pytest.raises(rn.FlyDSLUnsupported, match="^not gfx950$"):
        rn.DrafterRunner([layer()] * 5, torch.zeros(6144), kv_layers(), peers(), 0, PAGE, 64, GOOD_ENGINE)


def test_stale_kv_binding_detected():
    kv = kv_layers()
    r = make(kv=kv)
    assert not r.stale(kv)
    moved = list(kv)
    moved[3] = kv[3].clone()  # re-allocated: new data pointer
    assert r.stale(moved)
    grown = kv_layers(pages=8)
    assert r.stale(grown)
    r.close()


def test_launch_plan_orders_ten_exchanges():
    plan = rn.launch_plan(3)
    assert len(plan) == 5 * 10 + 1 and plan[-1] == ("final_norm", None)
    assert [x for _, x in plan if x is not None] == list(range(10))
    assert plan[:6] == [
        ("linear_qkv", None), ("qkv_rope", None), ("attention", None),
        ("attention_combine", None), ("linear_o", None), ("exchange_o", 0),
    ]
    from dspark_sidecar.kernels.flydsl.catalog import KERNELS

    assert {name for name, _ in plan} <= set(KERNELS)
    with pytest.raises(ValueError):
        rn.launch_plan(9)


def test_compile_all_compiles_what_every_launch_size_will_launch():
    """Start-up compiles (kernel, R, exchange) for R = 1..8; a later step finds all of them compiled."""
    r = make()
    compiled, launched = [], []

    def fake_kernel(name, num_reqs, exchange, args):
        key = (name, num_reqs, exchange)
        if key not in r._compiled:
            compiled.append(key)
            r._compiled[key] = lambda *a: launched.append(key)
        return r._compiled[key]

    r._kernel = fake_kernel
    count = r.compile_all()
    assert count == len(compiled) == len(set(compiled))
    assert not launched  # compiling launches nothing
    per_size = {n for n, _ in rn.launch_plan(1)} | {"final_norm"}
    assert {name for name, _, _ in compiled} == per_size
    assert {num_reqs for _, num_reqs, _ in compiled} == set(range(1, 9))
    before = len(compiled)
    n = 7 * 11  # 11 requests: launches of 8 and 3
    r.forward(torch.arange(n) + 100, torch.zeros(n, 6144, dtype=torch.bfloat16), torch.arange(n),
              torch.zeros(11, 8, dtype=torch.int32))
    assert len(compiled) == before, "a live step compiled a kernel"
    assert len(launched) == 2 * 51  # 10 kernels per layer x 5 + the final norm, per launch
