"""DI-treetensor's semantics in the Python package, each against a hand-written loop over torch:
the fallback to torch for unbound names, the reductions' `reduce=` convention, the module-level
in-place functions, Size / Object / treetensor.numpy, a leaf broadcast into a subtree, and the
idioms DI-engine uses (slices, split, stack of lists, attribute assignment, get, in, del,
pickling through a pipe, json)."""
import multiprocessing
import pickle
import warnings

import numpy as np
import pytest
import torch

import treetensor.common as tc
import treetensor.numpy as tnp
import treetensor.torch as ttorch
from conftest import dicts_equal


def dmap(fn, *ds):
    return {k: dmap(fn, *(d[k] for d in ds)) if isinstance(v, dict) else fn(*(d[k] for d in ds))
            for k, v in ds[0].items()}


def sample(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(2, 3, generator=g), "b": {"x": torch.randn(4, generator=g),
                                                      "y": torch.randn(3, 2, generator=g)}}


# ---- the fallback to torch ------------------------------------------------------------------------
@pytest.mark.parametrize("call,ref", [
    (lambda t: t.argmax(-1), lambda x: x.argmax(-1)),
    (lambda t: t.softmax(-1), lambda x: x.softmax(-1)),
    (lambda t: ttorch.log_softmax(t, -1), lambda x: torch.log_softmax(x, -1)),
    (lambda t: t.repeat(2, 1), lambda x: x.repeat(2, 1)),
    (lambda t: t.type_as(torch.zeros(1, dtype=torch.float64)), lambda x: x.double()),
    (lambda t: t.cumsum(0), lambda x: x.cumsum(0)),
    (lambda t: ttorch.atanh(t * 0.5), lambda x: torch.atanh(x * 0.5)),
    (lambda t: ttorch.arctanh(t * 0.5), lambda x: torch.arctanh(x * 0.5)),
    (lambda t: ttorch.asinh(t), torch.asinh),
    (lambda t: ttorch.acosh(t.abs() + 1), lambda x: torch.acosh(x.abs() + 1)),
    (lambda t: ttorch.isclose(torch.zeros(1), t), lambda x: torch.isclose(torch.zeros(1), x)),
    (lambda t: t.T, lambda x: x.T),
], ids=["argmax", "softmax", "log_softmax", "repeat", "type_as", "cumsum", "atanh", "arctanh", "asinh",
        "acosh", "isclose-tensor-first", "T"])
def test_fallback_is_leafwise_torch(call, ref):
    d = sample()
    dicts_equal(call(ttorch.Tensor(d)), dmap(ref, d))


def test_fallback_with_trees_in_other_arguments_and_lists():
    d, e = sample(0), sample(1)
    t, u = ttorch.Tensor(d), ttorch.Tensor(e)
    dicts_equal(t.type_as(u.int()), dmap(lambda x, y: x.type_as(y.int()), d, e))
    dicts_equal(ttorch.vstack([t, u]), dmap(lambda x, y: torch.vstack([x, y]), d, e))
    e2 = ttorch.Tensor({"a": torch.ones(1, 3), "b": {"x": torch.zeros(1, 4), "y": torch.ones(1, 2)}})
    dicts_equal(e2.expand(2, -1), dmap(lambda x: x.expand(2, -1), e2.to_dict()))
    assert torch.equal(ttorch.log_softmax(d["a"], -1), torch.log_softmax(d["a"], -1))  # no tree: torch's


def test_fallback_in_place_returns_the_tree_and_keeps_the_tensors():
    t = ttorch.Tensor(sample())
    leaves = t.to_dict()
    want = dmap(lambda x: x.clone().mul(0.5).atanh_(), leaves)
    t.mul_(0.5)
    assert t.atanh_() is t and t.a is leaves["a"]
    dicts_equal(t, want)
    assert t.unsqueeze_(0) is t and t.a.shape == (1, 2, 3) and t.a is leaves["a"]
    assert t.squeeze_(0) is t and t.a.shape == (2, 3)


def test_fallback_results_of_other_kinds():
    d = sample()
    t = ttorch.Tensor(d)
    values, indices = t.topk(1)
    dicts_equal(values, dmap(lambda x: x.topk(1).values, d))
    s = ttorch.sort(t)
    assert type(s).__name__ == "sort"
    dicts_equal(s.indices, dmap(lambda x: x.sort().indices, d))
    assert t.is_cuda == {"a": False, "b": {"x": False, "y": False}}
    assert isinstance(t.is_cuda, tc.Object) and not t.is_cuda.any()
    assert t.tolist() == dmap(lambda x: x.tolist(), d)
    n = t.numpy()
    assert isinstance(n, tnp.ndarray) and np.shares_memory(n.a, d["a"].numpy())
    assert t.numel() == 16  # the method: the total; the function: each leaf's (DI-treetensor's)
    assert isinstance(ttorch.numel(t), tc.Object) and ttorch.numel(t) == dmap(torch.numel, d)
    assert ttorch.numel(d["a"]) == d["a"].numel() and ttorch.numel(d) == dmap(torch.numel, d)


def test_missing_names_are_attribute_errors():
    t = ttorch.Tensor(sample())
    with pytest.raises(AttributeError, match=r"no key 'nope' at '<root>'; available keys: \{a, b\}"):
        t.nope
    with pytest.raises(AttributeError, match="no key 'q' at 'b'"):
        t.b.q
    with pytest.raises(AttributeError, match="has no attribute 'no_such_function' \\(nor has torch\\)"):
        ttorch.no_such_function
    with pytest.raises(AttributeError, match="torch.nn is a module"):
        ttorch.nn
    assert ttorch.float32 is torch.float32 and ttorch.int64 is torch.int64
    assert not hasattr(t, "__array_interface__")


def test_fallback_errors_name_the_leaf():
    t = ttorch.Tensor(sample())
    with pytest.raises(IndexError, match=r"argmax at leaf 'b\.x'"):
        t.argmax(1)
    with pytest.raises(ValueError, match=r"type_as: the trees differ at '<root>'"):
        t.type_as(ttorch.Tensor({"a": torch.ones(1)}))


