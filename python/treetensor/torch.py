"""``import treetensor.torch as ttorch``: DI-treetensor's everyday surface on treetensor's C++
core.

- ``ttorch.Tensor({'a': x, 'b': {'c': y}})`` builds a tree (torch.Tensor leaves shared, other
  leaves through torch.as_tensor); ``ttorch.Tensor(non_dict)`` is ``torch.tensor(non_dict)``.
- ``t.a.b`` / ``t['a']`` (views: assigning through them changes ``t``), ``keys() / values() /
  items()``, iteration over keys, ``len`` (children), ``'a' in t``, ``t.to_dict()``. A key
  comes before a method or property of its name (treevalue's rule: ``t.mean`` is the child
  'mean' where there is one; ``Tensor.mean(t)`` the method), except inside a pending asyncs
  scope on a result whose job still runs (its keys are unknown until the job is done).
- Every op is leaf-wise: operators (``+ - * / // % ** @ & | ^ << >>``, reflected and in-place,
  unary ``- + ~``, comparisons give trees of bool tensors), the op registry's ops as methods and
  functions (``ttorch.sigmoid(t)``, ``t.sum()``...). A function given no tree falls back to
  the torch function of the same name.
- Reductions (sum/mean/all/any/min/max/std, masked_select) take DI-treetensor's ``reduce=``:
  without arguments one tensor over every element of every leaf (``reduce=False``: per leaf);
  with arguments (``dim=``...) per leaf, ``reduce=True`` then ignored with a UserWarning.
  ``norm`` and ``dist`` are per leaf, ``numel()`` the total (``ttorch.numel(t)`` per leaf).
- Any other torch function or torch.Tensor method or attribute is torch's, leaf-wise
  (DI-treetensor's fallback: ``t.argmax(-1)``, ``ttorch.log_softmax(t, -1)``, ``t.is_cuda``;
  rules in treetensor.common); dtypes and plain values (``ttorch.float32``) are torch's.
  Keys come before these names; a leaf facing a subtree broadcasts into it.
- treevalue's tree methods, as DI-treetensor's trees have them (``t.walk()``, ``t.reduce(fn)``,
  ``t.filter(fn)``, ``t.mask(m)``, ``t.unpack(...)``, ``t.rise()``, ``t.type(Object)``,
  ``t.torch.<method>``; ``Tensor.union/subside/func``): treetensor._treevalue, after the keys.
- Construction from trees of shapes: ``ttorch.randn({'a': (2, 3)})``, zeros/ones/full/empty/
  rand/randint, the ``*_like`` forms, ``tensor`` / ``as_tensor``.
- ``ttorch.stream(n)`` / ``ttorch.stream('auto')``: the execution mode of tree calls; called,
  it sets the process-wide mode (DI-treetensor); ``with ttorch.stream(n):`` sets it for the
  calling thread inside the block only.
- ``ttorch.load(f)`` / ``ttorch.save(obj, f)``: torch.save files through treetensor's own
  allowlisted reader and writer (no pickle code runs); dicts of tensors load as trees, other
  dicts (int keys: an optimizer's state) as ``Object`` s keeping the file's key order. A tree
  given to torch.save loads as a tree by either (it pickles as ``_tree(nested dict)``, which
  torch.load's weights-only default allows once this module is imported).
- Every call doing leaf work releases the GIL. Errors are Python exceptions naming the op and
  the leaf path (structure mismatches: ValueError naming the path, argument positions and key
  sets; missing keys: KeyError/AttributeError).
"""
import builtins as _builtins
import inspect as _inspect
import operator as _operator
import types as _types
import warnings as _warnings

import torch as _torch

from . import _C, _leafwise, _ops, _scopes, _treevalue
from .common import Object, _foreign_dict, _is_foreign_tree

Tensor = _C.Tensor
_leafwise.register_kind(_torch.Tensor, Tensor)


def _tree(d):
    """A tree from its nested dict of tensors: how a tree unpickles (pickle, copy, torch.load)."""
    return Tensor(d)


# A tree pickles as _tree(its nested dict): made whole in one call, so torch.load's default
# (weights_only=True) may read torch.save(tree, f) once this module is imported. Not the class
# itself: that would let a file make Tensor.__new__'s unmade object (NEWOBJ without a state).
Tensor.__reduce__ = lambda self: (_tree, (Tensor.to_dict(self),))
_torch.serialization.add_safe_globals([_tree])

__all__ = ["Tensor", "Size", "Object", "stream", "apply", "synchronize"]


# ---- tree data: dicts, and treevalue TreeValues read as theirs (treetensor.common) ------------
def _plain_dict(x):
    """x, or the nested dict of an Object (a treetensor.numpy tree: DI-treetensor builds tensor
    trees from them) or of a treevalue TreeValue."""
    if type(x) is dict or x is None:
        return x
    if isinstance(x, Object):
        return x._d
    d = _foreign_dict(x)
    return x if d is None else d


def _is_data_tree(x):
    """A dict, an Object or a treevalue TreeValue: a tree given as data (shapes, values)."""
    return isinstance(x, (dict, Object)) or _is_foreign_tree(x)


def _tree_arg(a):
    """A dict or a treevalue TreeValue given as an operand, as a Tensor tree; else a itself."""
    a = _plain_dict(a)
    return Tensor(a) if isinstance(a, dict) else a


def _foreign_arg(a):
    """A treevalue TreeValue as a Tensor tree; else a itself (where a dict is no tree: clamp's
    bounds are torch's, which refuse a dict, as DI-treetensor does)."""
    d = _foreign_dict(a)
    return a if d is None else Tensor(d)


# ---- trees of values (shape, dtype, ...) ------------------------------------------------------
class Size(Object):
    """A tree of ``torch.Size`` (``t.shape``); also accepted as a tree of shapes by the
    construction functions. ``Size(non_dict)`` is ``torch.Size(non_dict)`` (DI-treetensor).
    ``numel()`` and ``count(v)`` are totals over the leaves; ``index(v)`` is a tree of each
    leaf's index of v (None where a leaf lacks it; ValueError when every leaf does)."""

    __slots__ = ()

    def __new__(cls, data=None):
        if data is not None and not _is_data_tree(data):
            return _torch.Size(data)
        return object.__new__(cls)

    def __init__(self, data=None):
        super().__init__(data)
        if not _builtins.all(isinstance(v, _torch.Size) for v in Object.leaves(self)):
            object.__setattr__(self, "_d", _map_dict(self._d, _torch.Size, "Size"))

    def __getitem__(self, k):
        """``s[key]``: the child; ``s[0]`` an Object of each leaf's first dimension, ``s[1:]``
        a Size of each leaf's trailing ones (DI-treetensor)."""
        r = super().__getitem__(k)
        if type(r) is Object and _builtins.all(isinstance(v, _torch.Size) for v in Object.leaves(r)):
            return Size(r._d)
        return r

    def numel(self):
        return _builtins.sum(s.numel() for s in Object.leaves(self))

    def count(self, value):
        return _builtins.sum(s.count(value) for s in Object.leaves(self))

    def index(self, value, *args):
        def find(s):
            try:
                return s.index(value, *args)
            except ValueError:
                return None

        found = _leafwise.call(find, (self,), {}, "index")[0]
        if _builtins.all(v is None for v in _leafwise._leaves(found)):
            raise ValueError(f"Can not find {value!r} in all the sizes.")
        return Object(found)


