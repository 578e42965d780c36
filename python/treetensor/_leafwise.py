"""Leaf-wise calls of any Python function over trees, with treevalue's rules (DI-treetensor
parity; the rules are in treetensor.common's docstring). Used for every torch / numpy name
that treetensor does not bind in C++: the calls run on the calling thread with the GIL held,
one Python call per leaf, as DI-treetensor's do.
"""
from . import _C
from .common import Object, _foreign_dict, _is_foreign_tree

_Tree = _C.Tensor
_kinds = {}  # leaf type -> tree class, filled by treetensor.torch and treetensor.numpy


def register_kind(leaf_type, tree_class):
    """Results whose leaves are all `leaf_type` become `tree_class` trees."""
    _kinds[leaf_type] = tree_class


def tree_dict(x):
    """The nested dict of a tree argument, None for anything else."""
    if isinstance(x, _Tree):
        return x.to_dict()
    if isinstance(x, Object):
        return x._d
    return _foreign_dict(x)  # a treevalue TreeValue, or None


class _Slot:
    """Where a tree argument goes in a leaf call (its index among the trees)."""
    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i


class _Seq:
    """A list or tuple holding trees (subsided: zipped as a tree of sequences)."""
    __slots__ = ("kind", "items")

    def __init__(self, kind, items):
        self.kind, self.items = kind, items


def _fill(a, leaves):
    t = type(a)
    if t is _Slot:
        return leaves[a.i]
    if t is _Seq:
        return a.kind(_fill(x, leaves) for x in a.items)
    return a


def _describe(path):
    return ".".join(map(str, path)) if path else "<root>"


def _key_sets(a, b):
    """Two nodes' keys for a message: sorted, ints first (a file's dicts mix int and str keys),
    each as its repr where some key is no str (so 1 and '1' differ)."""
    shown = str if all(isinstance(k, str) for k in (*a, *b)) else repr

    def text(keys):
        return "{" + ", ".join(map(shown, sorted(keys, key=lambda k: (isinstance(k, str), k)))) + "}"
    return text(a), text(b)


def _leaf_error(name, path, e):
    """e's type with the op and leaf path prepended (the caller chains it to e), or e when its
    type cannot be built from one message."""
    try:
        return type(e)(f"{name} at leaf '{_describe(path)}': {e}")
    except Exception:  # noqa: BLE001  (a type with another constructor: raise e itself)
        return e


def call(fn, args, kwargs, name, subside=False):
    """fn over the leaves of the trees among args and kwargs: a nested dict of leaf results,
    or fn's own result when no argument is a tree. Returns (result, is_tree).
    @raises ValueError naming the path and argument positions when key sets differ;
            a leaf's exception keeps its type, with the op and leaf path prepended."""
    trees = []

    def mark(a):
        d = tree_dict(a)
        if d is not None:
            trees.append(d)
            return _Slot(len(trees) - 1)
        if subside and type(a) in (list, tuple):
            items = [mark(x) for x in a]
            if any(type(x) in (_Slot, _Seq) for x in items):
                return _Seq(type(a), items)
        return a

    targs = [mark(a) for a in args]
    tkw = {k: mark(v) for k, v in kwargs.items()}
    if not trees:
        return fn(*args, **kwargs), False

    def walk(nodes, path):
        keys = None
        for i, n in enumerate(nodes):
            if type(n) is dict:
                if keys is None:
                    keys, first = n.keys(), i
                elif n.keys() != keys:
                    mine, theirs = _key_sets(keys, n)
                    raise ValueError(
                        f"treetensor: {name}: the trees differ at '{_describe(path)}': tree argument "
                        f"{first} has keys {mine}, tree argument {i} has keys {theirs}")
        if keys is None:
            try:
                return fn(*[_fill(a, nodes) for a in targs], **{k: _fill(v, nodes) for k, v in tkw.items()})
            except Exception as e:  # noqa: BLE001  (re-raised with its type and the path)
                new = _leaf_error(name, path, e)
                if new is e:
                    raise
                raise new from e
        return {k: walk([n[k] if type(n) is dict else n for n in nodes], path + (k,)) for k in keys}

    return walk(trees, ()), True


def _rise(d, leaves):
    """A tuple (of the leaves' tuple type) of trees when every leaf is a tuple or list of one
    length; None otherwise."""
    first = leaves[0]
    kind = type(first)
    # tuples, lists and torch.return_types (struct sequences); not torch.Size (a tuple's subclass)
    if not (kind is tuple or kind is list or hasattr(kind, "n_fields")) or any(
            type(x) is not kind or len(x) != len(first) for x in leaves):
        return None

    def part(n, i):
        return {k: part(v, i) for k, v in n.items()} if type(n) is dict else n[i]

    # (struct sequences, too, are built from one sequence)
    return kind([wrap(part(d, i)) for i in range(len(first))])


def wrap(d, rise=True, empty=_Tree):
    """A nested dict of leaf results as a tree of their kind (treetensor.common docstring);
    ``rise=False``: tuples stay leaves (an attribute's value, as ``shape``); ``empty(d)`` makes
    a tree without leaves."""
    if type(d) is not dict:
        return d
    leaves = _leaves(d)
    if not leaves:
        return empty(d)
    kind = type(leaves[0])
    cls = _kinds.get(kind)
    if cls is None:
        for t, c in _kinds.items():
            if isinstance(leaves[0], t):
                cls, kind = c, t
                break
    if cls is not None and all(isinstance(x, kind) for x in leaves):
        return cls(d)
    risen = _rise(d, leaves) if rise else None
    if risen is not None:
        return risen
    return Object(d)


def _leaves(d):
    out = []
    for v in d.values():
        if type(v) is dict:
            out += _leaves(v)
        else:
            out.append(v)
    return out


def _more_trees(args, kwargs, subside):
    """Whether an argument after the first is (or, subsided, may hold) a tree."""
    for a in (*args[1:], *kwargs.values()):
        if isinstance(a, (_Tree, Object)) or _is_foreign_tree(a) or (subside and type(a) in (list, tuple)):
            return True
    return False


def treelized(fn, name, subside=False, inplace=False):
    """fn leaf-wise: f(*args, **kwargs) gives fn's own result without tree arguments, else the
    tree of leaf results (wrap); an in-place name (`abs_`) returns its first tree argument."""
    def f(*args, **kwargs):
        if args and type(args[0]) is _Tree and (len(args) == 1 and not kwargs
                                                or not _more_trees(args, kwargs, subside)):
            # one tree, first: the leaf loop in C++ (Tensor._leaf_call), a tree back directly
            r = args[0]._leaf_call(fn, args[1:], kwargs, name)
            return args[0] if inplace else wrap(r)
        r, is_tree = call(fn, args, kwargs, name, subside)
        if not is_tree:
            return r
        if inplace:
            for a in args:
                if tree_dict(a) is not None:
                    return a
        return wrap(r)

    f.__name__ = f.__qualname__ = name
    f.__doc__ = (f"``{name}`` leaf-wise over trees (DI-treetensor's fallback to torch): "
                 f"{getattr(fn, '__module__', None) or 'torch'}.{name} on every leaf; "
                 "without a tree argument, the function itself.")
    return f
