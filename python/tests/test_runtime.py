"""stream(n), asyncs threads, apply with Python callbacks, Python threads, GIL release, Ctrl-C."""
import threading
import time
import warnings

import pytest
import torch

import treetensor.asyncs as asyncs
import treetensor.torch as ttorch
from conftest import dicts_equal


def seed_trees(n=16, s=8):
    torch.manual_seed(0)
    a = ttorch.randn({f"a{i}": (s, 2 * s) for i in range(n)})
    b = ttorch.randn({f"a{i}": (2 * s, 4 * s) for i in range(n)})
    return a, b


def native(a, b):
    return {k: torch.matmul(a[k], b[k]) for k in a.keys()}


def test_stream_global_and_scoped():
    a, b = seed_trees()
    want = native(a, b)
    assert ttorch.current_stream() == "stream(1)"
    ttorch.stream(2)  # DI-treetensor: the call sets the process-wide mode
    assert ttorch.current_stream() == "stream(2)"
    got = ttorch.matmul(a, b)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5)
    ttorch.stream(1)
    with ttorch.stream(3):  # scoped: this thread, inside the block
        assert ttorch.current_stream() == "stream(3)"
        seen = []
        t = threading.Thread(target=lambda: seen.append(ttorch.current_stream()))
        t.start()
        t.join()
        assert seen == ["stream(1)"]  # other threads keep the process-wide mode
        got = a @ b
        with ttorch.stream("auto"):
            assert ttorch.current_stream() == "stream(automatic)"
            got2 = a @ b
        assert ttorch.current_stream() == "stream(3)"
    assert ttorch.current_stream() == "stream(1)"
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5) and torch.allclose(got2[k], want[k], atol=1e-5)
    # elementwise results are bitwise the same in every mode
    lin = (a * 2 + 1).sigmoid()
    with ttorch.stream(2):
        assert ttorch.equal((a * 2 + 1).sigmoid(), lin)
    with pytest.raises(ValueError):
        ttorch.stream(0)
    with pytest.raises(ValueError):
        ttorch.stream("sideways")


@pytest.mark.parametrize("mode", [1, 2, 4, "auto"])
def test_apply_python_callback_under_lanes(mode):
    a, b = seed_trees(n=32, s=4)
    calls = []
    with ttorch.stream(mode):
        r = ttorch.apply(lambda x, y, k: (calls.append(1), torch.matmul(x, y) * k)[1], a, b, 3)
        # a callback may itself make tree calls (nested, GIL re-acquired)
        nested = ttorch.apply(lambda x: ttorch.Tensor({"v": x}).sigmoid().v, a)
    assert len(calls) == 32
    want = native(a, b)
    for k in want:
        assert torch.allclose(r[k], want[k] * 3)
    dicts_equal(nested, {k: torch.sigmoid(v) for k, v in a.to_dict().items()})
    pair = ttorch.apply(lambda x: (x + 1, x - 1), a)
    assert isinstance(pair, tuple) and ttorch.equal(pair[0], a + 1) and ttorch.equal(pair[1], a - 1)
    assert a.apply(lambda x: x * 2).equal(a * 2)
    assert ttorch.apply(lambda x, scale=1: x * scale, a, scale=3).equal(a * 3)  # keywords as they are
    assert ttorch.apply(lambda x: x + 1, torch.ones(1)).item() == 2  # no tree: a plain call


def test_apply_over_no_leaves_keeps_the_structure():
    for d in ({}, {"a": {}}, {"a": {}, "b": {"c": {}}}):
        r = ttorch.apply(lambda x: x + 1, ttorch.Tensor(d))
        assert isinstance(r, ttorch.Tensor) and r.to_dict() == d  # DI-treetensor's too
        assert ttorch.Tensor(d).apply(lambda x: x).to_dict() == d


def test_apply_errors_keep_type_and_path():
    t = ttorch.Tensor({"a": torch.ones(2), "b": {"c": torch.zeros(3)}})

    def f(x):
        if x.numel() == 3:
            raise KeyError("boom")
        return x

    with ttorch.stream(2):
        with pytest.raises(KeyError, match=r"apply at leaf 'b\.c'.*boom") as info:
            ttorch.apply(f, t)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(TypeError, match="must return a torch.Tensor"):
        ttorch.apply(lambda x: 1.0, t)

    def interrupt(x):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # Ctrl-C is never swallowed or rewrapped
        ttorch.apply(interrupt, t)

    class Odd(Exception):  # built from the message, __new__ returns no Odd: raised unchanged
        def __new__(cls, *args):
            return (1,) if args and "at leaf" in str(args[0]) else super().__new__(cls, *args)

    def odd(x):
        raise Odd("x")

    for call in (lambda: ttorch.apply(odd, t), lambda: t.map(odd)):
        for _ in range(200):
            with pytest.raises(Odd, match="^x$"):
                call()


