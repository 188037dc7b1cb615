"""A fake HIP runtime for the TP exchange protocol on CPU: device memory is a file, an IPC handle its name.

Opening a handle maps the same file (torch.from_file, shared), so ranks in different processes
really see each other's stores, as they would through HIP IPC. `fault` makes this rank misbehave
the way a broken deployment would.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch
import torch.distributed as dist

from dspark_sidecar.kernels.flydsl.peers import IPC_HANDLE_BYTES, map_peers
from dspark_sidecar.kernels.flydsl.runner import FlyDSLUnsupported

# What a fresh allocation holds: memory a previous sidecar's exchange left behind, every word 1, the tag
# the first exchange of a new process waits for (epoch 0, exchange 0), so unzeroed flags read as ready.
STALE_WORD = (1).to_bytes(4, "little")
FAULTS = (None, "alloc", "short_handle", "no_handle", "bogus_handle", "open", "wrap_flags", "free")


class FakeHip:
    """`fault`: one of FAULTS, or several joined by "+" (e.g. "bogus_handle+free")."""

    def __init__(self, folder: str, fault: str | None = None) -> None:
        assert fault is None or all(f in FAULTS for f in fault.split("+")), fault
        self.folder, self.fault = Path(folder), fault
        self.faults = set(fault.split("+")) if fault else set()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.calls: list[tuple[str, int]] = []
        self._files: dict[int, Path] = {}  # pointer -> backing file (own allocations and opened handles)
        self._ids = itertools.count(1)

    def _ptr(self) -> int:
        return (os.getpid() << 24) + next(self._ids) * 4096

    def malloc_uncached(self, nbytes: int) -> int:
        if "alloc" in self.faults:
            raise FlyDSLUnsupported("hipExtMallocWithFlags(hipDeviceMallocUncached) failed: out of memory")
        ptr = self._ptr()
        path = self.folder / f"{ptr:x}.mem"
        with open(path, "wb") as f:  # not zeroed, as hipExtMallocWithFlags' memory is not
            f.write(STALE_WORD * (nbytes // 4))
        self._files[ptr] = path
        self.calls.append(("malloc", ptr))
        return ptr

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        with open(self._files[ptr], "r+b") as f:
            f.write(bytes([value]) * nbytes)

    def free(self, ptr: int) -> None:
        self.calls.append(("free", ptr))
        if "free" in self.faults:  # the driver refuses; the memory stays allocated
            raise FlyDSLUnsupported("hipFree failed: an illegal memory access was encountered")
        self._files.pop(ptr).unlink()

    def ipc_handle(self, ptr: int):
        if "no_handle" in self.faults:
            return None
        if "short_handle" in self.faults:
            return b"\x01" * 10
        name = b"missing.mem" if "bogus_handle" in self.faults else self._files[ptr].name.encode()
        return name.ljust(IPC_HANDLE_BYTES, b"\0")

    def ipc_open(self, handle: bytes) -> int:
        if "open" in self.faults:
            raise FlyDSLUnsupported("hipIpcOpenMemHandle failed: invalid argument")
        path = self.folder / handle.rstrip(b"\0").decode()
        if not path.exists():
            raise FlyDSLUnsupported("hipIpcOpenMemHandle failed: invalid resource handle")
        ptr = self._ptr()
        self._files[ptr] = path
        self.calls.append(("open", ptr))
        return ptr

    def ipc_close(self, ptr: int) -> None:
        self.calls.append(("close", ptr))
        del self._files[ptr]

    def tensor(self, ptr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if "wrap_flags" in self.faults and dtype == torch.int32 and ("open", ptr) in self.calls:
            raise FlyDSLUnsupported("torch could not view the IPC-mapped exchange buffer in place")
        numel = 1
        for s in shape:
            numel *= s
        return torch.from_file(str(self._files[ptr]), shared=True, size=numel, dtype=dtype).view(shape)

    def live(self) -> int:
        return len(self._files)


def exchange_scenarios(rank: int, world: int, folder: str, scenarios: list[tuple[str | None, int]]) -> list[dict]:
    """run_ranks body: one `exchange_rank` per (fault, faulty rank), in order, in the same processes."""
    out = []
    for i, (fault, fault_rank) in enumerate(scenarios):
        sub = Path(folder) / f"s{i}"
        sub.mkdir(exist_ok=True)
        out.append(exchange_rank(rank, world, str(sub), fault, fault_rank))
        dist.barrier()  # the next scenario starts after every rank finished this one
    return out


def exchange_rank(rank: int, world: int, folder: str, fault: str | None, fault_rank: int) -> dict:
    """Map the peers, push a rank-tagged block into every rank's RX/flags, read our own back, close."""
    rt = FakeHip(folder, fault if rank == fault_rank else None)
    try:
        peers = map_peers(None, lambda: rt, torch.device("cpu"))
    except FlyDSLUnsupported as exc:
        return {"error": str(exc), "calls": rt.calls, "live": rt.live()}
    # What the exchange kernel does (exchange.py): slot [parity 0, src = rank] of every rank's RX and flags.
    for d in range(world):
        peers.rx[d].view(2, world, 64, -1)[0, rank].fill_(rank + 1)
        peers.flags[d].view(2, world, -1)[0, rank].fill_(100 + rank)
    dist.barrier()
    seen_rx = peers.rx_local.view(2, world, 64, -1)[0, :, 5, 7].tolist()
    seen_flags = peers.flags_local.view(2, world, -1)[0, :, 3].tolist()
    untouched = bool((peers.flags_local.view(2, world, -1)[1] == 0).all())
    own_is_local = peers.rx[rank].data_ptr() == peers.rx_local.data_ptr()
    live = rt.live()
    peers.close()
    peers.close()  # idempotent
    return {"seen_rx": seen_rx, "seen_flags": seen_flags, "untouched": untouched, "own_is_local": own_is_local,
            "epoch": peers.epoch.tolist(), "live_before_close": live, "calls": rt.calls, "live": rt.live()}


