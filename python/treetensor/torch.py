"""``import treetensor.torch as ttorch``: DI-treetensor's everyday surface on treetensor's C++
core.

- ``ttorch.Tensor({'a': x, 'b': {'c': y}})`` builds a tree (torch.Tensor leaves shared, other
  leaves through torch.as_tensor); ``ttorch.Tensor(non_dict)`` is ``torch.tensor(non_dict)``.
- ``t.a.b`` / ``t['a']`` (views: assigning through them changes ``t``), ``keys() / values() /
  items()``, iteration over keys, ``len`` (children), ``'a' in t``, ``t.to_dict()``.
- Every op is leaf-wise: operators (``+ - * / // % ** @ & | ^ << >>``, reflected and in-place,
  unary ``- + ~``, comparisons give trees of bool tensors), the op table as methods and
  functions (``ttorch.sigmoid(t)``, ``t.sum()``...). A function given no tree falls back to
  the torch function of the same name.
- Tree-level reductions (``t.sum()``, ``ttorch.mean(t)``, all/any/min/max/std/norm) give one
  tensor over every element of every leaf; with ``dim=`` they are per leaf (a tree).
- Construction from trees of shapes: ``ttorch.randn({'a': (2, 3)})``, zeros/ones/full/empty/
  rand/randint, the ``*_like`` forms, ``tensor`` / ``as_tensor``.
- ``ttorch.stream(n)`` / ``ttorch.stream('auto')``: the execution mode of tree calls; called,
  it sets the process-wide mode (DI-treetensor); ``with ttorch.stream(n):`` sets it for the
  calling thread inside the block only.
- Every call doing leaf work releases the GIL. Errors are Python exceptions naming the op and
  the leaf path (structure mismatches: ValueError naming the path, argument positions and key
  sets; missing keys: KeyError/AttributeError).
"""
import torch as _torch

from . import _C

Tensor = _C.Tensor

__all__ = ["Tensor", "Size", "Object", "stream", "apply", "synchronize"]


# ---- trees of values (shape, dtype, ...) ------------------------------------------------------
class Object:
    """A tree of non-tensor values (DI-treetensor's ``ttorch.Object``): attribute and item
    access, keys/values/items, ``==`` by structure and values, printing in the tree layout."""

    __slots__ = ("_d",)

    def __init__(self, data):
        object.__setattr__(self, "_d", data.to_dict() if isinstance(data, Object) else data)

    @classmethod
    def _wrap(cls, v):
        return cls(v) if isinstance(v, dict) else v

    def __getattr__(self, k):
        try:
            return self._wrap(self._d[k])
        except KeyError:
            raise AttributeError(f"no key '{k}' in tree (keys: {sorted(self._d)})") from None

    def __getitem__(self, k):
        return self._wrap(self._d[k])

    def keys(self):
        return sorted(self._d)

    def values(self):
        return [self[k] for k in self.keys()]

    def items(self):
        return [(k, self[k]) for k in self.keys()]

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self._d)

    def __contains__(self, k):
        return k in self._d

    def to_dict(self):
        return self._d

    def __eq__(self, other):
        if isinstance(other, Object):
            other = other._d
        return self._d == other

    __hash__ = None

    def _lines(self, out, indent):
        keys = self.keys()
        for i, k in enumerate(keys):
            last = i == len(keys) - 1
            glyph = "└── " if last else "├── "
            v = self[k]
            if isinstance(v, Object):
                out.append(f"{indent}{glyph}{k} --> <{type(v).__name__}>")
                v._lines(out, indent + ("    " if last else "│   "))
            else:
                out.append(f"{indent}{glyph}{k} --> {v!r}")

    def __repr__(self):
        out = [f"<{type(self).__name__}>"]
        self._lines(out, "")
        return "\n".join(out)


class Size(Object):
    """A tree of ``torch.Size`` (``t.shape``); also accepted as a tree of shapes by the
    construction functions."""


def _prop(name, cls=Object):
    getter = getattr(Tensor, name)
    return property(lambda self: cls._wrap(getter(self)))


