"""Health probe for exec-style liveness/readiness checks: exit 0 iff every asked rank is SERVING."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark_sidecar import layout
from dspark_sidecar.proto import SERVICE_NAME
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.proto.rich_status import error_reason


MAX_PROBE_TIMEOUT_S = 86400


def check(target: str, timeout_s: float = 2.0, service: str = SERVICE_NAME) -> str:
    """The health status name of one endpoint ("SERVING", "NOT_SERVING", "SERVICE_UNKNOWN: why", or
    "UNREACHABLE: CODE: why")."""
    try:
        with grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                       timeout=timeout_s)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            # grpc.health.v1's Check answer for a service the server has no status for (Watch's SERVICE_UNKNOWN):
            # a server answered. Printed "UNREACHABLE: NOT_FOUND", it read as a socket file not found.
            return (f"SERVICE_UNKNOWN: this server answers grpc.health.v1 but has no status for {service}: not a "
                    "DSpark sidecar rank (another server on its socket?)")
        return f"UNREACHABLE: {unreachable(err, timeout_s)}"


def not_serving_why(target: str, timeout_s: float = 2.0) -> str:
    """The rank's own words for its NOT_SERVING ("STATE" or "STATE: why", from GetStatus), or "" when it gives
    none. Health reads the same for a rank still loading, draining, refused for good (--strict-refusal) or
    waiting on a peer that exited; the probe's line is all a person sees of a failed probe (a Kubernetes
    probe's event), so it says which, and why, as the shim reads it (client/connection.py probe_health)."""
    try:
        with grpc.insecure_channel(target) as ch:
            st = pb_grpc.DrafterSidecarStub(ch).GetStatus(pb.GetStatusRequest(), timeout=timeout_s)
    except grpc.RpcError as err:
        # Loading its shard, a rank has no status to give yet and says so in its error (ErrorInfo reason LOADING,
        # server/app.py LateServicer); a rank gone since the health check says nothing: health's word stands.
        return error_reason(err)
    # REFUSED's why is the fast path's refusal; PEER_SILENT's and STEP_STUCK's are state_reason (proto StatusReport).
    why = st.state_reason or (st.fast_path_refusal if st.state == "REFUSED" else "")
    why = one_line(why)  # one line a rank, whatever sidecar sent it
    return f"{st.state}: {why}" if why else st.state


def one_line(text: str) -> str:
    """`text` with its lines joined by spaces (blank ones dropped): a reason quoting an error (a HIP error's advice,
    a compiler's diagnostics) broke the probe's line for its rank, the rest reading as lines of no rank."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def unreachable(err: grpc.RpcError, timeout_s: float) -> str:
    """"CODE: why" for a call that reached no sidecar (this module, `dspark-sidecar status`). The code alone read
    the same (UNAVAILABLE) for a socket file that is not there, a stale one nobody listens on (connection
    refused) and one the caller may not open (permission denied: not in the socket group)."""
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # gRPC's words are the code's ("Deadline Exceeded")
        return f"DEADLINE_EXCEEDED: no answer within {timeout_s:g} s (--timeout): a stopped or hung rank?"
    details = err.details()
    return f"{err.code().name}: {details}" if details else err.code().name


def probe_flags_problem(tp: int, timeout_s: float) -> str | None:
    """Why a probe of ranks 0..tp-1 cannot use these --tp / --timeout (this module, `dspark-sidecar status`)."""
    # --tp 0 (or below) checked no rank and exited 0: a probe that passed with no sidecar at all.
    if tp < 1:
        return f"--tp: must be at least 1, got {tp}"
    # serve's range: a DSPARK_TP of 4000 or a typo probed every rank one after another, each --timeout long where
    # the folder's socket hangs, printing a line per rank no serve can have.
    if tp > layout.MAX_TP:
        return f"--tp: must be 1..{layout.MAX_TP} (serve's), got {tp}"
    # 0, a negative or nan deadline made every live rank UNREACHABLE (DEADLINE_EXCEEDED), naming no flag.
    if not 0 < timeout_s < float("inf"):
        return f"--timeout: must be a number of seconds above 0, got {timeout_s}"
    # gRPC holds a deadline as int64 nanoseconds: past ~292 years it overflowed and expired at once, a live rank
    # UNREACHABLE "within 1e+10 s". A probe that waits a day is already a typo.
    if timeout_s > MAX_PROBE_TIMEOUT_S:
        return f"--timeout: at most {MAX_PROBE_TIMEOUT_S} s, got {timeout_s:g}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_sidecar.server.healthcheck", description=__doc__)
    ap.add_argument("--socket", help="one rank's unix socket path")
    ap.add_argument("--socket-dir", type=layout.folder_flag, default=Path("/tmp/dspark-sidecar"))
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--all-ranks", action="store_true", help="check rank0..rank{tp-1}.sock in --socket-dir")
    ap.add_argument("--timeout", type=float, default=2.0)
    a = ap.parse_args(argv)
    if why := probe_flags_problem(a.tp, a.timeout):
        ap.error(why)
    one = a.socket and not a.all_ranks
    # A path no gRPC client can reach (longer than sun_path, '?', ',', '%XX', a leading '//'): every rank read
    # UNREACHABLE (UNKNOWN) under gRPC's own log lines, or, with ',' or '%XX', the probe asked another
    # folder's socket, whose SERVING passed it. serve refuses such a folder; so does the probe, saying why.
    if why := (layout.socket_path_problem(a.socket) if one else layout.socket_dir_problem(a.socket_dir, a.tp)):
        ap.error(f"{'--socket' if one else '--socket-dir'}: {why}")
    paths = [a.socket] if one else [str(layout.rank_socket(a.socket_dir, r)) for r in range(a.tp)]
    ok = True
    for p in paths:
        status = check(f"unix:{p}", a.timeout)
        ok &= status == "SERVING"
        if status == "NOT_SERVING" and (why := not_serving_why(f"unix:{p}", a.timeout)):
            status += f" ({why})"
        print(f"{p}: {status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