_tree_meta_call = type(Tensor).__call__


def _construct(cls, data=None, *args, **kwargs):
    data = _plain_dict(data)
    # Tensor(dict, dtype=..., ...): torch.as_tensor(leaf, ...) of every leaf (DI-treetensor).
    if (args or kwargs) and isinstance(data, dict):
        data = _map_dict(data, lambda v: _torch.as_tensor(v, *args, **kwargs), "Tensor")
        args, kwargs = (), {}
    return _tree_meta_call(cls, data, *args, **kwargs)


type(Tensor).__call__ = _construct


def _prop(name, cls=Object):
    getter = getattr(Tensor, name)
    return property(lambda self: cls._wrap(getter(self)))


Tensor.shape = _prop("_shape", Size)  # a tree of torch.Size
Tensor.dtype = _prop("_dtype")  # a tree of torch.dtype
Tensor.device = _prop("_device")  # a tree of torch.device
Tensor.requires_grad = property(lambda self: Object._wrap(self._requires_grad()))


def _numel(self):
    """The number of elements of every leaf together (DI-treetensor's method);
    ``ttorch.numel(t)`` is each leaf's, an ``Object`` (DI-treetensor's function)."""
    return _builtins.sum(_leafwise._leaves(self._numel())) if len(self) else 0


Tensor.numel = _numel


def numel(input):
    """Each leaf's number of elements, an ``Object`` tree (DI-treetensor's function; the
    method ``t.numel()`` is their total); torch.numel without a tree."""
    if isinstance(input, (Tensor, dict)):
        return Object(_tree_arg(input)._numel())
    return _torch.numel(input)


__all__.append("numel")


def _to(self, *args, **kwargs):
    """Leaf-wise ``to(dtype)``, ``to(device)``, ``to(device, dtype)``, ``to(tensor)``, keywords
    ``dtype=``, ``device=``, ``non_blocking=``, ``copy=``."""
    dtype = kwargs.pop("dtype", None)
    device = kwargs.pop("device", None)
    for a in args:
        if isinstance(a, _torch.dtype):
            dtype = a
        elif isinstance(a, (str, _torch.device)):
            device = a
        elif isinstance(a, _torch.Tensor):
            dtype, device = a.dtype, a.device
        else:
            raise TypeError(f"to(): unsupported argument {a!r}")
    return self._to(dtype=dtype, device=device, **kwargs)


Tensor.to = _to
Tensor.cuda = lambda self, device=None: Tensor.to(self, device if device is not None else "cuda")


def _dim(self):
    """Tree of leaf dimension counts (``ndim`` is the same)."""
    return Object._wrap(_map_dict(self._shape(), len) if isinstance(self._shape(), dict) else len(self._shape()))


Tensor.dim = _dim
Tensor.ndim = property(_dim)
for _name, _dt in [("float", _torch.float32), ("double", _torch.float64), ("half", _torch.float16),
                   ("int", _torch.int32), ("long", _torch.int64), ("bool", _torch.bool),
                   ("byte", _torch.uint8), ("short", _torch.int16), ("bfloat16", _torch.bfloat16)]:
    setattr(Tensor, _name, (lambda dt: lambda self: self._to(dtype=dt))(_dt))


def _equal(self, other):
    """Whether every leaf pair is torch.equal, as :func:`equal` (one bool; DI-treetensor's
    method is its fallback to torch, an ``Object`` of per-leaf bools)."""
    return equal(self, other)


def _allclose(self, other, rtol=1e-5, atol=1e-8, equal_nan=False):
    """Whether every leaf pair is torch.allclose, as :func:`allclose`."""
    return allclose(self, other, rtol, atol, equal_nan)


Tensor.equal = _equal
Tensor.allclose = _allclose


# ---- module functions ---------------------------------------------------------------------------
def _is_tree(x):
    return isinstance(x, (Tensor, dict)) or _is_foreign_tree(x)


def _export(names):
    g = globals()
    for n in names:
        g[n] = getattr(_C, n)
        __all__.append(n)


# The op registry's functions and the operator functions bound in C++ (fall back to torch without a tree).
_export([n for n in dir(_C) if not n.startswith("_") and n not in (
    "Tensor", "from_dict", "to_dict", "set_stream", "current_stream", "synchronize", "apply")])
from_dict = _C.from_dict
to_dict = _C.to_dict
apply = _C.apply
synchronize = _C.synchronize
__all__ += ["from_dict", "to_dict"]


def _method_fn(name, doc=None):
    """A module function calling the tree method `name`, or torch.<name> without a tree."""
    tfn = getattr(_torch, name, None)

    def f(input, *args, **kwargs):
        if not isinstance(input, Tensor):
            input = _tree_arg(input)
        if isinstance(input, Tensor):
            return getattr(type(input), name)(input, *args, **kwargs)  # a key 'name' comes first on t
        if _builtins.any(_is_tree(a) for a in args) or _builtins.any(_is_tree(v) for v in kwargs.values()):
            # the tree is not the first argument (ttorch.isclose(tensor, tree))
            args = [_tree_arg(a) for a in args]
            return _leafwise.treelized(tfn, name)(input, *args, **kwargs)
        return tfn(input, *args, **kwargs)

    f.__name__ = name
    f.__doc__ = doc or f"Leaf-wise / tree-level ``{name}`` (see Tensor.{name}); torch.{name} without a tree."
    globals()[name] = f
    __all__.append(name)


for _n in ["sum", "mean", "all", "any", "min", "max", "std", "norm", "masked_select",
           "reshape", "view", "squeeze", "unsqueeze", "transpose", "permute", "flatten",
           "index_select", "split", "chunk", "unbind", "clamp", "isclose", "clone", "detach",
           "contiguous", "floor_divide"]:
    _method_fn(_n)


# ---- the fallback to torch (DI-treetensor parity) ----------------------------------------------
# A name that is neither a key nor a method of the tree: torch.Tensor's method of that name
# applied to every leaf (treetensor.common's rules: a tree of the results' kind, tuples rise,
# an in-place `_` name returns the tree itself), or for a torch.Tensor attribute (`t.is_cuda`,
# `t.T`) the tree of its values. Keys come first: `t.T` is the child 'T' when there is one.
class _Getter:
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __call__(self, tree):
        return _leafwise.wrap(tree._leaf_call(getattr, (self.name,), {}, self.name))