def test_keys_come_before_torch_names():
    ttorch.Tensor({"a": torch.ones(2)}).argmax()  # the method form is resolved (and kept) first
    t = ttorch.Tensor({"T": torch.ones(2), "argmax": torch.zeros(1), "neg": torch.ones(1)})
    assert torch.equal(t.T, torch.ones(2)) and torch.equal(t.argmax, torch.zeros(1))
    # before its own methods too (treevalue's rule, DESIGN.md §15); the class has them
    assert torch.equal(t.neg, torch.ones(1)) and torch.equal(ttorch.Tensor.neg(t)["neg"], -torch.ones(1))
    s = ttorch.Tensor({"sum": torch.ones(2), "shape": torch.zeros(3)})
    assert torch.equal(s.sum, torch.ones(2)) and torch.equal(s.shape, torch.zeros(3))
    assert torch.equal(ttorch.Tensor.sum(s), torch.tensor(2.0))
    assert ttorch.Tensor.shape.__get__(s).sum == torch.Size([2])
    assert torch.equal(s["sum"], torch.ones(2)) and torch.equal(s["shape"], torch.zeros(3))
    view = ttorch.Tensor(sample()).b
    del view.x
    with pytest.raises(AttributeError, match="no key 'x' at 'b'"):
        view.x
    root = ttorch.Tensor(sample())
    view = root.b
    del root.b  # the view keeps its node (treevalue's): a root of its own now
    assert "b" not in root
    dicts_equal(view, sample()["b"])


# ---- reductions ---------------------------------------------------------------------------------
def flat(d):
    return torch.cat([v.reshape(-1) if not isinstance(v, dict) else flat(v) for _, v in sorted(d.items())])


@pytest.mark.parametrize("name", ["sum", "mean", "std", "min", "max"])
def test_reductions_reduce_keyword(name):
    d = sample()
    t = ttorch.Tensor(d)
    fn = getattr(torch, name)
    assert torch.allclose(getattr(t, name)(), fn(flat(d)))
    assert torch.allclose(getattr(ttorch, name)(t, reduce=True), fn(flat(d)))
    dicts_equal(getattr(t, name)(reduce=False), dmap(fn, d))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        per_leaf = getattr(t, name)(dim=0)
    with pytest.warns(UserWarning, match=f"Reduce forbidden for this case of function {name}"):
        assert type(getattr(ttorch, name)(t, dim=0, reduce=True)) is type(per_leaf)
    if name in ("min", "max"):
        assert type(per_leaf).__name__ == name  # torch.return_types of trees
        dicts_equal(per_leaf.values, dmap(lambda x: fn(x, dim=0).values, d))
    else:
        dicts_equal(per_leaf, dmap(lambda x: fn(x, dim=0), d))


def test_all_any_masked_select_norm_dist():
    d = sample()
    t = ttorch.Tensor(d)
    m = t > 0
    assert ttorch.all(t > -100).item() and not ttorch.any(t > 100).item()
    dicts_equal(m.all(reduce=False), dmap(lambda x: (x > 0).all(), d))
    dicts_equal(ttorch.any(m, dim=0), dmap(lambda x: (x > 0).any(dim=0), d))
    assert torch.equal(ttorch.masked_select(t, m), torch.cat([x[x > 0] for x in (d["a"], d["b"]["x"], d["b"]["y"])]))
    dicts_equal(ttorch.masked_select(t, m, reduce=False), dmap(lambda x: x[x > 0], d))
    dicts_equal(t.norm(), dmap(torch.norm, d))
    dicts_equal(ttorch.norm(t, p=1), dmap(lambda x: torch.norm(x, p=1), d))
    u = ttorch.Tensor(sample(1))
    dicts_equal(ttorch.dist(t, u), dmap(torch.dist, d, sample(1)))


def test_module_in_place_functions():
    for name in ["abs_", "sigmoid_", "exp_", "neg_", "round_", "floor_", "ceil_", "detach_"]:
        d = sample()
        want = dmap(lambda x: getattr(x.clone(), name)(), d)
        t = ttorch.Tensor(d)
        assert getattr(ttorch, name)(t) is t and t.a is d["a"], name
        dicts_equal(t, want)
    t = ttorch.Tensor(dmap(lambda x: x.abs(), sample()))
    assert ttorch.sqrt_(t) is t and ttorch.log_(t) is t
    t = ttorch.Tensor(sample())
    assert ttorch.clamp_(t, min=0.0) is t and (t >= 0).all()
    assert "abs_" in ttorch.__all__ and "abs_" in ttorch.funcs.__all__


# ---- Size, Object, numpy --------------------------------------------------------------------------
def test_size_and_object():
    assert ttorch.Size([1, 2, 3]) == torch.Size([1, 2, 3]) and type(ttorch.Size([1, 2])) is torch.Size
    s = ttorch.Size({"a": [1, 2, 3], "b": {"x": [3, 4]}})
    assert s.numel() == 18 and s.count(3) == 2
    assert s.index(3) == {"a": 2, "b": {"x": 0}}
    with pytest.raises(ValueError, match="Can not find 9"):
        s.index(9)
    # An index that is no key indexes every leaf (DI-treetensor): ints give an Object, slices
    # a Size; int keys (an optimizer's state) stay keys.
    assert s[0] == {"a": 1, "b": {"x": 3}} and s[-1] == {"a": 3, "b": {"x": 4}}
    assert type(s[1:]) is ttorch.Size and s[1:] == {"a": torch.Size([2, 3]), "b": {"x": torch.Size([4])}}
    assert s["a"] == torch.Size([1, 2, 3]) and s.b.x == torch.Size([3, 4])
    words = tc.Object({"a": "ab", "b": {"x": "cd"}})
    assert words[1:] == {"a": "b", "b": {"x": "d"}} and words[0] == {"a": "a", "b": {"x": "c"}}
    assert tc.Object({0: "x", 1: "yz"})[1] == "yz"
    with pytest.raises(KeyError):
        tc.Object({0: "x", 1: "yz"})[2]  # a missing int key of an int-keyed Object
    o = tc.Object({"a": True, "b": {"c": False}})
    assert not o.all() and o.any() and tc.Object(1) == 1
    assert o.get("a") is True and o.get("z", 3) == 3 and "b" in o
    assert pickle.loads(pickle.dumps(o)) == o
    nested = tc.Object({"a": o, "b": {"c": tc.Object({"d": 1})}, "e": 2})  # Objects as subtrees
    assert nested.json() == {"a": {"a": True, "b": {"c": False}}, "b": {"c": {"d": 1}}, "e": 2}
    assert type(nested.b.c) is tc.Object and nested.b.c.d == 1 and not nested.all()
    plain = {"x": {"y": 1}}
    assert tc.Object(plain).to_dict() == plain and tc.Object(plain).to_dict() is not plain  # new dicts
    o.y = {"v": tc.Object({"u": 1})}  # a tree among a dict's values: a subtree, as built
    assert o.y.v.u == 1 and o.json()["y"] == {"v": {"u": 1}}
    del o.y
    o.z = {"w": 3}  # attributes set and delete keys
    del o.a
    assert o.json() == {"b": {"c": False}, "z": {"w": 3}} and o.z.w == 3
    with pytest.raises(AttributeError, match=r"no key 'a' in tree \(keys: \['b', 'z'\]\)"):
        del o.a
    assert repr(tc.Object({1: "x", "b": {2: 3}})) == "<Object>\n├── 1 --> 'x'\n└── b --> <Object>\n    └── 2 --> 3"
    # a str key that is no identifier is quoted: int 1 and str '1' print apart
    assert repr(tc.Object({1: 0, "1": 1, "a.b": 2, "": 3, "-2": 4})).splitlines() == [
        "<Object>", "├── 1 --> 0", "├── '' --> 3", "├── '-2' --> 4", "├── '1' --> 1", "└── 'a.b' --> 2"]
    shown = repr(tc.Object({None: 0, "None": 1, "'1'": 2, "1": 3})).splitlines()[1:]
    assert sorted(line[4:line.index(" -->")] for line in shown) == ['"\'1\'"', "'1'", "'None'", "None"]


