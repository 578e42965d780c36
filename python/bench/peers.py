"""The peers workload of the main job: treetensor beside DI-treetensor, tensordict, optree and
torch.utils._pytree, on the same inputs, in one run (scripts/bench.sh runs it).

    python python/bench/peers.py --peers-python PEERS_PY [--ours-path DIR] \\
        [--json out/peers.json] [--plot out/peers.png] [--tree-bench PATH] [--quick]

Our package and DI-treetensor are both imported as `treetensor`: each side runs in a worker
process of its own (peers_worker.py): `ours` under this Python (with --ours-path prepended to
PYTHONPATH, where our package is installed), `peers` under the peers' venv
(scripts/peers-env.sh), which holds DI-treetensor, tensordict and optree. This driver imports
neither; it makes the inputs once (seeded, torch.save to a temporary folder, loaded by both
workers), asks every side for its result and compares it with the torch baseline's (structure,
dtype, shape and values bitwise: every row is leaf-wise torch work, so equal results are exact;
a mismatch is an error and the side is not timed), then times the sides round-robin: in round r
every side of a case runs one batch of calls, starting from side r mod n, so a shared machine's
noise falls on all alike. Each row is the median over the rounds of the per-call time, with the
mean and standard deviation; a row whose std is above a quarter of its mean is noisy and
claims nothing.

Sections (tensordict's own benchmark operations and shapes, benchmarks/common/*_test.py and its
compile suite's eager cases):
  per-op     indexing, items()/keys(), apply, + 1 / + tree, clone, creation, unbind, split,
             stack/cat, to(dtype): ours, ours consolidated, DI-treetensor, tensordict, torch
             (torch.utils._pytree.tree_map or the dict comprehension; the baseline)
  structure  flatten / unflatten / map over nested dicts of 57, 585 and 5,220 nodes (the tree
             shapes of bench/tree_bench.cpp): optree, torch pytree (baseline), DI-treetensor
             (treevalue), ours from Python, ours from C++ (tree_bench, Tree<int>: a reference)
  seed       200 leaves, S x 2S @ 2S x 4S float32 matmuls: ours linear / stream(2) / auto,
             DI-treetensor (its stream needs CUDA), the torch loop (baseline)
  optimizer  one Adam, AdamW and SGD-momentum step over ResNet-50's trainable tensors
             (data/models): torch.optim's for-loop (baseline), foreach and fused steps, compared
             within a bound derived from the step; ours flat: treetensor.optim's single-pass
             step over consolidated parameter and gradient trees, on the calling thread
             (linear) and over 2 lanes (stream(2); torch's fused step uses the intra-op threads)

Not measured: the gradient all_reduce (our Python API exposes no collectives).

Exit status: 0 when every available side was verified and timed, 2 when a side's result did not
match (or a side failed), 1 on a usage or worker error.
"""
import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
NOISY = 0.25  # std > NOISY * mean: not a finding (as treetensor-bench, report.hpp)
SECTIONS = {
    "per-op": ("Per-op overhead (tensordict's benchmark operations and shapes)", "torch",
               ["ours", "ours consolidated", "DI-treetensor", "tensordict", "torch"]),
    "structure": ("Structure: flatten / unflatten / map over nested dicts", "torch pytree",
                  ["ours", "ours C++ (tree_bench)", "optree", "DI-treetensor", "torch pytree"]),
    "seed": ("The seed: 200 leaves of S x 2S @ 2S x 4S matmuls, CPU", "torch loop",
             ["ours linear", "ours stream(2)", "ours auto", "DI-treetensor", "DI-treetensor stream(2)",
              "torch loop"]),
    "optimizer": ("One optimizer step over a model's parameters (torch.optim)", "torch for-loop",
                  ["ours flat", "ours flat stream(2)", "torch fused", "torch foreach", "torch for-loop"]),
}
MODEL_DIR = HERE.parent.parent / "data" / "models"
BUFFERS = (".running_mean", ".running_var", ".num_batches_tracked")  # never optimised


# ---- inputs ---------------------------------------------------------------------------------

