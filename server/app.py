"""One sidecar rank process: join the TP group, load the shard, serve gRPC with health, drain on SIGTERM."""

from __future__ import annotations

import atexit
import ctypes
import datetime
import faulthandler
import gc
import logging
import os
import platform
import signal
import stat
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dspark_sidecar import layout
from dspark_sidecar.drafter.checkpoint import (
    EMBED_KEY, CheckpointReader, SyntheticSource, ensure_synthetic_checkpoint,
)
from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import DistExchange, LocalExchange, ParallelContext
from dspark_sidecar.kernels.weights import prepare_layer_weights
from dspark_sidecar.layout import LAUNCH_REQS
from dspark_sidecar.proto import SERVICE_NAME
from dspark_sidecar.proto.doorbell import nap_for, stores_in_order
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.server.backend import BackendUnavailable, choose_backend, resolve_device
from dspark_sidecar.server.config import AddressInUse, ServeConfig, ServeConfigError, bind_refusal
from dspark_sidecar.server.errors import SidecarError, StatusInterceptor
from dspark_sidecar.server.fast_path import build_fast_path
from dspark_sidecar.server.graphs import StepGraphs, launch_streams
from dspark_sidecar.server.health import HealthPublisher, watch_peers, watch_steps
from dspark_sidecar.server.kv_binding import MemoryBindings
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.preflight import check_port, claim_socket
from dspark_sidecar.server.process_group import join_group
from dspark_sidecar.server.processes import ExitWith
from dspark_sidecar.server.rank import RankContext, RankLoop
from dspark_sidecar.server.warmup import warm_sizes
from dspark_sidecar.server.refusal import probe_host, shared_host
from dspark_sidecar.server.rendezvous import Board, PeerProcesses, Rendezvous
from dspark_sidecar.server.servicer import MAX_STREAMS, DrafterServicer, Lifecycle, give_back_unopened, limits_pb
from dspark_sidecar.server.startup import StartUp
from dspark_sidecar.server.teardown import teardown

log = logging.getLogger("dspark_sidecar.server")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BEAT_S = 0.5  # how often a rank's main thread beats on the rendezvous board and looks at its peers'
# gRPC handler threads: up to MAX_STREAMS open DraftSteps streams hold one each; the rest answer the
# unary calls and the health check.
GRPC_THREADS = MAX_STREAMS + 8


def _die_with_parent() -> None:
    """Ranks started by our launcher exit when it does (no orphans), via PR_SET_PDEATHSIG."""
    parent = os.environ.get("DSPARK_LAUNCHER_PID")
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(1)


class LateServicer(pb_grpc.DrafterSidecarServicer):
    """Registered before the server starts (gRPC cannot add services later), so health answers
    while the shard loads; draft RPCs get UNAVAILABLE until the real servicer is attached."""

    def __init__(self) -> None:
        self.inner: DrafterServicer | None = None
        self.status_source: DrafterServicer | None = None  # GetStatus before `inner` (state LOADING during warm-up)

    def _target(self, context=None, handles=()) -> DrafterServicer:
        if self.inner is None:
            if handles:  # refused before any was opened: the engine's references go back (same node only)
                give_back_unopened(context.peer(), handles)
            raise SidecarError(grpc.StatusCode.UNAVAILABLE, "rank is still loading; retry when health is SERVING",
                               "", "LOADING")
        return self.inner

    def GetStatus(self, request, context):
        src = self.inner or self.status_source
        return (src or self._target()).GetStatus(request, context)

    def BindKV(self, request, context):
        return self._target(context, [lb.memory for lb in request.layers]).BindKV(request, context)

    def UnbindKV(self, request, context):
        return self._target().UnbindKV(request, context)

    def RegisterBuffers(self, request, context):
        return self._target(context, [r.memory for r in request.regions]).RegisterBuffers(request, context)

    def DraftStep(self, request, context):
        return self._target().DraftStep(request, context)

    def AttachDoorbell(self, request, context):
        # A CUDA IPC page is refused by the servicer too (it must be shared memory), but given back there.
        return self._target(context, [request.page]).AttachDoorbell(request, context)

    def UnregisterBuffers(self, request, context):
        return self._target().UnregisterBuffers(request, context)

    def DraftSteps(self, request_iterator, context):
        # The interceptor ends the stream with _target's refusal, as it answers a unary call with it.
        return self._target().DraftSteps(request_iterator, context)


