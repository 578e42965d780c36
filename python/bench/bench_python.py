"""The Python module's goals, measured side by side in one run (the issue's table).

1. `a + b` on 200 leaves of 4 elements: the tree call vs the Python dict comprehension over
   torch (goal: no slower), and on consolidated trees (C++ consolidate(); goal <= 0.1x).
2. The fallback to torch (a torch.Tensor method treetensor does not bind, run per leaf in
   Python): its cost above a bound op with the same kernel (goal: <= 2 us per call).
3. The seed experiment at S=32 (200 leaves, S x 2S @ 2S x 4S): ttorch.stream(2) vs the native
   Python loop (goal >= 1.4x).
4. The seed's loop with asyncs scopes (treetensor-bench overlap, in Python): a training step on
   the main thread, a decoder and a metrics writer in `with asyncs.thread(k):` blocks (pending)
   vs sequential and vs `submit` (goal: scoped <= 1.15x the largest part when a core is free).

Strategies are interleaved round by round; each row is the median over rounds of the per-call
time of a batch of calls.

    python python/bench/bench_python.py [--rounds R]   # the Python treetensor is installed in
"""
import argparse
import os
import platform
import resource
import statistics
import time

import torch

import treetensor.torch as ttorch


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def per_call(fn, calls):
    c0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(calls):
        fn()
    wall = time.perf_counter() - t0
    return wall / calls, wall, cpu_seconds() - c0


def measure(cases, rounds, calls):
    """name -> (median per call, best per call, process CPU seconds per wall second)."""
    times = {name: [] for name, _ in cases}
    cpu = {name: [0.0, 0.0] for name, _ in cases}
    for _, fn in cases:
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in cases:
            t, wall, c = per_call(fn, calls)
            times[name].append(t)
            cpu[name][0] += wall
            cpu[name][1] += c
    return {name: (statistics.median(v), min(v), cpu[name][1] / cpu[name][0]) for name, v in times.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--leaves", type=int, default=200)
    p.add_argument("--seed-s", type=int, default=32)
    args = p.parse_args()

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} at start")
    # ---- a + b on small leaves ----
    torch.manual_seed(0)
    n = args.leaves
    da = {f"k{i}": torch.randn(4) for i in range(n)}
    db = {f"k{i}": torch.randn(4) for i in range(n)}
    ta, tb = ttorch.Tensor(da), ttorch.Tensor(db)
    ca, cb = ta.consolidate(), tb.consolidate()
    assert ca.is_consolidated() and ttorch.equal(ca + cb, ta + tb)
    want = {k: da[k] + db[k] for k in da}
    assert ttorch.equal(ta + tb, want)
    small = measure([
        ("dict comprehension", lambda: {k: da[k] + db[k] for k in da}),
        ("ttorch a + b", lambda: ta + tb),
        ("ttorch a + b (consolidated)", lambda: ca + cb),
    ], args.rounds, 200)
    base, base_best, _ = small["dict comprehension"]
    print(f"\n## a + b, {n} leaves of 4 float32 elements (per call; median and best round)")
    print(f"{'':30} {'median us':>10} {'vs dict':>8} {'best us':>9} {'vs dict':>8}")
    for name, (t, b, _) in small.items():
        print(f"{name:30} {t * 1e6:10.1f} {t / base:7.2f}x {b * 1e6:9.1f} {b / base_best:7.2f}x")

    # ---- the fallback to torch: a torch.Tensor method treetensor does not bind, vs a bound op
    # with the same kernel (neg / negative), per call on a small tree and per leaf on a large one
    print(f"\n## the fallback to torch: t.negative() (unbound, torch's per leaf) vs t.neg() (bound)")
    print(f"{'':30} {'neg us':>10} {'negative us':>12} {'extra us':>9} {'extra/leaf':>11}")
    for leaves in (1, 2, n):
        t = ttorch.Tensor({f"k{i}": torch.randn(4) for i in range(leaves)})
        assert ttorch.equal(t.negative(), t.neg())
        fb = measure([("neg", lambda: t.neg()), ("negative", lambda: t.negative()),
                      ("ttorch.negative", lambda: ttorch.negative(t))], args.rounds, 200)
        bound, unbound, fn = fb["neg"][0], fb["negative"][0], fb["ttorch.negative"][0]
        for label, x in ((f"{leaves} leaves, method", unbound), (f"{leaves} leaves, ttorch.", fn)):
            print(f"{label:30} {bound * 1e6:10.2f} {x * 1e6:12.2f} {(x - bound) * 1e6:9.2f} "
                  f"{(x - bound) * 1e6 / leaves:11.3f}")

    # ---- the seed experiment ----
    s = args.seed_s
    torch.manual_seed(0)
    a = ttorch.randn({f"a{i}": (s, 2 * s) for i in range(200)})
    b = ttorch.randn({f"a{i}": (2 * s, 4 * s) for i in range(200)})
    al = [a[f"a{i}"] for i in range(200)]
    bl = [b[f"a{i}"] for i in range(200)]

    def stream2():
        with ttorch.stream(2):
            return ttorch.matmul(a, b)

    def auto():
        with ttorch.stream("auto"):
            return ttorch.matmul(a, b)

    ref = [torch.matmul(x, y) for x, y in zip(al, bl)]
    for fn in (stream2, auto, lambda: ttorch.matmul(a, b)):
        got = fn()
        assert all(torch.allclose(got[f"a{i}"], ref[i], rtol=1e-4, atol=1e-4) for i in range(200))
    seed = measure([
        ("native (Python loop)", lambda: [torch.matmul(x, y) for x, y in zip(al, bl)]),
        ("min (loop, N/2 leaves)", lambda: [torch.matmul(x, y) for x, y in zip(al[:100], bl[:100])]),
        ("ttorch linear", lambda: ttorch.matmul(a, b)),
        ("ttorch stream(2)", stream2),
        ("ttorch stream('auto')", auto),
    ], args.rounds, 5)
    base, base_best, _ = seed["native (Python loop)"]
    print(f"\n## seed, 200 leaves of {s}x{2 * s} @ {2 * s}x{4 * s} float32 (per call; median and best round)")
    # cpu/wall: cores this process got while the row ran (about 2 for stream(2) on an idle
    # 2-core machine; near 1 or below means other processes held the second core).
    print(f"{'':30} {'median ms':>10} {'speed-up':>9} {'best ms':>9} {'speed-up':>9} {'cpu/wall':>9}")
    for name, (t, b, c) in seed.items():
        print(f"{name:30} {t * 1e3:10.3f} {base / t:8.2f}x {b * 1e3:9.3f} {base_best / b:8.2f}x {c:9.2f}")
    overlap(args.rounds)
    print(f"\n# load average {os.getloadavg()[0]:.1f} at the end")