def chain19():
    """tensordict's big_nested_td: leaves '0.t', '0.1.t', ... '0.1...18.t', (3, 4) each."""
    root = {}
    for i in range(1, 20):
        node = root
        for j in range(i):
            node = node.setdefault(str(j), {})
        node["t"] = torch.randn(3, 4) + i
    return root


def nested10():
    """tensordict's compile suite get_nested_td: 10 levels, a scalar 'a' at each (11 leaves)."""
    d = node = {}
    for i in range(10):
        node["a"] = torch.randn(())
        node[str(i)] = {}
        node = node[str(i)]
    node["a"] = torch.randn(())
    return d


def balanced(fanout, depth, counter):
    """bench/tree_bench.cpp's trees, leaves distinct 0-d tensors (flatten is checked order-free)."""
    if depth == 0:
        counter[0] += 1
        return torch.tensor(float(counter[0]))
    names = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    return {(names[i % 5] + str(i) if depth == 1 else f"layer{i}"): balanced(fanout, depth - 1, counter)
            for i in range(fanout)}


def node_count(d):
    return 1 + sum(node_count(v) for v in d.values()) if isinstance(d, dict) else 1


def make_inputs(quick, seed_s):
    torch.manual_seed(0)
    td = {"a": torch.randn(3, 4, 5), "b": {"b1": torch.randn(3, 4, 5)}}
    inp = {
        "td": td,  # tensordict's `td` fixture, batch [3, 4]
        "big": {str(i): torch.randn(3, 4) + i for i in range(100)},  # its big_td
        "nested19": chain19(),
        # pytree_benchmarks_test's nested_dict, batch [3, 4]
        "pytree": {"a": {"b": torch.randn(3, 4, 1), "c": {"d": torch.rand(3, 4, 5, 6)}}, "c": torch.rand(3, 4, 1)},
        "flat50": {str(i): torch.full((), i) for i in range(50)},  # get_flat_td: 50 int64 scalars
        "nested10": nested10(),
        "list": [{"a": torch.randn(3, 4, 5), "b": {"b1": torch.randn(3, 4, 5)}} for _ in range(8)],
    }
    for n in (10, 50, 100):
        inp[f"create{n}"] = {str(i): torch.randn(3, 4) for i in range(n)}
    shapes = [(7, 2)] if quick else [(7, 2), (8, 3), (17, 3)]  # 57, 585, 5,220 nodes
    inp["structure_sizes"] = []
    for fanout, depth in shapes:
        d = balanced(fanout, depth, [0])
        n = node_count(d)
        inp["structure_sizes"].append(n)
        inp[f"struct{n}"] = d
    model = json.loads((MODEL_DIR / ("mobilenet_v3_small.json" if quick else "resnet50.json")).read_text())
    shapes = [t["shape"] for t in model["tensors"] if not t["key"].endswith(BUFFERS)]
    if quick:
        shapes = shapes[:12]
    inp["model"] = model["model"] + (" (12 tensors)" if quick else "")
    inp["model_shapes"] = shapes
    inp["model_grads"] = [torch.randn(sh) * 1e-2 for sh in shapes]
    s = seed_s
    inp["seed_a"] = {f"a{i}": torch.randn(s, 2 * s) for i in range(200)}
    inp["seed_b"] = {f"a{i}": torch.randn(2 * s, 4 * s) for i in range(200)}
    return inp


def section_of(case):
    if case.startswith(("flatten", "unflatten", "map ")):
        return "structure"
    if case.startswith("seed"):
        return "seed"
    if case.split()[0] in ("Adam", "AdamW", "SGD-momentum"):
        return "optimizer"
    return "per-op"


# ---- workers --------------------------------------------------------------------------------

class Worker:
    def __init__(self, name, python, env):
        self.name = name
        self.proc = subprocess.Popen([python, "-W", "ignore", str(HERE / "peers_worker.py"), name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)

    def ask(self, **msg):
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited (status {self.proc.wait()}); see its messages above")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise WorkerError(f"{self.name} worker, {msg.get('cmd')} {msg.get('case', '')} / "
                              f"{msg.get('side', '')}: {reply.get('error')}\n{reply.get('trace', '')}")
        return reply

    def close(self):
        try:
            self.ask(cmd="quit")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class WorkerError(RuntimeError):
    pass


