"""``treetensor.common``: trees of arbitrary Python values (DI-treetensor's
``treetensor.common.Object``) and the leaf-wise call of any function over trees that
``treetensor.torch`` and ``treetensor.numpy`` use for every name they do not bind in C++.

The leaf-wise rules are treevalue's (DI-treetensor parity), looser than the C++ API's strict
zips (DESIGN.md §15): trees zip by key with the same key sets at every node; a non-tree
argument, and a leaf facing a subtree of another tree, broadcast into it (treevalue's
``inherit``); a list or tuple of trees given to a function is zipped as a tree of lists
(``subside``); leaf results that are tuples of the same length rise to a tuple of trees
(``rise``; torch's named tuples keep their type). The result is a tree of the leaves' kind:
``treetensor.torch.Tensor`` when every leaf is a tensor, ``treetensor.numpy.ndarray`` when
every leaf is a numpy array, else an ``Object``.

A treevalue ``TreeValue`` (DI-treetensor's trees are ones, and so are treevalue's
``FastTreeValue``) given where a dict is taken is read as its nested dict: ``Object(tv)``,
``ttorch.Tensor(tv)``, ``ttorch.zeros(tree_of_shapes)``, an operand of a tree call or of a
leaf-wise call. treevalue is never imported here: an object can only be a TreeValue once the
program has imported treevalue.
"""
import builtins as _builtins
import keyword as _keyword
import sys as _sys

from . import _C

__all__ = ["Object", "Constraint", "ValidationError", "to_constraint", "vval", "vcheck", "nval",
           "ncheck", "cleaf"]


def _key_text(k):
    """A key as Object's repr shows it: a str that is a Python identifier (not a keyword) as it
    is, any other key as its repr, so no two keys print alike (1 and '1', None and 'None')."""
    if isinstance(k, str) and k.isidentifier() and not _keyword.iskeyword(k):
        return k
    return repr(k)