def test_leafwise_calls_walk_any_depth_and_name_a_cycle():
    """Operators, in-place operators, the torch fallback and leaves() walk without recursion:
    a tree 3000 levels deep works (Python's recursion limit is 1000); a tree that contains
    itself is a ValueError naming both paths, not a RecursionError."""
    d = node = {}
    for _ in range(3000):
        node["n"] = {}
        node = node["n"]
    node["leaf"] = 1
    o = tc.Object(d)
    r = -(o * 2 + 1)
    o += 10
    for _ in range(3000):
        r, o = r.n, o.n
    assert (r.leaf, o.leaf) == (-3, 11)
    t = {"a": torch.ones(2)}
    for _ in range(1500):
        t = {"n": t}
    s = ttorch.softmax(ttorch.Tensor(t), -1)  # the fallback to torch, leaf-wise
    for _ in range(1500):
        s = s.n
    assert torch.equal(s.a, torch.full((2,), 0.5))
    c = tc.Object({"a": 1, "b": {"c": 2}})
    c.b.d = c
    for walk in (lambda: c + 1, c.all, c.leaves):
        with pytest.raises(ValueError, match=r"the dict at 'b\.d' is the dict at '<root>' again "
                                             r"\(a cycle\): a tree cannot contain itself"):
            walk()
    mixed = tc.Object({1: 0, "a": {2: 5, "b": 6}})  # a checkpoint's int and str keys
    assert mixed.leaves() == [0, 5, 6] and not mixed.all() and mixed.any()


def test_object_operators_with_int_keys_and_without_leaves():
    """Messages name int-keyed paths (a checkpoint's Objects have them) and tell 1 from '1'; a
    tree without leaves stays an Object."""
    with pytest.raises(ValueError, match=r"differ at '2': tree argument 0 has keys \{3\}, tree "
                                         r"argument 1 has keys \{4\}"):
        tc.Object({1: 1, 2: {3: 4}}) + tc.Object({1: 1, 2: {4: 4}})
    with pytest.raises(ValueError, match=r"has keys \{1\}, tree argument 1 has keys \{'1'\}"):
        tc.Object({1: 1}) + tc.Object({"1": 1})
    with pytest.raises(TypeError, match=r"^__add__ at leaf '1': unsupported operand"):
        tc.Object({1: 1}) + {1: 1}  # a plain dict is a value here, as in DI-treetensor
    assert type(tc.Object({"a": {}}) + 1) is tc.Object and (tc.Object({"a": {}}) + 1).json() == {"a": {}}


def test_object_prints_shared_and_self_containing_subtrees_once_at_any_depth():
    """A subtree printed before is named instead (treevalue's "The same address as ..."): an
    Object that contains itself prints; so does one nested deeper than Python's recursion."""
    q = tc.Object({"a": 1, "b": {"c": 2}})
    q["z"] = q
    q.b["y"] = q.b
    assert repr(q).splitlines() == [
        "<Object>", "├── a --> 1", "├── b --> <Object>", "│   ├── c --> 2", "│   └── y --> <Object>",
        "│             (the same tree as 'b')", "└── z --> <Object>",
        "          (the same tree as '<root>')"]
    deep = d = {}
    for _ in range(3000):
        d["n"] = {}
        d = d["n"]
    d["leaf"] = 1
    lines = repr(tc.Object(deep)).splitlines()
    assert len(lines) == 3002 and lines[-1] == " " * 4 * 3000 + "└── leaf --> 1"


def test_numpy_trees():
    a = tnp.array({"a": [1, 2, 3, 4], "b": {"x": [[1.0, 2.0]]}})
    assert isinstance(a, tnp.ndarray) and np.array_equal(a.a, np.array([1, 2, 3, 4]))
    assert a.b.x.dtype == np.float64
    st = tnp.stack([tnp.array({"a": [1, 2]}), tnp.array({"a": [3, 4]})])
    assert np.array_equal(st.a, np.array([[1, 2], [3, 4]]))
    parts = tnp.split(tnp.array({"a": [1, 2, 3, 4], "b": {"x": [5, 6, 7, 8]}}), 2)
    assert isinstance(parts, list) and np.array_equal(parts[1].b.x, np.array([7, 8]))
    assert tnp.all(tnp.array({"a": [True], "b": {"x": [True, True]}})) is True
    assert np.array_equal((a + a).a, np.array([2, 4, 6, 8])) and a.sum() == 13.0


def test_numpy_fallback_to_numpy_functions():
    z = tnp.zeros({"a": (2, 3), "c": {"x": (3,)}})
    close = tnp.allclose(z, tnp.ndarray({"a": np.zeros((2, 3)), "c": {"x": np.ones(3)}}))
    assert type(close) is tc.Object and close.a is True and close.c.x is False  # bools: an Object
    r = tnp.arange(tnp.ndarray({"a": 3.0, "c": {"x": 4.0}}))
    assert isinstance(r, tnp.ndarray) and np.array_equal(r.c.x, np.arange(4.0))
    root = tnp.sqrt({"a": np.array([4.0]), "b": {"x": np.array([9.0])}})  # dicts are trees here
    assert np.array_equal(root.a, [2.0]) and np.array_equal(root.b.x, [3.0])
    assert np.array_equal(tnp.arange(3), np.arange(3))  # no tree: numpy's own result
    assert tnp.pi == np.pi and tnp.allclose is tnp.allclose  # cached as a module attribute
    with pytest.raises(AttributeError, match=r"'no_such_name' \(nor has numpy\)"):
        tnp.no_such_name
    with pytest.raises(AttributeError, match="numpy.float32 is a type, not a function"):
        tnp.float32  # as DI-treetensor: dtypes are numpy's own