def fast_path_rank(rank: int, world: int, folder: str, ckpt: str, fault: str | None) -> dict:
    """run_ranks body: the server's start-up of the FlyDSL path (weights + peers) on the tiny drafter."""
    from dspark_sidecar.drafter.checkpoint import SCALE_SUFFIX, CheckpointReader
    from dspark_sidecar.drafter.config import PRESETS
    from dspark_sidecar.drafter.model import DSparkDrafter
    from dspark_sidecar.drafter.parallel import ParallelContext
    from dspark_sidecar.kernels.ops import REFERENCE_OPS
    from dspark_sidecar.server.fast_path import build_fast_path
    from dspark_sidecar.server.refusal import HostFacts

    class Bf16Linears(CheckpointReader):
        """A checkpoint whose linears were saved dequantized (bf16), as a conversion script might."""

        def _slice(self, key, shape, rows, cols):
            t = super()._slice(key, shape, rows, cols)
            return t.to(torch.bfloat16) if t.dtype == torch.float8_e4m3fn else t

        def has(self, key):  # saved dequantized: no block scales beside them (a kept one is refused)
            return not key.endswith(SCALE_SUFFIX) and super().has(key)

    class OomLinears(CheckpointReader):
        """The device runs out of memory for the shards (torch raises OutOfMemoryError, a RuntimeError)."""

        def read_stored(self, key, shape, rows=None, cols=None):
            raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 96.00 MiB")

    cfg = PRESETS["tiny"]
    readers = {"weights": Bf16Linears, "weights_oom": OomLinears}
    reader = (readers.get(fault, CheckpointReader) if rank == 0 else CheckpointReader)(ckpt, torch.bfloat16,
                                                                                       cfg.quant_block)
    model = DSparkDrafter(cfg, ParallelContext(rank, world), REFERENCE_OPS).load(reader)
    rt = FakeHip(folder, fault if rank == 0 and fault not in readers else None)
    fast = build_fast_path(cfg, model, reader, HostFacts(True, True, world), None, rank, make_runtime=lambda: rt)
    out = {"reason": fast.startup_reason, "layers": len(fast.layers),
           "qkv": tuple(fast.layers[0].qkv.bits.shape) if fast.layers else None, "mapped": fast.peers is not None}
    fast.close()
    out["live"] = rt.live()
    return out
