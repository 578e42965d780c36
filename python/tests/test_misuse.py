"""Misuse from Python gives exceptions, never a crash, a hang or a memory bomb: closed asyncs
threads, cyclic and very deep dicts, keys changed under a running call, unread job errors,
raising futures, missing attributes."""
import gc
import os
import subprocess
import sys
import textwrap
import tracemalloc

import pytest
import torch

import treetensor.asyncs as asyncs
import treetensor.torch as ttorch


def run_script(src, timeout=120):
    """src in a fresh interpreter: a crash there is a failed test here, not a dead pytest."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(src)], capture_output=True,
                         text=True, timeout=timeout, env=dict(os.environ))
    assert out.returncode == 0, f"rc {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


# ---- closed asyncs threads -------------------------------------------------------------------
def test_closed_thread_is_defined_like_a_shut_down_executor():
    out = run_script("""
        import treetensor.asyncs as asyncs
        t = asyncs.Thread()
        i = t.id
        t.submit(lambda: 1).result()
        t.close()
        assert t.id == i, "the id stays readable"
        assert t.in_flight() == 0
        t.wait_idle()
        t.close()
        for f in (lambda: t.submit(lambda: 1), lambda: asyncs.thread(t).__enter__()):
            try:
                f()
            except RuntimeError as e:
                assert f"asyncs thread {i} is closed" in str(e), str(e)
            else:
                raise AssertionError("no error after close")
        print("ok")
    """)
    assert out.strip() == "ok"


def test_asyncs_threads_and_step_in_backward_after_torch_compile():
    # torch.compile leaves a CUDA guard without a stream pool in a process without a GPU: an
    # asyncs thread asked it for worker streams and raised "Backend doesn't support acquiring
    # a stream from pool" (so did step_in_backward, which runs on one).
    out = run_script("""
        import torch, torch.nn as nn
        import treetensor.asyncs as asyncs, treetensor.nn as tnn, treetensor.optim as topt
        f = torch.compile(lambda x: x * 2, backend="eager")
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
        t = asyncs.Thread("metrics")
        assert t.submit(lambda: 41 + 1).result() == 42
        t.close()
        m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        tree = tnn.consolidate_module(m)
        opt = topt.SGD(tree.params, lr=0.1)
        tree.step_in_backward(opt)
        before = m[0].weight.detach().clone()
        m(torch.randn(5, 4)).sum().backward()
        opt.step()
        assert not torch.equal(before, m[0].weight)
        print("ok")
    """, timeout=300)
    assert out.strip().endswith("ok")


# ---- dicts -----------------------------------------------------------------------------------
def test_cyclic_dict_is_a_value_error_naming_the_path():
    d = {"x": torch.ones(1)}
    d["s"] = {"t": d}
    with pytest.raises(ValueError, match=r"dict at 's\.t' is the dict at '<root>' again \(a cycle\)"):
        ttorch.Tensor(d)
    shared = {"v": torch.ones(1)}  # the same dict twice, not inside itself: fine
    t = ttorch.Tensor({"a": shared, "b": shared})
    assert torch.equal(t.a.v, t.b.v)


def test_shape_trees_refuse_cycles_and_depth_as_tensor_trees_do():
    # zeros/ones/empty/full walk a dict of shapes: past 10,000 levels they ran out of stack
    # (a segfault at 50,000) and a dict containing itself recursed for ever.
    deep = (2,)
    for _ in range(50000):
        deep = {"k": deep}
    cyclic = {"a": (2,)}
    cyclic["s"] = {"t": cyclic}
    for make in (ttorch.zeros, ttorch.ones, ttorch.empty, lambda d: ttorch.full(d, 2.0)):
        with pytest.raises(ValueError, match="nested deeper than 10000 levels"):
            make(deep)
        with pytest.raises(ValueError, match=r"dict at 's\.t' is the dict at '<root>' again \(a cycle\)"):
            make(cyclic)
    ok = (2,)
    for _ in range(9999):
        ok = {"k": ok}
    node = ttorch.full(ok, 2.0).to_dict()
    while isinstance(node, dict):
        node = node["k"]
    assert torch.equal(node, torch.full((2,), 2.0))
    with pytest.raises(TypeError, match="the shape at 'a.b' is not a sequence of ints"):
        ttorch.zeros({"a": {"b": "x"}})


def test_cyclic_dict_given_to_object_names_the_path_as_the_tensor_tree_does():
    import treetensor.common as tc

    d = {"x": 1}
    d["s"] = {"t": d}
    with pytest.raises(ValueError, match=r"dict at 's\.t' is the dict at '<root>' again \(a cycle\)"):
        tc.Object(d)
    q = tc.Object({"a": 1})
    q["z"] = q  # accepted, as in DI-treetensor (it prints); read as a subtree it is a cycle
    with pytest.raises(ValueError, match=r"dict at 'w\.z' is the dict at 'w' again \(a cycle\)"):
        tc.Object({"w": q})
    import collections

    od = collections.OrderedDict(x=1)
    od["s"] = od  # through a dict subclass too (it looped forever in a first version)
    with pytest.raises(ValueError, match=r"dict at 'r\.s' is the dict at 'r' again"):
        tc.Object({"r": od})
    shared = {"v": 1}
    assert tc.Object({"a": shared, "b": tc.Object({"c": shared})}).json() == {
        "a": {"v": 1}, "b": {"c": {"v": 1}}}


def test_deep_dicts_build_without_copying_paths_up_to_the_limit():
    import resource

    d = torch.ones(1)
    for _ in range(10000):
        d = {"k": d}
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t = ttorch.Tensor(d)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown < 256 * 1024, f"peak RSS grew {grown} KiB"  # a path copy per level: 2.5 GB
    node, depth = t.to_dict(), 0
    while isinstance(node, dict):
        assert list(node) == ["k"]
        node, depth = node["k"], depth + 1
    assert depth == 10000 and torch.equal(node, torch.ones(1))
    with pytest.raises(ValueError, match="nested deeper than 10000 levels"):
        ttorch.Tensor({"k": d})


# ---- keys changed while a call reads the tree --------------------------------------------------
def test_callback_deleting_keys_of_its_own_tree_raises():
    out = run_script("""
        import torch, treetensor.torch as ttorch
        t = ttorch.Tensor({f"k{i}": torch.ones(4) for i in range(64)})
        def cb(x):
            del t.k1
            return x
        with ttorch.stream(2):
            try:
                ttorch.apply(cb, t)
            except RuntimeError as e:
                assert "cannot change the keys at '<root>'" in str(e), str(e)
            else:
                raise AssertionError("no error")
        try:  # map's callback runs with the GIL held, on the caller: the same refusal
            t.map(cb)
        except RuntimeError as e:
            assert "map at leaf 'k0': treetensor: cannot change the keys" in str(e), str(e)
        else:
            raise AssertionError("no error from map")
        assert len(t) == 64 and "k1" in t
        del t.k1  # once the call is over
        assert len(t) == 63
        print("ok")
    """)
    assert out.strip() == "ok"


def test_keys_changed_by_another_thread_during_calls_never_crash():
    out = run_script("""
        import sys, threading, time, torch, treetensor.torch as ttorch
        # A switch at almost every bytecode, and inside torch's dealloc of a replaced or removed
        # leaf (it releases the GIL): a change must be whole before another thread reads.
        sys.setswitchinterval(1e-6)
        s = ttorch.Tensor({f"k{i}": torch.ones(64) for i in range(256)})
        stop, refused, changed = time.monotonic() + 3, [0], [0]
        def mutate():
            i = 0
            while time.monotonic() < stop:
                try:
                    setattr(s, f"n{i % 8}", torch.ones(64))
                    setattr(s, f"n{i % 8}", {"q": torch.ones(64)})  # replaces a leaf
                    delattr(s, f"n{i % 8}")
                    changed[0] += 1
                except RuntimeError as e:
                    assert "while a tree call reads this tree" in str(e), str(e)
                    refused[0] += 1
                except KeyError:
                    pass
                i += 1
        m = threading.Thread(target=mutate)
        m.start()
        with ttorch.stream(2):
            while time.monotonic() < stop:
                for r in (s + 1, ttorch.apply(lambda x: x + 1, s), s.map(lambda x: x + 1)):
                    assert all(torch.equal(r[f"k{i}"], torch.full((64,), 2.0)) for i in range(256))
        m.join()
        assert changed[0] > 0
        print("ok", refused[0], changed[0])
    """)
    assert out.startswith("ok")


# ---- asyncs job errors ------------------------------------------------------------------------
def test_synchronize_raises_unread_job_errors_once_with_the_count():
    w = asyncs.Thread("unread")

    def fail(i):
        raise ArithmeticError(f"job {i} failed")

    futs = [w.submit(fail, i) for i in range(800)]
    with pytest.raises(ArithmeticError, match="job 0 failed") as e:
        futs[0].result()  # read: not reported again
    with pytest.raises(ArithmeticError) as e:
        asyncs.synchronize()
    msg = str(e.value)
    assert msg.startswith(f"asyncs thread {w.id}, job 2: ArithmeticError: job 1 failed"), msg
    assert "and 798 more unread asyncs job error(s)" in msg, msg
    assert str(e.value.__cause__) == "job 1 failed"
    asyncs.synchronize()  # each error once
    with pytest.raises(ArithmeticError, match="job 5 failed"):
        futs[5].result()  # a future still raises its own error
    w.close()


def test_raising_futures_do_not_leak():
    w = asyncs.Thread("leak")

    def once():
        f = w.submit(lambda: 1 / 0)
        try:
            f.result()
        except ZeroDivisionError:
            pass

    for _ in range(1000):
        once()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(20000):
        once()
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    w.close()
    assert grown < 2 * 1024 * 1024, f"{grown} bytes over 20,000 raising futures"


# ---- missing attributes -------------------------------------------------------------------------
def test_missing_attribute_lists_keys_and_names_private_torch_attributes():
    t = ttorch.Tensor({f"k{i:02}": torch.ones(1) for i in range(12)})
    with pytest.raises(AttributeError) as e:
        t.c
    assert str(e.value) == ("treetensor: no key 'c' at '<root>'; available keys: {k00, k01, "
                            "k02, k03, k04, k05, k06, k07, k08, k09, ... (12 keys)}; nor is it a "
                            "name of torch.Tensor, which a tree would apply leaf-wise")
    # torch.Tensor's public names apply leaf-wise (DI-treetensor's fallback); private ones do not
    assert t.argmax().k00.item() == 0 and t.is_leaf.all()
    with pytest.raises(AttributeError, match="'_version' is a torch.Tensor attribute that tree "
                                             "tensors do not provide"):
        t._version
    assert not hasattr(t, "__array_interface__")


@pytest.mark.parametrize("make", [lambda: asyncs.thread(1), lambda: ttorch.stream(1)],
                         ids=["asyncs.thread", "stream"])
def test_exit_without_enter_is_a_runtime_error_naming_the_with_form(make):
    guard = make()
    with pytest.raises(RuntimeError, match=r"__exit__ without __enter__ on this thread \(a scope "
                                           r"ends on the thread that entered it; use it as ``with "):
        guard.__exit__(None, None, None)
    with guard:  # still usable as it should be
        r = ttorch.Tensor({"a": torch.ones(2)}) + 1
    assert torch.equal(r.a, torch.full((2,), 2.0))


def _in_force(kind):
    """What the calling thread's innermost scope of `kind` says now."""
    if kind == "stream":
        return ttorch.current_stream()
    return type(ttorch.Tensor({"a": torch.ones(2)}).sum()).__name__  # PendingTensor inside