class Object:
    """A tree of arbitrary Python values: attribute and item access, ``keys/values/items``
    (sorted keys), ``len``, ``in``, ``get(key, default)``, ``all()/any()`` over the leaves,
    ``==`` by structure and values, ``json()`` (the nested dict), printing in the tree layout;
    arithmetic and bitwise operators leaf-wise, zipping trees by key (``o + 1``, ``2 ** o``,
    ``o * o``, ``-o``; ``o += 1`` replaces the leaves of ``o`` itself), as treevalue's.
    ``Object(non_dict)`` is the value itself; ``Object(t)`` of a ``treetensor.torch.Tensor``
    tree is an Object over its tensors (DI-treetensor). An Object or treevalue TreeValue among a
    dict's values is a subtree, not a leaf (DI-treetensor); a tensor tree there stays a leaf, as
    ``treetensor.torch.load`` gives a checkpoint's ``model`` (DI-treetensor reads it as a subtree)."""

    # _c: treevalue's constraint of this object (treetensor/_constraint.py) or None.
    __slots__ = ("_d", "_c")

    def __new__(cls, data=None):
        if data is None:
            data = {}
        if not isinstance(data, (dict, Object, _C.Tensor)) and _foreign_dict(data) is None:
            return data
        return super().__new__(cls)

    def __init__(self, data=None):
        if data is None:
            data = {}
        if isinstance(data, Object):
            data = data._d
        elif isinstance(data, _C.Tensor):
            data = _C.Tensor.to_dict(data)
        elif isinstance(data, dict):
            data = _with_subtrees(data)
        else:
            data = _foreign_dict(data)
        object.__setattr__(self, "_d", data)
        object.__setattr__(self, "_c", None)

    @classmethod
    def _view(cls, d, c=None):
        """A tree over the dict `d` as it is (one of ours: its subtrees already dicts)."""
        t = object.__new__(cls)
        object.__setattr__(t, "_d", d)
        object.__setattr__(t, "_c", c)
        return t

    def _child(self, k):
        """The child `k`: a view (a tree over the same dict, with its part of the constraint)
        or the leaf value."""
        v = self._d[k]
        if not isinstance(v, dict):
            return v
        return self._view(v, None if self._c is None else self._c.child(k))

    def _constraint(self):
        return self._c

    def _with_constraint(self, c):
        return self._view(self._d, c)

    @classmethod
    def _wrap(cls, v):
        return cls(v) if isinstance(v, dict) else v

    def __getattribute__(self, k):
        # DI-treetensor parity (treevalue's rule): a key comes before a public method of the
        # same name (Object({'type': 'ppo'}).type is 'ppo'); private names are the package's.
        if k[:1] != "_":
            d = object.__getattribute__(self, "_d")
            if k in d:
                return object.__getattribute__(self, "_child")(k)
        return object.__getattribute__(self, k)

    def __getattr__(self, k):
        """A name that is neither a key nor a method: every leaf's attribute of that name, an
        Object of them (DI-treetensor: ``Object({'a': 'abc'}).upper()`` is ``{'a': 'ABC'}``,
        through ``__call__``). AttributeError naming the first leaf without it."""
        if k in self._d:  # a key '_x': __getattribute__ leaves private names to Python's lookup
            return self._child(k)
        if k[:1] == "_":
            raise AttributeError(f"no key '{k}' in tree (keys: {_sorted_keys(self._d)})")
        from ._leafwise import call
        try:
            return Object._wrap(call(lambda v: getattr(v, k), (self,), {}, k)[0])
        except AttributeError as e:
            raise AttributeError(f"no key '{k}' in tree (keys: {_sorted_keys(self._d)}), and {e}") \
                from None

    def __array__(self, *args, **kwargs):
        # numpy must not take a tree for a sequence of its keys (np.asarray(t) gave the keys).
        raise TypeError(f"treetensor: a tree of {len(_leaves(self._d))} leaves is not one numpy "
                        f"array: convert a leaf, or use treetensor.numpy's functions on the tree")

    def __call__(self, *args, **kwargs):
        """Calls every leaf with the arguments (trees among them zipped), an Object of the
        results (DI-treetensor's ``Object({'f': fn})(x)``)."""
        from ._leafwise import call
        return Object._wrap(call(lambda f, *a, **kw: f(*a, **kw), (self, *args), kwargs, "call")[0])

    def __getitem__(self, k):
        """``o[key]``: the child ``key``; an index that is no key (``o[0]``, ``o[1:]``) indexes
        every leaf, an Object of the results (DI-treetensor). An Object with int keys (an
        optimizer's state) takes an int as a key: a missing one is a KeyError."""
        try:
            if isinstance(k, str) or k in self._d or (
                    isinstance(k, int) and _builtins.any(isinstance(x, int) for x in self._d)):
                return self._child(k)
        except TypeError:  # unhashable: a slice (Python < 3.12), a list
            pass
        from ._leafwise import call
        return Object._wrap(call(lambda v: v[k], (self,), {}, "getitem")[0])

    def __setattr__(self, k, v):
        """``o.k = v`` sets the key ``k``, as ``o[k] = v`` (DI-treetensor)."""
        self[k] = v

    def __delattr__(self, k):
        """``del o.k`` removes the key ``k``."""
        try:
            del self[k]
        except KeyError:
            raise AttributeError(f"no key '{k}' in tree (keys: {_sorted_keys(self._d)})") from None

    def get(self, k, default=None):
        return self._child(k) if k in self._d else default

    def keys(self):
        return _sorted_keys(self._d)

    def values(self):
        return [self[k] for k in _sorted_keys(self._d)]

    def items(self):
        return [(k, self[k]) for k in _sorted_keys(self._d)]

    def __iter__(self):
        return iter(_sorted_keys(self._d))

    def __reversed__(self):
        return reversed(_sorted_keys(self._d))

    def __len__(self):
        return len(self._d)

    def __contains__(self, k):
        return k in self._d

    def to_dict(self):
        """The tree as new nested dicts, down to the leaves: a tensor tree among the values (as
        ``treetensor.torch.load`` gives a checkpoint's ``model``) is its nested dict too, so the
        result is what ``torch.load`` gives (``model.load_state_dict(ck.to_dict()['model'])``)."""
        return _plain(self._d)

    json = to_dict

    def leaves(self):
        """The leaf values in sorted-path order."""
        return _leaves(self._d)

    def all(self):
        """Whether every leaf is true (``builtins.all``; DI-treetensor's ``Object.all``)."""
        return _builtins.all(_leaves(self._d))

    def any(self):
        """Whether some leaf is true (``builtins.any``)."""
        return _builtins.any(_leaves(self._d))

    def __eq__(self, other):
        if isinstance(other, Object):
            other = other._d
        return self._d == other

    __hash__ = None

    def __reduce__(self):
        return (type(self), (self._d,))

    def __repr__(self):
        """The tree layout, one line per key in sorted order. Iterative (any depth); a subtree
        printed before (a shared one, or one that contains this tree) is named instead of
        printed again, as treevalue does."""
        out = [f"<{type(self).__name__}>"]
        seen = {id(self._d): None}  # a subtree printed -> its path link (see _describe)
        stack = [(self, _sorted_keys(self._d), 0, "", None)]
        while stack:
            node, keys, i, indent, path = stack.pop()
            if i == len(keys):
                continue
            stack.append((node, keys, i + 1, indent, path))
            k, last = keys[i], i == len(keys) - 1
            glyph, more = ("└── ", "    ") if last else ("├── ", "│   ")
            v, shown = node._child(k), _key_text(k)
            if not isinstance(v, Object):
                text = repr(v).replace("\n", "\n" + indent + more + " " * (len(shown) + 5))
                out.append(f"{indent}{glyph}{shown} --> {text}")
                continue
            out.append(f"{indent}{glyph}{shown} --> <{type(v).__name__}>")
            if id(v._d) in seen:
                where = _describe(seen[id(v._d)])
                out.append(f"{indent}{more}{' ' * (len(shown) + 5)}(the same tree as '{where}')")
            else:
                seen[id(v._d)] = (k, path)
                stack.append((v, _sorted_keys(v._d), 0, indent + more, (k, path)))
        return "\n".join(out)


