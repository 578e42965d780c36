"""treevalue's constraints for our trees (``t.with_constraints(c)``, ``t.constraint``,
``t.validate()``; the constructors are exported by ``treetensor.common``).

A constraint is attached to a tree object by ``with_constraints`` (a new object over the same
tree: keys and leaves are shared, as treevalue's storage is) and checked only by ``validate()``,
never by ops or assignments (treevalue's rule). Views carry the part that concerns them:
``t.b.constraint`` is the constraint of key ``b`` (a dict constraint's entry, plus every value
constraint, which holds for all leaves below). Results of ops, copies and pickles have none. A
tensor tree object is not seen by Python's cycle collector, so a constraint whose function
refers to its own tree keeps that tree alive.

What ``to_constraint`` takes: None (no constraint); a type (every leaf an instance of it); a
dict of key -> constraint (a node with those children, each checked against its entry; a key
the tree lacks is not an error); a list or tuple of constraints (all of them); a constraint.
The constructors: ``vval(fn)`` (fn(leaf) must not raise), ``vcheck(fn)`` (fn(leaf) must be
true), ``nval(fn)`` / ``ncheck(fn)`` (the same for the node itself), ``cleaf()`` (the node is
a leaf). ``validate()`` raises :class:`ValidationError` naming the constraint, the position (a
tuple of keys) and the error the check raised (DI-treetensor 0.5.0 exports these methods but
drops the constraint of its Tensor trees: DESIGN.md §15).
"""
__all__ = ["Constraint", "ValidationError", "to_constraint", "vval", "vcheck", "nval", "ncheck",
           "cleaf"]


class ValidationError(Exception):
    """A tree failed its constraint: ``args`` is (tree, error, position, constraint), as
    treevalue's; the message names the constraint, the position and the error."""

    def __init__(self, tree, error, position, constraint):
        super().__init__(tree, error, position, constraint)
        self.tree, self.error, self.position, self.constraint = tree, error, position, constraint

    def __str__(self):
        return (f"Validation failed on {self.constraint!r} at position {self.position}\n"
                f"{type(self.error).__name__}: {self.error}")


class _Failed(Exception):
    """A check's failure on its way up to validate(), which names the whole tree."""


def _is_tree(x):
    from ._treevalue import _is_tree as is_tree
    return is_tree(x)


class Constraint:
    """The base: ``validate(value)`` raises the first failure as a ValidationError; ``child(key)``
    is what holds for the child ``key`` (None: nothing). ``check(value, path)`` is the walk
    under it, which reports a failure to ``validate`` by raising the internal ``_Failed``."""

    def check(self, value, path=()):
        raise NotImplementedError

    def child(self, key):
        return None

    def validate(self, value):
        """Raises ValidationError (with `value` as its tree) when `value`, a tree or a leaf,
        fails this constraint; the check's own error is its ``__cause__``."""
        try:
            self.check(value, ())
        except _Failed as f:
            error, position, constraint = f.args
            raise ValidationError(value, error, position, constraint) from error

    def _key(self):
        return ()

    def __eq__(self, other):
        return type(other) is type(self) and other._key() == self._key()

    def __hash__(self):
        return hash((type(self), self._key()))

    def _fail(self, value, path, error):
        raise _Failed(error, tuple(path), self)


class EmptyConstraint(Constraint):
    def check(self, value, path=()):
        pass

    def __repr__(self):
        return "<EmptyConstraint>"


class _LeafWise(Constraint):
    """A constraint on every leaf value below the node (treevalue's value constraints):
    ``check_one(leaf)`` raises what is wrong with one leaf."""

    def check(self, value, path=()):
        if _is_tree(value):
            for k, v in type(value).items(value):  # the class's: a key 'items' comes first
                self.check(v, (*path, k))
            return
        try:
            self.check_one(value)
        except Exception as e:  # noqa: BLE001  (the check's own error, kept as the cause)
            self._fail(value, path, e)

    def child(self, key):
        return self


class _NodeWise(Constraint):
    """A constraint on the node it is attached to, not on its children: ``check_one(node)``."""

    def check(self, value, path=()):
        try:
            self.check_one(value)
        except Exception as e:  # noqa: BLE001
            self._fail(value, path, e)


class TypeConstraint(_LeafWise):
    def __init__(self, type_):
        self.type = type_

    def check_one(self, value):
        if not isinstance(value, self.type):
            raise TypeError(f"Invalid type, {self.type!r} expected but {type(value)!r} found - {value!r}.")

    def _key(self):
        return (self.type,)

    def __repr__(self):
        return f"<TypeConstraint {self.type!r}>"


class _UserFunction:
    """A user's function as the check (``vval``/``nval``: it must not raise; ``vcheck``/
    ``ncheck``, ``must_be_true``: its result must be true), named in messages by ``name``."""

    must_be_true = False

    def __init__(self, fn, name=None):
        self.fn = fn
        self.name = name or f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    def check_one(self, x):
        result = self.fn(x)  # a vval function's result is not looked at
        if self.must_be_true and not result:
            raise AssertionError(f"Check of {self.name!r} failed.")

    def _key(self):
        return (self.fn, self.name)

    def __repr__(self):
        return f"<{type(self).__name__} {self.name}>"


