"""Structure, access, printing, conversions and identity."""
import collections.abc
import gc
import os
import sys
import tracemalloc
import weakref

import pytest
import torch

import treetensor.common as tc
import treetensor.torch as ttorch
from conftest import dicts_equal


def sample():
    return {"a": torch.arange(6.0).reshape(2, 3), "b": {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor(3.0)}}


def test_construct_and_access():
    d = sample()
    t = ttorch.Tensor(d)
    assert isinstance(t, ttorch.Tensor)
    assert t.a is d["a"] and t["a"] is d["a"] and t.b.x is d["b"]["x"]
    assert isinstance(t.b, ttorch.Tensor) and isinstance(t["b"], ttorch.Tensor)
    assert t.keys() == ["a", "b"] and list(t) == ["a", "b"] and len(t) == 2 and len(t.b) == 2
    assert "a" in t and "z" not in t
    assert [k for k, _ in t.items()] == ["a", "b"]
    assert t.values()[0] is d["a"]
    # non-dict data: a plain torch.Tensor (DI-treetensor)
    p = ttorch.Tensor([1, 2, 3])
    assert type(p) is torch.Tensor and p.tolist() == [1, 2, 3]
    x = torch.ones(2)
    assert ttorch.Tensor(x) is x
    # non-tensor leaves go through torch.as_tensor
    q = ttorch.Tensor({"a": [1, 2], "b": {"c": 1.5}})
    assert q.a.dtype == torch.int64 and q.b.c.item() == 1.5


def test_views_write_through():
    t = ttorch.Tensor(sample())
    v = t.b
    v.z = torch.zeros(1)  # assignment through a view changes the root
    assert "z" in t.b and torch.equal(t.b.z, torch.zeros(1))
    t["b"]["w"] = {"deep": torch.ones(1)}
    assert torch.equal(t.b.w.deep, torch.ones(1))
    del t.b.z
    assert "z" not in t.b
    v += 1  # in place through a view: the root's tensors change
    assert torch.equal(t.b.x, torch.tensor([2.0, 3.0]))


def test_missing_keys_name_the_path():
    t = ttorch.Tensor(sample())
    with pytest.raises(AttributeError, match="no key 'q' at 'b'"):
        t.b.q
    with pytest.raises(KeyError, match="no key 'q' at 'b'"):  # as the attribute says
        t["b"]["q"]
    assert not hasattr(t, "nope")
    with pytest.raises(TypeError, match="not a string"):
        ttorch.Tensor({"a": {1: torch.ones(1)}})


def test_errors_name_the_call_and_the_leaf_a_user_wrote():
    """The op as the user called it, the leaf's path, the type once."""
    t = ttorch.Tensor({"a": torch.arange(3.0), "b": {"c": torch.ones(2)}})
    with pytest.raises(IndexError, match=r"^sum at leaf 'a': Dimension out of range"):
        t.sum(dim=5)
    with pytest.raises(IndexError, match=r"^index at leaf 'a': index 5 is out of bounds"):
        t[5]
    for make in (ttorch.tensor, ttorch.as_tensor):
        with pytest.raises(ValueError, match=rf"^{make.__name__} at leaf 'b.x': expected sequence of length 2") as info:
            make({"a": [1, 2], "b": {"x": [[1, 2], [3]]}})
        assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(TypeError, match=r"Tensor at leaf 'q': .*str"):
        ttorch.Tensor({"q": "text"}, dtype=torch.float32)
    for fn in (ttorch.cat, ttorch.stack):
        with pytest.raises(TypeError, match=rf"^{fn.__name__}: expects a list or tuple of trees or tensors"):
            fn(t, t)  # the list forgotten: a tree iterates its keys
    assert ttorch.cat((t, t)).a.shape == (6,) and ttorch.stack([t, t]).b.c.shape == (2, 2)
    assert torch.equal(ttorch.cat([t, torch.ones(1)]).b.c, torch.ones(3))  # joins every leaf
    with pytest.raises(ValueError, match=r"at 'b' argument 0 is a leaf but argument 1 is a subtree "
                                         r"with keys \{c\}$"):  # no C++ remedy (inherit) named
        ttorch.Tensor({"a": torch.ones(3), "b": torch.ones(2)}).add_(t)