def _torch_method(name):
    """torch.Tensor.<name> leaf-wise as a tree method; a _Getter for a data attribute; None when
    torch.Tensor has no public attribute of that name."""
    if name.startswith("_"):
        return None
    attr = getattr(_torch.Tensor, name, None)
    if attr is None:
        return None
    if not callable(attr) or isinstance(attr, type):
        return _Getter(name)
    return _leafwise.treelized(attr, name, inplace=name.endswith("_"))


# name -> method bound by Tensor.__getattr__ in C++ after the keys: treevalue's tree methods
# (DI-treetensor parity: a key 'mask' is t.mask), then torch's leaf-wise as first used.
_attr_methods = dict(_treevalue.METHODS)
_no_attr = set()  # names torch.Tensor lacks
_nothing = object()


def _attr_fallback(tree, name):
    # The first access of a name (later ones of a method stay in C++: _attr_methods).
    if name == "torch":
        return _treevalue.TorchProxy(tree, _torch_method)
    if name in _no_attr:
        return None
    f = _torch_method(name)
    if f is None:
        _no_attr.add(name)
        return None
    if type(f) is _Getter:
        return f(tree)
    _attr_methods[name] = f
    return _types.MethodType(f, tree)


_C._set_attr_fallback(_attr_fallback, _attr_methods)


def _class_attr(cls, name):
    # ``ttorch.Tensor.<name>`` (the metaclass's __getattr__): the leaf-wise function that
    # instances bind, so ``hasattr(ttorch.Tensor, 'arctanh')`` and ``ttorch.Tensor.arctanh(t)``
    # work as in DI-treetensor; torch.Tensor's data attributes stay instance-only.
    if name == "torch":
        return _treevalue.TorchProxy(None, _torch_method)
    f = _attr_methods.get(name)
    if f is None:
        f = _torch_method(name)
        if f is None or type(f) is _Getter:
            raise AttributeError(f"type object '{cls.__name__}' has no attribute '{name}'")
        _attr_methods[name] = f
    return f


type(Tensor).__getattr__ = _class_attr
# dir(ttorch.Tensor) lists treevalue's methods, which live in _attr_methods (after the keys).
type(Tensor).__dir__ = lambda cls: sorted(set(type.__dir__(cls)) | set(_treevalue.METHODS) | {"torch"})
for _name, _fn in _treevalue.CLASS_METHODS.items():
    setattr(Tensor, _name, classmethod(_fn))


def __getattr__(name):
    """``ttorch.<name>`` for a torch name this module does not define (DI-treetensor parity): a
    torch function leaf-wise over its tree arguments (lists of trees zipped, torch's own result
    without a tree; cached as a module attribute), a torch.dtype or a plain value (``float32``,
    ``has_cuda``) as torch's. Anything else: AttributeError."""
    item = getattr(_torch, name, _nothing) if not name.startswith("_") else _nothing
    if isinstance(item, (_types.FunctionType, _types.BuiltinFunctionType)):
        f = _leafwise.treelized(item, name, subside=True, inplace=name.endswith("_"))
        globals()[name] = f
        return f
    if isinstance(item, (_torch.dtype, bool, bytearray, bytes, complex, dict, float, frozenset, int,
                         list, range, set, slice, str, tuple)):
        return item
    if item is _nothing:
        raise AttributeError(f"module 'treetensor.torch' has no attribute '{name}' (nor has torch)")
    raise AttributeError(f"module 'treetensor.torch' has no attribute '{name}' (torch.{name} is a "
                         f"{type(item).__name__}, not a function: use torch.{name})")


# ---- a leaf facing a subtree (treevalue's inherit, DI-treetensor parity) ------------------------
# The C++ ops zip strictly (DESIGN.md §2); when one refuses two trees, the operator or function
# runs again through treetensor.common's rules, where a leaf of one tree broadcasts into the
# other's subtree at the same path (other key mismatches raise the C++ ValueError). Only the
# refused call pays for it.
def _inheriting(cpp, fallback, name):
    def f(*args, **kwargs):
        try:
            return cpp(*args, **kwargs)
        except ValueError as e:
            # only a leaf facing a subtree ("... is a leaf but ... is a subtree with keys ...");
            # other mismatches keep the C++ message
            if "is a leaf but" not in str(e) or _builtins.sum(
                    _is_tree(a) for a in (*args, *kwargs.values())) < 2:
                raise
        args = [_tree_arg(a) for a in args]
        return _leafwise.wrap(_leafwise.call(fallback, args, kwargs, name)[0])

    f.__name__ = f.__qualname__ = name
    f.__doc__ = getattr(cpp, "__doc__", None)
    if isinstance(cpp, _types.FunctionType):
        f.__wrapped__ = cpp  # its signature (inspect, the stubs)
    else:
        f._binding = cpp  # the stubs read its signature from its docstring (inspect cannot)
    return f


def _leaf_facing_subtree(target, other, path=""):
    # In place, only another argument's leaf may broadcast into the target's subtree: a target
    # leaf facing a subtree would be written once per leaf of it. The path of the first such
    # leaf, or None.
    if not _is_tree(other):
        return None
    if not _is_tree(target):
        return path or "<root>"
    keys = type(target).keys(target)  # the classes': keys come before methods
    if sorted(keys) == sorted(type(other).keys(other)):
        for k in keys:
            p = _leaf_facing_subtree(target[k], other[k], f"{path}.{k}" if path else k)
            if p is not None:
                return p
    return None


def _target_covers(target, other, err):
    if _leaf_facing_subtree(target, other) is not None:
        raise err  # the C++ refusal stands


def _inheriting_inplace(cpp, fallback, name):
    def f(self, *args, **kwargs):
        try:
            return cpp(self, *args, **kwargs)
        except ValueError as e:  # refused before any leaf was written (zip_rules.hpp)
            if "is a leaf but" not in str(e):
                raise
            err = e
        args = [_tree_arg(a) for a in args]
        for a in args:
            _target_covers(self, a, err)
        _leafwise.call(fallback, [self, *args], kwargs, name)
        return self

    f.__name__ = f.__qualname__ = name
    f.__doc__ = getattr(cpp, "__doc__", None)
    return f


def _reflected(fn):
    return lambda a, b: fn(b, a)


