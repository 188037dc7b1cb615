"""Draft-step layout constants and launch grouping, imported by every other part."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# Query rows per request: the anchor plus 6 noise rows (dspark_block_size, and the
# engine's num_speculative_tokens).
QPR = 7
# Requests per kernel launch: the fused kernels are tiled for at most 8 x 7 = 56 rows.
LAUNCH_REQS = 8
# Default largest step forwarded to the sidecar; larger steps run the engine's stock
# layers. Configurable per deployment (`--max-reqs`), bounded by MAX_REQS_LIMIT.
DEFAULT_MAX_REQS = 32
MAX_REQS_LIMIT = 256
# Largest tensor-parallel size `serve` takes (and so the most ranks a probe or `status` looks at).
MAX_TP = 64
# Seeds of the synthetic checkpoint (serve --seed, demo --seed): drafter/checkpoint.py seeds torch's generator
# with seed * 1_000_003 + crc32(key), which must stay in its 64-bit range.
SEED_LIMIT = 1 << 32


def launch_groups(num_reqs: int, launch_reqs: int = LAUNCH_REQS) -> list[tuple[int, int]]:
    """Split requests [0, num_reqs) into consecutive launches of at most `launch_reqs`.

    Returns (first_request, end_request) pairs; e.g. 17 -> [(0, 8), (8, 16), (16, 17)].
    """
    if num_reqs < 0:
        raise ValueError(f"num_reqs must be >= 0, got {num_reqs}")
    return [(s, min(s + launch_reqs, num_reqs)) for s in range(0, num_reqs, launch_reqs)]


# Sockets: `dspark-sidecar serve --socket-dir DIR` puts rank r on DIR/rank{r}.sock, and an engine
# rank reaches it as the gRPC target unix:DIR/rank{r}.sock.
SUN_PATH_MAX = 107  # bytes of a unix socket path: sun_path holds 108 with its NUL
PID_MAX = 1 << 22  # Linux's largest pid_max (kernel.pid_max): a larger number is no process id


def folder_flag(text: str) -> Path:
    """A folder flag's value (--socket-dir, --checkpoint, --out-dir, ...) as argparse's `type`: Path('') is the
    working directory, so `--socket-dir "$UNSET_VAR"` served (or probed) there in silence, and
    `--checkpoint "$UNSET_VAR"` read whatever checkpoint lay there, where the same empty DSPARK_* variable is
    refused (cli.py _env). argparse says it, exit 2."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty; give a folder (the working directory is '.')")
    return Path(text)


def rank_socket(socket_dir: str | Path, rank: int) -> Path:
    """Rank r's unix socket path in `socket_dir`."""
    return Path(socket_dir) / f"rank{rank}.sock"


def rank_lease_socket(socket_dir: str | Path, rank: int) -> Path:
    """Rank r's lease socket path in `socket_dir` (server/lease.py, StatusReport.lease_socket)."""
    return Path(socket_dir) / f"rank{rank}.lease"


def socket_dir_problem(socket_dir: str | Path, tp: int) -> str | None:
    """Why ranks 0..tp-1's sockets in `socket_dir` cannot be served or reached, or None.

    gRPC parses a `unix:PATH` target as a URI: '?' and '#' end its path on the client side only
    (the ranks bind and go SERVING while no engine ever connects), ',' splits it into two
    addresses, and '%XX' is decoded (the bind then fails as "in use"). A path longer than
    sun_path fails in the kernel, with an error that names no setting. A path that starts with '//'
    (pathlib keeps exactly two) makes unix://NAME/..., which the client refuses as a target with an
    authority while the ranks bind it and go SERVING. A name that is not UTF-8 cannot be a gRPC target at all.
    The longest of a rank's socket names is judged: its lease socket's, one byte longer than its gRPC socket's
    (a folder whose gRPC sockets just fitted failed each rank on the lease socket's bind, after its shard loaded)."""
    return socket_path_problem(rank_lease_socket(socket_dir, tp - 1), socket_dir)


def socket_path_problem(path: str | Path, folder: str | Path | None = None) -> str | None:
    """Why the gRPC target unix:`path` cannot reach a socket at `path` (socket_dir_problem's reasons), or None.
    `folder`: the socket folder that holds it, which the words then name (serve's --socket-dir)."""
    named, noun = (path, "path") if folder is None else (folder, "folder")
    path = str(Path(path))  # as socket_dir_problem's: '///x' is '/x' (unix:///x is a valid target), '//x' stays
    odd = sorted(set("?#,%") & set(path))
    if odd:
        return (f"{named} holds {', '.join(map(repr, odd))}; gRPC reads '?', '#', ',' or '%' in a unix: "
                f"target as URI syntax, choose a {noun} without them")
    if path.startswith("//"):
        return (f"{named} starts with '//': gRPC reads unix:{path} as a target with an authority and "
                f"refuses it; start the {noun} with a single '/'")
    try:
        size = len(path.encode())
    except UnicodeEncodeError:  # a byte of the name that is not UTF-8 (argv and os.listdir keep it as a surrogate)
        return (f"{os.fsencode(str(named))!r} is not UTF-8: gRPC takes a unix: target as UTF-8 text, so no "
                f"client could reach a socket there; choose a {noun} whose name is UTF-8")
    if size > SUN_PATH_MAX:
        return f"{path} is {size} bytes, a unix socket path holds at most {SUN_PATH_MAX}; choose a shorter {noun}"
    return None