# ---- semantics ----------------------------------------------------------------------------------
def test_a_leaf_broadcasts_into_a_subtree():
    d = sample()
    v = {"a": torch.randn(2, 3), "b": torch.randn(1)}
    t, tv = ttorch.Tensor(d), ttorch.Tensor(v)
    want = {"a": d["a"] + v["a"], "b": {"x": d["b"]["x"] + v["b"], "y": d["b"]["y"] + v["b"]}}
    dicts_equal(t + tv, want)
    dicts_equal(tv + t, {"a": v["a"] + d["a"], "b": {"x": v["b"] + d["b"]["x"], "y": v["b"] + d["b"]["y"]}})
    dicts_equal(t == tv, {"a": d["a"] == v["a"], "b": {"x": d["b"]["x"] == v["b"], "y": d["b"]["y"] == v["b"]}})
    dicts_equal(ttorch.mul(t, tv), {"a": d["a"] * v["a"], "b": {"x": d["b"]["x"] * v["b"], "y": d["b"]["y"] * v["b"]}})
    with pytest.raises(ValueError, match="argument 0 has keys"):
        t + ttorch.Tensor({"a": torch.ones(1), "c": torch.ones(1)})
    # the method forms as the functions (t.add(tv) refused what t + tv and ttorch.add took)
    at_b = lambda fn: {"a": fn(d["a"], v["a"]), "b": {k: fn(d["b"][k], v["b"]) for k in ("x", "y")}}  # noqa: E731
    for name in ("add", "sub", "mul", "div", "pow", "eq", "ne", "lt", "le", "gt", "ge", "maximum", "atan2",
                 "remainder", "fmod"):
        dicts_equal(getattr(t, name)(tv), at_b(getattr(torch, name)))
    dicts_equal(t.add(tv, alpha=2), at_b(lambda x, y: torch.add(x, y, alpha=2)))
    dicts_equal(tv.sub(t), {"a": v["a"] - d["a"], "b": {k: v["b"] - d["b"][k] for k in ("x", "y")}})
    with pytest.raises(ValueError, match="argument 0 has keys"):
        t.add(ttorch.Tensor({"a": torch.ones(1), "c": torch.ones(1)}))


def test_in_place_a_leaf_broadcasts_into_the_targets_subtree():
    d = sample()
    v = {"a": torch.randn(2, 3), "b": torch.randn(1)}
    t, tv = ttorch.Tensor(d), ttorch.Tensor(v)
    leaves = [t.a, t.b.x, t.b.y]
    want = {"a": d["a"] + v["a"], "b": {"x": d["b"]["x"] + v["b"], "y": d["b"]["y"] + v["b"]}}
    want = dmap(lambda x: x * 2, want)
    t += tv
    assert t.add_(t) is t
    dicts_equal(t, want)
    assert all(a is b for a, b in zip([t.a, t.b.x, t.b.y], leaves))  # the same tensors, in place
    before = dmap(torch.clone, v)
    with pytest.raises(ValueError, match="argument 0 is a leaf but argument 1 is a subtree"):
        tv.add_(t)  # the target's leaf would be written once per leaf of the subtree
    dicts_equal(tv, before)


def test_functions_taking_trees_broadcast_a_leaf_into_a_subtree():
    d, v = sample(), {"a": torch.randn(2, 3), "b": torch.randn(1)}
    t, tv = ttorch.Tensor(d), ttorch.Tensor(v)
    at_b = lambda fn: {"a": fn(d["a"], v["a"]), "b": {k: fn(d["b"][k], v["b"]) for k in ("x", "y")}}  # noqa: E731
    dicts_equal(ttorch.isclose(t, tv), at_b(torch.isclose))
    dicts_equal(t.isclose(tv), at_b(torch.isclose))
    dicts_equal(ttorch.where(t > 0, t, tv), at_b(lambda x, y: torch.where(x > 0, x, y)))
    dicts_equal(ttorch.lerp(t, tv, 0.25), at_b(lambda x, y: torch.lerp(x, y, 0.25)))
    dicts_equal(ttorch.addcmul(t, tv, t, value=2), at_b(lambda x, y: torch.addcmul(x, y, x, value=2)))
    dicts_equal(t.clamp(min=tv), at_b(lambda x, y: torch.clamp(x, min=y)))
    dicts_equal(t.clamp(-0.5, 0.5), dmap(lambda x: x.clamp(-0.5, 0.5), d))  # numbers: C++


def test_indexing_and_joins_broadcast_a_leaf_into_a_subtree():
    """A mask or index tree's leaf facing a subtree indexes (and assigns) every leaf there; a
    tensor among the trees of stack/cat, or a leaf facing a subtree, joins every leaf there."""
    d = sample()
    t = ttorch.Tensor(d)
    rows = torch.tensor([0, 2])
    key = ttorch.Tensor({"a": d["a"] > 0, "b": rows})  # a mask, and rows of b.x and b.y
    dicts_equal(t[key], {"a": d["a"][d["a"] > 0], "b": {k: d["b"][k][rows] for k in ("x", "y")}})
    u = ttorch.Tensor(dmap(torch.clone, d))
    u[key] = 0.0
    want = dmap(torch.clone, d)
    want["a"][d["a"] > 0] = 0.0
    for k in ("x", "y"):
        want["b"][k][rows] = 0.0
    dicts_equal(u, want)
    with pytest.raises(ValueError, match="argument 1 has keys"):
        t[ttorch.Tensor({"a": torch.tensor([0]), "c": torch.tensor([0])})]
    row = torch.randn(3)
    flat = ttorch.Tensor({"a": torch.randn(3), "b": torch.randn(3)})
    for join in (ttorch.stack, ttorch.cat):
        dicts_equal(join([flat, row]), {k: join([flat[k], row]) for k in ("a", "b")})
        dicts_equal(join([row, flat]), {k: join([row, flat[k]]) for k in ("a", "b")})
    e = {"a": d["a"], "b": {"x": torch.randn(3), "y": torch.randn(3)}}
    leafy = ttorch.Tensor({"a": d["a"], "b": torch.randn(3)})  # b: a leaf facing e's subtree b
    dicts_equal(ttorch.stack([ttorch.Tensor(e), leafy]), {
        "a": torch.stack([d["a"], d["a"]]), "b": {k: torch.stack([e["b"][k], leafy.b]) for k in ("x", "y")}})


def test_clamp_in_place_with_tree_bounds():
    d, hi = sample(), sample(1)
    t = ttorch.Tensor(d)
    want = dmap(lambda x, y: torch.clamp(x, max=y), d, hi)
    leaves = [t.a, t.b.x]
    assert t.clamp_(max=ttorch.Tensor(hi)) is t
    dicts_equal(t, want)
    assert leaves[0] is t.a and leaves[1] is t.b.x  # the same tensors
    short = ttorch.Tensor({"a": torch.zeros(2, 3), "b": torch.zeros(1)})
    with pytest.raises(ValueError, match="clamp_: the tree has a leaf at 'b' where min has a subtree"):
        short.clamp_(min=ttorch.Tensor(sample()))
    assert torch.equal(short.b, torch.zeros(1))  # refused before any leaf was written
    with pytest.raises(TypeError, match="clamp: max is a dict, not a tree of bounds"):
        t.clamp(max={"a": torch.ones(1)})  # a dict is not a tree bound (DI-treetensor: TypeError)