for _name, _fn in [("add", _operator.add), ("sub", _operator.sub), ("mul", _operator.mul),
                   ("truediv", _operator.truediv), ("floordiv", _operator.floordiv),
                   ("mod", _operator.mod), ("pow", _operator.pow), ("matmul", _operator.matmul),
                   ("and", _operator.and_), ("or", _operator.or_), ("xor", _operator.xor),
                   ("lshift", _operator.lshift), ("rshift", _operator.rshift)]:
    setattr(Tensor, f"__{_name}__", _inheriting(getattr(Tensor, f"__{_name}__"), _fn, f"__{_name}__"))
    setattr(Tensor, f"__r{_name}__",
            _inheriting(getattr(Tensor, f"__r{_name}__"), _reflected(_fn), f"__r{_name}__"))
def _getitem(get):
    inheriting = _inheriting(get, _operator.getitem, "__getitem__")

    def __getitem__(self, key):  # a key (str) goes straight to C++: no broadcast to redo
        return get(self, key) if type(key) is str else inheriting(self, key)
    return __getitem__


Tensor.__getitem__ = _getitem(Tensor.__getitem__)
for _name, _fn in [("eq", _operator.eq), ("ne", _operator.ne), ("lt", _operator.lt),
                   ("le", _operator.le), ("gt", _operator.gt), ("ge", _operator.ge)]:
    setattr(Tensor, f"__{_name}__", _inheriting(getattr(Tensor, f"__{_name}__"), _fn, f"__{_name}__"))
for _name, _fn in [("add", _operator.iadd), ("sub", _operator.isub), ("mul", _operator.imul),
                   ("truediv", _operator.itruediv), ("floordiv", _operator.ifloordiv),
                   ("mod", _operator.imod), ("pow", _operator.ipow), ("and", _operator.iand),
                   ("or", _operator.ior), ("xor", _operator.ixor), ("lshift", _operator.ilshift),
                   ("rshift", _operator.irshift)]:
    setattr(Tensor, f"__i{_name}__",
            _inheriting_inplace(getattr(Tensor, f"__i{_name}__"), _fn, f"__i{_name}__"))
# The registry's ops with a scalar argument (addcmul's value, lerp's weight): the C++ forms take
# a number. A tensor (lerp's Tensor-weight overload; one that requires grad) or a tree there
# goes leaf-wise through torch's function instead, as the fallback to torch does.
_SCALAR_ARG = {**{n: ("value", None) for n in _ops.TERNARY_VALUE},
               **{n: ("weight", 2) for n in _ops.BINARY_WEIGHT}}


def _scalar_arg_signature(name, first):
    """torch's signature of a registry op with a scalar argument (the C++ binding's has none
    that inspect reads): (input, tensor1, tensor2, *, value=1) or (input, end, weight)."""
    p = _inspect.Parameter
    if name.rstrip("_") in _ops.TERNARY_VALUE:
        params = [p(first, p.POSITIONAL_OR_KEYWORD), p("tensor1", p.POSITIONAL_OR_KEYWORD),
                  p("tensor2", p.POSITIONAL_OR_KEYWORD), p("value", p.KEYWORD_ONLY, default=1)]
    else:
        params = [p(n, p.POSITIONAL_OR_KEYWORD) for n in (first, "end", "weight")]
    return _inspect.Signature(params)


def _number_or_leafwise(cpp, fallback, name, inplace=False, first="input"):
    arg, position = _SCALAR_ARG[name.rstrip("_")]

    def f(*args, **kwargs):
        v = kwargs.get(arg, args[position] if position is not None and len(args) > position else 1)
        if not (_is_tree(v) or isinstance(v, _torch.Tensor)) or (
                type(v) is _torch.Tensor and v.dim() == 0 and not v.requires_grad):
            return cpp(*args, **kwargs)
        args = [_tree_arg(a) for a in args]
        out = _leafwise.call(fallback, args, {k: _tree_arg(x) for k, x in kwargs.items()}, name)[0]
        return args[0] if inplace else _leafwise.wrap(out)

    f.__name__ = f.__qualname__ = name
    f.__doc__ = getattr(cpp, "__doc__", None)
    f.__signature__ = _scalar_arg_signature(name, first)
    return f


for _name in _SCALAR_ARG:
    setattr(Tensor, _name, _number_or_leafwise(getattr(Tensor, _name), getattr(_torch.Tensor, _name),
                                               _name, first="self"))
    setattr(Tensor, _name + "_", _number_or_leafwise(
        getattr(Tensor, _name + "_"), getattr(_torch.Tensor, _name + "_"), _name + "_", inplace=True,
        first="self"))
    globals()[_name] = _number_or_leafwise(getattr(_C, _name), getattr(_torch, _name), _name)
for _name in ["add_", "sub_", "copy_"] + [
        n + "_" for n in _ops.BINARY_SCALAR + _ops.TERNARY_VALUE + _ops.BINARY_WEIGHT]:
    setattr(Tensor, _name, _inheriting_inplace(getattr(Tensor, _name), getattr(_torch.Tensor, _name), _name))
for _name in ("add", "sub") + _ops.BINARY_SCALAR + _ops.BINARY_TENSOR + _ops.BLAS:
    globals()[_name] = _inheriting(getattr(_C, _name), getattr(_torch, _name), _name)
    # the method form (t.add(u)) as the function and the operator
    setattr(Tensor, _name, _inheriting(getattr(Tensor, _name), getattr(_torch.Tensor, _name), _name))
for _name in _ops.TERNARY_VALUE + _ops.BINARY_WEIGHT:
    globals()[_name] = _inheriting(globals()[_name], getattr(_torch, _name), _name)
# methods taking more trees than self
for _name in ("isclose", "where") + _ops.TERNARY_VALUE + _ops.BINARY_WEIGHT:
    setattr(Tensor, _name, _inheriting(getattr(Tensor, _name), getattr(_torch.Tensor, _name), _name))
globals()["where"] = _inheriting(_C.where, _torch.where, "where")


def _bounds(min, max, name):  # noqa: A002
    """clamp's bounds: a treevalue TreeValue is a tree; a dict is refused (torch.clamp refuses
    it, and so does DI-treetensor) with a TypeError saying what to pass instead."""
    for which, bound in (("min", min), ("max", max)):
        if isinstance(bound, dict):
            raise TypeError(f"treetensor: {name}: {which} is a dict, not a tree of bounds (as in "
                            f"DI-treetensor): pass ttorch.Tensor({which}), a number or a tensor")
    return _foreign_arg(min), _foreign_arg(max)


def _clamp(self, min=None, max=None):  # noqa: A002  (torch's names)
    """Every leaf clamped to [min, max] (numbers: in C++; trees of bounds: torch.clamp per leaf
    pair, a leaf bound broadcasting into a subtree; DI-treetensor)."""
    min, max = _bounds(min, max, "clamp")  # noqa: A001
    if isinstance(min, Tensor) or isinstance(max, Tensor):
        return _leafwise.wrap(_leafwise.call(_torch.clamp, (self, min, max), {}, "clamp")[0])
    return _tree_clamp(self, min, max)


