"""OneFlow-style asyncs threads on treetensor's runtime.

    import treetensor.asyncs as asyncs
    with asyncs.thread(1):          # tree calls of this block run on asyncs worker 1
        y = ttorch.sigmoid(x)       # pending: returns at once, the block goes on
        s = x.sum()                 # a PendingTensor, pending too (x was made before the block)
    print(float(s), y.a)            # a read waits (GIL released) for exactly its job
    asyncs.synchronize()            # every asyncs job done; raises a job's unobserved error

``thread(worker)`` takes an integer id (the same id names the same worker for the life of the
process; workers are created on first use) or a :class:`Thread`. Tree calls inside the block
are queued on that worker in FIFO order and return pending results; a leaf error is raised at
the first read with its type, the op, the leaf path and the worker ("asyncs thread <id>, job
<n>"). ``thread(worker, blocking=True)`` makes the caller wait for each call instead. Scopes
nest; the innermost wins. Only the Python thread that entered the block is affected.

After ``os.fork()`` (a DataLoader worker, multiprocessing's fork start method) the child has
none of the parent's worker threads: ``thread(k)`` starts new ones there; a :class:`Thread`
made before the fork raises RuntimeError when used (``close()`` returns at once); a job that
was still queued or running at the fork never runs in the child, and every read of its results
there raises RuntimeError saying so, as does the child's first :func:`synchronize` (for the jobs
of every parent thread; one never read is printed at exit). The parent is unaffected. Read what
a child needs, or call :func:`synchronize`, before forking.
"""
import atexit as _atexit
import copy as _copy
import os as _os
import threading as _threading
import weakref as _weakref

import torch as _torch

from . import _C, _scopes

__all__ = ["Thread", "Future", "PendingTensor", "thread", "synchronize", "current_thread_id"]


class Thread:
    """An asyncs worker thread (C++ ``asyncs::Thread``): one OS thread running jobs in FIFO
    order. ``id`` is its worker id in the pool (1..8 by default, TREETENSOR_ASYNCS_THREADS)."""

    def __init__(self, name=""):
        self._c = _C._AsyncThread(name)
        _alive.add(self)

    @property
    def id(self):
        return self._c.id

    def in_flight(self):
        """Jobs queued or running."""
        return self._c.in_flight()

    def wait_idle(self):
        """Blocks (GIL released) until every job submitted so far has run. Ctrl-C interrupts
        the wait (KeyboardInterrupt; the jobs run on)."""
        self._c.wait_idle()

    def submit(self, fn, *args, **kwargs):
        """Queues ``fn(*args, **kwargs)`` on this worker (FIFO) and returns a :class:`Future`.
        The job takes the GIL to run Python; its tree calls release it again. Blocks (GIL
        released) while the worker has too many jobs in flight (back-pressure)."""
        return Future(self._c.submit(fn, *args, **kwargs))

    def close(self):
        """Drains the worker and frees its id. Afterwards (as after
        ``concurrent.futures.Executor.shutdown``) ``submit`` and ``thread(self)`` raise
        RuntimeError, ``id`` keeps the id it had, ``in_flight()`` is 0, ``wait_idle()`` and
        ``close()`` return at once."""
        self._c.close()


class Future:
    """The outcome of :meth:`Thread.submit`."""

    def __init__(self, c):
        self._c = c
        self._outcome = None

    def done(self):
        """Whether the job has finished (never blocks)."""
        c = self._c
        return c is None or c.done()

    def result(self):
        """Waits (GIL released) and returns the job's value, or raises the exception it
        raised (the same exception object, every call)."""
        c = self._c
        if c is not None:
            # The outcome moves here and the C++ future goes: a raised exception's traceback
            # holds the frames that called result(), often with this future in them, and the
            # garbage collector can only break that cycle through Python objects.
            self._outcome = c._outcome()
            self._c = None
        del c  # the traceback holds this frame: no C++ object may stay reachable from it
        raised, value = self._outcome
        if not raised:
            return value
        try:
            raise value
        finally:
            del self, value  # no cycle through this frame (as concurrent.futures does)


def _ready(x):
    """The plain tensor a PendingTensor stands for, once its job has run (raises its error)."""
    x._tt_job.wait()  # every read: joins the job's streams, raises its error
    return x._tt_out


def _plain(x):
    if type(x) is PendingTensor:
        return _ready(x)
    if type(x) in (list, tuple):  # torch's TensorList arguments: torch.stack([s, t])
        return type(x)(_plain(v) for v in x)
    return x


def _plain_args(args, kwargs):
    return tuple(_plain(a) for a in args), ({k: _plain(v) for k, v in kwargs.items()} if kwargs else {})


