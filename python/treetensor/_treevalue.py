"""treevalue's tree methods on treetensor's tree classes (DI-treetensor parity: its ``Tensor``
and ``Object`` are treevalue ``FastTreeValue`` s and so have them): ``walk``, ``reduce``,
``filter``, ``mask``, ``unpack``, ``rise``, ``type``, ``clear``, ``popitem`` and the class
methods ``union``, ``subside``, ``func``; on ``Object`` also ``map``, ``clone``, ``pop``,
``setdefault``, ``update``. Keys are visited sorted (DESIGN.md §1).

Where a tree here cannot hold what treevalue's would (DESIGN.md §15): a ``Tensor`` tree's leaves
are tensors, so a result whose leaves are other values (``union``'s tuples, ``subside``'s lists)
is an ``Object``; no tree holds a dict as a leaf, so ``subside`` of a dict holding trees is a
TypeError (lists and tuples subside); ``func`` is treevalue's ``strict`` mode with ``inherit``.
"""
import copy as _copy
import inspect as _inspect
import operator as _operator
import types as _types

import torch as _torch

from . import _C, _constraint, _graph, _leafwise
from .common import Object, _foreign_dict, _with_subtrees

_Tree = _C.Tensor
_MISSING = object()


def _is_tree(x):
    return isinstance(x, (_Tree, Object))


def _as_dict(tree):
    return _Tree.to_dict(tree) if isinstance(tree, _Tree) else tree._d


def _positional(fn):
    """How many positional arguments fn takes, 0 to 2 (treevalue calls fn(value) or
    fn(value, path) by what fn accepts)."""
    try:
        params = _inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: one argument
        return 1
    n = 0
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            return 2
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty:
            n += 1
    return min(n, 2)


def _path_caller(fn):
    n = _positional(fn)
    return (lambda v, p: fn()) if n == 0 else (lambda v, p: fn(v)) if n == 1 else fn


def _describe(path):
    return ".".join(path) if path else "<root>"


# ---- instance methods ----------------------------------------------------------------------
def walk(self):
    """(path, value) pairs of every node and leaf, the root first as ``()``, then depth first in
    key order; a node's value is the tree (a view), a leaf's the leaf (treevalue's ``walk``)."""
    def go(node, path):
        yield path, node
        for k in type(node).keys(node):  # the class's: keys come before methods
            child = node[k]
            if _is_tree(child):
                yield from go(child, path + (k,))
            else:
                yield path + (k,), child

    return go(self, ())


def reduce(self, func):
    """``func(**children)`` bottom up: each node's children (leaves, or their nodes' results) as
    keyword arguments named by their keys; the root's result (treevalue's ``reduce``)."""
    def go(node):
        return func(**{k: go(v) if _is_tree(v) else v for k, v in ((k, node[k]) for k in type(node).keys(node))})

    return go(self)


def _pruned(d, keep, remove_empty, path=()):
    out = {}
    for k in sorted(d, key=str):
        v = d[k]
        if type(v) is dict:
            sub = _pruned(v, keep, remove_empty, path + (k,))
            if sub or not remove_empty:
                out[k] = sub
        elif keep(v, path + (k,)):
            out[k] = v
    return out


def filter(self, func, remove_empty=True):  # noqa: A001  (treevalue's name)
    """The tree of the leaves for which ``func(leaf)`` (or ``func(leaf, path)``) is true; nodes
    left empty are removed unless ``remove_empty=False`` (treevalue's ``filter``)."""
    call = _path_caller(func)
    return type(self)(_pruned(_as_dict(self), lambda v, p: bool(call(v, p)), remove_empty))


def mask(self, mask_, remove_empty=True):
    """The tree of the leaves whose place in ``mask_`` (a tree of bools or bool tensors; a mask
    leaf facing a subtree covers all of it) is true; nodes left empty removed unless
    ``remove_empty=False`` (treevalue's ``mask``).
    @raises KeyError naming the path when ``mask_`` lacks a key of this tree; RuntimeError
            (ValueError for a numpy array) naming it where a mask leaf is not one element."""
    m = _as_dict(mask_) if _is_tree(mask_) else mask_

    def at(path):
        node = m
        for i, k in enumerate(path):
            if type(node) is not dict:
                break
            if k not in node:
                raise KeyError(f"treetensor: mask: the mask has no key '{k}' at '{_describe(path[:i])}'")
            node = node[k]
        try:
            return bool(node)
        except (RuntimeError, ValueError) as e:  # not one element: a mask per element (torch's
            # and numpy's types kept)
            raise type(e)(f"treetensor: mask: the mask at '{_describe(path)}' is not one bool "
                          f"per leaf ({e}); to select elements use masked_select or t[mask] "
                          f"(treevalue's mask keeps or drops whole leaves)") from e

    return type(self)(_pruned(_as_dict(self), lambda v, p: at(p), remove_empty))