def overlap(rounds, leaves=40, s=64, steps=8):
    """The seed's loop with a decoder and a metrics writer beside the training step."""
    import io

    import treetensor.asyncs as asyncs

    torch.manual_seed(0)
    basis = torch.randn(s, 2 * s) / (64 * s ** 0.5)
    w0 = ttorch.Tensor({f"l{k}": torch.randn(2 * s, 4 * s) / (2 * s) ** 0.5 for k in range(leaves)})
    codes = [ttorch.Tensor({f"l{k}": torch.randint(0, 256, (s, s), dtype=torch.uint8)
                            for k in range(leaves)}) for _ in range(steps + 1)]

    def decode(code):
        return ttorch.matmul(code.to(torch.float32) - 127.5, basis)

    def train(batch, w):
        y = ttorch.matmul(batch, w)
        w.mul_(0.9999)
        return y

    def metrics(y):  # per-leaf statistics and the tree-level mean (a PendingTensor in a scope)
        return y.std(dim=(0, 1)), (y * y).sum(dim=(0, 1)), y.mean()

    def write(out, i, m):
        *trees, mean = m
        out.write(f"{i} {float(mean):.9g} "
                  + " ".join(f"{float(v):.9g}" for t in trees for v in t.values()) + "\n")

    dec, met = asyncs.Thread("decoder"), asyncs.Thread("metrics")

    def sequential(w, out):
        batch = decode(codes[0])
        for i in range(steps):
            nxt = decode(codes[i + 1])
            write(out, i, metrics(train(batch, w)))
            batch = nxt

    def scoped(w, out):
        batch = decode(codes[0])
        for i in range(steps):
            with asyncs.thread(dec):
                nxt = decode(codes[i + 1])
            y = train(batch, w)
            with asyncs.thread(met):
                m = metrics(y)
            met.submit(write, out, i, m)
            batch = nxt
        asyncs.synchronize()

    def submitted(w, out):
        batch = decode(codes[0])
        for i in range(steps):
            nxt = dec.submit(decode, codes[i + 1])
            y = train(batch, w)
            met.submit(lambda i=i, y=y: write(out, i, metrics(y)))
            batch = nxt.result()
        met.wait_idle()

    rows = {"sequential": sequential, "scoped": scoped, "submit": submitted}
    outcome = {}
    for name, fn in rows.items():
        w, out = w0.clone(), io.StringIO()
        fn(w, out)
        outcome[name] = (w, out.getvalue())
    for name, (w, text) in outcome.items():
        assert ttorch.equal(w, outcome["sequential"][0]), f"{name}: weights differ from sequential"
        assert text == outcome["sequential"][1], f"{name}: metrics file differs from sequential"
    w, y0, sink = w0.clone(), train(decode(codes[0]), w0.clone()), io.StringIO()
    batch0 = decode(codes[0])
    cases = [(name, (lambda fn=fn: fn(w0.clone(), io.StringIO()))) for name, fn in rows.items()]
    cases += [("decode alone", lambda: [decode(c) for c in codes]),
              ("train alone", lambda: [train(batch0, w) for _ in range(steps)]),
              ("metrics alone", lambda: [write(sink, i, metrics(y0)) for i in range(steps)])]
    got = measure(cases, rounds, 1)
    per_step = {name: t / steps for name, (t, _, _) in got.items()}
    parts = [per_step[k] for k in ("decode alone", "train alone", "metrics alone")]
    base = per_step["sequential"]
    print(f"\n## overlap: {leaves} leaves, S={s}, {steps} steps (ms per step, median; verified: the "
          f"same weights and metrics text)")
    print(f"{'':30} {'ms/step':>10} {'vs sequential':>14}")
    for name, t in list(per_step.items()) + [("sum of parts", sum(parts)), ("max of parts", max(parts))]:
        print(f"{name:30} {t * 1e3:10.3f} {base / t:13.2f}x")
    print(f"scoped / max of parts: {per_step['scoped'] / max(parts):.2f}")
    dec.close()
    met.close()


if __name__ == "__main__":
    main()
