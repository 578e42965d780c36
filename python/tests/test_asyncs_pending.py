"""Pending asyncs scopes (DESIGN.md §10; OneFlow's `with oneflow.asyncs.thread(k):`): the block's
tree calls return at once, every read waits (with the GIL released) for exactly its job, errors
are raised at the first read. Values are checked against torch on the same leaves."""
import _thread
import copy
import json
import os
import pickle
import select
import sys
import threading
import time

import pytest
import torch

import treetensor.asyncs as asyncs
import treetensor.torch as ttorch


def sample(seed=0):
    torch.manual_seed(seed)
    return ttorch.randn({"a": (3,), "b": {"x": (2, 2), "y": (4,)}})


def leaves(t, prefix=""):
    out = {}
    for k, v in t.to_dict().items():
        if isinstance(v, dict):
            out.update(leaves(ttorch.Tensor(v), prefix + k + "."))
        else:
            out[prefix + k] = v
    return out


def gated(worker):
    """A job that holds `worker` until the returned event is set."""
    ev = threading.Event()
    worker.submit(ev.wait)
    return ev


def open_later(ev, delay=0.05):
    opened = []

    def go():
        time.sleep(delay)
        opened.append(True)
        ev.set()

    t = threading.Thread(target=go)
    t.start()
    return t, opened


def test_calls_return_at_once_and_reads_wait():
    x = sample()
    w = asyncs.Thread("pending")
    ev = gated(w)
    with asyncs.thread(w):
        r = x * 2 + 1  # two pending jobs behind the gate
        assert w.in_flight() == 3
    t, opened = open_later(ev)
    got = r.b.x  # waits, GIL released (the opener thread runs meanwhile)
    assert opened, "the read returned before its job ran"
    assert torch.equal(got, x.b.x * 2 + 1)
    t.join()
    w.close()


@pytest.mark.parametrize("read", ["attr", "repr", "to_dict", "keys", "len", "sum", "call", "sync"])
def test_every_read_path_waits(read):
    x = sample(1)
    want = {k: torch.sigmoid(v) for k, v in leaves(x).items()}
    w = asyncs.Thread("reads")
    ev = gated(w)
    with asyncs.thread(w):
        r = x.sigmoid()
    t, opened = open_later(ev)
    if read == "attr":
        assert torch.equal(r.a, want["a"])
    elif read == "repr":
        assert "Tensor" in repr(r) or "tensor" in repr(r)
    elif read == "to_dict":
        assert torch.equal(r.to_dict()["b"]["y"], want["b.y"])
    elif read == "keys":
        assert sorted(r.keys()) == ["a", "b"]
    elif read == "len":
        assert len(r) == 2
    elif read == "sum":
        assert float(r.sum()) == pytest.approx(float(sum(v.sum() for v in want.values())), rel=1e-6)
    elif read == "call":
        assert torch.equal((r + 0).b.x, want["b.x"])
    else:
        asyncs.synchronize()
        assert w.in_flight() == 0
    assert opened, f"{read}: returned before the job ran"
    assert {k: torch.equal(v, want[k]) for k, v in leaves(r).items()} == {k: True for k in want}
    t.join()
    w.close()


def test_a_chain_runs_on_the_worker_without_waiting():
    x, y = sample(2), sample(3)
    w = asyncs.Thread("chain")
    ev = gated(w)
    with asyncs.thread(w):
        s = x + y * 0.5
        m = s * x
        r = ttorch.clamp(ttorch.matmul(m, m).sigmoid(), 0.1, 0.9)
        assert w.in_flight() == 1 + 6, "add, mul, mul, matmul, sigmoid, clamp: none waited"
    ev.set()
    for k, v in leaves(r).items():
        a, b = leaves(x)[k], leaves(y)[k]
        mm = (a + b * 0.5) * a
        assert torch.equal(v, torch.clamp(torch.matmul(mm, mm).sigmoid(), 0.1, 0.9)), k
    w.close()