def unpack(self, *keys, default=_MISSING):
    """The children named by keys, as a tuple (``a, b = t.unpack('a', 'b')``); ``default`` for a
    missing key when given (treevalue's ``unpack``).
    @raises KeyError naming the key when it is missing and no default is given."""
    out = []
    for k in keys:
        if k in self:
            out.append(self[k])
        elif default is _MISSING:
            raise KeyError(f"treetensor: no key '{k}' at '{self._path or '<root>'}'"
                           if isinstance(self, _Tree) else f"treetensor: no key '{k}'")
        else:
            out.append(default)
    return tuple(out)


def _split(d, i):
    return {k: _split(v, i) for k, v in d.items()} if type(d) is dict else d[i]


def _risen(d, kinds, template):
    leaves = _leafwise._leaves(d)
    if template is None and leaves:
        first = leaves[0]
        if type(first) in kinds and all(type(x) is type(first) and len(x) == len(first) for x in leaves):
            template = type(first)([_MISSING] * len(first))
    if isinstance(template, (list, tuple)):
        return type(template)(_risen(_split(d, i), kinds, None if t is _MISSING else t)
                              for i, t in enumerate(template))
    return _leafwise.wrap(d)


def rise(self, dict_=True, list_=True, tuple_=True, template=None):
    """Lists and tuples that every leaf holds, of one type and length, rise above the tree: a
    list (tuple) of trees, recursively (treevalue's ``rise``); ``template`` (a list or tuple of
    sub-templates, None for 'as found') fixes how far. Leaves are never dicts here, so
    ``dict_`` has nothing to rise."""
    kinds = tuple(t for t, on in ((list, list_), (tuple, tuple_)) if on)
    return _risen(_as_dict(self), kinds, template)


_rise_tree = rise  # (func's argument `rise` hides the name)


def type_(self, clazz=None, *args, **kwargs):
    """``t.type(Object)``: the same tree as another tree class (treevalue's ``type``; leaves
    shared; as ``Tensor(dict)``, a Tensor converts other leaves with torch.as_tensor); any other
    argument is torch.Tensor.type leaf-wise (``t.type(torch.float64)``, an extension: treevalue
    raises TypeError there)."""
    if isinstance(clazz, type) and issubclass(clazz, (_Tree, Object)):
        return clazz(_as_dict(self))
    if isinstance(self, _Tree):
        return _leafwise.wrap(self._leaf_call(_torch.Tensor.type, (() if clazz is None else (clazz,)) + args,
                                              kwargs, "type"))
    raise TypeError(f"treetensor: {type(self).__name__}.type takes a tree class, not {clazz!r}")


def clear(self):
    """Removes every child (dict.clear)."""
    for k in list(type(self).keys(self)):  # the class's: keys come before methods
        del self[k]


def popitem(self):
    """Removes and returns the (key, child) pair of the last key in sorted order (treevalue's
    ``popitem``).
    @raises KeyError when the tree is empty."""
    keys = list(type(self).keys(self))
    if not keys:
        raise KeyError(f"popitem(): {type(self).__name__} is empty")
    k = keys[-1]
    return k, type(self).pop(self, k)


# ---- class methods -------------------------------------------------------------------------
def _result(cls, d):
    """A nested dict of results as cls when cls can hold its leaves, else the kind they make."""
    r = _leafwise.wrap(d)
    if isinstance(r, Object) and issubclass(cls, Object) and type(r) is not cls:
        return cls(_as_dict(r))
    return r


def _strict_zip(op, mode="strict", inherit=True, missing=_MISSING, delayed=False):
    """Refuses treevalue's zip options other than its defaults: the leaf-wise rules here are its
    ``strict`` mode with ``inherit`` (treetensor.common)."""
    if mode != "strict" or not inherit or missing is not _MISSING or delayed:
        raise ValueError(f"treetensor: {op} supports treevalue's 'strict' mode with inherit=True only "
                         f"(no missing=, no delayed=)")


