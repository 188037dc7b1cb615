"""Synthetic draft steps laid out as the engine does: pages allocated, context committed, block rows built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.config import DrafterConfig
from dspark_sidecar.drafter.kv_cache import StepMetadata, block_slots


@dataclass(frozen=True)
class StepInputs:
    """Everything one draft step needs besides the weights and the cache."""

    input_ids: torch.Tensor  # int64 [n]: anchor then 6 noise ids per request
    inputs_embeds: torch.Tensor  # [n, hidden]
    positions: torch.Tensor  # int64 [n]: P..P+6 per request
    meta: StepMetadata


def pages_needed(seq_len: int, page_size: int) -> int:
    return -(-seq_len // page_size)


def allocate_block_tables(seq_lens: list[int], page_size: int, num_pages: int,
                          gen: torch.Generator | None = None) -> torch.Tensor:
    """Give each request distinct physical pages (shuffled when `gen` is given) -> int32 [R, max_pages].

    Unused entries are 0, as in vLLM: only entries below ceil(seq_len / page_size) are read.
    """
    need = [pages_needed(s, page_size) for s in seq_lens]
    if sum(need) > num_pages:
        raise ValueError(f"{sum(need)} pages needed, cache has {num_pages}")
    order = torch.randperm(num_pages, generator=gen) if gen is not None else torch.arange(num_pages)
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    used = 0
    for i, k in enumerate(need):
        table[i, :k] = order[used : used + k].to(torch.int32)
        used += k
    return table


def block_rows(anchors: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
               page_size: int, noise_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 7 rows of each request: ids [anchor, N x 6], positions P..P+6, their cache slots."""
    q = layout.QPR
    ids = torch.full((anchors.numel(), q), noise_id, dtype=torch.int64)
    ids[:, 0] = anchors
    positions = (seq_lens.to(torch.int64)[:, None] - q) + torch.arange(q)[None, :]
    slots = torch.stack([block_slots(block_tables[i], positions[i], page_size) for i in range(anchors.numel())])
    return ids.reshape(-1), positions.reshape(-1), slots.reshape(-1)


def random_step(cfg: DrafterConfig, context_lens: list[int], page_size: int, num_pages: int,
                embed: torch.Tensor, seed: int = 0, shuffle_pages: bool = True) -> StepInputs:
    """A step whose request i has `context_lens[i]` committed rows (P = context_len) and random anchors."""
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, cfg.vocab_size, (len(context_lens),), generator=gen)
    seq_lens = torch.tensor([c + layout.QPR for c in context_lens], dtype=torch.int32)
    tables = allocate_block_tables(seq_lens.tolist(), page_size, num_pages, gen if shuffle_pages else None)
    ids, positions, slots = block_rows(anchors, seq_lens, tables, page_size, cfg.noise_token_id)
    return StepInputs(ids, embed[ids], positions, StepMetadata(seq_lens, tables, slots))


def context_rows(meta: StepMetadata, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and slots of every committed context row (0..P-1) of every request in a step."""
    pos, slots = [], []
    for i in range(meta.num_reqs):
        p = torch.arange(int(meta.seq_lens[i]) - layout.QPR)
        pos.append(p)
        slots.append(block_slots(meta.block_tables[i], p, page_size))
    return torch.cat(pos), torch.cat(slots)


def random_taps(cfg: DrafterConfig, rows: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Stand-in target tap hidden states [rows, num_taps * hidden], O(1) like real activations."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cfg.tap_size, generator=gen).to(dtype)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64: how far an answer is from the reference's (0.0 when equal)."""
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))