def _scope(kind, n):
    return ttorch.stream(n) if kind == "stream" else asyncs.thread(n)


@pytest.mark.parametrize("kind", ["stream", "asyncs.thread"])
def test_a_scope_exited_before_one_entered_after_it_is_refused_and_stays_open(kind):
    """Each guard restores what it replaced: ending the outer scope first would leave the
    inner one's setting in force after both ended, so that exit is refused."""
    before = _in_force(kind)
    outer = _scope(kind, 2)  # made just before entering: a made ttorch.stream sets the mode
    outer.__enter__()
    inner = _scope(kind, 3)
    inner.__enter__()
    inside = _in_force(kind)
    with pytest.raises(RuntimeError, match=rf"treetensor: \S*{kind} scope exited out of order: "
                                           rf"1 \S+ scope\(s\) entered after it on this thread "
                                           r"are still open; exit the innermost first"):
        outer.__exit__(None, None, None)
    assert _in_force(kind) == inside  # nothing changed
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert _in_force(kind) == before
    asyncs.synchronize()


@pytest.mark.parametrize("kind", ["stream", "asyncs.thread"])
def test_one_scope_object_entered_on_two_threads_ends_each_threads_own_scope(kind):
    """A module-level scope object shared by threads: each thread's __exit__ ends the scope
    it entered, whatever order the threads exit in; another thread cannot end it."""
    import threading

    before = _in_force(kind)
    scope = _scope(kind, 2)
    entered, exited = threading.Event(), threading.Event()
    seen = {}

    def other():
        scope.__enter__()
        seen["inside"] = _in_force(kind)
        entered.set()
        exited.wait(30)
        scope.__exit__(None, None, None)
        seen["after"] = _in_force(kind)

    scope.__enter__()  # made just before: a made ttorch.stream sets the process-wide mode
    inside = _in_force(kind)
    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(30)
    scope.__exit__(None, None, None)  # the main thread's own scope, though the other's is newer
    assert _in_force(kind) == before
    with pytest.raises(RuntimeError, match=r"__exit__ without __enter__ on this thread \(a scope "
                                           r"ends on the thread that entered it"):
        scope.__exit__(None, None, None)  # the other thread's scope is not this thread's to end
    exited.set()
    t.join(30)
    assert seen == {"inside": inside, "after": before}
    asyncs.synchronize()