def _start_grpc(cfg: ServeConfig, rank: int, health_servicer, late: LateServicer,
                start_up: StartUp | None = None) -> grpc.Server:
    opts = [("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=GRPC_THREADS, thread_name_prefix=f"grpc-r{rank}"),
                         interceptors=[StatusInterceptor()], options=opts)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    pb_grpc.add_DrafterSidecarServicer_to_server(late, server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME, "grpc.health.v1.Health"), server)
    claim_socket(cfg, rank)  # a stale socket of a killed run is replaced; a live server's is refused
    path = cfg.socket_path(rank)
    if start_up is not None:  # ours from here (claimed): a failed bind of --tcp-base-port below removes it
        start_up.socket = path
    for ep, flag in zip(cfg.endpoints(rank), ("--socket-dir", "--tcp-base-port")):
        try:  # grpc 1.8x raises on a failed bind; older ones return 0
            bound = server.add_insecure_port(ep)
        except RuntimeError:
            bound = 0
        if bound == 0:
            # gRPC does not say why. A host that is not this one's is refused by check_port as such (exit 2);
            # otherwise the port or socket was taken since the checks (exit 75: it may be free next time).
            if flag == "--tcp-base-port":
                check_port(flag, cfg.tcp_host, cfg.tcp_base_port + rank, who=f"rank {rank} ")
            raise AddressInUse(f"{flag}: rank {rank} cannot listen on {ep}: another process took it since "
                               "the start-up checks")
    server.start()
    _give_socket_mode(path, rank)
    return server


def _give_socket_mode(path: Path, rank: int) -> None:
    """Make the socket gRPC just bound at `path` 0660 (owner and the group shared with the engine only; bind
    made it 0777 less the umask), never through a link: the folder's group may create and rename entries in
    it, and a link renamed over the socket had a chmod by path make its target (any file of this user's; as
    root, any file) 0660. The name is opened without following a link, and only a socket of this user's is
    changed, through /proc (Linux has no lchmod, and fchmod refuses an O_PATH descriptor)."""
    def replaced(what: str) -> AddressInUse:
        return AddressInUse(f"--socket-dir: rank {rank}'s socket {path} is no longer the one it bound ({what}): "
                            "another process replaced it since the bind")

    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise replaced("removed") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            raise replaced("a symbolic link now")
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise replaced(f"now {'a socket' if stat.S_ISSOCK(st.st_mode) else 'not a socket'}, owner uid {st.st_uid}")
        os.chmod(f"/proc/self/fd/{fd}", 0o660)
    finally:
        os.close(fd)


def graphs_on(cfg: ServeConfig, device: torch.device, backend: str) -> bool:
    """Whether this rank replays steps as CUDA graphs: they need a GPU and capturable ops (the Triton
    backend's are; the reference loop attention is not)."""
    return cfg.cuda_graphs and device.type == "cuda" and backend == "triton"


def warm_plan(cfg: ServeConfig, device: torch.device, graphs: StepGraphs | None) -> list[int]:
    """The request counts of the warm-up's steps. On a GPU, every launch shape served (warmup.warm_sizes):
    the kernels compile per shape, and a shape first met in a served step compiled inside it, past the
    engine's step deadline. A CPU rank's kernels compile nothing per shape: one step, as the group's proof."""
    if device.type != "cuda":
        return [LAUNCH_REQS]
    return warm_sizes(cfg.max_reqs, len(graphs.streams) if graphs is not None else 0)


def step_streams(cfg: ServeConfig, device: torch.device, backend: str) -> int:
    """Streams this rank's step graphs run a step's launch groups on (1: in order, and without graphs)."""
    return cfg.step_streams if graphs_on(cfg, device, backend) else 1


def exchange_lanes(streams: int, world: int, device: torch.device,
                   timeout: datetime.timedelta | None = None) -> tuple[DistExchange, ...]:
    """At TP > 1 with launch groups on `streams` streams: a communicator of its own for each stream
    past the first (ParallelContext.lanes; the first uses the world group). Collective: every rank
    calls it alike. Each is used once here, outside any capture: a communicator first used inside a
    CUDA graph capture fails it (BENCHMARKS.md run 98). `timeout`: --dist-timeout-s, as the world
    group's; without it new_group gives torch's default (10 min for NCCL), and a step's collective on
    a lane waited that long for a dead peer, not --dist-timeout-s."""
    if world == 1 or streams <= 1:
        return ()
    log.warning("%d launch streams at TP %d: each runs its collectives on a communicator of its own, at the same "
                "time as the others. NCCL does not promise that collectives of different communicators in flight "
                "together make progress (its guide: use them at different times, in the same order on every "
                "rank), so a step could hang. Tested on two H200s only; --launch-streams 1 avoids it", streams, world)
    lanes = []
    for _ in range(streams - 1):
        group = dist.new_group(timeout=timeout)
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe, group=group)
        if int(probe.item()) != world:
            raise RuntimeError(f"exchange lane {len(lanes) + 1}: a probe summed to {int(probe.item())} over {world} ranks")
        lanes.append(DistExchange(group))
    return tuple(lanes)