def test_in_place_inside_then_read_outside():
    t = sample(4)
    before = {k: v.clone() for k, v in leaves(t).items()}
    w = asyncs.Thread("in place")
    ev = gated(w)
    with asyncs.thread(w):
        t.add_(1)
        t.mul_(2)
        t += 1  # __iadd__, then setattr-free: the same object
        assert w.in_flight() == 4, "the root's in-place calls went pending"
    thread, opened = open_later(ev)
    got = leaves(t)
    assert opened
    for k, v in before.items():
        assert torch.equal(got[k], (v + 1) * 2 + 1), k
    thread.join()
    w.close()


def test_in_place_on_a_view_inside_a_scope_waits_for_its_job():
    t = sample(5)
    before = {k: v.clone() for k, v in leaves(t).items()}
    w = asyncs.Thread("view")
    with asyncs.thread(w):
        t.b.sub_(0.5)  # a view: done when the call returns (no pending node below the root)
        t.b += 1
        assert w.in_flight() == 0
    got = leaves(t)
    for k, v in before.items():
        assert torch.equal(got[k], (v - 0.5) + 1 if k.startswith("b.") else v), k
    w.close()


def test_an_error_mid_chain_is_raised_at_the_first_read():
    x = sample(5)
    bad = ttorch.Tensor({"a": torch.ones(2, 3), "b": {"x": torch.ones(5, 5), "y": torch.ones(4)}})
    w = asyncs.Thread("errors")
    with asyncs.thread(w):
        y = ttorch.matmul(x, bad)  # fails on the worker
        z = y + 1  # chained: fails with y's error in its message
    with pytest.raises(RuntimeError) as e:
        z.a
    msg = str(e.value)
    assert f"asyncs thread {w.id}, job 2" in msg and "tree call add" in msg, msg
    assert "matmul" in msg and "job 1" in msg, msg
    with pytest.raises(RuntimeError):
        print(y)  # every read raises: nothing half-made is handed out
    asyncs.synchronize()  # both were observed by reads
    w.close()


def test_an_unread_error_is_raised_by_synchronize():
    x = sample(6)
    w = asyncs.Thread("unread")
    with asyncs.thread(w):
        x.view(7)  # no leaf has 7 elements; the result is dropped unread
    with pytest.raises(RuntimeError, match="tree call view"):
        asyncs.synchronize()
    w.close()


def test_two_python_threads_each_in_their_own_scope():
    xs = [sample(7), sample(8)]
    got, errors = [None, None], []

    def work(i):
        try:
            w = asyncs.Thread(f"py {i}")
            with asyncs.thread(w):
                t = xs[i] * (i + 2)
                t.sub_(1)
                r = t.abs().sqrt()
            got[i] = leaves(r)
            w.close()
        except Exception as ex:  # noqa: BLE001
            errors.append(ex)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert errors == []
    for i in range(2):
        for k, v in leaves(xs[i]).items():
            assert torch.equal(got[i][k], (v * (i + 2) - 1).abs().sqrt()), (i, k)


def test_blocking_scope_raises_at_the_call():
    x = sample(9)
    w = asyncs.Thread("blocking")
    with asyncs.thread(w, blocking=True):
        r = x.exp()
        with pytest.raises(RuntimeError, match="view"):
            x.view(7)
    assert torch.equal(r.a, x.a.exp())
    w.close()


