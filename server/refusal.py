"""Why the FlyDSL fast path is off: the seed's deployment checks, with the engine's facts from BindKV."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from dspark_sidecar import layout

REQUIRED_TP = 4
REQUIRED_METHOD = "dspark"
# fast_path_refusal's last word before any BindKV, where every host check passed: the engine's checks wait
# for its facts. No refusal of the deployment (health and --strict-refusal leave it out: server/app.py).
AWAITING_BIND = "no engine bound yet (the DP/PP/speculative checks need BindKV)"


@dataclass(frozen=True)
class EngineFacts:
    """What the engine told us at bind time (proto EngineFacts)."""

    tp_size: int
    dp_size: int
    pp_size: int
    speculative_method: str
    num_speculative_tokens: int


@dataclass(frozen=True)
class HostFacts:
    """What the sidecar sees of its own host, probed once at start-up."""

    on_gfx950: bool
    flydsl_available: bool
    tp_size: int
    stores_in_order: bool = True  # x86-64: the shared-memory doorbell may be attached (proto/doorbell.py)


def probe_host(tp_size: int) -> HostFacts:
    from dspark_sidecar.kernels.flydsl.toolchain import flydsl_available, on_gfx950
    from dspark_sidecar.proto.doorbell import stores_in_order

    return HostFacts(on_gfx950=on_gfx950(), flydsl_available=flydsl_available(), tp_size=tp_size,
                     stores_in_order=stores_in_order())


def shared_host(facts: Sequence[HostFacts]) -> HostFacts:
    """The TP group's host facts from every rank's own (in rank order): a check passes only where it passes on
    every rank. on_gfx950 asks the rank's own GPU (another model on a mixed host), and the backend chosen from
    it must be the same on every rank: the FlyDSL path is built collectively and exchanges between the ranks'
    kernels."""
    return replace(facts[0], on_gfx950=all(f.on_gfx950 for f in facts),
                   flydsl_available=all(f.flydsl_available for f in facts))


def fast_path_refusal(host: HostFacts, engine: EngineFacts | None) -> str | None:
    """The first failing check in the seed's order (its exact words), or None when FlyDSL may serve.

    Before any bind the engine-side checks use the sidecar's own TP and wait for the rest.
    """
    tp = engine.tp_size if engine is not None else host.tp_size
    checks = [
        (host.on_gfx950, "not gfx950"),
        (host.flydsl_available, "FlyDSL not installed"),
        (tp == REQUIRED_TP, f"TP {tp} != {REQUIRED_TP}"),
    ]
    if engine is None:
        checks.append((False, AWAITING_BIND))
    else:
        checks += [
            (engine.dp_size == 1, "DP > 1"),
            (engine.pp_size == 1, "PP > 1"),
            (engine.speculative_method == REQUIRED_METHOD, "no DSpark draft"),
            (engine.num_speculative_tokens == layout.QPR, f"{layout.QPR} speculative tokens required"),
        ]
    for ok, why in checks:
        if not ok:
            return why
    return None
