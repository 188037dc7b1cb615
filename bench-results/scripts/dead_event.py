"""Probe (session 52): does a stream that waits on a dead engine's interprocess event ever go on?

The doorbell's sidecar stream waits on the engine's "inputs written" event (AttachDoorbellRequest.input_event)
before it reads a step's inputs. If the engine is killed after recording that event behind GPU work its GPU had
not yet done, does the driver ever complete the wait, or is the sidecar's stream (and every later step on it)
stuck for good? Run on a GPU host: `python3 bench-results/scripts/dead_event.py [alive|exit|kill] [seconds] [nowait|noopen]`.

The engine (a child process) queues `seconds` of GPU spinning (torch.cuda._sleep), records an interprocess event
behind it, hands the event over and then finishes normally (alive), exits at once (exit: os._exit with the spin
still queued) or is SIGKILLed at once (kill). This process opens the event, makes a stream wait on it, queues a
small kernel and an event behind the wait, and polls that event for 45 s.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

import torch


def engine(path: str, seconds: float) -> None:
    torch.cuda.init()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # the spin kernel's module loaded (lazily) before it is timed
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 100_000_000 / start.elapsed_time(end)
    ev = torch.cuda.Event(interprocess=True)
    torch.cuda._sleep(int(seconds * 1000 * cycles_per_ms))
    ev.record()
    with open(path + ".tmp", "wb") as f:
        f.write(ev.ipc_handle())
    os.rename(path + ".tmp", path)
    while not os.path.exists(path + ".exit"):
        time.sleep(0.01)
    if sys.argv[4] == "exit":  # the spin still queued
        os._exit(0)
    torch.cuda.synchronize()
    os._exit(0)


def main() -> None:
    how = sys.argv[1] if len(sys.argv) > 1 else "kill"
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    nowait = len(sys.argv) > 3 and sys.argv[3] in ("nowait", "noopen")
    noopen = len(sys.argv) > 3 and sys.argv[3] == "noopen"
    torch.cuda.init()
    dev = torch.device("cuda", 0)
    path = os.path.join(tempfile.mkdtemp(), "event")
    child = subprocess.Popen([sys.executable, __file__, "--engine", path, str(seconds), how])
    while not os.path.exists(path):
        time.sleep(0.005)
    t_handle = time.perf_counter()
    # noopen: the control of the control, a process with nothing of the engine's (under MPS: a co-resident client)
    theirs = None if noopen else torch.cuda.Event.from_ipc_handle(dev, open(path, "rb").read())
    s = torch.cuda.Stream(dev)
    # Both kernels loaded before the wait is queued: a lazily loaded kernel's first launch synchronizes the
    # context, and behind the wait that is the engine's whole spin (s52b's first run: 19.99 s of "set-up").
    x = torch.zeros(1, device=dev)
    x.add_(1)
    x.zero_()
    torch.cuda.synchronize(dev)
    done = torch.cuda.Event()
    with torch.cuda.stream(s):
        if not nowait:  # nowait: the control, the event opened but never waited on
            s.wait_event(theirs)
        x.add_(1)
        done.record(s)
    t0 = time.perf_counter()
    print(f"[{how}] the wait queued {t0 - t_handle:.2f} s after the event's handle came; the spin is {seconds:.0f} s",
          flush=True)
    if how == "kill":
        child.send_signal(signal.SIGKILL)
    else:
        open(path + ".exit", "w").close()
    rc = child.wait()
    t_dead = time.perf_counter() - t0
    while not done.query() and time.perf_counter() - t0 < 45:
        time.sleep(0.01)
    t = time.perf_counter() - t0
    if done.query():
        print(f"[{how}, {seconds:.0f} s spin] engine rc {rc} after {t_dead:.2f} s; the wait ended after {t:.2f} s; "
              f"the kernel behind it ran: x = {x.item():.0f}", flush=True)
    else:
        print(f"[{how}, {seconds:.0f} s spin] engine rc {rc} after {t_dead:.2f} s; the wait had NOT ended after "
              f"{t:.2f} s: the stream is stuck", flush=True)
    # Another stream of this process goes on? (A stuck stream should not hold the context.)
    other = torch.cuda.Stream(dev)
    with torch.cuda.stream(other):
        y = torch.ones(1, device=dev)
    other.synchronize()
    print(f"[{how}] another stream of the same process: {y.item():.0f}, context usable", flush=True)
    os._exit(0)  # with a stream stuck, the interpreter's exit could wait on it


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine(sys.argv[2], float(sys.argv[3]))
    else:
        main()