def test_printing_layout():
    t = ttorch.Tensor({"a": torch.tensor([1.0, 2.0]), "b": {"x": torch.tensor([3, 4])}})
    assert str(t) == (
        "<TreeTensor>\n"
        "├── a --> tensor([1., 2.])\n"
        "└── b --> <TreeTensor>\n"
        "    └── x --> tensor([3, 4])"
    )
    assert repr(t.b) == "<TreeTensor>\n└── x --> tensor([3, 4])"
    assert "torch.Size([2])" in repr(t.shape)


def test_meta_leaves_print_as_torch_prints_them():
    """A tree loaded with map_location='meta' prints: each leaf as torch's repr of it."""
    leaves = {"a": torch.ones(2, device="meta"), "b": torch.ones(2, 3, device="meta", dtype=torch.int64),
              "c": torch.ones((), device="meta"), "d": torch.ones(0, device="meta", requires_grad=True),
              "z": torch.ones(2, device="meta", dtype=torch.complex64)}
    leaves["e"] = leaves["d"] * 2
    t = ttorch.Tensor(leaves)
    for k, v in leaves.items():
        assert f"{k} --> {v!r}" in str(t)


def test_leaves_print_as_torch_prints_them(capfd):
    """torch's repr of each leaf: complex leaves with a format for the real parts and one for
    the imaginary parts (they printed LibTorch's C++ form, imaginary parts dropped), widths from
    the nonzero finite elements ("0." beside "nan"), a summarised leaf's format from the
    elements it shows (torch's get_summarized_data)."""
    shown_int = torch.arange(2000.0)
    shown_int[1000] = 0.5  # not shown: the format stays torch's
    leaves = {"c": torch.tensor([1 + 1j, 2 - 10j]), "d": torch.tensor([1.5 + 2j, -0.25 - 1j], dtype=torch.complex128),
              "e": torch.tensor(3 + 4j), "f": torch.tensor([float("nan") + 1j, 2.0]), "g": torch.zeros(3, dtype=torch.complex64),
              "h": torch.tensor([0.0, float("nan")]), "i": torch.tensor([1e-6, 1.0]), "j": torch.tensor([1.0, 2000.0]),
              "k": torch.tensor([float("inf"), 1.5]), "m": torch.tensor([0.1, 0.25], dtype=torch.float16)}
    text = str(ttorch.Tensor(leaves))
    for k, v in leaves.items():
        assert f"{k} --> {v!r}" in text
    for v in (shown_int, torch.randn(2000, dtype=torch.complex64), torch.randn(3, 4, dtype=torch.complex128)):
        assert str(ttorch.Tensor({"x": v})).split("x --> ", 1)[1].split() == repr(v).split()
    assert "discards the imaginary part" not in capfd.readouterr().err


def test_tree_reductions_promote_before_reducing_as_torch_cat_does():
    t = ttorch.Tensor({"a": torch.ones(70000, dtype=torch.float16), "b": torch.ones(1)})
    assert t.sum().item() == torch.cat([t.a, t.b]).sum().item() == 70001  # not float16's inf
    m = ttorch.Tensor({"a": torch.tensor([True, False]), "b": torch.tensor([0.5])})
    assert torch.allclose(m.std(), torch.cat([m.a, m.b]).std())  # a bool leaf taken as float


def test_dict_round_trip_keeps_objects():
    d = sample()
    t = ttorch.Tensor(d)
    back = t.to_dict()
    assert back["a"] is d["a"] and back["b"]["x"] is d["b"]["x"] and back["b"]["y"] is d["b"]["y"]
    assert ttorch.to_dict(d)["a"] is d["a"]
    assert ttorch.from_dict(d).a is d["a"]
    # a tensor made in C++ keeps its Python object while the tree holds it
    r = t + 1
    first = r.a
    assert r.a is first and r.to_dict()["a"] is first


