"""One rank of a real draft step through the server's FlyDSL fast path on an MI355X x4, against the reference layers."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dspark_sidecar.drafter.checkpoint import LAYER_LINEARS, SyntheticSource, dequantize_mxfp8, quantize_mxfp8
from dspark_sidecar.drafter.config import PRESETS
from dspark_sidecar.drafter.kv_cache import StepMetadata, kv_planes, kv_rows, kv_storage_shape
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import DistExchange, ParallelContext
from dspark_sidecar.drafter.scenario import allocate_block_tables, block_rows, pages_needed
from dspark_sidecar.kernels.ops import REFERENCE_OPS
from dspark_sidecar.server.fast_path import build_fast_path
from dspark_sidecar.server.kv_binding import KVBinding
from dspark_sidecar.server.refusal import EngineFacts, probe_host

PAGE = 16
CONTEXTS = [5, 4096 + 40, 200]  # R = 3, one context past the window


class MXFP8Exact:
    """Synthetic weights with the layer linears rounded through MXFP8, so the reference layers and the
    kernels (which re-quantize them, exactly) multiply by the same values."""

    def __init__(self, inner: SyntheticSource, block: int) -> None:
        self.inner, self.block = inner, block

    def read(self, key, shape, rows=None, cols=None):
        t = self.inner.read(key, shape, rows, cols)
        if not key.endswith(tuple(f"{name}.weight" for name in LAYER_LINEARS)):
            return t
        q, s = quantize_mxfp8(t.float(), self.block)
        return dequantize_mxfp8(q, s, self.block).to(t.dtype)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def step_rank(rank: int, world: int, kv_layout: str = "planes") -> dict:
    torch.cuda.set_device(rank)
    dev, bf = torch.device("cuda", rank), torch.bfloat16
    cfg = PRESETS["minimax-m3.1"]
    nccl = dist.new_group(backend="nccl")  # the reference layers' all-reduce; the fast path uses its own exchange
    src = MXFP8Exact(SyntheticSource(cfg, bf, dev, seed=0), cfg.quant_block)
    model = DSparkDrafter(cfg, ParallelContext(rank, world, DistExchange(nccl)), REFERENCE_OPS, bf, dev).load(src)
    fast = build_fast_path(cfg, model, src, probe_host(world), None, rank)
    if fast.startup_reason is not None:
        return {"error": fast.startup_reason}

    gen = torch.Generator().manual_seed(1234)  # same on every rank: the step's inputs are replicated
    seq_lens = torch.tensor([c + 7 for c in CONTEXTS], dtype=torch.int32)
    pages = sum(pages_needed(int(s), PAGE) for s in seq_lens) + 4
    tables = allocate_block_tables(seq_lens.tolist(), PAGE, pages, gen)
    anchors = torch.randint(0, cfg.vocab_size, (len(CONTEXTS),), generator=gen)
    _, positions, slots = block_rows(anchors, seq_lens, tables, PAGE, cfg.noise_token_id)
    embeds = torch.randn(positions.numel(), cfg.hidden_size, generator=gen).to(bf).to(dev)
    meta = StepMetadata(seq_lens, tables, slots).to(dev)
    kv_gen = torch.Generator().manual_seed(99 + rank)  # this rank's KV head: committed context, random
    kv = []
    for _ in range(5):  # the same contents in either layout: the engine's allocation, seen as its planes view
        layer = kv_planes(torch.empty(kv_storage_shape(cfg, world, pages, PAGE, kv_layout), dtype=bf, device=dev))
        layer.copy_(torch.randn(2, pages, PAGE, 1, 128, generator=kv_gen) * 0.5)
        kv.append(layer)
    kv_ref = [t.clone() for t in kv]  # clone keeps the records strides: the reference writes through them too

    want = model.draft_step(embeds, positions.to(dev), meta, kv_ref)
    binding = KVBinding(1, 1, kv, pages, PAGE, EngineFacts(world, 1, 1, "dspark", 7), [])
    deadline = time.monotonic() + 900  # the first ready() starts compiling every kernel in the background
    while not fast.ready(binding):
        if fast.reason is not None or time.monotonic() > deadline:
            return {"error": fast.reason or "FlyDSL kernels still compiling after 900 s"}
        time.sleep(0.5)
    got = fast.forward(embeds, positions.to(dev), meta)
    torch.cuda.synchronize()
    written = slots.to(dev)  # compare the step's block K/V only: the rest is the untouched context

    def block(t):
        return torch.stack([kv_rows(t, 0, written), kv_rows(t, 1, written)])

    out = {"err": rel_l2(got, want), "kv_err": max(rel_l2(block(a), block(b)) for a, b in zip(kv, kv_ref)),
           "hidden": got.cpu()}
    fast.close()
    return out
