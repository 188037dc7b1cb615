"""Prelaunch's queue / take / release protocol on CPU stand-ins for the word ops, events, program and graphs."""

from __future__ import annotations

import ctypes
import gc
import mmap
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # prelaunch imports the metadata program's module

from dspark_sidecar.drafter.kv_cache import StepMetadata, window_width  # noqa: E402
from dspark_sidecar.kernels.triton.step_meta import (FLAG_INVALID, FLAG_NOT_RUNG, FLAG_RAN, STAGE_WORDS,  # noqa: E402
                                                     Staging, gated_copy_reference, step_gate_reference,
                                                     step_meta_reference)
from dspark_sidecar.proto import doorbell as bell  # noqa: E402
from dspark_sidecar.proto import sidecar_pb2 as pb  # noqa: E402
from dspark_sidecar.server import prelaunch  # noqa: E402
from dspark_sidecar.server.graphs import _Packed  # noqa: E402
from dspark_sidecar.server.validate import Step, host_meta  # noqa: E402

PAGE, WINDOW, Q, KEY, SEQ, PAGES = 16, 64, 7, 5, 40, 32
LENS = [40, 100]  # context lengths: rows sit at L-7 .. L-1 with L = c + 7
OK = pb.DraftStepResponse()
ERR = pb.DraftStepResponse(error=pb.StepError(code=3, message="x"))


def _read(ptr, dtype, count: int) -> np.ndarray:
    """What the program reads: a raw address (the region read in place) or a staged copy (a tensor)."""
    if isinstance(ptr, torch.Tensor):
        return ptr.numpy()[:count].copy()
    return np.frombuffer((ctypes.c_char * (count * np.dtype(dtype).itemsize)).from_address(ptr.address), dtype).copy()


class Event:
    def __init__(self, gpu):
        self.gpu, self.recorded, self.synced, self.passed = gpu, 0, 0, False

    def record(self, stream):
        self.recorded, self.passed = self.recorded + 1, False

    def query(self):
        self.passed = self.passed or self.gpu.run()  # seen finished since its last record, by whoever asked
        return self.passed

    def synchronize(self):
        self.synced += 1


class Gpu:
    """Word ops and metadata program: the program runs (via the reference) once the wait before it passes,
    so a test sets the engine's word before take(), as the engine's stream would."""

    hip = False  # GpuWordOps.hip: True, the wait is HIP's plain unsigned >= (run), not CUDA's cyclic compare

    def __init__(self):
        self.registered, self.unregistered, self.waits, self.programs, self.flags = [], [], [], [], []
        self.copies: list = []  # staged copies queued before the program (staged rigs)
        self.mirrors: list = []  # each program's mirror of its flags (device memory)
        self.then: list = []  # TP > 1: the flags' exchange and gate, replayed after the program (capture)
        self.hold_until = 0.0  # clock() time before which the copy has not started (a late peer)
        self.clock = time.perf_counter  # prelaunch's clock (the cooldown tests' _Clock)
        self.writes: list = []  # stream writes: the program's expected word, ahead of each queued step
        self.word_addr = 0  # the doorbell's GPU word (set by the rig): never written from the sidecar's stream
        self.warmed: list = []  # (what, waits queued by then): launches compiled and loaded, not queued

    def register(self, ptr, nbytes):
        self.registered.append(ptr)
        return ptr  # identity: device addresses are the host addresses

    def unregister(self, ptr):
        self.unregistered.append(ptr)

    def write(self, stream, addr, value):
        assert addr != self.word_addr, "the sidecar stores its release word from the host, never from its stream"
        self.writes.append((stream, addr, value))
        ctypes.c_uint64.from_address(addr).value = value  # queued ahead of the wait: in place by the program

    def wait_geq(self, stream, addr, value):
        self.waits.append((stream, addr, value))

    def program(self, word, expect, src, out, flag, mirror=None, warm=False, **kw):
        # expect: the device's int64 [1] the stream wrote; the value the program sees when it runs.
        # mirror: the device memory that gets the flags too (Prelaunch's, read by the gated copy).
        if warm:
            self.warmed.append(("program", len(self.waits)))
            return
        self.programs.append((word, int(expect[0]) % (1 << 64), src, out, flag, kw))
        self.mirrors.append(mirror)

    def stage(self, src, dst, blocks, word_src, word_dst, warm=False):
        """Staging.stage's copy, done when the program runs (after the wait), as the stream would."""
        if warm:
            self.warmed.append(("stage", len(self.waits)))
            return
        assert len(self.waits) == len(self.programs) + 1, "copy queued before its wait: it would read a stale region"
        self.copies.append((src.address, dst, blocks, word_src.address, word_dst))

    def _copy(self) -> None:
        for src, dst, blocks, word_src, word_dst in self.copies:
            ctypes.memmove(dst.data_ptr(), src, blocks * STAGE_WORDS * 8)
            ctypes.memmove(word_dst.data_ptr(), word_src, 8)
        self.copies.clear()

    def run(self) -> bool:
        if len(self.flags) == len(self.programs):
            return True
        if self.clock() < self.hold_until:  # a peer not there yet (TP > 1)
            return False
        _, addr, value = self.waits[-1]
        word = ctypes.c_uint64.from_address(addr).value
        if (word < value) if self.hip else (word - value) % (1 << 64) >= 1 << 63:
            return False  # HIP: word < value; CUDA: (int64)(word - value) < 0. The stream is still blocked
        self._copy()
        word, expect, (p, lens, tab, s), out, flag, kw = self.programs[-1]
        R, width = kw["num_reqs"], kw["width"]
        assert (p.dtype, lens.dtype, tab.dtype, s.dtype) == (torch.int64, torch.int32, torch.int32, torch.int64)
        value = (int(word[0]) % (1 << 64) if isinstance(word, torch.Tensor)
                 else ctypes.c_uint64.from_address(word.address).value)
        res = step_meta_reference(value, expect, _read(p, np.int64, Q * R),
                                  _read(lens, np.int32, R), _read(tab, np.int32, R * width).reshape(R, width),
                                  _read(s, np.int64, Q * R), kw["page_size"], kw["window"], kw["num_pages"],
                                  out[4].shape[1])
        for o, r in zip(out, res[:5]):
            o.copy_(torch.from_numpy(np.asarray(r).reshape(o.shape)))
        (ctypes.c_int32 * R).from_address(flag.data_ptr())[:] = res[5].tolist()
        self.mirrors[-1][:R] = torch.from_numpy(res[5])
        self.flags.append(res[5])
        for fn in self.then:
            fn()
        self.then.clear()
        return True


class Graphs:
    stream = SimpleNamespace(cuda_stream=0)

    def __init__(self, embeds):
        self.embeds, self.replays, self.uncaptured = embeds, 0, False
        packed = _Packed(len(LENS), window_width(PAGE, WINDOW))
        self.graph = SimpleNamespace(graph=SimpleNamespace(replay=self._replay), out=torch.randn(packed.n, 8),
                                     views=packed.views(torch.zeros(packed.nbytes, dtype=torch.uint8)))

    def _replay(self):
        self.replays += 1

    def captured(self, embeds, R, kv):
        return self.graph if embeds is self.embeds and R == len(LENS) and not self.uncaptured else None


