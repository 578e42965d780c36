"""The main job's gradient all_reduce beside the peers: 2 local ranks (Gloo, spawned here, one
intra-op thread each) sum a real model's gradient tree (the shapes of
data/models/<model>.json, float32, random per rank), every way a user could.

  ours consolidated   treetensor.distributed.all_reduce of the consolidated tree (one call per
                      25 MiB bucket of its buffer, no copy)
  ours per leaf       the same function on the plain tree (one call per leaf)
  tensordict          TensorDict.all_reduce() (one call per leaf), from the peers' venv
  tensordict bucketed TensorDict.all_reduce(bucket_bytes=25 MiB)
  torch bucketed      what DDP's reducer does without gradient_as_bucket_view: copy the
                      gradients into 25 MiB buckets (torch._utils._flatten_dense_tensors),
                      all_reduce each, copy back
  torch per leaf      a loop of torch.distributed.all_reduce
  limit               one all_reduce of one preallocated buffer of the same size (no copy)

Every side's result is checked to be exactly the two ranks' sum before timing. Then the sides
run round-robin (alternating order), a batch of calls per side per round; a cell is the median
ms per call over rounds ± half their range; a row whose half-range is a quarter of its median
is noisy. tensordict is imported from the peers' venv (--peers-python; it is also where
DI-treetensor, a second package named `treetensor`, lives: that venv's site-packages go at the
end of sys.path, so `treetensor` stays ours); without it, its rows are n/a.

    python bench_allreduce.py [--model mobilenet_v3_small] [--peers-python P] [--json F]
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUCKET = 25 << 20
NOISE = 0.25


def grads(model, rank):
    with open(os.path.join(ROOT, "data", "models", f"{model}.json")) as f:
        tensors = json.load(f)["tensors"]
    g = torch.Generator().manual_seed(1000 + rank)
    tree = {}
    for t in tensors:
        if t["dtype"] != "float32" or "running_" in t["key"]:
            continue  # gradients: the parameters' (BatchNorm statistics have none)
        node = tree
        *parents, leaf = t["key"].split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = torch.randn(t["shape"], generator=g)
    return tree


def flat_leaves(tree):
    out = []
    for k in sorted(tree):
        out += flat_leaves(tree[k]) if isinstance(tree[k], dict) else [tree[k]]
    return out


def sides(tree, tensordict):
    """name -> (state, call): call(state) reduces state in place; each state its own copy of
    `tree`."""
    tree = _tree_map(torch.clone, tree)
    import treetensor.distributed as tdist
    import treetensor.torch as ttorch
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    def torch_bucketed(ts):
        buckets, cur, size = [], [], 0
        for t in ts:
            if cur and size + t.numel() * 4 > BUCKET:
                buckets.append(cur)
                cur, size = [], 0
            cur.append(t)
            size += t.numel() * 4
        buckets.append(cur)
        for b in buckets:
            flat = _flatten_dense_tensors(b)
            dist.all_reduce(flat)
            for t, r in zip(b, _unflatten_dense_tensors(flat, b)):
                t.copy_(r)

    out = {
        "ours consolidated": (ttorch.Tensor(tree).consolidate(), tdist.all_reduce),
        "ours per leaf": (ttorch.Tensor(tree), tdist.all_reduce),
        "torch bucketed": ([t.clone() for t in flat_leaves(tree)], torch_bucketed),
        "torch per leaf": ([t.clone() for t in flat_leaves(tree)],
                           lambda ts: [dist.all_reduce(t) for t in ts]),
        "limit": (torch.cat([t.flatten() for t in flat_leaves(tree)]), dist.all_reduce),
    }
    if tensordict is not None:
        out["tensordict"] = (tensordict.TensorDict(tree).clone(), lambda td: td.all_reduce())
        out["tensordict bucketed"] = (tensordict.TensorDict(tree).clone(),
                                      lambda td: td.all_reduce(bucket_bytes=BUCKET))
    return out


def leaves_of(state):
    import treetensor.torch as ttorch
    if isinstance(state, ttorch.Tensor):
        return ttorch.tree_flatten(state)[0]
    if isinstance(state, list):
        return state
    if isinstance(state, torch.Tensor):
        return [state]
    return [state[k] for k in sorted(state.keys(include_nested=True, leaves_only=True))]


def verify(name, state, want):
    got = leaves_of(state)
    if name == "limit":
        return bool(torch.equal(got[0], torch.cat([w.flatten() for w in want])))
    if name.startswith("tensordict"):
        want = flat_leaves_td_order(state, want)
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def flat_leaves_td_order(td, want_tree):
    def at(tree, key):
        for k in (key if isinstance(key, tuple) else (key,)):
            tree = tree[k]
        return tree
    return [at(want_tree, k) for k in sorted(td.keys(include_nested=True, leaves_only=True))]


def rank_main(rank, args, init_file, out_file):
    import treetensor.nn  # noqa: F401  before the group exists (treetensor.nn's imports say why)
    torch.set_num_threads(1)
    tensordict = None
    if args.peers_site:
        sys.path.append(args.peers_site)  # after ours: `treetensor` stays this package
        try:
            import tensordict
        except ImportError:
            tensordict = None
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    mine, other = grads(args.model, rank), grads(args.model, 1 - rank)
    want_tree = _tree_add(mine, other)
    all_sides = sides(mine, tensordict)
    failures = {}
    for name, (state, call) in all_sides.items():
        fresh = sides(mine, tensordict)[name][0]
        call(fresh)
        want = want_tree if name.startswith("tensordict") else flat_leaves(want_tree)
        if not verify(name, fresh, want):
            failures[name] = "not the two ranks' sum"
    names = list(all_sides)
    times = {n: [] for n in names}
    for n in names:  # warm-up
        for _ in range(3):
            all_sides[n][1](all_sides[n][0])
    for r in range(args.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            state, call = all_sides[n]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call(state)
            times[n].append((time.perf_counter() - t0) * 1e3 / args.calls)
    if rank == 0:
        rows = []
        for n in names:
            med = statistics.median(times[n])
            half = (max(times[n]) - min(times[n])) / 2
            rows.append({"model": args.model, "side": n, "ms": med, "spread_ms": half,
                         "noisy": half >= NOISE * med, "verified": n not in failures})
        if tensordict is None:
            rows += [{"model": args.model, "side": s, "status": "n/a (no tensordict: --peers-python)"}
                     for s in ("tensordict", "tensordict bucketed")]
        with open(out_file, "w") as f:
            json.dump({"rows": rows, "tensordict": getattr(tensordict, "__version__", None),
                       "numel": sum(t.numel() for t in flat_leaves(mine)),
                       "leaves": len(flat_leaves(mine))}, f)
    dist.barrier()
    dist.destroy_process_group()


def _tree_add(a, b):
    return {k: _tree_add(a[k], b[k]) if isinstance(a[k], dict) else a[k] + b[k] for k in a}


def _tree_map(fn, a):
    return {k: _tree_map(fn, v) if isinstance(v, dict) else fn(v) for k, v in a.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mobilenet_v3_small", help="a data/models/<model>.json")
    ap.add_argument("--peers-python", default=None, help="the peers' venv Python (tensordict)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=8, help="calls per side per round (sums double each call)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.peers_site = None
    if args.peers_python:
        args.peers_site = subprocess.run(
            [args.peers_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        mp.spawn(rank_main, args=(args, os.path.join(d, "init"), out), nprocs=2, join=True)
        with open(out) as f:
            result = json.load(f)
    rows = result["rows"]
    limit = next(r for r in rows if r["side"] == "limit")
    print(f"all_reduce of {args.model}'s gradients ({result['leaves']} leaves, {result['numel'] * 4 / 1e6:.1f} MB), "
          f"2 Gloo ranks, 1 thread each; ms per call, median over {args.rounds} rounds ± half their range; "
          f"tensordict {result['tensordict']}")
    for r in rows:
        if "status" in r:
            print(f"  {r['side']:<20} {r['status']}")
            continue
        mark = "" if r["verified"] else "  NOT VERIFIED"
        print(f"  {r['side']:<20} {r['ms']:8.2f} ±{r['spread_ms']:<6.2f} {limit['ms'] / r['ms']:5.2f}x of limit"
              f"{' (noisy)' if r['noisy'] else ''}{mark}")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_train import blas_name, cpu_name
        config = {"command": "python python/bench/bench_allreduce.py " + " ".join(sys.argv[1:]),
                  "allocator": "glibc malloc", "all_verified": all(r.get("verified", True) for r in rows),
                  "machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                              "libtorch": torch.__version__.split("+")[0],
                              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "blas": blas_name(),
                              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                              "load_average": os.getloadavg()[0]}}
        with open(args.json, "w") as f:
            json.dump({"config": config, "model": args.model, "leaves": result["leaves"],
                       "numel": result["numel"], "tensordict": result["tensordict"],
                       "rounds": args.rounds, "rows": rows}, f, indent=1)
    if not all(r.get("verified", True) for r in rows):
        sys.exit(2)


if __name__ == "__main__":
    main()
