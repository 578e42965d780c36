"""Function helpers under DI-treetensor's names (``treetensor.utils``), for code written
against it. DI-treetensor's class- and module-building decorators (``tag_names``,
``inherit_names``, ``doc_from``, ``class_autoremove``, ...) are how it assembles its own
modules, not user API, and are not provided."""
import functools as _functools

__all__ = ["replaceable_partial", "args_mapping"]


def replaceable_partial(func, **defaults):
    """``func`` with keyword defaults that a call's own keywords override (unlike
    ``functools.partial``'s, which a call cannot replace once positional)::

        f = replaceable_partial(torch.zeros, dtype=torch.int64)
        f(2)                       # int64
        f(2, dtype=torch.float32)  # float32
    """
    @_functools.wraps(func)
    def call(*args, **kwargs):
        return func(*args, **{**defaults, **kwargs})

    return call


def args_mapping(mapper):
    """A decorator that passes every argument through ``mapper(position_or_name, value)``
    first: positional arguments by index, keywords by name."""
    def decorate(func):
        @_functools.wraps(func)
        def call(*args, **kwargs):
            return func(*(mapper(i, a) for i, a in enumerate(args)),
                        **{k: mapper(k, v) for k, v in kwargs.items()})

        return call

    return decorate