def _step(buf: mmap.mmap, embeds: torch.Tensor, nbytes: int = -1) -> Step:
    """A valid step whose metadata tensors are views of one page-aligned region, like validate.py's cached ones
    (of `nbytes`, -1: the whole buffer)."""
    R, n = len(LENS), Q * len(LENS)
    L = np.array(LENS, np.int32) + Q
    need = -(-L // PAGE)
    width = int(need.max()) + 2
    tables = np.full((R, width), -1, np.int32)
    perm, used = np.random.default_rng(0).permutation(PAGES).astype(np.int32), 0
    for i, k in enumerate(need):
        tables[i, :k], used = perm[used : used + k], used + k
    P = L[:, None].astype(np.int64) - Q + np.arange(Q)
    S = tables[np.arange(R)[:, None], P // PAGE].astype(np.int64) * PAGE + P % PAGE
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    pos, slots = raw[: 8 * n].view(torch.int64), raw[8 * n : 16 * n].view(torch.int64)
    lens, tab = raw[16 * n : 16 * n + 4 * R].view(torch.int32), raw[16 * n + 4 * R :][: 4 * R * width].view(torch.int32)
    pos.copy_(torch.from_numpy(P.reshape(-1)))
    slots.copy_(torch.from_numpy(S.reshape(-1)))
    lens.copy_(torch.from_numpy(L))
    tab = tab.view(R, width)
    tab.copy_(torch.from_numpy(tables))
    meta = StepMetadata(lens, tab, slots)
    kv = SimpleNamespace(layers=[], page_size=PAGE, num_pages=PAGES)
    return Step(1, R, pos, embeds, None, meta, kv, None, host_meta(pos, meta), True)


def _gate(agreed, flag, slots, R):
    """step_gate on the CPU stand-ins: its NumPy spec, into the host's flag page and the graph's slots."""
    flags, out = step_gate_reference(agreed[:R].numpy(), slots.numpy())
    (ctypes.c_int32 * R).from_address(flag.data_ptr())[:] = flags.tolist()
    slots.copy_(torch.from_numpy(out))


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def world(request):
    return request.param


@pytest.fixture(params=[True, False], ids=["staged", "in-place"])
def staged(request):
    """The program reads copies made after the wait (Staging, as on a GPU) or the region in place."""
    return request.param


RIG_BEHIND_S = 30.0  # see rig()


@pytest.fixture
def rig(world, staged):
    page_buf = mmap.mmap(-1, mmap.PAGESIZE)
    page = bell.Page(np.frombuffer(page_buf, np.uint8), 1024)
    embeds = torch.zeros(Q * len(LENS), 8)
    gpu, graphs = Gpu(), Graphs(embeds)
    # Two layouts in regions of their own: same values, different tensor objects.
    a, b = _step(mmap.mmap(-1, mmap.PAGESIZE), embeds), _step(mmap.mmap(-1, mmap.PAGESIZE), embeds)
    base = np.frombuffer(page_buf, np.uint8).ctypes.data
    # TP 2: the peer's flags for the queued step (set by a test), MAX-ed in by the exchange.
    peer = torch.full((len(LENS),), FLAG_RAN, dtype=torch.int32)
    captures, meta_captures, copy_captures = [], [], []

    def capture(fn):
        if fn.__name__ == "run_metadata":  # the staging copy and the program: each replay queues them again
            meta_captures.append(fn)
            return fn
        if fn.__name__ == "run_copy":  # the gated copy: each replay queues it again (copy_out defers it)
            copy_captures.append(fn)
            return fn
        captures.append(fn)  # the exchange + gate "graph": replayed with the program, when the word passes
        return lambda: gpu.then.append(fn)

    extra = dict(capture=capture) if world == 1 else dict(
        exchange=lambda t: torch.maximum(t, peer[: t.numel()], out=t), gate=_gate, capture=capture, max_reqs=len(LENS))
    if staged:
        extra["staging"] = Staging("cpu", launch=gpu.stage)
    # The engine's output slice (output_of): none unless a test sets r.out; the gated copy runs with the
    # program, after the flags' exchange and gate where there is one (gpu.then), as the stream orders it.
    r = SimpleNamespace(out=None, copies=[])

    def copy_out(src, dst, flag, R, warm=False):
        if warm:
            gpu.warmed.append(("copy", len(gpu.waits)))
            return
        r.copies.append((src, dst, R))
        assert flag is pl._dev_flags, "the copy reads the flags' device mirror, never the host's page"
        gpu.then.append(lambda: dst.copy_(gated_copy_reference(src, dst, flag[:R].numpy())))

    # behind_s far above any scheduling stall: the rig's own word is there at the ring, but a host that deschedules
    # the test for more than the 5 ms default between the ring and the first look at the word (a loaded 2-core CI
    # box did, session 51) started a cooldown, and the next step was not queued. The cooldown tests set their own.
    pl = prelaunch.Prelaunch(gpu, page, base, graphs, WINDOW, event=lambda: Event(gpu), program=gpu.program,
                             output_of=lambda step, like: r.out, copy_out=copy_out, behind_s=RIG_BEHIND_S, **extra)
    gpu.word_addr = base + bell.GPU_WORD_OFFSET
    r.__dict__.update(pl=pl, gpu=gpu, graphs=graphs, page=page, a=a, b=b, word_addr=gpu.word_addr,
                      peer=peer, captures=captures, meta_captures=meta_captures, copy_captures=copy_captures,
                      world=world, staged=staged)
    return r


def _req(key=KEY):
    return pb.DraftStepRequest(step_id=1, launch_key=key)


def _word(r) -> int:
    return int(r.page.words[bell.GPU_WORD])


def _take(r, seq, req, step):
    """The rank loop at one rank: offer, a verdict that agrees with it (world 1), take."""
    hook = r.pl.hook(seq, req)
    queued, queue_next = hook.offer(step)
    return hook.take(queued, queue_next)


def _serve(r, seq, step=None, key=KEY, resp=OK):
    """One rung step: the engine's word, the rank loop's hook, then the doorbell's after()."""
    r.page.words[bell.GPU_WORD] = bell.gpu_word(seq, key)
    out = _take(r, seq, _req(key), step or r.a)
    r.pl.after(seq, resp)
    return out


def _queue(r):
    """Two same-layout steps SEQ, SEQ+1: SEQ+2 is queued."""
    _serve(r, SEQ)
    _serve(r, SEQ + 1)
    assert r.pl.queued is not None and r.pl.queued.seq == SEQ + 2


class _Clock:
    """prelaunch's perf_counter for the cooldown tests, which judge words against a 10 ms behind_s: it moves only
    when the test moves it (advance) or the code under test polls (its bell.pause: POLL_S a poll), and a word the
    test schedules (at) lands when the clock passes its time. On the real clock these tests failed 3 runs in 15
    beside two busy loops on a 2-core box (word waits of 38-40 ms read for a word landing 50 ms after a timer's
    start): a stall of the test's thread between a timer's start and the wait's start shortened the wait it
    measured, and one of 10 ms between the ring and the first look judged a word already there late (the rig's
    RIG_BEHIND_S keeps the other tests clear of that)."""

    POLL_S = 1e-3

    def __init__(self) -> None:
        self.now = 1000.0
        self._due: list = []  # (time, fn), landing in time order

    def perf_counter(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s
        while self._due and self._due[0][0] <= self.now:
            self._due.pop(0)[1]()

    def at(self, after_s: float, fn) -> None:
        self._due.append((self.now + after_s, fn))
        self._due.sort(key=lambda d: d[0])

    def __getattr__(self, name):  # the rest of the time module (monotonic: the release's bound) is real
        return getattr(time, name)


@pytest.fixture
def clock(rig, monkeypatch):
    """The rig's pre-launch on a _Clock: its polls on this thread advance the clock instead of sleeping."""
    c = _Clock()
    real_pause, me = bell.pause, threading.get_ident()

    def pause(idle_s: float, nap_s: float = bell.NAP_S) -> None:
        if threading.get_ident() != me:  # another thread's poll (none here): its own real nap
            real_pause(idle_s, nap_s)
            return
        c.advance(_Clock.POLL_S)

    monkeypatch.setattr(prelaunch, "time", c)
    monkeypatch.setattr(bell, "pause", pause)
    rig.clock, rig.gpu.clock = c, c.perf_counter
    return c


def _lands(r, seq):
    """The engine's stream writing step seq's word (a _Clock.at callback)."""
    return lambda: r.page.words.__setitem__(bell.GPU_WORD, bell.gpu_word(seq, KEY))


def test_queues_after_a_streak(rig):
    _serve(rig, SEQ)
    assert rig.gpu.waits == [] and rig.pl.queued is None
    _serve(rig, SEQ + 1)
    assert rig.gpu.waits == [(0, rig.word_addr, bell.gpu_word(SEQ + 2, 0))]
    [(word, expect, src, out, _, kw)] = rig.gpu.programs
    assert expect == bell.gpu_word(SEQ + 2, KEY)
    a = rig.a
    host = [t.data_ptr() for t in (a.positions, a.meta.seq_lens, a.meta.block_tables, a.meta.slot_mapping)]
    if rig.staged:  # one copy of the word and of the region's block holding the sources, queued before the program
        [(src_addr, dst, blocks, word_src, word_dst)] = rig.gpu.copies
        assert word_src == rig.word_addr and word is word_dst and src_addr == a.positions.untyped_storage().data_ptr()
        assert blocks == 1 and [t.data_ptr() - dst.data_ptr() for t in src] == [h - src_addr for h in host]
    else:
        assert word.address == rig.word_addr and [p.address for p in src] == host
    assert out is rig.graphs.graph.views
    assert kw == dict(num_reqs=2, width=a.meta.block_tables.shape[1], page_size=PAGE, window=WINDOW, num_pages=PAGES)
    assert rig.graphs.replays == 1 and rig.pl.queued.seq == SEQ + 2 and rig.pl.queued.done.recorded == 1
    # The expected word went ahead of the wait, into the device word the program reads.
    assert rig.gpu.writes == [(0, rig.pl._expect.data_ptr(), bell.gpu_word(SEQ + 2, KEY))]


def test_metadata_launches_are_captured_at_a_layout_s_second_queue(rig):
    """First queue of a layout: the staging copy and the program run as they are (compiled, no capture
    for a one-off layout); second: captured before the wait; from then on replayed, never captured again.
    Every step still gets its own program run with its own expected word."""
    _queue(rig)
    assert rig.meta_captures == []
    for s in (SEQ + 2, SEQ + 3, SEQ + 4):
        rig.page.words[bell.GPU_WORD] = bell.gpu_word(s, KEY)
        assert _serve(rig, s) is rig.graphs.graph.out
        assert len(rig.meta_captures) == 1 and rig.pl.queued.seq == s + 1
    assert [w[2] for w in rig.gpu.writes] == [bell.gpu_word(s, KEY) for s in range(SEQ + 2, SEQ + 6)]
    assert [p[1] for p in rig.gpu.programs] == [bell.gpu_word(s, KEY) for s in range(SEQ + 2, SEQ + 6)]
    assert rig.gpu.flags[-1].tolist() == [FLAG_RAN] * len(LENS)
    # Another layout (its own region views): a key of its own, first run directly again.
    _serve(rig, SEQ + 5, step=rig.b)
    _serve(rig, SEQ + 6, step=rig.b)
    assert len(rig.meta_captures) == 1 and rig.pl.queued.seq == SEQ + 7


def test_a_layout_s_first_queue_loads_its_kernels_before_the_wait(rig):
    """At a layout's first queue its staging copy, program and gated copy are compiled and loaded
    (warm) before the wait on the word is queued: loaded at their launch behind that wait, the code
    waited for the engine's next step while the doorbell thread held the rank lock, and an engine
    whose next call was a gRPC step or a BindKV deadlocked with it (run 265). Once per layout: a
    replay loads nothing."""
    rig.out = torch.zeros_like(rig.graphs.graph.out)
    _queue(rig)
    want = ([("stage", 0)] if rig.staged else []) + [("program", 0), ("copy", 0)]
    assert rig.gpu.warmed == want and len(rig.gpu.waits) == 1  # all before the one wait
    for s in (SEQ + 2, SEQ + 3):
        _serve(rig, s)
    assert rig.gpu.warmed == want and len(rig.gpu.waits) == 3  # captured at the second queue, then replayed
    _serve(rig, SEQ + 4, step=rig.b)
    _serve(rig, SEQ + 5, step=rig.b)  # another layout's first queue: its metadata launches warmed before its
    # wait (the 4th); the copy into the same output slice is the one captured already
    assert rig.gpu.warmed[len(want):] == [(w, 3) for w, _ in want[:-1]] and len(rig.gpu.waits) == 4


def test_hit_returns_the_queued_output(rig):
    _queue(rig)
    word = bell.gpu_word(SEQ + 2, KEY)
    rig.page.words[bell.GPU_WORD] = word
    assert _take(rig, SEQ + 2, _req(), rig.a) is rig.graphs.graph.out
    assert (rig.pl.hits, rig.pl.misses) == (1, 0) and _word(rig) == word and [f.tolist() for f in rig.gpu.flags] == [[FLAG_RAN] * len(LENS)]
    # The graph's static inputs are what the host path would have built.
    np.testing.assert_array_equal(rig.graphs.graph.views[0].numpy(), rig.a.positions.numpy())
    np.testing.assert_array_equal(rig.graphs.graph.views[2].numpy(), rig.a.meta.slot_mapping.numpy())
    rig.pl.after(SEQ + 2, OK)
    assert rig.pl.queued.seq == SEQ + 3 and rig.graphs.replays == 2


@pytest.mark.parametrize("kind", [
    "key", "seq", "uncaptured",
    # Same key, other views: after() must compare the views by identity (== on tensors raises).
    "layout",
])
def test_host_miss_releases(rig, kind):
    _queue(rig)
    seq, key, step = SEQ + 2, KEY, rig.a
    if kind == "key":
        key = KEY + 1
    elif kind == "seq":
        seq = SEQ + 3
    elif kind == "layout":
        step = rig.b
    else:
        rig.graphs.uncaptured = True
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY)  # the GPU would accept: the host must refuse
    assert _take(rig, seq, _req(key), step) is None
    assert (rig.pl.hits, rig.pl.misses) == (0, 1) and rig.pl.queued is None
    assert _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)
    rig.pl.after(seq, OK)
    # Only a sequence mismatch keeps the streak (same key and layout): it queues the next one at once.
    assert (rig.pl.queued.seq if rig.pl.queued else None) == (SEQ + 4 if kind == "seq" else None)
    assert len(rig.gpu.waits) == (2 if kind == "seq" else 1)


@pytest.mark.parametrize("kind", ["other-key", "corrupt"])
def test_gpu_refusal_releases(rig, kind):
    _queue(rig)
    word = bell.gpu_word(SEQ + 2, KEY + 1 if kind == "other-key" else KEY)
    if kind == "corrupt":
        rig.a.meta.slot_mapping[-1] += 1  # after the host's validation: only the GPU's check sees it
    rig.page.words[bell.GPU_WORD] = word
    assert _take(rig, SEQ + 2, _req(), rig.a) is None
    # Per request: a word for another key refuses every request, a bad slot only its own request.
    want = [FLAG_NOT_RUNG] * len(LENS) if kind == "other-key" else [FLAG_RAN] * (len(LENS) - 1) + [FLAG_INVALID]
    assert [f.tolist() for f in rig.gpu.flags] == [want]
    assert (rig.pl.hits, rig.pl.misses) == (0, 1) and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)