def _load(cfg: ServeConfig, rank: int, world: int, device: torch.device, cpu_group, start_up: StartUp):
    """This rank's drafter shard and embeddings, on the backend chosen once here."""
    dcfg = load_config(cfg.preset, cfg.checkpoint)
    dtype = DTYPES[cfg.dtype]
    shard_world = cfg.shard_of or world  # --shard-of: one process computes rank 0's shard of TP N
    host = probe_host(shard_world)
    if world > 1:
        # The backend below must be the same on every rank (build_fast_path is collective), and on_gfx950 asks
        # this rank's GPU alone: taken as it was, the gfx950 ranks of a mixed host entered build_fast_path's
        # collectives while the others went on to the next, and start-up hung until --startup-timeout-s.
        host = shared_host(start_up.gather(host, world, cpu_group))
    choice = choose_backend(cfg, host, device, dcfg, dtype)
    t = time.perf_counter()
    if cfg.random_weights:
        weights = embeds = SyntheticSource(dcfg, dtype, device, cfg.seed)
    else:
        if cfg.checkpoint is None:  # the embedded synthetic checkpoint: rank 0 writes it once
            if rank == 0:
                with start_up.unwinding():  # its partial folder goes if the rank is stopped meanwhile
                    ensure_synthetic_checkpoint(dcfg, cfg.seed)
            start_up.barrier(cpu_group)
            dspark_dir, target_dir = ensure_synthetic_checkpoint(dcfg, cfg.seed)
        else:
            dspark_dir, target_dir = cfg.checkpoint, cfg.target_checkpoint
        weights = CheckpointReader(dspark_dir, dtype, dcfg.quant_block, device)
        embeds = CheckpointReader(target_dir, dtype, device=device)
    par = ParallelContext(rank, shard_world, DistExchange(None) if world > 1 else LocalExchange(),
                          exchange_lanes(step_streams(cfg, device, choice.name), world, device,
                                         datetime.timedelta(seconds=cfg.dist_timeout_s)))
    model = DSparkDrafter(dcfg, par, choice.ops, dtype, device).load(weights)
    embed = embeds.read(EMBED_KEY, (dcfg.vocab_size, dcfg.hidden_size))
    fast = None
    if choice.name == "flydsl":  # collective: every rank chose alike (same host facts)
        # Its own failures, on any rank, are the path's reason on every rank; what it raises is a peer lost in
        # its collectives (a rank killed while binding its shards): one line, as at the barriers.
        fast = start_up._collective(lambda: build_fast_path(dcfg, model, weights, host, cpu_group, rank))
        if fast.startup_reason is not None and cfg.backend == "flydsl":
            raise BackendUnavailable(f"--backend flydsl: {fast.startup_reason}")
    prepare_layer_weights(model, cfg.weights, dcfg.quant_block, fold=choice.ops.name == "triton")
    # A path the choice selected may have failed to start (weights, peers): its reason, not the choice's "on".
    off = fast.startup_reason if fast is not None else choice.flydsl_refusal
    log.info("rank %d: %s shard loaded in %.1f s on %s (%s, backend %s; FlyDSL path: %s)", rank, dcfg.name,
             time.perf_counter() - t, device, cfg.dtype, choice.name, off or "on")
    return dcfg, model, embed, choice, host, fast


def serve_rank(cfg: ServeConfig, rank: int, world: int, local_rank: int, agent_attempt: int | None = None,
               agent_pid: int | None = None) -> int:
    """Run one rank until it is stopped. `agent_attempt`: under torchrun, whose agent hosts the group's
    store, its restart count (None: our launcher, rank 0 hosts the store). `agent_pid`: the agent's pid as the
    process read it at its start (cli.PARENT_AT_START; None: this process's parent now)."""
    start_up = StartUp(rank)  # its stop: a SignalStop, which the handlers may set wherever the main thread is
    try:
        return _serve_rank(cfg, rank, world, local_rank, agent_attempt, start_up, agent_pid)
    except BaseException:
        # Any start-up failure (a busy metrics port, a checkpoint error, a lost peer): no socket file nobody
        # answers on, nor rank 0's board, outlives the rank. Under torchrun nothing else removes them (our
        # launcher does, launcher._remove_stale_sockets). Past start-up both are gone already or unused.
        start_up.release()
        raise


