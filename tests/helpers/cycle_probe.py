"""Which objects a sidecar rank leaves to Python's cyclic collector: a `sitecustomize` probe loaded by every
process of a test's sidecar, and the reports it writes.

A rank must free what its steps, bindings and buffers held by reference counting, where its code lets go
of them. On a GPU a collection may run on any thread at any allocation, and torch's unmap of a CUDA IPC
tensor it frees synchronizes that thread's current stream, perhaps the rank's, behind a pre-launched wait
(session 37's note; graphs.gc_paused is the same hazard inside a capture)."""

from __future__ import annotations

import collections
import json
import os
import signal
import time
from pathlib import Path

from helpers.sidecar_proc import SidecarProcess

# DEBUG_SAVEALL keeps what a collection finds unreachable in gc.garbage instead of freeing it; SIGUSR2
# collects and appends, as one JSON line, what came into gc.garbage since the previous SIGUSR2.
_PROBE = '''
import collections, gc, json, os, signal
gc.set_debug(gc.DEBUG_SAVEALL)
_mark = [0]
def _report(signum, frame):
    gc.collect()
    new, _mark[0] = gc.garbage[_mark[0]:], len(gc.garbage)
    import torch
    types = collections.Counter(type(o).__module__ + "." + type(o).__qualname__ for o in new)
    out = {"tensors": [[list(o.shape), str(o.device)] for o in new if isinstance(o, torch.Tensor)],
           "frames": sorted({f"{o.f_code.co_filename}:{o.f_code.co_name}" for o in new if type(o).__name__ == "frame"}),
           "types": types.most_common(30),
           "ours": collections.Counter("torch.Tensor" if isinstance(o, torch.Tensor) else type(o).__module__ + "." +
                                       type(o).__qualname__ for o in gc.get_objects() if isinstance(o, torch.Tensor)
                                       or type(o).__module__.startswith("dspark_sidecar.")
                                       and not type(o).__module__.endswith("_pb2"))}
    with open(os.environ["DSPARK_TEST_CYCLES_OUT"] + f".{os.getpid()}", "a") as f:
        f.write(json.dumps(out) + "\\n")
signal.signal(signal.SIGUSR2, _report)
'''


def install(tmp_path: Path, monkeypatch) -> Path:
    """Make the sidecars this test starts load the probe; the path prefix of their reports."""
    probe = tmp_path / "cycle-probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(_PROBE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(probe), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "cycles"
    monkeypatch.setenv("DSPARK_TEST_CYCLES_OUT", str(out))
    return out


def collect(sc: SidecarProcess, out: Path, n: int) -> list[dict]:
    """SIGUSR2 to each rank; its n-th report, rank by rank: {"tensors": [[shape, device]], "frames":
    [file:function], "types": [[type, count]]} of the garbage its collector found since report n-1, and
    "ours": {type: count} of the tensors and the project's objects (its messages aside) alive then,
    outside the heap `serve` froze at start-up."""
    pids = sc.rank_pids()
    assert pids, f"no rank process:\n{sc.log_tail()}"
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)
    reports, deadline = [], time.monotonic() + 30
    for pid in pids:
        path = Path(f"{out}.{pid}")
        while time.monotonic() < deadline and (not path.exists() or len(path.read_text().splitlines()) < n):
            time.sleep(0.05)
        lines = path.read_text().splitlines() if path.exists() else []
        assert len(lines) >= n, f"rank pid {pid} wrote no report {n} (is the probe loaded?):\n{sc.log_tail()}"
        reports.append(json.loads(lines[n - 1]))
    return reports


def growth(before: list[dict], after: list[dict]) -> list[dict]:
    """Per rank, the tensors and project types ("ours") of which more were alive at a later report."""
    return [dict(collections.Counter(b["ours"]) - collections.Counter(a["ours"])) for a, b in zip(before, after)]


def assert_none_held(reports: list[dict]) -> None:
    """No tensor and no frame (a traceback's: an error kept with the step it refused) in any cycle."""
    for r, rep in enumerate(reports):
        assert rep["tensors"] == [] and rep["frames"] == [], (
            f"rank {r}: a collection found {len(rep['tensors'])} tensors {rep['tensors'][:8]} in reference cycles, "
            f"and frames {rep['frames']}; the cycles' objects: {rep['types']}")
