"""Why a draft step ran on the engine's stock layers: the shim's fallback reasons, and the sidecar's answers as reasons.

Each reason is a key of ShimStats.fallbacks and the text of the shim's log line the first time a step falls back
for it: fixed text an operator can search for (deploy/OPERATIONS.md, "Fallback reasons", lists each with what to
do; tests/client/test_reasons.py keeps the two in step). A reason that carries a detail (the sidecar's status code,
an exception's type) is one of these prefixes and that detail.
"""

from __future__ import annotations

import grpc

from dspark_sidecar.proto import sidecar_pb2 as pb

# Fallback reasons (the keys of ShimStats.fallbacks).
ROWS = "rows not a multiple of 7"
REQS = "R outside 1..max_reqs"
POSITIONS = "positions not int64"
NO_CONTEXT = "no forward context"
NO_METADATA = "no attention metadata"
CAPTURE = "CUDA graph capture"
BAD_METADATA = "attention metadata unusable"
KV_GROUPS = "draft layers span several KV cache groups"  # a step carries one table and slot mapping for all layers
NO_KV = "KV cache not allocated"
UNSETTLED = "previous step unsettled"
BREAKER = "sidecar unavailable (breaker open)"
UNREACHABLE = "sidecar unreachable"
NOT_SERVING = "sidecar not serving"
BIND_FAILED = "KV bind failed"
KV_NOT_SHAREABLE = "KV cache memory cannot be shared (expandable_segments or cuMem allocator)"
PEER_NOT_READY = "peer engine rank not ready"
GENERATIONS = "binding generations differ"
STREAM = "stream broken"
DEADLINE = "step deadline exceeded"
BAD_ANSWER = "malformed answer"
TOO_LARGE = "request over the sidecar's max_message_bytes"
PEER_FAILED = "peer engine rank got no result"
EMBED_FAILED = "engine embedding raised"  # + the exception's type: the engine's own fault, not the sidecar's
BAD_EMBEDS = "inputs_embeds not the step's [n, hidden] rows"  # the engine's input: nothing sent, not counted
CLOSED = "shim closed"
STEP_IN_FLIGHT = "a step is in flight on another thread"  # connect()'s answer only: never a fallback reason
SHIM_ERROR = "shim error in "  # + where and the exception's type (_internal): an unexpected error of the shim's own
# Off for the whole process (DrafterShim.refusal): every step's reason is OFF + why, one of the deployment's refusals
# (client/config.py, client/vllm_refusals.py), SIDECAR_REFUSES + the sidecar's, PEER_REFUSES, or NOT_BINDABLE + why.
OFF = "off: "
SIDECAR_REFUSES = "sidecar refuses: "  # + the sidecar's fast_path_refusal (strict mode) or its state
PEER_REFUSES = "a peer engine rank's sidecar refuses"
NOT_BINDABLE = "KV cache cannot be bound: "  # + BindError's permanent reason
# How a sidecar's fast_path_refusal starts before any BindKV on a host that passes its own checks (server/refusal.py
# AWAITING_BIND, its stable words up to the parenthesis): no refusal, never a fallback reason (sidecar_refusal).
AWAITING_BIND = "no engine bound yet"


def sidecar_error(code: grpc.StatusCode) -> str:
    """The fallback reason of a step the sidecar answered with a StepError of `code` (_step_error)."""
    return f"sidecar {code.name}"


# Fields of a step's attention metadata, which the engine wrote: a step the sidecar refuses naming one of them
# is the engine's at fault for that step, not the sidecar's limits or health. vLLM's DSpark speculator clamps a
# request's block positions at max_model_len - 1 within 7 tokens of its end, and writes -1 slots for null blocks;
# taken as the other refusals are (the link dropped, a breaker failure), a few such steps opened the breaker for
# every request. The shim cannot check positions itself without reading them back from the engine's GPU.
ENGINE_METADATA = frozenset({"positions", "seq_lens", "block_tables", "slot_mapping"})


def sidecar_refusal(status: pb.StatusReport) -> str | None:
    """The sidecar's own process-wide refusal (strict mode: a refused deployment is state REFUSED, NOT_SERVING,
    with its reason), or None. Every other state passes: on its way to serving or out of it for a while (LOADING,
    DRAINING, PEER_SILENT, STEP_STUCK, ""), and any state this shim does not know."""
    if status.serving:
        return None
    # REFUSED alone, as sidecar.proto says a client reads the states. Any state outside a list of transient ones
    # with a fast_path_refusal was read as refused for good, and every Triton host's status says "not gfx950" in
    # every state: a newer sidecar's new state, or an older one's GetStatus race (serving false, state SERVING),
    # turned the shim off for the life of the engine.
    # Not with AWAITING_BIND, which is no refusal (proto StatusReport.fast_path_refusal): a GetStatus between a
    # refused binding's release (UnbindKV, its engine's lease ending) and the health publish after it answered
    # REFUSED with it, and the next engine, configured right, turned off for good ("sidecar refuses: no engine
    # bound yet (...)"). Passing, it is NOT_SERVING for that step and the status is read again.
    if status.state == "REFUSED" and not status.fast_path_refusal.startswith(AWAITING_BIND):
        return f"{SIDECAR_REFUSES}{status.fast_path_refusal or status.state}"
    return None
