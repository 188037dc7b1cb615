"""The engine rank's drafter shim: forwards an eligible draft step to its sidecar rank, or returns None.

Every engine TP rank ends every step with the same decision (all forwarded, or all None),
because the stock layers the engine runs on None all-reduce among the ranks. The checks run in
three phases (FAILURE_MODES.md has the full argument):

1. The seed's checks, in the seed's order, on TP-replicated state only (the engine's config and
   the step's inputs, identical on every rank; the agreed limits). No remote call and no
   collective: every rank takes the same branch, so none waits for a peer. (One in RELEARN_EVERY
   steps above the agreed max_reqs goes on to phase 2, on every rank alike, to learn a raised limit.)
2. This rank's readiness (breaker, connection, KV binding), each bounded by a deadline, then a
   pre-flight MIN all-reduce: one rank not ready -> all return None.
3. The step on the long-lived stream (bounded by the step deadline), then a post-flight MIN
   all-reduce of "I got a valid answer": one rank without one -> all return None.

`close()` may come from another thread (an engine shutting down) while a step is in either phase.
Phases 2 and 3 hold the rank's link (`_link`) and close() takes it the same way, after waking a
step that waits for its answer: nothing is released or unmapped under a step. After close() the rank
is not ready at every pre-flight (it still takes part in the agreements: its peers wait there).
connect() takes the link too, and changes nothing while a step on another thread is between its
phase 2 and its end (the peers agree on the link as phase 2 left it).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Sequence

import grpc
import torch

from dspark_sidecar import layout
from dspark_sidecar.client.agreement import StepAgreement, agreement_from, all_min_ints
from dspark_sidecar.client.binding import BindError, KVBinder, NotShareable
from dspark_sidecar.client.breaker import CircuitBreaker
from dspark_sidecar.client.config import EngineConfig, config_refusal
from dspark_sidecar.client.connection import ChannelFactory, SidecarConnection, StepInterrupted, StreamBroken, _insecure
from dspark_sidecar.client.dataplane import DataPlaneError
from dspark_sidecar.client.doorbell_transport import DoorbellTransport
from dspark_sidecar.client.forward_context import LOCAL_SOURCE, ForwardContextSource
from dspark_sidecar.client.lease import lease_path
from dspark_sidecar.client.link import Link
from dspark_sidecar.client.metadata import read_step_metadata, spans_kv_groups, tables_cover
from dspark_sidecar.client.reasons import (
    ROWS, REQS, POSITIONS, NO_CONTEXT, NO_METADATA, CAPTURE, BAD_METADATA, KV_GROUPS, NO_KV, UNSETTLED, BREAKER,
    UNREACHABLE, NOT_SERVING, BIND_FAILED, KV_NOT_SHAREABLE, PEER_NOT_READY, GENERATIONS, STREAM, DEADLINE,
    BAD_ANSWER, TOO_LARGE, PEER_FAILED, EMBED_FAILED, BAD_EMBEDS, CLOSED, STEP_IN_FLIGHT, SHIM_ERROR,
    sidecar_error, ENGINE_METADATA, sidecar_refusal, OFF, PEER_REFUSES, NOT_BINDABLE)
from dspark_sidecar.client.stats import ShimStats
from dspark_sidecar.drafter.kv_cache import StepMetadata, kv_paging
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.memory import HandleError

log = logging.getLogger("dspark_sidecar.client")

# One in this many steps above the agreed max_reqs goes on to the readiness check and the pre-flight instead of
# returning at phase 1: the limit is learned only there (GetStatus, read at each reconnect), which such steps
# never reach, so a sidecar restarted with a larger --max-reqs (or one above the engine's first guess) was never
# learned while every step exceeded the old limit. Costs one pre-flight per this many fallbacks; the others
# still make no remote call and no agreement.
RELEARN_EVERY = 64
_NO_LIMIT = layout.MAX_REQS_LIMIT + 1
_NO_GEN = 1 << 62
# StatusReport.model.compute_dtype: the proto's short names, and torch's, which the sidecar sends.
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                   "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# An inline request's bytes past its tensors': five TensorRefs' dtype, shape and field tags, and the step's
# scalars (under 1 KB at any shape the limits allow).
_HEADER_BYTES = 4096
_MAX_DOORBELL_PAGES = 8192  # block-table width the registered metadata region is sized for
# A data plane refused for a passing reason (a sidecar busy past the deadline, e.g. at TP > 1 waiting
# on its peers while it releases this rank's old regions) is asked for again after this long; until
# then, and for good after any other refusal on this connection, steps use the gRPC stream.
DOORBELL_RETRY_S = 5.0
_PASSING = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


@functools.cache
def _has_cuda() -> bool:
    return torch.cuda.is_available()  # asked once: a few us per call, on every step


def _not_capturing() -> bool:
    return bool(_has_cuda() and torch.cuda.is_current_stream_capturing())


class DrafterShim:
    """One per engine rank. `maybe_forward` has the seed's signature and contract."""

    def __init__(self, config: EngineConfig, model: Any, kv_caches: Callable[[], Sequence[torch.Tensor] | None],
                 par: Any, *, forward_context: ForwardContextSource = LOCAL_SOURCE,
                 is_capturing: Callable[[], bool] = _not_capturing,
                 channel_factory: ChannelFactory = _insecure, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._model, self._kv_caches, self._fc, self.is_capturing = model, kv_caches, forward_context, is_capturing
        self._agree: StepAgreement = agreement_from(par, config.agreement_timeout_s)
        self.rank = int(getattr(par, "rank", 0))
        self.stats = ShimStats()
        self._logged: set[str] = set()
        self._max_reqs = config.max_reqs  # replicated: changed only from agreed values
        self._over_limit = 0  # replicated: steps above _max_reqs so far (RELEARN_EVERY)
        self._next_step = 1  # replicated: advanced only on agreed steps
        self._unsettled: tuple[Any, int] | None = None  # (stream, step id) of a step not yet answered
        self._drop_pending = False  # _drop_link asked for while a step was unsettled: done once it settles
        self.fault_hook: Callable[[int], None] | None = None  # tests: called just before a step is sent
        # The link (connection, binding, data plane and its shared memory) is used by one thread at a time:
        # maybe_forward's phases 2 and 3, connect(), and close() (which may run on another thread; link.py).
        self._hold = Link(self._finish_close, self.rank)
        # A maybe_forward is between its readiness check and its end (set and read holding the link; see connect)
        self._step_open = False
        self.refusal = config_refusal(config)
        self.enabled = self.refusal is None
        self.connection = SidecarConnection(config.endpoint, channel_factory)
        self.doorbell: DoorbellTransport | None = None
        self._doorbell_off: str | None = None  # why this connection uses the gRPC stream instead
        self._doorbell_retry_at = 0.0  # time.monotonic() before which a passing refusal is not asked again
        self._via_doorbell = False
        self.breaker = CircuitBreaker(config.breaker, self._probe, clock, name=f"sidecar rank {self.rank}")
        self.binder = KVBinder(pb.EngineFacts(
            engine_rank=self.rank, tp_size=config.tp_size, dp_size=config.dp_size, pp_size=config.pp_size,
            speculative_method=config.speculative_method, num_speculative_tokens=config.num_speculative_tokens,
            device=config.device,
            # The engine rank's GPU, which the sidecar rank compares with its own at BindKV (an engine rank wired
            # to another GPU's sidecar rank is refused there, by name); "" on a CPU rank: not compared. Each
            # BindKV names the GPU its cache lives on instead, where that differs (binding.on_cache_gpu).
            device_uuid=memory.gpu_uuid(torch.device(config.device))))
        if self.refusal is not None:
            log.info("DSpark drafter sidecar off: %s", self.refusal)

    # The seed's entry point ------------------------------------------------------------------
    def maybe_forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                      inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's final hidden states [n, hidden] from the sidecar, or None for the stock layers."""
        if not self.enabled:
            # Not inside CUDA graph capture: a settled look orders the engine's stream after the sidecar's event,
            # and the drop it may make records and queries events there, which invalidates the capture.
            if self._unsettled is not None and not self.is_capturing():
                with self._link():
                    self._settle_off()
            return self._fallback(f"{OFF}{self.refusal}")
        n = positions.numel()
        if n % layout.QPR:
            return self._fallback(ROWS)
        r = n // layout.QPR
        if not 0 < r <= self._max_reqs:
            self._over_limit += 1  # replicated: every rank sees the same steps and the same agreed limit
            if not 0 < r <= layout.MAX_REQS_LIMIT or self._over_limit % RELEARN_EVERY:
                return self._fallback(REQS)
        if positions.dtype != torch.int64:
            return self._fallback(POSITIONS)
        if not self._fc.available():
            return self._fallback(NO_CONTEXT)
        attn = self._fc.attn_metadata()
        if attn is None:
            return self._fallback(NO_METADATA)
        if self.is_capturing():
            return self._fallback(CAPTURE)
        if spans_kv_groups(attn):
            if KV_GROUPS not in self._logged:  # the engine's KV cache layout: every step falls back, so said loudly
                self._logged.add(KV_GROUPS)
                log.warning("DSpark drafter sidecar unused: vLLM placed the draft's attention layers in several KV "
                            "cache groups, each with its own block table, and a step carries one; every draft step "
                            "runs the stock layers")
            return self._fallback(KV_GROUPS)
        layers = self._layers()
        paging = kv_paging(layers[0]) if layers else None
        meta, longest = read_step_metadata(attn, n, paging[1] if paging else None)
        if meta is None:
            return self._fallback(BAD_METADATA)
        start = time.perf_counter_ns()

        with self._link() as is_open:  # not held across the agreements: a close() waits for this rank only
            if not is_open:
                self._settle_off()  # a drop close() had to defer for an unsettled step
                ready, why, refused = False, CLOSED, False
            else:
                try:
                    ready, why, refused = self._prepare(layers)
                except Exception as e:  # noqa: BLE001  (raising here would leave the peers in the all-reduce)
                    ready, why, refused = False, self._internal("prepare", e), False
            gen = self.binder.generation
            status = self.connection.status
            view = status.limits.max_reqs if status is not None else 0
            # Until this step ends, the link stays as its peers are about to agree on it: a connect()
            # from another thread in between leaves it alone (one attribute store here and one below, ~30 ns).
            self._step_open = True
        try:
            agreed = all_min_ints(self._agree, [int(ready), -int(refused), gen or _NO_GEN, -gen, view or _NO_LIMIT])
            all_ready, any_refused, gen_min, gen_max, limit = agreed[0], -agreed[1], agreed[2], -agreed[3], agreed[4]
            if any_refused:
                with self._link():
                    self._disable(why if refused else PEER_REFUSES)
                return self._fallback(f"{OFF}{self.refusal}")
            if limit != _NO_LIMIT:
                self._max_reqs = limit
            if gen_max and gen_min != gen_max:
                with self._link() as is_open:
                    try:
                        if is_open:
                            self._catch_up(gen_max)
                    except Exception as e:  # noqa: BLE001  (raising here would skip the peers' next agreement)
                        self._internal("catch-up", e)
                return self._fallback(GENERATIONS)
            if not all_ready:
                return self._fallback(why if not ready else PEER_NOT_READY)
            if r > self._max_reqs:
                return self._fallback(REQS)
            if paging is not None and not tables_cover(meta, paging[1], longest):
                # Here, not in phase 1: the page size is this rank's cache's, and a rank whose provider raised
                # has none; it would go on to the pre-flight alone. All ranks are ready here, so each has read
                # its cache (the engine's one page size) and all decide alike, with no further agreement.
                return self._fallback(BAD_METADATA)

            step_id, self._next_step = self._next_step, self._next_step + 1
            # Outside the link, on every rank past the pre-flight alike: the engine's embedding is a collective
            # (vLLM's VocabParallelEmbedding all-reduces over the TP ranks). A rank closed since the pre-flight
            # skipped it inside the link while its peers ran theirs, which its next all-reduce then matched.
            embed_error: Exception | None = None
            if inputs_embeds is None:
                try:
                    inputs_embeds = self._model.embed_input_ids(input_ids)
                except Exception as e:  # noqa: BLE001  (reported below, in the link: the rank reaches the post-flight)
                    embed_error = e
            with self._link() as is_open:  # closed since the pre-flight: nothing is sent
                try:
                    if not is_open:
                        hidden, why = None, CLOSED
                    elif embed_error is not None:
                        hidden, why = None, self._engine_error(EMBED_FAILED, embed_error)
                    elif inputs_embeds.dim() != 2 or inputs_embeds.shape[0] != n:
                        # The engine's own input (replicated: every rank alike). Sent, the data plane refused it
                        # (it had broadcast one row into all n) as a shim error against the breaker.
                        hidden, why = None, BAD_EMBEDS
                    else:
                        hidden, why = self._run_step(step_id, r, positions, inputs_embeds, meta)
                except Exception as e:  # noqa: BLE001  (same: every rank must reach the post-flight agreement)
                    hidden, why = None, self._internal("step", e)
            if not all_min_ints(self._agree, [int(hidden is not None)])[0]:
                return self._fallback(why or PEER_FAILED)
            self.stats.record_forward(time.perf_counter_ns() - start, self._via_doorbell)
            return hidden
        finally:
            self._step_open = False

    def _layers(self) -> list[torch.Tensor]:
        """The engine's KV cache layers, or [] when its provider raises. The provider reads this rank's
        own state (vLLM's layer attributes), not the step's replicated inputs, so an exception here must
        neither escape maybe_forward nor end the step before the agreements (its peers would wait there
        for this rank): an empty cache is reported not ready (NO_KV) in the pre-flight instead."""
        try:
            return list(self._kv_caches() or [])
        except Exception as e:  # noqa: BLE001  (see above: the pre-flight turns it into None on every rank)
            self._engine_error("engine KV cache provider raised", e)
            return []

    def connect(self) -> str | None:
        """This rank's phase 2 alone, ahead of its first step: connect, bind the KV cache, attach the
        data plane. None when ready, else why not. No agreement with the peers is made here, so any rank
        may call it at any time (an engine at start-up, the bench); `maybe_forward` still checks and
        agrees on every step. A refusal found here does not turn this rank off: that is decided by all
        ranks together at a step's pre-flight (one rank off alone would skip the agreements its peers
        wait in).

        From another thread while a step is between its readiness check and its end, it returns
        STEP_IN_FLIGHT and changes nothing, once it has the link (while the step sends and waits for its
        answer it waits for it, bounded by the step deadline and late_grace_s): that step's peers agree on
        this rank's link as it was (its generation, its limits), and the step then sends on it. A re-bind or
        a dropped link in that gap sent a generation the peers had not agreed on, or raised inside the step.
        The step checks the link itself.
        Two connect() calls at once run one after the other (the link); the second finds it ready."""
        if not self.enabled:
            return f"{OFF}{self.refusal}"
        with self._link() as is_open:
            if not is_open:
                return CLOSED
            if not self.enabled:
                # Again, holding the link: the ranks may have agreed to turn off while this call waited for it
                # (a step's _disable released the link). Read only above, it re-bound the cache after the
                # turn-off's UnbindKV, and nothing released that binding or channel before close().
                return f"{OFF}{self.refusal}"
            if self._step_open:
                return STEP_IN_FLIGHT
            try:
                ready, why, refused = self._prepare(self._layers())
            except Exception as e:  # noqa: BLE001  (as in maybe_forward: it returns why, it does not raise)
                ready, why, refused = False, self._internal("prepare", e), False
            if refused:
                self._drop_link()  # the next step's pre-flight opens it again, finds the refusal, and agrees on it
        return None if ready else why

    def _lease_socket(self) -> str:
        """Where the sidecar rank hands out leases (StatusReport.lease_socket, read at each reconnect, as this
        process reaches it: client/lease.lease_path); "": none."""
        status = self.connection.status
        return lease_path(self.connection.endpoint, status.lease_socket) if status is not None else ""

    def _probe(self, deadline_s: float) -> bool:
        """The breaker's health probe: SERVING passes, and so does a sidecar that is NOT_SERVING because it
        refuses for good (its status says so, sidecar_refusal). Health alone kept such a sidecar (strict mode,
        come up REFUSED after the breaker opened while it loaded) behind the breaker for good: its refusal is
        read only by the readiness check's GetStatus, which the open breaker never let run, so the ranks never
        agreed to turn off and every step paid the pre-flight. Let through, the readiness check reads it."""
        return self.connection.probe_health(deadline_s, refuses=lambda status: sidecar_refusal(status) is not None)

    # Phase 2: this rank's readiness ----------------------------------------------------------------
    def _prepare(self, layers: list[torch.Tensor]) -> tuple[bool, str, bool]:
        """(ready, why not, sidecar refuses for good); every remote call here has a deadline."""
        cfg = self.config
        if self._unsettled is not None:
            stream, step_id = self._unsettled
            if not stream.settled(step_id):
                return False, UNSETTLED, False
            self._unsettled = None
            log.info("sidecar rank %d: late step %d settled", self.rank, step_id)
            if self._drop_pending:
                self._drop_link()  # asked for while the step was unsettled; the link reopens below
        if not layers:
            return False, NO_KV, False
        if not self.breaker.allow():
            return False, BREAKER, False
        if self.doorbell is not None and self.doorbell.replaced:
            log.warning("sidecar rank %d: the sidecar closed this engine's doorbell (another client attached one to "
                        "the rank, or it is shutting down); attaching again", self.rank)
            self._drop_link()
        if self.connection.stream_ended or (self.doorbell is not None and not self.doorbell.liveness.alive):
            # Reconnect and re-read the status: a restarted sidecar lost our binding. The doorbell's
            # liveness stream counts too: kept, the dead data plane stayed unreleased. (connection.stream()
            # hands an ended stream back as it is, so one that ends after this check breaks its step.)
            self._drop_link()
        if not self.connection.is_open:
            try:
                status = self.connection.open(cfg.connect_deadline_s)
            except grpc.RpcError as e:
                self.breaker.record_failure(f"connect: {e.code().name}")
                return False, UNREACHABLE, False
            b = self.binder.current
            if b is not None and not (status.kv.bound and status.kv.binding_id == b.binding_id
                                      and status.kv.generation == b.generation):
                self.binder.invalidate()  # a restarted sidecar: our binding is gone
            refusal = sidecar_refusal(status)
            if refusal is not None and status.kv.bound and self.binder.current is None:
                # A strict refusal judged on a binding this engine did not make: an engine gone without
                # UnbindKV (killed, crashed) whose facts were refused. Read as final, it kept every engine
                # after it off until the sidecar restarted. Ours are judged once bound: bind, read again.
                failed = self._bind(layers)
                if failed is not None:
                    return failed
                try:
                    status = self.connection.refresh_status(cfg.connect_deadline_s)
                except grpc.RpcError as e:
                    self.breaker.record_failure(f"status: {e.code().name}")
                    self._drop_link()
                    return False, UNREACHABLE, False
                refusal = sidecar_refusal(status)
            if refusal is not None:
                return False, refusal, True
        status = self.connection.status
        if status is not None and not status.serving:
            self._drop_link()  # re-read the status on the next try
            self.breaker.record_failure(f"state {status.state}")
            return False, NOT_SERVING, False
        if self.binder.needs_bind(layers):
            failed = self._bind(layers)
            if failed is not None:
                return failed
        if (self.config.transport == "doorbell" and self.doorbell is None and self._doorbell_off is None
                and time.monotonic() >= self._doorbell_retry_at):
            self._attach_doorbell(layers)
        # The step stream opens with a ready link, not at the first step sent: it ends when the sidecar process does
        # (stream_ended, above), the only sign that the status read at open() is an old process's. Opened at the
        # first step, a restart in between (connect() then a warm-up, or steps the peers kept back) went unseen,
        # and the restarted sidecar was served under the old status (its limits) for the link's life.
        stream = self.connection.stream()
        if not stream.alive:
            # Ended as it opened (another sidecar instance, refused, not taken in time): no step can go through
            # this link. Taken as ready, connect() answered None and the pre-flight sent the peers' copies to
            # their sidecar ranks' rendezvous (ABORTED at its deadline) while this rank's send broke at once.
            self.breaker.record_failure(f"{STREAM}: {stream.end}")
            self._drop_link()
            return False, STREAM, False
        return True, "", False

    def _bind(self, layers: list[torch.Tensor]) -> tuple[bool, str, bool] | None:
        """Bind the KV cache: None when bound, else _prepare's (ready, why not, refused for good)."""
        try:
            self.binder.bind(self.connection.stub, layers, self.config.bind_deadline_s, self._lease_socket())
        except NotShareable as e:
            # The engine's allocator, not the sidecar: no breaker failure, the link kept, nothing sent. Not
            # ready until the engine re-allocates the cache (then it is tried again): every rank falls back.
            if str(e) not in self._logged:
                self._logged.add(str(e))
                log.warning("sidecar rank %d: %s. Every draft step runs the stock layers until the KV cache is "
                            "allocated outside expandable segments (PYTORCH_CUDA_ALLOC_CONF="
                            "expandable_segments:False; deploy/OPERATIONS.md)", self.rank, e)
            return False, KV_NOT_SHAREABLE, False
        except BindError as e:
            if e.permanent:
                return False, f"{NOT_BINDABLE}{e}", True
            self.breaker.record_failure(str(e))
            self._drop_link()
            return False, BIND_FAILED, False
        return None

    def _attach_doorbell(self, layers: list[torch.Tensor]) -> None:
        """Register the step buffers and attach the doorbell; on refusal use the gRPC stream (logged once)."""
        status = self.connection.status
        assert status is not None
        dtype = _COMPUTE_DTYPES.get(status.model.compute_dtype)
        if dtype is None:
            # The step buffers hold the embeddings and the answer in the sidecar's compute dtype. Sized in the KV
            # cache's instead (an fp8 cache: embeddings squeezed to fp8), and an answer in them was held to no
            # dtype: the stream holds an unknown compute dtype's answer to the engine's own (_run_step).
            self._doorbell_off = (f"the sidecar names no compute dtype this shim knows "
                                  f"({status.model.compute_dtype!r}): using the gRPC stream")
            log.warning("sidecar rank %d: %s", self.rank, self._doorbell_off)
            return
        try:
            self.doorbell = DoorbellTransport(
                self.connection, int(status.model.hidden_size),
                min(int(status.limits.max_reqs or self._max_reqs), self.config.max_reqs),
                min((kv_paging(layers[0]) or (0, 0))[0], _MAX_DOORBELL_PAGES), dtype, layers[0].device,
                self.config.connect_deadline_s, self.binder.lease.held)
            log.info("sidecar rank %d: steps go through the shared-memory doorbell", self.rank)
        except (grpc.RpcError, DataPlaneError, HandleError, ValueError, RuntimeError, OSError, MemoryError) as e:
            # The sidecar's message too, not its code alone: a refusal such as STORE_ORDER says what to change
            # (FAILED_PRECONDITION by itself told the operator nothing).
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            if isinstance(e, grpc.RpcError) and e.code() in _PASSING:
                self._doorbell_retry_at = time.monotonic() + DOORBELL_RETRY_S
                log.warning("sidecar rank %d: data plane not set up (%s): the gRPC stream for now, asking again "
                            "in %.0f s", self.rank, detail, DOORBELL_RETRY_S)
                return
            self._doorbell_off = f"data plane unavailable ({detail}): using the gRPC stream"
            log.warning("sidecar rank %d: %s", self.rank, self._doorbell_off)

    def _catch_up(self, gen_max: int) -> None:
        """Bring this rank's binding generation up to its peers' (BindKV bumps it by one per call on
        each sidecar rank, and the sidecar runs a step only when all ranks name the same one). The layers
        through _layers: the engine's provider raising is its own fault, not the sidecar's (no bind).
        Not through an open breaker, as every other call (allow() may send its bounded health probe): the
        link stays open when steps time out or answer malformed, and the catch-up sent BindKV regardless."""
        if not self.breaker.allow():
            return
        layers = self._layers()
        binds = 0
        while (self.connection.is_open and layers and self.binder.generation < gen_max
               and binds < self.config.max_catchup_binds):
            binds += 1
            try:
                self.binder.bind(self.connection.stub, layers, self.config.bind_deadline_s, self._lease_socket())
            except NotShareable:
                return  # nothing was sent; the next readiness check reports it (_prepare)
            except BindError as e:
                if not e.permanent:
                    self.breaker.record_failure(str(e))
                    self._drop_link()
                # A refusal for good is the deployment's, not the sidecar's health (as in _bind): the binding is
                # forgotten, so the next readiness check binds, is refused the same way, and the pre-flight turns
                # every rank off. Counted, it opened the breaker on a rank a failure or two in, whose steps then
                # fell back as "breaker open" until a probe passed, and dropped the link for nothing.
                return

    # Phase 3: the step ------------------------------------------------------------------------------
    def _request(self, step_id: int, r: int, positions: torch.Tensor, embeds: torch.Tensor,
                 meta: StepMetadata, inline: bool) -> tuple[pb.DraftStepRequest, int]:
        """(The step, the bytes of its inline tensors); with inline=False the tensors are left for the data plane
        to fill in as region slices (0 bytes)."""
        b = self.binder.current
        assert b is not None
        # Whole milliseconds, floored (the sidecar gives up no later than the shim), but not below a whole
        # number the engine gave: DSPARK_STEP_DEADLINE_MS=1001 is 1.001 s, and 1.001 * 1000 is 1000.999...
        deadline_ms = int(self.config.step_deadline_s * 1000 + 1e-6)
        req = pb.DraftStepRequest(step_id=step_id, binding_id=b.binding_id, binding_generation=b.generation,
                                  num_requests=r, deadline_ms=deadline_ms)
        payload = 0
        if inline:
            dtype = self._compute_dtype()
            x = embeds.to(dtype) if dtype is not None else embeds
            for field, t in (("positions", positions), ("inputs_embeds", x),
                             ("seq_lens", meta.seq_lens), ("block_tables", meta.block_tables),
                             ("slot_mapping", meta.slot_mapping)):
                getattr(req, field).CopyFrom(codec.to_tensor_ref(t))
                payload += t.numel() * t.element_size()  # the ref's data (reading it back would copy it)
        return req, payload

    def _fits(self, req: pb.DraftStepRequest, payload: int) -> bool:
        """Whether an inline request, `payload` bytes of tensors, fits the largest message either end takes (this
        channel's and the sidecar's StatusReport.limits). Its tensors decide, but within _HEADER_BYTES of the
        limit: ByteSize is a whole serialization (~55 us at R=8, as much as the send's own), paid only there."""
        status = self.connection.status
        mine = self.connection.max_message_bytes
        limit = min(mine, (status.limits.max_message_bytes if status is not None else 0) or mine)
        return payload + _HEADER_BYTES <= limit or (payload <= limit and req.ByteSize() <= limit)

    def _run_step(self, step_id: int, r: int, positions: torch.Tensor, embeds: torch.Tensor,
                  meta: StepMetadata) -> tuple[torch.Tensor | None, str]:
        """Send one step and wait for its answer: (hidden, "") or (None, why)."""
        cfg = self.config
        bell = (self.doorbell if self.doorbell is not None and self.doorbell.alive
                and self.doorbell.fits(r, meta, embeds.shape[-1]) else None)
        req, payload = self._request(step_id, r, positions, embeds, meta, inline=bell is None)
        if bell is None and not self._fits(req, payload):
            # Sent, gRPC would end the whole stream (RESOURCE_EXHAUSTED), read as a broken link: a reconnect
            # and a breaker failure on every such step, for a fact of the step's size. Not sent; the same on
            # every rank (same R and table width), else the post-flight agreement makes it so.
            return None, TOO_LARGE
        stream: Any = bell if bell is not None else self.connection.stream()
        if not self._hold.wait_on(stream):  # either close() finds this waiter and interrupts it, or this sees close()
            return None, CLOSED
        try:
            if self.fault_hook is not None:
                self.fault_hook(step_id)
            if bell is not None:
                bell.send(req, embeds, positions, meta)
            else:
                stream.send(req)
            resp = stream.wait(step_id, cfg.step_deadline_s)
            if resp is None:
                # Until the answer comes the sidecar may still write this step's K/V: wait a
                # little longer, then remember the step and forward nothing until it settles.
                late = stream.wait(step_id, cfg.late_grace_s)
                if late is None:
                    self._unsettled = (stream, step_id)
                    log.warning("sidecar rank %d: step %d unanswered after %.3g s; forwarding paused "
                                "until it settles", self.rank, step_id, cfg.step_deadline_s + cfg.late_grace_s)
                self.breaker.record_failure(DEADLINE)
                return None, DEADLINE
        except StepInterrupted:
            # close() from another thread: the step was sent and may still run. close() lets it settle
            # (bounded) before it drops the link, as for any unsettled step.
            self._unsettled = (stream, step_id)
            return None, CLOSED
        except StreamBroken as e:
            self.breaker.record_failure(f"{STREAM}: {e}")
            self._drop_link()  # reconnect and re-read the status (a restarted sidecar?)
            return None, STREAM
        finally:
            self._hold.waited()
        if resp.WhichOneof("result") == "error":
            return None, self._step_error(resp.error)
        try:
            if bell is not None:
                bell.check_answer(resp, step_id, positions.numel(), embeds.shape[-1])
                hidden = bell.hidden()
            else:
                hidden = codec.from_tensor_ref(resp.hidden_states, "hidden_states", writable=True)
        except ValueError as e:
            self.breaker.record_failure(str(e))
            return None, BAD_ANSWER
        want = self._compute_dtype()
        if want is None and bell is None:
            # A compute dtype the shim cannot read (an older sidecar leaves it unset): any floating dtype
            # passed, and an fp32 engine got bf16 hidden states its next layer cannot take. The answer
            # must then have the engine's own dtype. (The doorbell's region has one dtype, which
            # check_answer holds the answer to.)
            want = embeds.dtype
        if (tuple(hidden.shape) != (positions.numel(), embeds.shape[-1]) or not hidden.is_floating_point()
                or (want is not None and hidden.dtype != want)):
            self.breaker.record_failure(f"hidden_states {list(hidden.shape)} {hidden.dtype}")
            return None, BAD_ANSWER
        self.breaker.record_success()
        self._via_doorbell = bell is not None
        if hidden.device != embeds.device or hidden.dtype != embeds.dtype:
            # The engine's own dtype, as its stock layers return: a sidecar computing in another (bf16 for an
            # fp16 or fp32 engine, which BindKV allows with an fp8 cache) answered in it, and the engine's
            # next layer refused those hidden states with a RuntimeError inside its step.
            hidden = hidden.to(device=embeds.device, dtype=embeds.dtype)
        return hidden, ""

    def _compute_dtype(self) -> torch.dtype | None:
        """The dtype the sidecar computes in (its status), which its hidden states must have."""
        status = self.connection.status
        return _COMPUTE_DTYPES.get(status.model.compute_dtype) if status is not None else None

    def _step_error(self, err: pb.StepError) -> str:
        code = grpc.StatusCode.UNKNOWN
        for c in grpc.StatusCode:
            if c.value[0] == err.code:
                code = c
        if code is grpc.StatusCode.FAILED_PRECONDITION and err.reason == "REFUSED":
            # Strict mode refusing since the status was read (its fast path refuses the binding itself, known
            # only once bound): re-read the status, whose refusal the next pre-flight agrees on. Taken as a
            # stale binding, every later step re-bound and was refused again, for good.
            self._drop_link()
        elif code is grpc.StatusCode.FAILED_PRECONDITION:
            self.binder.invalidate()  # stale or unknown binding: re-bind before the next step
        elif code is grpc.StatusCode.OUT_OF_RANGE or code is grpc.StatusCode.INVALID_ARGUMENT:
            if err.field not in ENGINE_METADATA:  # the engine's own metadata: that step falls back, nothing more
                self._drop_link()  # limits may have changed: re-read the status
                self.breaker.record_failure(err.message)
        elif code is not grpc.StatusCode.ABORTED and not (
                code is grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == "RESPONSE_TOO_LARGE"):
            # ABORTED: a peer's problem, not this sidecar rank's. RESPONSE_TOO_LARGE: this step's inline answer
            # would not fit --max-message-bytes (refused before it ran), a function of R and a healthy
            # sidecar's limit; counted, three such steps opened the breaker and the steps that fit fell back too.
            self.breaker.record_failure(err.message)
        key = sidecar_error(code)
        if key not in self._logged:
            log.info("sidecar rank %d: step failed: %s %s (%s)", self.rank, code.name, err.reason, err.message)
        return key

    # Bookkeeping -------------------------------------------------------------------------------------
    def _internal(self, where: str, e: Exception) -> str:
        """An unexpected error between the agreements: counted against the breaker, logged with its trace once."""
        key = f"{SHIM_ERROR}{where}: {type(e).__name__}"
        if key not in self._logged:
            self._logged.add(key)
            log.exception("DSpark drafter shim: %s (this step and later ones fall back while it repeats)", key)
        self.breaker.record_failure(key)
        return key

    def _engine_error(self, what: str, e: Exception) -> str:
        """An exception from the engine's own objects (its KV cache provider, its embedding): logged with its
        trace once, not counted against the breaker. Counted, the engine's embedding raising for a few steps
        (an out-of-memory) opened the breaker on a sidecar that had done nothing wrong, and the steps after it
        recovered fell back as "sidecar unavailable (breaker open)" until a health probe passed."""
        key = f"{what}: {type(e).__name__}"
        if key not in self._logged:
            self._logged.add(key)
            log.error("DSpark drafter shim: %s (steps fall back while it repeats)", key, exc_info=e)
        return key

    def _fallback(self, why: str) -> None:
        self.stats.record_fallback(why)
        if why not in self._logged:
            self._logged.add(why)
            log.info("DSpark drafter step on the stock layers: %s (logged once)", why)
        return None

    def _disable(self, why: str) -> None:
        self.enabled, self.refusal = False, why
        log.warning("DSpark drafter sidecar off for this process: %s", why)
        self._release()

    def _settle_off(self) -> None:
        """Off for good, so _prepare never runs again: a drop deferred by an unsettled step is made
        here, once the step settles (else the page, the regions and the channel stay until exit). Never raises:
        maybe_forward calls it outside its try, and after close() before the pre-flight its peers wait in."""
        try:
            if self._unsettled is not None and self._unsettled[0].settled(self._unsettled[1]):
                self._unsettled = None
                if self._drop_pending:
                    self._drop_link()
        except Exception as e:  # noqa: BLE001  (a driver refusing the wait a late answer queues: tried again next call)
            self._internal("settling a late step", e)

    def invalidate_binding(self) -> None:
        """Forget the binding: re-bind before the next step. For an integration that knows its KV cache was
        remapped in place (vLLM's sleep mode wake-up keeps the tensors and their addresses, so the identity
        check cannot see it) and calls this on every rank. Nothing in this package calls it: vLLM gives the
        draft model no wake-up hook (FAILURE_MODES.md, "vLLM sleep mode")."""
        self.binder.invalidate()

    def _release(self) -> None:
        self.binder.release(self.connection.stub, self.config.connect_deadline_s)
        self._drop_link()
        # Last: its end releases at the sidecar what the calls above did not (a call that failed; buffers whose
        # release waits for an unsettled step), and it was taken for this link's sidecar only.
        self.binder.lease.close()

    def _drop_link(self) -> None:
        """Close the data plane and the channel; the next step reconnects (and re-reads the status).

        Not while a step is unsettled: its transport is the only thing that can tell when the sidecar
        is done with it (a closed doorbell page has no sequence word left to read, and a cancelled
        stream would read as settled while the sidecar may still write that step's K/V). The drop
        then waits for the step to settle (`_prepare`)."""
        if self._unsettled is not None:
            self._drop_pending = True
            return
        self._drop_pending = False
        if self.doorbell is not None:
            doorbell, self.doorbell = self.doorbell, None
            try:
                doorbell.close()
            except Exception as e:  # noqa: BLE001  (e.g. the driver refusing the page's unregistration: maybe_forward
                self._internal("closing the data plane", e)  # reaches this outside its try (_disable), and must not raise)
        self._doorbell_off = None
        # A passing refusal's wait was the old link's sidecar's: the next link's (maybe a restarted process) is asked
        # at its first step, not up to DOORBELL_RETRY_S later with its steps on the gRPC stream meanwhile.
        self._doorbell_retry_at = 0.0
        self.connection.close()

    def close(self) -> None:
        """The engine is done with the sidecar (shutting down, or freeing its KV cache for good): release
        the binding and the link. Final and idempotent; from any thread, at any time.

        A step waiting for its answer on another thread is woken (its maybe_forward returns None), and
        close() takes the link only once that thread has left it: nothing is unmapped under it. The
        step may still run on the sidecar, so close() gives it up to late_grace_s to settle; a step
        still unsettled then keeps its link (see _drop_link) until a later maybe_forward finds it
        settled, or the process exits. Every maybe_forward after close() is None (the rank is not
        ready at the pre-flight, so its peers fall back with it) and makes no remote call. Bounded:
        link.CLOSE_WAIT_S for the link, late_grace_s, then the release's own deadlines (UnbindKV,
        UnregisterBuffers) and, on a GPU, the data plane's CLOSE_WAIT_S."""
        self._hold.close()

    def _finish_close(self) -> None:
        """close()'s release, holding the link: an unsettled step (one close() woke) first gets
        late_grace_s to settle, then the binding and the link go. Never raises (it may run at the end of
        a maybe_forward, or in an engine's shutdown hook)."""
        try:
            if self._unsettled is not None:
                stream, step_id = self._unsettled
                deadline = time.monotonic() + self.config.late_grace_s
                while not stream.settled(step_id) and time.monotonic() < deadline:
                    time.sleep(0.005)
                if stream.settled(step_id):
                    self._unsettled = None
                else:
                    log.warning("sidecar rank %d: closed with step %d unsettled; its link stays until it "
                                "settles", self.rank, step_id)
        except Exception as e:  # noqa: BLE001  (logged with its trace: see above)
            self._internal("close", e)  # the step stays unsettled: its link is kept, the rest released below
        # Whatever the look at the step did (a driver refusing the wait a late answer queues): skipped, no UnbindKV
        # was sent and the lease was never ended, so the sidecar kept the binding, the regions and the doorbell
        # made under it for the rest of the engine's life (close() is final: nothing releases them later).
        try:
            self._release()
        except Exception as e:  # noqa: BLE001  (as above)
            self._internal("close", e)

    # The link, one thread at a time ----------------------------------------------------------------------
    def _link(self) -> Link:
        """`with self._link() as is_open:` holds the link for the block (link.Link); is_open: whether the shim
        is still open (after close(): only the bookkeeping of a deferred drop may use it)."""
        return self._hold
