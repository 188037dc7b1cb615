"""The harness's request mix: requests join and leave, pages are handed out, contexts grow; replicated on every rank."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.kv_cache import block_slots

Q = layout.QPR


def whole(v: object) -> bool:
    """An int, not a bool (nor a float that happens to be whole): a count given to range() or randint(), a round or
    rank compared with `==` (client/harness.py reads it too)."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class MixConfig:
    """Shape of the request mix. Every rank draws from the same seeded RNG, so all see the same steps."""

    seed: int = 0
    max_active: int = 12  # requests in flight at most (above the sidecar's max_reqs on purpose)
    join_p: float = 0.35  # per round: one request joins
    burst_p: float = 0.04  # per round: a burst of joins up to max_active
    short_prompt: tuple[int, int] = (1, 160)
    mid_prompt: tuple[int, int] = (300, 1200)
    long_prompt: tuple[int, int] = (4000, 4120)  # contexts that cross the 4096 window as they grow
    mid_p: float = 0.15
    long_p: float = 0.05
    budget: tuple[int, int] = (8, 80)  # rounds a request stays (if its pages last)
    first_long: bool = True  # request 0 starts just below the window

    def __post_init__(self) -> None:
        # max_active 0 admitted no request and the round failed in block_table (max() of nothing); a negative
        # prompt gave negative positions; a reversed range failed only when first drawn from.
        # Counts, so ints (not bools): max_active 2.5 passed `>= 1` and the first burst failed in range(), a float
        # prompt bound in randint or as a position, in every engine rank mid-run (after it mapped its KV cache).
        if not whole(self.max_active) or self.max_active < 1:
            raise ValueError(f"max_active: a whole number >= 1, got {self.max_active!r}")
        for name in ("short_prompt", "mid_prompt", "long_prompt", "budget"):
            lo, hi = getattr(self, name)
            if not (whole(lo) and whole(hi) and 0 <= lo <= hi):
                raise ValueError(f"{name}: need whole numbers 0 <= low <= high, got ({lo!r}, {hi!r})")
        # Each is compared with a uniform draw: a NaN one never fired, one outside [0, 1] acted as 0 or 1, and
        # mid_p + long_p above 1 drew no short prompt, a mix other than the one asked for, silently.
        for name in ("join_p", "burst_p", "mid_p", "long_p"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:  # a NaN fails the comparison, so is refused too
                raise ValueError(f"{name}: a probability in [0, 1], got {p}")
        if self.mid_p + self.long_p > 1.0 + 1e-9:  # slack for the rounding of a sum meant as 1
            raise ValueError(f"mid_p + long_p: at most 1, got {self.mid_p} + {self.long_p}")


@dataclass
class Request:
    rid: int
    pos: int  # P: the anchor's absolute position (= committed context rows)
    anchor: int
    budget: int
    salt: int
    pages: list[int] = field(default_factory=list)
    rounds: int = 0


class PagePool:
    """Free list of the draft KV cache's pages (identical on every rank)."""

    def __init__(self, num_pages: int) -> None:
        self.free = list(range(num_pages - 1, -1, -1))

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = [self.free.pop() for _ in range(n)]
        return out

    def give(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))


def taps_for(salt: int, positions: torch.Tensor, tokens: torch.Tensor, tap_size: int) -> torch.Tensor:
    """Deterministic stand-in target taps [m, tap_size] for committed rows, a function of the request,
    the rows' positions and tokens: a divergent draft changes the tokens and so every later cache row."""
    key = zlib.crc32(positions.numpy().tobytes(), zlib.crc32(tokens.numpy().tobytes(), salt & 0xFFFFFFFF))
    gen = torch.Generator().manual_seed(key)
    return torch.randn(positions.numel(), tap_size, generator=gen)