class ValueValidateConstraint(_UserFunction, _LeafWise):
    pass


class ValueCheckConstraint(_UserFunction, _LeafWise):
    must_be_true = True


class NodeValidateConstraint(_UserFunction, _NodeWise):
    pass


class NodeCheckConstraint(_UserFunction, _NodeWise):
    must_be_true = True


class LeafConstraint(_NodeWise):
    def check_one(self, node):
        if _is_tree(node):
            raise TypeError(f"Tree leaf expected, but node found:\n{node!r}")

    def __repr__(self):
        return "<LeafConstraint>"


class TreeConstraint(Constraint):
    """Children by key: {key: constraint}."""

    def __init__(self, children):
        for k in children:
            if not isinstance(k, str):
                raise TypeError(f"Invalid constraint - key {k!r} of a dict constraint is not a str "
                                f"(tree keys are strings).")
        self.children = dict(sorted(children.items()))

    def check(self, value, path=()):
        if not _is_tree(value):
            self._fail(value, path, TypeError(f"Tree node expected, but value {value!r} found."))
        for k, c in self.children.items():
            if k in value:
                c.check(value[k], (*path, k))

    def child(self, key):
        return self.children.get(key)

    def _key(self):
        return tuple(self.children.items())

    def __repr__(self):
        return f"<TreeConstraint {tuple(self.children.items())!r}>"


class CompositeConstraint(Constraint):
    """All of `parts`."""

    def __init__(self, parts):
        self.parts = tuple(parts)

    def check(self, value, path=()):
        for c in self.parts:
            c.check(value, path)

    def child(self, key):
        return _combine([c.child(key) for c in self.parts])

    def _key(self):
        return self.parts

    def __repr__(self):
        return f"<CompositeConstraint {self.parts!r}>"


_EMPTY = EmptyConstraint()


def _combine(parts):
    """The constraint of all `parts` (None and empty ones dropped, composites flattened): None
    when nothing is left."""
    flat = []
    for c in parts:
        if c is None or isinstance(c, EmptyConstraint):
            continue
        for p in (c.parts if isinstance(c, CompositeConstraint) else (c,)):
            if p not in flat:
                flat.append(p)
    if not flat:
        return None
    return flat[0] if len(flat) == 1 else CompositeConstraint(flat)


def to_constraint(c):
    """A constraint from None, a type, a dict, a list or tuple of those, or a constraint.
    @raises TypeError for anything else."""
    if c is None:
        return _EMPTY
    if isinstance(c, Constraint):
        return c
    if isinstance(c, type):
        return TypeConstraint(c)
    if isinstance(c, dict):
        children = {k: to_constraint(v) for k, v in c.items()}
        return TreeConstraint({k: v for k, v in children.items() if not isinstance(v, EmptyConstraint)})
    if isinstance(c, (list, tuple)):
        return _combine([to_constraint(x) for x in c]) or _EMPTY
    raise TypeError(f"Invalid constraint - {c!r}.")


def vval(fn, name=None):
    """Every leaf: fn(leaf) must not raise (``name``: how messages call the check; default: fn's module and name)."""
    return ValueValidateConstraint(fn, name)


def vcheck(fn, name=None):
    """Every leaf: fn(leaf) must be true (``name``: how messages call the check; default: fn's module and name)."""
    return ValueCheckConstraint(fn, name)


def nval(fn, name=None):
    """The node itself: fn(node) must not raise (``name``: how messages call the check; default: fn's module and name)."""
    return NodeValidateConstraint(fn, name)


def ncheck(fn, name=None):
    """The node itself: fn(node) must be true (``name``: how messages call the check; default: fn's module and name)."""
    return NodeCheckConstraint(fn, name)


def cleaf():
    """The node is a leaf, not a tree."""
    return LeafConstraint()


# ---- the tree methods (installed by treetensor._treevalue) -------------------------------------
def constraint_of(tree):
    """This tree's constraint (``<EmptyConstraint>`` when it has none)."""
    return tree._constraint() or _EMPTY


def with_constraints(self, constraint, clear=False):
    """This tree with `constraint` added to its own (``clear=True``: instead of its own), as a
    new object over the same keys and leaves (treevalue's ``with_constraints``). Nothing is
    checked until ``validate()``. @raises TypeError for what ``to_constraint`` refuses."""
    new = to_constraint(constraint)
    return self._with_constraint(_combine([new] if clear else [new, self._constraint()]))


def validate(self):
    """Checks this tree against its constraint. @raises ValidationError (constraint, position,
    the check's error; the tree as its first argument)."""
    c = self._constraint()
    if c is not None:
        c.validate(self)