def union(cls, *trees, return_type=None, **options):
    """A tree of tuples, one element from each tree (non-tree arguments broadcast), zipped by key
    (treevalue's ``union``). Its leaves are tuples, so it is an Object (or ``return_type``).
    @raises ValueError naming the path when key sets differ; for zip options other than
            treevalue's defaults (``mode='strict'``, ``inherit=True``)."""
    _strict_zip("union", **options)
    d, is_tree = _leafwise.call(lambda *xs: xs, trees, {}, "union")
    out = return_type or (cls if issubclass(cls, Object) else Object)
    return out(d) if is_tree else d


def subside(cls, value, dict_=True, list_=True, tuple_=True, return_type=None, **options):
    """The trees inside lists and tuples (nested) sink to the leaves: a tree whose leaves are
    those lists and tuples (treevalue's ``subside``; the same zip as every leaf-wise call).
    @raises TypeError for a dict holding trees (leaves here are never dicts: DESIGN.md §15);
            ValueError naming the path when the trees' key sets differ, for ``list_=False`` or
            ``tuple_=False`` (both always subside) and for zip options other than treevalue's
            defaults."""
    _strict_zip("subside", **options)
    if not (list_ and tuple_):
        raise ValueError("treetensor: subside: lists and tuples always subside (list_=False and "
                         "tuple_=False are not supported)")
    def has_tree(x):
        if _is_tree(x):
            return True
        if type(x) in (list, tuple):
            return any(has_tree(v) for v in x)
        if type(x) is dict:
            return any(has_tree(v) for v in x.values())
        return False

    if type(value) is dict and has_tree(value):
        raise TypeError("treetensor: subside: a dict holding trees would make dict leaves, which a "
                        "tree here cannot hold (DESIGN.md §15); pass a list or tuple of trees")
    d, is_tree = _leafwise.call(lambda v: v, (value,), {}, "subside", subside=True)
    if not is_tree:
        return value
    if return_type is not None:
        return return_type(d)
    leaves = _leafwise._leaves(d)
    # lists and tuples as leaves: an Object (wrap would rise them straight back)
    return Object(d) if leaves and type(leaves[0]) in (list, tuple) else _result(cls, d)


def func(cls, mode="strict", inherit=True, missing=_MISSING, delayed=False, subside=None, rise=None):
    """A decorator making fn leaf-wise over trees (treevalue's ``func``): results are trees of
    their kind (cls when it can hold them); ``subside=True`` zips lists of trees, ``rise=True``
    lifts tuple results.
    @raises ValueError for a mode other than 'strict', ``inherit=False``, ``missing`` or
            ``delayed`` (treevalue's other zips: not supported here)."""
    _strict_zip("func", mode, inherit, missing, delayed)

    def decorate(fn):
        def f(*args, **kwargs):
            d, is_tree = _leafwise.call(fn, args, kwargs, getattr(fn, "__name__", "func"), bool(subside))
            if not is_tree:
                return d
            r = _result(cls, d)
            if rise and _is_tree(r):
                return _rise_tree(r, **(rise if isinstance(rise, dict) else {}))
            return r

        f.__name__ = getattr(fn, "__name__", "func")
        f.__doc__ = fn.__doc__
        f.__wrapped__ = fn
        return f

    return decorate


# ---- Object's own (a tensor tree has these in treetensor.torch and its C++ map) ---------------
def _map(self, mapper, delayed=False):
    """``mapper(leaf)`` (or ``mapper(leaf, path)``, or ``mapper()``) on every leaf: a tree of the
    same class (treevalue's ``map``; ``Tensor`` trees' ``map`` makes tensor trees). Computed at
    once: ``delayed=True`` (treevalue's lazy values) gives the same tree."""
    call = _path_caller(mapper)

    def go(d, path):
        return {k: go(v, path + (k,)) if type(v) is dict else call(v, path + (k,)) for k, v in d.items()}

    return type(self)(go(self._d, ()))


def _clone(self, copy_value=None):
    """A new tree of the same structure; leaves shared unless ``copy_value`` is True (deep copies)
    or a function (applied to each leaf) (treevalue's ``clone``)."""
    copy = _copy.deepcopy if copy_value is True else copy_value if callable(copy_value) else (lambda v: v)

    def go(d):
        return {k: go(v) if type(v) is dict else copy(v) for k, v in d.items()}

    return type(self)(go(self._d))


