"""One side of the peers workload (python/bench/peers.py runs it; not meant to be run by hand).

    python peers_worker.py ours    # the project's venv, our package importable as `treetensor`
    python peers_worker.py peers   # the peers' venv: DI-treetensor (also named `treetensor`),
                                   # tensordict, optree and torch.utils._pytree

Our package and DI-treetensor are both imported as `treetensor`, so each lives in its own
process (scripts/peers-env.sh). The driver sends one JSON command a line on stdin and reads one
JSON answer a line; the worker's own stdout is moved to stderr so that no library's print can
break the protocol. Commands:

    {"cmd": "setup", "inputs": PATH}   -> {"cases": {case: {side: null | "n/a (...)"}}}
    {"cmd": "result", "case", "side", "path"}  runs the call once and torch.saves its result in
                                       a plain form (nested dicts and lists of tensors) to path
    {"cmd": "time", "case", "side", "calls"}   -> {"seconds": wall time of `calls` calls}
    {"cmd": "quit"}

Every answer carries "ok"; a failed command answers {"ok": false, "error": text}.
"""
import gc
import json
import os
import sys
import time
import traceback

import torch

# The protocol's channel: the real stdout, kept before anything can print to it.
_proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
sys.stdout = sys.stderr


def plain(x):
    """A result as nested dicts (sorted keys) and lists of tensors, whatever library made it."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in sorted(x.items())}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if hasattr(x, "items"):  # a tree of any of the libraries: its own (key, child) pairs
        return {str(k): plain(v) for k, v in sorted(x.items())}
    if isinstance(x, (str, int, float)):
        return x
    raise TypeError(f"no plain form for {type(x).__name__}")


def path_str(path):
    """A key path of any library ('a.b', ('a', 'b'), pytree's key entries) as 'a.b'."""
    if isinstance(path, str):
        return path
    parts = []
    for p in path:
        parts.append(str(getattr(p, "key", p)))
    return ".".join(parts)


def items_plain(pairs):
    """(path, leaf) pairs in any order as [[path, leaf], ...] sorted by path."""
    return [[p, v] for p, v in sorted((path_str(p), v) for p, v in pairs)]


def transpose(d, n):
    """A dict whose leaves are n-tuples (pytree's tree_map of unbind/split) as n dicts."""
    return [torch.utils._pytree.tree_map(lambda x: x[i], d, is_leaf=lambda x: isinstance(x, tuple))
            for i in range(n)]


def flat_leaves(leaves):
    """A flatten's leaves, order-free: one sorted 1-d tensor (every structure leaf is distinct)."""
    return torch.sort(torch.stack([torch.as_tensor(v).reshape(()) for v in leaves]).double()).values


class Missing(Exception):
    """A side that the library's API does not offer (the row says so; nothing is faked)."""


def missing(why):
    def build():
        raise Missing(why)
    return build


# ---------------------------------------------------------------------------------------------
# The cases. Each side is a builder: it makes its library's inputs from the plain ones (outside
# any timing) and returns (call, to_plain): call() is what is timed, to_plain(result) what the
# driver compares across sides.

def ours_sides(inp):
    import treetensor.torch as ttorch

    T = ttorch.Tensor

    def tree(name):
        return T(inp[name])

    def cons(name):
        return T(inp[name]).consolidate()

    sides = {}

    def both(case, make, op):
        """`op` on our tree and on its consolidated copy (make: input name or builder)."""
        sides[case] = {
            "ours": lambda: (lambda t: (lambda: op(t), plain))(tree(make)),
            "ours consolidated": lambda: (lambda t: (lambda: op(t), plain))(cons(make)),
        }

    both("index [1]", "td", lambda t: t[1])
    both("index [:, 1]", "td", lambda t: t[:, 1])
    both("index [[0, 1]]", "td", lambda t: t[[0, 1]])
    for name in ("items", "keys"):
        fn = (lambda t: t.items()) if name == "items" else (lambda t: t.keys())
        wrap = (lambda r: [[k, v] for k, v in sorted(r)]) if name == "items" else sorted
        sides[f"{name}() 100 keys"] = {
            "ours": (lambda fn, wrap: lambda: (lambda t: (lambda: fn(t), wrap))(tree("big")))(fn, wrap)}
    # Every (path, leaf) of the 19-leaf chain: tree_flatten's leaves beside its spec's paths.
    sides["items() nested 19 leaves"] = {"ours": lambda: (lambda t: (
        lambda: (lambda leaves, spec: list(zip(spec.paths(), leaves)))(*ttorch.tree_flatten(t)),
        items_plain))(tree("nested19"))}
    sides["keys() nested 19 leaves"] = {"ours": lambda: (lambda t: (
        lambda: ttorch.tree_flatten(t)[1].paths(), lambda r: sorted(path_str(p) for p in r)))(tree("nested19"))}
    both("apply(x + 1) 3 leaves", "pytree", lambda t: t.apply(lambda x: x + 1))
    both("+ 1, 50 scalars", "flat50", lambda t: t + 1)
    both("+ tree, 50 scalars", "flat50", lambda t: t + t)
    both("+ 1, 10 levels", "nested10", lambda t: t + 1)
    both("+ tree, 10 levels", "nested10", lambda t: t + t)
    both("clone", "td", lambda t: t.clone())
    for n in (10, 50, 100):
        sides[f"create {n} keys"] = {"ours": (lambda n: lambda: (lambda d: (lambda: T(d), plain))(inp[f"create{n}"]))(n)}
    both("unbind(0)", "pytree", lambda t: t.unbind(0))
    both("split([1, 2], 0)", "pytree", lambda t: t.split([1, 2], 0))
    sides["stack 8 trees"] = {"ours": lambda: (lambda ts: (lambda: ttorch.stack(ts), plain))([T(d) for d in inp["list"]])}
    sides["cat 8 trees"] = {"ours": lambda: (lambda ts: (lambda: ttorch.cat(ts), plain))([T(d) for d in inp["list"]])}
    both("to(float64)", "td", lambda t: t.to(torch.float64))

    for s in inp["structure_sizes"]:
        key = f"struct{s}"
        sides[f"flatten {s} nodes"] = {"ours": (lambda key: lambda: (lambda t: (
            lambda: ttorch.tree_flatten(t), lambda r: flat_leaves(r[0])))(tree(key)))(key)}
        sides[f"unflatten {s} nodes"] = {"ours": (lambda key: lambda: (lambda leaves, spec: (
            lambda: ttorch.tree_unflatten(spec, leaves), plain))(*ttorch.tree_flatten(tree(key))))(key)}
        sides[f"map {s} nodes"] = {"ours": (lambda key: lambda: (lambda t: (lambda: t.map(lambda x: x), plain))(tree(key)))(key)}

    def seed(mode):
        def build():
            a, b = T(inp["seed_a"]), T(inp["seed_b"])
            if mode == 1:
                return (lambda: ttorch.matmul(a, b)), plain

            def call():
                with ttorch.stream(mode):
                    return ttorch.matmul(a, b)
            return call, plain
        return build

    sides["seed matmul"] = {"ours linear": seed(1), "ours stream(2)": seed(2), "ours auto": seed("auto")}
    def optimizer(cls, kw, mode):
        def build():
            # torch's parameters and gradients (optimizer_sides), as consolidated trees whose
            # sorted keys keep the model's order: treetensor.optim's single-pass step per buffer
            import treetensor.optim as topt
            torch.manual_seed(1)
            ps = [torch.randn(s) * 0.05 for s in inp["model_shapes"]]
            keys = [f"p{i:04d}" for i in range(len(ps))]
            params = T(dict(zip(keys, ps))).consolidate()
            grads = T(dict(zip(keys, inp["model_grads"]))).consolidate()
            opt = getattr(topt, cls)(params, **kw)
            def step():  # the kernel's pieces spread over the mode's lanes (linear: this thread)
                with ttorch.stream(mode):
                    opt.step(grads)
            for _ in range(OPT_STEPS):
                step()
            return step, lambda _: ttorch.tree_flatten(params)[0]
        build.lazy = True
        return build

    for name, (cls, kw) in OPTIMIZERS.items():
        sides[f"{name} {inp['model']}"] = {"ours flat": optimizer(cls, kw, 1),
                                           "ours flat stream(2)": optimizer(cls, kw, 2)}
    return sides


# The optimizers of the optimizer section: torch.optim class and its settings.
OPTIMIZERS = {
    "Adam": ("Adam", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}),
    "AdamW": ("AdamW", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}),
    "SGD-momentum": ("SGD", {"lr": 1e-2, "momentum": 0.9}),
}
OPT_STEPS = 3  # steps before the compared result (bias correction and momentum matter)