def _is_foreign_tree(x):
    """Whether x is a treevalue TreeValue."""
    treevalue = _sys.modules.get("treevalue")
    return treevalue is not None and isinstance(x, treevalue.TreeValue)


_MAX_DEPTH = 10000  # as the C++ reader of nested dicts


def _foreign_dict(x):
    """The nested dict of a treevalue TreeValue (its subtrees as dicts, its leaves as they are),
    None for anything else. No recursion: any depth up to 10000 levels; deeper (a tree that
    contains itself) is a ValueError."""
    if not _is_foreign_tree(x):
        return None
    tree_value = _sys.modules["treevalue"].TreeValue
    out = {}
    todo = [(x, out, 0)]
    while todo:
        node, d, depth = todo.pop()
        if depth >= _MAX_DEPTH:
            raise ValueError(f"treetensor: a treevalue TreeValue nested deeper than {_MAX_DEPTH} "
                             "levels (one that contains itself?)")
        for k, v in tree_value.items(node):  # the class's: a key 'items' comes first there too
            if isinstance(v, tree_value):
                d[k] = {}
                todo.append((v, d[k], depth + 1))
            else:
                d[k] = v
    return out


def _describe(link):
    """The dotted path of a (key, parent link) chain; '<root>' for the root's (None)."""
    keys = []
    while link is not None:
        key, link = link
        keys.append(str(key))
    return ".".join(reversed(keys)) or "<root>"


def _cannot_enter(on_path, ident, link):
    """A walk cannot enter the dict with id `ident` at path `link`: raises the ValueError that
    names the paths, for a cycle (the dict is on the path already, `on_path` maps the ids on
    the path to their links) or else for nesting past _MAX_DEPTH levels."""
    if ident in on_path:
        raise ValueError(f"treetensor: the dict at '{_describe(link)}' is the dict at "
                         f"'{_describe(on_path[ident])}' again (a cycle): a tree cannot "
                         "contain itself")
    where = _describe(link)
    raise ValueError(f"treetensor: dicts nested deeper than {_MAX_DEPTH} levels, at "
                     f"'{where if len(where) <= 200 else where[:200] + '...'}'")


def _walk_dicts(root, visit, payload=None):
    """Calls ``visit(node, payload)`` on every dict reached from ``root``, depth first, without
    recursion; it returns the ``(key, child dict, child payload)`` triples to descend into.
    @raises ValueError naming the path where a dict contains itself (as the C++ reader's), or
    where dicts nest deeper than _MAX_DEPTH levels."""
    on_path = {}  # id of a dict being walked -> its path link
    todo = [(root, payload, None, 0)]
    while todo:
        node, payload, link, depth = todo.pop()
        if depth < 0:  # all of `node`'s children are walked
            del on_path[id(node)]
            continue
        if id(node) in on_path or depth >= _MAX_DEPTH:
            _cannot_enter(on_path, id(node), link)
        on_path[id(node)] = link
        todo.append((node, None, link, -1))
        for key, child, child_payload in visit(node, payload):
            todo.append((child, child_payload, (key, link), depth + 1))


