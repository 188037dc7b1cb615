"""The `dspark-sidecar` command: serve, status, step, demo, bench. All flag and environment reading lives here."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import time
from pathlib import Path

ENV_PREFIX = "DSPARK_"
# The process that started this one, read at import, before anything slow: under torchrun its agent, which a rank
# watches (server/app.py). Read in serve_rank, after the imports and a rank's check_checkpoint (a full read of
# the checkpoint: minutes), an agent gone meanwhile had re-parented the rank, which then watched init or a
# subreaper instead, and served on as an orphan for good.
PARENT_AT_START = os.getppid()


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


class UsageError(ValueError):
    """A flag or environment value that cannot be used: printed as one line, exit status 2."""


def env_name(dest: str) -> str:
    """The variable that gives a flag's default: DSPARK_<DEST>."""
    return ENV_PREFIX + dest.upper()


class _FromEnv:
    """A flag's default set by DSPARK_<DEST>, read (and refused if it cannot be) only where the flag is not given.

    Converted when the parser was built, a malformed variable stopped the command even with the flag that overrides
    it on the command line (`DSPARK_TP=four serve --tp 4` exited 2), so an operator could not mend a bad ConfigMap
    value from the command line. argparse leaves a default that is not a string as it is; `resolve_env_defaults`
    converts whichever are still this after parsing."""

    def __init__(self, name: str, raw: str, kind, flag: str, default) -> None:
        self.name, self.raw, self.kind, self.flag, self.default = name, raw, kind, flag, default

    def __str__(self) -> str:  # help's "(default %(default)s)": the variable's value
        return self.raw.strip()

    def resolve(self):
        raw = self.raw.strip()  # as int() and float() strip: a YAML value quoted with its space, a $(cat file)'s newline
        if not raw:  # `DSPARK_SOCKET_DIR=$UNSET_VAR`: as a path '' is the working directory, silently
            raise UsageError(f"{self.name} ({self.flag}) is set but empty: unset it for the default "
                             f"({self.default}) or give a value")
        if self.kind is bool:
            word = raw.lower()
            if word not in _TRUE + _FALSE:
                raise UsageError(f"{self.name}={self.raw!r}: expected one of {', '.join(_TRUE + _FALSE[:-1])}")
            return word in _TRUE
        try:
            return self.kind(raw)
        except ValueError:
            what = ("an integer" if self.kind is int else "a number" if self.kind is float else self.kind.__name__)
            raise UsageError(f"{self.name}={self.raw!r}: expected {what}") from None


def _env(dest: str, default, kind=str, flag: str | None = None):
    """A flag's default: DSPARK_<DEST> from the environment when set (resolved after parsing, `_FromEnv`), else the
    built-in default. `flag`: the flag it is the default of, where that is not --<dest> (DSPARK_DEMO_ROUNDS: demo's
    --rounds)."""
    name = env_name(dest)
    raw = os.environ.get(name)
    if raw is None:
        return default
    return _FromEnv(name, raw, kind, flag or "--" + dest.replace("_", "-"), default)


def resolve_env_defaults(a: argparse.Namespace) -> argparse.Namespace:
    """Every flag left at a DSPARK_* default converted (UsageError naming the variable where it cannot be)."""
    for dest, value in vars(a).items():
        if isinstance(value, _FromEnv):
            setattr(a, dest, value.resolve())
    return a


def _builtin(dest: str, default, kind=str, flag: str | None = None):
    """A flag's built-in default, its variable unread: the defaults of a command that is not the one running."""
    return default


