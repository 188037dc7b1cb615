"""A minimal speculative-decoding engine at TP N (one process per rank, gloo) that drives the shim round by round.

Each rank owns a paged draft KV cache (in shared memory on CPU, on its own GPU with device
"cuda": one GPU per rank, the stock layers' exchange over NCCL), commits context rows locally (spec 3A),
builds each draft step as vLLM does (anchor + 6 noise rows at P..P+6, sequence length P+7, query
slots), asks the shim, runs the stock reference layers on None, and turns the hidden states into
7 draft tokens per request with lm_head and the Markov chain (spec 3C). In verify mode every
forwarded round also runs the local layers and compares hidden states, draft tokens and the
block rows' K/V the sidecar wrote.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dspark_sidecar import layout
from dspark_sidecar.client.config import BreakerConfig, EngineConfig, rank_endpoint
from dspark_sidecar.client.forward_context import set_forward_context
from dspark_sidecar.client.shim import DrafterShim
from dspark_sidecar.client.workload import MixConfig, Workload, taps_for, whole
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import (
    EMBED_KEY, LM_HEAD_KEY, PREFIX, CheckpointReader, ensure_synthetic_checkpoint,
)
from dspark_sidecar.drafter.config import PRESETS
from dspark_sidecar.drafter.kv_cache import (KV_DTYPE_CHOICES, KV_LAYOUTS, StepMetadata, kv_cache_dtype, kv_planes,
                                             kv_rows, kv_storage_shape)
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import DistExchange, LocalExchange, ParallelContext
from dspark_sidecar.kernels.ops import REFERENCE_OPS
from dspark_sidecar.proto.memory import exportable_zeros

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FAULTS = ("realloc_kv", "break_stream", "pause")
# How long run_engine waits for the ranks it stops to release their shim and KV segments before killing them.
RANK_UNWIND_S = 5.0


@dataclass(frozen=True)
class Fault:
    """At the start of `round`: re-allocate every rank's KV cache, break `rank`'s stream during the
    step, or pause all ranks until the controller (run_engine's on_pause) is done."""

    round: int
    kind: str
    rank: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULTS:
            raise ValueError(f"fault kind: one of {FAULTS}, got {self.kind!r}")
        if not (whole(self.round) and whole(self.rank)):  # round 1.5 passed `< rounds` and no round matched it
            raise ValueError(f"fault round and rank: whole numbers, got round {self.round!r}, rank {self.rank!r}")
        if self.round < 0 or self.rank < 0:
            raise ValueError(f"fault round and rank: must be >= 0, got round {self.round}, rank {self.rank}")


@dataclass(frozen=True)
class HarnessConfig:
    rounds: int = 100
    tp: int = 4
    preset: str = "tiny"
    dtype: str = "fp32"
    checkpoint: tuple[str, str] | None = None  # (dspark_dir, target_dir); None: the preset's synthetic one
    socket_dir: str | None = None  # the sidecar's; None: no shim, local layers only
    page_size: int = 16
    num_pages: int = 1024
    mix: MixConfig = field(default_factory=MixConfig)
    verify: bool = True
    warmup_calls: bool = True  # a profiling run and CUDA-graph capture passes before round 0
    transport: str = "grpc"  # or "doorbell" (EngineConfig.transport)
    step_deadline_s: float = 5.0
    late_grace_s: float = 5.0
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    faults: tuple[Fault, ...] = ()
    control_dir: str | None = None
    progress_every: int = 0
    device: str = "cpu"  # or "cuda": rank r on GPU r (its KV cache, stock layers, lm_head)
    required_tp: int = 4  # the shim forwards only at this TP (EngineConfig.required_tp; the seed's check)
    kv_layout: str = "planes"  # how the engine allocates its draft KV cache (kv_cache.KV_LAYOUTS)
    kv_dtype: str = "auto"  # the cache's element type: auto (the compute dtype) or fp8 (e4m3, kv_cache.FP8_KV)

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPE_CHOICES:
            raise ValueError(f"kv_dtype: auto or fp8, got {self.kv_dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: cpu or cuda, got {self.device!r}")
        for f in ("rounds", "tp", "page_size", "num_pages", "progress_every"):
            if not whole(getattr(self, f)):  # else a TypeError (range(2.5)) or a never-true `==` in every rank
                raise ValueError(f"{f}: a whole number, got {getattr(self, f)!r}")
        if self.progress_every < 0:
            raise ValueError(f"progress_every: must be >= 0 (0: no progress lines), got {self.progress_every}")
        if self.rounds < 0 or self.tp < 1:
            raise ValueError("rounds must be >= 0 and tp >= 1")
        if self.preset not in PRESETS:
            raise ValueError(f"preset: one of {sorted(PRESETS)}, got {self.preset!r}")
        PRESETS[self.preset].check_tp(self.tp)
        self.engine_config()  # refused here, not in each rank after it has mapped its KV cache
        if self.page_size < 1 or self.num_pages < 1:
            raise ValueError(f"page_size and num_pages must be >= 1, got {self.page_size}, {self.num_pages}")
        for f in self.faults:
            # A fault past the last round or on a rank that does not exist never fired, silently: the run
            # passed as if the break, re-allocation or pause (and its on_pause) had been survived.
            if f.round >= self.rounds or f.rank >= self.tp:
                raise ValueError(f"faults: {f} never fires in {self.rounds} rounds on ranks 0..{self.tp - 1}")
            if f.kind == "break_stream" and self.socket_dir is None:  # no shim: its hook is never called
                raise ValueError(f"faults: {f} never fires without a sidecar (socket_dir None): no stream to break")

    def engine_config(self, endpoint: str = "", device: str = "cpu") -> EngineConfig:
        """The shim's config as every rank builds it (EngineRank), its rank's endpoint and device given."""
        return EngineConfig(tp_size=self.tp, endpoint=endpoint, step_deadline_s=self.step_deadline_s,
                            late_grace_s=self.late_grace_s, breaker=self.breaker, transport=self.transport,
                            device=device, required_tp=self.required_tp)


class EngineRank:
    """One engine TP rank: stock drafter shard, KV cache, shim, and the round loop."""

    def __init__(self, h: HarnessConfig, rank: int) -> None:
        self.h, self.rank = h, rank
        self.cfg = cfg = PRESETS[h.preset]
        self.dtype = DTYPES[h.dtype]
        self.dev = dev = torch.device("cuda", rank) if h.device == "cuda" else torch.device("cpu")
        dspark_dir, target_dir = h.checkpoint or ensure_synthetic_checkpoint(cfg)
        # The shim agrees over the CPU (gloo) group; on GPUs the stock layers sum over NCCL.
        self.par = ParallelContext(rank, h.tp, DistExchange(None) if h.tp > 1 else LocalExchange())
        layers_par = self.par
        if h.tp > 1 and dev.type == "cuda":
            layers_par = ParallelContext(rank, h.tp, DistExchange(dist.new_group(backend="nccl")))
        self.model = DSparkDrafter(cfg, layers_par, REFERENCE_OPS, self.dtype, dev).load(
            CheckpointReader(dspark_dir, self.dtype, cfg.quant_block, dev))
        target = CheckpointReader(target_dir, torch.float32, device=dev)
        v, hid = cfg.vocab_size, cfg.hidden_size
        self.embed = target.read(EMBED_KEY, (v, hid)).to(self.dtype)
        self.lm_head = target.read(LM_HEAD_KEY, (v, hid))
        markov = CheckpointReader(dspark_dir, torch.float32, device=dev)
        self.w1 = markov.read(f"{PREFIX}markov_head.markov_w1.weight", (v, cfg.markov_rank))
        self.w2 = markov.read(f"{PREFIX}markov_head.markov_w2.weight", (v, cfg.markov_rank))
        self.kv = self._allocate()
        self.shim: DrafterShim | None = None
        try:  # run()'s finally releases the segments from here on; a failure (or a SIGTERM) before it, here
            if h.socket_dir is not None:
                self.shim = DrafterShim(h.engine_config(rank_endpoint(h.socket_dir, rank), str(dev)), self,
                                        lambda: [s.tensor for s in self.kv], self.par)
            self.work = Workload(h.mix, v, h.page_size, h.num_pages)
        except BaseException:
            if self.shim is not None:
                self.shim.close()
            for s in self.kv:
                s.close()
            raise

    # The engine's stock model, as the shim sees it ------------------------------------------------
    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed[ids.to(self.dev)]

    def _allocate(self):
        shape = kv_storage_shape(self.cfg, self.h.tp, self.h.num_pages, self.h.page_size, self.h.kv_layout)
        dtype = kv_cache_dtype(self.h.kv_dtype, self.dtype)
        return [exportable_zeros(shape, dtype, self.dev) for _ in range(self.cfg.num_hidden_layers)]

    def _layers(self) -> list[torch.Tensor]:
        """The caches as the stock layers address them: [2, pages, page_size, kv_heads, head_dim] views."""
        return [kv_planes(s.tensor) for s in self.kv]

    def reallocate_kv(self) -> None:
        """A new cache allocation (new segments, same layout), contents carried over; the old one freed."""
        new = self._allocate()
        for old, fresh in zip(self.kv, new, strict=True):
            fresh.tensor.copy_(old.tensor)
            old.close()
        self.kv = new

    # Spec 3C ----------------------------------------------------------------------------------------
    def draft_tokens(self, hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """hidden [7R, hidden] -> greedy draft tokens int64 [R, 7]: lm_head plus the rank-r Markov chain."""
        r = anchors.numel()
        u = (hidden.float() @ self.lm_head.T).view(r, layout.QPR, -1)
        prev, out = anchors.to(self.dev), []
        for j in range(layout.QPR):
            d = (u[:, j] + self.w1[prev] @ self.w2.T).argmax(dim=-1)
            out.append(d)
            prev = d
        return torch.stack(out, dim=1).cpu()

    def _gather_block_kv(self, slots: torch.Tensor) -> torch.Tensor:
        slots = slots.to(self.dev)
        return torch.stack([torch.stack([kv_rows(t, 0, slots), kv_rows(t, 1, slots)]) for t in self._layers()])

    def _commit(self, salts: list[int], rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        if not rows:
            return
        taps = torch.cat([taps_for(s, p, t, self.cfg.tap_size) for s, (p, t, _) in zip(salts, rows)])
        self.model.commit_context(taps.to(self.dev), torch.cat([p for p, _, _ in rows]).to(self.dev),
                                  torch.cat([sl for _, _, sl in rows]).to(self.dev), self._layers())

    # The loop ---------------------------------------------------------------------------------------
    def _warmup_calls(self, ids: torch.Tensor, pos: torch.Tensor, meta: StepMetadata) -> None:
        """What vLLM does before serving: a profiling run (no attention metadata) and CUDA graph capture."""
        assert self.shim is not None
        with set_forward_context(None):
            self.shim.maybe_forward(ids, pos)
        capturing = self.shim.is_capturing
        self.shim.is_capturing = lambda: True
        with set_forward_context(meta):
            self.shim.maybe_forward(ids, pos)
        self.shim.is_capturing = capturing

    def _pause(self, rnd: int) -> None:
        if self.h.tp > 1:
            dist.barrier()
        if self.rank == 0 and self.h.control_dir is not None:
            ctl = Path(self.h.control_dir)
            (ctl / f"reached-{rnd}").touch()
            deadline = time.monotonic() + 600
            while not (ctl / f"go-{rnd}").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"controller did not release round {rnd}")
                time.sleep(0.02)
        if self.h.tp > 1:
            dist.barrier()

    def run(self) -> dict:
        """All rounds, then the rank's report. The shim and the KV cache's segments are released however
        it ends: an exception mid-run left the segments in /dev/shm and the shim's channel open until exit."""
        try:
            return self._rounds()
        finally:
            if self.shim is not None:
                self.shim.close()
            for s in self.kv:
                s.close()

    def _rounds(self) -> dict:
        h, rec = self.h, Record()
        for rnd in range(h.rounds):
            faults = [f for f in h.faults if f.round == rnd]
            for f in faults:
                if f.kind == "pause":
                    self._pause(rnd)
                elif f.kind == "realloc_kv":
                    self.reallocate_kv()
            if self.shim is not None:
                self.shim.fault_hook = None
                if any(f.kind == "break_stream" and f.rank == self.rank for f in faults):
                    shim = self.shim
                    self.shim.fault_hook = lambda _sid: shim.connection.stream().close()
            new = self.work.admit()
            self._commit([q.salt for q in new], [self.work.prompt(q) for q in new])
            reqs = self.work.active
            anchors = torch.tensor([q.anchor for q in reqs], dtype=torch.int64)
            seq_lens = torch.tensor([q.pos + layout.QPR for q in reqs], dtype=torch.int32)
            tables = self.work.block_table()
            ids, pos, slots = scenario.block_rows(anchors, seq_lens, tables, h.page_size, self.cfg.noise_token_id)
            meta = StepMetadata(seq_lens, tables, slots)
            if rnd == 0 and h.warmup_calls and self.shim is not None:
                self._warmup_calls(ids, pos, meta)
            before = dict(self.shim.stats.fallbacks) if self.shim else {}
            t0 = time.perf_counter_ns()
            hidden = None
            if self.shim is not None:
                with set_forward_context(meta):
                    hidden = self.shim.maybe_forward(ids, pos)
            t1 = time.perf_counter_ns()
            forwarded = hidden is not None
            side_kv = self._gather_block_kv(slots) if forwarded and h.verify else None
            local = None
            if not forwarded or h.verify:
                t2 = time.perf_counter_ns()
                local = self.model.draft_step(self.embed_input_ids(ids), pos.to(self.dev), meta.to(self.dev),
                                              self._layers())
                rec.local_ns.append(time.perf_counter_ns() - t2)
            drafts = self.draft_tokens(hidden if forwarded else local, anchors)
            if forwarded:
                rec.fwd_ns.append(t1 - t0)
                if local is not None:
                    rec.compare(hidden, local, drafts, self.draft_tokens(local, anchors),
                                side_kv, self._gather_block_kv(slots))
            reason = ""
            if self.shim is not None and not forwarded:
                after = self.shim.stats.fallbacks
                reason = next((k for k in after if after[k] != before.get(k, 0)), "")
            rec.round(len(reqs), forwarded, reason, drafts, int(seq_lens.max()))
            rows, salts = [], []
            for i, q in enumerate(reqs):
                d = drafts[i].tolist()
                p, t = self.work.advance(q, self.work.accepted(q, d, rnd), d)
                rows.append((p, t, self.work.slots(q, p)))
                salts.append(q.salt)
            self._commit(salts, rows)
            self.work.retire()
            if h.progress_every and self.rank == 0 and (rnd + 1) % h.progress_every == 0:
                print(rec.progress(rnd + 1, h.rounds), flush=True)
        out = rec.as_dict()
        out.update(rank=self.rank, joined=self.work.joined, left=self.work.left,
                   shim=self.shim.stats.as_dict() if self.shim else None,
                   binds=self.shim.binder.binds if self.shim else 0)
        return out


def worst(a: float, b: float) -> float:
    """The larger of two differences, NaN if either is: Python's max(0.0, nan) is 0.0, and a round whose
    answer held a NaN vanished from the record (a non-reference backend is judged on these numbers alone)."""
    return a if a != a or a >= b else b


@dataclass
class Record:
    """What one rank saw, round by round."""

    decisions: list[str] = field(default_factory=list)  # "F" forwarded / "L" local, per round
    reasons: list[str] = field(default_factory=list)
    reqs: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)  # the longest sequence of each round
    fwd_ns: list[int] = field(default_factory=list)
    local_ns: list[int] = field(default_factory=list)
    digest: int = 0
    max_seq_len: int = 0
    compared: int = 0
    hidden_mismatch: int = 0
    token_mismatch: int = 0  # rounds whose draft tokens differ
    tokens_differing: int = 0  # draft tokens that differ, summed
    kv_mismatch: int = 0
    max_hidden_diff: float = 0.0
    max_kv_diff: float = 0.0
    max_hidden_rel: float = 0.0  # relative L2, for backends that round differently (the GPU's)
    max_kv_rel: float = 0.0

    def compare(self, fwd: torch.Tensor, local: torch.Tensor, d_fwd: torch.Tensor, d_local: torch.Tensor,
                kv_fwd: torch.Tensor, kv_local: torch.Tensor) -> None:
        self.compared += 1
        diff = (fwd.float() - local.float()).abs().max().item() if fwd.numel() else 0.0
        self.max_hidden_diff = worst(self.max_hidden_diff, diff)
        self.hidden_mismatch += int(not torch.equal(fwd, local.to(fwd.dtype)) or fwd.dtype != local.dtype)
        n = int((d_fwd != d_local).sum())
        self.token_mismatch += int(n > 0)
        self.tokens_differing += n
        # Compared as bits: torch has no equality for float8 on CPU, and bits are what must match.
        self.kv_mismatch += int(kv_fwd.dtype != kv_local.dtype
                                or not torch.equal(kv_fwd.view(torch.uint8) if kv_fwd.element_size() == 1 else kv_fwd,
                                                   kv_local.view(torch.uint8) if kv_local.element_size() == 1 else kv_local))
        self.max_kv_diff = worst(self.max_kv_diff, (kv_fwd.float() - kv_local.float()).abs().max().item())
        if fwd.numel():
            self.max_hidden_rel = worst(self.max_hidden_rel, scenario.rel_l2(fwd, local.to(fwd.dtype)))
            self.max_kv_rel = worst(self.max_kv_rel, scenario.rel_l2(kv_fwd, kv_local))

    def round(self, r: int, forwarded: bool, reason: str, drafts: torch.Tensor, seq_len: int) -> None:
        self.decisions.append("F" if forwarded else "L")
        self.reasons.append(reason)
        self.reqs.append(r)
        self.seq_lens.append(seq_len)
        self.digest = zlib.crc32(drafts.numpy().tobytes(), self.digest)
        self.max_seq_len = max(self.max_seq_len, seq_len)

    def progress(self, done: int, total: int) -> str:
        f = self.decisions.count("F")
        return (f"round {done}/{total}: R={self.reqs[-1]} forwarded {f}, local {done - f}, "
                f"longest context {self.max_seq_len}, mismatches {self.hidden_mismatch}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"decisions": "".join(self.decisions)}


# Processes ------------------------------------------------------------------------------------------
def _exit_with_starter(rank: int) -> None:
    """End this rank at once when the process that spawned it has gone, however it went.

    run_engine's finally stops the ranks when the starter unwinds, but a SIGKILLed starter runs none, and
    torch's parent-death SIGINT (set in its spawn wrapper) misses two cases: a starter killed before the
    wrapper runs (the rank's imports, seconds) left its ranks drafting every round, orphaned; and a rank
    blocked in a gloo collective does not run the KeyboardInterrupt, while its peer, interrupted between two,
    may leave it there until gloo's timeout (30 minutes). The spawn parent's sentinel is a pipe whose other
    end only the starter holds: it reads EOF once the starter has gone, even before this thread waits on it.
    A thread (not a check per round) and os._exit (not an exception), for the blocked collective; the KV
    cache's segments are unlinked by the starter's resource tracker once its last process has exited."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not a spawned rank
        return

    def watch() -> None:
        parent.join()
        os.write(2, f"engine rank {rank}: its starter (pid {parent.pid}) has gone; exiting\n".encode())
        os._exit(1)

    threading.Thread(target=watch, name=f"engine-rank{rank}-starter", daemon=True).start()


def _unwinding(_signum: int, _frame) -> None:
    """SIGINT or SIGTERM in a rank already unwinding from one: nothing more to do."""


def _stop_rank(signum: int, _frame) -> None:
    """SIGINT (a terminal's Ctrl-C) or SIGTERM (run_engine's stop; torch's, when a peer rank failed) in an engine
    rank: unwind, so that EngineRank.run's finally releases the shim and the KV cache's segments (SIGTERM's default
    ended the rank where it stood, leaving them to the starter's resource tracker). Once: the other signal, which
    follows a Ctrl-C from the starter, must not cut that unwind short (run_engine kills a rank that takes too long)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        # Not SIG_IGN: a signal that came beside this one, already caught, then printed "ignored due to race".
        signal.signal(s, _unwinding)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt  # torch's spawn wrapper takes it as its parent's stop: exit 0, as before
    raise SystemExit(128 + signum)  # a failure to torch's join, as the signal's own end was


def _rank_entry(rank: int, h: HarnessConfig, store_path: str, out_dir: str) -> None:
    _exit_with_starter(rank)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _stop_rank)
    torch.set_num_threads(1)  # same reductions as the sidecar's ranks: bit-identical results
    if h.device == "cuda":
        torch.cuda.set_device(rank)
    if h.tp > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, h.tp), rank=rank, world_size=h.tp)
    try:
        report = EngineRank(h, rank).run()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        if h.tp > 1:
            dist.destroy_process_group()


def run_engine(h: HarnessConfig, work_dir: str | Path, on_pause=None, timeout_s: float = 1800.0) -> list[dict]:
    """Run the harness on h.tp spawned processes; returns each rank's report (RuntimeError naming a rank that
    exited without writing one: stopped by SIGINT alone, torch's spawn wrapper ends it with status 0).

    `on_pause(round)` runs in this process at every "pause" fault while all engine ranks wait.
    """
    import torch.multiprocessing as mp

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for r in range(h.tp):
        # A reused work_dir's reports: a rank that ends without writing its own (a SIGINT: exit 0) must not
        # leave the last run's in its place, returned as this run's.
        (work / f"rank{r}.json").unlink(missing_ok=True)
    ctl = work / "control"
    ctl.mkdir(exist_ok=True)
    for stale in ctl.iterdir():
        # A reused work_dir's reached-N / go-N of the last run: on_pause ran before the ranks got to round N,
        # and rank 0, finding go-N, did not wait for it (the "pause" ran beside live rounds).
        stale.unlink()
    h = dataclasses.replace(h, control_dir=str(ctl))
    store = work / "store"
    if store.exists():
        store.unlink()
    ctx = mp.start_processes(_rank_entry, args=(h, str(store), str(work)), nprocs=h.tp, join=False,
                             start_method="spawn")
    pauses = sorted({f.round for f in h.faults if f.kind == "pause"})
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.05):
            if pauses and (ctl / f"reached-{pauses[0]}").exists():
                rnd = pauses.pop(0)
                if on_pause is not None:
                    on_pause(rnd)
                (ctl / f"go-{rnd}").touch()
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine harness did not finish in {timeout_s} s")
    finally:
        # Ranks still running here (an error or an interrupt in this process: Ctrl-C, the demo's SIGTERM) are asked
        # to unwind first (_stop_rank): EngineRank.run's finally closes the shim and unlinks the KV cache's
        # segments. SIGKILLed at once, they left those in /dev/shm until this process exited, its resource tracker
        # then warning of "leaked shared_memory objects" after the demo's one line. One that cannot unwind in time
        # (blocked in a gloo collective) is killed, as is every one still alive if a second interrupt cuts the
        # wait short.
        alive = [p for p in ctx.processes if p.is_alive()]
        try:
            for p in alive:
                p.terminate()
            unwind_by = time.monotonic() + RANK_UNWIND_S
            for p in alive:
                p.join(max(0.0, unwind_by - time.monotonic()))
        finally:
            for p in alive:
                if p.is_alive():
                    p.kill()
                    p.join()  # reaped: not a zombie until this process next starts one or exits
            for f in ctx.error_files:  # torch's pickled traceback of a rank that raised, read by join; else in $TMPDIR
                Path(f).unlink(missing_ok=True)
    for r, p in enumerate(ctx.processes):
        if not (work / f"rank{r}.json").exists():  # torch's spawn wrapper ends a SIGINTed rank with 0
            raise RuntimeError(f"engine rank {r} exited (status {p.exitcode}) without its report: interrupted?")
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(h.tp)]