def test_word_never_arrives_times_out(rig, monkeypatch):
    monkeypatch.setattr(prelaunch, "READY_TIMEOUT_S", 0.01)
    _queue(rig)  # the page still holds SEQ+1's word: the wait for SEQ+2 never passes
    assert _take(rig, SEQ + 2, _req(), rig.a) is None
    assert rig.gpu.flags == [] and rig.pl.misses == 1 and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)


def test_a_ring_whose_word_never_arrives_waits_ready_timeout_s_and_no_longer(rig, clock):
    """The answer to a rung step waits for its queued copy to start at most READY_TIMEOUT_S (2 s, on the _Clock:
    its polls advance it), holding the rank's lock meanwhile: past it the step runs the ordinary way. The other
    tests shorten the bound itself, so a wait that outran it (a check against a multiple of it) passed them."""
    _queue(rig)  # the page still holds SEQ+1's word: the wait for SEQ+2 never passes
    start = clock.now
    assert _take(rig, SEQ + 2, _req(), rig.a) is None and rig.pl.misses == 1
    waited = clock.now - start
    assert prelaunch.READY_TIMEOUT_S <= waited <= prelaunch.READY_TIMEOUT_S + 3 * clock.POLL_S, waited
    assert rig.pl.start_wait_ns == pytest.approx(waited * 1e9, abs=2 * clock.POLL_S * 1e9)


def test_an_own_word_that_never_arrives_stops_queueing_like_a_late_one(rig, monkeypatch):
    """A word more than behind_s late starts a cooldown; one that had not arrived READY_TIMEOUT_S after
    the ring did not: the streak held, the next step was queued again, and each step of an engine whose
    GPU runs that far behind (or whose stream never writes the word) waited READY_TIMEOUT_S (2 s) on the
    host before it ran. A peer that is late (TP > 1) with this engine's word there is still no news."""
    monkeypatch.setattr(prelaunch, "READY_TIMEOUT_S", 0.01)
    _queue(rig)  # the page still holds SEQ+1's word: the wait for SEQ+2 never passes
    assert _take(rig, SEQ + 2, _req(), rig.a) is None
    rig.pl.after(SEQ + 2, OK)
    assert rig.pl.queued is None and rig.pl.cooldown > 0
    if rig.world > 1:
        rig.pl.cooldown = 0
        _serve(rig, SEQ + 3)
        assert rig.pl.queued is not None and rig.pl.queued.seq == SEQ + 4
        rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 4, KEY)  # this engine's word is there
        rig.gpu.hold_until = time.perf_counter() + 60  # a peer's never comes
        assert _take(rig, SEQ + 4, _req(), rig.a) is None
        rig.pl.after(SEQ + 4, OK)
        assert rig.pl.cooldown == 0 and rig.pl.queued is not None and rig.pl.queued.seq == SEQ + 5


@pytest.mark.parametrize("world", [2])
def test_a_late_own_word_starts_a_cooldown_when_a_peer_times_out_too(rig, clock, monkeypatch):
    """The cooldown is judged on this engine's own word, whatever the peers do: a word past behind_s starts
    one. Seen late and then a peer's copy never started (the timeout), it started none, and this rank went
    on queueing steps behind an engine far behind its host."""
    monkeypatch.setattr(prelaunch, "READY_TIMEOUT_S", 0.2)
    rig.pl.behind_s = 0.01
    _queue(rig)
    rig.gpu.hold_until = clock.now + 60  # a peer's copy never starts
    clock.at(0.05, _lands(rig, SEQ + 2))  # this engine's own word lands 50 ms after the ring: far behind
    assert _take(rig, SEQ + 2, _req(), rig.a) is None
    assert 0.04e9 <= rig.pl.word_wait_ns <= 0.06e9
    rig.pl.after(SEQ + 2, OK)
    assert rig.pl.cooldown > 0 and rig.pl.queued is None


def test_error_response_releases_and_resets_the_streak(rig):
    _queue(rig)
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY)
    rig.pl.after(SEQ + 2, ERR)  # refused before the hook ran: the queued step was never taken
    assert rig.pl.queued is None and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)
    _serve(rig, SEQ + 3)
    assert rig.pl.queued is None and len(rig.gpu.waits) == 1
    _serve(rig, SEQ + 4)
    assert rig.pl.queued.seq == SEQ + 5


def test_release_from_outside(rig):
    _queue(rig)
    q = rig.pl.queued
    rig.pl.release(wait=True)
    assert rig.pl.queued is None and q.done.passed and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)
    _serve(rig, SEQ + 2)  # streak cleared: one step alone does not queue
    assert rig.pl.queued is None and len(rig.gpu.waits) == 1
    rig.pl.release(wait=True)  # nothing queued: the engine's word stays
    assert _word(rig) == bell.gpu_word(SEQ + 2, KEY)


def test_a_released_wait_blocked_again_by_an_older_engine_word_is_released_again(rig):
    """The release is a host store into the word the engine's stream also writes. An engine whose GPU
    runs behind its host lands its word for step SEQ+1 after the release of the queued SEQ+2: the
    wait blocks again, for a word that may never come. A host waiting for the step to finish
    (BindKV, UnregisterBuffers, stop) then waited without bound under the rank loop's lock."""
    _queue(rig)
    q = rig.pl.queued
    rig.pl.release()
    assert _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY) and rig.pl.passing
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 1, KEY)  # the engine's late word lands
    assert not q.done.query()  # the model: the stream waits again
    assert rig.pl.repass() is False and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)
    assert q.done.query() and rig.pl.repass() is True and not rig.pl.passing
    assert rig.pl.repass() is True and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)  # nothing left to store


def test_a_release_whose_miss_count_raises_still_stores_the_word(rig):
    """The release's word comes before its bookkeeping: a counter that raised (the metrics callback) left the
    queued step's stream waiting for a word nobody would write, and every later host wait on the device hung."""
    _queue(rig)

    def broken(hit):
        raise RuntimeError("counter")

    rig.pl._count = broken
    with pytest.raises(RuntimeError, match="counter"):
        rig.pl.release()
    assert _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY) and rig.pl.passing  # and repass() keeps it


def test_a_settle_whose_miss_count_raises_leaves_the_step_released_not_queued(rig):
    """settle() (the step was refused, aborted or served by a fast path, so its queued copy was never taken)
    takes the step out of `queued` before its bookkeeping, as release() and take() do. A counter that raised
    there left the released step in `queued` as well as in `_passed`; repass, which stores nothing while a step
    is queued, then never stored the release again once an engine's late word undid it: the stream stayed
    blocked, and every host wait on the device behind it."""
    _queue(rig)
    q = rig.pl.queued

    def broken(hit):
        raise RuntimeError("counter")

    rig.pl._count = broken
    with pytest.raises(RuntimeError, match="counter"):
        rig.pl.settle()
    assert rig.pl.queued is None and rig.pl.passing and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 1, KEY)  # the engine's late word: blocked again
    assert rig.pl.repass() is False and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)
    assert q.done.query() and rig.pl.repass() is True and not rig.pl.passing


def test_release_with_wait_stores_again_until_the_released_step_has_finished(rig):
    _queue(rig)
    q = rig.pl.queued
    rig.pl.release()  # e.g. a gRPC step's quiesce: no wait
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 1, KEY)  # the engine's late word
    rig.pl.release(wait=True)  # e.g. UnregisterBuffers: nothing queued now, but the released step still waits
    assert q.done.passed and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY) and not rig.pl.passing


def test_release_with_wait_gives_up_on_a_device_that_never_passes(rig, monkeypatch):
    """A released copy that never finishes (a peer's copy never runs, a wedged device): the wait ends,
    with an error that says so (RankLoop.exclusive then exits the rank), instead of holding the lock."""
    monkeypatch.setattr(prelaunch, "RELEASE_WAIT_S", 0.05)
    _queue(rig)
    rig.gpu.hold_until = time.perf_counter() + 60  # the queued copy has not started (a peer not there)
    with pytest.raises(RuntimeError, match="step 42.*has not finished"):
        rig.pl.release(wait=True)
    rig.gpu.hold_until = 0.0
    rig.pl.release(wait=True)
    assert not rig.pl.passing


def _released_then_blocked(rig, monkeypatch) -> list:
    """SEQ+2 queued, released, then blocked again by the engine's late word; returns the list each capture
    appends to: whether that released step had finished when the capture began."""
    _queue(rig)
    q = rig.pl.queued
    rig.pl.release()
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 1, KEY)  # the engine's late word: blocked again
    seen = []
    real = rig.pl._capture
    monkeypatch.setattr(rig.pl, "_capture", lambda fn: (seen.append(q.done.passed), real(fn))[1])
    return seen


def test_a_capture_first_waits_for_released_steps_and_keeps_the_streak(rig, monkeypatch):
    """A capture synchronizes the device with nothing to store the release again meanwhile: the
    queueing that captures waits for every released step first (the streak it is queueing from stays)."""
    seen = _released_then_blocked(rig, monkeypatch)
    rig.pl._last, rig.pl._streak = ("kept",), 5
    rig.pl._replay_of(("k",), (), lambda warm=False: None)  # first sight: no capture, no wait
    assert seen == [] and rig.pl.passing
    rig.pl._replay_of(("k",), (), lambda warm=False: None)  # second sight: captured, after the released step finished
    assert seen == [True] and not rig.pl.passing and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)
    assert rig.pl._last == ("kept",) and rig.pl._streak == 5


@pytest.mark.parametrize("world", [2], ids=["tp2"])
def test_the_flags_exchange_is_captured_only_after_released_steps_finished(rig, monkeypatch):
    """At TP > 1 the flags' exchange and gate are captured at their first queued step: the capture
    synchronizes the device, so a released step blocked again by a late word must be released first."""
    seen = _released_then_blocked(rig, monkeypatch)
    rig.pl._agreements.clear()  # the next queueing captures the exchange again
    rig.pl._agreement(rig.graphs.graph, len(LENS))
    assert seen == [True] and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY) and not rig.pl.passing


def test_a_released_step_is_not_stored_again_while_a_newer_one_is_queued(rig):
    """A queued step waits for the engine's word anyway, and the released ones before it on the stream
    with it; storing the older release then could only lower a word the engine just wrote."""
    _queue(rig)
    first = rig.pl.queued
    rig.pl.release()
    _serve(rig, SEQ + 2)
    _serve(rig, SEQ + 3)  # a new streak: SEQ+4 queued behind the released SEQ+2
    assert rig.pl.queued is not None and rig.pl.queued.seq == SEQ + 4
    rig.pl._passed = first
    first.done.passed = False  # not seen finished yet (helper 73: left passed, the guard went untested)
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 1, KEY)
    assert rig.pl.repass() is False  # the guard, not the event, decides here
    assert _word(rig) == bell.gpu_word(SEQ + 1, KEY)


