"""The shim's frozen engine config and the seed's deployment-wide refusal computed from it."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from pathlib import Path

from dspark_sidecar import layout

REQUIRED_METHOD = "dspark"
TRANSPORTS = ("grpc", "doorbell")


class EngineConfigError(ValueError):
    """An EngineConfig field is invalid; the message names the field."""


def _seconds(v: object) -> bool:
    """Whether `v` is a usable wait: a number (not a bool) above 0 and at most 3600 s. A string raised
    TypeError from the comparison, a traceback naming no field; True passed as a 1 s wait."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < v <= 3600


@dataclass(frozen=True)
class BreakerConfig:
    """When to stop calling a failing sidecar rank and how fast to try again (seconds)."""

    failure_threshold: int = 3  # consecutive failed calls that open the breaker
    backoff_initial_s: float = 0.05  # first wait before a health probe
    backoff_max_s: float = 2.0  # the wait doubles per failed probe up to this
    probe_deadline_s: float = 0.25  # deadline of one grpc.health.v1 Check

    def __post_init__(self) -> None:
        v = self.failure_threshold
        # A whole number, as EngineConfig's counts: `failures >= nan` (or inf) is never true, so such a threshold
        # passed a bare `< 1` and the breaker never opened, calling a dead sidecar on every step.
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise EngineConfigError(f"breaker.failure_threshold: must be >= 1 (a whole number of failures), got {v!r}")
        for f in ("backoff_initial_s", "backoff_max_s", "probe_deadline_s"):
            # Finite, as EngineConfig's deadlines: an infinite backoff never probes again, and gRPC fails a
            # call with an infinite timeout at once (DEADLINE_EXCEEDED): a recovered sidecar unused for good.
            if not _seconds(getattr(self, f)):
                raise EngineConfigError(f"breaker.{f}: must be above 0 and at most 3600 s, got {getattr(self, f)!r}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise EngineConfigError("breaker.backoff_max_s: must be >= backoff_initial_s")


@dataclass(frozen=True)
class EngineConfig:
    """What the shim knows of its engine rank's deployment, plus how to reach and wait for its sidecar rank."""

    tp_size: int
    dp_size: int = 1
    pp_size: int = 1
    speculative_method: str = REQUIRED_METHOD
    num_speculative_tokens: int = layout.QPR
    required_tp: int = 4
    # Sidecar rank r's gRPC target for THIS engine rank, e.g. "unix:/run/dspark-sidecar/rank0.sock".
    endpoint: str = ""
    device: str = "cpu"
    # Largest R forwarded until the sidecar's GetStatus limit is known (then the agreed limit).
    max_reqs: int = layout.DEFAULT_MAX_REQS
    # Deadlines (seconds). A step's deadline must exceed the sidecar's rendezvous deadline plus
    # its compute time, or every step that needs an abort would be reported as a timeout.
    step_deadline_s: float = 2.0
    # After a step's deadline the shim still waits this long for the late answer: until it comes,
    # the sidecar may still be writing that step's K/V into the engine's cache.
    late_grace_s: float = 2.0
    connect_deadline_s: float = 1.0  # first GetStatus on a fresh channel
    bind_deadline_s: float = 5.0
    # Largest number of BindKV calls one step may spend bringing this rank's binding generation
    # up to its peers' (see binding.py).
    max_catchup_binds: int = 8
    # "grpc": tensors inline on the long-lived DraftSteps stream (portable). "doorbell": registered
    # buffers + the shared-memory doorbell (client/dataplane.py); falls back to "grpc" when the
    # sidecar cannot attach it.
    transport: str = "grpc"
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def __post_init__(self) -> None:
        for f in ("tp_size", "dp_size", "pp_size", "required_tp", "max_catchup_binds", "max_reqs"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise EngineConfigError(f"{f}: must be a positive integer, got {v!r}")
        if not isinstance(self.breaker, BreakerConfig):  # read by agreement_timeout_s and the breaker itself
            raise EngineConfigError(f"breaker: must be a BreakerConfig, got {self.breaker!r}")
        if not isinstance(self.endpoint, str):
            raise EngineConfigError(f"endpoint: must be a gRPC target string, got {self.endpoint!r}")
        if self.endpoint.startswith("unix:") and (why := layout.socket_path_problem(self.endpoint[len("unix:"):])):
            # gRPC's own answer to such a target is a connect that fails "UNKNOWN" at every step, and the shim
            # falls back for good with nothing saying why (serve refuses the same folder at its start).
            raise EngineConfigError(f"endpoint {self.endpoint!r}: {why}")
        if self.transport not in TRANSPORTS:
            raise EngineConfigError(f"transport: one of {TRANSPORTS}, got {self.transport!r}")
        if not 1 <= self.max_reqs <= layout.MAX_REQS_LIMIT:
            raise EngineConfigError(f"max_reqs: must be 1..{layout.MAX_REQS_LIMIT}, got {self.max_reqs}")
        for f in ("step_deadline_s", "late_grace_s", "connect_deadline_s", "bind_deadline_s"):
            if not _seconds(getattr(self, f)):  # finite: every wait of the shim is bounded by these
                raise EngineConfigError(f"{f}: must be above 0 and at most 3600 s, got {getattr(self, f)!r}")
        if self.step_deadline_s < 0.001:
            # DraftStepRequest.deadline_ms is whole milliseconds, and 0 there is the sidecar's "no deadline":
            # a shorter step deadline went out as 0, and the sidecar ran such a step with none at all.
            raise EngineConfigError(f"step_deadline_s: must be at least 0.001 s (the step's deadline_ms is whole "
                                    f"milliseconds), got {self.step_deadline_s}")

    @property
    def agreement_timeout_s(self) -> float:
        """How long a rank waits in a step agreement for its peer engine ranks before it gives them up for
        dead (AgreementTimeout). Longer than a live peer can take between two agreements, its sidecar rank
        answering every call just inside its deadline, with slack for a loaded host, and 60 s at least. Two kinds
        of interval, summed (an upper bound of either):

        - a catch-up, then the next step's readiness check: two breaker probes (a health Check and a GetStatus
          each, probe_deadline_s), the catch-up's binds (its last one failing and dropping the link: the data
          plane's UnregisterBuffers), the readiness check's reconnect (GetStatus), bind and status re-read (a
          strict refusal judged on another engine's binding), the data plane's AttachDoorbell, RegisterBuffers
          and the release after one that timed out, the step stream's opening (each of those connect_deadline_s,
          a bind bind_deadline_s), and a close() from another thread that the rank finishes as it leaves the
          link (UnbindKV). Counted as one reconnect, the binds and two registrations at the larger of
          bind_deadline_s and connect_deadline_s, a sidecar slow but answering at connect and bind deadlines of
          400 s took 1860 s (measured at a thousandth of that), past the 1670 s its peers waited: AgreementTimeout
          turned a healthy rank off.
        - a step: its deadline and late grace, the drop of a broken link (UnregisterBuffers), and a close()
          from another thread waiting out the late grace once more.

        With the doorbell transport each close of its page waits up to the data plane's CLOSE_WAIT_S for the
        engine's stream (three in the two intervals). A fixed 60 s was shorter than a step a
        DSPARK_STEP_DEADLINE_MS of 60000 or more allows; uncounted, the probes did the same from a
        probe_deadline_s of about 15 s up (BreakerConfig allows 3600)."""
        c, b, p = self.connect_deadline_s, self.bind_deadline_s, self.breaker.probe_deadline_s
        readiness = 4 * p + (self.max_catchup_binds + 1) * b + 8 * c
        step = self.step_deadline_s + 2 * self.late_grace_s + c
        live = readiness + step
        if self.transport == "doorbell":
            from dspark_sidecar.client.dataplane import CLOSE_WAIT_S  # torch's: imported only where it counts
            live += 3 * CLOSE_WAIT_S
        return max(60.0, live + 10.0)


def rank_endpoint(socket_dir: str | Path, rank: int) -> str:
    """Sidecar rank r's unix-socket target, as `dspark-sidecar serve --socket-dir DIR` lays them out."""
    return f"unix:{layout.rank_socket(socket_dir, rank)}"


def config_refusal(cfg: EngineConfig) -> str | None:
    """Why this engine deployment can never forward (the seed's engine-side checks, its words), or None.

    The hardware checks of the seed (gfx950, FlyDSL) are the sidecar's business: it serves
    through a portable backend where FlyDSL refuses, and says so in GetStatus.
    """
    checks = (
        (cfg.tp_size == cfg.required_tp, f"TP {cfg.tp_size} != {cfg.required_tp}"),
        (cfg.dp_size == 1, "DP > 1"),
        (cfg.pp_size == 1, "PP > 1"),
        (cfg.speculative_method == REQUIRED_METHOD, "no DSpark draft"),
        (cfg.num_speculative_tokens == layout.QPR, f"{layout.QPR} speculative tokens required"),
        (bool(cfg.endpoint), "no sidecar endpoint configured"),
    )
    for ok, why in checks:
        if not ok:
            return why
    return None