class PendingTensor(_torch.Tensor):
    """A tree-level reduction's result made inside a pending scope (``t.sum()`` in ``with
    thread(k):``): a 0-d ``torch.Tensor`` of the reduction's dtype and device standing for the
    plain tensor the scope's worker fills in. Every read waits, with the GIL released, for
    exactly that job and then reads the plain tensor: a torch function or method given it
    (``__torch_function__``), anything torch's C++ does with it, such as a Scalar argument
    (``torch.full((2,), s)``, ``t.narrow(0, 0, s)``: ``__torch_dispatch__``), a conversion
    (``float``, ``int``, ``bool``, ``.item()``, ``.tolist()``, ``.numpy()``), printing,
    formatting, pickling, ``copy.deepcopy``, and a tree call given it (even in the same scope:
    it is a tensor, not a tree, so the worker cannot chain on it). If the job failed, every
    read raises its error (type, op, leaf path, "asyncs thread <id>, job <n>"). Results of
    operations on it are plain tensors (an in-place op returns the plain tensor too), and each
    goes through Python (a few µs), so keep it for reading results, not for heavy work; it
    cannot be a ``torch.nn.Parameter``'s data."""

    @staticmethod
    def _make(out, job):
        # A wrapper (no storage of its own): torch's C++ cannot read it without
        # __torch_dispatch__, so no read skips the wait.
        t = _torch.Tensor._make_wrapper_subclass(PendingTensor, out.shape, strides=out.stride(),
                                                  dtype=out.dtype, device=out.device)
        t._tt_out, t._tt_job = out, job
        return t

    # Printed, formatted, pickled and copied as the plain tensor it stands for: ``tensor(19.)``,
    # ``f"{s:.3f}"``, and a pickle or deep copy that is a torch.Tensor.
    def __repr__(self, *, tensor_contents=None):
        return repr(_ready(self))

    def __format__(self, format_spec):
        return format(_ready(self), format_spec)

    def __reduce_ex__(self, protocol):
        return _ready(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return _copy.deepcopy(_ready(self), memo)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        args, kwargs = _plain_args(args, kwargs)
        with _torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = _plain_args(args, kwargs)
        return func(*args, **kwargs)


_alive = _weakref.WeakSet()


@_atexit.register
def _close_all():
    # Drain every worker while the interpreter still runs (a job may need the GIL); at
    # finalization it no longer can.
    for t in list(_alive):
        try:
            t.close()
        except Exception:  # noqa: BLE001  (errors belong to futures and synchronize())
            pass


_workers = {}
_workers_lock = _threading.Lock()


def _after_fork_in_child():
    # The parent's workers do not exist here (asyncs::Thread, fork()): thread(k) starts new
    # ones. The lock may have been held by a thread that the fork did not copy.
    global _workers_lock
    _workers_lock = _threading.Lock()
    _workers.clear()  # their close() returns at once


_os.register_at_fork(after_in_child=_after_fork_in_child)


def _worker(key):
    with _workers_lock:
        w = _workers.get(key)
        if w is None:
            w = _workers[key] = Thread(f"python-{key}")
        return w


class thread:
    """``with thread(worker):`` runs the block's tree calls on an asyncs worker thread
    (OneFlow's ``oneflow.asyncs.thread``).

    worker: an int (a process-wide worker for that number, created on first use) or a Thread.
    The block yields the Thread.

    By default the block's tree calls are *pending*: each returns at once a tree whose content
    is made when first read (``t.a``, ``print(t)``, ``t.to_dict()``, a tree call outside the
    block or on another thread, ``synchronize()``), which waits, with the GIL released, for
    exactly the job it needs; the block's code goes on meanwhile. In-place calls leave their
    tree pending the same way. A failed call's error (its type, op, leaf path and "asyncs
    thread <id>, job <n>") is raised by every read of its result; one never read is raised by
    ``synchronize()``. Tree calls order themselves after the pending jobs whose leaves they
    touch; torch's own calls on a leaf do not: write an operand's leaf in place with torch
    (``x.a.add_(1)``) only after reading the results, or after ``synchronize()``.

    Tree-level reductions (``t.sum()``, ``mean``, ``all``, ``any``, ``min``, ``max``, ``std``
    without ``dim``) return a :class:`PendingTensor`; of a result made earlier in the block,
    they first wait for the jobs making it (its dtypes decide the result's). Calls that return
    several trees or a tensor of unknown shape (``split``/``unbind``, ``masked_select``,
    ``apply`` with a Python function) and calls autograd records into a tensor (a reduction of
    leaves that require grad) run on the worker and wait, as with ``blocking=True``, because
    their results cannot be handed out before they exist.

    blocking=True: every tree call of the block runs on the worker and the caller waits for it
    (values are ready when the call returns; errors are raised by the call itself).

    Scopes belong to the OS thread that entered them (one object may be entered on several
    threads) and end innermost first: ``__exit__`` while an ``asyncs.thread`` scope entered
    after it on the same thread is still open raises RuntimeError and leaves it open."""

    def __init__(self, worker=0, blocking=False):
        if isinstance(worker, Thread):
            self._thread = worker
        elif isinstance(worker, int) and not isinstance(worker, bool):
            self._thread = _worker(worker)
        else:
            raise TypeError(f"asyncs.thread takes an int or an asyncs.Thread, not {type(worker).__name__}")
        self._blocking = bool(blocking)
        self._guards = _scopes.Guards("asyncs.thread")

    def __enter__(self):
        self._guards.push(_C._thread_scope(self._thread._c, self._blocking))
        return self._thread

    def __exit__(self, *exc):
        self._guards.pop()
        return False


def synchronize():
    """Waits (GIL released) for every tree call and asyncs job in flight; raises the first job
    error nobody has observed yet, with its type and context ("asyncs thread <id>, job <n>"),
    the original chained as ``__cause__``, and how many more there were. Each error is
    reported once: by a ``Future.result()`` or by one synchronize(). Ctrl-C interrupts the
    wait (KeyboardInterrupt; the jobs run on, and a later synchronize() waits for them)."""
    _C.synchronize()


def current_thread_id():
    """The asyncs worker id running the calling code, or None."""
    return _C._current_thread_id()