Tensor.shape = _prop("_shape", Size)  # a tree of torch.Size
Tensor.dtype = _prop("_dtype")  # a tree of torch.dtype
Tensor.device = _prop("_device")  # a tree of torch.device
Tensor.requires_grad = property(lambda self: Object._wrap(self._requires_grad()))


def _numel(self):
    """Tree of element counts (DI-treetensor); ``ttorch.numel(t)`` is the same."""
    return Object._wrap(self._numel())


Tensor.numel = _numel


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
Tensor.cuda = lambda self, device=None: self.to(device if device is not None else "cuda")


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
    """Whether both trees have the same structure and every leaf pair is torch.equal."""
    return _C._equal(self, other)


def _allclose(self, other, rtol=1e-5, atol=1e-8, equal_nan=False):
    return _C._allclose(self, other, rtol, atol, equal_nan)


Tensor.equal = _equal
Tensor.allclose = _allclose
Tensor.apply = lambda self, fn, *args, **kwargs: apply(fn, self, *args, **kwargs)


# ---- module functions ---------------------------------------------------------------------------
def _is_tree(x):
    return isinstance(x, (Tensor, dict))


def _export(names):
    g = globals()
    for n in names:
        g[n] = getattr(_C, n)
        __all__.append(n)


# The op table and the operator functions bound in C++ (fall back to torch without a tree).
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
        if isinstance(input, dict):
            input = Tensor(input)
        if isinstance(input, Tensor):
            return getattr(input, name)(*args, **kwargs)
        return tfn(input, *args, **kwargs)

    f.__name__ = name
    f.__doc__ = doc or f"Leaf-wise / tree-level ``{name}`` (see Tensor.{name}); torch.{name} without a tree."
    globals()[name] = f
    __all__.append(name)


for _n in ["sum", "mean", "all", "any", "min", "max", "std", "norm", "masked_select",
           "reshape", "view", "squeeze", "unsqueeze", "transpose", "permute", "flatten",
           "index_select", "split", "chunk", "unbind", "clamp", "isclose", "clone", "detach",
           "contiguous", "numel", "floor_divide"]:
    _method_fn(_n)


def equal(input, other):
    """True when both trees have the same structure and every leaf pair is equal."""
    if _is_tree(input) or _is_tree(other):
        return _C._equal(input, other)
    return _torch.equal(input, other)


def allclose(input, other, rtol=1e-5, atol=1e-8, equal_nan=False):
    if _is_tree(input) or _is_tree(other):
        return _C._allclose(input, other, rtol, atol, equal_nan)
    return _torch.allclose(input, other, rtol, atol, equal_nan)


def lerp(input, end, weight):
    if _is_tree(input) or _is_tree(end):
        return _C._lerp(input, end, weight)
    return _torch.lerp(input, end, weight)


def addcmul(input, tensor1, tensor2, *, value=1):
    if _is_tree(input) or _is_tree(tensor1) or _is_tree(tensor2):
        return _C._addcmul(input, tensor1, tensor2, value)
    return _torch.addcmul(input, tensor1, tensor2, value=value)


def addcdiv(input, tensor1, tensor2, *, value=1):
    if _is_tree(input) or _is_tree(tensor1) or _is_tree(tensor2):
        return _C._addcdiv(input, tensor1, tensor2, value)
    return _torch.addcdiv(input, tensor1, tensor2, value=value)


def cat(tensors, dim=0):
    """Leaf p of the result is torch.cat of leaf p of every tree (same structures)."""
    tensors = list(tensors)
    if tensors and _is_tree(tensors[0]):
        return _C._cat(tensors, dim)
    return _torch.cat(tensors, dim)


def stack(tensors, dim=0):
    """Leaf p of the result is torch.stack of leaf p of every tree (same structures)."""
    tensors = list(tensors)
    if tensors and _is_tree(tensors[0]):
        return _C._stack(tensors, dim)
    return _torch.stack(tensors, dim)


__all__ += ["equal", "allclose", "lerp", "addcmul", "addcdiv", "cat", "stack"]


# ---- construction -------------------------------------------------------------------------------
def _shapes(x):
    if isinstance(x, Object):
        return x.to_dict()
    return x