# ---- verification ---------------------------------------------------------------------------

def mismatch(got, want, where="result"):
    """None when equal (structure, dtype, shape, bitwise values), else what differs."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: a {type(got).__name__}, expected a tensor"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{where}: {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
        if not torch.equal(got, want):
            diff = (got.double() - want.double()).abs().max().item()
            return f"{where}: values differ (max |diff| {diff:.3g})"
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or sorted(got) != sorted(want):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            return f"{where}: keys {keys}, expected {sorted(want)}"
        for k in want:
            m = mismatch(got[k], want[k], f"{where}.{k}")
            if m:
                return m
        return None
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{where}: {type(got).__name__} of {len(got) if isinstance(got, list) else '?'}, expected {len(want)} items"
        for i, (g, w) in enumerate(zip(got, want)):
            m = mismatch(g, w, f"{where}[{i}]")
            if m:
                return m
        return None
    return None if got == want else f"{where}: {got!r}, expected {want!r}"


def optimizer_mismatch(got, want, lr, steps):
    """Parameters after `steps` steps with a constant gradient, within a bound derived from the
    step: each step moves a parameter by at most about lr (Adam: m_hat / sqrt(v_hat) is +-1 for a
    constant gradient; SGD: lr * |momentum buffer| <= lr * |g| / (1 - momentum)), which fused or
    foreach arithmetic rounds differently by a few units in the last place of the update, and the
    update's subtraction rounds once in p: |got - want| <= steps * eps * (|p| + 16 lr * scale)."""
    eps = torch.finfo(torch.float32).eps
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"parameter {i}: {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}"
        bound = (steps + 1) * eps * (w.abs() + 16 * lr)
        excess = ((g - w).abs() / bound).max().item() if g.numel() else 0.0
        worst = max(worst, excess)
        if excess > 1:
            return f"parameter {i}: |diff| {((g - w).abs()).max().item():.3g} exceeds the bound ({excess:.2f} of it)"
    return None, worst


def perturbed(x):
    """The same result with its first tensor changed (--perturb: the check must catch it)."""
    if isinstance(x, torch.Tensor):
        return x + 1 if x.numel() else x
    if isinstance(x, dict) and x:
        k = next(iter(x))
        return {**x, k: perturbed(x[k])}
    if isinstance(x, list) and x:
        return [perturbed(x[0])] + x[1:]
    return x


# ---- timing ---------------------------------------------------------------------------------

def calibrate(worker, case, side, target_s, max_calls):
    """Calls per batch so that one batch takes about target_s (after two warm-up calls)."""
    worker.ask(cmd="time", case=case, side=side, calls=2)
    t = worker.ask(cmd="time", case=case, side=side, calls=1)["seconds"]
    return max(1, min(max_calls, int(target_s / max(t, 1e-7))))


def time_case(case, sides, workers, rounds, warmup, target_s, max_calls, progress):
    calls = {s: calibrate(workers[s], case, s, target_s, max_calls) for s in sides}
    samples = {s: [] for s in sides}
    for r in range(warmup + rounds):
        progress(f"{case}: {'warm-up' if r < warmup else 'round'} {r + 1 - (warmup if r >= warmup else 0)}")
        for k in range(len(sides)):
            s = sides[(r + k) % len(sides)]
            sec = workers[s].ask(cmd="time", case=case, side=s, calls=calls[s])["seconds"]
            if r >= warmup:
                samples[s].append(sec / calls[s] * 1e3)
    return {s: (samples[s], calls[s]) for s in sides}


def stats(ms):
    mean = statistics.fmean(ms)
    return {"median_ms": statistics.median(ms), "mean_ms": mean,
            "std_ms": statistics.stdev(ms) if len(ms) > 1 else 0.0}


# ---- C++ figures ----------------------------------------------------------------------------

