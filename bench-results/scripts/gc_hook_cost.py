"""What a gc.callbacks hook that makes an idle stream current for each collection would cost (run 269).

Prints the median time of a young-generation collection over a heap frozen like serve's, without and
with the hook, and the cost of the two stream switches alone; a step of the sidecar allocates a few
hundred objects, so collections come about every step or two."""
import gc
import statistics
import time

import torch

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
quiet = torch.cuda.Stream(dev)
junk = [[{} for _ in range(50)] for _ in range(2000)]  # a heap to freeze, as serve does at ready
gc.collect()
gc.freeze()
saved = []


def hook(phase, info):
    if phase == "start":
        saved.append(torch.cuda.current_stream(dev))
        torch.cuda.set_stream(quiet)
    else:
        torch.cuda.set_stream(saved.pop())


def collect_us(n=2000):
    out = []
    for _ in range(n):
        [[] for _ in range(200)]  # young garbage, as a step makes
        t = time.perf_counter_ns()
        gc.collect(0)
        out.append((time.perf_counter_ns() - t) / 1e3)
    return statistics.median(out)


def switch_us(n=20000):
    s = torch.cuda.current_stream(dev)
    t = time.perf_counter_ns()
    for _ in range(n):
        torch.cuda.set_stream(quiet)
        torch.cuda.set_stream(s)
    return (time.perf_counter_ns() - t) / 1e3 / n


base = collect_us()
gc.callbacks.append(hook)
hooked = collect_us()
gc.callbacks.remove(hook)
print(f"gc.collect(0) median: {base:.2f} us without the hook, {hooked:.2f} us with it "
      f"(+{hooked - base:.2f} us); two set_stream calls: {switch_us():.2f} us; "
      f"gc thresholds {gc.get_threshold()}")
