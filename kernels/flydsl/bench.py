"""Time the FlyDSL kernel chain of one draft launch on a gfx950 rank against the HBM floor at 8 TB/s.

    python -m dspark_sidecar.kernels.flydsl.bench --reqs 1 8 --context 4096 [--kv-layout records]

runs on one MI355X (no peers): it times every kernel of a launch except the two TP exchanges per
layer, which need the 4 ranks (their bytes are a few MB and are left out of the floor too).
The floor counts the rank's FP8 weights and scales plus the draft KV the attention reads.
"""

from __future__ import annotations

import argparse

import torch

from ...layout import LAUNCH_REQS, QPR
from .runner import NUM_LAYERS, launch_plan
from .shapes import HEAD_DIM, KV_HEADS, KV_LAYOUTS, MX_BLOCK, SCHEDULES, SLIDING_WINDOW, kv_row_map

HBM_BYTES_PER_S = 8e12  # MI355X
KV_BYTES_PER_TOKEN = NUM_LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # 2560: K and V, bf16, 5 layers


def weight_bytes_per_rank() -> int:
    """FP8 weights plus E8M0 scales of the rank's 4 linears x 5 layers (~0.43 GB)."""
    per_layer = sum(s.n * s.k + s.n * s.k // MX_BLOCK for s in SCHEDULES.values())
    return NUM_LAYERS * per_layer


def hbm_floor_seconds(num_reqs: int, context_len: int) -> float:
    """Bytes one launch must read (weights once, each request's windowed KV) / 8 TB/s."""
    keys = min(context_len + QPR, SLIDING_WINDOW + QPR - 1)
    return (weight_bytes_per_rank() + num_reqs * keys * KV_BYTES_PER_TOKEN) / HBM_BYTES_PER_S


def launcher(name: str, num_reqs: int, page_size: int):
    """Catalog kernel `name`'s launcher for `num_reqs` requests; a paged one (attention) for `page_size`-slot pages.

    The attention's page size is compiled into its block-table arithmetic (as runner.DrafterRunner builds it):
    built at the catalog's default 16 over a cache of larger pages, it read past each request's block-table row."""
    from .catalog import KERNELS

    spec = KERNELS[name]
    return spec.build(num_reqs, page_size) if spec.paged else spec.build(num_reqs)


def bench_rank(num_reqs: int, context_len: int, iters: int = 20, page_size: int = 16,
               kv_layout: str = "planes") -> dict:
    """Median-free mean time of the launch chain (exchanges excluded) on the current gfx950 GPU, the
    draft KV addressed as a `kv_layout` cache (its K and V rows apart, or interleaved per slot)."""
    from .catalog import KERNELS
    from .toolchain import on_gfx950

    if not on_gfx950():
        raise RuntimeError("bench_rank needs a gfx950 GPU")
    import flydsl.compiler as flyc

    dev = torch.device("cuda")
    # The catalog's placeholder arguments have every kernel's shapes and dtypes; on the GPU
    # they become random device tensors of the same shapes (cache sized for the context).
    pages_per_req = -(-(context_len + QPR) // page_size)
    plan = [name for name, x in launch_plan(num_reqs) if x is None]
    calls = []
    for name in dict.fromkeys(plan):
        args = list(KERNELS[name].args(num_reqs))
        dev_args = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.dtype in (torch.bfloat16, torch.float32):
                    t = torch.randn(a.shape, device=dev).to(a.dtype) * 0.1
                elif a.dtype == torch.uint8:
                    t = torch.randint(100, 130, a.shape, device=dev, dtype=torch.uint8)
                else:
                    t = torch.zeros(a.shape, device=dev, dtype=a.dtype)
                dev_args.append(t)
            else:
                dev_args.append(a)
        if name in ("qkv_rope", "attention"):
            slots = num_reqs * pages_per_req * page_size
            kv_i = 8 if name == "qkv_rope" else 1
            # Either layout's cache is the same 2 * slots rows; only the kernels' addressing differs.
            dev_args[kv_i] = torch.randn(2 * slots, HEAD_DIM, device=dev).to(torch.bfloat16)
            dev_args[-2:] = kv_row_map(kv_layout, slots)
            pos_i = 5 if name == "qkv_rope" else 2
            anchors = torch.full((num_reqs,), context_len, device=dev, dtype=torch.int64)
            dev_args[pos_i] = (anchors[:, None] + torch.arange(QPR, device=dev)).reshape(-1)
            if name == "attention":
                dev_args[3] = torch.arange(num_reqs * pages_per_req, device=dev, dtype=torch.int32).view(num_reqs, -1)
            else:
                dev_args[4] = torch.randn(context_len + 64, 64, device=dev)
                dev_args[6] = torch.arange(num_reqs * QPR, device=dev, dtype=torch.int64)
        fn = flyc.compile(launcher(name, num_reqs, page_size), *dev_args)
        calls.append((name, fn, dev_args))
    by_name = {name: (fn, a) for name, fn, a in calls}
    # A compiled launcher takes every parameter positionally, its stream last (runner.DrafterRunner._run):
    # called without it, FlyDSL's argument packing raised IndexError before the first launch.
    stream = torch.cuda.current_stream(dev)

    def one_launch():
        for name in plan:
            fn, a = by_name[name]
            fn(*a, stream)

    one_launch()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        one_launch()
    end.record()
    torch.cuda.synchronize()
    step_s = start.elapsed_time(end) / 1e3 / iters
    floor_s = hbm_floor_seconds(num_reqs, context_len)
    return {"reqs": num_reqs, "context": context_len, "kv_layout": kv_layout, "step_s": step_s, "floor_s": floor_s,
            "x_floor": step_s / floor_s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reqs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--kv-layout", choices=KV_LAYOUTS, default="planes")
    opts = ap.parse_args(argv)
    # Here, not after the compiles: --iters 0 divided by zero, a request count past a launch raised from
    # launch_plan, and a negative context put negative positions into the RoPE table and the block table.
    if any(not 1 <= r <= LAUNCH_REQS for r in opts.reqs):
        ap.error(f"--reqs: 1..{LAUNCH_REQS} requests per launch each, got {opts.reqs}")
    if opts.context < 0:
        ap.error(f"--context: committed keys per request, at least 0, got {opts.context}")
    if opts.iters < 1:
        ap.error(f"--iters: at least 1, got {opts.iters}")
    print(f"{'reqs':>4} {'context':>7} {'step ms':>8} {'floor ms':>8} {'x floor':>7}")
    for r in opts.reqs:
        res = bench_rank(r, opts.context, opts.iters, kv_layout=opts.kv_layout)
        print(f"{r:>4} {opts.context:>7} {res['step_s'] * 1e3:8.3f} {res['floor_s'] * 1e3:8.3f} {res['x_floor']:7.2f}")


if __name__ == "__main__":
    main()
