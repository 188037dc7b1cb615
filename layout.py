"""Draft-step layout constants and launch grouping, imported by every other part."""

from __future__ import annotations

# Query rows per request: the anchor plus 6 noise rows (dspark_block_size, and the
# engine's num_speculative_tokens).
QPR = 7
# Requests per kernel launch: the fused kernels are tiled for at most 8 x 7 = 56 rows.
LAUNCH_REQS = 8
# Default largest step forwarded to the sidecar; larger steps run the engine's stock
# layers. Configurable per deployment (`--max-reqs`), bounded by MAX_REQS_LIMIT.
DEFAULT_MAX_REQS = 32
MAX_REQS_LIMIT = 256


def launch_groups(num_reqs: int, launch_reqs: int = LAUNCH_REQS) -> list[tuple[int, int]]:
    """Split requests [0, num_reqs) into consecutive launches of at most `launch_reqs`.

    Returns (first_request, end_request) pairs; e.g. 17 -> [(0, 8), (8, 16), (16, 17)].
    """
    if num_reqs < 0:
        raise ValueError(f"num_reqs must be >= 0, got {num_reqs}")
    return [(s, min(s + launch_reqs, num_reqs)) for s in range(0, num_reqs, launch_reqs)]