def test_torch_methods_on_the_class():
    import types
    assert isinstance(ttorch.Tensor.arctanh, types.FunctionType) and hasattr(ttorch.Tensor, "arctanh_")
    t = ttorch.Tensor(sample())
    dicts_equal(ttorch.Tensor.arctanh(t * 0.5), dmap(lambda x: torch.arctanh(x * 0.5), sample()))
    assert isinstance(t.arctanh, types.MethodType) and ttorch.Tensor.arctanh is ttorch.Tensor.arctanh
    assert not hasattr(ttorch.Tensor, "is_cuda")  # data attributes: instances only
    with pytest.raises(AttributeError, match="type object 'Tensor' has no attribute 'no_such_name'"):
        ttorch.Tensor.no_such_name


def test_package_top_level_utils_and_meta():
    import importlib.metadata

    import treetensor
    import treetensor.config.meta as meta
    from treetensor.utils import args_mapping, replaceable_partial
    assert treetensor.Tensor is ttorch.Tensor and treetensor.Object is tc.Object
    assert treetensor.ndarray is tnp.ndarray
    assert treetensor.__version__ == meta.__VERSION__ == importlib.metadata.version("treetensor")
    assert meta.__TITLE__ == "treetensor"
    zeros = replaceable_partial(torch.zeros, dtype=torch.int64)
    assert zeros(2).dtype == torch.int64 and zeros(2, dtype=torch.float32).dtype == torch.float32
    add = args_mapping(lambda i, x: x * 10 if i == 0 else x)(lambda a, b=0: a + b)
    assert add(1, b=2) == 12


def test_tensor_of_dict_with_dtype():
    t = ttorch.Tensor({"a": [1, 2], "b": {"x": [3]}}, dtype=torch.float64)
    assert t.a.dtype is torch.float64 and t.b.x.tolist() == [3.0]
    assert ttorch.Tensor([1, 2], dtype=torch.float32).dtype is torch.float32


def test_checkpoint_with_int_keys_is_refused_as_by_ditreetensor():
    """DI-treetensor 0.5.0 refuses it too (TypeError; the oracle's 'checkpoint' case)."""
    m = torch.nn.Linear(2, 2)
    o = torch.optim.Adam(m.parameters())
    m(torch.ones(1, 2)).sum().backward()
    o.step()
    with pytest.raises(TypeError, match="key 0 at 'optimizer.state' is not a string"):
        ttorch.Tensor({"optimizer": {"state": o.state_dict()["state"]}})


def test_ditengine_idioms():
    d = {"obs": torch.randn(6, 3), "act": {"x": torch.randn(6), "y": torch.randint(0, 3, (6,))}}
    data = ttorch.Tensor(d)
    dicts_equal(data[:4], dmap(lambda x: x[:4], d))
    parts = ttorch.split(data, 4)
    assert len(parts) == 2
    dicts_equal(parts[1], dmap(lambda x: x.split(4)[1], d))
    items = [ttorch.Tensor(dmap(lambda x: x[i], d)) for i in range(6)]
    dicts_equal(ttorch.stack(items), d)
    dicts_equal(ttorch.cat([data[:2], data[2:]]), d)
    dicts_equal(data.unsqueeze(0), dmap(lambda x: x.unsqueeze(0), d))
    dicts_equal(data.to(dtype=torch.float64), dmap(lambda x: x.to(dtype=torch.float64), d))
    data.adv = torch.ones(6)
    assert "adv" in data and torch.equal(data.get("adv"), torch.ones(6)) and data.get("nope", 7) == 7
    del data.adv
    assert "adv" not in data
    sub = data.pop("act")
    assert "act" not in data and torch.equal(sub.x, d["act"]["x"]) and data.pop("act", 3) == 3
    with pytest.raises(KeyError, match="no key 'act'"):
        data.pop("act")
    data.update({"act": sub}, adv=torch.zeros(6))
    assert torch.equal(data.adv, torch.zeros(6)) and data.setdefault("adv", None) is data.adv
    del data.adv
    j = data.json()
    assert isinstance(j, dict) and j["act"]["x"] is data.act.x
    mine, theirs = multiprocessing.Pipe()  # the connection pickles what it sends
    mine.send(data)
    assert theirs.poll(10)
    back = theirs.recv()
    assert isinstance(back, ttorch.Tensor)
    dicts_equal(back, d)


# ---- treevalue's tree methods (DI-treetensor's trees are FastTreeValues) ------------------------
def test_walk_reduce_filter_mask_over_the_hand_written_loop():
    d = sample()
    t = ttorch.Tensor(d)
    walked = dict(t.walk())
    assert sorted(walked) == [(), ("a",), ("b",), ("b", "x"), ("b", "y")]
    assert walked[("b", "x")] is d["b"]["x"] and walked[()]._same_root(t)
    walked[("b",)].z = torch.ones(1)  # a walked node is a view of the tree
    assert torch.equal(t.b.z, torch.ones(1))
    del t.b.z
    total = t.reduce(lambda **kw: sum(v.sum() for v in kw.values()))
    assert torch.equal(total, d["a"].sum() + (d["b"]["x"].sum() + d["b"]["y"].sum()))
    big = t.filter(lambda x: x.numel() > 4)
    assert big.keys() == ["a", "b"] and big.b.keys() == ["y"] and big.b.y is d["b"]["y"]
    assert t.filter(lambda x: x.numel() > 100).keys() == []
    assert t.filter(lambda x: x.numel() > 100, remove_empty=False).b.keys() == []
    assert t.filter(lambda x, path: path[-1] == "x").b.keys() == ["x"]
    masked = t.mask(tc.Object({"a": False, "b": {"x": True, "y": torch.tensor(False)}}))
    assert masked.keys() == ["b"] and masked.b.keys() == ["x"] and masked.b.x is d["b"]["x"]
    assert t.mask(tc.Object({"a": True, "b": False})).keys() == ["a"]  # a mask leaf covers a subtree
    with pytest.raises(KeyError, match="no key 'y' at 'b'"):
        t.mask({"a": True, "b": {"x": True}})
    with pytest.raises(RuntimeError, match=r"mask at 'a' is not one bool per leaf .* masked_select"):
        t.mask(t > 0)  # a mask per element: t[t > 0] or masked_select


def test_tree_methods_come_after_keys_and_type_keeps_torchs_form():
    t = ttorch.Tensor({"mask": torch.ones(1), "filter": torch.zeros(1), "a": torch.ones(2)})
    assert torch.equal(t.mask, torch.ones(1)) and torch.equal(t.filter, torch.zeros(1))
    assert callable(ttorch.Tensor(sample()).mask) and "walk" in dir(ttorch.Tensor)
    d = sample()
    o = ttorch.Tensor(d).type(tc.Object)
    assert type(o) is tc.Object and o.b.x is d["b"]["x"]  # leaves shared
    dicts_equal(ttorch.Tensor(d).type(torch.float64), dmap(lambda x: x.type(torch.float64), d))
    dicts_equal(ttorch.Tensor(d).torch.view(-1), dmap(lambda x: x.view(-1), d))
    dicts_equal(ttorch.Tensor.torch.neg(ttorch.Tensor(d)), dmap(torch.neg, d))


