"""Bench diagnostic (--shim-phases): where the engine shim's host time around the ring and answer goes, per step.

Mode h reports the shim's time from maybe_forward's start to the doorbell's ring, and from the answer
seen to maybe_forward's return, as two figures, and the first moved 50-115 us between fresh processes
of the same code on one H200 host (BENCHMARKS.md runs 254-259), more than anything the code changes
did. This splits both at the shim's own seams by wrapping bound methods of the bench's shim instance
and its data plane (nine; seven without a GPU word) while mode h runs, and unwrapping them after
(`close`): no class is touched, nothing in the shim knows, and the modes timed after h (d, f and g go
through the same data plane) carry no wrapper. Each wrapper reads time.monotonic_ns once or twice and
costs ~0.3 us, so each span's phases add up to ~1.5 us more than its unwrapped figure.
"""

from __future__ import annotations

import functools
import resource
import statistics
import time

# In step order: maybe_forward's own checks and metadata read; the readiness check; the agreements
# and the tables' cover; the request built; the step's copies into the regions; the request
# serialized and joined with the region fields; the GPU word's stream write; the input event's
# record; and the rest of send_bytes (the raw stream lookups, the page write, the ring).
PHASES = ("checks", "prepare", "agree", "request", "stage", "serialize", "word", "record", "ring")
# After the answer, in step order, from the moment the data plane saw it (the bench's "after answer" figure):
# the answer's page read and decoded; the transport's wait returning and check_answer; the output region's
# copy-out (queued on the engine's stream: the driver's copy, or a clone without it); the rest of _run_step
# (shape and dtype checks, the breaker); and maybe_forward's end (the post-flight agreement, the stats).
AFTER = ("parse", "check", "copy", "finish", "post")
# Beside them, whether the thread ran all that time: its CPU time over the wall time from maybe_forward's
# start to send_bytes (1.0: on a CPU throughout, so a slow step was a slow CPU; less: descheduled, or
# waiting for the GIL), and the involuntary context switches of the thread in the same span.
EXTRA = ("on_cpu_share", "preempted")
_ABSENT = object()  # a wrapped name that had no instance attribute (the class's method alone)


class ShimPhases:
    """Stamps taken inside one shim's maybe_forward; `step()` turns one step's into a row of PHASES (ns)."""

    def __init__(self, shim, transport) -> None:
        self._t: dict[str, int] = {}
        self._undo: list[tuple[object, str, object, object]] = []  # (obj, name, wrapper, instance attribute before)
        self.rows: list[tuple[int, ...]] = []
        self.after: list[tuple[int, ...]] = []  # per answered step: AFTER (ns)
        self.extra: list[tuple[float, int]] = []  # per step: EXTRA
        self._wrap(shim, "_prepare", "prepare")
        self._wrap(shim, "_run_step", "run")
        self._wrap(transport.buffers, "stage", "stage")
        self._wrap(transport.bell, "send_bytes", "send", end=False, cpu=True)
        self._wrap(transport.bell, "wait", "answer")  # each poll stamps; the last one's end is the answer's
        self._wrap(transport, "check_answer", "check")
        self._wrap(transport, "hidden", "copy")
        ops = transport.bell._ops
        if ops is not None:  # a GPU word and its event record through the driver (proto/gpu_word.py)
            self._wrap(ops, "write", "word")
            self._wrap(ops, "record", "record")

    def start(self) -> tuple[int, int]:
        """At maybe_forward's start: (thread CPU time ns, involuntary switches) for step()."""
        return time.thread_time_ns(), _switches()

    def _wrap(self, obj, name: str, key: str, end: bool = True, cpu: bool = False) -> None:
        """Stamp `key`0 (and with end, `key`1) around obj.name; cpu: the thread's CPU time and switches too."""
        fn, stamps = getattr(obj, name), self._t

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if cpu:
                stamps["cpu"], stamps["nivcsw"] = time.thread_time_ns(), _switches()
            stamps[key + "0"] = time.monotonic_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                if end:
                    stamps[key + "1"] = time.monotonic_ns()

        self._undo.append((obj, name, timed, vars(obj).get(name, _ABSENT)))
        setattr(obj, name, timed)  # an instance attribute: found before the class's method

    def close(self) -> None:
        """Unwrap: each method is again what it was (the class's), so the steps timed after mode h (d, f
        and g call the same stage and send_bytes) pay no wrapper. The rows stay, for medians_us."""
        for obj, name, wrapper, before in reversed(self._undo):
            if vars(obj).get(name) is not wrapper:  # replaced since by someone else: theirs stays
                continue
            if before is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
        self._undo.clear()

    def step(self, t0: int, rung: int, began: tuple[int, int] | None = None, seen: int = 0, done: int = 0) -> None:
        """After one maybe_forward that started at t0 and rang at `rung` (both time.monotonic_ns);
        began: what start() returned at t0; seen and done: when the data plane saw its answer and when
        maybe_forward returned (0: not known, no AFTER row)."""
        t = dict(self._t)
        self._t.clear()  # the dict the wrappers write into: emptied, never replaced
        if not all(k in t for k in ("prepare0", "prepare1", "run0", "stage0", "stage1", "send0")):
            return  # fell back before sending, or the data plane was set up again (wrappers gone): no row
        word = t.get("word1", 0) - t.get("word0", 0)
        record = t.get("record1", 0) - t.get("record0", 0)
        self.rows.append((t["prepare0"] - t0, t["prepare1"] - t["prepare0"], t["run0"] - t["prepare1"],
                          t["stage0"] - t["run0"], t["stage1"] - t["stage0"], t["send0"] - t["stage1"],
                          word, record, rung - t["send0"] - word - record))
        if began is not None and "cpu" in t:
            self.extra.append(((t["cpu"] - began[0]) / max(1, t["send0"] - t0), t["nivcsw"] - began[1]))
        if seen and done and all(k in t for k in ("answer1", "check1", "copy1", "run1")):
            self.after.append((t["answer1"] - seen, t["check1"] - t["answer1"], t["copy1"] - t["check1"],
                               t["run1"] - t["copy1"], done - t["run1"]))

    def medians_us(self, last: int) -> dict[str, float]:
        """PHASES' medians (us) over the last `last` steps, then AFTER's, then EXTRA's: the median on-CPU share
        and the mean involuntary switches per step."""
        rows, after, extra = self.rows[-last:], self.after[-last:], self.extra[-last:]
        out = {p: statistics.median(r[i] for r in rows) / 1e3 for i, p in enumerate(PHASES)} if rows else {}
        if after:
            out |= {p: statistics.median(r[i] for r in after) / 1e3 for i, p in enumerate(AFTER)}
        if extra:
            out |= {"on_cpu_share": statistics.median(e[0] for e in extra),
                    "preempted": sum(e[1] for e in extra) / len(extra)}
        return out


def _switches() -> int:
    """This thread's involuntary context switches so far (Linux; 0 where RUSAGE_THREAD is missing)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_nivcsw if who is not None else 0