def test_a_scope_object_entered_again_keeps_the_process_wide_mode_set_since():
    """``ttorch.stream(n)`` sets the process-wide mode when made; its first ``__enter__`` undoes
    that (so ``with ttorch.stream(n):`` changes nothing outside), but never a mode set later."""
    before = ttorch.current_stream()
    s2 = ttorch.stream(2)
    with s2:
        assert ttorch.current_stream() == "stream(2)"
    assert ttorch.current_stream() == before
    ttorch.stream(4)
    with s2:  # entered again: the process-wide stream(4) set since stays
        pass
    assert ttorch.current_stream() == "stream(4)"
    s3 = ttorch.stream(3)
    ttorch.stream(3)  # set again since, to the same mode: the first entry must not undo it
    with s3:
        pass
    assert ttorch.current_stream() == "stream(3)"
    ttorch.stream(_parse(before))


def _parse(text):
    inner = text[text.index("(") + 1:-1]
    return int(inner) if inner.isdigit() else inner


def test_a_thread_that_ends_inside_a_scope_leaves_nothing_for_a_later_thread():
    """A thread's open scopes are its own: one that ends inside a scope does not hand it to a
    later thread, even one given the same ident, whose own scopes then end as usual."""
    import threading

    s, u = ttorch.stream(2), ttorch.stream(3)
    ttorch.stream(1)
    out = []

    def dies_in_scope():
        s.__enter__()

    def later():
        u.__enter__()
        try:
            s.__exit__(None, None, None)
            out.append("ended a scope it never entered")
        except RuntimeError as e:
            out.append(str(e))
        u.__exit__(None, None, None)
        out.append(ttorch.current_stream())

    for f in (dies_in_scope, later):
        t = threading.Thread(target=f)
        t.start()
        t.join(30)
    assert out[0].startswith("treetensor: stream.__exit__ without __enter__ on this thread")
    assert out[1] == "stream(1)"
