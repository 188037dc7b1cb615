"""The sidecar's frozen, validated serve config: built once from flags/env (cli.py) and passed down."""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from dspark_sidecar import layout

BACKENDS = ("auto", "reference", "triton", "flydsl")
GPU_ONLY_BACKENDS = ("triton", "flydsl")  # their kernels run on the rank's GPU: refused with --device cpu
DTYPES = ("bf16", "fp32")
# R = 32 is 4 launch groups of 8: on 4 streams its step took 1.24 ms on an H200 against 1.72 in
# order, and 1.32 on 2 (BENCHMARKS.md runs 106-107). More streams than groups are never used.
DEFAULT_LAUNCH_STREAMS = 4
MAX_LAUNCH_STREAMS = 8
# What a field of each annotated type takes, and the words its refusal uses. bool is an int to isinstance, so
# it is refused where a number is meant (--tp True reached the launcher's WORLD_SIZE=True).
_KINDS = {"int": (int, "an integer"), "float": ((int, float), "a number"), "bool": (bool, "True or False"),
          "str": (str, "text")}
_NEGATED = ("warmup", "cuda_graphs", "prelaunch")  # the bool fields whose flag is --no-<field>


class ServeConfigError(ValueError):
    """A serve flag is invalid; the message names the flag. `serve` exits `exit_status` with that one line."""

    exit_status = 2  # only a change of configuration fixes it: systemd's unit does not restart it


class AddressInUse(ServeConfigError):
    """A port or socket the flag names is held by another process now: a previous instance still letting
    go, say, or one taken between the parent's check and the rank's bind. It may be free at the next
    start, so this exits 75 (EX_TEMPFAIL, sysexits.h), which systemd restarts, and not 2, which it does not."""

    exit_status = 75


def bind_refusal(err: OSError) -> type[ServeConfigError]:
    """The refusal a failed bind raises: AddressInUse (exit 75) where another process holds the address
    now (EADDRINUSE), else ServeConfigError (exit 2: a privileged port, an address not this host's)."""
    return AddressInUse if err.errno == errno.EADDRINUSE else ServeConfigError