def _shape_arg(args):
    return len(args) == 1 and isinstance(args[0], (dict, Object))


def _factory(name):
    cfn = getattr(_C, "_" + name)
    tfn = getattr(_torch, name)

    def f(*args, **kwargs):
        if _shape_arg(args):
            return cfn(_shapes(args[0]), **kwargs)
        return tfn(*args, **kwargs)

    f.__name__ = name
    f.__doc__ = (f"``{name}(tree_of_shapes, *, dtype=None, device=None, requires_grad=False)``: a "
                 f"tree of torch.{name} leaves (DI-treetensor); plain torch.{name} otherwise.")
    globals()[name] = f
    __all__.append(name)


for _n in ["randn", "rand", "zeros", "ones", "empty"]:
    _factory(_n)


def full(size, fill_value, **kwargs):
    """A tree of torch.full leaves from a tree of shapes."""
    if isinstance(size, (dict, Object)):
        return _C._full(_shapes(size), fill_value, **kwargs)
    return _torch.full(size, fill_value, **kwargs)


def randint(*args, **kwargs):
    """``randint([low=0,] high, tree_of_shapes, *, dtype=torch.int64, device=None)``."""
    if args and isinstance(args[-1], (dict, Object)):
        if len(args) == 2:
            low, high = 0, args[0]
        elif len(args) == 3:
            low, high = args[0], args[1]
        else:
            raise TypeError("randint([low,] high, shapes)")
        return _C._randint(low, high, _shapes(args[-1]), **kwargs)
    return _torch.randint(*args, **kwargs)


def _like(name):
    cfn = getattr(_C, "_" + name)
    tfn = getattr(_torch, name)

    def f(input, *args, **kwargs):
        if _is_tree(input):
            return cfn(input, *args, **kwargs)
        return tfn(input, *args, **kwargs)

    f.__name__ = name
    f.__doc__ = f"Leaf-wise torch.{name} over a tree (structure and leaf shapes kept)."
    globals()[name] = f
    __all__.append(name)


for _n in ["zeros_like", "ones_like", "empty_like", "randn_like", "rand_like", "full_like"]:
    _like(_n)


def randint_like(input, *args, **kwargs):
    if _is_tree(input):
        low, high = (0, args[0]) if len(args) == 1 else args
        return _C._randint_like(input, low, high, **kwargs)
    return _torch.randint_like(input, *args, **kwargs)


def _map_dict(d, fn):
    return {k: _map_dict(v, fn) if isinstance(v, dict) else fn(v) for k, v in d.items()}


def tensor(data, *args, **kwargs):
    """A tree of torch.tensor(leaf) from a nested dict of values; torch.tensor otherwise."""
    if isinstance(data, dict):
        return Tensor(_map_dict(data, lambda v: _torch.tensor(v, *args, **kwargs)))
    if isinstance(data, Tensor):
        return data.clone() if not (args or kwargs) else data.clone().to(*args, **kwargs)
    return _torch.tensor(data, *args, **kwargs)


def as_tensor(data, dtype=None, device=None):
    """A tree sharing the leaves that already have dtype and device (torch.as_tensor)."""
    if isinstance(data, dict):
        data = Tensor(_map_dict(data, lambda v: _torch.as_tensor(v, dtype=dtype, device=device)))
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
    calling thread inside the block only and the previous process-wide mode stays."""

    # The process-wide mode as last set through this class (the C++ runtime reports only the
    # calling thread's mode, which a scoped guard overrides).
    _process_wide = None

    def __init__(self, mode):
        if stream._process_wide is None:
            stream._process_wide = _C.current_stream()
        self._previous = stream._process_wide
        _C.set_stream(mode)
        stream._process_wide = _C._describe_stream(mode)
        self._mode = mode
        self._guards = []

    def __enter__(self):
        # The scoped form: undo the process-wide change, install a thread-local guard.
        _C.set_stream(_parse_mode(self._previous))
        stream._process_wide = self._previous
        self._guards.append(_C._stream_guard(self._mode))
        return self

    def __exit__(self, *exc):
        self._guards.pop().close()
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


__all__ += ["current_stream"]
del _n, _name, _dt