def test_detaching_forgets_the_released_step_once_the_device_is_done(rig):
    """finish() may close the page next (Doorbell._close_page): nothing may read its word after."""
    _queue(rig)
    finish = rig.pl.detach()
    assert rig.pl.passing
    finish()
    assert not rig.pl.passing and rig.pl.repass() is True


def test_a_queueing_that_fails_after_its_wait_tracks_the_passed_wait(rig, monkeypatch):
    """The wait is queued before the program and the graph; a failure after it passes the wait (else the
    stream stays blocked), and that pass can be undone by a late word like any release: repass keeps it."""
    _serve(rig, SEQ)

    def broken(*args, warm=False, **kwargs):
        if not warm:  # compiled and loaded before the wait; its launch after the wait fails
            raise RuntimeError("injected: the metadata program failed to launch")

    class WaitEvent:  # finished once the word passes the last queued wait, as the stream would be
        def record(self, stream):
            pass

        def query(self):
            _, addr, value = rig.gpu.waits[-1]
            return (ctypes.c_uint64.from_address(addr).value - value) % (1 << 64) < 1 << 63

    monkeypatch.setattr(rig.pl, "_program", broken)
    monkeypatch.setattr(rig.pl, "_event", WaitEvent)
    with pytest.raises(RuntimeError, match="injected"):
        _serve(rig, SEQ + 1)  # after() queues SEQ+2: its wait goes in, then the program raises
    assert rig.pl.queued is None and rig.pl.passing and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 1, KEY)  # the engine's late word
    assert rig.pl.repass() is False and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)
    assert rig.pl.repass() is True and not rig.pl.passing


def test_launch_key_zero_never_queues(rig):
    for i in range(4):
        _serve(rig, SEQ + i, key=0)
    assert rig.pl.queued is None and rig.gpu.waits == [] and rig.graphs.replays == 0


def test_the_release_key_as_a_launch_key_never_queues(rig):
    """SKIP_KEY is the word the sidecar stores to release a queued step; the proto leaves every nonzero
    uint32 to the engine. A step queued under it would be rung by its own release: an engine that falls
    back (never rings) would have the GPU run the old layout's step anyway, writing K/V and output rows
    it never asked for."""
    region = torch.zeros_like(rig.graphs.graph.out)
    rig.out = region
    for i in range(3):
        _serve(rig, SEQ + i, key=bell.SKIP_KEY)
    q = rig.pl.queued
    rig.pl.release(wait=True)  # the engine fell back: a gRPC step, a BindKV or stopping releases it
    assert not region.any() and all((f != FLAG_RAN).all() for f in rig.gpu.flags)
    assert q is None and rig.gpu.waits == [] and rig.graphs.replays == 0


def test_close_unregisters_every_page_once(rig):
    _queue(rig)
    _serve(rig, SEQ + 2, rig.b, key=KEY + 1)  # another layout, another region
    _serve(rig, SEQ + 3, rig.b, key=KEY + 1)
    assert rig.pl.queued.token is rig.b.positions
    assert len(rig.gpu.registered) == 4  # header, flag page, two metadata regions
    q = rig.pl.queued
    rig.pl.close()
    assert sorted(rig.gpu.unregistered) == sorted(rig.gpu.registered) and len(set(rig.gpu.registered)) == 4
    assert q.done.passed and _word(rig) == bell.gpu_word(SEQ + 4, bell.SKIP_KEY)


def test_detaching_frees_nothing_before_the_device_has_passed(rig):
    """At TP > 1 a released copy finishes only with its peers' copies, and its program and gate write
    through the header and the flag page. Doorbell.stop() (a re-attach after one engine rank's link
    dropped) used to unregister and unmap them at once, the copy still queued: a stray device write."""
    _queue(rig)
    q = rig.pl.queued
    finish = rig.pl.detach()
    assert rig.pl.queued is None and not q.done.passed and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)
    assert rig.gpu.unregistered == [] and not rig.pl._flag_buf.closed
    rig.pl.close()  # detached: close() has nothing left to free
    assert rig.gpu.unregistered == []
    finish()  # the device has passed (RankLoop.after_device)
    assert sorted(rig.gpu.unregistered) == sorted(rig.gpu.registered) and rig.pl._flag_buf.closed


def test_forgetting_the_regions_unregisters_their_pages_and_queues_nothing_from_them(rig):
    """forget_regions (UnregisterBuffers), here between a step's take and its after(), which the doorbell
    no longer lets happen (it holds the loop's lock from a step through after()): the queued step is
    released without a host wait, the metadata region's registration ends only in finish() (once the
    device has passed what was queued, before the sidecar unmaps the region), and nothing is queued
    from the step served; the next streak queues again."""
    _queue(rig)
    q = rig.pl.queued
    region_pages = rig.gpu.registered[2:]  # after the header and the flag page
    assert len(region_pages) == 1 and rig.gpu.unregistered == []
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY)
    assert _take(rig, SEQ + 2, _req(), rig.a) is rig.graphs.graph.out  # answered from the queued copy
    waits = len(rig.gpu.waits)
    finish = rig.pl.forget_regions()
    assert rig.gpu.unregistered == [] and q.done.synced == 0  # no host wait; the device may still read them
    finish()  # the device has passed the point (RankLoop.after_device)
    assert rig.gpu.unregistered == region_pages and rig.pl._replays == {}
    rig.pl.after(SEQ + 2, OK)
    assert rig.pl.queued is None and len(rig.gpu.waits) == waits
    _serve(rig, SEQ + 3)
    _serve(rig, SEQ + 4)  # a new streak: its region registered again, the next step queued
    assert rig.pl.queued is not None and rig.pl.queued.seq == SEQ + 5 and len(rig.gpu.registered) == 4


def test_a_late_finish_of_forgotten_regions_lets_go_of_their_launches_only(rig):
    """forget_regions takes the layouts' captured launches out of use at once (they hold views of the regions,
    which stay mapped while they live) and lets them go in finish(), once the device has passed what was
    queued: at TP > 1 nothing waits for that, and steps of the regions still registered are served, queued
    and captured meanwhile. finish() lets go of the launches captured before the release only; had it dropped
    those captured since, a layout's replay (maybe queued on the stream that moment) went with them, and its
    next queue warmed up and captured again."""
    _queue(rig)
    _serve(rig, SEQ + 2)  # the layout's second queue: its metadata launches captured
    assert len(rig.meta_captures) == 1
    finish = rig.pl.forget_regions()  # e.g. another region of the engine's released: this one stays
    for s in range(SEQ + 3, SEQ + 6):  # a new streak: SEQ+5 queued, then SEQ+6, its launches captured again
        _serve(rig, s)
    assert rig.pl.queued.seq == SEQ + 6 and len(rig.meta_captures) == 2
    captured = dict(rig.pl._replays)
    warmed = list(rig.gpu.warmed)
    finish()  # the device has passed the release (RankLoop.after_device)
    assert captured and rig.pl._replays.keys() == captured.keys()
    assert all(rig.pl._replays[k] is v for k, v in captured.items())
    assert _serve(rig, SEQ + 6) is rig.graphs.graph.out
    assert len(rig.meta_captures) == 2 and rig.gpu.warmed == warmed  # replayed, not warmed or captured again


def test_the_threshold_is_the_serve_flag_s_or_behind_s(rig):
    """Prelaunch(behind_s=...) is what serve --prelaunch-behind-ms passes (servicer -> doorbell)."""
    for given, want in ((None, prelaunch.BEHIND_S), (1e-3, 1e-3)):
        other = prelaunch.Prelaunch(rig.gpu, rig.page, rig.word_addr - bell.GPU_WORD_OFFSET, rig.graphs, WINDOW,
                                    event=lambda: Event(rig.gpu), program=rig.gpu.program,
                                    **({} if given is None else {"behind_s": given}))
        assert other.behind_s == want
        other.close()


def test_gpu_far_behind_stops_queueing_for_a_while(rig, monkeypatch):
    """A queued step whose GPU start the host waited for longer than BEHIND_S is still answered from
    the queue, but the next COOLDOWN steps are not queued (answered as soon as launched); a second
    such wait doubles the pause."""
    rig.pl.behind_s = -1.0  # every wait counts as far behind
    monkeypatch.setattr(prelaunch, "COOLDOWN", 3)
    rig.pl._next_cooldown = 3
    _queue(rig)
    assert _serve(rig, SEQ + 2) is rig.graphs.graph.out  # the hit still counts
    assert rig.pl.queued is None and rig.pl.cooldown == 2
    for s in (SEQ + 3, SEQ + 4):
        assert _serve(rig, s) is None and rig.pl.queued is None
    _serve(rig, SEQ + 5)  # the pause is over and the streak held: queued again
    assert rig.pl.queued is not None and rig.pl.queued.seq == SEQ + 6
    assert _serve(rig, SEQ + 6) is rig.graphs.graph.out
    assert rig.pl.cooldown == 5  # 6, doubled, minus this step's


def test_the_cooldown_doubles_up_to_max_cooldown(rig, monkeypatch):
    """Each far-behind wait after a cooldown doubles the next pause, but never past MAX_COOLDOWN: an
    engine that falls behind now and then for hours must not turn pre-launching off for good."""
    rig.pl.behind_s = -1.0  # every wait counts as far behind
    monkeypatch.setattr(prelaunch, "COOLDOWN", 3)
    monkeypatch.setattr(prelaunch, "MAX_COOLDOWN", 8)
    rig.pl._next_cooldown = 3
    _queue(rig)
    seq, pauses = SEQ + 2, []
    for _ in range(4):
        assert _serve(rig, seq) is rig.graphs.graph.out  # queued, and far behind: a cooldown starts
        pauses.append(rig.pl.cooldown + 1)  # this step's is already counted
        seq += 1
        while rig.pl.cooldown:
            assert _serve(rig, seq) is None and rig.pl.queued is None
            seq += 1
        _serve(rig, seq)  # the pause is over: queued again
        seq += 1
        assert rig.pl.queued is not None and rig.pl.queued.seq == seq
    assert pauses == [3, 6, 8, 8]


# TP > 1: what the ranks agree on (server/rendezvous.py offers), and the flags' exchange on the GPU ----

@pytest.mark.parametrize("world", [2])
def test_tp2_hit_needs_every_rank_s_flags(rig):
    _queue(rig)
    assert len(rig.captures) == 1  # the exchange + gate graph, captured once for this step graph
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY)
    hook = rig.pl.hook(SEQ + 2, _req())
    assert hook.offer(rig.a) == (True, True)
    assert hook.take(True, True) is rig.graphs.graph.out
    rig.pl.after(SEQ + 2, OK)
    assert rig.pl.queued.seq == SEQ + 3 and len(rig.captures) == 1  # the same graph: no new capture