def test_refcounts_and_no_leak():
    d = sample()
    before = [sys.getrefcount(d["a"]), sys.getrefcount(d["b"]["x"])]
    t = ttorch.Tensor(d)
    for _ in range(100):
        t.to_dict(), t.a, t["b"].x
    del t
    gc.collect()
    assert [sys.getrefcount(d["a"]), sys.getrefcount(d["b"]["x"])] == before
    # results are freed: the leaf tensors die with the last reference
    r = ttorch.Tensor(d) * 2
    ref = weakref.ref(r.a)
    del r
    gc.collect()
    assert ref() is None

    a = ttorch.Tensor({f"k{i}": torch.ones(4) for i in range(20)})
    b = ttorch.Tensor({f"k{i}": torch.ones(4) for i in range(20)})
    for _ in range(1000):  # warm-up: caches, free lists
        c = a + b
        c.k0
    gc.collect()
    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    for _ in range(10000):
        c = a + b
        c += 1
        c.k3
        c.to_dict()
    del c
    gc.collect()
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
    assert grown < 64 * 1024, f"{grown} bytes of Python memory grew over 10,000 ops"


def test_shape_dtype_device_attributes():
    t = ttorch.Tensor(sample())
    s = t.shape
    assert s.a == torch.Size([2, 3]) and s.b.x == torch.Size([2]) and s.b.y == torch.Size([])
    assert s == {"a": torch.Size([2, 3]), "b": {"x": torch.Size([2]), "y": torch.Size([])}}
    assert t.dtype.a is torch.float32
    assert t.device.b.x == torch.device("cpu")
    assert t.numel() == 9  # the total (DI-treetensor); per leaf: t.shape's leaves' numel()
    assert t.requires_grad == {"a": False, "b": {"x": False, "y": False}}
    assert t.dim() == {"a": 2, "b": {"x": 1, "y": 0}} and t.ndim.b.x == 1
    # a Size tree is a tree of shapes for construction
    z = ttorch.zeros(t.shape)
    assert z.shape == t.shape


def test_leafwise_indexing():
    t = ttorch.Tensor({"a": torch.arange(6).reshape(2, 3), "b": torch.arange(4).reshape(2, 2)})
    dicts_equal(t[0], {"a": torch.tensor([0, 1, 2]), "b": torch.tensor([0, 1])})
    dicts_equal(t[:, -1], {"a": torch.tensor([2, 5]), "b": torch.tensor([1, 3])})
    t[0] = 7
    assert t.a[0].tolist() == [7, 7, 7] and t.b[0].tolist() == [7, 7]
    with pytest.raises(IndexError, match=r"index at leaf 'a': index 2 is out of bounds") as info:
        t[2]  # both leaves have 2 rows; 'a' comes first
    assert isinstance(info.value.__cause__, IndexError)
    with pytest.raises(ZeroDivisionError, match=r"map at leaf 'a'"):
        t.map(lambda x: 1 / 0)


def test_equality_as_ditreetensor():
    a = ttorch.Tensor(sample())
    b = ttorch.Tensor(sample())
    eq = a == b  # leaf-wise, a tree of bool tensors
    assert isinstance(eq, ttorch.Tensor) and eq.all().item()
    assert ttorch.equal(a, b) and a.equal(b)
    b.b.x[0] = 9
    assert not ttorch.equal(a, b)
    assert not ttorch.equal(a, ttorch.Tensor({"a": torch.ones(1)}))  # structure differs: False
    assert ttorch.allclose(a, a + 1e-9)


def test_cpp_capsule_round_trip():
    d = sample()
    t = ttorch.Tensor(d)
    cap = t.b._to_capsule()  # what treetensor/python.hpp's from_python reads
    back = ttorch.Tensor._from_capsule(cap)
    assert back.x is d["b"]["x"] and back.keys() == ["x", "y"]
    with pytest.raises(TypeError):
        ttorch.Tensor._from_capsule(object())


def test_pickle_and_copy():
    import copy
    import pickle

    t = ttorch.Tensor(sample())
    u = pickle.loads(pickle.dumps(t))
    assert isinstance(u, ttorch.Tensor) and ttorch.equal(t, u) and u.a is not t.a
    c = copy.copy(t)
    assert c.a is t.a  # shallow: the same leaves
    dc = copy.deepcopy(t)
    assert ttorch.equal(dc, t) and dc.a is not t.a