def optimizer_sides(inp):
    """torch.optim's for-loop, foreach and fused steps over the model's parameter tree.

    Built lazily (the driver drops each case after timing it): a ResNet-50 state is 100 MB a
    tensor set. The gradients are constant across steps and shared by the variants (read only)."""
    sides = {}
    shapes = inp["model_shapes"]
    grads = [g for g in inp["model_grads"]]
    for name, (cls, kw) in OPTIMIZERS.items():
        per = {}
        for variant, flags in (("torch for-loop", {"foreach": False}), ("torch foreach", {"foreach": True}),
                               ("torch fused", {"fused": True})):
            def build(cls=cls, kw=kw, flags=flags):
                torch.manual_seed(1)
                params = [torch.nn.Parameter(torch.randn(s) * 0.05) for s in shapes]
                for p, g in zip(params, grads):
                    p.grad = g
                opt = getattr(torch.optim, cls)(params, **kw, **flags)
                for _ in range(OPT_STEPS):
                    opt.step()
                return opt.step, lambda _: [p.detach() for p in params]
            build.lazy = True
            per[variant] = build
        sides[f"{name} {inp['model']}"] = per
    return sides


def peers_sides(inp):
    import optree
    import tensordict
    import treevalue
    import treetensor.torch as ditorch  # DI-treetensor: this process never sees ours
    import torch.utils._pytree as pytree

    TD = tensordict.TensorDict

    def DI(d):
        """A DI-treetensor tree built bottom-up: ttorch.Tensor(nested dict) takes time doubling
        with each level of nesting (3 s for 12 levels here), from subtrees it is linear."""
        return ditorch.Tensor({k: DI(v) if isinstance(v, dict) else v for k, v in d.items()})
    tmap = pytree.tree_map
    sides = {}

    def td_of(name, batch):
        return TD(inp[name], batch_size=batch)

    def sides_for(case, name, batch, td_op, di_op, torch_op, torch_plain=plain):
        sides[case] = {
            "DI-treetensor": lambda: (lambda t: (lambda: di_op(t), plain))(DI(inp[name])),
            "tensordict": lambda: (lambda t: (lambda: td_op(t), plain))(td_of(name, batch)),
            "torch": lambda: (lambda d: (lambda: torch_op(d), torch_plain))(inp[name]),
        }

    for case, idx in (("index [1]", 1), ("index [:, 1]", (slice(None), 1)), ("index [[0, 1]]", [0, 1])):
        sides_for(case, "td", [3, 4], (lambda i: lambda t: t[i])(idx), (lambda i: lambda t: t[i])(idx),
                  (lambda i: lambda d: tmap(lambda x: x[i], d))(idx))

    # One node's items()/keys() (tensordict's test_items/test_keys: 100 keys).
    sides["items() 100 keys"] = {
        "DI-treetensor": lambda: (lambda t: (lambda: list(t.items()), lambda r: [[k, v] for k, v in sorted(r)]))(DI(inp["big"])),
        "tensordict": lambda: (lambda t: (lambda: list(t.items()), lambda r: [[k, v] for k, v in sorted(r)]))(td_of("big", [3, 4])),
        "torch": lambda: (lambda d: (lambda: list(d.items()), lambda r: [[k, v] for k, v in sorted(r)]))(inp["big"]),
    }
    sides["keys() 100 keys"] = {
        "DI-treetensor": lambda: (lambda t: (lambda: list(t.keys()), sorted))(DI(inp["big"])),
        "tensordict": lambda: (lambda t: (lambda: list(t.keys()), sorted))(td_of("big", [3, 4])),
        "torch": lambda: (lambda d: (lambda: list(d.keys()), sorted))(inp["big"]),
    }
    # Every (path, leaf) of the 19-leaf chain: tensordict's items(True, True); DI-treetensor's
    # treevalue.flatten; pytree's tree_leaves_with_path.
    sides["items() nested 19 leaves"] = {
        "DI-treetensor": lambda: (lambda t: (lambda: treevalue.flatten(t), items_plain))(DI(inp["nested19"])),
        "tensordict": lambda: (lambda t: (lambda: list(t.items(True, True)), items_plain))(td_of("nested19", [3, 4])),
        "torch": lambda: (lambda d: (lambda: pytree.tree_leaves_with_path(d), items_plain))(inp["nested19"]),
    }
    keys_plain = lambda r: sorted(path_str(p) for p in r)  # noqa: E731
    sides["keys() nested 19 leaves"] = {
        "DI-treetensor": lambda: (lambda t: (lambda: [p for p, _ in treevalue.flatten(t)], keys_plain))(DI(inp["nested19"])),
        "tensordict": lambda: (lambda t: (lambda: list(t.keys(True, True)), keys_plain))(td_of("nested19", [3, 4])),
        "torch": lambda: (lambda d: (lambda: [p for p, _ in pytree.tree_leaves_with_path(d)], keys_plain))(inp["nested19"]),
    }
    add1 = lambda x: x + 1  # noqa: E731
    sides_for("apply(x + 1) 3 leaves", "pytree", [3, 4], lambda t: t.apply(add1), lambda t: t.map(add1),
              lambda d: tmap(add1, d))
    for case, name in (("50 scalars", "flat50"), ("10 levels", "nested10")):
        sides_for(f"+ 1, {case}", name, [], lambda t: t + 1, lambda t: t + 1, lambda d: tmap(add1, d))
        sides_for(f"+ tree, {case}", name, [], lambda t: t + t, lambda t: t + t,
                  lambda d: tmap(lambda x, y: x + y, d, d))
    sides_for("clone", "td", [3, 4], lambda t: t.clone(), lambda t: t.clone(), lambda d: tmap(torch.clone, d))
    for n in (10, 50, 100):
        d = inp[f"create{n}"]
        sides[f"create {n} keys"] = {
            "DI-treetensor": (lambda d: lambda: ((lambda: DI(d)), plain))(d),
            "tensordict": (lambda d: lambda: ((lambda: TD(d, batch_size=[3, 4])), plain))(d),
            "torch": (lambda d: lambda: ((lambda: dict(d)), plain))(d),
        }
    sides_for("unbind(0)", "pytree", [3, 4], lambda t: t.unbind(0), lambda t: t.unbind(0),
              lambda d: tmap(lambda x: x.unbind(0), d), lambda r: plain(transpose(r, 3)))
    sides_for("split([1, 2], 0)", "pytree", [3, 4], lambda t: t.split([1, 2], 0), lambda t: t.split([1, 2], 0),
              lambda d: tmap(lambda x: x.split([1, 2], 0), d), lambda r: plain(transpose(r, 2)))
    for case, fn in (("stack 8 trees", torch.stack), ("cat 8 trees", torch.cat)):
        di_fn = ditorch.stack if fn is torch.stack else ditorch.cat
        sides[case] = {
            "DI-treetensor": (lambda g: lambda: (lambda ts: (lambda: g(ts), plain))([DI(d) for d in inp["list"]]))(di_fn),
            "tensordict": (lambda g: lambda: (lambda ts: (lambda: g(ts, 0), plain))([td_of_d(d) for d in inp["list"]]))(fn),
            "torch": (lambda g: lambda: (lambda ds: (lambda: tmap(lambda *xs: g(xs, 0), *ds), plain))(inp["list"]))(fn),
        }
    to64 = lambda t: t.to(torch.float64)  # noqa: E731
    sides_for("to(float64)", "td", [3, 4], to64, to64, lambda d: tmap(to64, d))

    ident = lambda x: x  # noqa: E731
    for s in inp["structure_sizes"]:
        key = f"struct{s}"
        d = inp[key]
        sides[f"flatten {s} nodes"] = {
            "optree": (lambda d: lambda: ((lambda: optree.tree_flatten(d)), lambda r: flat_leaves(r[0])))(d),
            "torch pytree": (lambda d: lambda: ((lambda: pytree.tree_flatten(d)), lambda r: flat_leaves(r[0])))(d),
            "DI-treetensor": (lambda d: lambda: (lambda t: (lambda: treevalue.flatten(t), lambda r: flat_leaves(v for _, v in r)))(DI(d)))(d),
        }

        def unflat_optree(d):
            leaves, spec = optree.tree_flatten(d)
            return (lambda: optree.tree_unflatten(spec, leaves)), plain

        def unflat_pytree(d):
            leaves, spec = pytree.tree_flatten(d)
            return (lambda: pytree.tree_unflatten(leaves, spec)), plain

        def unflat_di(d):
            pairs = treevalue.flatten(DI(d))
            return (lambda: treevalue.unflatten(pairs)), plain

        sides[f"unflatten {s} nodes"] = {
            "optree": (lambda d: lambda: unflat_optree(d))(d),
            "torch pytree": (lambda d: lambda: unflat_pytree(d))(d),
            "DI-treetensor": (lambda d: lambda: unflat_di(d))(d),
        }
        sides[f"map {s} nodes"] = {
            "optree": (lambda d: lambda: ((lambda: optree.tree_map(ident, d)), plain))(d),
            "torch pytree": (lambda d: lambda: ((lambda: pytree.tree_map(ident, d)), plain))(d),
            "DI-treetensor": (lambda d: lambda: (lambda t: (lambda: t.map(ident), plain))(DI(d)))(d),
        }

    def di_seed():
        a, b = DI(inp["seed_a"]), DI(inp["seed_b"])
        return (lambda: ditorch.matmul(a, b)), plain

    def di_stream():
        try:
            ditorch.stream(2)
        except BaseException as e:  # its assert names CUDA; the row says so
            raise Missing(f"ttorch.stream(2) raises on CPU: {type(e).__name__}: {e}") from None
        raise Missing("ttorch.stream(2) accepted on CPU (unexpected); not timed")

    def torch_seed():
        a, b = inp["seed_a"], inp["seed_b"]
        return (lambda: {k: torch.matmul(a[k], b[k]) for k in a}), plain

    sides["seed matmul"] = {"DI-treetensor": di_seed, "DI-treetensor stream(2)": di_stream,
                            "torch loop": torch_seed}
    sides.update(optimizer_sides(inp))
    return sides


