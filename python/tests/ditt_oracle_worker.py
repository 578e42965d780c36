"""Runs the DI-treetensor oracle's cases (test_ditt_oracle.py) with whichever `treetensor` this
Python imports, and writes what each gave in a plain, comparable form.

    python ditt_oracle_worker.py SPEC OUT
    python ditt_oracle_worker.py --names OUT     (only the names, for scripts/ditt_names.py)

SPEC (torch.save): {"inputs": {name: nested dict of tensors}, "cases": [(id, expression)]}.
Each expression is evaluated with ttorch, tnp, tc (treetensor.common), torch, np and T(name)
(a fresh tree of a copy of input `name`). OUT (torch.save): {"results": {id: encoded},
"names": the names this treetensor exports}. Imports nothing from the test suite: the peers'
venv runs it with DI-treetensor, the project's venv with ours (never both in one process).
"""
import sys
import warnings

import numpy as np
import torch


def is_tree(r):
    return type(r).__module__.startswith("treetensor") and hasattr(r, "items") and not isinstance(r, type)


def encode(r):
    """(kind, payload): tensors and arrays copied, trees as {key: encoded}, tuples as lists."""
    if isinstance(r, torch.Tensor):
        return ("tensor", r.detach().clone())
    if is_tree(r):
        return ("tree:" + type(r).__name__, {str(k): encode(v) for k, v in r.items()})
    if isinstance(r, np.ndarray):
        return ("ndarray", r.copy())
    if isinstance(r, np.generic):
        return ("npscalar", r.item())
    if isinstance(r, torch.Size):
        return ("size", tuple(r))
    if hasattr(type(r), "n_fields"):
        return ("struct:" + type(r).__name__, [encode(x) for x in r])
    if isinstance(r, (tuple, list)):
        return (type(r).__name__, [encode(x) for x in r])
    if isinstance(r, dict):
        return ("dict", {str(k): encode(v) for k, v in r.items()})
    if r is None or isinstance(r, (bool, int, float, str, torch.dtype, torch.device)):
        return ("value", r)
    if callable(r):
        return ("callable", None)
    return ("other:" + type(r).__name__, repr(r))


def names(ttorch, tnp, tc):
    def public(obj):
        return sorted(n for n in dir(obj) if not n.startswith("_"))
    return {"torch": list(dict.fromkeys(ttorch.__all__)), "numpy": list(tnp.__all__),
            "common": ["Object"], "funcs": list(ttorch.funcs.__all__),
            "Tensor": public(ttorch.Tensor), "Object": public(tc.Object)}


def main(spec_path, out_path):
    import treetensor as tt
    import treetensor.common as tc
    import treetensor.numpy as tnp
    import treetensor.torch as ttorch

    if spec_path == "--names":
        torch.save({"names": names(ttorch, tnp, tc)}, out_path)
        return

    spec = torch.load(spec_path, weights_only=False)
    inputs = spec["inputs"]

    def copy(d):
        return {k: copy(v) if isinstance(v, dict) else v.clone() for k, v in d.items()}

    def T(name):  # noqa: N802  (the cases' short name)
        return ttorch.Tensor(copy(inputs[name]))

    env = {"tt": tt, "ttorch": ttorch, "tnp": tnp, "tc": tc, "torch": torch, "np": np, "T": T,
           "D": lambda name: copy(inputs[name])}
    results = {}
    for case_id, expression in spec["cases"]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                value = encode(eval(expression, dict(env)))  # noqa: S307  (the suite's own cases)
            except Exception as e:  # noqa: BLE001  (the exception's type is the result)
                value = ("error", type(e).__name__, str(e))
        results[case_id] = (value, sorted({w.category.__name__ for w in caught
                                            if not issubclass(w.category, (DeprecationWarning, FutureWarning))}))
    torch.save({"results": results, "names": names(ttorch, tnp, tc)}, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
