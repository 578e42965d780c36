"""Leaf-wise calls of any Python function over trees, with treevalue's rules (DI-treetensor
parity; the rules are in treetensor.common's docstring). Used for every torch / numpy name
that treetensor does not bind in C++: the calls run on the calling thread with the GIL held,
one Python call per leaf, as DI-treetensor's do.
"""
from . import _C
from .common import _MAX_DEPTH, Object, _cannot_enter, _foreign_dict, _is_foreign_tree
from .common import _describe as _describe_link
from .common import _leaves as _dict_leaves

_Tree = _C.Tensor
_kinds = {}  # leaf type -> tree class, filled by treetensor.torch and treetensor.numpy


def register_kind(leaf_type, tree_class):
    """Results whose leaves are all `leaf_type` become `tree_class` trees."""
    _kinds[leaf_type] = tree_class


def tree_dict(x):
    """The nested dict of a tree argument, None for anything else."""
    if isinstance(x, _Tree):
        return _Tree.to_dict(x)  # the class's: a key 'to_dict' comes before the method
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


def _leaf_error(name, where, e):
    """e's type with the op and the leaf's dotted path `where` prepended (the caller chains it
    to e), or e when its type cannot be built from one message."""
    try:
        return type(e)(f"{name} at leaf '{where}': {e}")
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

    return _walk(fn, targs, tkw, trees, name), True


def _walk(fn, targs, tkw, trees, name):
    """call()'s walk: fn over the zipped leaves of `trees` (a leaf of one facing a subtree of
    another is broadcast into it), depth first in key order as a recursive walk would call
    it, but without recursion, so any depth works; also refuses a first tree that contains
    itself and one deeper than _MAX_DEPTH (ValueError naming the path)."""
    out = {}
    on_path = {}  # id of a first-tree dict being walked -> its path link
    todo = [(trees, None, out, None)]
    while todo:
        nodes, link, parent, key = todo.pop()
        if parent is None:  # every child of the dict with id `key` is walked
            del on_path[key]
            continue
        keys, first = None, None
        for i, n in enumerate(nodes):
            if type(n) is dict:
                if keys is None:
                    keys, first = n.keys(), i
                elif n.keys() != keys:
                    mine, theirs = _key_sets(keys, n)
                    raise ValueError(
                        f"treetensor: {name}: the trees differ at '{_describe_link(link)}': tree "
                        f"argument {first} has keys {mine}, tree argument {i} has keys {theirs}")
        if keys is None:
            try:
                parent[key] = fn(*[_fill(a, nodes) for a in targs],
                                 **{k: _fill(v, nodes) for k, v in tkw.items()})
            except Exception as e:  # noqa: BLE001  (re-raised with its type and the path)
                new = _leaf_error(name, _describe_link(link), e)
                if new is e:
                    raise
                raise new from e
            continue
        ident = id(nodes[first])
        if ident in on_path or len(on_path) >= _MAX_DEPTH:
            _cannot_enter(on_path, ident, link)
        on_path[ident] = link
        node = parent[key] = dict.fromkeys(keys)  # filled in key order as the children are walked
        todo.append((None, None, None, ident))
        if len(nodes) == 1:
            d = nodes[0]
            todo += [([d[k]], (k, link), node, k) for k in reversed(keys)]
        else:
            todo += [([n[k] if type(n) is dict else n for n in nodes], (k, link), node, k)
                     for k in reversed(keys)]
    return out[None]


def _map(d, f):
    """The nested dict `d` with f(leaf) for each leaf, without recursion."""
    out = {}
    todo = [(d, out)]
    while todo:
        src, dst = todo.pop()
        for k, v in src.items():
            if type(v) is dict:
                dst[k] = {}
                todo.append((v, dst[k]))
            else:
                dst[k] = f(v)
    return out


def _rise(d, leaves):
    """A tuple (of the leaves' tuple type) of trees when every leaf is a tuple or list of one
    length; None otherwise."""
    first = leaves[0]
    kind = type(first)
    # tuples, lists and torch.return_types (struct sequences); not torch.Size (a tuple's subclass)
    if not (kind is tuple or kind is list or hasattr(kind, "n_fields")) or any(
            type(x) is not kind or len(x) != len(first) for x in leaves):
        return None

    # (struct sequences, too, are built from one sequence)
    return kind([wrap(_map(d, lambda x, i=i: x[i])) for i in range(len(first))])


def wrap(d, rise=True, empty=_Tree, plain=Object):
    """A nested dict of leaf results as a tree of their kind (treetensor.common docstring);
    ``rise=False``: tuples stay leaves (an attribute's value, as ``shape``); ``empty(d)`` makes
    a tree without leaves, ``plain(d)`` one whose leaves have no kind (an Object)."""
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
    return plain(d)


def _leaves(d):
    """The leaves of nested dict `d`, depth first in key order, without recursion.
    @raises ValueError naming the paths for a dict that contains itself."""
    return _dict_leaves(d, list)


def _more_trees(args, kwargs, subside):
    """Whether an argument after the first is (or, subsided, may hold) a tree."""
    for a in (*args[1:], *kwargs.values()):
        if isinstance(a, (_Tree, Object)) or _is_foreign_tree(a) or (subside and type(a) in (list, tuple)):
            return True
    return False


def treelized(fn, name, subside=False, inplace=False, empty=_Tree):
    """fn leaf-wise: f(*args, **kwargs) gives fn's own result without tree arguments, else the
    tree of leaf results (wrap; `empty(d)` a result without leaves); an in-place name (`abs_`)
    returns its first tree argument."""
    def f(*args, **kwargs):
        if args and type(args[0]) is _Tree and (len(args) == 1 and not kwargs
                                                or not _more_trees(args, kwargs, subside)):
            # one tree, first: the leaf loop in C++ (Tensor._leaf_call), a tree back directly
            r = args[0]._leaf_call(fn, args[1:], kwargs, name)
            return args[0] if inplace else wrap(r, empty=empty)
        r, is_tree = call(fn, args, kwargs, name, subside)
        if not is_tree:
            return r
        if inplace:
            for a in args:
                if tree_dict(a) is not None:
                    return a
        return wrap(r, empty=empty)

    f.__name__ = f.__qualname__ = name
    f.__doc__ = (f"``{name}`` leaf-wise over trees (DI-treetensor's fallback to torch): "
                 f"{getattr(fn, '__module__', None) or 'torch'}.{name} on every leaf; "
                 "without a tree argument, the function itself.")
    return f