def test_unpack_popitem_clear_union_subside_rise_func():
    d = sample()
    t = ttorch.Tensor(d)
    a, b = t.unpack("a", "b")
    assert a is d["a"] and b.x is d["b"]["x"] and t.unpack("zz", default=None) == (None,)
    with pytest.raises(KeyError, match="no key 'zz'"):
        t.unpack("zz")
    key, value = t.popitem()  # the last key in sorted order, deterministically
    assert key == "b" and value.x is d["b"]["x"] and t.keys() == ["a"]
    t.clear()
    assert len(t) == 0
    with pytest.raises(KeyError, match="empty"):
        t.popitem()
    u = ttorch.Tensor.union(ttorch.Tensor(d), 3)
    assert type(u) is tc.Object and u.b.x == (d["b"]["x"], 3)
    with pytest.raises(ValueError, match="differ at '<root>'"):
        ttorch.Tensor.union(ttorch.Tensor(d), ttorch.Tensor({"a": torch.ones(1)}))
    e = dmap(lambda x: x * 2, d)
    s = ttorch.Tensor.subside([ttorch.Tensor(d), (ttorch.Tensor(e), 5)])
    assert type(s) is tc.Object and s.b.y[0] is d["b"]["y"] and s.b.y[1] == (e["b"]["y"], 5)
    first, (second, five) = s.rise()
    assert type(first) is ttorch.Tensor and first.a is d["a"] and second.b.x is e["b"]["x"]
    assert type(five) is tc.Object and five.b.x == 5
    with pytest.raises(TypeError, match="dict leaves"):
        ttorch.Tensor.subside({"p": ttorch.Tensor(d)})
    f = ttorch.Tensor.func(subside=True)(lambda xs, k: xs[0] * k - xs[1])
    dicts_equal(f([ttorch.Tensor(d), ttorch.Tensor(e)], 3), dmap(lambda x, y: x * 3 - y, d, e))
    with pytest.raises(ValueError, match="'strict' mode"):
        ttorch.Tensor.func(mode="outer")
    with pytest.raises(ValueError, match="'strict' mode"):
        ttorch.Tensor.union(ttorch.Tensor(d), ttorch.Tensor(d), mode="inner")
    with pytest.raises(ValueError, match="list_=False"):
        ttorch.Tensor.subside([ttorch.Tensor(d)], list_=False)


def test_object_map_clone_and_dict_methods():
    o = tc.Object({"a": [1], "b": {"c": 2}})
    assert o.map(lambda x, p: p).b.c == ("b", "c") and o.map(lambda: 0).a == 0
    shallow, deep = o.clone(), o.clone(copy_value=True)
    shallow.a.append(5)
    assert o.a == [1, 5] and deep.a == [1] and type(deep) is tc.Object
    assert o.pop("a") == [1, 5] and o.pop("a", 7) == 7 and o.keys() == ["b"]
    assert o.setdefault("z", 9) == 9 and o.setdefault("z", 0) == 9
    o.update({"k": tc.Object({"m": 1})}, n=2)
    o["q"] = 3
    del o["z"]
    assert o.json() == {"b": {"c": 2}, "k": {"m": 1}, "n": 2, "q": 3}
    assert o.reduce(lambda **kw: sum(kw.values())) == 8
    assert o.filter(lambda x: x > 1).json() == {"b": {"c": 2}, "n": 2, "q": 3}


# ---- treevalue's graph / graphics (the DOT structure is checked against DI-treetensor by the
# oracle; here what it cannot check) -------------------------------------------------------------

def test_graph_is_valid_dot_that_graphviz_draws():
    t = ttorch.Tensor({"a": torch.arange(6.).reshape(2, 3), "b": {"x": torch.tensor(1),
                                                               "y": torch.zeros(2)}})
    g = t.graph("t <tree>", title='a "quoted" title')
    svg = g.pipe(format="svg").decode()  # Graphviz's dot parses and lays out our source
    assert svg.count('class="node"') == 5 and svg.count('class="edge"') == 4
    assert "&lt;tree&gt;.b" in svg  # the markup characters of a name arrive as text


def test_graph_shares_nodes_of_views_and_values_with_dup_value():
    leaf = torch.ones(2)
    t = ttorch.Tensor({"a": leaf, "b": {"x": leaf}, "c": torch.zeros(1)})
    g = ttorch.Tensor.graphics((t, "t"), (t.b, "tb"), dup_value=True)
    nodes = [ln for ln in g.body if " -> " not in ln]
    assert len(nodes) == 4  # t, t.b drawn once (also the root tb), the shared leaf once, c
    assert sum(" -> " in ln for ln in g.body) == 4
    assert len([ln for ln in t.graph().body if " -> " not in ln]) == 5  # no dup_value


def test_graph_generators_get_the_arguments_they_take():
    seen = []
    o = tc.Object({"a": 1, "b": {"c": 2}})
    o.graph("o", repr_gen=lambda v: f"<{v}>",
            node_cfg_gen=lambda *args: seen.append(("node", len(args))) or {},
            edge_cfg_gen=lambda cur, parent, path: seen.append(("edge", tuple(path))) or {"weight": 2})
    assert ("node", 7) in seen and ("edge", ("b", "c")) in seen


def test_graph_errors_and_names():
    with pytest.raises(TypeError, match="argument 1 is a int, not a tree"):
        ttorch.Tensor.graphics(ttorch.Tensor({"a": torch.ones(1)}), 3)
    g = ttorch.Tensor({"a": {"b": torch.ones(1)}}).graph(3).source  # any name, as its str
    assert "label=3 " in g and 'label="3.a"' in g


def test_graph_without_the_graphviz_package(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "graphviz", None)
    with pytest.raises(ImportError, match=r"pip install graphviz"):
        ttorch.Tensor({"a": torch.ones(1)}).graph()


def test_stream_call_is_the_call():
    x = torch.randn(3)
    assert torch.equal(ttorch.stream_call(torch.add, x, 1, alpha=2), x + 2)
    with ttorch.stream(2):
        assert torch.equal(ttorch.stream_call(torch.sigmoid, x), torch.sigmoid(x))


# ---- treevalue's constraints (DI-treetensor 0.5.0 drops them; treevalue's semantics here) -----