def _pop(self, key, *default):
    """Removes the child ``key`` and returns it; ``default`` when there is none (dict.pop)."""
    if key not in self._d and default:
        return default[0]
    return self._wrap(self._d.pop(key))


def setdefault(self, key, default=None):
    """The child ``key`` (a leaf or a tree); set to ``default`` first when there is none
    (dict.setdefault). Tensor and Object trees alike."""
    if key not in self:
        self[key] = default
    return self[key]


def update(self, other=(), **kwargs):
    """Sets each child of ``other`` (a dict, a tree or (key, value) pairs) and of kwargs
    (dict.update). Tensor and Object trees alike."""
    items = type(other).items(other) if hasattr(type(other), "items") else other
    for k, v in list(items) + list(kwargs.items()):
        self[k] = v


def _is_key(d, key):
    """Whether ``o[key] = v`` sets a key of dict ``d`` (as ``o[key]`` reads one): a str, a key it
    has, any key of an empty Object, an int where it has int keys (an optimizer's state)."""
    try:
        return isinstance(key, str) or key in d or not d or (
            isinstance(key, int) and any(isinstance(k, int) for k in d))
    except TypeError:  # unhashable: a slice (Python < 3.12), a list
        return False


def _setitem(self, key, value):
    if not _is_key(self._d, key):  # an index: every leaf's leaf[key] = value (DI-treetensor)
        _leafwise.call(_operator.setitem, (self, key, value), {}, "setitem")
        return
    # a tree given as a value is a subtree, as in the constructor (Object's common._with_subtrees)
    if _is_tree(value):
        value = _as_dict(value)
    elif isinstance(value, dict):
        value = _with_subtrees(value)
    elif _foreign_dict(value) is not None:
        value = _foreign_dict(value)
    self._d[key] = value


def _delitem(self, key):
    del self._d[key]


class TorchProxy:
    """``t.torch.<name>``: torch.Tensor's method ``name`` leaf-wise, bound to the tree, even
    where a key or a tree method has that name (DI-treetensor's ``Tensor.torch``);
    ``ttorch.Tensor.torch.<name>`` is the unbound leaf-wise function."""
    __slots__ = ("_tree", "_method")

    def __init__(self, tree, method):
        self._tree, self._method = tree, method  # method: treetensor.torch's _torch_method

    def __getattr__(self, name):
        f = self._method(name)
        if f is None or (self._tree is None and not _inspect.isfunction(f)):
            raise AttributeError(f"torch.Tensor has no method '{name}'")
        if not _inspect.isfunction(f):  # a data attribute (is_cuda): its tree of values
            return f(self._tree)
        return f if self._tree is None else _types.MethodType(f, self._tree)


def _node_id(tree):
    return tree._node_id() if isinstance(tree, _Tree) else id(tree._d)


def graph(self, root=None, title=None, cfg=None, dup_value=False, repr_gen=None,
          node_cfg_gen=None, edge_cfg_gen=None):
    """A ``graphviz.Digraph`` of this tree (treevalue's ``graph``; needs the graphviz package):
    ``root`` names the root node (default ``<Tensor #id>``), ``title`` the graph (default
    ``Graph of tree <root>.``); the other options as ``graphics``."""
    root = "<%s #%x>" % (type(self).__name__, _node_id(self)) if root is None else str(root)
    return _graph.graphics(_is_tree, _node_id, (self, root), title=title or f"Graph of tree {root}.",
                           cfg=cfg, dup_value=dup_value, repr_gen=repr_gen,
                           node_cfg_gen=node_cfg_gen, edge_cfg_gen=edge_cfg_gen)


def graphics(cls, *trees, title=None, cfg=None, dup_value=False, repr_gen=None,
             node_cfg_gen=None, edge_cfg_gen=None):
    """A ``graphviz.Digraph`` of several trees, each a tree or a ``(tree, name)`` pair
    (treevalue's ``graphics``; see ``treetensor._graph`` for the options)."""
    return _graph.graphics(_is_tree, _node_id, *trees, title=title, cfg=cfg, dup_value=dup_value,
                           repr_gen=repr_gen, node_cfg_gen=node_cfg_gen, edge_cfg_gen=edge_cfg_gen)