def _log_level() -> str:
    level = os.environ.get("DSPARK_LOG_LEVEL", "INFO").strip().upper()  # stripped, as the other variables
    # logging's own names (WARN and FATAL too, as before): getLevelName gives a known name's number, else a
    # string. Not getLevelNamesMapping, which is Python 3.11's: requires-python admits 3.10.
    if not isinstance(logging.getLevelName(level), int):
        raise UsageError(f"DSPARK_LOG_LEVEL={level!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def _add_serve_flags(p: argparse.ArgumentParser, env=_env) -> None:
    """serve's flags; `env` gives each its default (_env: DSPARK_<FLAG> where set, _builtin: never read)."""
    from dspark_sidecar import layout
    from dspark_sidecar.server.config import BACKENDS, DTYPES, ServeConfig

    d = ServeConfig()
    p.add_argument("--tp", type=int, default=env("tp", d.tp, int), help="tensor-parallel ranks (default %(default)s)")
    p.add_argument("--socket-dir", type=layout.folder_flag, default=env("socket_dir", d.socket_dir, Path),
                   help="rank r listens on unix:DIR/rank{r}.sock (default %(default)s)")
    p.add_argument("--tcp-host", default=env("tcp_host", d.tcp_host))
    p.add_argument("--tcp-base-port", type=int, default=env("tcp_base_port", d.tcp_base_port, int),
                   help="also listen on TCP HOST:PORT+r (0 = unix sockets only)")
    p.add_argument("--allow-remote", action="store_true", default=env("allow_remote", False, bool))
    p.add_argument("--preset", default=env("preset", d.preset), help="tiny | minimax-m3.1 (default %(default)s)")
    p.add_argument("--checkpoint", type=layout.folder_flag, default=env("checkpoint", None, Path),
                   help="the dspark/ folder (default: the preset's synthetic checkpoint)")
    p.add_argument("--target-checkpoint", type=layout.folder_flag, default=env("target_checkpoint", None, Path),
                   help="folder holding embed_tokens (the target model's checkpoint)")
    p.add_argument("--backend", choices=BACKENDS, default=env("backend", d.backend))
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=env("device", d.device))
    p.add_argument("--dtype", choices=DTYPES, default=env("dtype", d.dtype))
    p.add_argument("--weights", choices=("bf16", "mxfp8"), default=env("weights", d.weights),
                   help="layer weights dense in --dtype, or kept as MXFP8 and dequantized inside the kernels")
    p.add_argument("--max-reqs", type=int, default=env("max_reqs", layout.DEFAULT_MAX_REQS, int))
    p.add_argument("--metrics-port", type=int, default=env("metrics_port", d.metrics_port, int),
                   help="Prometheus text on HOST:PORT+r (0 = off)")
    p.add_argument("--metrics-host", default=env("metrics_host", d.metrics_host),
                   help="address of the metrics endpoint (default loopback; 0.0.0.0 in a pod)")
    p.add_argument("--strict-refusal", action="store_true", default=env("strict_refusal", False, bool),
                   help="a refused fast path makes health NOT_SERVING instead of serving the portable backend")
    p.add_argument("--rendezvous-ms", type=int, default=env("rendezvous_ms", d.rendezvous_ms, int))
    p.add_argument("--dist-backend", choices=("auto", "gloo", "nccl"), default=env("dist_backend", d.dist_backend))
    p.add_argument("--dist-timeout-s", type=int, default=env("dist_timeout_s", d.dist_timeout_s, int))
    p.add_argument("--startup-timeout-s", type=int, default=env("startup_timeout_s", d.startup_timeout_s, int),
                   help="how long a rank waits at start-up for its slowest peer (loading, warm-up) before it "
                        "stops (default %(default)s)")
    p.add_argument("--master-addr", default=env("master_addr", d.master_addr))
    p.add_argument("--master-port", type=int, default=env("master_port", d.master_port, int),
                   help="torch.distributed rendezvous port (0 = pick a free one)")
    p.add_argument("--max-message-bytes", type=int, default=env("max_message_bytes", d.max_message_bytes, int))
    p.add_argument("--drain-s", type=float, default=env("drain_s", d.drain_s, float),
                   help="after SIGTERM, report NOT_SERVING this long before closing the listener")
    p.add_argument("--exit-with-pid", type=int, default=env("exit_with_pid", d.exit_with_pid, int),
                   help="stop the ranks (as on SIGTERM) once process PID has exited (0 = never; "
                        "client/launcher.py passes its own pid)")
    p.add_argument("--random-weights", action="store_true", default=env("random_weights", False, bool),
                   help="benchmarks: draw weights on the device instead of reading a checkpoint")
    p.add_argument("--shard-of", type=int, default=env("shard_of", 0, int),
                   help="benchmarks: with --tp 1, compute rank 0's shard of a TP-N drafter (no exchange)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   default=env("cuda_graphs", True, bool), help="run steps eagerly on the GPU")
    p.add_argument("--no-prelaunch", dest="prelaunch", action="store_false", default=env("prelaunch", True, bool),
                   help="never queue a doorbell step on the GPU before it is rung (server/prelaunch.py)")
    p.add_argument("--prelaunch-behind-ms", type=float, default=env("prelaunch_behind_ms", d.prelaunch_behind_ms, float),
                   help="stop queueing steps for a while when the engine's GPU reaches a rung step this many ms "
                        "late (its host runs ahead; a queued step's answer would hold it that long)")
    p.add_argument("--launch-streams", type=int, default=env("launch_streams", d.launch_streams, int),
                   help="run a step's launch groups (8 requests each) side by side on N CUDA streams; "
                        "0 = 4 at --tp 1, 1 (in order) above; at --tp > 1, N > 1 gives each extra stream its own "
                        "communicator (opt-in: not yet benchmarked)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", default=env("warmup", True, bool))
    p.add_argument("--seed", type=int, default=env("seed", d.seed, int), help="seed of the synthetic checkpoint")


def serve_config(a: argparse.Namespace):
    from dspark_sidecar.server.config import ServeConfig

    fields = ServeConfig.__dataclass_fields__
    a = resolve_env_defaults(a)  # a parser of _add_serve_flags parsed by hand (deploy checks, tests) too
    return ServeConfig(**{k: v for k, v in vars(a).items() if k in fields})


# DSPARK_* names read outside serve's flags: the log level, the launcher's own, the demo's, deploy/launch-tp4.sh's
# (exported, they reach serve), and the vLLM plug-in's (client/vllm_plugin.py), which may share the sidecar's
# environment (one pod spec, one .env).
OTHER_ENV = frozenset({"DSPARK_LOG_LEVEL", "DSPARK_LAUNCHER_PID", "DSPARK_DEMO_ROUNDS",
                       "DSPARK_LAUNCHER", "DSPARK_PYTHON", "DSPARK_SOCKET_GROUP",
                       "DSPARK_DRAFTER_ARCHS", "DSPARK_STEP_DEADLINE_MS", "DSPARK_DRAFT_CUDAGRAPHS"})


def unknown_env(environ: dict[str, str], flag_dests: list[str]) -> list[str]:
    """One line per DSPARK_* variable that nothing reads (a typo, or DSPARK_NO_X for a --no-x flag,
    whose variable is DSPARK_X=0): such a value was ignored without a word."""
    import difflib

    known = {env_name(d) for d in flag_dests} | OTHER_ENV
    lines = []
    for name in sorted(n for n in environ if n.startswith(ENV_PREFIX) and n not in known):
        near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        lines.append(f"{name} is not read by dspark-sidecar; ignored" + (f" (did you mean {near[0]}?)" if near else ""))
    return lines


def cmd_serve(a: argparse.Namespace, argv: list[str], flag_dests: list[str]) -> int:
    from dspark_sidecar.drafter.checkpoint import check_checkpoint, ensure_synthetic_checkpoint
    from dspark_sidecar.drafter.config import load_config

    cfg = serve_config(a)
    if os.environ.get("RANK", "0") == "0" and "DSPARK_LAUNCHER_PID" not in os.environ:  # once: the parent, or
        for line in unknown_env(dict(os.environ), flag_dests):  # torchrun's rank 0
            logging.getLogger("dspark_sidecar.cli").warning(line)
        if "RANK" in os.environ and cfg.exit_with_pid:  # only our launcher watches it
            logging.getLogger("dspark_sidecar.cli").warning(
                "--exit-with-pid is ignored under torchrun: its agent, not serve, starts and stops the ranks")
    # Preset, checkpoint config, TP and the checkpoint's tensors checked here, once: in the ranks each
    # would print its own line or traceback, and only after they had started listening.
    dcfg = load_config(cfg.preset, cfg.checkpoint)
    in_rank = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # under torchrun or our own launcher
    # --shard-of N: one process computes rank 0's shard of TP N, so N is the TP the drafter must split over
    _check_tp(dcfg, cfg.shard_of or cfg.tp, "--shard-of" if cfg.shard_of else "--tp")
    if not in_rank:  # this process launches the ranks (below)
        from dspark_sidecar.server.backend import check_gpu_placement

        # Our launcher spawns every rank on this machine's visible GPUs (not torchrun, which may give each rank
        # GPUs of its own: a scheduler's per-rank CUDA_VISIBLE_DEVICES). Counted before the checkpoint is read:
        # GPUs not visible yet exit 75, restarted every 5 s while a booting host's driver loads, and each try
        # read every tensor of --checkpoint (GBs) first.
        check_gpu_placement(cfg)
    # --random-weights draws every weight on the device (app._load): of a --checkpoint only its config.json
    # (read above) is used, so its tensors were read for nothing, and a folder of config.json alone refused.
    if cfg.checkpoint is not None and not cfg.random_weights:
        # Once: in this parent, or in each rank under torchrun, where no parent checked it. A rank of our own
        # launcher (its parent, whose pid it is given) read every tensor again, TP + 1 full reads at each start;
        # it checks its own slices as it loads them.
        if not ("RANK" in os.environ and os.environ.get("DSPARK_LAUNCHER_PID") == str(os.getppid())):
            check_checkpoint(dcfg, cfg.checkpoint, cfg.target_checkpoint)
    elif not cfg.random_weights and "RANK" not in os.environ:  # the embedded synthetic one: written here, once
        # Before any handler of serve's: SIGTERM (a systemd stop at a first start) killed this process at once,
        # and the writer's partial folder (gigabytes for a full preset) stayed. Unwound, exit 0 as a stopped start.
        try:
            with _sigterm_unwinds(status=0):
                ensure_synthetic_checkpoint(dcfg, cfg.seed)
        except KeyboardInterrupt:  # Ctrl-C, the same stopped start (README): exit 0, not main's interrupt
            return 0
    if in_rank:
        from dspark_sidecar.server.app import serve_rank
        from dspark_sidecar.server.process_group import PeerLost

        # torchrun's (and our launcher's) rendezvous address wins over the flags
        cfg = cfg.replace(master_addr=os.environ.get("MASTER_ADDR", cfg.master_addr),
                          master_port=int(os.environ.get("MASTER_PORT", cfg.master_port)))

        try:
            return serve_rank(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                              int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
                              agent_attempt=(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                                             if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None),
                              agent_pid=PARENT_AT_START)
        except PeerLost as err:  # the peer printed why; this rank's traceback would only add noise
            print(f"dspark-sidecar: {err}", file=sys.stderr, flush=True)
            # Ended here, not by returning: the group lost its peer inside a collective, and gloo's threads may
            # still wait in it. The interpreter's exit destroyed them running (CI: SIGABRT, "terminate called
            # without an active exception", after this line), and a thread of ours in it would hold the exit for
            # good. serve_rank has removed the rank's files (StartUp.release), as a stop during start-up does.
            logging.shutdown()
            sys.stdout.flush()
            os._exit(1)
    from dspark_sidecar.server.healthcheck import check
    from dspark_sidecar.server.launcher import launch
    from dspark_sidecar.server.preflight import check_before_launch, listener_pid
    from dspark_sidecar.server.processes import parent_pid

    # A live sidecar on the socket dir, an unusable folder or a busy port: one line here, before any
    # rank (which would otherwise take over a live server's socket or fail once per rank, some after loading).
    check_before_launch(cfg)

    def another_s(r: int) -> bool:
        """Whether rank r's socket is listened on by a process that is not one of our ranks (our children): a serve
        started on the folder with this one, past the check above too, whose rank took the socket first. Ours
        then refuses it (exit 75) seconds later; until then the other's health read as this group serving, and the
        losing serve printed "TP N serving" before its refusal. Nobody answering now tells nothing: not held; nor
        does a parent not known (no /proc), which would otherwise keep a group of our own from ever serving."""
        pid = listener_pid(cfg.socket_path(r))
        if pid is None:
            return False
        parent = parent_pid(pid) if pid > 0 else -1  # pid 0: a process of another pid namespace, never our child
        return parent != 0 and parent != os.getpid()

    def ready() -> bool:
        states = [check(f"unix:{cfg.socket_path(r)}", 1.0) for r in range(cfg.tp)]
        if all(s == "SERVING" for s in states) and not any(another_s(r) for r in range(cfg.tp)):
            print(f"dspark-sidecar: TP {cfg.tp} serving", flush=True)
            for r in range(cfg.tp):
                print(f"  rank {r}: {', '.join(cfg.endpoints(r))}  health {states[r]}", flush=True)
            print("  status: dspark-sidecar status --socket-dir", cfg.socket_dir, "| stop: Ctrl-C / SIGTERM", flush=True)
            return True
        return False

    return launch(cfg, argv, on_ready=ready)


def cmd_status(a: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import text_format

    from dspark_sidecar import layout
    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
    from dspark_sidecar.server.healthcheck import probe_flags_problem, unreachable

    if why := probe_flags_problem(a.tp, a.timeout):
        raise UsageError(why)
    # As serve's and the probe's (server/healthcheck.py): a folder no gRPC client can reach printed every rank
    # UNREACHABLE UNKNOWN under gRPC's log lines, naming nothing, or ('%XX', ',') asked another folder's ranks.
    if problem := layout.socket_dir_problem(a.socket_dir, a.tp):
        raise UsageError(f"--socket-dir: {problem}")
    rc = 0
    for r in range(a.tp):
        path = layout.rank_socket(a.socket_dir, r)
        try:
            with grpc.insecure_channel(f"unix:{path}") as ch:
                st = pb_grpc.DrafterSidecarStub(ch).GetStatus(pb.GetStatusRequest(), timeout=a.timeout)
            print(f"== rank {r} ({path})\n{text_format.MessageToString(st)}")
        except grpc.RpcError as err:
            # A rank that answered with the sidecar's own error (rich status: still loading, ...) is up
            # and says why it gives no report; printed as UNREACHABLE it read like a rank that is gone.
            why = _sidecar_error(err)
            print(f"== rank {r} ({path}): {why or 'UNREACHABLE ' + unreachable(err, a.timeout)}")
            rc = 1
    return rc


def _sidecar_error(err) -> str:
    """"CODE (REASON): message" when the sidecar itself answered `err` (its ErrorInfo), else ""."""
    from dspark_sidecar.proto.rich_status import error_reason

    reason = error_reason(err)
    # details() is the rich status's message: rpc_status.from_call refuses a status whose message differs.
    return f"{err.code().name} ({reason}): {err.details()}" if reason else ""


def cmd_step(a: argparse.Namespace) -> int:
    """One draft step on the embedded synthetic drafter, in-process at TP 1: shapes and time."""
    import torch

    from dspark_sidecar import layout
    from dspark_sidecar.drafter import scenario
    from dspark_sidecar.drafter.checkpoint import EMBED_KEY, CheckpointReader, ensure_synthetic_checkpoint
    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.drafter.kv_cache import allocate_kv_cache, kv_storage_shape
    from dspark_sidecar.drafter.model import DSparkDrafter
    from dspark_sidecar.drafter.parallel import ParallelContext
    from dspark_sidecar.kernels.ops import REFERENCE_OPS

    # Checked before the drafter loads: each ended in a traceback after it (no request, a negative
    # context for torch.arange, no timed step to report).
    if not 1 <= a.reqs <= layout.MAX_REQS_LIMIT:  # above, no sidecar serves the step (ran on for minutes)
        raise UsageError(f"--reqs: must be 1..{layout.MAX_REQS_LIMIT}, got {a.reqs}")
    if a.context < 0:
        raise UsageError(f"--context: must be 0 or more, got {a.context}")
    if a.repeat < 1:
        raise UsageError(f"--repeat: must be at least 1, got {a.repeat}")
    cfg = load_config(a.preset)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    lens = [a.context] * a.reqs
    pages = sum(scenario.pages_needed(c + 7, 16) for c in lens)
    # The KV cache and the context's taps (float32 drawn, then cast), sized before either is made: a large
    # --context allocated until the OOM killer ended the process (SIGKILL, no line; on a shared host maybe another).
    need = (cfg.num_hidden_layers * math.prod(kv_storage_shape(cfg, 1, pages, 16)) * dtype.itemsize
            + a.reqs * a.context * cfg.tap_size * (4 + dtype.itemsize))
    if need > (have := _host_memory_bytes()):
        raise UsageError(f"--reqs/--context: {a.reqs} requests of {a.context} tokens need {need / 2**30:.1f} GiB "
                         f"(KV cache and context taps), more than this host's {have / 2**30:.1f} GiB")
    dspark_dir, target_dir = ensure_synthetic_checkpoint(cfg)
    model = DSparkDrafter(cfg, ParallelContext(), REFERENCE_OPS, dtype).load(CheckpointReader(dspark_dir, dtype))
    embed = CheckpointReader(target_dir, dtype).read(EMBED_KEY, (cfg.vocab_size, cfg.hidden_size))
    kv = allocate_kv_cache(cfg, 1, pages, 16, dtype)
    step = scenario.random_step(cfg, lens, 16, pages, embed)
    pos, slots = scenario.context_rows(step.meta, 16)
    model.commit_context(scenario.random_taps(cfg, pos.numel(), 1), pos, slots, kv)
    times = []
    for _ in range(a.repeat):
        t = time.perf_counter()
        hidden = model.draft_step(step.inputs_embeds, step.positions, step.meta, kv)
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"preset {cfg.name}: {a.reqs} requests x 7 rows, context {a.context}, {a.dtype}, reference ops, TP 1")
    print(f"  inputs_embeds {list(step.inputs_embeds.shape)}  positions {list(step.positions.shape)}  "
          f"block_tables {list(step.meta.block_tables.shape)}  KV layer {list(kv[0].shape)}")
    print(f"  hidden {list(hidden.shape)} {hidden.dtype}  launches {len(range(0, a.reqs, 8))}  "
          f"median {times[len(times) // 2] * 1e3:.2f} ms over {a.repeat}")
    return 0


def _host_memory_bytes() -> int:
    """This host's physical memory (step's bound: a step that cannot fit in it is refused, not OOM-killed)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_tp(preset, tp: int, flag: str = "--tp") -> None:
    """UsageError unless `preset` (a name, or serve's loaded DrafterConfig) shards over `tp` ranks, as the sidecar's
    and the engine's ranks both shard it; the line names `flag`, the one that gave `tp`."""
    from dspark_sidecar.drafter.config import ConfigError, load_config

    dcfg = load_config(preset) if isinstance(preset, str) else preset  # an unknown preset: its own ConfigError
    try:
        dcfg.check_tp(tp)
    except ConfigError as err:
        raise UsageError(f"{flag} {tp}: {err}") from None


def _check_gpus(tp: int) -> None:
    """UsageError unless --tp GPUs are visible: sidecar rank r and engine rank r both run on GPU r
    (torch.cuda.set_device(r)); with fewer, the ranks failed in tracebacks after the sidecar had started."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < tp:
        raise UsageError(f"--device cuda: {visible} GPU(s) visible, --tp {tp} needs {tp} (sidecar rank r and engine "
                         f"rank r run on GPU r); {'lower --tp, ' if tp > 1 else ''}make more GPUs visible, or use "
                         "--device cpu")


def cmd_demo(a: argparse.Namespace) -> int:
    from dspark_sidecar import layout
    from dspark_sidecar.client.demo import DemoConfig, DemoError, format_report, run_demo, unverified_line, verdict

    # Checked before anything starts: --tp 0 ended in the harness's traceback after the checkpoint was
    # written, --required-tp 0 only in the engine ranks, after the sidecar had started.
    for flag, n in (("--tp", a.tp), ("--required-tp", a.required_tp)):
        if n < 1:
            raise UsageError(f"{flag}: must be at least 1, got {n}")
    if a.use_running_sidecar and a.socket_dir is None:
        raise UsageError("--use-running-sidecar: needs --socket-dir (the folder the running sidecar serves in)")
    try:
        cfg = DemoConfig(rounds=a.rounds, tp=a.tp, preset=a.preset, seed=a.seed, max_reqs=a.max_reqs, dtype=a.dtype,
                         socket_dir=str(a.socket_dir) if a.socket_dir else None, start_sidecar=not a.use_running_sidecar,
                         verify=a.verify, rendezvous_ms=a.rendezvous_ms, device=a.device, transport=a.transport,
                         required_tp=a.required_tp, kv_layout=a.kv_layout, kv_dtype=a.kv_dtype)
    except ValueError as err:  # DemoConfig names the field ("rounds: ..."): the flag of the same name
        field, _, why = str(err).partition(": ")
        raise UsageError(f"--{field.replace('_', '-')}: {why}") from None
    if cfg.start_sidecar:  # the flags the demo's own sidecar is started with, by serve's rules (else it exits 2 later)
        from dspark_sidecar.server.config import ServeConfig

        ServeConfig(tp=a.tp, max_reqs=a.max_reqs, rendezvous_ms=a.rendezvous_ms, dtype=a.dtype, device=a.device,
                    **({"socket_dir": a.socket_dir} if a.socket_dir is not None else {}))
    # The harness's ranks shard the preset as the sidecar's do: a --tp it does not divide ended in a
    # traceback once the sidecar, started, had exited 2 (or, with --use-running-sidecar, in the engine ranks).
    _check_tp(a.preset, a.tp)
    # The folder the sockets are looked for in (with --use-running-sidecar; the demo's own sidecar's was checked
    # just above, where serve's default folder used to be): one too long for a unix socket failed in the
    # launcher, as "a sidecar already answers" there.
    if a.socket_dir is not None and (problem := layout.socket_dir_problem(a.socket_dir, a.tp)):
        raise UsageError(f"--socket-dir: {problem}")
    if a.device == "cuda":
        _check_gpus(a.tp)
    if cfg.verify and a.tp != a.required_tp:
        # The shim forwards only at --required-tp (the seed's check): every round would run locally, and a
        # verifying demo that compared nothing fails (exit 1), after starting eight processes to say so.
        raise UsageError(f"--tp {a.tp}: the shim forwards only at --required-tp {a.required_tp}, so no round would "
                         f"be compared; pass --required-tp {a.tp} (or --no-verify to watch every round fall back)")
    try:
        with _sigterm_unwinds():
            report = run_demo(cfg)
    except DemoError as err:  # no sidecar to talk to: README's exit 1, said in one line (a log tail may follow)
        print(f"dspark-sidecar demo: FAILED: {err}", file=sys.stderr)
        return 1
    print(format_report(report))
    if failed := verdict(report, cfg.dtype, cfg.kv_dtype, cfg.verify):
        print(f"dspark-sidecar demo: FAILED: {failed}", file=sys.stderr)
        return 1
    if not cfg.verify:
        print(unverified_line(report))
    return 0


@contextlib.contextmanager
def _sigterm_unwinds(status: int | None = None):
    """While inside, SIGTERM (`timeout`, a cancelled CI job) raises SystemExit(143, or `status`), so the demo's
    (and the bench's) finally blocks run: killed at once by default, its engine ranks went on drafting every round
    locally, orphaned (only the sidecar stops by itself, --exit-with-pid), and both its temporary folders stayed."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # signal.signal is the main thread's only
        yield
        return

    def stop(signum, _frame):
        signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM, during the unwind, kills as before
        raise SystemExit(128 + signum if status is None else status)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _bench_out_dir(path: Path, files: tuple[str, ...]) -> None:
    """Make --out-dir before the run: run_bench made it at its end, where a file of that name (or a parent
    it cannot be made in) ended a whole bench in a traceback with bench.json unwritten. `files`: the names the
    run writes there, each of which a folder may have taken (the same traceback, after the whole run)."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out-dir: cannot make {str(path)!r} a folder ({err.strerror or err})") from None
    try:  # a folder that takes no files (read-only, another user's) failed the same way, at the end
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise UsageError(f"--out-dir: cannot write into {str(path)!r} ({err.strerror or err})") from None
    for name in files:
        where = path / name
        if where.is_dir():
            taken, kind = where, "a folder"
        elif where.parent.exists() and not where.parent.is_dir():  # single-gpu/bench.json under a file single-gpu
            taken, kind = where.parent, "not a folder"
        else:
            continue
        raise UsageError(f"--out-dir: {str(taken)!r} is {kind}, where the bench writes its {name}; "
                         "move it or choose another --out-dir")


def cmd_bench(a: argparse.Namespace) -> int:
    import torch

    from dspark_sidecar.bench import REMOTE_MODES, BenchConfig, BenchFailed, failed_rows, run_bench
    from dspark_sidecar.server.config import GPU_ONLY_BACKENDS

    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu")
    def ints(flag: str, text: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise UsageError(f"{flag}: comma-separated integers, got {text!r}") from None

    if a.tp > 1 and a.shard_of not in (None, a.tp):  # bench_tp times TP N's shard: the flag was silently ignored
        raise UsageError(f"--shard-of {a.shard_of}: with --tp {a.tp} the shard timed is TP {a.tp}'s; "
                         f"drop --shard-of, or give --shard-of {a.tp}")
    shard_of = a.tp if a.tp > 1 else BenchConfig.shard_of if a.shard_of is None else a.shard_of  # its default: 4
    bc = BenchConfig(preset=a.preset, shard_of=shard_of, reqs=ints("--reqs", a.reqs), contexts=ints("--contexts", a.contexts),
                     modes=tuple(m for m in a.modes if m not in ", "), dtype=a.dtype, weights=a.weights, repeats=a.repeats, out_dir=a.out_dir,
                     sidecar_backend=a.sidecar_backend, prelaunch=a.prelaunch,
                     engine_copy=a.engine_copy, launch_streams=a.launch_streams, lead_ms=a.lead_ms,
                     shim_inputs=a.shim_inputs, kv_layout=a.kv_layout, kv_dtype=a.kv_dtype, shim_phases=a.shim_phases)
    if a.tp < 1:  # else read as --tp 1: the one-process bench ran, as if the flag had not been given
        raise UsageError(f"--tp: at least 1, got {a.tp}")
    if device.type == "cpu" and bc.sidecar_backend in GPU_ONLY_BACKENDS and (a.tp > 1 or REMOTE_MODES & set(bc.modes)):
        # serve refuses it (ServeConfig), so the bench's sidecar never started: d-i failed after the other modes had
        # run (exit 1, each row naming the sidecar's log), and --tp N ended in "the bench's sidecar did not start".
        raise UsageError(f"--sidecar-backend {bc.sidecar_backend}: its kernels run on a GPU, and this bench runs on "
                         "the CPU (--device cpu, or no GPU visible); use --sidecar-backend auto or reference")
    if device.type == "cuda":  # at --tp 1 too: the weights' first CUDA allocation ended it in torch's traceback
        _check_gpus(a.tp)
    if a.tp == 1:  # the shard's TP, as serve's --shard-of: the drafter's words alone, after --out-dir was made
        _check_tp(a.preset, shard_of, "--shard-of")
    if a.tp > 1 and a.shim_phases:  # run_tp_bench has no phase split: the flag was ignored
        raise UsageError(f"--shim-phases: the one-process bench's mode h only, not --tp {a.tp}")
    if a.tp > 1:
        from dspark_sidecar.bench_tp import run_tp_bench

        # Before any process: with --no-single-gpu nothing else checked the preset or --tp before the sidecar
        # started, which then failed (a traceback naming its log, its folder left in $TMPDIR) for a flag's value.
        _check_tp(a.preset, a.tp)  # (the GPUs were counted above: run_tp_bench's own check exited 1, unprefixed)

        _bench_out_dir(bc.out_dir, (f"bench-tp{a.tp}.json",)
                       + (("single-gpu/bench.json", "single-gpu/bench.png") if a.single_gpu else ()))
        with _sigterm_unwinds():  # as the demo's: killed at once, the engine ranks' folder stayed behind
            try:
                report = run_tp_bench(bc, a.tp, a.single_gpu, device.type)
            except BenchFailed as err:  # a traceback through torch's spawn said less: which rank, which log
                print(f"dspark-sidecar: bench --tp {a.tp}: {err}", file=sys.stderr)
                return 1
        bad = [r for r in report["rows"] if not r["parity_ok"]]
        print(f"wrote {a.out_dir / f'bench-tp{a.tp}.json'}; parity "
              + (f"FAILED in {len(bad)} of {len(report['rows'])} cases" if bad else "ok in every case"))
        # The single-GPU comparison's rows (bench.json in single-gpu/): a failed one left only a figure missing.
        failed = report["single_gpu_failed"]
        if failed:
            print(f"dspark-sidecar: bench --tp {a.tp}: the single-GPU comparison's rows failed: {', '.join(failed)}; "
                  f"their notes in {a.out_dir / 'single-gpu' / 'bench.json'} say why", file=sys.stderr)
        return 1 if bad or failed else 0
    _bench_out_dir(bc.out_dir, ("bench.json", "bench.png"))
    with _sigterm_unwinds():  # its sidecar's folder and the cache's shared memory: removed as on Ctrl-C
        report = run_bench(bc, device)
    print(f"device {report['device']}, copy bandwidth {report['copy_bandwidth_GBps']:.0f} GB/s; "
          f"wrote {a.out_dir / 'bench.json'}")
    # A mode that failed is a row with a note (so the other modes still run), but the run is not a success: exit 0
    # there let a script or CI job take a table with every sidecar mode broken for a measured one. A mode that
    # cannot run here ("n/a: needs a GPU") is not a failure.
    failed = failed_rows(report["rows"])
    if failed:
        print(f"dspark-sidecar: {len(failed)} of {len(report['rows'])} rows failed: {', '.join(failed)}; "
              "their notes say why", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """The command; a flag, environment value, config or checkpoint that cannot be used is one line and exit 2
    (75 when it is a port or socket that another process holds now)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C: the finally blocks (the demo's ranks and folders, the bench's sidecar) have run, and Python's
        # traceback through them named no fault. One line, then the end SIGINT gives, as Python's own after its
        # traceback: a shell, and serve's launcher for a rank still starting (-SIGINT), see an interrupt.
        print("dspark-sidecar: interrupted", file=sys.stderr)
        return _die_of_sigint()
    except BrokenPipeError:
        if not _stdout_gone():  # another pipe (a spawned child's): not the reader of our output
            raise
        # The reader went away (`status | head`): no traceback for that. Python flushes stdout again at
        # exit, so point it at /dev/null first; exit 1, as Python itself does on EPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except Exception as err:
        if not isinstance(err, _usage_errors()):
            raise
        print(f"dspark-sidecar: {err}", file=sys.stderr)
        return getattr(err, "exit_status", 2)  # 75 for a port or socket held now (server/config.AddressInUse)
    finally:
        if argv is None and _command(sys.argv[1:]) == "serve":  # the program itself (python -m, the script)
            _ignore_stop_signals()


def _command(argv: list[str]) -> str | None:
    """The command argv runs: its first word that is not an option (the top-level parser takes none but -h)."""
    return next((w for w in argv if not w.startswith("-")), None)


def _ignore_stop_signals() -> None:
    """serve has ended (the launcher's ranks have exited; a rank has stopped or failed): SIGTERM and SIGINT are
    ignored for what is left, the interpreter's exit. That exit puts SIG_DFL back for every handler set from Python
    (launch() had already put back the defaults it found), and a stop repeated there (a second Ctrl-C, a supervisor
    repeating SIGTERM) turned the stopped serve's exit 0 into -SIGTERM or -SIGINT, or a KeyboardInterrupt traceback
    out of an atexit hook. SIG_IGN is what the exit leaves in place. Not for a caller in this process (main(argv)):
    its own handlers stay."""
    import signal

    with contextlib.suppress(ValueError):  # main() off the main thread, which may not set handlers
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)


def _die_of_sigint() -> int:
    """End this process by SIGINT's default action, stdout flushed first (the kill skips Python's exit flush)."""
    import signal

    with contextlib.suppress(OSError, ValueError):  # a reader gone (EPIPE) or a closed stream: nothing to deliver
        sys.stdout.flush()
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    except ValueError:  # main() called off the main thread, which may not set handlers: the shell's 130
        return 128 + signal.SIGINT
    os.kill(os.getpid(), signal.SIGINT)
    return 128 + signal.SIGINT  # not reached: the signal's default action ends the process at once


def _stdout_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone (poll reports an error or hang-up on it)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fd (a replaced sys.stdout), or no poll()
        return False


def _usage_errors() -> tuple[type, ...]:
    """The errors that name a flag, variable, config field or checkpoint tensor (imported only when needed)."""
    from dspark_sidecar.bench import BenchConfigError
    from dspark_sidecar.client.config import EngineConfigError
    from dspark_sidecar.drafter.checkpoint import CheckpointError
    from dspark_sidecar.drafter.config import ConfigError
    from dspark_sidecar.server.config import ServeConfigError

    return UsageError, ServeConfigError, EngineConfigError, ConfigError, CheckpointError, BenchConfigError


def _main(argv: list[str] | None) -> int:
    from dspark_sidecar import layout  # torch-free, as bench_defaults below: for the folder flags' type

    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=_log_level(),
                        format=f"%(asctime)s %(levelname)s [pid {os.getpid()} rank {os.environ.get('RANK', '-')}] "
                               "%(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="dspark-sidecar", description="DSpark drafter sidecar")
    # Only the command being run reads its DSPARK_* defaults (its parser is built with _env, the others with
    # _builtin): every parser read them, so `step --help`, the bench and the demo (whose sidecar gets none of
    # serve's variables) exited 2 for a DSPARK_WARMUP=ture only serve reads, and serve for DSPARK_DEMO_ROUNDS.
    # The top-level parser takes no option but -h, so the command is argv's first word that is not one.
    chosen = _command(argv)

    def env(cmd: str):
        return _env if cmd == chosen else _builtin

    sub = ap.add_subparsers(dest="cmd", required=True)
    serve_p = sub.add_parser("serve", help="start the TP sidecar (all ranks) and serve until SIGTERM")
    _add_serve_flags(serve_p, env("serve"))
    st = sub.add_parser("status", help="print every rank's GetStatus")
    st.add_argument("--socket-dir", type=layout.folder_flag, default=env("status")("socket_dir", Path("/tmp/dspark-sidecar"), Path))
    st.add_argument("--tp", type=int, default=env("status")("tp", 4, int))
    st.add_argument("--timeout", type=float, default=3.0)
    sp = sub.add_parser("step", help="one draft step on the embedded synthetic drafter, in-process")
    sp.add_argument("--preset", default="tiny")
    sp.add_argument("--reqs", type=int, default=8)
    sp.add_argument("--context", type=int, default=4096)
    sp.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    sp.add_argument("--repeat", type=int, default=5)
    dp = sub.add_parser("demo", help="TP-4 sidecar + TP-4 engine harness: N rounds, forwarded vs local")
    dp.add_argument("--rounds", type=int, default=env("demo")("demo_rounds", 100, int, flag="demo --rounds"))
    dp.add_argument("--tp", type=int, default=env("demo")("tp", 4, int))
    dp.add_argument("--preset", default="tiny")
    dp.add_argument("--seed", type=int, default=0)
    dp.add_argument("--max-reqs", type=int, default=8, help="the sidecar's --max-reqs; the mix goes above it")
    dp.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    dp.add_argument("--socket-dir", type=layout.folder_flag, default=None, help="default: a fresh temporary folder")
    dp.add_argument("--use-running-sidecar", action="store_true",
                    help="talk to a sidecar already serving at --socket-dir instead of starting one")
    dp.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: sidecar rank r and engine rank r on GPU r (the engine's stock layers over NCCL)")
    dp.add_argument("--transport", choices=("grpc", "doorbell"), default="grpc",
                    help="doorbell: the shared-memory data plane (registered buffers, CUDA IPC on GPUs)")
    dp.add_argument("--kv-layout", choices=("planes", "records"), default="planes",
                    help="how the engine allocates its draft KV cache: planes [2, pages, page, heads, 128] (the spec's) "
                         "or records [pages, heads, page, 2 * 128] (vLLM 0.34's)")
    dp.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                    help="the draft KV cache's element type: auto (the compute dtype) or fp8 (e4m3 codes, as vLLM's "
                         "kv_cache_dtype fp8 at scale 1)")
    dp.add_argument("--required-tp", type=int, default=4,
                    help="the TP the shim forwards at (the seed's check; the deployment is TP 4)")
    dp.add_argument("--no-verify", dest="verify", action="store_false",
                    help="skip running the local layers beside forwarded rounds")
    dp.add_argument("--rendezvous-ms", type=int, default=200)
    from dspark_sidecar import bench_defaults  # torch-free: the parser is built before any command runs

    bp = sub.add_parser("bench", help="draft-step latency vs the HBM floor and the stock layers, one run")
    bp.add_argument("--preset", default="minimax-m3.1")
    bp.add_argument("--shard-of", type=int, default=None,
                    help="time rank 0's shard of a TP-N drafter (default 4; with --tp N > 1 the shard is TP N's)")
    bp.add_argument("--reqs", default="1,8,32", help="comma-separated request counts")
    bp.add_argument("--contexts", default="512,4096", help="comma-separated context lengths")
    bp.add_argument("--modes", default="abcdefghi", help="a ref eager, b ref graphed, c GPU backend, d data plane, e gRPC, "
                    "f data plane pipelined (no host sync between steps), g data plane behind the engine's own GPU "
                    "work, h data plane from the engine's shim (maybe_forward), i h behind the engine's own GPU work")
    bp.add_argument("--lead-ms", type=float, default=8.0,
                    help="g, i: ms of GPU work the engine queues before each step (its host runs that far ahead)")
    bp.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    bp.add_argument("--weights", choices=("bf16", "mxfp8"), default="bf16",
                    help="mxfp8: every mode's layer weights kept as MXFP8 (the floor counts their bytes)")
    bp.add_argument("--repeats", type=int, default=bench_defaults.REPEATS,
                    help="timed steps per mode and case (default %(default)s: from "
                         f"{bench_defaults.P99_MIN_SAMPLES} samples a p99 is printed)")
    bp.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    bp.add_argument("--sidecar-backend", default="auto")
    bp.add_argument("--no-prelaunch", dest="prelaunch", action="store_false",
                    help="the sidecar never queues a step before it is rung (compare d and f without it)")
    bp.add_argument("--engine-copy", action="store_true",
                    help="d/f: the engine's embeddings are copied into the registered input region every step")
    bp.add_argument("--shim-inputs", choices=("host", "device"), default="host",
                    help="h/i: the positions and attention metadata the shim is given live on the host (as the "
                         "data plane's regions want them) or on the GPU (as vLLM's forward context holds them)")
    bp.add_argument("--launch-streams", type=int, default=0,
                    help="c and the sidecar: launch groups side by side on N streams (0: the serve default, 4 at "
                         "--tp 1 and 1 above, the one-GPU shard beside --tp N > 1 included; with --tp N > 1 each "
                         "extra stream gets its own communicator)")
    bp.add_argument("--kv-layout", choices=("planes", "records"), default="planes",
                    help="the engine's draft KV cache allocation: planes (the spec's) or records (vLLM 0.34's)")
    bp.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                    help="the draft KV cache's element type: auto (the compute dtype) or fp8 (e4m3 codes)")
    bp.add_argument("--shim-phases", action="store_true",
                    help="h: split the shim's host time before the ring and after the answer into phases "
                         "(diagnostic; ~3 us of timing wrappers added to mode h)")
    bp.add_argument("--out-dir", type=layout.folder_flag, default=Path("bench-out"))
    bp.add_argument("--tp", type=int, default=1,
                    help="N > 1: the sidecar at TP N on N GPUs (N CPU ranks with --device cpu), driven by N engine ranks "
                         "over the data plane, checked against the reference layers at TP N")
    bp.add_argument("--no-single-gpu", dest="single_gpu", action="store_false",
                    help="with --tp N: skip the one-GPU shard baseline")
    a = resolve_env_defaults(ap.parse_args(argv))
    if a.cmd == "bench":
        return cmd_bench(a)
    if a.cmd == "demo":
        return cmd_demo(a)
    if a.cmd == "serve":
        return cmd_serve(a, argv, [act.dest for act in serve_p._actions])
    if a.cmd == "status":
        return cmd_status(a)
    return cmd_step(a)


if __name__ == "__main__":
    sys.exit(main())