def _serve_rank(cfg: ServeConfig, rank: int, world: int, local_rank: int, agent_attempt: int | None,
                start_up: StartUp, agent_pid: int | None = None) -> int:
    # A --tp this rank cannot serve is refused as a flag is (exit 2, one line): no restart changes it. As
    # SystemExit it was exit 1, which the launcher reported as a rank's failure and systemd restarted for ever.
    if world != cfg.tp:
        raise ServeConfigError(f"--tp {cfg.tp}: {world} ranks were started (WORLD_SIZE {world}); start as many "
                               "as --tp says (torchrun --nproc-per-node)")
    if world > 1 and not stores_in_order():
        raise ServeConfigError(f"--tp {world} on this {platform.machine()} host: the ranks agree on every step "
                               "through a shared-memory board that relies on stores being seen in the order written "
                               "(x86-64); this host does not promise that (see proto/doorbell.py)")
    stop = start_up.stop  # set by SIGTERM/SIGINT, at any point of the rank's life
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, start_up.on_signal)
    # SIGUSR1 writes every thread's Python stack to stderr (the rank's log), the process going on: what an
    # operator needs of a rank that seems stuck, with no debugger on the node. faulthandler's C handler
    # runs even while the main thread is blocked in a native call.
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    _die_with_parent()
    # Under torchrun the agent is this rank's parent and alone stops it; its workers run in sessions of their
    # own, so an agent killed outright (SIGKILL, the OOM killer) left every rank serving as an orphan, SERVING
    # to engines with nobody to stop or restart it. Watched from the beat below, by pid and start time (not
    # PR_SET_PDEATHSIG: that fires when the agent's spawning *thread* ends, which torch does not promise is
    # its main one). Our launcher's ranks have PDEATHSIG (_die_with_parent).
    agent = ExitWith(os.getppid() if agent_pid is None else agent_pid) if agent_attempt is not None else None
    device = resolve_device(cfg, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(1)  # ranks share the host's cores; also makes CPU results deterministic
    else:
        torch.cuda.set_device(device)
    health_servicer = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    late = LateServicer()
    server = _start_grpc(cfg, rank, health_servicer, late, start_up)
    # Before the load and the rendezvous: a busy metrics port fails in seconds, not after the shard loaded.
    metrics = Metrics(rank)
    if cfg.metrics_port:
        try:
            metrics.serve_http(cfg.metrics_host, cfg.metrics_port + rank)
        except OSError as err:
            raise bind_refusal(err)(f"--metrics-port: rank {rank} cannot listen on {cfg.metrics_host}:"
                                    f"{cfg.metrics_port + rank}: {err.strerror}") from None
    log.info("rank %d/%d: listening on %s (NOT_SERVING while loading)", rank, world, ", ".join(cfg.endpoints(rank)))

    dist_backend = cfg.dist_backend if cfg.dist_backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    join_group(cfg, dist_backend, rank, world, agent_attempt)
    cpu_group = start_up.group(cfg.startup_timeout_s)

    dcfg, model, embed, choice, host, fast = _load(cfg, rank, world, device, cpu_group, start_up)

    # Rank 0 makes the board under a random name and tells the others; once every rank has it mapped,
    # the name goes (rendezvous.Board): nobody else can open, pre-empt or leave behind a board.
    if rank == 0:
        board = start_up.board = Board(None, world, create=True)
    name = start_up.share(board.name if rank == 0 else None, cpu_group)
    if rank != 0:
        board = Board(name, world, create=False)
    start_up.barrier(cpu_group)
    if rank == 0:
        board.unlink()
    rendezvous = Rendezvous(board, rank, cfg.rendezvous_ms, nap_s=nap_for(device.type))
    memory = MemoryBindings(dcfg, model.par.world_size, rank, model.dtype, device)
    ctx = RankContext(rank, world, dcfg, model, embed, memory, metrics, cfg.max_reqs, fast=fast,
                      max_message_bytes=cfg.max_message_bytes)
    life = Lifecycle(backend=choice.name, fallback=choice.fallback, host=host, flydsl_off=choice.flydsl_refusal,
                     strict=cfg.strict_refusal, dist_backend=dist_backend)
    graphs = (StepGraphs(model, lambda: memory.kv.page_size, launch_streams(step_streams(cfg, device, choice.name),
                                                                          device))
              if graphs_on(cfg, device, choice.name) else None)
    loop = RankLoop(ctx, rendezvous, graphs)
    # The servicer binds the lease socket (beside the gRPC one, claimed with it) in its constructor: ours from
    # before it, as the gRPC socket is from before its bind. Taken only once the constructor had returned, a
    # stop or a failure of the rest of it (out of descriptors) left the socket behind.
    start_up.lease = layout.rank_lease_socket(cfg.socket_dir, rank)
    servicer = DrafterServicer(ctx, loop, life, limits_pb(cfg.max_reqs, cfg.max_message_bytes),
                               pb.Parallel(tp_size=world, tp_rank=rank, dist_backend=dist_backend, device=str(device)),
                               f"mxfp8->{cfg.dtype}" if cfg.weights == "bf16" else "mxfp8", cfg.socket_dir,
                               cfg.prelaunch, cfg.prelaunch_behind_ms / 1e3)
    if servicer.leases is not None:  # the lease socket beside the gRPC one, with its mode
        _give_socket_mode(start_up.lease, rank)
    late.status_source = servicer  # reads only: safe during the warm-up

    publish = HealthPublisher(life, servicer, ctx, health_servicer, metrics)
    life.on_change.append(publish)
    if cfg.warmup:
        sizes = warm_plan(cfg, device, graphs)
        secs = start_up.warm_up(ctx, sizes=sizes, graphs=graphs)
        log.info("rank %d: warm-up steps (%s requests) took %.1f ms", rank, ", ".join(map(str, sizes)), secs * 1e3)
    # A first beat before the barrier: past it every peer has beaten at least once, so a peer that
    # stops before its first timed beat is still seen (watch_peers skips peers that never beat).
    board.beat(rank)
    start_up.barrier(cpu_group)  # every rank loaded and warmed up: the group can draft
    board.beat(rank)  # the barrier may have waited long for the slowest peer
    peers = PeerProcesses(board, rank)
    peers.exited()  # every peer is past the barrier, so alive: each is seen now (see PeerProcesses)
    rendezvous.peers_started()  # and rank 0 by this rank's step waits (on rank 0: the peers, by its coordinator)
    # Only now: a step let in during the warm-up (a client that ignores NOT_SERVING) would put its
    # collectives among the warm-up's, on this rank only.
    start_up.active = False  # from here a signal drains (the loop below reads `stop`)
    # What start-up made (torch, the weights' Python objects, the warm-up's) is never garbage again: out
    # of every later collection, which then scans only what serving makes. graphs.gc_paused collects
    # before each capture, which costs tens of ms over the whole start-up heap and ~nothing after this.
    gc.collect()
    gc.freeze()
    # Back before the interpreter's final collection: frozen objects skip it, and nanobind (Triton's
    # bindings) then reports each of its live objects as leaked, dozens of lines that buried the
    # launcher's own last lines in the log.
    atexit.register(gc.unfreeze)
    late.inner = servicer
    # A stop that came since `active` went (the collection above can take a while) drains at once below:
    # published, SERVING would show a rank told to stop as ready, to probes and engines, until the drain.
    code = 0
    try:
        if not stop.is_set():
            publish("SERVING")
            log.info("rank %d: %s (backend %s, CUDA graphs %s)", rank, life.state, life.backend,
                     "on" if graphs is not None else "off")
        while not stop.wait(BEAT_S):  # a timed wait keeps the main thread responsive to signals
            watch_peers(board, rank, life, publish, peers)
            watch_steps(loop, rank, life, publish)
            if agent is not None and agent.gone():
                log.error("rank %d: torchrun's agent (pid %d) has exited without stopping this rank: draining, "
                          "as it would have", rank, agent.pid)
                code = 1
                break
    except Exception:
        # A beat that fails (what it reads, a health publish, the first one included): raised from here, it
        # skipped the teardown, and the gRPC server, never stopped, held the interpreter's exit for good on every
        # open DraftSteps stream's handler thread: a rank that neither served nor exited. It drains and ends as
        # a stop does, status 1.
        log.exception("rank %d: the serving loop failed; draining (exit 1)", rank)
        code = 1
    log.info("rank %d: draining", rank)
    try:
        publish("DRAINING")
    except Exception:
        # The loop's failure may be publish's own: health still leaves SERVING before the drain.
        log.exception("rank %d: publishing the drain failed; health set NOT_SERVING directly (exit 1)", rank)
        code = 1
        publish.draining_anyway()
    time.sleep(cfg.drain_s)  # health says NOT_SERVING while calls are still accepted: engines move off
    teardown(rank, servicer, loop, server, graphs, fast, rendezvous, board, status=code)
    return code
