"""CPU harness: DrafterShim.maybe_forward in a loop at R=1 / R=8 against a real CPU sidecar (bench mode h's setup).

python3 .notes/shimh.py [--steps N] [--reqs 1,8] [--profile] [--phases] [--tag X]
Prints per R: median / p10 / p90 of the shim's time before the ring and after the answer (us), and total.
"""
import signal, argparse, cProfile, io, json, os, pstats, statistics, sys, tempfile, time
from pathlib import Path
import torch

from dspark_sidecar import bench as B
from dspark_sidecar.bench import Bench, BenchConfig, Case


def q(xs, p):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(p * len(xs)))]


def fake_start(b, cases):
    """Warm up on the real sidecar, keep one real answer per R, ring a private page from then on, and have
    send_bytes write that answer (this step's id) right after the ring: the shim's own code runs as is,
    the remote side costs nothing and nothing between the ring and the answer is timed."""
    from dspark_sidecar.proto import doorbell as dbm
    from dspark_sidecar.proto import sidecar_pb2 as pb
    answers = {}
    for R, case in cases.items():
        b._inputs = b.bufs.input_view(case.embeds.shape[0]); b._inputs.copy_(case.embeds)
        with b._forward_context(case):
            for _ in range(5):
                b._shimmed(case)
        page = b.bell.page
        answers[case.positions.numel()] = pb.DraftStepResponse.FromString(page.read(page.resp_area, dbm.RESP_LEN))
    import numpy as np
    bell, shim = b.bell, b.shim
    # A private page: the sidecar (left running, so its liveness stream stays) never sees these rings.
    priv = dbm.Page(np.zeros(dbm.HEADER + 2 * bell.capacity, dtype=np.uint8), bell.capacity)
    priv.words[dbm.RESP_SEQ] = priv.words[dbm.REQ_SEQ] = bell._seq
    bell._real_page, bell.page = bell.page, priv
    def send_bytes(data, key):
        type(bell).send_bytes(bell, data, key)
        resp = answers[int(shim._fake_rows)]
        resp.step_id = shim._next_step - 1
        bell.page.write(bell.page.resp_area, resp.SerializeToString(), dbm.RESP_LEN, dbm.RESP_SEQ, bell._seq)
    bell.send_bytes = send_bytes
    tr = shim.doorbell
    def send(req, embeds, positions, meta):
        shim._fake_rows = positions.numel()
        type(tr).send(tr, req, embeds, positions, meta)
    tr.send = send


def micro(b, cases):
    import timeit
    from dspark_sidecar.client import shim as S, metadata as MD
    from dspark_sidecar.proto import sidecar_pb2 as pb, codec
    from dspark_sidecar.proto import doorbell as dbm
    shim, tr = b.shim, b.shim.doorbell
    for R, case in cases.items():
        b._inputs = b.bufs.input_view(case.embeds.shape[0]); b._inputs.copy_(case.embeds)
        with b._forward_context(case):
            out = b._shimmed(case)
            page = b.bell.page
            resp = pb.DraftStepResponse.FromString(page.read(page.resp_area, dbm.RESP_LEN))
            pos, emb, meta = case.host.positions, b._inputs, case.host.meta
            req = shim._request(5, R, pos, emb, meta, inline=False)
            staged = tr.buffers.stage(emb, pos, meta)
            layers = shim._layers()
            g = dict(globals(), **locals())
            stmts = [
                ("fc checks", "shim._fc.available(); shim._fc.attn_metadata(); shim.is_capturing()"),
                ("layers", "shim._layers()"),
                ("kv_paging", "S.kv_paging(layers[0])"),
                ("step_metadata_from", "MD.step_metadata_from(meta, pos.numel(), 16)"),
                ("_prepare", "shim._prepare(layers)"),
                ("needs_bind", "shim.binder.needs_bind(layers)"),
                ("gen/status/view", "shim.binder.generation; st = shim.connection.status; st.limits.max_reqs"),
                ("all_min_ints 5", "S.all_min_ints(shim._agree, [1, 0, 3, -3, 8])"),
                ("tables_cover", "MD.tables_cover(meta, 16)"),
                ("link enter+exit", "shim._hold.__enter__(); shim._hold.__exit__(None, None, None)"),
                ("with cv", "exec('with shim._cv: pass')"),
                ("alive+fits", "tr.alive and tr.fits(R, meta, emb.shape[-1])"),
                ("_request", "shim._request(5, R, pos, emb, meta, inline=False)"),
                ("stage", "tr.buffers.stage(emb, pos, meta)"),
                ("serialize+concat", "req.SerializeToString() + staged.fields"),
                ("page.write", "b.bell.page.write(b.bell.page.req_area, staged.fields, dbm.REQ_LEN, 0, b.bell._seq)"),
                ("page.read+FromString", "pb.DraftStepResponse.FromString(page.read(page.resp_area, dbm.RESP_LEN))"),
                ("WhichOneof", "resp.WhichOneof('result')"),
                ("check_answer", "tr.check_answer(resp, resp.step_id, pos.numel(), emb.shape[-1])"),
                ("hidden clone", "tr.hidden()"),
                ("_compute_dtype", "shim._compute_dtype()"),
                ("shape checks", "(tuple(out.shape) != (pos.numel(), emb.shape[-1]) or not out.is_floating_point() or out.dtype != emb.dtype)"),
                ("record_success", "shim.breaker.record_success()"),
                ("device/dtype cmp", "out.device != emb.device or out.dtype != emb.dtype"),
                ("stats", "shim.stats.forwarded += 1; shim.stats.via_doorbell += int(shim._via_doorbell); shim.stats.forward_ns.append(1)"),
                ("whole step (fake)", "b._shimmed(case)"),
            ]
            print(f"R={R}")
            for label, st in stmts:
                num = 2000 if label.startswith("whole") else 20000
                best = min(timeit.repeat(st, globals=g, number=num, repeat=5)) / num * 1e6
                print(f"  {label:24s} {best:7.3f} us")