def test_with_constraints_shares_the_tree_and_keeps_its_constraint():
    t = ttorch.Tensor({"a": torch.ones(2, 3), "b": {"x": torch.zeros(4)}})
    c = t.with_constraints({"a": tc.vcheck(lambda v: v.shape[0] == 2), "b": torch.Tensor})
    assert repr(t.constraint) == "<EmptyConstraint>" and c.constraint != t.constraint
    assert repr(c.b.constraint) == "<TypeConstraint <class 'torch.Tensor'>>"
    assert repr(c.b.x) == repr(t.b.x) and c.a is t.a  # the same leaves
    c.b.y = torch.ones(1)  # the same keys: t sees it
    assert "y" in t.b
    c.validate()
    assert repr((c + 1).constraint) == "<EmptyConstraint>"  # results of ops have none


@pytest.mark.parametrize("make", [lambda d: ttorch.Tensor(d), lambda d: tc.Object(d)])
def test_validate_names_the_constraint_position_and_error(make):
    t = make({"a": torch.ones(2), "b": {"x": torch.zeros(3), "y": torch.zeros(1)}})
    c = t.with_constraints({"b": {"y": tc.vcheck(lambda v: v.numel() > 1)}})
    with pytest.raises(tc.ValidationError, match=r"at position \('b', 'y'\)\nAssertionError: Check of") as e:
        c.validate()
    tree, error, position, constraint = e.value.args
    assert tree is c and position == ("b", "y") and isinstance(e.value.__cause__, AssertionError)
    with pytest.raises(tc.ValidationError, match=r"Invalid type, <class 'int'> expected but "
                                                r"<class 'torch.Tensor'> found"):
        t.with_constraints(int).validate()


def test_constraint_kinds_and_composition():
    t = tc.Object({"a": 1, "b": {"c": 2}})
    t.with_constraints([int, tc.vval(lambda v: v > 0), tc.nval(lambda n: n.a),
                        tc.ncheck(lambda n: "b" in n), {"b": tc.nval(len), "a": tc.cleaf()}]).validate()
    for bad, where in ((tc.vval(lambda v: 1 / (v - 2)), ("b", "c")), (tc.cleaf(), ()),
                       ({"a": {"x": int}}, ("a",)), (tc.ncheck(lambda n: "z" in n), ())):
        with pytest.raises(tc.ValidationError) as e:
            t.with_constraints(bad).validate()
        assert e.value.position == where, bad
    both = t.with_constraints(int).with_constraints({"b": float})
    assert "CompositeConstraint" in repr(both.constraint)
    assert repr(both.with_constraints(str, clear=True).constraint) == "<TypeConstraint <class 'str'>>"
    assert repr(both.b.constraint) == "<CompositeConstraint (<TypeConstraint <class 'float'>>, " \
                                      "<TypeConstraint <class 'int'>>)>"
    assert tc.to_constraint({"a": None}) == tc.to_constraint({}) and tc.to_constraint(int) == tc.to_constraint([int])
    with pytest.raises(TypeError, match="Invalid constraint - 3"):
        t.with_constraints(3)
    with pytest.raises(tc.ValidationError, match=r"Check of 'positive' failed"):
        tc.Object({"a": -1}).with_constraints(tc.vcheck(lambda v: v > 0, name="positive")).validate()
    assert tc.vcheck(abs, name="n") != tc.vcheck(abs) and tc.vcheck(abs) == tc.vcheck(abs)


def test_a_key_named_constraint_comes_first():
    t = ttorch.Tensor({"constraint": torch.ones(1), "validate": torch.zeros(1)})
    assert torch.equal(t.constraint, torch.ones(1)) and torch.equal(t.validate, torch.zeros(1))
    assert repr(ttorch.Tensor({"a": torch.ones(1)}).constraint) == "<EmptyConstraint>"


def test_setitem_with_a_tree_mask_and_numpy_trees_back_to_tensor_trees():
    t = ttorch.Tensor({"a": torch.tensor([1., -2.]), "b": {"x": torch.tensor([-1., 3.])}})
    u = t.clone()
    u[u > 0] = 0.  # DI-treetensor: leaf-wise, the mask zipped by path
    assert torch.equal(u.a, torch.tensor([0., -2.])) and torch.equal(u.b.x, torch.tensor([-1., 0.]))
    with pytest.raises(RuntimeError, match=r"__setitem__ at leaf 'a': .*\(assigned 0 of 2 leaves before it\)"):
        u[0] = torch.zeros(3)
    v = ttorch.Tensor({"a": torch.tensor([1., 2.]), "b": torch.tensor([3.])})
    with pytest.raises(IndexError, match=r"at leaf 'b': .*\(assigned 1 of 2 leaves before it: 'a'\)"):
        v[1] = 5.  # the per-leaf loop's partial write, said in the error
    assert torch.equal(v.a, torch.tensor([1., 5.])) and torch.equal(v.b, torch.tensor([3.]))
    a = tnp.array({"a": np.array([1, 2]), "b": {"x": np.array([3.5])}})
    back = ttorch.Tensor(a)
    assert torch.equal(back.a, torch.tensor([1, 2])) and torch.equal(back.b.x, torch.tensor([3.5]))
    assert torch.equal(ttorch.as_tensor(t.numpy()).b.x, t.b.x)
    assert (abs(a) == tnp.array({"a": np.array([1, 2]), "b": {"x": np.array([3.5])}})).all()
    assert abs(tc.Object({"k": -2})) == tc.Object({"k": 2})


def test_reversed_goes_over_the_keys_backwards():
    """As DI-treetensor's: the iteration order backwards (it indexed the leaves by ints)."""
    t = ttorch.Tensor({"a": torch.arange(3.0), "c": torch.ones(2), "b": torch.zeros(1)})
    for tree in (t, tc.Object({"a": 1, "c": 2, "b": 3}), tnp.array({"a": [1], "c": [2], "b": [3]})):
        assert list(reversed(tree)) == list(tree)[::-1] == ["c", "b", "a"]


def test_numpy_trees_without_leaves_stay_numpy_trees():
    """tnp's functions and methods give an ndarray tree without leaves too (DI-treetensor's);
    a tensor tree came back, whose later calls followed torch's rules."""
    empty = tnp.array({"a": {}})
    for r in (tnp.array({}), tnp.zeros({}), tnp.ones({"a": {}}), empty, tnp.stack([empty, empty]),
              empty.copy(), tnp.sqrt(empty), empty[0:1], empty.shape, empty.T, empty.dtype):
        assert type(r) is tnp.ndarray, type(r)
    assert tnp.array({"a": {}}).to_dict() == {"a": {}} and tnp.array({}).to_dict() == {}


# ---- keys named like methods ----------------------------------------------------------------------
METHOD_KEYS = ["mean", "std", "sum", "to_dict", "keys", "values", "items", "grad", "shape", "dtype",
               "detach", "clone", "to", "get", "pop", "map", "numel", "json", "consolidate", "walk",
               "reduce", "float", "split", "apply", "requires_grad_"]


