"""Random steps' metadata for the index-check parity tests (the host's checks, the GPU program and its spec)."""

from __future__ import annotations

import numpy as np


def random_step(rng: np.random.Generator):
    """A random step (positions [n], seq_lens [R], tables [R, w], slots [n], page_size, window, num_pages): valid,
    then 0-2 faults of the kinds an engine sends (rows off by one or a page, short or table-filling lengths, pages
    outside the cache, slots off their place or -1, a slot another request also names)."""
    q = 7
    R = int(rng.integers(1, 7))
    ps = int(rng.choice([1, 2, 3, 4, 16]))
    window, pages = int(rng.choice([1, 8, 16, 32])), int(rng.integers(1, 40))
    L = rng.integers(q, 60, R).astype(np.int32)
    width = max(1, int((-(-L // ps)).max() + rng.integers(-1, 3)))
    tables = (rng.permutation(max(pages, R * width))[: R * width].reshape(R, width) % pages).astype(np.int32)
    P = L[:, None].astype(np.int64) - q + np.arange(q)

    def slots(r, p):  # each position's place through request r's row (rows [R, 1] or one request's index)
        return tables[r, np.clip(p // ps, 0, width - 1)].astype(np.int64) * ps + p % ps

    S = slots(np.arange(R)[:, None], P)
    for _ in range(int(rng.integers(0, 3))):
        k, r, j = int(rng.integers(0, 8)), int(rng.integers(0, R)), int(rng.integers(0, q))
        if k == 0:  # a row off by a key; half the time its slot follows it (only the positions rule refuses it)
            P[r, j] += int(rng.choice([-1, 1]))
            if rng.integers(0, 2):
                col = min(max(int(np.trunc(P[r, j] / ps)), 0), width - 1)  # as the program: C's // and %
                S[r, j] = int(tables[r, col]) * ps + int(np.fmod(P[r, j], ps))
        elif k == 1:
            L[r] = int(rng.integers(-3, 9))
        elif k == 2:
            tables[r, int(rng.integers(0, width))] = int(rng.choice([-1, pages, -(1 << 31)]))
        elif k == 3:
            S[r, j] = int(rng.choice([-1, S[r, j] + 1]))
        elif k == 4:
            S[(r + 1) % R, j] = S[r, j]
        elif k == 5:  # rows and slots at a length that fills the table, or passes it by a key or two
            L[r] = width * ps + int(rng.integers(-1, 3))
            P[r] = L[r] - q + np.arange(q)
            S[r] = slots(r, P[r])
        elif k == 6:
            P[r] -= ps
        else:
            S[r] = -1
    return P.reshape(-1), L, tables, S.reshape(-1), ps, window, pages