def interop_module():
    """python/tests/interop, a user's C++ extension built against the installed package by
    ctest's fixture (python_interop_build), which names its folder in TREETENSOR_INTEROP_DIR."""
    where = os.environ.get("TREETENSOR_INTEROP_DIR")
    if not where:
        pytest.skip("TREETENSOR_INTEROP_DIR is not set (ctest builds python/tests/interop)")
    sys.path.insert(0, where)
    try:
        import _treetensor_interop
    finally:
        sys.path.remove(where)
    return _treetensor_interop


def test_cpp_extension_exchanges_trees():
    _interop = interop_module()
    d = sample()
    t = ttorch.Tensor(d)
    back = _interop.same(t)
    assert isinstance(back, ttorch.Tensor) and back.a is d["a"] and back.b.x is d["b"]["x"]
    dicts = _interop.double_it(t.b)
    assert torch.equal(dicts.x, d["b"]["x"] * 2) and dicts.keys() == ["x", "y"]
    with pytest.raises(ValueError, match="not a treetensor.torch.Tensor"):
        _interop.same(torch.ones(1))


def test_cpp_extension_shares_the_runtime():
    _interop = interop_module()
    ttorch.stream(2)  # process-wide: the extension's calls see it only through the one library
    assert _interop.stream_mode() == "stream(2)"


def _walk(d, prefix=()):
    """(path, leaf) pairs in sorted-key depth-first order: the hand-written flatten."""
    for k in sorted(d):
        if isinstance(d[k], dict):
            yield from _walk(d[k], prefix + (k,))
        else:
            yield prefix + (k,), d[k]


def test_spec_paths_where_branches_repeat_keys():
    """Paths share their ancestors' key strs: same names under different parents, a deep chain,
    a leaf after a deeper branch and the empty tree still give the hand-written flatten's."""
    d = {"a": {"xx": {"k": torch.ones(1)}, "y": torch.ones(1)}, "b": {"xx": {"k": torch.ones(1), "m": torch.ones(1)}},
         "c": torch.ones(1), "xx": {"xx": {"xx": {"xx": torch.ones(1)}}}}
    paths = ttorch.tree_flatten(ttorch.Tensor(d))[1].paths()
    assert paths == [p for p, _ in _walk(d)]
    # (one-character strs are CPython's singletons: "xx" shows which strs are shared)
    assert paths[0][1] is not paths[2][1] and paths[2][1] is paths[3][1]  # a.xx vs b.xx; b.xx shared
    assert ttorch.tree_flatten(ttorch.Tensor({}))[1].paths() == []


def test_tree_flatten_and_unflatten():
    d = {"z": torch.ones(1), "b": {"y": torch.zeros(2), "x": torch.arange(3)}, "a": torch.tensor(5.0)}
    t = ttorch.Tensor(d)
    leaves, spec = ttorch.tree_flatten(t)
    want = list(_walk(d))
    assert [p for p, _ in want] == spec.paths() == [("a",), ("b", "x"), ("b", "y"), ("z",)]
    assert all(a is b for a, (_, b) in zip(leaves, want))  # the same tensor objects
    assert spec.num_leaves == 4 and spec.num_nodes == 6 and "4 leaves: a, b.x, b.y, z" in repr(spec)
    doubled = ttorch.tree_unflatten(spec, [x * 2 for x in leaves])
    dicts_equal(doubled, {"z": d["z"] * 2, "b": {"y": d["b"]["y"] * 2, "x": d["b"]["x"] * 2}, "a": d["a"] * 2})
    again = ttorch.tree_flatten(doubled)[1]
    assert again == spec and hash(again) == hash(spec) and spec != ttorch.tree_flatten(t.b)[1] and spec != 1
    cons = ttorch.tree_flatten(ttorch.Tensor(sample()).consolidate())
    assert cons[1] == ttorch.tree_flatten(ttorch.Tensor(sample()))[1]
    assert [float(x.sum()) for x in cons[0]] == [15.0, 3.0, 3.0]
    assert ttorch.tree_unflatten(ttorch.tree_flatten(ttorch.Tensor({}))[1], []).keys() == []