@pytest.mark.parametrize("world", [2])
def test_tp2_a_request_a_peer_refused_writes_nothing_here(rig):
    """The peer's copy of request 1 was invalid: here it ran, but the gate makes it a no-op (slots -1)
    before the graph, so no K/V summed with the peer's no-op is written; the host sees the agreed flag."""
    _queue(rig)
    rig.peer[1] = FLAG_INVALID
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY)
    hook = rig.pl.hook(SEQ + 2, _req())
    assert hook.offer(rig.a) == (False, True)
    assert rig.gpu.flags[-1].tolist() == [FLAG_RAN, FLAG_RAN]  # this rank's own program accepted both
    slots = rig.graphs.graph.views[2].numpy().reshape(len(LENS), Q)
    np.testing.assert_array_equal(slots[0], rig.a.meta.slot_mapping.numpy()[:Q])
    assert (slots[1] == -1).all()
    assert hook.take(False, True) is None and (rig.pl.hits, rig.pl.misses) == (0, 1)
    assert _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)


@pytest.mark.parametrize("world", [2])
def test_tp2_the_verdict_overrides_this_rank_s_view(rig):
    """A verdict without QUEUED after this rank accepted its copy (the coordinator now aborts a step whose
    copies ran on some ranks only, SOME_COPIES; rank.py checks the host copy should such a GO come): the
    accepted copy is released all the same. And the next step is queued exactly when the verdict says so,
    even after an error answer here (the peers queue theirs: one rank without would pair their
    collectives with its ordinary step)."""
    _queue(rig)
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY)
    hook = rig.pl.hook(SEQ + 2, _req())
    assert hook.offer(rig.a) == (True, True)
    assert hook.take(False, True) is None and rig.pl.misses == 1
    rig.pl.after(SEQ + 2, ERR)
    assert rig.pl.queued is not None and rig.pl.queued.seq == SEQ + 3
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 3, KEY)
    hook = rig.pl.hook(SEQ + 3, _req())
    assert hook.offer(rig.a)[0]
    assert hook.take(True, False) is rig.graphs.graph.out  # a peer in its cooldown: none queues the next
    rig.pl.after(SEQ + 3, OK)
    assert rig.pl.queued is None


def test_a_late_peer_is_no_news_a_late_own_word_is(rig, clock):
    """The cooldown is judged on this engine's own word. Waiting for anything else (at TP > 1 the
    peers' words and the flags' exchange; once per flags' graph every rank's capture, ~45 ms in
    run 92) starts none: one rank's cooldown would veto queueing on every rank."""
    rig.pl.behind_s = 0.01
    _queue(rig)
    rig.gpu.hold_until = clock.now + 0.05  # the word is here; the copy starts 50 ms later
    assert _serve(rig, SEQ + 2) is rig.graphs.graph.out and rig.pl.cooldown == 0
    assert rig.pl.queued is not None and rig.pl.queued.seq == SEQ + 3
    # StepTimings' split of the wait: the word was there at once, the copy started 50 ms later (on the
    # rig's clock, give or take its polls).
    word_ns, start_ns = rig.pl.word_wait_ns, rig.pl.start_wait_ns  # the served step's (its hook's waits_ns)
    assert word_ns == 0 and 0.04e9 <= start_ns <= 0.06e9, (word_ns, start_ns)
    clock.at(0.05, _lands(rig, SEQ + 3))  # this engine's stream writes its word 50 ms after the ring
    assert _take(rig, SEQ + 3, _req(), rig.a) is rig.graphs.graph.out
    assert rig.pl.cooldown > 0
    assert 0.04e9 <= rig.pl.word_wait_ns <= 0.06e9 and rig.pl.start_wait_ns >= rig.pl.word_wait_ns


def _cooldown_step(r, seq, on_time: bool, behind_s: float):
    """One ordinary step in a cooldown: the ring, the answer, then the doorbell's idle polls (watch).
    on_time: the engine's stream writes the word before the ring (a synchronized engine); else it is
    still missing once behind_s has passed (its GPU far behind), and lands only after that."""
    if on_time:
        r.page.words[bell.GPU_WORD] = bell.gpu_word(seq, KEY)
    assert _take(r, seq, _req(), r.a) is None  # not queued in a cooldown: launched the ordinary way
    r.pl.after(seq, OK)
    r.pl.watch()
    if not on_time:
        r.clock.advance(behind_s * 1.5)
        r.pl.watch()  # late already: judged without waiting for it to land
        r.page.words[bell.GPU_WORD] = bell.gpu_word(seq, KEY)
        r.pl.watch()


def test_a_cooldown_ends_once_the_engine_s_words_arrive_on_time_again(rig, clock):
    """An engine that was far ahead (a long prefill) and synchronizes again gets pre-launched steps back
    after ON_TIME steps in a row whose words arrived within behind_s of their ring, and the doubling
    starts over; late words, or a word that had not arrived by the next ring, start that count over."""
    rig.pl.behind_s = 0.01
    _queue(rig)
    clock.at(0.03, _lands(rig, SEQ + 2))
    assert _take(rig, SEQ + 2, _req(), rig.a) is rig.graphs.graph.out
    rig.pl.after(SEQ + 2, OK)
    assert rig.pl.cooldown == prelaunch.COOLDOWN - 1 and rig.pl._next_cooldown == 2 * prelaunch.COOLDOWN
    seq = SEQ + 3
    for _ in range(prelaunch.ON_TIME + 2):  # still far behind: the cooldown goes on
        _cooldown_step(rig, seq, on_time=False, behind_s=rig.pl.behind_s)
        seq += 1
    for _ in range(prelaunch.ON_TIME - 1):
        _cooldown_step(rig, seq, on_time=True, behind_s=rig.pl.behind_s)
        seq += 1
    # One step's word has not arrived when the next rings (no watch in between): no evidence either way.
    assert _take(rig, seq, _req(), rig.a) is None
    rig.pl.after(seq, OK)
    seq += 1
    for _ in range(prelaunch.ON_TIME - 1):
        _cooldown_step(rig, seq, on_time=True, behind_s=rig.pl.behind_s)
        seq += 1
    assert rig.pl.cooldown > 0 and rig.pl.queued is None
    _cooldown_step(rig, seq, on_time=True, behind_s=rig.pl.behind_s)  # the ON_TIME-th in a row
    assert rig.pl.cooldown == 0 and rig.pl._next_cooldown == prelaunch.COOLDOWN
    seq += 1
    _serve(rig, seq)  # the layout's streak held through the cooldown: the next step is queued
    assert rig.pl.queued is not None and rig.pl.queued.seq == seq + 1
    assert _serve(rig, seq + 1) is rig.graphs.graph.out


def test_a_late_word_starts_the_on_time_count_over(rig, clock):
    """ON_TIME cooldown steps *in a row* end a cooldown early. The on-time steps of a cooldown that ran out
    before reaching ON_TIME, with the late word that starts the next cooldown after them, are not such a
    row: counted on, the next cooldown ended after one on-time step (and reset the doubling)."""
    rig.pl.behind_s = 0.01
    rig.pl.cooldown = prelaunch.ON_TIME - 1  # a cooldown about to run out
    seq = SEQ
    for _ in range(prelaunch.ON_TIME - 1):  # on time, one too few to end it early: it runs out instead
        _cooldown_step(rig, seq, on_time=True, behind_s=rig.pl.behind_s)
        seq += 1
    assert rig.pl.cooldown == 0
    _serve(rig, seq)  # the streak held: the next step is queued
    seq += 1
    assert rig.pl.queued is not None and rig.pl.queued.seq == seq
    clock.at(0.03, _lands(rig, seq))  # this engine's word lands 30 ms after the ring: far behind again
    assert _take(rig, seq, _req(), rig.a) is rig.graphs.graph.out
    rig.pl.after(seq, OK)
    assert rig.pl.cooldown == prelaunch.COOLDOWN - 1
    for _ in range(prelaunch.ON_TIME - 1):  # on time again, but not yet ON_TIME in a row since the late word
        seq += 1
        _cooldown_step(rig, seq, on_time=True, behind_s=rig.pl.behind_s)
        assert rig.pl.cooldown > 0 and rig.pl.queued is None
    seq += 1
    _cooldown_step(rig, seq, on_time=True, behind_s=rig.pl.behind_s)  # the ON_TIME-th since the late word
    assert rig.pl.cooldown == 0 and rig.pl._next_cooldown == prelaunch.COOLDOWN


def test_watch_outside_a_cooldown_does_nothing(rig):
    _queue(rig)
    rig.pl.watch()
    assert rig.pl.cooldown == 0 and rig.pl.queued.seq == SEQ + 2 and rig.pl._watched is None


def test_a_word_there_at_the_ring_is_on_time_however_long_the_step_takes(rig, clock):
    """A synchronized engine's word lands before its ring; the step may then take longer than behind_s
    on the sidecar's host (a graph capture for a new R): judged at the ring, it is still on time."""
    rig.pl.behind_s = 0.01
    rig.pl.cooldown = 50
    for seq in range(SEQ, SEQ + prelaunch.ON_TIME):
        rig.page.words[bell.GPU_WORD] = bell.gpu_word(seq, KEY)
        hook = rig.pl.hook(seq, _req())
        queued, nxt = hook.offer(rig.a)
        clock.advance(2 * rig.pl.behind_s)  # the step's host path, longer than behind_s
        assert hook.take(queued, nxt) is None
        rig.pl.after(seq, OK)
        rig.pl.watch()
    assert rig.pl.cooldown == 0


def test_a_word_first_seen_past_behind_s_breaks_the_on_time_row_though_it_is_there(rig, clock):
    """A cooldown step's word that the doorbell's polls first see only after behind_s (it landed while the
    thread was busy, say) cannot be placed before behind_s: it breaks the row of on-time steps like a late
    word. Counted on, the row went on, and the next on-time step ended the cooldown one step early."""
    behind_s = rig.pl.behind_s = 0.01
    rig.pl.cooldown = 50
    seq = SEQ
    for _ in range(prelaunch.ON_TIME - 1):
        _cooldown_step(rig, seq, on_time=True, behind_s=behind_s)
        seq += 1
    assert _take(rig, seq, _req(), rig.a) is None  # the ring: its word not there yet
    rig.pl.after(seq, OK)
    clock.advance(1.5 * behind_s)  # no look between the ring and now ...
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(seq, KEY)  # ... and the word landed meanwhile
    rig.pl.watch()  # first seen now: past behind_s
    assert rig.pl._watched is None and rig.pl._on_time == 0
    seq += 1
    for _ in range(prelaunch.ON_TIME - 1):  # a new row: one short of ON_TIME
        _cooldown_step(rig, seq, on_time=True, behind_s=behind_s)
        seq += 1
    assert rig.pl.cooldown > 0
    _cooldown_step(rig, seq, on_time=True, behind_s=behind_s)
    assert rig.pl.cooldown == 0


