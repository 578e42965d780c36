"""``import treetensor.numpy as tnp``: trees of ``numpy.ndarray`` (DI-treetensor's
``treetensor.numpy``), as DI-engine uses them: ``tnp.array(dict)``, ``tnp.stack`` /
``tnp.concatenate`` of lists of trees, ``tnp.split``, ``t.numpy()`` of a tensor tree.

Every function and method here is numpy's applied to every leaf with treetensor.common's rules
(the calls run in Python, one per leaf, as DI-treetensor's do). Any other numpy function
(``tnp.allclose``, ``tnp.arange``, ufuncs) is numpy's, leaf-wise, giving a tree of its
results' kind; numpy's plain values (``tnp.pi``) are numpy's. Needs numpy (not a dependency of the package:
``import treetensor.numpy`` raises ImportError without it).
"""
import builtins as _builtins
import operator as _operator
import types as _types

import numpy as _np
from torch import from_numpy as _torch_from_numpy

from . import _leafwise, _treevalue
from .common import Object, _foreign_dict, _sorted_keys

__all__ = ["ndarray", "array", "all", "any", "equal", "array_equal", "stack", "concatenate", "split",
           "zeros", "ones"]


def _leaf_method(name):
    """A leaf's own method `name` called: numpy scalars (a 0-d comparison's np.bool_) have
    them too, where numpy.ndarray's unbound ones refuse them."""
    def method(x, *args, **kwargs):
        return getattr(x, name)(*args, **kwargs)

    return method


class ndarray(Object):
    """A tree of numpy arrays: keys as attributes, then numpy.ndarray's methods and attributes on
    every leaf (``t.sum()``, ``t.shape``: trees), operators leaf-wise."""

    __slots__ = ()

    def __getattr__(self, name):
        d = object.__getattribute__(self, "_d")
        if name in d or name[:1] == "_":  # a key, or Object's error for a private name
            return Object.__getattr__(self, name)
        attr = getattr(_np.ndarray, name, None)
        if attr is None:
            raise AttributeError(f"no key '{name}' in tree (keys: {_sorted_keys(d)}) and "
                                 f"numpy.ndarray has no attribute '{name}'")
        if not callable(attr):
            return _leafwise.wrap(_leafwise.call(lambda x: getattr(x, name), (self,), {}, name)[0],
                                  rise=False, empty=ndarray)
        f = _leafwise.treelized(_leaf_method(name), name, inplace=name.endswith("_"), empty=ndarray)
        return lambda *args, **kwargs: _as_ndarray(f(self, *args, **kwargs))

    def __getitem__(self, index):
        """``a['k']``: the child ``k``; any other index (ints, slices, tuples, arrays, a tree of
        them, zipped) is numpy's on every leaf (DI-treetensor)."""
        if isinstance(index, str):
            return self._child(index)
        return _as_ndarray(_leafwise.wrap(_leafwise.call(_operator.getitem, (self, index), {},
                                                         "index")[0], empty=ndarray))

    def __setitem__(self, index, value):
        """``a['k'] = v`` sets the child ``k``; any other index writes numpy's ``leaf[index] =
        value`` on every leaf in place (``value``: a number, an array or a tree, zipped)."""
        if isinstance(index, str):
            Object.__setitem__(self, index, value)
        else:
            _leafwise.call(_operator.setitem, (self, index, value), {}, "index")

    def tolist(self):
        """The leaves' ``tolist()`` (an Object)."""
        return Object(_leafwise.call(lambda x: x.tolist(), (self,), {}, "tolist")[0])

    def _total(self, fn, name, reduce, args, kwargs):
        return reduce(_leafwise._leaves(_leafwise.call(fn, (self,) + args, kwargs, name)[0]))

    def sum(self, *args, **kwargs):
        """The sum of the leaves' ``sum(...)`` (DI-treetensor)."""
        return self._total(_leaf_method("sum"), "sum", _builtins.sum, args, kwargs)

    def all(self, *args, **kwargs):
        """Whether every leaf's ``all(...)`` is true (DI-treetensor)."""
        return self._total(_leaf_method("all"), "all", _builtins.all, args, kwargs)

    def any(self, *args, **kwargs):
        """Whether some leaf's ``any(...)`` is true (DI-treetensor)."""
        return self._total(_leaf_method("any"), "any", _builtins.any, args, kwargs)

    @property
    def size(self):
        """The element count of every leaf together (DI-treetensor)."""
        return _builtins.sum(x.size for x in Object.leaves(self))

    @property
    def nbytes(self):
        """The bytes of every leaf together (DI-treetensor)."""
        return _builtins.sum(x.nbytes for x in Object.leaves(self))

    def tensor(self, *args, **kwargs):
        """A treetensor.torch.Tensor of torch.from_numpy(leaf) (memory shared), then
        ``.to(*args, **kwargs)`` when given."""
        from .torch import Tensor

        def one(x):
            t = _torch_from_numpy(x)
            return t.to(*args, **kwargs) if args or kwargs else t

        return Tensor(_leafwise.call(one, (self,), {}, "tensor")[0])