def td_of_d(d):
    import tensordict
    return tensordict.TensorDict(d, batch_size=[3, 4])


# ---------------------------------------------------------------------------------------------

def main():
    which = sys.argv[1]
    torch.set_num_threads(int(os.environ.get("TREETENSOR_PEERS_THREADS", torch.get_num_threads())))
    built = {}  # (case, side) -> (call, to_plain)
    sides = {}
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            cmd = msg["cmd"]
            if cmd == "quit":
                _proto.write(json.dumps({"ok": True}) + "\n")
                return
            if cmd == "setup":
                inp = torch.load(msg["inputs"], weights_only=True)
                sides = (ours_sides if which == "ours" else peers_sides)(inp)
                cases = {}
                for case, per_side in sides.items():
                    cases[case] = {}
                    for side, build in per_side.items():
                        try:
                            built[(case, side)] = build if getattr(build, "lazy", False) else build()
                            cases[case][side] = None
                        except Missing as e:
                            cases[case][side] = f"n/a (missing: {e})"
                        except Exception as e:  # a side that fails to build: its row is an error
                            cases[case][side] = f"error: {type(e).__name__}: {e}"
                versions = {"torch": torch.__version__}
                for mod in ("treetensor", "tensordict", "optree", "treevalue"):
                    if mod in sys.modules:
                        m = sys.modules[mod]
                        versions[mod] = getattr(m, "__version__", None) or _dist_version(mod)
                reply = {"cases": cases, "versions": versions, "threads": torch.get_num_threads()}
            elif cmd == "drop":  # the case is done: free what its sides hold
                for key in [k for k in built if k[0] == msg["case"]]:
                    del built[key]
                gc.collect()
                reply = {}
            elif cmd == "result":
                key = (msg["case"], msg["side"])
                if callable(built[key]):  # a lazy side: built on first use
                    built[key] = built[key]()
                call, to_plain = built[key]
                torch.save(to_plain(call()), msg["path"])
                reply = {}
            elif cmd == "time":
                call = built[(msg["case"], msg["side"])][0]
                n = int(msg["calls"])
                t0 = time.perf_counter()
                for _ in range(n):
                    call()
                reply = {"seconds": time.perf_counter() - t0}
            else:
                raise ValueError(f"unknown command {cmd!r}")
            reply["ok"] = True
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        _proto.write(json.dumps(reply) + "\n")


def _dist_version(mod):
    from importlib import metadata
    for dist in ({"treetensor": "di-treetensor"}.get(mod, mod), mod):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return None


if __name__ == "__main__":
    main()