@dataclass(frozen=True)
class ServeConfig:
    tp: int = 4
    socket_dir: Path = Path("/tmp/dspark-sidecar")
    tcp_host: str = "127.0.0.1"
    tcp_base_port: int = 0  # 0: unix sockets only; else rank r also listens on host:port+r
    allow_remote: bool = False
    preset: str = "tiny"
    checkpoint: Path | None = None  # the `dspark/` folder; None: the preset's synthetic checkpoint
    target_checkpoint: Path | None = None  # embed_tokens source; None: next to a synthetic checkpoint
    backend: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "bf16"
    weights: str = "bf16"  # bf16 | mxfp8 (layer weights kept as F8_E4M3 + E8M0 scales, dequantized in the kernels)
    max_reqs: int = layout.DEFAULT_MAX_REQS
    metrics_port: int = 0  # Prometheus text on port + rank; 0 = off
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 in a pod, so the cluster's scraper can reach it
    strict_refusal: bool = False
    rendezvous_ms: int = 200  # how long ranks wait for each other's copy of a step
    dist_backend: str = "auto"  # auto | gloo | nccl
    dist_timeout_s: int = 60  # a collective stuck this long (dead peer) ends the rank
    # A start-up barrier (the shard loaded, the warm-up done) waits this long for the slowest rank: longer
    # than --dist-timeout-s, as one rank's load may run minutes behind another's; a peer hung that long ends it.
    startup_timeout_s: int = 600
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: the launcher picks a free one (torchrun's MASTER_PORT wins over either)
    max_message_bytes: int = 256 << 20
    warmup: bool = True
    cuda_graphs: bool = True  # replay the step as a CUDA graph per request count (GPU, capturable backend)
    prelaunch: bool = True  # queue the next doorbell step on the GPU behind the engine's GPU word (server/prelaunch.py)
    # Stop queueing for a while when the engine's GPU word reaches a rung step this late: a queued step's
    # answer waits until its GPU has started it, which holds an engine that runs this far ahead (prelaunch.BEHIND_S).
    prelaunch_behind_ms: float = 5.0
    # A step's launch groups side by side on this many streams (graphs); 0: 4 at TP 1, 1 above. At TP > 1
    # each extra stream gets its own communicator (app.exchange_lanes); tested on two GPUs but not yet benchmarked, so opt-in.
    launch_streams: int = 0
    drain_s: float = 1.0  # after SIGTERM: NOT_SERVING for this long before the listener closes
    # The launcher stops the ranks (as on SIGTERM) once this process has gone; 0: never. SidecarLauncher
    # passes its own pid: a starter that is SIGKILLed (a killed demo or test run) leaks no sidecar.
    exit_with_pid: int = 0
    seed: int = 0  # of the synthetic checkpoint
    # Benchmark emulation (never for serving an engine's real traffic):
    random_weights: bool = False  # draw weights on the device instead of reading a checkpoint
    shard_of: int = 0  # with --tp 1: compute rank 0's shard of a TP-N drafter, partial sums not exchanged

    def __post_init__(self) -> None:
        self._check_kinds()
        if not 1 <= self.tp <= layout.MAX_TP:
            raise ServeConfigError(f"--tp: must be 1..{layout.MAX_TP}, got {self.tp}")
        if self.backend not in BACKENDS:
            raise ServeConfigError(f"--backend: must be one of {BACKENDS}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ServeConfigError(f"--dtype: must be one of {DTYPES}, got {self.dtype!r}")
        if self.weights not in ("bf16", "mxfp8"):
            raise ServeConfigError(f"--weights: must be bf16 or mxfp8, got {self.weights!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ServeConfigError(f"--device: must be auto, cpu or cuda, got {self.device!r}")
        if self.dist_backend not in ("auto", "gloo", "nccl"):
            raise ServeConfigError(f"--dist-backend: must be auto, gloo or nccl, got {self.dist_backend!r}")
        if self.dist_backend == "nccl" and self.device == "cpu":
            # NCCL moves GPU tensors only: each rank ended in torch's traceback from init_process_group, exit 1.
            raise ServeConfigError("--dist-backend nccl: the ranks compute on the CPU (--device cpu), which NCCL "
                                   "cannot serve; use --dist-backend gloo or auto, or --device cuda")
        if self.backend in GPU_ONLY_BACKENDS and self.device == "cpu":
            # Both run their kernels on the rank's GPU: each rank refused it only once started (choose_backend),
            # after it had listened and joined the group, in a line of its own.
            raise ServeConfigError(f"--backend {self.backend}: its kernels run on a GPU, and --device cpu puts the "
                                   "ranks on the CPU; use --backend auto or reference, or --device cuda")
        if not 1 <= self.max_reqs <= layout.MAX_REQS_LIMIT:
            raise ServeConfigError(f"--max-reqs: must be 1..{layout.MAX_REQS_LIMIT}, got {self.max_reqs}")
        if not 0 < self.prelaunch_behind_ms <= 60_000:
            raise ServeConfigError(f"--prelaunch-behind-ms: must be above 0 and at most 60000, got {self.prelaunch_behind_ms}")
        if not 1 <= self.rendezvous_ms <= 60_000:
            raise ServeConfigError(f"--rendezvous-ms: must be 1..60000, got {self.rendezvous_ms}")
        listen_hint = "; give a host or address (127.0.0.1, or 0.0.0.0 for every interface)"
        for flag, host, if_empty in (("--tcp-host", self.tcp_host, listen_hint),
                                     ("--metrics-host", self.metrics_host, listen_hint),
                                     ("--master-addr", self.master_addr, " (an empty DSPARK_MASTER_ADDR?); give a host "
                                      "or address, 127.0.0.1 on one machine")):
            # Empty: getaddrinfo reads it as every interface (`--metrics-host "$UNSET"` served metrics off-node,
            # where an empty DSPARK_METRICS_HOST is refused, cli._env; 0.0.0.0 says it on purpose), and torch's
            # rendezvous fails with "hostname cannot be None".
            if not host.strip():
                raise ServeConfigError(f"{flag}: empty{if_empty}")
            # No name or address holds white space (a variable copied from a file with its newline). Before the
            # loopback check below: a padded 127.0.0.1 was "not a loopback address ... needs --allow-remote".
            if host != host.strip():
                raise ServeConfigError(f"{flag}: {host!r} has white space around it; give the host or address alone")
        # Rank r listens on base + r, so a base port's range ends where base + tp - 1 is 65535; the
        # rendezvous port is one port.
        for flag, port, top in (("--tcp-base-port", self.tcp_base_port, 65536 - self.tp),
                                ("--metrics-port", self.metrics_port, 65536 - self.tp),
                                ("--master-port", self.master_port, 65535)):
            if not 0 <= port <= top:
                raise ServeConfigError(f"{flag}: must be 0..{top}, got {port}")
        if self.tcp_base_port and _misbracketed(self.tcp_host):
            # gRPC parses [IPV6]:PORT only, where the checks strip the brackets: every rank's bind failed after
            # the parent's check had passed, read as a port taken since (exit 75, which systemd restarts).
            raise ServeConfigError(f"--tcp-host: {self.tcp_host!r}: brackets go around an IPv6 address only "
                                   "([::1]); give an IPv4 address or a host name without them")
        if self.tcp_base_port and not self.allow_remote and not is_loopback(self.tcp_host):
            raise ServeConfigError(
                f"--tcp-host: {self.tcp_host} is not a loopback address; KV handles grant memory "
                "access, so serving off-node needs --allow-remote")
        if self.shard_of and (self.tp != 1 or self.shard_of < 2):
            raise ServeConfigError(f"--shard-of: needs --tp 1 and N >= 2, got --tp {self.tp} --shard-of {self.shard_of}")
        if not 0 <= self.launch_streams <= MAX_LAUNCH_STREAMS:
            raise ServeConfigError(f"--launch-streams: must be 0..{MAX_LAUNCH_STREAMS}, got {self.launch_streams}")
        if not 0 <= self.drain_s <= 300:
            raise ServeConfigError(f"--drain-s: must be 0..300, got {self.drain_s}")
        if not 0 <= self.exit_with_pid <= layout.PID_MAX:
            raise ServeConfigError(f"--exit-with-pid: must be 0 (off) or a process id 1..{layout.PID_MAX}, got {self.exit_with_pid}")
        if not 0 <= self.seed < layout.SEED_LIMIT:
            raise ServeConfigError(f"--seed: must be 0..{layout.SEED_LIMIT - 1}, got {self.seed}")
        if self.checkpoint is not None and self.target_checkpoint is None and not self.random_weights:
            raise ServeConfigError("--target-checkpoint: required with --checkpoint (embed_tokens lives in the target)")
        if self.target_checkpoint is not None and self.checkpoint is None:
            raise ServeConfigError("--target-checkpoint: given without --checkpoint, it would be ignored and the "
                                   "preset's synthetic drafter served; pass the dspark/ folder too")
        if not 1 << 20 <= self.max_message_bytes <= (1 << 31) - 1:
            raise ServeConfigError(f"--max-message-bytes: must be 1 MiB..2^31 - 1 (gRPC's limit), got {self.max_message_bytes}")
        if not 1 <= self.dist_timeout_s <= 86_400:
            raise ServeConfigError(f"--dist-timeout-s: must be 1..86400, got {self.dist_timeout_s}")
        if not 1 <= self.startup_timeout_s <= 86_400:
            raise ServeConfigError(f"--startup-timeout-s: must be 1..86400, got {self.startup_timeout_s}")
        used = {}  # every port a rank listens on, by flag: two flags' ranges must not meet
        for flag, base in (("--tcp-base-port", self.tcp_base_port), ("--metrics-port", self.metrics_port)):
            for port in range(base, base + self.tp) if base else ():
                if port in used:
                    raise ServeConfigError(f"{flag}: port {port} is also {used[port]}'s")
                used[port] = flag
        if self.master_port in used:
            raise ServeConfigError(f"--master-port: port {self.master_port} is also {used[self.master_port]}'s")
        problem = layout.socket_dir_problem(self.socket_dir, self.tp)
        if problem:
            raise ServeConfigError(f"--socket-dir: {problem}")

    def _check_kinds(self) -> None:
        """Each field holds its type, the paths made Path (frozen: object.__setattr__). The flags and DSPARK_*
        variables always give it; the demo, the bench and tests build ServeConfig themselves, and a path given
        as text failed in the parent's folder check (d.parent) or a rank's AttachDoorbell (run_dir / name)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flag = "--" + ("no-" if f.name in _NEGATED else "") + f.name.replace("_", "-")
            if f.type in ("Path", "Path | None"):
                if value is None and f.type != "Path":
                    continue
                if not isinstance(value, (str, Path)):
                    raise ServeConfigError(f"{flag}: expected a path, got {value!r}")
                if isinstance(value, str) and not value.strip():  # Path('') is the working directory, silently
                    raise ServeConfigError(f"{flag}: empty; give a folder (the working directory is '.')")
                object.__setattr__(self, f.name, Path(value))
                continue
            kind, words = _KINDS[f.type]
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ServeConfigError(f"{flag}: expected {words}, got {value!r}")

    @property
    def step_streams(self) -> int:
        """Streams a step's launch groups run on (1: in order); --launch-streams 0 resolved."""
        return self.launch_streams or (DEFAULT_LAUNCH_STREAMS if self.tp == 1 else 1)

    def socket_path(self, rank: int) -> Path:
        return layout.rank_socket(self.socket_dir, rank)

    def endpoints(self, rank: int) -> list[str]:
        eps = [f"unix:{self.socket_path(rank)}"]
        if self.tcp_base_port:
            host = f"[{self.tcp_host}]" if ":" in self.tcp_host and not self.tcp_host.startswith("[") else self.tcp_host
            eps.append(f"{host}:{self.tcp_base_port + rank}")
        return eps

    def replace(self, **kw) -> ServeConfig:
        return dataclasses.replace(self, **kw)


def _misbracketed(host: str) -> bool:
    """Whether `host` has a bracket but is not one bracketed IPv6 address ("[::1]" is fine, "::1" too)."""
    if not (host.startswith("[") or host.endswith("]")):
        return False
    if not (host.startswith("[") and host.endswith("]")):
        return True
    try:
        ipaddress.IPv6Address(host[1:-1])
    except ValueError:
        return True
    return False


def is_loopback(host: str) -> bool:
    """Whether `host` (a name, an address, a bracketed IPv6 literal) names this node's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