def tree_bench_rows(path, sizes):
    """bench/tree_bench's flatten/unflatten/map (Tree<int>, Google Benchmark) as reference rows."""
    out = subprocess.run([path, "--benchmark_format=json", "--benchmark_min_time=0.05",
                          "--benchmark_repetitions=5", "--benchmark_report_aggregates_only=true",
                          "--benchmark_filter=BM_Tree(Flatten|Unflatten|Map)/"],
                         capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    by = {}
    for b in data["benchmarks"]:
        m = re.match(r"BM_Tree(Flatten|Unflatten|Map)/(\d+)_(mean|stddev|median)$", b["name"])
        if not m:
            continue
        op, idx, agg = m.group(1).lower(), int(m.group(2)), m.group(3)
        unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0}[b["time_unit"]]
        by.setdefault((op, idx), {})[agg] = (b["real_time"] * unit, b.get("nodes"))
    rows = []
    all_sizes = [57, 585, 5220]
    for (op, idx), agg in sorted(by.items()):
        nodes = int(agg["mean"][1] or all_sizes[idx])
        if nodes not in sizes:
            continue
        rows.append((f"{op} {nodes} nodes", {"median_ms": agg["median"][0], "mean_ms": agg["mean"][0],
                                             "std_ms": agg["stddev"][0]}))
    return rows


# ---- machine --------------------------------------------------------------------------------