def _clamp_(self, min=None, max=None):  # noqa: A002
    """In place: every leaf clamped to [min, max] (see clamp); returns the tree."""
    min, max = _bounds(min, max, "clamp_")  # noqa: A001
    if isinstance(min, Tensor) or isinstance(max, Tensor):
        for name, bound in (("min", min), ("max", max)):
            where = _leaf_facing_subtree(self, bound)
            if where is not None:
                raise ValueError(f"treetensor: clamp_: the tree has a leaf at '{where}' where "
                                 f"{name} has a subtree (a leaf would be written once per leaf "
                                 f"of it)")
        _leafwise.call(_torch.Tensor.clamp_, (self, min, max), {}, "clamp_")
        return self
    return _tree_clamp_(self, min, max)


_tree_clamp, _tree_clamp_ = Tensor.clamp, Tensor.clamp_
Tensor.clamp, Tensor.clamp_ = _clamp, _clamp_


# ---- reductions: DI-treetensor's calling convention -----------------------------------------------
def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _native_dim(name, args, kwargs):
    """(dim, keepdim) when a call's arguments are only those, in a form the C++ per-leaf
    reduction takes with torch's meaning (sum/mean/std: an int or a non-empty sequence of ints;
    all/any: one int), else None."""
    # std's second positional argument is unbiased, not keepdim (torch.Tensor.std).
    if (len(args) > (1 if name == "std" else 2) or set(kwargs) - {"dim", "keepdim"}
            or ("dim" in kwargs and args)):
        return None
    dim = args[0] if args else kwargs.get("dim")
    keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
    if "keepdim" in kwargs and len(args) > 1 or not isinstance(keepdim, bool):
        return None
    if _is_int(dim):
        return (dim, keepdim)
    ok = (name in ("sum", "mean", "std") and isinstance(dim, (tuple, list)) and dim
          and _builtins.all(_is_int(d) for d in dim))
    return (tuple(dim), keepdim) if ok else None


def _reduction(name):
    tree_level = getattr(Tensor, name)  # C++: one tensor over every element of every leaf
    per_leaf = _leafwise.treelized(getattr(_torch, name), name)
    native = name in ("sum", "mean", "all", "any", "std")  # C++ also takes (dim, keepdim)

    def method(self, *args, reduce=None, **kwargs):
        if args or kwargs:  # dim, keepdim, dtype, ...: per leaf, whatever reduce says
            if reduce:
                _warnings.warn(UserWarning(
                    f"Reduce forbidden for this case of function {name}, enablement of reduce "
                    f"option will be ignored."), stacklevel=2)
            dim = _native_dim(name, args, kwargs) if native else None
            if dim is not None:  # the same ATen call per leaf, from C++: pending in a scope
                return tree_level(self, *dim)
            return per_leaf(self, *args, **kwargs)
        if reduce is None or reduce:
            return tree_level(self)
        return per_leaf(self)

    method.__name__ = name
    method.__doc__ = (
        f"``{name}(*args, reduce=None, **kwargs)`` (DI-treetensor): without arguments, one tensor "
        f"over every element of every leaf (``reduce=False``: torch.{name} of each leaf, a tree); "
        f"with arguments (``dim=``...), torch.{name} of each leaf with them (a tree; max/min give "
        f"torch.return_types of trees), and ``reduce=True`` is ignored with a UserWarning.")
    setattr(Tensor, name, method)


for _n in ["sum", "mean", "all", "any", "min", "max", "std"]:
    _reduction(_n)
_tree_masked_select = Tensor.masked_select


def _masked_select(self, mask, reduce=None):
    """The selected elements of every leaf in one tensor (DI-treetensor; ``reduce=False``: a tree
    of per-leaf torch.masked_select)."""
    if reduce is None or reduce:
        return _tree_masked_select(self, mask)
    return _leafwise.wrap(_leafwise.call(_torch.masked_select, (self, mask), {}, "masked_select")[0])


Tensor.masked_select = _masked_select
for _n in ["dist", "squeeze_", "unsqueeze_"]:  # DI-treetensor's own methods, torch's per leaf
    setattr(Tensor, _n, _torch_method(_n))
_torch_norm = _torch_method("norm")


def _only_p(args, kwargs):
    """p as a float when a norm call has no argument but p (a number, or 'fro' meaning 2),
    else None (dim, keepdim, dtype or another p: torch's own call per leaf)."""
    if len(args) + len(kwargs) > 1 or set(kwargs) - {"p"}:
        return None
    p = args[0] if args else kwargs.get("p", "fro")
    if isinstance(p, str) and p == "fro":
        return 2.0
    return float(p) if _is_int(p) or isinstance(p, float) else None


def _norm(self, *args, **kwargs):
    """torch.Tensor.norm of every leaf (a tree; DI-treetensor). With no argument but p (a number
    or 'fro') it is the same ATen norm of each leaf run from C++: pending inside an asyncs
    scope."""
    p = _only_p(args, kwargs)
    if p is not None:
        return self._leaf_norm(p)
    return _torch_norm(self, *args, **kwargs)


Tensor.norm = _norm
Tensor.get = lambda self, key, default=None: self[key] if key in self else default
Tensor.get.__doc__ = "The child `key` (a tensor or a tree), or `default` when there is none."
def _pop(self, key, *default):
    """Removes the child `key` and returns it (a tensor or a tree); `default` when there is none
    (dict.pop; KeyError without a default)."""
    if key not in self:
        if default:
            return default[0]
        raise KeyError(f"treetensor: no key '{key}' at '{self._path or '<root>'}'")
    value = self[key]
    del self[key]  # a subtree's view keeps its node: it becomes a root of its own
    return value


Tensor.pop = _pop
Tensor.update = _treevalue.update
Tensor.setdefault = _treevalue.setdefault
Tensor.json = lambda self: Tensor.to_dict(self)
Tensor.json.__doc__ = "The nested dict of the leaf tensors (DI-treetensor's json())."

def vmap(func, *args, **kwargs):
    """torch.vmap(func, ...) applied to every leaf of its tree arguments (DI-treetensor)."""
    return _leafwise.treelized(_torch.vmap(func, *args, **kwargs), "vmap")


__all__.append("vmap")

def _tolist(self):
    """The leaves' ``tolist()`` (an Object; DI-treetensor)."""
    return Object(self._leaf_call(_torch.Tensor.tolist, (), {}, "tolist"))


def _numpy(self):
    """The leaves' ``numpy()`` (a treetensor.numpy.ndarray sharing their memory)."""
    from . import numpy as tnp
    return tnp.ndarray(self._leaf_call(_torch.Tensor.numpy, (), {}, "numpy"))


