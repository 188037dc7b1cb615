"""Runs 293-294 (session 50): the host time of the shim's copy-out (DoorbellTransport.hidden: the output region's
clone) against other ways to make the same copy, at a step's [7R, 6144] bf16 rows, after the stream was made to
wait on an event as the shim's _after_outputs does. Prints medians (us) of 400 calls each, interleaved. Then
(run 294) the clone's host time right after 400 us of waiting as the doorbell waits for an answer (10 us naps,
the thread's timer slack lowered) against 400 us of spinning, and back to back."""

import statistics
import time

import torch

dev = torch.device("cuda")
torch.cuda.init()
region = torch.zeros((64 * 7, 6144), dtype=torch.bfloat16, device=dev)
region.untyped_storage()._share_cuda_()  # exported as the data plane's regions are
ev = torch.cuda.Event(interprocess=True)
s = torch.cuda.current_stream()


def way_clone(v):
    return v.clone()


def way_empty_copy(v):
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    out.copy_(v)
    return out


def way_empty_like_copy(v):
    return torch.empty_like(v, memory_format=torch.contiguous_format).copy_(v)


def way_new_empty_copy(v):
    return v.new_empty(v.shape).copy_(v)


WAYS = {"clone": way_clone, "empty+copy_": way_empty_copy, "empty_like+copy_": way_empty_like_copy,
        "new_empty+copy_": way_new_empty_copy}
for rows in (7, 56):
    v = region[:rows]
    times = {k: [] for k in WAYS}
    keep = []
    for i in range(400 + 50):
        for name, fn in WAYS.items():
            ev.record(s)
            s.wait_event(ev)
            t0 = time.perf_counter_ns()
            out = fn(v)
            t1 = time.perf_counter_ns()
            keep.append(out)
            if i >= 50:
                times[name].append(t1 - t0)
        if len(keep) > 64:
            torch.cuda.synchronize()
            keep.clear()
    torch.cuda.synchronize()
    print(f"rows {rows}: " + ", ".join(f"{k} {statistics.median(t) / 1e3:.1f} us" for k, t in times.items()))


from dspark_sidecar.proto import doorbell as bell  # noqa: E402

bell.lower_timer_slack()
v = region[:7]


def nap(us):
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        bell.pause(0.0, bell.NAP_S)


def spin(us):
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


WAITS = {"after 400 us of naps": lambda: nap(400), "after 400 us of spin": lambda: spin(400), "back to back": lambda: None}
times = {k: [] for k in WAITS}
for i in range(300):
    for name, wait in WAITS.items():
        ev.record(s)
        s.wait_event(ev)
        wait()
        t0 = time.perf_counter_ns()
        out = v.clone()
        t1 = time.perf_counter_ns()
        if i >= 30:
            times[name].append(t1 - t0)
    torch.cuda.synchronize()
print("clone of 7 rows: " + ", ".join(f"{k} {statistics.median(t) / 1e3:.1f} us" for k, t in times.items()))