def test_keys_named_like_methods_come_first_and_the_package_still_works(tmp_path):
    """treevalue's rule: t.mean is the key 'mean' where there is one. The package's own code
    reaches methods through the class, so such a tree still prints, pickles, saves, stacks,
    zips and reduces; the methods stay reachable as ttorch.Tensor.<name>(t)."""
    d = {k: torch.tensor([float(i), -1.0]) for i, k in enumerate(METHOD_KEYS)}
    d["sub"] = {"max": torch.tensor([5.0]), "min": torch.tensor([1.0])}
    t = ttorch.Tensor(d)
    for k in METHOD_KEYS:
        assert torch.equal(getattr(t, k), d[k]), k
    assert torch.equal(t.sub.max - t.sub.min, torch.tensor([4.0]))
    assert callable(t.add) and callable(t._leaf_call)  # no such key: the methods
    dicts_equal(ttorch.Tensor.to_dict(t), d)
    assert torch.equal(ttorch.Tensor.mean(t), ttorch.mean(t))
    assert "requires_grad_" in repr(t)
    dicts_equal(pickle.loads(pickle.dumps(t)), d)
    ttorch.save(t, str(tmp_path / "t.pt"))
    dicts_equal(ttorch.load(str(tmp_path / "t.pt")), d)
    dicts_equal(ttorch.stack([t, t]), dmap(lambda x: torch.stack([x, x]), d))
    dicts_equal(t + t, dmap(lambda x: x + x, d))
    dicts_equal(t.softmax(-1), dmap(lambda x: x.softmax(-1), d))  # the fallback: no such key
    assert ttorch.Tensor.reduce(t, lambda **kw: len(kw)) == len(d)
    assert len(list(ttorch.Tensor.walk(t))) == len(d) + 3
    t.mean = torch.tensor([9.0])  # assigned: the key again
    assert torch.equal(t.mean, torch.tensor([9.0]))
    del t.mean
    assert callable(t.mean)
    with pytest.raises(AttributeError, match="no key 'mean'"):
        del t.mean


def test_object_and_numpy_keys_come_first_and_leaves_answer_the_rest():
    o = tc.Object({"type": "ppo", "keys": [1, 2], "items": {"c": "x"}})
    assert o.type == "ppo" and o.keys == [1, 2] and isinstance(o.items, tc.Object)
    assert tc.Object.keys(o) == ["items", "keys", "type"] and len(o) == 3
    assert repr(o).startswith("<Object>") and pickle.loads(pickle.dumps(o)).type == "ppo"
    assert tc.Object({"a": "abc", "b": {"c": "de"}}).upper().to_dict() == {"a": "ABC", "b": {"c": "DE"}}
    assert tc.Object({"f": abs, "g": {"h": str}})(-3).to_dict() == {"f": 3, "g": {"h": "-3"}}
    with pytest.raises(AttributeError, match=r"no key 'nothing' in tree .*'int' object has no attribute"):
        tc.Object({"a": 1}).nothing
    n = tnp.ndarray({"r": np.array(1.0), "o": np.array([1.0, 2.0]), "sum": np.array([4.0])})
    assert isinstance(n.sum, np.ndarray) and tnp.ndarray.sum(n) == 8.0
    m = tnp.ndarray({"r": np.array(1.0), "o": np.array([1.0, -2.0])})
    assert (m > 0).any() and not (m > 0).all() and (m > 0).sum() == 2
    assert m.tolist().to_dict() == {"r": 1.0, "o": [1.0, -2.0]}
    with pytest.raises(TypeError, match="is not one numpy array"):
        np.asarray(m)


def test_the_package_s_functions_take_trees_with_keys_named_like_methods():
    """Each of these called a method of a user's tree by attribute (a key of that name came
    first and was called)."""
    x = torch.ones(2)
    assert ttorch.zeros(ttorch.Tensor({"to_dict": x, "b": x}).shape).b.shape == (2,)
    dicts_equal(ttorch.tensor(ttorch.Tensor({"clone": x, "b": x})), {"clone": x, "b": x})
    assert torch.equal(tc.Object.to_dict(tc.Object(ttorch.Tensor({"to_dict": x})))["to_dict"], x)
    assert torch.equal(tc.Object({"n": ttorch.Tensor({"to_dict": x})}).to_dict()["n"]["to_dict"], x)
    t = ttorch.Tensor({"a": x})
    ttorch.Tensor.update(t, ttorch.Tensor({"items": 2 * x}))
    assert torch.equal(t["items"], 2 * x)
    o = tc.Object({"items": 1, "_x": 2})
    assert o._x == 2 and o.items == 1
    p = {"consolidate": torch.nn.Parameter(torch.ones(3)), "b": torch.nn.Parameter(torch.ones(2))}
    import treetensor.optim as topt
    opt = topt.SGD(ttorch.Tensor.consolidate(ttorch.Tensor(p)), lr=0.1)
    opt.step(ttorch.Tensor({"consolidate": torch.ones(3), "b": torch.ones(2)}))
    assert torch.allclose(opt.params["consolidate"], torch.full((3,), 0.9))
    import treetensor.nn as tnn
    m = torch.nn.Module()
    m.consolidate, m.keys = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    tree = tnn.consolidate_module(m)
    assert ttorch.Tensor.keys(tree.params) == ["consolidate", "keys"]
    tree.close()


def test_equal_and_allclose_broadcast_a_tensor_and_a_leaf_facing_a_subtree():
    """DI-treetensor's equal (func_treelize, then all); allclose the same, one bool."""
    t = ttorch.Tensor({"a": torch.tensor([1., 2.]), "b": {"x": torch.tensor([1., 2.])}})
    u = ttorch.Tensor({"a": torch.tensor([1., 2.]), "b": torch.tensor([1., 2.])})
    for f in (ttorch.equal, ttorch.Tensor.equal, ttorch.allclose, ttorch.Tensor.allclose):
        assert f(t, torch.tensor([1., 2.])) is True and f(t, u) is True and f(u, t) is True
        assert f(t, torch.tensor([1., 3.])) is False and f(t, u + 1) is False
        assert f(t, ttorch.Tensor({"a": torch.tensor([1., 2.])})) is False  # other keys
    assert ttorch.equal(torch.tensor([1., 2.]), t) is True
    assert ttorch.allclose(t, t + 1e-6) is True and ttorch.equal(t, t + 1e-6) is False


def test_reshape_and_view_keywords_are_torchs_per_leaf():
    t = ttorch.Tensor({"a": torch.arange(6.0), "b": {"x": torch.arange(4.0)}})
    v = t.view(dtype=torch.int32)
    assert torch.equal(v.a, torch.arange(6.0).view(torch.int32)) and v.b.x.dtype == torch.int32
    r = t.reshape(shape=(2, -1))
    assert r.a.shape == (2, 3) and r.b.x.shape == (2, 2)