Tensor.tolist = _tolist
Tensor.numpy = _numpy

# DI-treetensor's module functions that the C++ module does not bind: torch's leaf-wise.
for _n in ["abs_", "clamp_", "sigmoid_", "round_", "floor_", "ceil_", "neg_", "exp_", "exp2_",
           "sqrt_", "log_", "log2_", "log10_", "detach_", "dist", "sort"]:
    if _n not in globals():
        __getattr__(_n)
        __all__.append(_n)


def _all_leaves(cpp, fn, name, input, other, *args):
    """One bool over trees: ``cpp`` (the C++ comparison) for two trees of one structure; else
    ``fn`` over the leaves zipped as DI-treetensor's ``func_treelize`` zips them (a tensor, or
    a leaf facing a subtree, broadcast into it), all of them; different keys are False."""
    if _is_tree(input) and _is_tree(other):
        if cpp(input, other, *args):
            return True
        a, b = _tree_arg(input), _tree_arg(other)
        if _C.tree_flatten(a)[1] == _C.tree_flatten(b)[1]:
            return False
    try:
        d = _leafwise.call(lambda x, y: fn(x, y, *args), (_tree_arg(input), _tree_arg(other)),
                           {}, name)[0]
    except ValueError as e:  # different keys; a leaf's own error (its path after the op) stays
        if not str(e).startswith(f"treetensor: {name}: the trees differ at "):
            raise
        return False
    return _builtins.all(_leafwise._leaves(d))


def equal(input, other):
    """True when every leaf pair is torch.equal: trees of one structure, or (DI-treetensor's
    ``equal``) a tensor or a leaf facing a subtree broadcast into it; False for different keys.
    Both plain tensors: torch.equal."""
    if _is_tree(input) or _is_tree(other):
        return _all_leaves(_C._equal, _torch.equal, "equal", input, other)
    return _torch.equal(input, other)


def allclose(input, other, rtol=1e-5, atol=1e-8, equal_nan=False):
    """True when every leaf pair is torch.allclose, broadcast as :func:`equal`'s. One bool
    (DI-treetensor, which has no allclose of its own, gives an ``Object`` of per-leaf bools
    through its fallback to torch)."""
    if _is_tree(input) or _is_tree(other):
        return _all_leaves(_C._allclose, _torch.allclose, "allclose", input, other, rtol, atol,
                           equal_nan)
    return _torch.allclose(input, other, rtol, atol, equal_nan)


def _sequence_of_trees(tensors, name):
    """`tensors` as a list; a single tree (whose iteration gives its keys) is a TypeError."""
    if _is_tree(tensors):
        raise TypeError(f"{name}: expects a list or tuple of trees or tensors, as torch.{name} "
                        f"does ({name}([t, u], dim)), got a single {type(tensors).__name__} tree")
    return list(tensors)


def _join(name, cpp, fn, tensors, dim):
    tensors = _sequence_of_trees(tensors, name)
    if not _builtins.any(_is_tree(x) for x in tensors):
        return fn(tensors, dim)
    try:
        return cpp(tensors, dim)
    except ValueError as e:  # a tensor, or a leaf facing a subtree: broadcast into it (inherit)
        if "is a leaf but" not in str(e):
            raise
    args = [_tree_arg(x) for x in tensors]
    return _leafwise.wrap(_leafwise.call(lambda *xs: fn(list(xs), dim), args, {}, name)[0])


def cat(tensors, dim=0):
    """Leaf p of the result is torch.cat of leaf p of every tree; a tensor among them, or a
    leaf facing another's subtree, joins every leaf there (DI-treetensor's inherit)."""
    return _join("cat", _C._cat, _torch.cat, tensors, dim)


def stack(tensors, dim=0):
    """Leaf p of the result is torch.stack of leaf p of every tree; a tensor among them, or a
    leaf facing another's subtree, joins every leaf there (DI-treetensor's inherit)."""
    return _join("stack", _C._stack, _torch.stack, tensors, dim)


__all__ += ["equal", "allclose", "cat", "stack"]


# ---- construction -------------------------------------------------------------------------------
def _shapes(x):
    if isinstance(x, Object):
        return Object.to_dict(x)
    return _plain_dict(x)


def _shape_arg(args):
    return len(args) == 1 and _is_data_tree(args[0])


def _define(name, f, doc):
    """f as this module's function `name` (exported), with `doc`."""
    f.__name__, f.__doc__ = name, doc
    globals()[name] = f
    __all__.append(name)


def _factory(name):
    cfn = getattr(_C, "_" + name)
    tfn = getattr(_torch, name)

    def f(*args, **kwargs):
        if _shape_arg(args):
            return cfn(_shapes(args[0]), **kwargs)
        return tfn(*args, **kwargs)

    _define(name, f, f"``{name}(tree_of_shapes, *, dtype=None, device=None, "
                     f"requires_grad=False)``: a tree of torch.{name} leaves (DI-treetensor); "
                     f"plain torch.{name} otherwise.")


for _n in ["zeros", "ones", "empty"]:
    _factory(_n)


# Random trees: one torch call per leaf on the calling thread, in flatten (sorted-key) order, so
# that after torch.manual_seed(s) leaf k holds what the k-th torch call would (DI-treetensor
# parity: {'a': (3,)} gives torch.randn(3)'s values) whatever the stream mode, and generator=
# works as torch's. The C++ API draws one seed per leaf instead (construct.hpp).
def _random_leaves(shapes, fill, name):
    def in_order(d):  # a str key sorts as the tree sorts it; Tensor() names a non-str one
        return {k: in_order(d[k]) if isinstance(d[k], dict) else d[k] for k in sorted(d, key=str)}
    return Tensor(_map_dict(in_order(shapes), lambda s: fill((s,) if isinstance(s, int) else s),
                            name))


def _random_factory(name):
    tfn = getattr(_torch, name)

    def f(*args, **kwargs):
        if _shape_arg(args):
            return _random_leaves(_shapes(args[0]), lambda s: tfn(s, **kwargs), name)
        return tfn(*args, **kwargs)

    _define(name, f, f"``{name}(tree_of_shapes, *, generator=None, dtype=None, device=None, "
                     f"requires_grad=False)``: a tree of torch.{name} leaves made in sorted-key "
                     f"order (after torch.manual_seed, the values of torch.{name} calls in that "
                     f"order, as DI-treetensor); plain torch.{name} otherwise.")


for _n in ["randn", "rand"]:
    _random_factory(_n)


def full(size, fill_value, **kwargs):
    """A tree of torch.full leaves from a tree of shapes."""
    if _is_data_tree(size):
        return _C._full(_shapes(size), fill_value, **kwargs)
    return _torch.full(size, fill_value, **kwargs)