class Workload:
    """Requests in flight and their pages; `admit()` each round, `advance()` after the drafts."""

    def __init__(self, mix: MixConfig, vocab: int, page_size: int, num_pages: int) -> None:
        self.mix, self.vocab, self.page_size = mix, vocab, page_size
        self.rng = random.Random(mix.seed)
        self.pool = PagePool(num_pages)
        self.active: list[Request] = []
        self.next_rid = 0
        self.joined = self.left = 0

    def _prompt_len(self) -> int:
        m, u = self.mix, self.rng.random()
        if self.next_rid == 0 and m.first_long:
            return m.long_prompt[0]
        lo, hi = m.long_prompt if u < m.long_p else m.mid_prompt if u < m.long_p + m.mid_p else m.short_prompt
        return self.rng.randint(lo, hi)

    def _pages_for(self, req: Request, seq_len: int) -> bool:
        need = -(-seq_len // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        got = self.pool.take(need)
        if got is None:
            return False
        req.pages += got
        return True

    def admit(self) -> list[Request]:
        """New requests this round (their prompt rows still to be committed by the caller)."""
        m, new = self.mix, []
        want = 0
        if not self.active:
            want = 1
        elif self.rng.random() < m.burst_p:
            want = m.max_active - len(self.active)
        elif self.rng.random() < m.join_p:
            want = 1
        for _ in range(max(0, min(want, m.max_active - len(self.active)))):
            p = self._prompt_len()
            budget = self.rng.randint(*m.budget)
            if p >= m.long_prompt[0]:
                budget = max(budget, 40)  # long enough to cross the window
            req = Request(self.next_rid, p, self.rng.randrange(self.vocab), budget, self.rng.getrandbits(31))
            self.next_rid += 1
            if not self._pages_for(req, p + Q):
                if not self.active:
                    # Every page is free with no request in flight: this prompt never fits, and a round
                    # of no request failed in block_table (max() of nothing).
                    raise ValueError(f"num_pages {len(self.pool.free)} x page_size {self.page_size} = "
                                     f"{len(self.pool.free) * self.page_size} rows: a prompt of {p} rows needs {p + Q}")
                self.pool.give(req.pages)
                break
            self.active.append(req)
            new.append(req)
            self.joined += 1
        return new

    def prompt(self, req: Request) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions 0..P-1, tokens, slots) of a new request's prompt."""
        pos = torch.arange(req.pos, dtype=torch.int64)
        gen = torch.Generator().manual_seed(req.salt)
        tokens = torch.randint(0, self.vocab, (req.pos,), generator=gen)
        return pos, tokens, self.slots(req, pos)

    def slots(self, req: Request, positions: torch.Tensor) -> torch.Tensor:
        return block_slots(torch.tensor(req.pages, dtype=torch.int32), positions, self.page_size)

    def block_table(self) -> torch.Tensor:
        """int32 [R, max_pages] of the active requests (unused entries 0, as vLLM)."""
        width = max(len(r.pages) for r in self.active)
        t = torch.zeros(len(self.active), width, dtype=torch.int32)
        for i, r in enumerate(self.active):
            t[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        return t

    def accepted(self, req: Request, drafts: list[int], round_no: int) -> int:
        """Simulated verify: the accepted prefix length (0..7), a function of the drafts themselves."""
        a = 0
        for d in drafts:
            if (d * 2654435761 + req.salt + round_no) % 5 == 0:
                break
            a += 1
        return a

    def advance(self, req: Request, accepted: int, drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit the anchor and `accepted` drafts; returns (positions, tokens) of the committed rows.
        The bonus token becomes the next anchor. With no page left for all of them, fewer are accepted."""
        if not self._pages_for(req, req.pos + accepted + 1):
            accepted = min(accepted, len(req.pages) * self.page_size - req.pos - 1)
        pos = torch.arange(req.pos, req.pos + accepted + 1, dtype=torch.int64)
        tokens = torch.tensor([req.anchor] + drafts[:accepted], dtype=torch.int64)
        req.anchor = (sum(drafts) * 31 + req.pos * 7 + accepted) % self.vocab
        req.pos += accepted + 1
        req.rounds += 1
        return pos, tokens

    def retire(self) -> list[Request]:
        """Requests leaving after this round: budget spent, or no page left for the next block."""
        keep, gone = [], []
        for r in self.active:
            if r.rounds >= r.budget or not self._pages_for(r, r.pos + Q):
                gone.append(r)
                self.pool.give(r.pages)
                self.left += 1
            else:
                keep.append(r)
        self.active = keep
        return gone
