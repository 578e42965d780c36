"""The open scopes of one scope object (``ttorch.stream``, ``asyncs.thread``), per OS thread.

One object may be entered on several threads at once (a module-level ``asyncs.thread(w)``
used by a thread pool); each thread ends only its own scopes, innermost first, since each C++
guard restores what it replaced (DESIGN.md §10).
"""
import threading as _threading


class Guards:
    """The C++ guards a scope object's ``__enter__`` made, keyed by the entering thread."""

    def __init__(self, name):
        self._name = name
        self._open = {}  # thread ident -> guards, innermost last

    def push(self, guard):
        self._open.setdefault(_threading.get_ident(), []).append(guard)

    def pop(self):
        """Ends the calling thread's innermost scope of this object.

        Raises RuntimeError when this thread has none open (``__exit__`` without
        ``__enter__``), or when a scope of the same kind entered after it on this thread is
        still open; the scope then stays open."""
        ident = _threading.get_ident()
        mine = self._open.get(ident)
        if not mine:
            raise RuntimeError(f"treetensor: {self._name}.__exit__ without __enter__ on this thread "
                               f"(use it as ``with {self._name}(...):``)")
        mine[-1].close()
        mine.pop()
        if not mine:
            del self._open[ident]