#: The instance methods, by name. Tensor trees look them up after their keys (as DI-treetensor
#: does: a key 'mask' is ``t.mask``); Object has them as plain methods.
METHODS = {"walk": walk, "reduce": reduce, "filter": filter, "mask": mask, "unpack": unpack,
           "rise": rise, "type": type_, "clear": clear, "popitem": popitem, "graph": graph,
           "with_constraints": _constraint.with_constraints, "validate": _constraint.validate,
           "constraint": property(_constraint.constraint_of)}
#: The class methods (``ttorch.Tensor.union(a, b)``), by name.
CLASS_METHODS = {"union": union, "subside": subside, "func": func, "graphics": graphics}


def _operator_result(self, d):
    # A tree of the leaves' kind (treetensor.common's docstring: tensors make a ttorch.Tensor)
    # where they have one; else (no leaf, or leaves of no kind) the operand's own class, so a
    # subclass (tnp.ndarray among them) keeps it, as treevalue's operators keep theirs; never
    # risen into a tuple of trees.
    return _leafwise.wrap(d, rise=False, empty=type(self)._view, plain=type(self)._view)


def operator_method(fn, name, reflected=False):
    """Python operator `fn` leaf-wise as a method: ``o + x`` (``x + o`` when reflected) over
    the leaves, zipped with ``x`` where it is a tree (_operator_result says of which class)."""
    if reflected:
        def method(self, other):
            return _operator_result(self, _leafwise.call(fn, (other, self), {}, name)[0])
    else:
        def method(self, other):
            return _operator_result(self, _leafwise.call(fn, (self, other), {}, name)[0])
    method.__name__ = method.__qualname__ = name
    return method


def _inplace_operator_method(fn, name):
    # treevalue's: the results (``operator.iadd(leaf, x)``) replace the leaves of this tree,
    # once all are made; a leaf facing a subtree of ``x`` becomes that subtree of results.
    def method(self, other):
        _write_leaves(self._d, _leafwise.call(fn, (self, other), {}, name)[0])
        return self
    method.__name__ = method.__qualname__ = name
    return method


def _write_leaves(d, results):
    """Writes the leaves of nested dict `results` into `d` at their paths (a leaf of `d` facing
    a subtree of results becomes that subtree), without recursion."""
    todo = [(d, results)]
    while todo:
        dst, src = todo.pop()
        for k, v in src.items():
            if type(v) is dict and type(dst[k]) is dict:
                todo.append((dst[k], v))
            else:
                dst[k] = v


def _unary_method(fn, name):
    def method(self):
        return _operator_result(self, _leafwise.call(fn, (self,), {}, name)[0])
    method.__name__ = method.__qualname__ = name
    return method


#: Object's operators, treevalue's (DI-treetensor parity): arithmetic, bitwise and ``@``
#: leaf-wise, each with its reflected and in-place form; ``==`` stays whole-tree equality.
BINARY_OPERATORS = {"add": _operator.add, "sub": _operator.sub, "mul": _operator.mul,
                    "truediv": _operator.truediv, "floordiv": _operator.floordiv,
                    "mod": _operator.mod, "pow": _operator.pow, "matmul": _operator.matmul,
                    "and": _operator.and_, "or": _operator.or_, "xor": _operator.xor,
                    "lshift": _operator.lshift, "rshift": _operator.rshift}
UNARY_OPERATORS = {"neg": _operator.neg, "pos": _operator.pos, "invert": _operator.invert,
                   "abs": _operator.abs}  # abs: as numpy arrays and tensors take it


def _install_operators(cls):
    for name, fn in BINARY_OPERATORS.items():
        setattr(cls, f"__{name}__", operator_method(fn, f"__{name}__"))
        setattr(cls, f"__r{name}__", operator_method(fn, f"__r{name}__", reflected=True))
        inplace = getattr(_operator, f"i{name}")
        setattr(cls, f"__i{name}__", _inplace_operator_method(inplace, f"__i{name}__"))
    for name, fn in UNARY_OPERATORS.items():
        setattr(cls, f"__{name}__", _unary_method(fn, f"__{name}__"))


def install_object(cls):
    """The methods above and the operators on Object (its subclasses inherit them)."""
    _install_operators(cls)
    for name, fn in METHODS.items():
        setattr(cls, name, fn)
    for name, fn in CLASS_METHODS.items():
        setattr(cls, name, classmethod(fn))
    for name, fn in (("map", _map), ("clone", _clone), ("pop", _pop), ("setdefault", setdefault),
                     ("update", update), ("__setitem__", _setitem), ("__delitem__", _delitem)):
        setattr(cls, name, fn)