def randint(*args, **kwargs):
    """``randint([low=0,] high, tree_of_shapes, *, generator=None, dtype=torch.int64,
    device=None)``: a tree of torch.randint leaves made in sorted-key order (after
    torch.manual_seed, the values of torch.randint calls in that order); plain torch.randint
    otherwise."""
    if args and _is_data_tree(args[-1]):
        if len(args) == 2:
            low, high = 0, args[0]
        elif len(args) == 3:
            low, high = args[0], args[1]
        else:
            raise TypeError("randint([low,] high, shapes)")
        return _random_leaves(_shapes(args[-1]),
                              lambda s: _torch.randint(low, high, s, **kwargs), "randint")
    return _torch.randint(*args, **kwargs)


def _like(name):
    cfn = getattr(_C, "_" + name)
    tfn = getattr(_torch, name)

    def f(input, *args, **kwargs):
        if _is_tree(input):
            return cfn(input, *args, **kwargs)
        return tfn(input, *args, **kwargs)

    _define(name, f, f"Leaf-wise torch.{name} over a tree (structure and leaf shapes kept).")


for _n in ["zeros_like", "ones_like", "empty_like", "full_like"]:
    _like(_n)


def _random_like(name):
    tfn = getattr(_torch, name)

    def f(input, *args, **kwargs):
        if not _is_tree(input):
            return tfn(input, *args, **kwargs)
        leaves, spec = _C.tree_flatten(input)  # sorted-key order, as the random trees above
        return _C.tree_unflatten(spec, [tfn(x, *args, **kwargs) for x in leaves])

    _define(name, f, f"Leaf-wise torch.{name} over a tree, one call per leaf in sorted-key "
                     f"order (DI-treetensor's values after torch.manual_seed; generator= as "
                     f"torch's).")


for _n in ["randn_like", "rand_like", "randint_like"]:
    _random_like(_n)