# Object's operators (treetensor._treevalue) and numpy's comparisons, leaf-wise (an array of
# booleans per leaf, where Object's == is whole-tree equality).
for _name, _fn in [("eq", _operator.eq), ("ne", _operator.ne), ("lt", _operator.lt),
                   ("le", _operator.le), ("gt", _operator.gt), ("ge", _operator.ge)]:
    setattr(ndarray, f"__{_name}__", _treevalue.operator_method(_fn, f"__{_name}__"))
ndarray.__hash__ = None
_leafwise.register_kind(_np.ndarray, ndarray)


def _as_ndarray(r):
    # numpy's functions and methods give ndarray trees whatever the leaves (DI-treetensor)
    return ndarray(r._d) if type(r) is Object else r


def _tree(x):
    # A nested dict argument is a tree here (DI-treetensor's numpy functions take dicts).
    d = x if isinstance(x, dict) else _foreign_dict(x)  # a treevalue TreeValue's too
    return x if d is None else ndarray(d)


def _function(np_fn, name, subside=False, as_ndarray=True):
    # a tree without leaves is an ndarray tree too (wrap would make it a tensor tree)
    f = _leafwise.treelized(np_fn, name, subside=subside, empty=ndarray)

    def g(*args, **kwargs):
        r = f(*[_tree(a) for a in args], **kwargs)
        return _as_ndarray(r) if as_ndarray else r

    g.__name__ = g.__qualname__ = name
    g.__doc__ = f"numpy.{name} of every leaf of its tree arguments (DI-treetensor's tnp.{name})."
    return g


array = _function(_np.array, "array")
equal = _function(_np.equal, "equal")
array_equal = _function(_np.array_equal, "array_equal")
stack = _function(_np.stack, "stack", subside=True)
concatenate = _function(_np.concatenate, "concatenate", subside=True)
zeros = _function(_np.zeros, "zeros")
ones = _function(_np.ones, "ones")
_split = _function(_np.split, "split")


def split(ary, *args, **kwargs):
    """numpy.split of every leaf, risen to a list of trees (DI-treetensor)."""
    return _split(ary, *args, **kwargs)


def all(a, *args, **kwargs):  # noqa: A001  (numpy's name)
    """numpy.all of every leaf, then whether all of them are true (one bool; DI-treetensor)."""
    r, is_tree = _leafwise.call(_np.all, (_tree(a),) + args, kwargs, "all")
    return bool(_builtins.all(_leafwise._leaves(r))) if is_tree else r


def any(a, *args, **kwargs):  # noqa: A001
    """numpy.any of every leaf, then whether any of them is true (one bool; DI-treetensor)."""
    r, is_tree = _leafwise.call(_np.any, (_tree(a),) + args, kwargs, "any")
    return bool(_builtins.any(_leafwise._leaves(r))) if is_tree else r


del _name, _fn


# ---- the fallback to numpy (DI-treetensor parity) ----------------------------------------------
_function_types = tuple({_types.FunctionType, _types.BuiltinFunctionType, _np.ufunc,
                         type(_np.concatenate), type(_np.allclose)})
_plain_types = (bool, bytearray, bytes, complex, dict, float, frozenset, int, list, range, set,
                slice, str, tuple)
_nothing = object()


def __getattr__(name):
    """``tnp.<name>`` for a numpy name this module does not define (DI-treetensor parity): a
    numpy function leaf-wise over its tree arguments (nested dicts are trees; lists of trees
    zipped; numpy's own result without a tree; cached as a module attribute), giving a tree of
    the results' kind (ndarray leaves: an ndarray tree; bools, scalars: an Object); a plain
    value of ``numpy.__all__`` (``pi``) as numpy's. Anything else (dtypes, submodules):
    AttributeError."""
    item = getattr(_np, name, _nothing) if not name.startswith("_") else _nothing
    if isinstance(item, _function_types):
        f = _function(item, name, subside=True, as_ndarray=False)
        globals()[name] = f
        return f
    if isinstance(item, _plain_types) and name in _np.__all__:
        return item
    if item is _nothing:
        raise AttributeError(f"module 'treetensor.numpy' has no attribute '{name}' (nor has numpy)")
    raise AttributeError(f"module 'treetensor.numpy' has no attribute '{name}' (numpy.{name} is a "
                         f"{type(item).__name__}, not a function: use numpy.{name})")