def machine_info():
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cfg = torch.__config__.show()
    m = re.search(r"Math Kernel Library Version ([^ \n]+)", cfg)
    blas = f"MKL {m.group(1)} (linked into LibTorch)" if m else (
        re.search(r"BLAS_INFO=([^,\s]*)", cfg).group(0) if "BLAS_INFO" in cfg else "unknown")
    return {"cpu": cpu, "cores": os.cpu_count(), "libtorch": torch.__version__.split("+")[0],
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "blas": blas, "intra_op_threads": torch.get_num_threads(),
            "inter_op_threads": torch.get_num_interop_threads(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "load_average": os.getloadavg()[0]}


# ---- output ---------------------------------------------------------------------------------

def cell(r):
    if r is None:
        return "-"
    if r.get("status"):
        return r["status"].split(" (")[0] if r["status"].startswith("n/a") else "ERROR"
    us = r["median_ms"] * 1e3
    txt = f"{us:.1f}" if us < 1000 else f"{us:.0f}"
    return txt + ("*" if r["noisy"] else "")


def ratio(num, den):
    """num / den medians, for verified, quiet rows only."""
    ok = lambda r: r is not None and not r.get("status") and r["verified"] and not r["noisy"]  # noqa: E731
    return num["median_ms"] / den["median_ms"] if ok(num) and ok(den) else None


def print_tables(records, out):
    for section, (title, baseline, sides) in SECTIONS.items():
        rows = [r for r in records if r["section"] == section]
        if not rows:
            continue
        cases = list(dict.fromkeys(r["size"] for r in rows))
        present = [s for s in sides if any(r["strategy"] == s for r in rows)]
        ours = "ours" if section != "seed" else "ours auto"
        peers = [p for p in ("tensordict", "DI-treetensor") if p in present]
        out.write(f"\npeers, {title}: us per call, median of the rounds (* : std > {NOISY:.0%} of the mean, not a finding)\n")
        w = max(len(c) for c in cases + ["case"])
        widths = [max(len(s), 9) for s in present]
        out.write(f"{'case':<{w}}" + "".join(f"  {s:>{n}}" for s, n in zip(present, widths)) +
                  "".join(f"  {('td' if p == 'tensordict' else 'DI') + '/' + ours.split()[-1]:>11}" for p in peers) + "\n")
        notes = []
        for c in cases:
            by = {r["strategy"]: r for r in rows if r["size"] == c}
            line = f"{c:<{w}}" + "".join(f"  {cell(by.get(s)):>{n}}" for s, n in zip(present, widths))
            for p in peers:
                x = ratio(by.get(p), by.get(ours)) if by.get(p) and by.get(ours) else None
                line += f"  {(f'{x:.2f}x' if x else '-'):>11}"
            out.write(line + "\n")
            for s, r in by.items():
                if r.get("status") and s != "ours C++ (tree_bench)":
                    notes.append(f"  {c} / {s}: {r['status']}")
        for n in dict.fromkeys(notes):
            out.write(n + "\n")


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summary(records):
    """The issue's goals: each peer's time over ours on the per-op rows, geometric mean. First
    over the verified, quiet rows only (the findings); then, for a contended run where few rows
    are quiet, over every verified row's medians, noisy ones included (and so labelled)."""
    lines = []
    per = [r for r in records if r["section"] == "per-op"]
    cases = list(dict.fromkeys(r["size"] for r in per))
    for quiet_only in (True, False):
        lines += _summary(per, cases, quiet_only)
    return lines


def _summary(per, cases, quiet_only):
    lines = []
    timed = lambda r: r is not None and not r.get("status") and r["verified"]  # noqa: E731
    for ours in ("ours", "ours consolidated"):
        for peer in ("tensordict", "DI-treetensor"):
            xs, slower = [], []
            for c in cases:
                by = {r["strategy"]: r for r in per if r["size"] == c}
                if ours in by and peer in by:
                    if quiet_only:
                        x = ratio(by[peer], by[ours])
                    else:
                        a, b = by[peer], by[ours]
                        x = a["median_ms"] / b["median_ms"] if timed(a) and timed(b) else None
                    if x:
                        xs.append(x)
                        if x < 1:
                            slower.append(c)
            g = geomean(xs)
            if g:
                rows = "verified, quiet rows" if quiet_only else "verified rows, noisy ones included"
                lines.append(f"per-op, {peer} time / {ours} time: geometric mean {g:.2f}x over {len(xs)} "
                             f"{rows} (above 1: ours faster)"
                             + (f"; ours slower on: {', '.join(slower)}" if slower else "; ours slower on none"))
    return lines


def write_plot(path, records):
    if not shutil.which("gnuplot"):
        return (f"no plot: gnuplot is not installed; `sudo apt-get install gnuplot-nox` and run again "
                f"to get {path}")
    panels = []
    for section, (title, baseline, sides) in SECTIONS.items():
        rows = [r for r in records if r["section"] == section and not r.get("status") and r["verified"]
                and not r["noisy"] and r.get("speedup") and r["strategy"] != baseline]
        if rows:
            panels.append((section, title, baseline, sides, rows))
    if not panels:
        return f"no plot: no verified, quiet row to draw in {path}"
    script = (f"set terminal pngcairo size {720 * len(panels)},760 noenhanced\nset output '{path}'\n"
              "set logscale y\nset format y '%gx'\nset grid\nset key below horizontal\nset xtics rotate by -40 font ',8'\n"
              f"set multiplot layout 1,{len(panels)} title 'peers: speed-up vs the torch baseline (log scale)'\n")
    for p, (section, title, baseline, sides, rows) in enumerate(panels):
        cases = list(dict.fromkeys(r["size"] for r in rows))
        script += f"set title '{section}'\nset ylabel 'speed-up vs {baseline} (x)'\n"
        script += f"set xrange [-0.5:{len(cases) - 0.5}]\nset xtics (" + ", ".join(
            f"'{c}' {i}" for i, c in enumerate(cases)) + ")\n"
        plot = [f"1 with lines dashtype 2 lc rgb 'black' title '{baseline} (1x)'"]
        for k, s in enumerate(x for x in sides if any(r["strategy"] == x for r in rows)):
            script += f"$p{p}s{k} << EOD\n" + "".join(
                f"{cases.index(r['size'])} {r['speedup']}\n" for r in rows if r["strategy"] == s) + "EOD\n"
            style = "pt 6 ps 1.6 lc rgb 'gray40'" if "C++" in s else "pt 7 ps 1.4"
            plot.append(f"$p{p}s{k} using 1:2 with points {style} title '{s}'")
        script += "plot " + ", ".join(plot) + "\n"
    script += "unset multiplot\n"
    pathlib.Path(path).unlink(missing_ok=True)
    res = subprocess.run(["gnuplot"], input=script, text=True, stdout=subprocess.DEVNULL)
    if res.returncode != 0 or not pathlib.Path(path).exists():
        raise RuntimeError(f"gnuplot failed to draw {path} (see its message above)")
    return None


# ---- main -----------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers-python", required=True, help="the peers' venv's Python (scripts/peers-env.sh)")
    ap.add_argument("--ours-python", default=sys.executable, help="Python of our side (default: this one)")
    ap.add_argument("--ours-path", default="", help="prepended to PYTHONPATH for our side (our package's folder)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="draw the speed-ups here (PNG, gnuplot)")
    ap.add_argument("--tree-bench", help="bench/tree_bench binary: C++ reference rows of the structure section")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-ms", type=float, default=5.0, help="time one batch of calls takes (default 5)")
    ap.add_argument("--seed-s", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 3 rounds: checks the verification path")
    ap.add_argument("--perturb", metavar="SIDE", help="change SIDE's results before comparing (tests the check)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.batch_ms, args.seed_s = 3, 1, 1.0, 4
    for flag in ("json", "plot"):
        p = getattr(args, flag)
        if p and not os.access(os.path.dirname(os.path.abspath(p)), os.W_OK):
            sys.exit(f"peers: --{flag} {p}: its folder does not exist or is not writable")

    machine = machine_info()
    tty = sys.stderr.isatty()

    def progress(msg):
        if tty:
            sys.stderr.write(f"\rpeers: {msg}\033[K")
            sys.stderr.flush()

    tmp = tempfile.mkdtemp(prefix="treetensor-peers-")
    workers = {}
    status = 0
    try:
        inputs = os.path.join(tmp, "inputs.pt")
        torch.save(make_inputs(args.quick, args.seed_s), inputs)
        env_ours = dict(os.environ)
        if args.ours_path:
            env_ours["PYTHONPATH"] = os.pathsep.join(x for x in (args.ours_path, env_ours.get("PYTHONPATH")) if x)
        env_peers = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        workers = {"ours": Worker("ours", args.ours_python, env_ours),
                   "peers": Worker("peers", args.peers_python, env_peers)}
        setup = {n: w.ask(cmd="setup", inputs=inputs) for n, w in workers.items()}
        versions = {"ours": setup["ours"]["versions"], "peers": setup["peers"]["versions"]}
        owner, cases = {}, {}
        for n in ("ours", "peers"):
            for case, per_side in setup[n]["cases"].items():
                for side, st in per_side.items():
                    cases.setdefault(case, {})[side] = st
                    owner[(case, side)] = workers[n]

        records, notes, failed = [], [], []
        for case, per_side in cases.items():
            section = section_of(case)
            baseline = SECTIONS[section][1]
            if per_side.get(baseline) is not None:
                raise RuntimeError(f"{case}: the baseline {baseline} is unavailable: {per_side[baseline]}")
            progress(f"{case}: verifying")
            path = os.path.join(tmp, "result.pt")
            results = {}
            for side, st in per_side.items():
                if st is not None:
                    continue
                try:
                    owner[(case, side)].ask(cmd="result", case=case, side=side, path=path)
                except WorkerError as e:  # the side failed: an error, never a row
                    if side == baseline:
                        raise
                    per_side[side] = "error: " + str(e).split("\n")[0]
                    failed.append(side)
                    sys.stderr.write(f"peers: {per_side[side]}\n")
                    continue
                results[side] = torch.load(path, weights_only=True)
            want = results[baseline]
            ok = []
            worst = 0.0
            for side, got in results.items():
                if side == args.perturb:
                    got = perturbed(got)
                if section == "optimizer" and side != baseline:
                    lr = 1e-2 if case.startswith("SGD") else 1e-3
                    scale = 10 if case.startswith("SGD") else 1  # SGD: |buf| <= |g| / (1 - 0.9)
                    m = optimizer_mismatch(got, want, lr * scale, 4)
                    if isinstance(m, tuple):
                        m, w = m
                        worst = max(worst, w)
                else:
                    m = None if side == baseline else mismatch(got, want)
                if m:
                    failed.append(side)
                    per_side[side] = f"error: result differs from {baseline}: {m}"
                    sys.stderr.write(f"peers: {case} / {side}: result differs from {baseline}: {m}\n")
                else:
                    ok.append(side)
            how = (f"within the derived rounding bound ({worst:.2f} of it at most)" if section == "optimizer"
                   else "bitwise")
            notes.append(f"{case}: {len(ok) - 1} of {len(results) - 1} sides equal {baseline} {how}"
                         + (f" ({', '.join(s for s in ok if s != baseline)})" if len(ok) > 1 else ""))
            rounds = min(args.rounds, 5) if section == "optimizer" else args.rounds  # 0.1 s a step
            timed = time_case(case, ok, {s: owner[(case, s)] for s in ok}, rounds, args.warmup,
                              args.batch_ms / 1e3, 100000, progress)
            for w in workers.values():
                w.ask(cmd="drop", case=case) if section == "optimizer" else None
            base = statistics.median(timed[baseline][0])
            for side, st in per_side.items():
                rec = {"workload": "peers", "section": section, "size": case, "strategy": side,
                       "role": "strategy", "baseline": side == baseline}
                if side in timed:
                    ms, calls = timed[side]
                    rec.update(stats(ms))
                    rec.update(verified=True, reps=len(ms), calls_per_batch=calls,
                               noisy=rec["std_ms"] > NOISY * rec["mean_ms"],
                               speedup=base / rec["median_ms"])
                else:
                    rec.update(status=st, verified=False, median_ms=None, mean_ms=None, std_ms=None,
                               noisy=False, speedup=None)
                records.append(rec)
        if args.tree_bench:
            progress("C++ tree_bench")
            sizes = [int(c.split()[1]) for c in cases if c.startswith("flatten ")]
            for case, st in tree_bench_rows(args.tree_bench, sizes):
                base = next(r for r in records if r["size"] == case and r["baseline"])
                records.append({"workload": "peers", "section": "structure", "size": case,
                                "strategy": "ours C++ (tree_bench)", "role": "reference", "baseline": False,
                                **st, "verified": True, "reps": 5, "noisy": st["std_ms"] > NOISY * st["mean_ms"],
                                "speedup": base["median_ms"] / st["median_ms"]})
            notes.append("ours C++ (tree_bench): bench/tree_bench's Tree<int> (int leaves, no tensors, "
                         "no Python), Google Benchmark median of 5 repetitions; the same tree shapes, "
                         "timed apart from the rounds (a reference, not compared)")
        if tty:
            sys.stderr.write("\r\033[K")
        print(f"peers: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
              f"{machine['blas']}, LibTorch's default CPU allocator, threads {machine['intra_op_threads']}; "
              f"{machine['date']}, load average {machine['load_average']:.2f} at start")
        print(f"ours: {versions['ours']}; peers: {versions['peers']} (each in its own process)")
        print(f"{args.rounds} rounds after {args.warmup} warm-up, every side round-robin; a batch of calls "
              f"takes about {args.batch_ms:g} ms")
        print_tables(records, sys.stdout)
        summ = summary(records) + [
            "not measured here: the gradient all_reduce beside tensordict (it has no bucketed gradient "
            "reduction); against DDP it is timed inside a training step by the train workload "
            "(python/bench/bench_train.py), against a per-leaf loop by the C++ allreduce workload"]
        print()
        for line in summ:
            print(line)
        for n in notes:
            if "differs" in n:
                print(n)
        if failed:
            print(f"NOT verified: {', '.join(dict.fromkeys(failed))} (see the messages above); their rows are errors")
            status = 2
        cfg = {"command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
               "machine": machine, "allocator": "LibTorch's default CPU allocator",
               "versions": versions, "rounds": args.rounds, "warmup": args.warmup,
               "batch_ms": args.batch_ms, "seed_s": args.seed_s, "quick": args.quick,
               "noisy_fraction": NOISY, "all_verified": not failed,
               "baselines": {s: v[1] for s, v in SECTIONS.items()},
               "verification": notes, "summary": summ}
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"config": cfg, "results": records}, f, indent=2)
                f.write("\n")
        if args.plot:
            msg = write_plot(args.plot, records)
            if msg:
                print(msg, file=sys.stderr)
    except WorkerError as e:
        print(f"peers: {e}", file=sys.stderr)
        status = 1
    finally:
        for w in workers.values():
            w.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
