"""In-kernel TP all-reduce of a row-parallel linear (o_proj, down_proj) fused with its split-K sum and residual.

Every rank holds a receive buffer RX [2 parity, 4 src, 64 rows, 6144] f32 and flags
FL [2 parity, 4 src, NBLK] i32 in fine-grained (uncached) device memory; the other ranks map
both through HIP IPC handles exchanged once over the rank group. Workgroup b of every rank owns
the same 64-column block:

1. sums its split-K partials of the block (split order);
2. pushes the rank partial into slot [parity, rank] of every rank's RX (itself included) with
   system-coherent stores (sc0 sc1), then a system-scope release fence and a workgroup barrier;
3. writes its tag into FL[parity, rank, b] of every rank (system-scope release store);
4. waits until FL[parity, src, b] == tag for the 4 sources (system-scope acquire loads);
5. sums the 4 rank partials in rank order 0..3 (so every rank gets bit-identical hidden
   states) plus the residual, and writes bf16.

The tag is epoch * 16 + exchange + 1, where `epoch` is a device counter the runner bumps once
per launch and `exchange` (0..9) numbers the exchanges of a launch: a flag never needs
clearing, because a stale value can never equal the current tag. Tags of consecutive exchanges
alternate parity, so a rank that runs one exchange ahead writes the other half of RX and never
overwrites data a slower peer is still reading (it cannot run two ahead: it would need that
peer's flags of the exchange in between). Nothing is host-synchronized, so the sequence is
graph-capturable. All ranks' workgroups must be co-resident: the grid (96) stays below the
CU count.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import range_constexpr

from . import _device as dev
from .shapes import HIDDEN, SCHEDULES, TP, rows_for, row_tiles

CB = 64  # columns per workgroup
NBLK = HIDDEN // CB  # 96 workgroups
MP_MAX = 64
THREADS = 256
SYS_COHERENT = 17  # buffer cache policy sc0 | sc1: coherent at system scope
EXCHANGES_PER_LAUNCH = 10  # o_proj and down_proj of 5 layers


def build_reduce_exchange(num_reqs: int, which: str, exchange: int):
    """Launcher(P f32 [split, MP, 6144], RES bf16 [rows, 6144], OUT bf16 [rows, 6144],
    RX0..RX3 f32 [2*4*64, 6144] (peer-mapped receive buffers, by rank), FL0..FL3 i32
    [2*4*NBLK] (peer-mapped flags), RXL / FLL (this rank's own, local mapping),
    EPOCH i32 [1], rank i32). `which` is "o" or "down"; `exchange` is 0..9."""
    sched = SCHEDULES[which]
    if sched.norm or sched.n != HIDDEN:
        raise ValueError(f"{which} is not a row-parallel linear")
    if not 0 <= exchange < EXCHANGES_PER_LAUNCH:
        raise ValueError(f"exchange index {exchange} outside 0..{EXCHANGES_PER_LAUNCH - 1}")
    rows = rows_for(num_reqs)
    mp = 16 * row_tiles(num_reqs)
    split = sched.split
    pieces = mp * CB // 4  # 16-byte pieces of the block (4 columns each)
    per_thread = -(-pieces // THREADS)

    @flyc.kernel
    def reduce_exchange(
        P: fx.Tensor,
        RES: fx.Tensor,
        OUT: fx.Tensor,
        RX0: fx.Tensor,
        RX1: fx.Tensor,
        RX2: fx.Tensor,
        RX3: fx.Tensor,
        FL0: fx.Tensor,
        FL1: fx.Tensor,
        FL2: fx.Tensor,
        FL3: fx.Tensor,
        RXL: fx.Tensor,
        FLL: fx.Tensor,
        EPOCH: fx.Tensor,
        rank: fx.Int32,
    ):
        blk = fx.block_idx.x
        tid = fx.thread_idx.x
        a_f32x4 = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), 32)
        a_f32x4_sys = fx.make_copy_atom(fx.rocdl.BufferCopy128b(SYS_COHERENT), 32)
        a_bf16x4 = fx.make_copy_atom(fx.rocdl.BufferCopy64b(), 16)
        a_i32 = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), 32)
        epoch = dev.load_vec(a_i32, fx.logical_divide(fx.rocdl.make_buffer_tensor(EPOCH), fx.make_layout(1, 1)), 0, 1, fx.Int32)[0]
        tag = epoch * 16 + (exchange + 1)
        parity = tag & 1
        pb = fx.rocdl.make_buffer_tensor(P)
        peers = [fx.rocdl.make_buffer_tensor(t) for t in (RX0, RX1, RX2, RX3)]

        # 1-2. Split-K sum of this block, pushed to every rank's RX[parity, rank].
        for it in range_constexpr(per_thread):
            piece = tid + it * THREADS
            if piece < pieces:
                r = piece // (CB // 4)
                c4 = blk * (CB // 4) + piece % (CB // 4)
                y = None
                for s in range_constexpr(split):
                    prow = fx.logical_divide(fx.slice(pb, (s, r, None)), fx.make_layout(4, 1))
                    v = dev.load_vec(a_f32x4, prow, c4, 4, fx.Float32)
                    y = v if y is None else y + v
                for d in range_constexpr(TP):
                    dst = dev.rows_view(peers[d], (parity * TP + rank) * MP_MAX + r, 4)
                    dev.store_vec(a_f32x4_sys, dst, c4, y, 4, fx.Float32)
        fx.memory_fence(ordering=fx.AtomicOrdering.Release)
        fx.gpu.barrier()

        # 3. Publish: this block of this rank's partial is in place on every rank.
        if tid == 0:
            for fl in (FL0, FL1, FL2, FL3):
                fx.generic_store(fx.get_iter(fl) + (parity * TP + rank) * NBLK + blk, tag, memory_order=fx.AtomicOrdering.Release)

        # 4. Wait for the 4 sources' flags of this block (thread src polls source src).
        if tid < TP:
            flag = fx.get_iter(FLL) + (parity * TP + tid) * NBLK + blk
            while fx.generic_load(flag, memory_order=fx.AtomicOrdering.Acquire) != tag:
                fx.rocdl.s_sleep(1)
        fx.gpu.barrier()

        # 5. Rank-ordered sum + residual -> bf16.
        rxl = fx.rocdl.make_buffer_tensor(RXL)
        resb = fx.rocdl.make_buffer_tensor(RES)
        outb = fx.rocdl.make_buffer_tensor(OUT)
        for it in range_constexpr(per_thread):
            piece = tid + it * THREADS
            r = piece // (CB // 4)
            if r < rows:
                c4 = blk * (CB // 4) + piece % (CB // 4)
                acc = None
                for src in range_constexpr(TP):
                    v = dev.load_vec(a_f32x4_sys, dev.rows_view(rxl, (parity * TP + src) * MP_MAX + r, 4), c4, 4, fx.Float32)
                    acc = v if acc is None else acc + v
                res = dev.load_vec(a_bf16x4, dev.rows_view(resb, r, 4), c4, 4, fx.BFloat16).to(fx.Float32)
                dev.store_vec(a_bf16x4, dev.rows_view(outb, r, 4), c4, (res + acc).to(fx.BFloat16), 4, fx.BFloat16)

    @flyc.jit
    def launch(
        P: fx.Tensor,
        RES: fx.Tensor,
        OUT: fx.Tensor,
        RX0: fx.Tensor,
        RX1: fx.Tensor,
        RX2: fx.Tensor,
        RX3: fx.Tensor,
        FL0: fx.Tensor,
        FL1: fx.Tensor,
        FL2: fx.Tensor,
        FL3: fx.Tensor,
        RXL: fx.Tensor,
        FLL: fx.Tensor,
        EPOCH: fx.Tensor,
        rank: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        reduce_exchange(P, RES, OUT, RX0, RX1, RX2, RX3, FL0, FL1, FL2, FL3, RXL, FLL, EPOCH, rank).launch(
            grid=(NBLK, 1, 1), block=(THREADS, 1, 1), stream=stream
        )

    return launch
