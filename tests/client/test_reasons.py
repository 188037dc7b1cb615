"""client/reasons.py: every fallback reason an engine can log is in the operator guide's table, and only those."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from dspark_sidecar.client import reasons
from dspark_sidecar.proto import sidecar_pb2 as pb

OPERATIONS = Path(reasons.__file__).resolve().parents[1] / "deploy" / "OPERATIONS.md"
NOT_FALLBACKS = {"STEP_IN_FLIGHT", "AWAITING_BIND"}  # connect()'s answer to its caller, and the sidecar's
# words for no refusal yet: never a step's reason


def _constants() -> dict[str, str]:
    return {k: v for k, v in vars(reasons).items() if k.isupper() and isinstance(v, str) and k not in NOT_FALLBACKS}


def _stem(text: str) -> str:
    """A reason, or a table row's spelling of a prefix ("off: ...", "shim error in ..."), without the detail."""
    return text.removesuffix("...").rstrip().rstrip(":").rstrip()


def _table_reasons() -> list[str]:
    """The code spans of the first column of OPERATIONS.md's "Fallback reasons" table."""
    section = OPERATIONS.read_text().split("### Fallback reasons", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows, "OPERATIONS.md has no fallback reasons table"
    return [span for row in rows for span in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


@pytest.mark.parametrize("name", sorted(_constants()))
def test_every_reason_is_in_the_operator_guide_s_table(name):
    """An operator greps the engine's log line for its reason: one the guide does not list (it listed none before
    session 62) leaves them reading the shim's source to learn what to do."""
    assert _stem(_constants()[name]) in {_stem(span) for span in _table_reasons()}, (name, _constants()[name])


def test_the_table_lists_no_reason_the_shim_cannot_give():
    """A reason renamed in the code and not in the guide: the guide's row then matches no log line."""
    known = {_stem(v) for v in _constants().values()}
    codes = {reasons.sidecar_error(code) for code in grpc.StatusCode}
    known.add(_stem(reasons.sidecar_error(grpc.StatusCode.OK).removesuffix("OK")))  # the row for every code
    stale = [span for span in _table_reasons() if _stem(span) not in known and span not in codes]
    assert not stale, stale


# A reason with a detail: what the shim puts between its prefix and the detail (shim._engine_error adds ": type").
DETAIL_JOINTS = {"OFF": "", "SIDECAR_REFUSES": "", "NOT_BINDABLE": "", "SHIM_ERROR": "", "EMBED_FAILED": ": "}


@pytest.mark.parametrize("name", sorted(DETAIL_JOINTS))
def test_a_reason_with_a_detail_is_in_the_table_spelled_as_its_log_line_starts(name):
    """_stem drops a trailing colon and space: a prefix that lost its ": " (the log line "KV cache cannot be
    boundFAILED_PRECONDITION ...") or gained one more ("engine embedding raised: : MemoryError") still matched the
    table's row, which an operator's search then missed."""
    assert f"{getattr(reasons, name)}{DETAIL_JOINTS[name]}..." in _table_reasons(), name


def test_a_sidecar_step_error_reason_names_its_code():
    assert reasons.sidecar_error(grpc.StatusCode.INVALID_ARGUMENT) == "sidecar INVALID_ARGUMENT"


@pytest.mark.parametrize("state, refusal, want", [
    ("SERVING", "", None),
    ("LOADING", "", None),
    ("DRAINING", "FlyDSL fast path not built", None),  # transient: on its way out, not refused for good
    ("REFUSED", "", "sidecar refuses: REFUSED"),
    ("REFUSED", "kv dtype fp8", "sidecar refuses: kv dtype fp8"),
    ("NOT_SERVING", "kv dtype fp8", None),  # no state the sidecar gives: passing (below)
])
def test_a_sidecar_refuses_for_good_only_outside_its_transient_states(state, refusal, want):
    status = pb.StatusReport(serving=state == "SERVING", state=state, fast_path_refusal=refusal)
    assert reasons.sidecar_refusal(status) == want


# Written out: the states sidecar.proto names as passing (LOADING, DRAINING,
# PEER_SILENT, STEP_STUCK), the lifecycle's others, and "" (a status that names no state: an older sidecar's).
@pytest.mark.parametrize("state", ["", "STARTING", "LOADING", "WARMING", "DRAINING", "STOPPING", "PEER_SILENT",
                                   "STEP_STUCK"])
def test_no_transient_state_is_a_refusal_whatever_fast_path_refusal_says(state):
    """A sidecar not serving for a while names why its fast path is not in use ("no engine bound yet (...)" before
    any BindKV): read as a refusal for good, the shim turned off for the process on a sidecar about to serve."""
    status = pb.StatusReport(serving=False, state=state, fast_path_refusal="no engine bound yet (host checks pass)")
    assert reasons.sidecar_refusal(status) is None


# No state the sidecar gives today: a state a newer sidecar may add, a health status name, and an older sidecar's
# GetStatus that read serving and state apart (serving false, state SERVING: tests/server/test_get_status.py).
@pytest.mark.parametrize("state", ["NOT_SERVING", "COMPILING", "SERVING"])
def test_a_state_the_shim_does_not_know_is_passing_not_a_refusal_for_good(state):
    """sidecar.proto: "A client reads every state but REFUSED as passing." Any Triton host's status names
    "not gfx950" in every state, and a state outside the shim's list with it was read as a refusal for good: the
    shim turned off for the life of the engine on a sidecar that serves (portable backend) or soon will."""
    status = pb.StatusReport(serving=False, state=state, fast_path_refusal="not gfx950")
    assert reasons.sidecar_refusal(status) is None
    assert reasons.sidecar_refusal(pb.StatusReport(serving=False, state="REFUSED", fast_path_refusal="not gfx950")) \
        == "sidecar refuses: not gfx950"


def test_refused_with_the_sidecar_s_no_engine_bound_yet_is_passing_not_a_refusal_for_good():
    """"no engine bound yet (...)" is no refusal (proto StatusReport.fast_path_refusal; health never refuses for
    it). A GetStatus between a refused binding's release (UnbindKV, its engine's lease ending) and the publish after
    it answers state REFUSED with it: read as a refusal for good, the next engine (configured right) turned off for
    the life of its process with "sidecar refuses: no engine bound yet (...)"."""
    from dspark_sidecar.server.refusal import AWAITING_BIND

    for why in (AWAITING_BIND, "no engine bound yet (host checks pass)"):  # the current and an older sidecar's words
        assert reasons.sidecar_refusal(pb.StatusReport(serving=False, state="REFUSED", fast_path_refusal=why)) is None
    # A refusal of the binding itself is still one.
    assert reasons.sidecar_refusal(pb.StatusReport(serving=False, state="REFUSED", fast_path_refusal="DP > 1")) \
        == "sidecar refuses: DP > 1"