def test_tree_unflatten_takes_any_sequence_and_keeps_the_tensors():
    leaves, spec = ttorch.tree_flatten(ttorch.Tensor(sample()))

    class Leaves(collections.abc.Sequence):  # neither a list nor a tuple
        def __len__(self):
            return len(leaves)

        def __getitem__(self, i):
            return leaves[i]

    for given in (leaves, tuple(leaves), Leaves()):
        back = ttorch.tree_unflatten(spec, given)
        assert all(a is b for a, b in zip(ttorch.tree_flatten(back)[0], leaves))  # not copies
        assert ttorch.tree_flatten(back)[1] == spec

    class Reversed(list):  # a list subclass is read through its own __len__ and __getitem__
        def __getitem__(self, i):
            return list.__getitem__(self, len(self) - 1 - i)

    back = ttorch.tree_unflatten(spec, Reversed(leaves))
    assert all(a is b for a, b in zip(ttorch.tree_flatten(back)[0], leaves[::-1]))


def test_tree_unflatten_refuses_what_does_not_fit():
    leaves, spec = ttorch.tree_flatten(ttorch.Tensor(sample()))
    with pytest.raises(ValueError, match="the spec has 3 leaves but 2 were given"):
        ttorch.tree_unflatten(spec, leaves[:2])
    with pytest.raises(TypeError, match=r"leaf 1 \(at 'b\.x'\) is a float, not a torch\.Tensor"):
        ttorch.tree_unflatten(spec, [leaves[0], 1.5, leaves[2]])

    class Disguised:  # isinstance(Disguised(), torch.Tensor) is True; it is no tensor
        __class__ = torch.Tensor

    with pytest.raises(TypeError, match=r"leaf 2 \(at 'b\.y'\) is .*, not a torch\.Tensor"):
        ttorch.tree_unflatten(spec, [leaves[0], leaves[1], Disguised()])
    with pytest.raises(TypeError, match="expected a treetensor tree, a nested dict of tensors "
                       "or a treevalue TreeValue, got list"):
        ttorch.tree_flatten([torch.ones(1)])


def test_tree_flatten_reads_a_nested_dict_as_its_tree():
    """As torch.utils._pytree: a nested dict is flattened as the tree it makes (the same tensor
    objects); a leaf that is no tensor is refused, naming its path."""
    d = {"z": torch.ones(1), "b": {"y": torch.zeros(2), "x": torch.arange(3)}}
    leaves, spec = ttorch.tree_flatten(d)
    assert spec == ttorch.tree_flatten(ttorch.Tensor(d))[1] and spec.paths() == [("b", "x"), ("b", "y"), ("z",)]
    assert leaves[0] is d["b"]["x"] and leaves[1] is d["b"]["y"] and leaves[2] is d["z"]
    with pytest.raises(TypeError, match=r"tree_flatten: leaf 'b\.q' is an int, not a torch\.Tensor"):
        ttorch.tree_flatten({"a": torch.ones(1), "b": {"q": 1}})
    with pytest.raises(TypeError, match="key 1 at '<root>' is not a string"):
        ttorch.tree_flatten({1: torch.ones(1)})
    inner = ttorch.Tensor({"p": torch.ones(2)})  # a tree among the values: its leaves
    leaves, spec = ttorch.tree_flatten({"a": torch.zeros(1), "t": inner})
    assert spec.paths() == [("a",), ("t", "p")] and leaves[1] is inner.p
    with pytest.raises(TypeError, match=r"leaf 'o' is a treetensor\.common\.Object, not a torch\.Tensor"):
        ttorch.tree_flatten({"o": tc.Object({"x": 1})})
    loop = {"a": torch.ones(1)}
    loop["me"] = loop
    with pytest.raises(ValueError, match="is the dict at"):
        ttorch.tree_flatten(loop)