@pytest.mark.parametrize("mode", [1, 2])
def test_apply_keeps_the_runtime_rules_on_the_calling_thread_too(mode):
    """stream(1) (the default) runs apply's leaves on the calling thread with the GIL held,
    stream(2) through the lanes: either way every leaf runs and the failures are reported
    together, tuples rise, leaves must give as many results, and a callback cannot change the
    keys of the tree being walked."""
    t = ttorch.Tensor({"a": torch.ones(2), "b": {"c": torch.zeros(3)}})
    ran = []

    def fail(x):
        ran.append(x.numel())
        raise KeyError("boom")

    def change(x):
        t.z = torch.ones(1)
        return x

    with ttorch.stream(mode):
        with pytest.raises(KeyError, match=r"apply at leaf 'a'.*boom.*1 other failure\(s\): 'b\.c'"):
            ttorch.apply(fail, t)
        assert sorted(ran) == [2, 3]
        with pytest.raises(ValueError, match=r"apply: leaf 'b\.c' gave 1 results but leaf 'a' gave 2"):
            ttorch.apply(lambda x: (x, x) if x.numel() == 2 else (x,), t)
        low, high = t.apply(lambda x: (x - 1, x + 1))
        assert ttorch.equal(low, t - 1) and ttorch.equal(high, t + 1)
        with pytest.raises(RuntimeError, match="cannot change the keys"):
            ttorch.apply(change, t)
    assert "z" not in t.keys()


def test_four_python_threads_at_once():
    a, b = seed_trees(n=24, s=6)
    want_mm = native(a, b)
    want_el = ((a + 1) * a).to_dict()
    errors = []

    def work(i):
        try:
            for _ in range(30):
                with ttorch.stream(1 + i % 2):
                    r = a @ b
                    e = (a + 1) * a
                for k in want_mm:
                    assert torch.allclose(r[k], want_mm[k], atol=1e-5)
                dicts_equal(e, want_el)
                ttorch.apply(lambda x: x * i, a)
        except Exception as ex:  # noqa: BLE001
            errors.append(ex)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


@pytest.mark.parametrize("mode", [1, 2, "auto"])
def test_torch_warnings_of_tree_calls_are_python_warnings(mode):
    """A leaf's torch warning, on whichever lane, is a Python warning after the call (as torch's
    own calls make theirs): filters, -W error and pytest.warns see it; it went to stderr."""
    t = ttorch.Tensor({f"k{i}": torch.tensor([float(i)]) for i in range(16)})
    with ttorch.stream(mode):
        with pytest.warns(UserWarning, match="degrees of freedom is <= 0") as caught:
            r = t.std(dim=0)
        assert len([w for w in caught if "degrees of freedom" in str(w.message)]) == 16
        assert all(torch.isnan(r[k]) for k in r.keys())  # the call's result stands
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match="degrees of freedom"):
                t.std(dim=0)
        # named at the caller's line, past the package's Python wrappers
        assert {w.filename for w in caught} == {__file__}
        # from a tree call inside an apply callback, on whichever lane runs it
        with pytest.warns(UserWarning, match="degrees of freedom"):
            ttorch.apply(lambda x: ttorch.Tensor({"v": x}).std(dim=0).v, t)


def test_a_warnings_hook_may_change_the_tree():
    """Warnings are issued once the call has let go of its trees: a hook (Python code) may
    change their keys."""
    t = ttorch.Tensor({"a": torch.tensor([1.0]), "b": torch.tensor([2.0])})
    seen = []

    def hook(message, *args, **kwargs):
        t.c = torch.ones(1)  # a change of the keys while the call held them raised RuntimeError
        seen.append(str(message))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        t.std(dim=0)
    assert len(seen) == 2 and "c" in t.keys()


def test_gil_released_during_long_tree_call():
    torch.manual_seed(0)
    a = ttorch.randn({f"a{i}": (320, 320) for i in range(12)})
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.05)
    try:
        start = time.perf_counter()
        for _ in range(5):
            before = ticks[0]
            c0 = time.perf_counter()
            a @ a @ a
            during = ticks[0] - before
            if time.perf_counter() - c0 > 0.02:
                break
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        t.join()
    # With the GIL held, the spinning thread would get no turn during the call (switch interval
    # 5 ms, but a C++ call never offers the GIL); released, it counts all along.
    assert elapsed < 30
    assert during > 1000, f"the Python thread made {during} steps during the tree call"