B_MODULES = ["dspark_sidecar.proto.doorbell", "dspark_sidecar.client.metadata", "dspark_sidecar.client.agreement",
             "dspark_sidecar.client.binding", "dspark_sidecar.client.breaker", "dspark_sidecar.client.dataplane",
             "dspark_sidecar.client.doorbell_transport", "dspark_sidecar.client.shim"]


def load_b(bdir):
    import importlib.util
    saved = {m: sys.modules[m] for m in B_MODULES}
    mods = {}
    try:
        for m in B_MODULES:
            path = os.path.join(bdir, *m.split(".")) + ".py"
            spec = importlib.util.spec_from_file_location(m, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[m] = mod
            spec.loader.exec_module(mod)
            mods[m] = mod
    finally:
        sys.modules.update(saved)
    return mods


def live_objects(b):
    sh = b.shim; tr = sh.doorbell
    return [sh, sh._hold, tr, tr.buffers, tr.bell, sh.binder, sh.breaker, sh._agree, tr.bell.page]


def ab(a, b, cases):
    """Blocks of a.block steps, A then B or B then A (alternating), a.pairs times per R; medians per side."""
    import random
    mods = load_b(a.ab)
    objs = live_objects(b)
    classes_a = [type(o) for o in objs]
    def b_class(o):
        for m in mods.values():
            c = getattr(m, type(o).__name__, None)
            if isinstance(c, type) and c.__module__ == type(o).__module__:
                return c
        return type(o)
    classes_b = [b_class(o) for o in objs]
    adapt = getattr(mods["dspark_sidecar.client.shim"], "_ab_adapt", None)
    swapped = [ca.__name__ for ca, cb in zip(classes_a, classes_b) if ca is not cb]
    print("B classes:", swapped, flush=True)
    def use(side):
        for o, ca, cb in zip(objs, classes_a, classes_b):
            o.__class__ = cb if side == "B" else ca
        if side == "B":
            tr = b.shim.doorbell
            if not hasattr(tr, "_answer_ref"):
                tr._answer_ref = {}
            sh = b.shim
            pg = tr.bell.page
            if not hasattr(pg, "_req_view"):
                pg._req_view, pg._resp_view = memoryview(pg.req_area), memoryview(pg.resp_area)
            if not hasattr(sh, "_doorbell_req"):
                sh._doorbell_req = None
            if not hasattr(sh, "_lock"):
                sh._lock = sh._cv._lock
                sh._link_waiters = 0
    res = {}
    for R, case in cases.items():
        b._inputs = b.bufs.input_view(case.embeds.shape[0]); b._inputs.copy_(case.embeds)
        got = {"A": ([], [], []), "B": ([], [], [])}
        pairs = []  # per pair: B block median - A block median, for before / after / total
        with b._forward_context(case):
            for side in ("A", "B"):
                use(side)
                for _ in range(100):
                    b._shimmed(case)
            for i in range(a.pairs):
                order = ("A", "B") if i % 2 == 0 else ("B", "A")
                blk = {}
                for side in order:
                    use(side)
                    for _ in range(10):
                        b._shimmed(case)
                    b.shim_ns = []
                    tot = []
                    for _ in range(a.block):
                        t = time.perf_counter_ns(); b._shimmed(case); tot.append(time.perf_counter_ns() - t)
                    bef, aft, tt = got[side]
                    bef += [x[0] / 1e3 for x in b.shim_ns]; aft += [x[1] / 1e3 for x in b.shim_ns]; tt += [x / 1e3 for x in tot]
                    blk[side] = [statistics.median(x[0] / 1e3 for x in b.shim_ns), statistics.median(x[1] / 1e3 for x in b.shim_ns),
                                 statistics.median(tot) / 1e3]
                pairs.append([blk["B"][j] - blk["A"][j] for j in range(3)])
        use("A")
        for side in ("A", "B"):
            bef, aft, tt = got[side]
            r = {k: (statistics.median(v), q(v, .1), q(v, .9)) for k, v in (("before", bef), ("after", aft), ("total", tt))}
            res.setdefault(R, {})[side] = r
            print(f"{a.tag} R={R} {side} " + " ".join(f"{k} {m:.2f} [{lo:.1f}..{hi:.1f}]" for k, (m, lo, hi) in r.items()), flush=True)
        print(f"{a.tag} R={R} B-A " + " ".join(f"{k} {res[R]['B'][k][0] - res[R]['A'][k][0]:+.2f}" for k in ("before", "after", "total")), flush=True)
        pd = {k: (statistics.median(p[j] for p in pairs), q([p[j] for p in pairs], .25), q([p[j] for p in pairs], .75))
              for j, k in enumerate(("before", "after", "total"))}
        res[R]["paired"] = pd
        print(f"{a.tag} R={R} paired B-A median [IQR] " + " ".join(f"{k} {m:+.2f} [{lo:+.1f}..{hi:+.1f}]" for k, (m, lo, hi) in pd.items()), flush=True)
    print("JSON " + json.dumps({"tag": a.tag, "ab": res}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--reqs", default="1,8")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="alternate R values this many times")
    ap.add_argument("--tag", default="")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--ab", default="", help="B tree (a folder holding dspark_sidecar/): interleave A (this process's package) and B in blocks")
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--fake", action="store_true", help="after warm-up, stop the sidecar and answer each ring in-process")
    a = ap.parse_args()
    reqs = tuple(int(x) for x in a.reqs.split(","))
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    bc = BenchConfig(preset="tiny", reqs=reqs, contexts=(a.ctx,), modes=("h",), repeats=a.steps, dtype=a.dtype,
                     out_dir=Path(tempfile.mkdtemp()))
    b = Bench(bc, dev)
    res = {}
    try:
        cases = {R: Case(b.cfg, R, a.ctx, bc.page_size, b.pages, b.embed, dev, bc.seed) for R in reqs}
        if a.phases:
            from dspark_sidecar._marks import M as MK
        if a.fake:
            fake_start(b, cases)
        if a.ab:
            ab(a, b, cases)
            return
        if a.micro:
            micro(b, cases)
            return
        for rnd in range(a.rounds):
            for R, case in cases.items():
                b._inputs = b.bufs.input_view(case.embeds.shape[0]); b._inputs.copy_(case.embeds)
                b.shim_ns = []
                with b._forward_context(case):
                    for _ in range(200):
                        b._shimmed(case)
                    b.shim_ns = []
                    prof = cProfile.Profile() if a.profile else None
                    tot = []
                    if prof: prof.enable()
                    segs = {}
                    for _ in range(a.steps):
                        if a.phases:
                            MK.clear(); MK.append(("start", time.perf_counter_ns()))
                        t = time.perf_counter_ns(); b._shimmed(case); tot.append(time.perf_counter_ns() - t)
                        if a.phases:
                            MK.append(("end", time.perf_counter_ns()))
                            for (p0, t0), (p1, t1) in zip(MK, MK[1:]):
                                segs.setdefault(p1, []).append(t1 - t0)
                    if prof: prof.disable()
                bef = [x[0] / 1e3 for x in b.shim_ns]; aft = [x[1] / 1e3 for x in b.shim_ns]
                tot = [x / 1e3 for x in tot]
                r = {k: (statistics.median(v), q(v, .1), q(v, .9)) for k, v in (("before", bef), ("after", aft), ("total", tot))}
                res.setdefault(R, []).append(r)
                print(f"{a.tag} R={R} " + " ".join(f"{k} {m:.1f} [{lo:.1f}..{hi:.1f}]" for k, (m, lo, hi) in r.items()), flush=True)
                if a.phases:
                    for k, v in segs.items():
                        print(f"   {k:16s} {statistics.median(v)/1e3:7.2f}  (n={len(v)})")
                if prof:
                    s = io.StringIO(); st = pstats.Stats(prof, stream=s); st.sort_stats("tottime").print_stats(45)
                    print(s.getvalue())
                    s = io.StringIO(); st = pstats.Stats(prof, stream=s); st.sort_stats("cumulative").print_stats(45)
                    print(s.getvalue())
        print("JSON " + json.dumps({"tag": a.tag, "res": res}))
    finally:
        b.close()


if __name__ == "__main__":
    main()