def _exact_clock(rig, monkeypatch) -> float:
    """Polls of 2^-10 s and behind_s = 8 of them: every time the tests below read is exact in binary, so a
    word that lands exactly behind_s after the ring is read as exactly behind_s."""
    monkeypatch.setattr(_Clock, "POLL_S", 2.0 ** -10)
    rig.pl.behind_s = 2.0 ** -7
    return rig.pl.behind_s


def test_a_queued_step_s_word_exactly_behind_s_after_the_ring_starts_no_cooldown(rig, clock, monkeypatch):
    """--prelaunch-behind-ms: a word arriving *more* than behind_s after the ring starts a cooldown; one
    exactly that late is within it."""
    behind_s = _exact_clock(rig, monkeypatch)
    _queue(rig)
    clock.at(behind_s, _lands(rig, SEQ + 2))
    assert _take(rig, SEQ + 2, _req(), rig.a) is rig.graphs.graph.out
    assert rig.pl.word_wait_ns == int(behind_s * 1e9) and rig.pl.cooldown == 0
    rig.pl.after(SEQ + 2, OK)
    assert rig.pl.queued is not None and rig.pl.queued.seq == SEQ + 3


def test_a_cooldown_step_s_word_exactly_behind_s_after_its_ring_is_on_time(rig, clock, monkeypatch):
    """The watch's judgement has the same edge as the queued step's: within behind_s, that value included."""
    behind_s = _exact_clock(rig, monkeypatch)
    rig.pl.cooldown = 50
    for seq in range(SEQ, SEQ + prelaunch.ON_TIME):
        assert _take(rig, seq, _req(), rig.a) is None
        rig.pl.after(seq, OK)
        clock.advance(behind_s)
        rig.page.words[bell.GPU_WORD] = bell.gpu_word(seq, KEY)
        rig.pl.watch()
    assert rig.pl.cooldown == 0


def test_a_word_seen_only_through_the_started_copy_is_timed_as_late_as_that(rig, clock, monkeypatch):
    """The word can land between the host's look at it and its look at the queued copy's start (the copy
    waits on it, so started means landed): the wait then says when it landed, at the latest. Past
    behind_s that is a late word, a cooldown; taken as on time, an engine far behind its host kept being
    held by queued steps."""
    rig.pl.behind_s = 0.01
    _queue(rig)
    ready, t0 = rig.pl._ready, clock.now
    real = ready.query

    def query():
        if clock.now - t0 >= 0.02 and _word(rig) != bell.gpu_word(SEQ + 2, KEY):
            _lands(rig, SEQ + 2)()  # right after the host's look at the word found it missing
        return real()

    monkeypatch.setattr(ready, "query", query)
    assert _take(rig, SEQ + 2, _req(), rig.a) is rig.graphs.graph.out
    assert 0.02e9 <= rig.pl.word_wait_ns <= 0.03e9 and rig.pl.cooldown > 0
    rig.pl.after(SEQ + 2, OK)
    assert rig.pl.queued is None


def test_the_queued_rows_go_to_the_engine_s_output_slice_on_the_gpu(rig):
    """With the engine's output slice known (output_of), the queued step copies its rows there behind the
    replay, gated by the flags, and a hit answers with that slice: the host path copies nothing."""
    region = torch.zeros_like(rig.graphs.graph.out)
    rig.out = region
    _queue(rig)
    assert [(src, dst, R) for src, dst, R in rig.copies] == [(rig.graphs.graph.out, region, len(LENS))]
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY)
    got = _take(rig, SEQ + 2, _req(), rig.a)
    assert got is region and torch.equal(region, rig.graphs.graph.out)


def test_the_gated_copy_is_captured_at_a_layout_s_second_queue(rig):
    """Like the metadata launches: run as it is the first time a layout is queued, captured (before the
    wait) the second, replayed from then on; each queued step still copies its own rows."""
    region = torch.zeros_like(rig.graphs.graph.out)
    rig.out = region
    _queue(rig)
    assert rig.copy_captures == [] and len(rig.copies) == 1
    for s in (SEQ + 2, SEQ + 3, SEQ + 4):
        rig.graphs.graph.out.fill_(s)  # this step's rows
        assert _serve(rig, s) is region and torch.equal(region, rig.graphs.graph.out)
        assert len(rig.copy_captures) == 1 and rig.pl.queued.seq == s + 1
    assert len(rig.copies) == 4 and all(c[1] is region for c in rig.copies)
    # Another output slice: a key of its own, run directly when first queued, captured when next.
    rig.out = other = torch.zeros_like(region)
    rig.graphs.graph.out.fill_(SEQ + 5)
    assert _serve(rig, SEQ + 5) is rig.graphs.graph.out  # queued for the old slice: not this step's
    assert len(rig.copy_captures) == 1 and rig.copies[-1][1] is other
    _serve(rig, SEQ + 6)
    assert len(rig.copy_captures) == 2 and len(rig.copies) == 6


@pytest.mark.parametrize("kind", ["other-key", "other-slice"])
def test_a_queued_copy_never_answers_for_another_step_s_output(rig, kind):
    """A word for another layout: the GPU refuses every request and the gated copy writes nothing into
    the slice. A step naming another slice than the queued one: answered from the graph's own output,
    which the host path then copies where that step asked."""
    region = torch.zeros_like(rig.graphs.graph.out)
    rig.out = region
    _queue(rig)
    if kind == "other-key":
        rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY + 1)
        assert _take(rig, SEQ + 2, _req(), rig.a) is None
        assert not region.any()  # every flag NOT_RUNG: nothing copied
    else:
        rig.out = torch.zeros_like(region)  # the step's own slice resolves elsewhere
        rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY)
        assert _take(rig, SEQ + 2, _req(), rig.a) is rig.graphs.graph.out


@pytest.mark.parametrize("world", [1])
@pytest.mark.parametrize("staged", [False])
def test_a_prelaunch_the_driver_refuses_halfway_leaves_no_page_registered(rig):
    """The pre-launch registers the doorbell's header, then its own flag page. When the driver refused
    the second (GpuWordError), the doorbell went on without a pre-launch, as it should, but the header
    stayed registered: nothing held it any more to unregister it, not even the stop that unmaps the page."""
    from dspark_sidecar.proto.gpu_word import GpuWordError

    refused = []

    class Ops(Gpu):
        def register(self, ptr, nbytes):
            if self.registered:
                refused.append(ptr)
                raise GpuWordError("cuMemHostRegister_v2 failed with driver code 2")
            return super().register(ptr, nbytes)

    ops = Ops()
    with pytest.raises(GpuWordError):
        prelaunch.Prelaunch(ops, rig.page, rig.word_addr - bell.GPU_WORD_OFFSET, rig.graphs, WINDOW,
                            event=lambda: Event(ops), program=ops.program)
    assert len(refused) == 1 and ops.registered == [rig.word_addr - bell.GPU_WORD_OFFSET]
    assert ops.unregistered == ops.registered


def _private(step: Step) -> Step:
    """`step` as a rank validates it (validate.PrivateCopy): its index tensors copied out of the region, the
    region's own views kept as its sources."""
    own = [t.clone() for t in step.region_meta]
    meta = StepMetadata(*own[1:])
    return Step(step.step_id, step.num_reqs, own[0], step.inputs_embeds, None, meta, step.kv, None,
                host_meta(own[0], meta), True, step.region_meta)


def test_a_queued_program_reads_the_region_not_the_step_s_private_copy(rig):
    """The host checks and runs a copy of the step's metadata; the queued step runs after the engine's next
    write, so its program must read (and check) the region. Read from the copy, it checked the last step's
    values: a request the engine made invalid in the region ran, on the copy's stale slots."""
    step = _private(rig.a)
    _serve(rig, SEQ, step)
    _serve(rig, SEQ + 1, step)
    [(_, _, src, _, _, _)] = rig.gpu.programs
    region = [t.data_ptr() for t in rig.a.region_meta]
    if rig.staged:
        [(src_addr, *_)] = rig.gpu.copies
        assert src_addr == rig.a.positions.untyped_storage().data_ptr()
    else:
        assert [p.address for p in src] == region
    # The engine's next step, written to the region: request 1's slots far past the cache.
    rig.a.meta.slot_mapping[Q:] = PAGES * PAGE + 5
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY)
    assert _take(rig, SEQ + 2, _req(), step) is None  # not answered from the queued copy
    assert rig.gpu.flags[-1].tolist() == [FLAG_RAN, FLAG_INVALID]


def test_prelaunch_captures_in_thread_local_mode_with_the_collector_off(monkeypatch):
    """A collection inside a capture that freed an IPC-mapped tensor aborted the rank (run 267); another
    thread's allocation during a global-mode capture invalidates it. Both are ruled out at the capture."""
    import contextlib
    import gc

    seen = []

    @contextlib.contextmanager
    def graph(g, capture_error_mode="global"):
        seen.append(capture_error_mode)
        yield

    monkeypatch.setattr(prelaunch.torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: "replayed"))
    monkeypatch.setattr(prelaunch.torch.cuda, "graph", graph)
    replay = prelaunch._capture_graph(lambda: seen.append(gc.isenabled()))
    assert seen == ["thread_local", False] and gc.isenabled() and replay() == "replayed"


def test_a_layout_s_metadata_replay_holds_the_graph_s_views_not_the_graph(rig):
    """An entry of _replays lives until the layout goes or 128 accumulate; holding the step graph itself
    kept graphs a rebind dropped alive, with their memory pools (helper 77)."""
    _queue(rig)
    _serve(rig, SEQ + 2)  # the second queue: captured (the rig's capture returns run_metadata itself)
    [(held, replay)] = [v for k, v in rig.pl._replays.items() if k[0] == "metadata"]
    cells = [c.cell_contents for c in replay.__closure__ or ()]
    assert rig.graphs.graph not in cells and any(c is rig.graphs.graph.views for c in cells)
    # What its baked-in addresses belong to, the engine's region views included: kept while the entry lives.
    assert all(any(h is t for h in held) for t in (rig.graphs.graph.views, *rig.a.region_meta))