def test_asyncs_thread_scope():
    a, b = seed_trees(n=8, s=4)
    seen = []
    with asyncs.thread(1) as worker:
        assert isinstance(worker, asyncs.Thread) and worker.id >= 1
        r = a @ b
        ttorch.apply(lambda x: (seen.append(asyncs.current_thread_id()), x)[1], a)
    assert seen and all(s == worker.id for s in seen)
    assert asyncs.current_thread_id() is None
    want = native(a, b)
    for k in want:
        assert torch.allclose(r[k], want[k], atol=1e-5)
    with asyncs.thread(1) as again:
        assert again is worker  # the same number names the same worker
    bad = ttorch.Tensor({"a": torch.ones(2), "b": {"c": torch.ones(3)}})
    with asyncs.thread(worker, blocking=True):  # a blocking scope: the call itself raises
        with pytest.raises(RuntimeError, match=r"asyncs thread \d+, job \d+.*matmul at leaf 'b\.c'|matmul at leaf 'b\.c'.*"):
            bad @ ttorch.Tensor({"a": torch.ones(2), "b": {"c": torch.ones(4)}})
    asyncs.synchronize()
    ttorch.synchronize()
    with pytest.raises(TypeError):
        asyncs.thread("x")


def test_asyncs_thread_from_python_threads():
    a, _ = seed_trees(n=8, s=4)
    want = a.sigmoid()
    errors = []

    def work(i):
        try:
            with asyncs.thread(10 + i % 2):
                for _ in range(20):
                    assert ttorch.equal(a.sigmoid(), want)
        except Exception as ex:  # noqa: BLE001
            errors.append(ex)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert errors == []


def test_seed_example_runs():
    import os
    import subprocess
    import sys

    from conftest import ROOT

    script = os.path.join(ROOT, "python", "examples", "seed_stream.py")
    out = subprocess.run([sys.executable, script, "4", "2", "20", "2"], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert "stream(2)" in out.stdout and "native" in out.stdout


def test_ctrl_c_during_tree_calls_is_not_swallowed():
    import os
    import signal

    torch.manual_seed(0)
    a = ttorch.randn({f"a{i}": (96, 96) for i in range(16)})
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    deadline = time.monotonic() + 20
    with pytest.raises(KeyboardInterrupt):
        with ttorch.stream(2):
            while time.monotonic() < deadline:
                a @ a  # GIL released: Python handles the signal between calls
                ttorch.apply(lambda x: x * 2, a)  # and inside callbacks
    timer.join()


def test_no_native_memory_growth():
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    a = ttorch.Tensor({f"k{i}": torch.ones(4) for i in range(8)})
    for _ in range(2000):
        (a + 1).sum()
    before = rss()
    for _ in range(10000):
        c = a + 1
        c *= 2
        c.sum()
        c.to_dict()
    grown = rss() - before
    assert grown < 8 * 1024 * 1024, f"RSS grew {grown} bytes over 10,000 ops"


def test_asyncs_submit_python_jobs():
    a, _ = seed_trees(n=8, s=4)
    w = asyncs.Thread("submit-test")
    order = []
    futs = [w.submit(lambda i=i: (order.append(i), asyncs.current_thread_id(), (a * i).sum())[1:], ) for i in range(5)]
    results = [f.result() for f in futs]
    assert order == list(range(5))  # FIFO
    assert all(r[0] == w.id for r in results)
    assert all(torch.allclose(r[1], a.sum() * i) for i, r in enumerate(results))

    def fail():
        raise ValueError("job failed")

    f = w.submit(fail)
    for _ in range(2):
        with pytest.raises(ValueError, match="job failed"):
            f.result()
    assert f.done()
    assert w.submit(lambda x, y=1: x + y, 2, y=5).result() == 7
    w.close()


EXIT_SCRIPT = """
import time, torch, treetensor.torch as ttorch, treetensor.asyncs as asyncs
t = ttorch.randn({'a': (2, 2)})
with asyncs.thread(1):
    t + 1
f = asyncs.Thread().submit(lambda: (time.sleep(0.1), t.sum())[1])   # still running at exit
g = asyncs.Thread().submit(lambda: 1 / 0)                             # never observed
ttorch.stream(2)
r = ttorch.apply(lambda x: x * 2, t)
print("exiting")
"""


def test_interpreter_exit_with_workers_and_lanes_is_clean():
    import os
    import subprocess
    import sys

    for _ in range(3):  # the abort this guards against was intermittent
        out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ))
        assert out.returncode == 0, out.stderr
        assert "exiting" in out.stdout
