"""GPU time of the pre-launched step's metadata program (step_meta), R = 1, 8, 32, ctx 4096: CUDA events over 2000 launches."""
import sys
import numpy as np
import torch
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.kv_cache import window_width
from dspark_sidecar.kernels.triton import step_meta as sm

PAGE, WINDOW, Q = 16, 4096, 7
dev = torch.device("cuda", 0)
tag = sys.argv[1]
for R in (1, 8, 32):
    lens = [4096 + 13 * i for i in range(R)]
    need = [scenario.pages_needed(c + Q, PAGE) for c in lens]
    pages, width = sum(need) + 5, max(need) + 2
    perm = np.random.default_rng(0).permutation(pages).astype(np.int32)
    T = np.full((R, width), -1, np.int32)
    used = 0
    for i, k in enumerate(need):
        T[i, :k], used = perm[used:used + k], used + k
    L = np.array([c + Q for c in lens], np.int32)
    P = L[:, None].astype(np.int64) - Q + np.arange(Q)
    S = T[np.arange(R)[:, None], P // PAGE].astype(np.int64) * PAGE + P % PAGE
    src = [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (P.reshape(-1), L, T, S.reshape(-1))]
    ww = window_width(PAGE, WINDOW)
    n = R * Q
    out = (torch.zeros(n, dtype=torch.int64, device=dev), torch.zeros(n, dtype=torch.int64, device=dev),
           torch.zeros(n, dtype=torch.int64, device=dev), torch.zeros(R, dtype=torch.int32, device=dev),
           torch.zeros((R, ww), dtype=torch.int32, device=dev))
    flag = torch.zeros(R, dtype=torch.int32, device=dev)
    w = torch.tensor([5], dtype=torch.int64, device=dev)
    args = dict(num_reqs=R, width=width, page_size=PAGE, window=WINDOW, num_pages=pages)
    for _ in range(50):
        sm.step_meta(w, w, src, out, flag, **args)
    torch.cuda.synchronize()
    assert (flag == sm.FLAG_RAN).all(), flag
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(100):
            sm.step_meta(w, w, src, out, flag, **args)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / 100)
    print(f"{tag}: step_meta R={R:2d} ctx 4096: median {np.median(times):.2f} us per program launch (graphed, 100 per replay)")