def test_keys_and_items_follow_every_change_of_keys():
    """keys()/items() reuse their str objects per node while the keys stay (the root's
    version): every change of keys, at any depth and through any view, is seen."""
    t = ttorch.Tensor({"a": torch.ones(1), "b": {"x": torch.zeros(1)}})
    view = t.b
    assert t.keys() == ["a", "b"] and view.keys() == ["x"]
    listed = t.keys()
    listed.append("not a key")  # a fresh list each call
    assert t.keys() == ["a", "b"] and t.keys()[0] is t.keys()[0]
    t.c = torch.ones(2)
    assert t.keys() == ["a", "b", "c"]
    del t.a
    assert t.keys() == ["b", "c"] and [k for k, _ in t.items()] == ["b", "c"]
    view.y = torch.ones(3)  # through a view: the root's keys changed
    assert t.b.keys() == ["x", "y"] and [k for k, _ in view.items()] == ["x", "y"]
    t.b = {"z": torch.ones(1), "w": {"q": torch.ones(1)}}  # the view keeps the replaced node
    assert view.keys() == ["x", "y"] and t.b.keys() == ["w", "z"] and t.b.w.keys() == ["q"]
    t.b.w.pop("q")
    assert t.b.w.keys() == [] and t.b.keys() == ["w", "z"]
    t.update({"d": torch.ones(1)})
    assert t.keys() == ["b", "c", "d"] and dict(t.items())["d"].shape == (1,)


def test_tree_flatten_spec_follows_every_change_of_keys():
    """tree_flatten keeps one spec object per node while the keys stay; paths() made once."""
    t = ttorch.Tensor({"a": torch.ones(1), "b": {"x": torch.zeros(1)}})
    leaves, spec = ttorch.tree_flatten(t)
    leaves2, spec2 = ttorch.tree_flatten(t)
    assert spec2 is spec and leaves2 == leaves and leaves2 is not leaves
    paths = spec.paths()
    paths.append(("not", "a", "path"))  # a new list each call
    assert spec.paths() == [("a",), ("b", "x")]
    t.b.y = torch.ones(2)  # through a view
    leaves3, spec3 = ttorch.tree_flatten(t)
    assert spec3 != spec and spec3.paths() == [("a",), ("b", "x"), ("b", "y")] and len(leaves3) == 3
    assert spec.paths() == [("a",), ("b", "x")]  # an old spec keeps its structure
    t.a = torch.full((3,), 7.0)  # a new leaf under the same key: the leaves follow
    leaves4, spec4 = ttorch.tree_flatten(t)
    assert spec4 == spec3 and torch.equal(leaves4[0], torch.full((3,), 7.0))
    assert torch.equal(ttorch.tree_unflatten(spec4, leaves4).b.y, torch.ones(2))
    sub_leaves, sub_spec = ttorch.tree_flatten(t.b)
    assert sub_spec.paths() == [("x",), ("y",)] and sub_leaves[1] is t.b.y


def test_a_view_keeps_its_node_and_follows_the_tree_until_its_key_changes():
    """Views detach when their key (or one above) is replaced or deleted; the node itself
    given back (``t.b += 1``, ``t.b = t.b``, ``t.update(t)``) changes nothing."""
    t = ttorch.Tensor({"b": {"x": torch.ones(2), "s": {"z": torch.zeros(1)}}, "c": torch.ones(1)})
    v, deep = t.b, t.b.s
    t.b += 1
    t.b = t.b
    t.update(t)
    v.y = torch.zeros(1)
    deep.w = torch.ones(1)
    assert "y" in t.b and "w" in t.b.s and torch.equal(t.b.x, torch.full((2,), 2.0))
    t.b = {"q": torch.ones(3)}  # replaced: v and deep keep the old node, together
    assert v.keys() == ["s", "x", "y"] and t.b.keys() == ["q"] and v.s.keys() == ["w", "z"]
    deep.k = torch.ones(1)
    assert "k" in v.s and "k" not in t.b  # one root for both views
    x = t.b
    del t["b"]
    assert x.keys() == ["q"] and "b" not in t
    t.b = x  # copied in: keys added through x later stay out of t
    x.new = torch.ones(1)
    assert "new" not in t.b