@pytest.mark.parametrize("world", [1])
@pytest.mark.parametrize("staged", [False])
def test_a_replaced_doorbell_s_region_registrations_are_shared_with_the_new_one_s(rig):
    """A replaced doorbell's pre-launch ends its registrations of the engine's regions once the device has
    done its queued work, which at TP > 1 nothing waits for (Doorbell._drop_prelaunch: a released copy
    finishes only with its peers'). The new doorbell's pre-launch registers the same regions for its first
    queued step, often before then: the driver refuses pages already registered (as this fake does), and
    at TP > 1 a step that could not be queued exits the rank (Doorbell._queue_next)."""
    from dspark_sidecar.proto.gpu_word import GpuWordError

    gpu = rig.gpu
    live = set(gpu.registered) - set(gpu.unregistered)  # the driver's registrations
    plain_register, plain_unregister = gpu.register, gpu.unregister

    def register(ptr, nbytes):
        if ptr in live:
            raise GpuWordError("cuMemHostRegister_v2 failed with driver code 712")
        live.add(ptr)
        return plain_register(ptr, nbytes)

    def unregister(ptr):
        live.remove(ptr)
        plain_unregister(ptr)

    gpu.register, gpu.unregister = register, unregister
    _queue(rig)
    region = rig.a.positions.untyped_storage().data_ptr()
    assert region in live
    finish = rig.pl.detach()  # not called yet: the device has not done the released copy (TP > 1)
    page_buf = mmap.mmap(-1, mmap.PAGESIZE)
    page = bell.Page(np.frombuffer(page_buf, np.uint8), 1024)
    new = prelaunch.Prelaunch(gpu, page, np.frombuffer(page_buf, np.uint8).ctypes.data, rig.graphs, WINDOW,
                              event=lambda: Event(gpu), program=gpu.program)
    for seq in (1, 2):  # the new page's steps, same layout: the second queues step 3
        page.words[bell.GPU_WORD] = bell.gpu_word(seq, KEY)
        hook = new.hook(seq, _req())
        hook.take(*hook.offer(rig.a))
        new.after(seq, OK)
    assert new.queued is not None and new.queued.seq == 3
    finish()  # the old pre-launch's registrations end; the region's stays, the new one reads it
    assert region in live
    page.words[bell.GPU_WORD] = bell.gpu_word(3, KEY)
    hook = new.hook(3, _req())
    assert hook.take(*hook.offer(rig.a)) is rig.graphs.graph.out
    new.after(3, OK)
    new.close()
    assert live == set()


def test_a_step_that_offers_nothing_reports_none_of_an_earlier_step_s_waits(rig):
    """StepTimings' gpu_word_wait_ns and gpu_start_wait_ns are 0 when nothing was queued for the step
    (sidecar.proto). A step on the kernel fast path never offers (rank.py), and reported the waits of
    the last step answered from a queued copy: every fast step after it, until the next offer."""
    rig.pl.behind_s = 10.0  # the late word below starts no cooldown
    _queue(rig)
    late = threading.Timer(0.02, lambda: rig.page.words.__setitem__(bell.GPU_WORD, bell.gpu_word(SEQ + 2, KEY)))
    late.start()
    hook = rig.pl.hook(SEQ + 2, _req())
    assert hook.take(*hook.offer(rig.a)) is rig.graphs.graph.out
    late.join()
    assert hook.waits_ns()[0] > 0 and hook.waits_ns()[1] > 0  # this step's own waits
    rig.pl.after(SEQ + 2, OK)
    for seq in (SEQ + 3, SEQ + 4):  # on the fast path: no offer, the verdict neither takes nor queues
        rig.page.words[bell.GPU_WORD] = bell.gpu_word(seq, KEY)
        hook = rig.pl.hook(seq, _req())
        assert hook.take(False, False) is None
        assert hook.waits_ns() == (0, 0)
        rig.pl.after(seq, OK)


def test_an_output_slice_the_gpu_cannot_reach_is_copied_by_the_answer_not_behind_the_wait(rig, monkeypatch):
    """The proto lets an engine name any registered region for the hidden states, host shared memory
    included (the ordinary answer copies there from the host). The gated copy is a GPU kernel, and
    Triton's launcher refuses a pointer the GPU cannot reach ("cannot be accessed from Triton (cpu
    tensor?)"); its warm-up does not look. Launched behind the wait, the failure passed the wait and
    raised out of after(): pre-launching stopped at TP 1, and at TP > 1 the rank exited
    (Doorbell._queue_next). A slice off the graph's device is left to the answer's host path."""
    plain = rig.pl._copy_out

    def triton_like(src, dst, flags, R, warm=False):
        if not warm and dst.device != src.device:
            raise ValueError("Pointer argument (at 1) cannot be accessed from Triton (cpu tensor?)")
        plain(src, dst, flags, R, warm=warm)

    monkeypatch.setattr(rig.pl, "_copy_out", triton_like)
    rig.out = torch.empty_like(rig.graphs.graph.out, device="meta")  # stands in for host memory beside a GPU
    _queue(rig)
    assert rig.copies == [] and rig.pl.queued.out is None
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY)
    assert _take(rig, SEQ + 2, _req(), rig.a) is rig.graphs.graph.out  # rank._output copies it where asked
    rig.pl.after(SEQ + 2, OK)
    assert rig.pl.queued.seq == SEQ + 3 and rig.copies == []


@pytest.mark.parametrize("world", [1])
@pytest.mark.parametrize("boundary", [1 << 32, 1 << 31], ids=["wrap", "2^31"])
def test_hip_queues_no_step_next_to_the_sequence_wrap(rig, boundary, monkeypatch):
    """HIP's wait is a plain >= on the word (proto/gpu_word.py), the host's view of it (repass) cyclic, as
    CUDA's is. A step queued as the last before the 32-bit sequence wraps, then released (the engine rang
    another layout), waits for word >= 0xFFFFFFFF << 32: the engine's next word, 0 << 32 | key, there
    before the stream reaches that wait, never passes it, and repass saw it passed and stored nothing: the
    rank's stream blocked for good (here release(wait=True) gave up). At 2^31, a signed compare's own edge,
    the same: no step that near either is queued on HIP."""
    monkeypatch.setattr(prelaunch, "RELEASE_WAIT_S", 0.05)
    monkeypatch.setattr(prelaunch, "WRAP_GUARD", 3, raising=False)
    rig.gpu.hip = rig.pl._hip = True
    last = boundary - 1  # the step whose successor is the first after the edge
    _serve(rig, last - 2)
    _serve(rig, last - 1)  # a streak: on CUDA `last` would be queued now
    _serve(rig, last, key=KEY + 1)  # another layout: a queued `last` would have been released here
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(last + 1, KEY + 1)  # the engine's next word lands
    rig.pl.release(wait=True)  # e.g. a BindKV: nothing released may still wait on the device
    assert rig.pl.misses == 0 and len(rig.gpu.waits) == 0  # nothing was queued
    for s in range(last + 1, last + 3):  # a streak again, still within the guard
        _serve(rig, s, key=KEY + 1)
        assert rig.pl.queued is None
    seq = last + 3  # the next one, boundary + 3, is WRAP_GUARD past the edge: queued again, and a hit
    _serve(rig, seq, key=KEY + 1)
    assert rig.pl.queued is not None and rig.pl.queued.seq == seq + 1
    assert _serve(rig, seq + 1, key=KEY + 1) is rig.graphs.graph.out


@pytest.mark.parametrize("world", [1])
@pytest.mark.parametrize("boundary", [1 << 32, 1 << 31], ids=["wrap", "2^31"])
def test_hip_queues_a_step_exactly_wrap_guard_before_the_edge(rig, boundary, monkeypatch):
    """The guard is the steps *within* WRAP_GUARD of an edge, on both sides: boundary + WRAP_GUARD is queued
    again (above), and so is boundary - WRAP_GUARD, the last step before the guarded ones."""
    monkeypatch.setattr(prelaunch, "WRAP_GUARD", 3, raising=False)
    rig.gpu.hip = rig.pl._hip = True
    first = boundary - 3  # WRAP_GUARD steps before the edge
    _serve(rig, first - 2)
    _serve(rig, first - 1)
    assert rig.pl.queued is not None and rig.pl.queued.seq == first
    assert _serve(rig, first) is rig.graphs.graph.out
    assert rig.pl.queued is None  # first + 1 is within the guard


@pytest.mark.parametrize("world", [1])
def test_hip_queues_the_first_steps_of_a_page(rig):
    """A page starts at step 0 with its word 0 (the engine's fresh, zeroed page): the first steps' waits meet
    only words of steps 0 and on, and cross no edge of the sequence, so HIP's plain >= is right there. Guarded
    as if next to the wrap, HIP queued no step before the 65536th of each AttachDoorbell."""
    rig.gpu.hip = rig.pl._hip = True
    _serve(rig, 1)
    _serve(rig, 2)
    for s in range(3, 6):
        assert rig.pl.queued is not None and rig.pl.queued.seq == s
        assert _serve(rig, s) is rig.graphs.graph.out
    assert rig.pl.hits == 3 and rig.pl.misses == 0


@pytest.mark.parametrize("world", [1])
def test_cuda_queues_across_the_sequence_wrap(rig):
    """CUDA's wait compares cyclically, as the host does: steps are queued and answered across the wrap."""
    seq = (1 << 32) - 3
    _serve(rig, seq)
    _serve(rig, seq + 1)
    for s in range(seq + 2, seq + 6):
        assert rig.pl.queued.seq == s and _serve(rig, s) is rig.graphs.graph.out
    assert rig.pl.hits == 4 and rig.pl.misses == 0


def test_an_error_answer_to_a_served_step_resets_the_streak(rig):
    """The error branch of after() itself: the step's hook ran (offer set what it served), the answer was an
    error. test_error_response_releases_and_resets_the_streak refuses before the hook ran, where the
    served-step check resets the streak first, so it passed with the error check deleted."""
    _queue(rig)
    _serve(rig, SEQ + 2, resp=ERR)  # a hit, answered with an error: the verdict still queues SEQ+3
    assert rig.pl._streak == 0 and rig.pl.queued is not None and rig.pl.queued.seq == SEQ + 3
    _serve(rig, SEQ + 3)  # the first step of a new streak: nothing queued behind it
    assert rig.pl.queued is None
    _serve(rig, SEQ + 4)
    assert rig.pl.queued.seq == SEQ + 5


def test_after_for_another_step_than_the_one_served_queues_nothing(rig):
    """after(seq) with a seq whose hook never ran (the last hook was another step's): nothing of that other
    step may be queued as seq+1, and the streak starts over."""
    _queue(rig)
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY)
    assert _take(rig, SEQ + 2, _req(), rig.a) is rig.graphs.graph.out
    rig.pl.after(SEQ + 5, OK)
    assert rig.pl.queued is None and rig.pl._streak == 0 and len(rig.gpu.waits) == 1


def test_repass_never_lowers_a_newer_engine_word(rig):
    """A released step not yet finished (its copy not started: a peer late at TP > 1) while the engine's stream
    has already written a later step's word: the wait passes on that word, and storing the release again
    would lower it under the engine's next queued wait."""
    _queue(rig)
    rig.gpu.hold_until = time.perf_counter() + 60  # the released copy has not started
    rig.pl.release()
    newer = bell.gpu_word(SEQ + 3, KEY)
    rig.page.words[bell.GPU_WORD] = newer
    assert rig.pl.repass() is False and _word(rig) == newer
    rig.gpu.hold_until = 0.0
    assert rig.pl.repass() is True and _word(rig) == newer


def test_metadata_outside_host_memory_is_never_queued(rig):
    """The program reads the engine's region through host registrations (_device_view): metadata in device
    memory cannot be registered, and a step of it is served the ordinary way, never queued."""
    own = [t.to("meta") for t in rig.a.region_meta]
    step = Step(rig.a.step_id, rig.a.num_reqs, rig.a.positions, rig.a.inputs_embeds, None, rig.a.meta, rig.a.kv,
                None, rig.a.host, True, tuple(own))
    rig.pl._device_view = lambda t: pytest.fail(f"queued from metadata on {t.device}")  # (a fake's read would crash)
    for s in (SEQ, SEQ + 1, SEQ + 2):
        _serve(rig, s, step)
    assert rig.pl.queued is None and rig.gpu.waits == [] and len(rig.gpu.registered) == 2