def test_stress_scoped_programs_equal_the_unscoped_program():
    import random

    rng = random.Random(1234)
    w1, w2 = asyncs.Thread("s1"), asyncs.Thread("s2")
    for rnd in range(8):
        torch.manual_seed(rnd)
        a = [ttorch.randn({"p": (8,), "q": {"r": (2, 3)}}) for _ in range(4)]
        b = [t.clone() for t in a]
        steps = [rng.randrange(1000) for _ in range(30)]

        def program(v, scoped):
            for s in steps:
                k, j = s % 4, (s // 4) % 4
                ctx = asyncs.thread(w1 if (s // 16) % 2 else w2) if scoped and s % 3 else None
                if ctx:
                    ctx.__enter__()
                try:
                    op = (s // 32) % 5
                    if op == 0:
                        v[k] = v[k] + v[j]
                    elif op == 1:
                        v[k].mul_(0.5)
                    elif op == 2:
                        v[k] = ttorch.tanh(v[j]) - v[k]
                    elif op == 3:
                        v[k].add_(v[j], alpha=0.25)
                    else:
                        v[k] = ttorch.clamp(v[k], -2.0, 2.0)
                finally:
                    if ctx:
                        ctx.__exit__(None, None, None)

        program(a, True)
        program(b, False)
        for k in range(4):
            la, lb = leaves(a[k]), leaves(b[k])
            assert all(torch.equal(la[p], lb[p]) for p in lb), (rnd, k)
    w1.close()
    w2.close()


@pytest.mark.parametrize("name,args,kwargs", [
    ("sum", ((0, 1),), {}), ("sum", (-1, True), {}), ("mean", (), {"dim": [0], "keepdim": True}),
    ("std", ((0, 1),), {}), ("all", (0,), {}), ("any", (), {"dim": -1}),
])
def test_reductions_with_dim_are_pending_and_equal_torch_per_leaf(name, args, kwargs):
    x = ttorch.Tensor({"a": torch.randn(3, 5), "b": {"c": torch.randn(4, 2, 3)}})
    if name in ("all", "any"):
        x = x > 0
    w = asyncs.Thread("reduce")
    ev = gated(w)
    with asyncs.thread(w):
        r = getattr(x, name)(*args, **kwargs)
        assert w.in_flight() == 2, f"{name}: the reduction waited inside the scope"
    ev.set()
    for k, v in leaves(r).items():
        want = getattr(torch, name)(leaves(x)[k], *args, **kwargs)
        assert v.dtype == want.dtype and torch.equal(v, want), k
    w.close()


@pytest.mark.parametrize("name,args,kwargs", [
    ("sum", (), {"dim": 0, "dtype": torch.float64}), ("all", ((0, 1),), {}),
    ("std", (0,), {"correction": 0}), ("mean", ((),), {}),
    ("mean", (), {"dim": 1, "keepdim": False, "dtype": torch.float64}),
    ("std", (0, False), {}), ("std", (0, True, True), {}),  # std's second argument: unbiased
])
def test_reductions_torch_takes_otherwise_still_run_per_leaf(name, args, kwargs):
    """Arguments the C++ form does not take go to torch per leaf, with torch's meaning."""
    x = ttorch.Tensor({"a": torch.randn(3, 5), "b": {"c": torch.randn(4, 2, 3)}})
    if name == "all":
        x = x > 0
    r = getattr(x, name)(*args, **kwargs)
    for k, v in leaves(r).items():
        want = getattr(torch, name)(leaves(x)[k], *args, **kwargs)
        assert v.dtype == want.dtype and torch.equal(v, want), k
    with pytest.raises(TypeError):  # torch's own refusal of a non-bool keepdim, per leaf
        x.sum(0, keepdim=1)


@pytest.mark.parametrize("args,kwargs", [((), {}), ((1,), {}), ((), {"p": 3.0}), (("fro",), {}),
                                         ((float("inf"),), {})])
def test_norm_per_leaf_is_pending_and_equals_torch(args, kwargs):
    x = ttorch.Tensor({"a": torch.randn(3, 5), "b": {"c": torch.randn(4, 2, 3, dtype=torch.float64)}})
    w = asyncs.Thread("norm")
    ev = gated(w)
    with asyncs.thread(w):
        r = x.norm(*args, **kwargs)
        assert w.in_flight() == 2, "norm waited inside the scope"
    ev.set()
    for k, v in leaves(r).items():
        want = leaves(x)[k].norm(*args, **kwargs)
        assert v.dtype == want.dtype and torch.equal(v, want), k
    w.close()


def test_norm_with_dim_or_dtype_is_torch_per_leaf():
    x = ttorch.Tensor({"a": torch.randn(3, 5), "b": torch.randn(2, 4)})
    for args, kwargs in (((2, 1), {}), ((), {"dim": 0}), ((), {"p": 2, "dtype": torch.float64}),
                         (("nuc",), {})):
        r = x.norm(*args, **kwargs)
        for k, v in leaves(r).items():
            assert torch.equal(v, leaves(x)[k].norm(*args, **kwargs)), (args, kwargs, k)


# ---- tree-level reductions: a PendingTensor (treetensor.asyncs.PendingTensor) ------------------

def mixed(seed=3):
    torch.manual_seed(seed)
    return ttorch.Tensor({"a": torch.randn(3, 4), "b": {"c": torch.randn(5, dtype=torch.float64),
                                                         "d": torch.randn(2, 2)}})


def test_tree_unflatten_waits_for_a_pending_leaf_while_its_list_changes():
    x = mixed()
    leaves_, spec = ttorch.tree_flatten(ttorch.Tensor({"a": x.a, "b": x.a}))
    w = asyncs.Thread("unflatten")
    ev = gated(w)
    with asyncs.thread(w):
        given = [x.sum(), leaves_[1]]  # the list holds the only reference to the pending sum
    junk = []

    def change_then_open():  # runs while tree_unflatten waits for the sum, the GIL released
        time.sleep(0.05)  # lets the main thread go on into tree_unflatten
        given.clear()  # frees the pending sum and the list's item array ...
        junk.extend([None, None] for _ in range(1000))  # ... whose memory these reuse
        ev.set()

    t = threading.Thread(target=change_then_open)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100)  # after its sleep the other thread runs only once the wait
    # releases the GIL (no forced switch), however long the main thread takes to get there
    try:
        t.start()
        back = ttorch.tree_unflatten(spec, given)
    finally:
        sys.setswitchinterval(interval)
        t.join()
        w.close()
    assert torch.equal(back.a, x.sum()) and type(back.a) is torch.Tensor and back.b is leaves_[1]


@pytest.mark.parametrize("read", ["float", "item", "repr", "str", "format", "tolist", "numpy",
                                  "torch_fn", "operator", "bool", "dtype", "tree_call",
                                  "tree_leaf", "pickle", "deepcopy", "torch_scalar_arg",
                                  "tree_scalar_arg", "sync"])
def test_tree_level_reduction_returns_at_once_and_every_read_waits(read):
    x = mixed()
    want = x.sum()  # outside a scope: the plain tensor
    w = asyncs.Thread("tree-level")
    ev = gated(w)
    with asyncs.thread(w):
        s = x.sum()
        assert type(s) is asyncs.PendingTensor and w.in_flight() == 2
    t, opened = open_later(ev)
    if read == "float":
        assert float(s) == want.item()
    elif read == "item":
        assert s.item() == want.item()
    elif read == "repr":
        assert repr(s) == repr(want)
    elif read == "str":
        assert str(s) == str(want)
    elif read == "format":
        assert f"{s:.6f}" == f"{want.item():.6f}"
    elif read == "tolist":
        assert s.tolist() == want.tolist()
    elif read == "numpy":
        assert s.numpy() == want.numpy()
    elif read == "torch_fn":
        assert torch.equal(torch.add(s, 1), want + 1)
    elif read == "operator":
        got = s * 2
        assert type(got) is torch.Tensor and torch.equal(got, want * 2)
    elif read == "bool":
        assert bool(s > -1e9)
    elif read == "dtype":
        assert s.dtype == want.dtype == torch.float64
    elif read == "tree_call":  # a tree call reads it from C++, not through __torch_function__
        got = x - s
        assert torch.equal(got.b.c, x.b.c - want)
    elif read == "tree_leaf":
        got = ttorch.Tensor({"s": s})
        assert torch.equal(got.s, want)
    elif read == "deepcopy":
        got = copy.deepcopy({"s": s})["s"]
        assert type(got) is torch.Tensor and torch.equal(got, want)
    elif read == "torch_scalar_arg":  # torch's C++ reads a Scalar without __torch_function__
        assert torch.equal(torch.full((2,), s), torch.full((2,), want.item()))
    elif read == "tree_scalar_arg":  # a Number argument of a tree call (C++)
        got = x.clamp(min=s)
        assert torch.equal(got.b.c, x.b.c.clamp(min=want.item()))
    elif read == "pickle":
        got = pickle.loads(pickle.dumps(s))
        assert type(got) is torch.Tensor and torch.equal(got, want)
    elif read == "sync":
        asyncs.synchronize()
        assert opened
        assert torch.equal(s, want)
    assert opened, f"{read}: the read returned before the job ran"
    t.join()
    w.close()


TREES = {
    "mixed_float": lambda: mixed(),
    "half_and_float": lambda: ttorch.Tensor({"a": torch.randn(4).half(), "b": torch.randn(3)}),
    "bfloat_and_half": lambda: ttorch.Tensor({"a": torch.randn(4).bfloat16(),
                                              "b": torch.randn(3).half()}),
    "int_and_bool": lambda: ttorch.Tensor({"a": torch.arange(5, dtype=torch.int32),
                                           "b": torch.tensor([True, False])}),
    "int_and_half": lambda: ttorch.Tensor({"a": torch.arange(5, dtype=torch.int16),
                                           "b": torch.randn(3).half()}),
    "one_element": lambda: ttorch.Tensor({"a": torch.tensor([2.5], dtype=torch.float64)}),
    "empty_leaf": lambda: ttorch.Tensor({"a": torch.empty(0, dtype=torch.float64),
                                         "b": torch.randn(3)}),
    "no_leaves": lambda: ttorch.Tensor({}),
}


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("name", ["sum", "mean", "all", "any", "min", "max", "std"])
def test_tree_level_reduction_in_a_scope_equals_the_call_outside(tree, name):
    """Same dtype, same bits, or the same exception type raised at the first read."""
    x = TREES[tree]()
    try:
        want, error = getattr(x, name)(), None
    except Exception as e:  # noqa: BLE001  (the scope must raise the same type, later)
        want, error = None, type(e)
    w = asyncs.Thread("dtypes")
    with asyncs.thread(w):
        got = getattr(x, name)()
    if error is not None:
        with pytest.raises(error, match=r"asyncs thread \d+, job \d+ 'tree call " + name):
            float(got)
    else:
        assert type(got) is asyncs.PendingTensor
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want) or (want.isnan().all() and got.isnan().all())
    w.close()


@pytest.mark.parametrize("name", ["sum", "mean", "std"])
def test_a_default_dtype_constant_takes_the_default_dtype_of_the_call(name):
    """0 or NaN in the default dtype: the job runs after set_default_dtype changed it back."""
    x = TREES["no_leaves"]()
    w = asyncs.Thread("default dtype")
    ev = gated(w)
    torch.set_default_dtype(torch.float64)
    try:
        with asyncs.thread(w):
            got = getattr(x, name)()
        want = getattr(x, name)()
    finally:
        torch.set_default_dtype(torch.float32)
    ev.set()
    assert type(got) is asyncs.PendingTensor
    assert got.dtype == want.dtype == torch.float64
    assert torch.equal(got, want) or (want.isnan() and got.isnan())
    w.close()


def test_tree_level_reduction_error_is_raised_at_every_read_and_by_tree_calls():
    x = ttorch.Tensor({"a": torch.arange(3), "b": {"c": torch.arange(2)}})  # mean: integer
    w = asyncs.Thread("error")
    with asyncs.thread(w):
        m = x.mean()  # returns at once: the error belongs to the first read
    for read in (float, repr, lambda v: v + 1, lambda v: x.float() * v, lambda v: x.clamp(max=v),
                 lambda v: torch.as_tensor(v, dtype=torch.float64), lambda v: torch.full((1,), v)):
        with pytest.raises(RuntimeError, match=r"asyncs thread \d+, job \d+ 'tree call mean'.*"
                                             r"leaf 'a' is Long"):
            read(m)
    w.close()


def test_tree_level_reduction_of_a_pending_operand():
    x = mixed(4)
    w = asyncs.Thread("chain")
    with asyncs.thread(w):
        s = (x * 2 + 1).std()  # the operand is made first, then the reduction is queued
        assert type(s) is asyncs.PendingTensor
    assert torch.equal(s, (x * 2 + 1).std())
    w.close()


def test_tree_level_reduction_autograd_records_is_a_blocking_call():
    x = ttorch.Tensor({"a": torch.randn(3, requires_grad=True), "b": torch.randn(2, 2)})
    w = asyncs.Thread("grad")
    with asyncs.thread(w):
        s = x.sum()
    assert type(s) is torch.Tensor and s.grad_fn is not None
    s.backward()
    assert torch.equal(x.a.grad, torch.ones(3))
    with torch.no_grad(), asyncs.thread(w):
        assert type(x.sum()) is asyncs.PendingTensor  # nothing recorded: pending again
    w.close()


@pytest.mark.parametrize("read", ["arange", "narrow", "index"])
def test_an_int_result_read_as_an_int_argument_waits(read):
    """torch's C++ reads an int argument without __torch_function__: __torch_dispatch__ waits."""
    x = ttorch.Tensor({"a": torch.ones(2, dtype=torch.int64), "b": torch.ones(1, dtype=torch.int64)})
    w = asyncs.Thread("int")
    ev = gated(w)
    with asyncs.thread(w):
        k = x.sum()
    t, opened = open_later(ev)
    if read == "arange":
        assert torch.equal(torch.arange(k), torch.arange(3))
    elif read == "narrow":
        assert torch.arange(10).narrow(0, 0, k).shape == (3,)
    else:
        assert torch.arange(10)[k].item() == 3
    assert opened
    t.join()
    w.close()


def test_tree_level_reduction_of_quantized_leaves_is_a_blocking_call():
    q = torch.quantize_per_tensor(torch.tensor([0.1, 0.5]), 0.1, 0, torch.quint8)
    x = ttorch.Tensor({"a": q})
    w = asyncs.Thread("quantized")
    with asyncs.thread(w):
        got = x.max()  # the result's quantizer is known only from the data
    assert type(got) is torch.Tensor and got.dtype == torch.quint8 and got.item() == q.max().item()
    w.close()


def test_tree_level_reduction_in_inference_mode():
    x = mixed(5)
    w = asyncs.Thread("inference")
    with torch.inference_mode(), asyncs.thread(w):
        s = x.mean()
    assert torch.equal(s, x.mean())
    w.close()


def fork_child(body):
    """Forks a child that runs body() and writes its result (JSON) to a pipe: (pid, read end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover  (the child)
        try:
            out = body()
        except BaseException as e:  # noqa: BLE001
            out = f"child raised {type(e).__name__}: {e}"
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    return pid, r


def child_output(pid, r, limit=30):
    """The result fork_child's child wrote, or a failure when it hangs (it is killed)."""
    ready, _, _ = select.select([r], [], [], limit)
    if not ready:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    assert ready, f"the forked child hung for {limit} s"
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    assert data, f"the forked child wrote nothing (wait status {status})"
    return json.loads(data)


def in_forked_child(body, limit=30):
    """body() run in a forked child; its result (JSON) back, or a failure when it hangs."""
    return child_output(*fork_child(body), limit)


def test_a_forked_child_fails_the_jobs_in_flight_and_starts_its_own_workers():
    """fork() copies only the forking thread: in the child, jobs queued at the fork raise
    at every read, the parent's Thread objects refuse work, thread(k) and stream(2) start new
    workers. The parent is unaffected."""
    x = ttorch.Tensor({"a": torch.arange(3.0), "b": {"c": torch.ones(2)}})
    with ttorch.stream(2):
        x + 1  # the lanes' workers exist in the parent
    with asyncs.thread(1):
        x + 1  # so does the worker of thread(1)
    asyncs.synchronize()
    w = asyncs.Thread("forked")
    ev = gated(w)
    with asyncs.thread(w):
        y = x + 1
        s = x.sum()

    def child():
        out = {}
        for name, read in [("leaf", lambda: y.a), ("sum", lambda: float(s)),
                           ("submit", lambda: w.submit(int)), ("scope", lambda: asyncs.thread(w).__enter__()),
                           ("synchronize", asyncs.synchronize)]:
            try:
                read()
                out[name] = "no error"
            except RuntimeError as e:
                out[name] = str(e)
        w.close()
        with asyncs.thread(1):
            z = x * 2 + 1
        with ttorch.stream(2):
            v = x - 1
        out["new"] = [torch.equal(z.a, x.a * 2 + 1), torch.equal(z.b.c, x.b.c * 2 + 1),
                      torch.equal(v.b.c, x.b.c - 1)]
        return out

    try:
        out = in_forked_child(child)
    finally:
        ev.set()  # else the Thread's close drains a job that waits for ever
    for name in ("leaf", "sum", "synchronize"):
        assert "was in flight when the process forked" in out[name], (name, out[name])
    assert "'tree call add'" in out["leaf"] and "'tree call sum'" in out["sum"]
    for name in ("submit", "scope"):
        assert "was started before this process forked" in out[name], (name, out[name])
    assert out["new"] == [True, True, True]
    assert torch.equal(y.a, x.a + 1) and float(s) == 5.0  # the parent's jobs ran
    w.close()


def forks_beside_busy_threads(step, child, expected, forks, limit=30):
    """Forks `forks` children, each running child() and returning `expected`, while two threads
    each run step(w) in a loop, w an asyncs.Thread of their own."""
    stop = threading.Event()

    def busy():
        w = asyncs.Thread("busy")
        while not stop.is_set():
            step(w)
        w.close()

    threads = [threading.Thread(target=busy) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(forks):
            assert in_forked_child(child, limit) == expected
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_forks_while_other_threads_run_tree_calls_and_jobs():
    """The runtime's locks are held over fork(): a child forked while another thread is inside
    a tree call (lanes, the policy's learner) or submitting jobs starts with none of them held."""
    x = ttorch.Tensor({"a": torch.arange(4.0), "b": {"c": torch.ones(3)}})

    def step(w):
        with ttorch.stream(2):
            x * 2 + 1
        with asyncs.thread(w):
            x.sum()
        w.submit(int).result()

    def child():
        with ttorch.stream(2):
            y = x * 3
        with asyncs.thread(1):
            s = x.sum()
        return [torch.equal(y.b.c, x.b.c * 3), float(s) == 9.0]

    forks_beside_busy_threads(step, child, [True, True], forks=10)


def test_forks_while_workers_take_the_gil_for_python_jobs():
    """A worker running a Python job makes itself a Python thread state, under CPython's lock
    over the list of them; a child forked meanwhile must not start with that lock held (3.11
    waits on it in the child for ever). Each fork races with two workers' jobs."""

    def child():
        w = asyncs.Thread("child")
        out = w.submit(sum, [1, 2]).result()
        w.close()
        return out

    forks_beside_busy_threads(lambda w: w.submit(int).result(), child, 3, forks=150, limit=20)


def test_a_fork_inside_a_job_leaves_a_child_that_is_no_worker():
    """The forking job runs on in the child, on a thread that is no asyncs worker there: its
    tree calls and new workers behave as on any thread."""
    x = ttorch.Tensor({"a": torch.ones(3)})
    w = asyncs.Thread("forking")

    def child():
        with asyncs.thread(asyncs.Thread("child")):
            z = ttorch.sin(x)
        return [asyncs.current_thread_id(), torch.equal(z.a, torch.sin(x.a))]

    assert child_output(*w.submit(fork_child, child).result()) == [None, True]
    w.close()


@pytest.mark.parametrize("read", ["leaf", "sum", "future", "synchronize", "wait_idle"])
def test_ctrl_c_interrupts_a_wait_and_the_job_runs_on(read):
    """A read (or synchronize(), wait_idle()) waiting for a job runs Python's signal handlers
    every 50 ms: Ctrl-C raises KeyboardInterrupt at once, and a later read gets the value."""
    x = ttorch.Tensor({"a": torch.arange(3.0), "b": torch.ones(2)})
    w = asyncs.Thread("interrupted")
    ev = gated(w)
    with asyncs.thread(w):
        y = x + 1
        s = x.sum()
    f = w.submit(lambda: 42)
    reads = {"leaf": lambda: y.a, "sum": lambda: float(s), "future": f.result,
             "synchronize": asyncs.synchronize, "wait_idle": w.wait_idle}
    timer = threading.Timer(0.1, _thread.interrupt_main)
    fallback = threading.Timer(3.0, ev.set)  # a wait deaf to Ctrl-C fails instead of hanging
    timer.start()
    fallback.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            reads[read]()
        assert time.monotonic() - t0 < 2, "KeyboardInterrupt came only once the job had run"
    finally:
        timer.join()
        fallback.cancel()
        ev.set()
    assert torch.equal(y.a, x.a + 1) and float(s) == 5.0 and f.result() == 42
    w.close()


def test_a_failed_in_place_call_is_raised_by_a_first_read_of_a_leaf():
    """An in-place call's target raises the job's error at its first read, whatever the read
    (here an attribute), then shows what the failed call left."""
    t = ttorch.Tensor({"a": torch.ones(3), "b": torch.ones(2)})
    bad = ttorch.Tensor({"a": torch.ones(4), "b": torch.ones(2)})
    with asyncs.thread(1):
        t.add_(bad)
    with pytest.raises(RuntimeError, match=r"asyncs thread \d+, job \d+ 'tree call add_'"):
        t.a
    assert torch.equal(t.a, torch.ones(3))  # the leaf the failed call did not write


@pytest.mark.parametrize("end,status", [("return", 0), ("raise", 1), ("exit", 3)])
def test_a_child_forked_inside_a_job_ends_when_the_job_returns(end, status):
    """Returning from the job in the child ends the child (its only thread is done), with the
    job's outcome as its exit status, instead of hanging or aborting."""
    w = asyncs.Thread("forks and returns")

    def job():
        pid = os.fork()
        if pid == 0:
            if end == "raise":
                raise ValueError("the child's job failed")
            if end == "exit":
                sys.exit(3)
            return None
        return pid

    pid = w.submit(job).result()
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child forked inside a job did not end")
        time.sleep(0.01)
    assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == status, done[1]
    w.close()


def test_a_pending_tree_s_methods_come_before_its_keys_until_it_is_made():
    """A key comes before a method of its name (DI-treetensor parity), but a pending result's
    keys are known only once its job is done: until then its methods come first, without a
    wait (a method call on it chains inside the scope)."""
    x = ttorch.Tensor({"sum": torch.ones(2), "a": torch.zeros(2)})
    w = asyncs.Thread("keys")
    ev = gated(w)
    with asyncs.thread(w):
        r = x + 1
        s = r.sum  # the method, not a wait for the job behind the gate
        assert w.in_flight() == 2
    assert callable(s)
    ev.set()
    assert torch.equal(r.sum, torch.full((2,), 2.0))  # outside the scope a read: waits, the key
    with asyncs.thread(w):
        q = x + 2
        asyncs.synchronize()
        assert torch.equal(q.sum, torch.full((2,), 3.0))  # its job done: the key
    c = x.clone()
    with asyncs.thread(w):
        c += 1  # a pending write of c
    assert torch.equal(c.sum, torch.full((2,), 2.0))
    w.close()
