"""The open scopes of one scope object (``ttorch.stream``, ``asyncs.thread``), per OS thread.

One object may be entered on several threads at once (a module-level ``asyncs.thread(w)``
used by a thread pool); each thread ends only its own scopes, innermost first, since each C++
guard restores what it replaced (DESIGN.md §10). A thread's open scopes are its own
``threading.local`` data: a thread that ends inside a scope drops them with its other
thread-local data, and a later thread (even one given the same ident) never sees them.
"""
import threading as _threading


class Guards:
    """The C++ guards a scope object's ``__enter__`` made on each thread, innermost last."""

    def __init__(self, name):
        self._name = name
        self._local = _threading.local()

    def _mine(self):
        mine = getattr(self._local, "open", None)
        if mine is None:
            mine = self._local.open = []
        return mine

    def push(self, guard):
        self._mine().append(guard)

    def pop(self):
        """Ends the calling thread's innermost scope of this object.

        Raises RuntimeError when this thread has none open (``__exit__`` without
        ``__enter__``, or on another thread than the one that entered it), or when a scope of
        the same kind entered after it on this thread is still open; the scope then stays
        open."""
        mine = self._mine()
        if not mine:
            raise RuntimeError(f"treetensor: {self._name}.__exit__ without __enter__ on this "
                               "thread (a scope ends on the thread that entered it; use it as "
                               f"``with {self._name}(...):``)")
        mine[-1].close()
        mine.pop()