def test_a_queued_step_goes_on_the_stream_in_the_order_its_parts_read_each_other(rig, monkeypatch):
    """The stream order of one queued step: the expected word, the wait, the program (it reads the word and
    the region once the wait passes), at TP > 1 the flags' exchange and gate, the ready mark the host waits on
    (after the gate: the host reads the agreed flags), the graph (it reads what the program wrote), the gated
    copy of its rows, and the done mark that repass and release(wait=True) trust (the copy writes the
    engine's memory, so it must lie behind that mark). The CPU stand-ins run a step's parts at once, so
    this order is what the host queues."""
    rig.out = torch.zeros_like(rig.graphs.graph.out)
    _serve(rig, SEQ)
    order = []

    class Marked(Event):
        def __init__(self, gpu, name):
            super().__init__(gpu)
            self.name = name

        def record(self, stream):
            order.append(self.name)
            super().record(stream)

    def logged(name, fn, skip_warm=False):
        def call(*args, **kwargs):
            if not (skip_warm and kwargs.get("warm")):
                order.append(name)
            return fn(*args, **kwargs)
        return call

    gpu = rig.gpu
    monkeypatch.setattr(gpu, "write", logged("expect", gpu.write))
    monkeypatch.setattr(gpu, "wait_geq", logged("wait", gpu.wait_geq))
    monkeypatch.setattr(rig.pl, "_program", logged("program", rig.pl._program, skip_warm=True))
    monkeypatch.setattr(rig.pl, "_copy_out", logged("copy", rig.pl._copy_out, skip_warm=True))
    monkeypatch.setattr(rig.graphs.graph.graph, "replay", logged("replay", rig.graphs.graph.graph.replay))
    monkeypatch.setattr(rig.pl, "_ready", Marked(gpu, "ready"))
    monkeypatch.setattr(rig.pl, "_event", lambda: Marked(gpu, "done"))
    agreement = rig.pl._agreement
    monkeypatch.setattr(rig.pl, "_agreement", lambda graph, R: logged("agree", agreement(graph, R)))
    _serve(rig, SEQ + 1)  # queues SEQ+2: the layout's first queue (its launches run as they are)
    _serve(rig, SEQ + 2)  # a hit; queues SEQ+3: the second (captured, then replayed)
    agree = ["agree"] if rig.world > 1 else []
    one = ["expect", "wait", "program", *agree, "ready", "replay", "copy", "done"]
    assert order == one + one


def test_a_verdict_that_says_queued_is_not_answered_from_a_copy_this_rank_refused(rig):
    """take() answers from the copy only when this rank's own offer accepted it: a verdict saying QUEUED
    for a copy whose program refused the step here (the GPU word of another layout) would answer with the
    rows of a no-op. It releases the copy instead, and the step runs the ordinary way."""
    _queue(rig)
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 2, KEY + 1)
    hook = rig.pl.hook(SEQ + 2, _req())
    assert hook.offer(rig.a)[0] is False
    assert hook.take(True, False) is None
    assert (rig.pl.hits, rig.pl.misses) == (0, 1) and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)


def test_detaching_twice_frees_nothing_before_the_first_finish(rig):
    """A second detach() (its doorbell dropped twice) is a no-op: a second finish() run ahead of the first,
    which waits for the device, unregistered the flag page and the header and unmapped the flag page while
    the released copy could still write through them."""
    _queue(rig)
    first = rig.pl.detach()
    rig.pl.detach()()
    assert rig.gpu.unregistered == [] and not rig.pl._flag_buf.closed
    first()
    assert sorted(rig.gpu.unregistered) == sorted(rig.gpu.registered) and rig.pl._flag_buf.closed


@pytest.mark.parametrize("world", [2])
def test_the_flags_gate_of_a_new_graph_of_the_same_size_writes_that_graph_s_slots(rig):
    """The exchange and gate are captured per step graph's slot input, not per request count: a graph captured
    again for the same R (a rebind, a region released) has slots of its own, and a gate replayed from the old
    graph's capture left a request a peer refused running here, its K/V summed with the peer's no-op."""
    _queue(rig)  # SEQ+2 queued on the first graph
    packed = _Packed(len(LENS), window_width(PAGE, WINDOW))
    old = rig.graphs.graph
    rig.graphs.graph = SimpleNamespace(graph=old.graph, out=torch.randn(packed.n, 8),
                                       views=packed.views(torch.zeros(packed.nbytes, dtype=torch.uint8)))
    _serve(rig, SEQ + 2)  # another graph than the queued one's: released; SEQ+3 queued on the new graph
    assert rig.pl.queued.graph is rig.graphs.graph
    rig.peer[1] = FLAG_INVALID
    rig.page.words[bell.GPU_WORD] = bell.gpu_word(SEQ + 3, KEY)
    assert rig.pl.hook(SEQ + 3, _req()).offer(rig.a) == (False, True)
    slots = rig.graphs.graph.views[2].numpy().reshape(len(LENS), Q)
    np.testing.assert_array_equal(slots[0], rig.a.meta.slot_mapping.numpy()[:Q])
    assert (slots[1] == -1).all()


@pytest.mark.parametrize("world", [2])
def test_a_finish_lets_go_of_what_the_captured_copies_and_exchanges_held(rig):
    """finish() runs where the device's releases run (RankLoop._sweep, on an idle stream) and lets the
    captured launches go there, with the engine's output slice and the graphs' inputs they hold: kept in
    its closure, the slice's mapping outlived MappedMemory.close until the closure was dropped, outside
    that stream, and the graphs holding collectives outlived the point app.py drops them before the group."""
    packed = _Packed(len(LENS), window_width(PAGE, WINDOW))
    graph = rig.graphs.graph = SimpleNamespace(graph=rig.graphs.graph.graph, out=torch.randn(packed.n, 8),
                                               views=packed.views(torch.zeros(packed.nbytes, dtype=torch.uint8)))
    region = rig.out = torch.zeros_like(graph.out)
    _queue(rig)
    _serve(rig, SEQ + 2)  # the layout's second queue: its launches captured
    assert len(rig.pl._agreements) == 1
    exchange_ref = weakref.ref(next(iter(rig.pl._agreements.values()))[1])  # the exchange + gate's replay
    finish = rig.pl.detach()
    gc.collect()
    assert exchange_ref() is not None  # the released copy replays it: kept until the device is done (finish)
    assert rig.pl.repass() is True  # the released copy has finished (the stand-ins run it here)
    slice_ref, slots_ref = weakref.ref(region), weakref.ref(graph.views[2])
    for kept in (rig.copies, rig.captures, rig.meta_captures, rig.copy_captures, rig.gpu.programs):
        kept.clear()  # the stand-ins' own records of what was queued
    rig.out = rig.graphs.graph = region = graph = None
    gc.collect()
    assert slice_ref() is not None and slots_ref() is not None  # held by the captured launches until finish
    finish()
    gc.collect()
    assert slice_ref() is None and slots_ref() is None and exchange_ref() is None


@pytest.mark.parametrize("world", [2])
def test_the_captured_launches_and_exchanges_kept_are_bounded(rig):
    """Layouts and graphs that are gone leave their entries behind until a bound: 128 layouts' launches,
    64 graphs' exchanges. Unbounded, an engine that changes layouts for hours kept every one's captures."""
    sizes = []  # after each one: the bound holds all along, not only at the end
    for i in range(200):
        rig.pl._replay_of(("layout", i), (), lambda warm=False: None)
        sizes.append(len(rig.pl._replays))
    assert 0 < min(sizes) and max(sizes) == 128
    packed = _Packed(len(LENS), window_width(PAGE, WINDOW))
    sizes = []
    for _ in range(100):
        graph = SimpleNamespace(views=packed.views(torch.zeros(packed.nbytes, dtype=torch.uint8)))
        rig.pl._agreement(graph, len(LENS))
        sizes.append(len(rig.pl._agreements))
    assert 0 < min(sizes) and max(sizes) == 64


def test_a_queueing_whose_device_takes_no_event_tracks_nothing_for_repass(rig, monkeypatch):
    """The queued step's done mark cannot be recorded (the device failed): the wait is passed all the same and
    the launch's error is raised, and no pass is tracked behind an event that was never recorded (its query
    would say finished, or raise on the failed device at every poke)."""
    _serve(rig, SEQ)

    class Lost:
        def record(self, stream):
            raise RuntimeError("injected: the device is lost")

        def query(self):
            raise RuntimeError("injected: the device is lost")

    monkeypatch.setattr(rig.pl, "_event", Lost)
    with pytest.raises(RuntimeError, match="injected"):
        _serve(rig, SEQ + 1)  # after() queues SEQ+2: the wait goes in, then the done mark fails
    assert rig.pl.queued is None and not rig.pl.passing and _word(rig) == bell.gpu_word(SEQ + 2, bell.SKIP_KEY)


@pytest.mark.parametrize("world", [1])
@pytest.mark.parametrize("staged", [True])
def test_a_metadata_region_of_a_size_that_is_no_multiple_of_the_staging_block_is_staged(rig):
    """A region's registration is rounded up to whole pages (its mapping's): the staging copy reads whole
    2 KB blocks from the registration's base, and a region of, say, 1000 bytes registered at its own size
    left its first block past the registration: the queueing failed (at TP > 1 the rank exited)."""
    step = _step(mmap.mmap(-1, mmap.PAGESIZE), rig.a.inputs_embeds, nbytes=1000)
    assert step.positions.untyped_storage().nbytes() == 1000
    _serve(rig, SEQ, step)
    _serve(rig, SEQ + 1, step)
    assert rig.pl.queued is not None and rig.pl.queued.seq == SEQ + 2
    assert _serve(rig, SEQ + 2, step) is rig.graphs.graph.out


def _cuda_geq(word: int, value: int) -> bool:
    """cuStreamWaitValue64's CU_STREAM_WAIT_VALUE_GEQ: (int64_t)(*addr - value) >= 0."""
    d = (word - value) % (1 << 64)
    return (d - (1 << 64) if d >= 1 << 63 else d) >= 0


@pytest.mark.parametrize("world", [1])
@pytest.mark.parametrize("staged", [False])
@pytest.mark.parametrize("seq", [SEQ, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32])
@pytest.mark.parametrize("delta", [0, 1, 5, -1, -5, 1 << 31, (1 << 31) - 1, -(1 << 31), -((1 << 31) - 1)])
@pytest.mark.parametrize("key", [0, bell.SKIP_KEY])
def test_the_host_reads_the_word_as_the_gpu_s_wait_compares_it(rig, seq, delta, key):
    """repass and the cooldown judge whether a wait has passed by _word_reached, which must agree with the
    stream's cyclic compare on every word, also half the sequence away (where the signed difference flips):
    judged passed while the wait still blocks, a release undone by a late word was never stored again."""
    word = bell.gpu_word(seq + delta, key)
    rig.page.words[bell.GPU_WORD] = word
    assert rig.pl._word_reached(seq) == _cuda_geq(word, bell.gpu_word(seq, 0))