def _subtree_types():
    treevalue = _sys.modules.get("treevalue")
    return (Object, treevalue.TreeValue) if treevalue is not None else Object


def _plain(d, path=(), open_ids=None):
    """New nested dicts of `d` (an Object's dict) down to the values torch.load gives: tensor
    trees and Objects (also inside lists and tuples, as treetensor.torch.load makes them) read
    as their dicts. A dict that contains itself is a ValueError naming where."""
    open_ids = set() if open_ids is None else open_ids
    if id(d) in open_ids:
        raise ValueError(f"treetensor: to_dict: the dict at '{'.'.join(map(str, path)) or '<root>'}'"
                         f" contains itself (a cycle)")
    if len(path) >= _MAX_DEPTH:
        raise ValueError(f"treetensor: to_dict: dicts nested deeper than {_MAX_DEPTH} levels")
    open_ids.add(id(d))

    def value(v, at):
        if isinstance(v, dict):
            return _plain(v, at, open_ids)
        if isinstance(v, Object):
            return _plain(v._d, at, open_ids)
        if isinstance(v, _C.Tensor):
            return _C.Tensor.to_dict(v)
        if type(v) in (list, tuple):
            return type(v)(value(x, at + (i,)) for i, x in enumerate(v))
        return v

    out = {k: value(v, path + (k,)) for k, v in d.items()}
    open_ids.discard(id(d))
    return out


def _with_subtrees(d):
    """`d` with every Object and treevalue TreeValue among its values, at any depth, read as a
    subtree (its nested dict), as DI-treetensor builds trees from them: `d` itself when it holds
    none, else a new dict (the dicts on the way copied). Raises as _walk_dicts."""
    trees = _subtree_types()
    # The common case (plain nested dicts) in one cheap pass; a cycle ends it at the depth limit,
    # where _walk_dicts names it.
    todo = [(d, 0)]
    while todo:
        node, depth = todo.pop()
        if depth >= _MAX_DEPTH:
            _walk_dicts(d, lambda n, _: [(k, v, None) for k, v in n.items() if isinstance(v, dict)])
            raise ValueError(f"treetensor: dicts nested deeper than {_MAX_DEPTH} levels")
        for v in node.values():
            if isinstance(v, dict):
                todo.append((v, depth + 1))
            elif isinstance(v, trees):
                return _copy_with_subtrees(d, trees)
    return d


def _copy_with_subtrees(d, trees):
    def copy(node, out):
        children = []
        for k, v in node.items():
            if isinstance(v, trees):
                v = v._d if isinstance(v, Object) else _foreign_dict(v)
            if isinstance(v, dict):
                out[k] = {}
                children.append((k, v, out[k]))
            else:
                out[k] = v
        return children

    result = {}
    _walk_dicts(d, copy, result)
    return result


def _sorted_keys(d):
    """The keys of dict `d` sorted; a file's dict with int and str keys (treetensor.torch.load)
    ints first."""
    try:
        return sorted(d)
    except TypeError:
        return sorted(d, key=lambda k: (isinstance(k, str), k))


def _leaves(d, order=_sorted_keys):
    """The leaves of nested dict `d`, depth first, each dict's keys in ``order(dict)`` (sorted
    by default: sorted-path order, as keys()), without recursion.
    @raises ValueError as _walk_dicts: a dict that contains itself, or past _MAX_DEPTH levels."""
    out = []
    on_path = {id(d): None}  # id of a dict being walked -> its path link
    todo = [(d, iter(order(d)), None)]  # a dict, its keys left, its path link
    while todo:
        node, keys, link = todo[-1]
        for k in keys:
            v = node[k]
            if type(v) is dict:
                if id(v) in on_path or len(todo) >= _MAX_DEPTH:
                    _cannot_enter(on_path, id(v), (k, link))
                on_path[id(v)] = (k, link)
                todo.append((v, iter(order(v)), (k, link)))
                break
            out.append(v)
        else:
            del on_path[id(node)]
            todo.pop()
    return out


# treevalue's tree methods (walk, reduce, filter, mask, map, union, subside, ...): defined beside
# the Tensor tree's in treetensor._treevalue, which needs the leaf-wise rules built on Object.
from . import _treevalue  # noqa: E402
from ._constraint import (Constraint, ValidationError, cleaf, ncheck, nval, to_constraint,  # noqa: E402
                          vcheck, vval)

_treevalue.install_object(Object)