def _map_dict(d, fn, name="treetensor", path=()):
    """fn over the leaves of the nested dict d; a leaf's exception keeps its type, with the op
    and the leaf's path prepended (as leaf-wise calls do)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = _map_dict(v, fn, name, path + (str(k),))
            continue
        try:
            out[k] = fn(v)
        except Exception as e:  # noqa: BLE001  (re-raised with its type and the path)
            new = _leafwise._leaf_error(name, _leafwise._describe(path + (str(k),)), e)
            if new is e:
                raise
            raise new from e
    return out


def tensor(data, *args, **kwargs):
    """A tree of torch.tensor(leaf) from a nested dict of values; torch.tensor otherwise."""
    data = _plain_dict(data)
    if isinstance(data, dict):
        return Tensor(_map_dict(data, lambda v: _torch.tensor(v, *args, **kwargs), "tensor"))
    if isinstance(data, Tensor):
        copy = Tensor.clone(data)  # the class's: a key 'clone' comes first on data
        return copy if not (args or kwargs) else Tensor.to(copy, *args, **kwargs)
    return _torch.tensor(data, *args, **kwargs)


def as_tensor(data, dtype=None, device=None):
    """A tree sharing the leaves that already have dtype and device (torch.as_tensor)."""
    data = _plain_dict(data)
    if isinstance(data, dict):
        data = Tensor(_map_dict(data, lambda v: _torch.as_tensor(v, dtype=dtype, device=device),
                                "as_tensor"))
    if isinstance(data, Tensor):
        return _C._as_tensor(data, dtype=dtype, device=device)
    return _torch.as_tensor(data, dtype=dtype, device=device)


__all__ += ["full", "randint", "randint_like", "tensor", "as_tensor"]


# ---- execution mode -----------------------------------------------------------------------------
class stream:
    """The execution mode of tree calls (DI-treetensor's ``ttorch.stream``).

    ``ttorch.stream(n)`` spreads the leaf work of each tree call over n lanes (the calling
    thread plus n-1 workers; n=1 is linear), ``ttorch.stream('auto')`` lets treetensor's policy
    pick per call; results are the same in every mode and need no synchronize. Called as a
    statement it sets the process-wide mode; as ``with ttorch.stream(n):`` it applies to the
    calling thread inside the block only and the previous process-wide mode stays. Scoped
    forms end innermost first on the thread that entered them: ``__exit__`` while a stream
    scope entered after it on that thread is still open raises RuntimeError, leaving it open."""

    # The process-wide mode as last set through this class (the C++ runtime reports only the
    # calling thread's mode, which a scoped guard overrides).
    _process_wide = None
    _made = 0  # objects made so far: each one set the process-wide mode

    def __init__(self, mode):
        if stream._process_wide is None:
            stream._process_wide = _C.current_stream()
        self._undo = stream._process_wide  # what the first __enter__ puts back (see there)
        _C.set_stream(mode)
        stream._process_wide = _C._describe_stream(mode)
        stream._made += 1
        self._number = stream._made
        self._mode = mode
        self._guards = _scopes.Guards("stream")

    def __enter__(self):
        # The scoped form installs a thread-local guard. Its first entry also undoes the
        # process-wide change this object's construction made, unless a later object set the
        # mode since (``with ttorch.stream(n):`` as a whole leaves the process-wide mode as it
        # was).
        if self._undo is not None:
            if stream._made == self._number:
                _C.set_stream(_parse_mode(self._undo))
                stream._process_wide = self._undo
            self._undo = None
        self._guards.push(_C._stream_guard(self._mode))
        return self

    def __exit__(self, *exc):
        self._guards.pop()
        return False

    def __repr__(self):
        return f"ttorch.stream({self._mode!r})"


def _parse_mode(text):
    # "stream(2)" / "stream(automatic)" / "stream(fused)" -> the set_stream argument
    inner = text[text.index("(") + 1:-1]
    if inner == "automatic":
        return "auto"
    if inner == "fused":
        return "fused"
    return int(inner)


def current_stream():
    """The calling thread's mode as text, e.g. 'stream(2)'."""
    return _C.current_stream()


def stream_call(func, *args, **kwargs):
    """``func(*args, **kwargs)`` (DI-treetensor's ``ttorch.stream_call``, which its functions
    call per leaf). DI-treetensor issues each such call on the next of its ``stream(n)`` CUDA
    streams without any wait, so a result read on another stream can race; here it runs on the
    caller's current stream: tree calls already spread their leaves over lanes, each lane with
    its own stream and the waits that make that safe (DESIGN.md §7, §15)."""
    return func(*args, **kwargs)


__all__ += ["current_stream", "stream_call"]

# ---- files ------------------------------------------------------------------------------------


def _utf8(k):
    """Whether str k is valid UTF-8 text, as a tree key must be (a pickled str may hold a lone
    surrogate, which an Object keeps as a key)."""
    try:
        k.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _trees(x):
    # A dict of str keys holding only tensors and such dicts becomes a Tensor tree; any other
    # dict an Object (its keys, their types and order kept); lists, tuples and sets their items.
    if isinstance(x, dict):
        items = type(x)((k, _trees(v)) for k, v in x.items())
        tensors = _builtins.all(isinstance(k, str) and _utf8(k)
                                and isinstance(v, (_torch.Tensor, Tensor)) for k, v in items.items())
        return Tensor(dict(items)) if tensors else Object(items)
    if isinstance(x, (list, tuple, set)) and not hasattr(x, "_fields"):
        return type(x)(_trees(v) for v in x)
    return x


def _file_arg(f, mode):
    # A path (str, bytes or os.PathLike) as str, or None for a binary file object (torch.load /
    # torch.save accept both).
    import os
    if isinstance(f, (str, bytes, os.PathLike)):
        path = os.fsdecode(f)
        if "\x00" in path:
            raise ValueError("embedded null byte")  # as open() and torch.load raise it
        return path
    if hasattr(f, "read" if mode == "r" else "write"):
        return None
    raise TypeError(f"treetensor.torch.{'load' if mode == 'r' else 'save'}: f must be a path or "
                    f"a binary file object, not {type(f).__name__}")


def _shown(path):
    """A path for messages: its bytes that are not UTF-8 as \\xNN (the C++ errors' form)."""
    import os
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def load(f, map_location=None, *, weights_only=True, mmap=False, tree=True):
    """Reads a ``torch.save`` file (the zip or the legacy format) with treetensor's own
    allowlisted reader (C++, DESIGN.md §11): no pickle code runs; what it accepts and refuses is
    what ``torch.load(weights_only=True)`` does, and every size and offset is checked.

    ``f``: a path or a binary file object (read whole, then parsed). ``map_location``: None (the
    CPU, for a tensor saved from a GPU too, where torch.load restores it there), a device or its
    name; ``"meta"`` reads the structure alone (no tensor data), for files
    larger than memory. ``mmap=True`` (a path only): tensors view a copy-on-write mapping.

    With ``tree=False`` the result is ``torch.load(f, weights_only=True)``'s: dicts and
    OrderedDicts with their str and int keys in the file's order, lists, tuples, Python values,
    tensors and ``nn.Parameter`` s. With ``tree=True`` (the default) each dict with str keys
    holding only tensors (and such dicts) is a ``Tensor`` tree (keys as in the file: a state
    dict's ``'conv1.weight'`` is one key; sorted, as every tree), and any other dict a
    ``treetensor.common.Object`` keeping its keys' types and file order (``to_dict()``): a
    training checkpoint reads as ``ck.model.fc.weight``... ``ck.optimizer.state[0].exp_avg``.

    Raises FileNotFoundError (PermissionError, ...: the OSError of looking the path up) as
    torch.load does; RuntimeError naming the file, the byte offset and what was expected for a
    malformed, truncated or refused file (a global outside the allowlist is named); ValueError for
    ``weights_only=False`` (running a file's pickle code is torch.load's) and, with
    ``tree=True``, for a file nested deeper than Python's recursion limit; TypeError for a
    ``map_location`` that is a dict or a function."""
    if not weights_only:
        raise ValueError("treetensor.torch.load reads with an allowlist, as "
                         "torch.load(weights_only=True); torch.load(weights_only=False) runs the "
                         "file's pickle code")
    if callable(map_location) or isinstance(map_location, dict):
        raise TypeError("treetensor.torch.load: map_location must be None, a torch.device or a "
                        "device name (not a dict or a function)")
    path = _file_arg(f, "r")
    if path is None:
        if mmap:
            raise ValueError("treetensor.torch.load: mmap=True needs a path, not a file object")
        import tempfile
        with tempfile.NamedTemporaryFile(suffix=".pt") as tmp:
            tmp.write(f.read())
            tmp.flush()
            try:
                obj = _C._load(tmp.name, map_location, False, name=f"the file object {f!r}")
            except RuntimeError as e:  # name what the caller gave, not our copy of it
                raise RuntimeError(str(e).replace(tmp.name, f"the file object {f!r}")) from None
    else:
        import os
        os.stat(path)  # FileNotFoundError / PermissionError as torch.load's open() raises them
        obj = _C._load(os.fsencode(path), map_location, mmap, name=_shown(path))
    if not tree:
        return obj
    try:
        return _trees(obj)
    except RecursionError:
        raise ValueError(f"treetensor.torch.load: {_shown(path) if path else 'the file object'} "
                         "nests its lists and dicts deeper than Python's recursion limit lets "
                         "tree=True rebuild them; tree=False reads it as torch.load does") from None


def save(obj, f):
    """Writes ``obj`` as ``torch.save(obj, f)`` does (the zip format; ``torch.load`` with
    ``weights_only=True`` reads it back) through treetensor's C++ writer: atomic for a path (a
    reader sees the old file or the new one; a symlink's file is replaced so, the link kept),
    written in place as torch.save does for a FIFO, a device (``/dev/null``) or a file with
    other hard links; tensors sharing a storage written once.

    ``obj``: a ``Tensor`` tree (written as nested dicts, sorted keys), a ``treetensor.common.Object``
    (its dict), or dicts (str or int keys, in their order), OrderedDicts, lists, tuples and sets
    of these, of tensors (``nn.Parameter`` kept) and of None, bool, int, float, complex, str,
    bytes, torch.dtype, torch.device. ``f``: a path or a binary file object.

    Raises TypeError naming the path of a value or key the format cannot hold (a key that is not
    str or int, an object of another class); RuntimeError naming the file when it cannot be
    written (the old file is then kept)."""
    import os
    path = _file_arg(f, "w")
    if path is not None:
        _C._save(obj, os.fsencode(path))  # the file system's bytes: any name Linux allows
        return
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        name = os.path.join(tmp, "obj.pt")
        try:
            _C._save(obj, name)
        except RuntimeError as e:  # name what the caller gave, not our copy of it (as load)
            raise RuntimeError(str(e).replace(name, f"the file object {f!r}")) from None
        with open(name, "rb") as src:
            f.write(src.read())


__all__ += ["load", "save"]

#: DI-treetensor's ``ttorch.funcs``: the module's functions (``funcs.__all__``).
funcs = _types.ModuleType("treetensor.torch.funcs", "treetensor.torch's functions (DI-treetensor's funcs).")
funcs.__all__ = [n for n in dict.fromkeys(__all__) if n not in ("Tensor", "Size", "Object", "stream")]
for _n in funcs.__all__:
    setattr(funcs, _n, globals()[_n])
del _n, _name, _dt
