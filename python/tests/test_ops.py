"""Every function against the plain-torch dict comprehension on the same inputs."""
import os
import tomllib

import pytest
import torch

import treetensor.torch as ttorch
from conftest import ROOT, dicts_equal


def registry(shape):
    """The op names of one shape of the op registry, codegen/ops.toml (read here, not through
    the package's generated _ops.py, so that a stale installed package cannot hide an op)."""
    with open(os.path.join(ROOT, "codegen", "ops.toml"), "rb") as f:
        return [op["name"] for op in tomllib.load(f)["ops"] if op["shape"] == shape]


UNARY_INPLACE = registry("unary_inplace")
UNARY = registry("unary")
BINARY_SCALAR = registry("binary_scalar")
BINARY_TENSOR = registry("binary_tensor")
TERNARY_VALUE = registry("ternary_value")
BINARY_WEIGHT = registry("binary_weight")
INT_OPS = {"bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor"}
SHIFTED = {"acosh": 1.0}  # ops whose domain lies above [0.1, 0.9]: inputs shifted by this


def dmap(fn, *ds):
    d0 = ds[0]
    return {k: dmap(fn, *(d[k] for d in ds)) if isinstance(v, dict) else fn(*(d[k] for d in ds))
            for k, v in d0.items()}


def inputs(name, seed=0):
    g = torch.Generator().manual_seed(seed)
    if name in INT_OPS:
        mk = lambda *s: torch.randint(0, 16, s, generator=g)  # noqa: E731
    else:
        lo = 0.1 + SHIFTED.get(name, 0.0)  # inside the domain of every op
        mk = lambda *s: torch.rand(*s, generator=g) * 0.8 + lo  # noqa: E731
    return {"a": mk(2, 3), "b": {"x": mk(4), "y": mk(3, 2)}}


def test_tables_are_read():
    assert "sigmoid" in UNARY_INPLACE and "clone" in UNARY and "mul" in BINARY_SCALAR
    assert "atan2" in BINARY_TENSOR


@pytest.mark.parametrize("name", UNARY_INPLACE + UNARY)
def test_unary(name):
    d = inputs(name)
    t = ttorch.Tensor(d)
    want = dmap(getattr(torch, name), d)
    dicts_equal(getattr(ttorch, name)(t), want)  # module function
    dicts_equal(getattr(t, name)(), want)  # method
    assert torch.equal(getattr(ttorch, name)(d["a"]), want["a"])  # no tree: the torch function
    if name in UNARY_INPLACE:
        leaves = t.to_dict()
        assert getattr(t, name + "_")() is t
        if name not in ("logical_not",):  # torch: in place writes 0/1 in the input's dtype
            dicts_equal(t, want)
        assert t.a is leaves["a"]  # the same tensor objects, changed in place


@pytest.mark.parametrize("name", BINARY_SCALAR + BINARY_TENSOR)
def test_binary(name):
    d, e = inputs(name, 0), inputs(name, 1)
    t, u = ttorch.Tensor(d), ttorch.Tensor(e)
    fn = getattr(torch, name)
    dicts_equal(getattr(ttorch, name)(t, u), dmap(fn, d, e))
    dicts_equal(getattr(t, name)(u), dmap(fn, d, e))
    s = 3 if name in INT_OPS else 0.5
    ref_s = s if name in BINARY_SCALAR else torch.tensor(s)  # at::f(Tensor, Tensor) only
    dicts_equal(getattr(ttorch, name)(t, s), dmap(lambda x: fn(x, ref_s), d))  # scalar broadcast
    dicts_equal(getattr(ttorch, name)(t, e["a"][0, 0]), dmap(lambda x: fn(x, e["a"][0, 0]), d))
    if name in BINARY_SCALAR:
        r = ttorch.Tensor(dmap(torch.clone, d))
        getattr(r, name + "_")(u)
        want = dmap(lambda x, y: getattr(x.clone(), name + "_")(y), d, e)
        dicts_equal(r, want)


@pytest.mark.parametrize("name", TERNARY_VALUE + BINARY_WEIGHT)
def test_ops_with_a_scalar_argument(name):
    """addcmul(input, tensor1, tensor2, *, value=1) and lerp(input, end, weight), with torch's
    argument names: module function, method, in place (the same tensors), a number operand, and
    torch's function without a tree."""
    d, e, f = inputs(name, 0), inputs(name, 1), inputs(name, 2)
    t, u, v = ttorch.Tensor(d), ttorch.Tensor(e), ttorch.Tensor(f)
    fn, method = getattr(torch, name), getattr(torch.Tensor, name + "_")
    if name in TERNARY_VALUE:
        args, refs, kw = (u, v), (e, f), {"value": -0.5}
    else:
        args, refs, kw = (u,), (e,), {"weight": 0.25}
    want = dmap(lambda *xs: fn(*xs, **kw), d, *refs)
    dicts_equal(getattr(ttorch, name)(t, *args, **kw), want)
    dicts_equal(getattr(t, name)(*args, **kw), want)
    if name in TERNARY_VALUE:  # a number operand, as a 0-d tensor would be (lerp's end: a tensor)
        dicts_equal(getattr(ttorch, name)(t, u, 2.0, **kw),
                    dmap(lambda x, y: fn(x, y, torch.tensor(2.0), **kw), d, e))
    assert torch.equal(getattr(ttorch, name)(d["a"], *(r["a"] for r in refs), **kw),
                       fn(d["a"], *(r["a"] for r in refs), **kw))  # no tree: torch's function
    leaves = t.to_dict()
    want = dmap(lambda *xs: method(xs[0].clone(), *xs[1:], **kw), d, *refs)
    assert getattr(t, name + "_")(*args, **kw) is t
    dicts_equal(t, want)
    assert t.a is leaves["a"]  # the same tensor objects, changed in place


def test_ops_with_a_scalar_argument_defaults_tensor_scalars_and_subtrees():
    """value=1 by default; a tensor weight (torch.lerp's Tensor overload) or one that requires
    grad goes leaf-wise through torch's function; a leaf facing a subtree broadcasts into it
    through the functions and the methods, as DI-treetensor's do."""
    d, e, f = inputs("addcmul", 0), inputs("addcmul", 1), inputs("addcmul", 2)
    t, u, v = ttorch.Tensor(d), ttorch.Tensor(e), ttorch.Tensor(f)
    dicts_equal(ttorch.addcmul(t, u, v), dmap(torch.addcmul, d, e, f))
    dicts_equal(t.addcdiv(u, v), dmap(torch.addcdiv, d, e, f))
    w = torch.full((3,), 0.25)
    assert torch.equal(ttorch.lerp(e["b"]["x"], f["b"]["x"], torch.full((4,), 0.5)),
                       torch.lerp(e["b"]["x"], f["b"]["x"], torch.full((4,), 0.5)))  # no tree
    dicts_equal(t.b.lerp(u.b, torch.full((), 0.5)), dmap(lambda x, y: torch.lerp(x, y, 0.5), d["b"], e["b"]))
    assert torch.equal(ttorch.lerp(t.a, u.a, w), torch.lerp(d["a"], e["a"], w))
    r = ttorch.Tensor({"x": d["b"]["y"].clone()})
    assert r.lerp_(ttorch.Tensor({"x": e["b"]["y"]}), torch.full((2,), 0.5)) is r
    assert torch.equal(r.x, torch.lerp(d["b"]["y"], e["b"]["y"], torch.full((2,), 0.5)))
    g = torch.tensor(0.5, requires_grad=True)  # its gradient flows: leaf-wise, not .item()
    ttorch.lerp(t, u, g).sum().backward()
    assert torch.allclose(g.grad, sum((y - x).sum() for x, y in zip(
        (d["a"], d["b"]["x"], d["b"]["y"]), (e["a"], e["b"]["x"], e["b"]["y"]))))
    leaf = ttorch.Tensor({"a": d["a"], "b": e["b"]["x"][:1]})  # b: a leaf facing t's subtree b
    for got in (ttorch.addcmul(t, leaf, v, value=2), t.addcmul(leaf, v, value=2)):
        dicts_equal(got, {"a": torch.addcmul(d["a"], d["a"], f["a"], value=2),
                          "b": {k: torch.addcmul(d["b"][k], e["b"]["x"][:1], f["b"][k], value=2)
                                for k in ("x", "y")}})
    dicts_equal(t.lerp(leaf, 0.5), {"a": torch.lerp(d["a"], d["a"], 0.5),
                                    "b": {k: torch.lerp(d["b"][k], e["b"]["x"][:1], 0.5) for k in ("x", "y")}})


OPERATORS = [
    ("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b),
    ("/", lambda a, b: a / b), ("//", lambda a, b: a // b), ("%", lambda a, b: a % b),
    ("**", lambda a, b: a ** b), ("<", lambda a, b: a < b), ("<=", lambda a, b: a <= b),
    (">", lambda a, b: a > b), (">=", lambda a, b: a >= b), ("==", lambda a, b: a == b),
    ("!=", lambda a, b: a != b),
]
INT_OPERATORS = [("&", lambda a, b: a & b), ("|", lambda a, b: a | b), ("^", lambda a, b: a ^ b),
                 ("<<", lambda a, b: a << b), (">>", lambda a, b: a >> b)]


@pytest.mark.parametrize("sym,op", OPERATORS + INT_OPERATORS, ids=[o[0] for o in OPERATORS + INT_OPERATORS])
def test_operators(sym, op):
    kind = "bitwise_and" if (sym, op) in INT_OPERATORS else "add"
    d, e = inputs(kind, 0), inputs(kind, 1)
    if kind == "bitwise_and":
        e = dmap(lambda x: x % 4, e)
    t, u = ttorch.Tensor(d), ttorch.Tensor(e)
    dicts_equal(op(t, u), dmap(op, d, e))
    s = 2
    dicts_equal(op(t, s), dmap(lambda x: op(x, s), d))  # forward with a number
    dicts_equal(op(s, t), dmap(lambda x: op(s, x), d))  # reflected
    ten = e["a"][0, 0]
    dicts_equal(op(t, ten), dmap(lambda x: op(x, ten), d))
    dicts_equal(op(ten, t), dmap(lambda x: op(ten, x), d))  # a torch.Tensor on the left


@pytest.mark.parametrize("sym,op", OPERATORS + INT_OPERATORS, ids=[o[0] for o in OPERATORS + INT_OPERATORS])
def test_operators_take_numpy_operands_as_torch_does(sym, op):
    """A numpy scalar is the Python number its item() gives and an ndarray the tensor
    torch.as_tensor makes of it (torch's type promotion, where torch.Tensor + ndarray falls
    back to numpy's arithmetic), either side: numpy defers to the tree's operators
    (__array_ufunc__ = None) instead of taking the tree for a sequence of its keys."""
    import numpy as np
    kind = "bitwise_and" if (sym, op) in INT_OPERATORS else "add"
    d = inputs(kind, 0)
    t = ttorch.Tensor(d)
    scalars = [np.int64(3), np.bool_(True)] if kind == "bitwise_and" else \
        [np.float32(2.5), np.int64(3), np.float64(0.5)]
    for s in scalars + [np.array(s) for s in scalars]:
        if isinstance(s, np.ndarray):
            dicts_equal(op(t, s), dmap(lambda x: op(x, torch.as_tensor(s)), d))
            dicts_equal(op(s, t), dmap(lambda x: op(torch.as_tensor(s), x), d))
        else:  # the number item() gives (torch's bitwise ops refuse np.int64 itself)
            dicts_equal(op(t, s), dmap(lambda x: op(x, s.item()), d))
            dicts_equal(op(s, t), dmap(lambda x: op(s.item(), x), d))


def test_a_number_divided_by_a_tree_is_torchs_bits():
    """torch computes number / tensor as tensor.reciprocal() * number: the same two roundings
    here (a plain division differs in the last bit for most numbers)."""
    d = inputs("add", 0)
    t = ttorch.Tensor(d)
    for s in (2.5, 3, 0.1, -7.25, True):
        dicts_equal(s / t, dmap(lambda x: s / x, d))
    ten = d["a"][0, 0]
    dicts_equal(ten / t, dmap(lambda x: ten / x, d))  # a tensor / a tree divides, as torch.div


def test_numpy_refuses_to_take_a_tree_for_an_array():
    import numpy as np
    t = ttorch.tensor({"a": [1.0, 2.0], "b": [3.0, 4.0]})
    for f in (np.asarray, np.array, lambda x: np.stack([x, x])):
        with pytest.raises(TypeError, match="a tree of 2 leaves is not one numpy array"):
            f(t)
    t += np.float32(1)  # in place, and in methods and functions that take numbers
    assert torch.equal(t.a, torch.tensor([2.0, 3.0]))
    assert torch.equal(t.clamp(np.float32(0), np.int64(3)).b, torch.tensor([3.0, 3.0]))
    assert torch.equal(ttorch.where(t > 3, t, np.float32(0)).a, torch.tensor([0.0, 0.0]))


@pytest.mark.parametrize("sym", ["+=", "-=", "*=", "/=", "//=", "%=", "**=", "&=", "|=", "^=", "<<=", ">>="])
def test_inplace_operators(sym):
    kind = "bitwise_and" if sym in ("&=", "|=", "^=", "<<=", ">>=") else "add"
    d, e = inputs(kind, 0), inputs(kind, 1)
    if kind == "bitwise_and":
        e = dmap(lambda x: x % 4, e)
    t, u = ttorch.Tensor(dmap(torch.clone, d)), ttorch.Tensor(e)
    leaves = t.to_dict()
    code = compile(f"t {sym} u", "<op>", "exec")
    ns = {"t": t, "u": u}
    exec(code, ns)
    assert ns["t"] is t and t.a is leaves["a"]
    want = {}
    for k in ("a",):
        x = d[k].clone()
        ns2 = {"x": x, "y": e[k]}
        exec(compile(f"x {sym} y", "<op>", "exec"), ns2)
        want[k] = ns2["x"]
    assert torch.equal(t.a, want["a"])


def test_unary_operators_and_matmul():
    d = inputs("add")
    t = ttorch.Tensor(d)
    dicts_equal(-t, dmap(torch.neg, d))
    assert +t is t
    dicts_equal(abs(-t), dmap(torch.abs, d))
    i = ttorch.Tensor(inputs("bitwise_not"))
    dicts_equal(~i, dmap(torch.bitwise_not, inputs("bitwise_not")))
    m = {"a": torch.randn(2, 3), "b": torch.randn(4, 5)}
    n = {"a": torch.randn(3, 2), "b": torch.randn(5, 1)}
    r = ttorch.Tensor(m) @ ttorch.Tensor(n)
    for k in m:
        assert torch.allclose(r[k], m[k] @ n[k])
    r2 = ttorch.matmul(ttorch.Tensor(m), ttorch.Tensor(n))
    assert torch.allclose(r2.a, m["a"] @ n["a"])
    assert torch.allclose(ttorch.matmul(m["a"], n["a"]), m["a"] @ n["a"])


def test_add_sub_alpha_clamp_where():
    d, e = inputs("add", 0), inputs("add", 1)
    t, u = ttorch.Tensor(d), ttorch.Tensor(e)
    dicts_equal(ttorch.add(t, u, alpha=2), dmap(lambda x, y: torch.add(x, y, alpha=2), d, e))
    dicts_equal(t.sub(u, alpha=3), dmap(lambda x, y: torch.sub(x, y, alpha=3), d, e))
    dicts_equal(t.clamp(0.3, 0.6), dmap(lambda x: x.clamp(0.3, 0.6), d))
    dicts_equal(ttorch.clamp(t, min=0.5), dmap(lambda x: x.clamp(min=0.5), d))
    c = t > 0.5
    dicts_equal(ttorch.where(c, t, u), dmap(lambda x, y: torch.where(x > 0.5, x, y), d, e))
    dicts_equal(t.where(c, 0.0), dmap(lambda x: torch.where(x > 0.5, x, torch.tensor(0.0)), d))
    dicts_equal(ttorch.lerp(t, u, 0.25), dmap(lambda x, y: torch.lerp(x, y, 0.25), d, e))
    dicts_equal(ttorch.addcmul(t, t, u, value=2), dmap(lambda x, y: torch.addcmul(x, x, y, value=2), d, e))


def flat(d):
    out = []
    for k in sorted(d):
        out += flat(d[k]) if isinstance(d[k], dict) else [d[k].reshape(-1)]
    return out


def test_reductions_tree_level_and_per_leaf():
    d = inputs("add")
    t = ttorch.Tensor(d)
    allv = torch.cat(flat(d))
    assert torch.allclose(t.sum(), allv.sum()) and torch.allclose(ttorch.sum(t), allv.sum())
    assert torch.allclose(ttorch.mean(t), allv.mean())
    assert torch.equal(ttorch.min(t), allv.min()) and torch.equal(t.max(), allv.max())
    assert torch.allclose(ttorch.std(t), allv.std())
    dicts_equal(ttorch.norm(t), dmap(torch.norm, d))  # per leaf (DI-treetensor)
    dicts_equal(ttorch.norm(t, p=1), dmap(lambda x: torch.norm(x, p=1), d))
    assert ttorch.all(t > 0).item() and not ttorch.any(t > 1).item()
    dicts_equal(ttorch.sum(t, dim=0), dmap(lambda x: x.sum(dim=0), d))
    dicts_equal(t.mean(dim=0, keepdim=True), dmap(lambda x: x.mean(dim=0, keepdim=True), d))
    v, i = t.max(dim=0)
    dicts_equal(v, dmap(lambda x: x.max(dim=0).values, d))
    dicts_equal(i, dmap(lambda x: x.max(dim=0).indices, d))
    mask = t > 0.5
    assert torch.equal(ttorch.masked_select(t, mask), torch.cat([x[x > 0.5] for x in flat(d)]))
    assert torch.equal(ttorch.sum(d["a"]), d["a"].sum())  # no tree: torch.sum


def test_shape_functions():
    d = {"a": torch.randn(4, 6), "b": {"x": torch.randn(4, 2)}}
    t = ttorch.Tensor(d)
    dicts_equal(t.reshape(-1), dmap(lambda x: x.reshape(-1), d))
    dicts_equal(ttorch.reshape(t, (2, -1)), dmap(lambda x: x.reshape(2, -1), d))
    dicts_equal(t.unsqueeze(0), dmap(lambda x: x.unsqueeze(0), d))
    dicts_equal(t.unsqueeze(1).squeeze(1), d)
    dicts_equal(ttorch.squeeze(t.unsqueeze(0)), d)
    dicts_equal(t.transpose(0, 1), dmap(lambda x: x.transpose(0, 1), d))
    dicts_equal(t.permute(1, 0), dmap(lambda x: x.permute(1, 0), d))
    dicts_equal(t.flatten(), dmap(torch.flatten, d))
    idx = torch.tensor([0, 2])
    dicts_equal(ttorch.index_select(t, 0, idx), dmap(lambda x: x.index_select(0, idx), d))
    parts = ttorch.split(t, 3)
    assert isinstance(parts, tuple) and len(parts) == 2
    dicts_equal(parts[1], dmap(lambda x: x.split(3)[1], d))
    parts = t.split([1, 3])
    dicts_equal(parts[1], dmap(lambda x: x.split([1, 3])[1], d))
    ch = ttorch.chunk(t, 2, dim=0)
    dicts_equal(ch[0], dmap(lambda x: x.chunk(2)[0], d))
    dicts_equal(ttorch.cat([t, t], dim=1), dmap(lambda x: torch.cat([x, x], dim=1), d))
    dicts_equal(ttorch.stack([t, t]), dmap(lambda x: torch.stack([x, x]), d))
    dicts_equal(t.unbind(0)[3], dmap(lambda x: x[3], d))
    dicts_equal(t.double(), dmap(lambda x: x.double(), d))
    dicts_equal(t.to(torch.int32), dmap(lambda x: x.to(torch.int32), d))
    dicts_equal(t.to("cpu", dtype=torch.float64), dmap(lambda x: x.double(), d))


def test_construction():
    shapes = {"a": (2, 3), "b": {"x": [4], "y": torch.Size([1, 2])}, "c": 5}
    for name in ["randn", "rand", "zeros", "ones", "empty"]:
        t = getattr(ttorch, name)(shapes)
        assert t.shape == {"a": torch.Size([2, 3]), "b": {"x": torch.Size([4]), "y": torch.Size([1, 2])},
                           "c": torch.Size([5])}, name
    assert ttorch.zeros(shapes).sum().item() == 0 and ttorch.ones(shapes).sum().item() == 17
    f = ttorch.full(shapes, 2.5, dtype=torch.float64)
    assert f.dtype.a is torch.float64 and ttorch.all(f == 2.5).item()
    r = ttorch.randint(0, 5, shapes)
    assert r.dtype.a is torch.int64 and ttorch.all(r < 5).item() and ttorch.all(r >= 0).item()
    r = ttorch.randint(3, shapes, dtype=torch.int32)
    assert r.dtype.c is torch.int32 and ttorch.all(r < 3).item()
    g = ttorch.randn(shapes, requires_grad=True)
    assert g.requires_grad.a
    torch.manual_seed(3)
    a = ttorch.randn(shapes)
    torch.manual_seed(3)
    assert ttorch.equal(a, ttorch.randn(shapes))  # reproducible after manual_seed
    torch.manual_seed(3)  # torch's values, leaf by leaf in sorted-key order (DI-treetensor)
    assert all(torch.equal(leaf, torch.randn(leaf.shape)) for leaf in ttorch.tree_flatten(a)[0])
    with ttorch.stream(2):
        torch.manual_seed(3)
        assert ttorch.equal(a, ttorch.randn(shapes))  # whatever the mode
    g = torch.Generator().manual_seed(7)
    b = ttorch.rand(shapes, generator=g)
    g.manual_seed(7)
    assert ttorch.equal(b, ttorch.rand(shapes, generator=g))
    r = ttorch.randn_like(a, generator=g.manual_seed(7))
    g.manual_seed(7)
    assert all(torch.equal(x, torch.randn(x.shape, generator=g)) for x in ttorch.tree_flatten(r)[0])
    for name in ["zeros_like", "ones_like", "empty_like", "randn_like", "rand_like"]:
        assert getattr(ttorch, name)(a).shape == a.shape
    assert ttorch.full_like(a, 7).a.eq(7).all()
    assert ttorch.randint_like(a, 2, 4).b.x.ge(2).all()
    assert ttorch.zeros_like(a, dtype=torch.int8).dtype.a is torch.int8
    assert type(ttorch.randn(2, 3)) is torch.Tensor  # plain torch without a tree
    tt = ttorch.tensor({"a": [1, 2, 3], "b": {"x": [0.5]}})
    assert tt.a.tolist() == [1, 2, 3] and tt.b.x.dtype is torch.float32
    x = torch.ones(2)
    at = ttorch.as_tensor({"a": x})
    assert at.a is x  # shared when dtype and device already fit
    assert ttorch.as_tensor({"a": x}, dtype=torch.float64).a.dtype is torch.float64


def test_autograd():
    t = ttorch.randn({"a": (2, 3), "b": {"x": (4,)}})
    assert t.requires_grad_() is t
    loss = (t * t).sum()
    loss.backward()
    dicts_equal(t.grad, dmap(lambda x: 2 * x.detach(), t.to_dict()))
    u = ttorch.randn({"a": (2,), "b": (3,)}, requires_grad=True)
    y = u.sigmoid()
    y.backward(ttorch.ones_like(y))
    dicts_equal(u.grad, dmap(lambda x: torch.sigmoid(x) * (1 - torch.sigmoid(x)), u.detach().to_dict()))


def test_backward_errors_name_the_path():
    t = ttorch.Tensor({"a": torch.ones(2, requires_grad=True), "b": {"x": torch.ones(3, requires_grad=True)}})
    y = t * 2
    for extra in ({"c": torch.ones(1)}, {}):
        g = {"a": torch.ones(2), "b": {"x": torch.ones(3)} if extra else {"y": torch.ones(3)}, **extra}
        with pytest.raises(ValueError, match="backward: key mismatch at '(<root>|b)': argument 0 has keys"):
            y.backward(ttorch.Tensor(g), retain_graph=True)
    with pytest.raises(RuntimeError, match=r"backward at leaf 'b\.x': the gradient has shape \[2\], the leaf \[3\]"):
        y.backward({"a": torch.ones(2), "b": {"x": torch.ones(2)}}, retain_graph=True)
    with pytest.raises(RuntimeError, match="backward at leaf 'a': the leaf has 2 elements"):
        y.backward(retain_graph=True)
    with pytest.raises(TypeError, match="gradient must be a tree"):
        y.backward(5, retain_graph=True)
    with pytest.raises(TypeError, match="backward: self must be a tree, not Tensor"):
        ttorch.Tensor.backward(torch.ones((), requires_grad=True))
    assert t.grad.a is None  # nothing ran
    y.backward({"a": torch.ones(2), "b": {"x": torch.full((3,), 2.0)}})  # a dict is a tree here
    assert torch.equal(t.grad.a, torch.full((2,), 2.0)) and torch.equal(t.grad.b.x, torch.full((3,), 4.0))


def test_structure_mismatch_names_the_path():
    a = ttorch.Tensor({"a": torch.ones(2), "b": {"x": torch.ones(2)}})
    b = ttorch.Tensor({"a": torch.ones(2), "b": {"y": torch.ones(2)}})
    with pytest.raises(ValueError, match=r"at 'b'.*argument 0 has keys \{x\}, argument 1 has keys \{y\}"):
        a + b
    with pytest.raises(RuntimeError, match=r"matmul at leaf 'b\.x'"):
        ttorch.matmul(a, ttorch.Tensor({"a": torch.ones(2), "b": {"x": torch.ones(3)}}))
    with pytest.raises(TypeError, match="unsupported operand"):
        a.mul("text")
    with pytest.raises(TypeError, match=r"reshape at leaf 'a': .*tuple of ints"):
        a.reshape("x")  # not a shape here: torch's per leaf, whose error names the leaf
    with pytest.raises(TypeError, match="expected ints"):
        a.reshape(2, "x")
    with pytest.raises(TypeError, match=r"shape at 'b\.x'"):
        ttorch.zeros({"a": (2,), "b": {"x": ("q",)}})
    with pytest.raises(RuntimeError, match="randn at leaf 'a'"):
        ttorch.randn({"a": (-1,)})


def test_consolidated_trees_run_flat_with_the_dict_comprehensions_values():
    """Consolidated operands: one C++ call per buffer; the values are the per-leaf ones (add and
    mul are correctly rounded, so bitwise), results stay consolidated, in-place ops keep it."""
    a, b = inputs("add", 1), inputs("add", 2)
    ca, cb = ttorch.Tensor(a).consolidate(), ttorch.Tensor(b).consolidate()
    r = ca * 2 + cb
    assert r.is_consolidated()
    dicts_equal(r, dmap(lambda x, y: x * 2 + y, a, b))
    dicts_equal(ca, a)  # the operands are untouched
    ca += cb
    assert ca.is_consolidated()
    dicts_equal(ca, dmap(lambda x, y: x + y, a, b))
    # The tree sum reduces the buffer's leaf elements, in flatten order: the sum of their cat.
    assert torch.equal(r.sum(), torch.cat([r.a.flatten(), r.b.x.flatten(), r.b.y.flatten()]).sum())


def test_a_consolidated_tree_whose_leaves_changed_in_place_runs_per_leaf():
    """A leaf reshaped or re-pointed in place (the per-leaf fallback's unsqueeze_, a leaf's t_ or
    .data =) has left the buffer: the tree is no longer consolidated and ops see the leaves,
    not the buffer's old layout. requires_grad_() flags the tree's own leaves."""
    a = {"a": torch.randn(3, 4), "b": {"x": torch.randn(5)}}
    c = ttorch.Tensor(a).consolidate()
    c.unsqueeze_(0)
    assert not c.is_consolidated()
    dicts_equal(c + 1, dmap(lambda x: x.unsqueeze(0) + 1, a))
    c = ttorch.Tensor(a).consolidate()
    c.a.t_()
    dicts_equal(c * 1, {"a": a["a"].t(), "b": {"x": a["b"]["x"]}})
    c = ttorch.Tensor(a).consolidate()
    c.a.data = torch.zeros(3, 4)
    assert torch.equal((c + 1).a, torch.ones(3, 4))
    c = ttorch.Tensor(a).consolidate()
    assert c.requires_grad_() is c
    assert c.a.requires_grad and c.b.x.requires_grad
    c.sin().sum().backward()
    assert torch.equal(c.a.grad, a["a"].cos()) and torch.equal(c.b.x.grad, a["b"]["x"].cos())


def test_leaves_computed_without_aten_keep_what_torch_gives():
    """The per-leaf shortcut past ATen's dispatcher (DESIGN.md §5) must leave what torch gives:
    forward-mode tangents, a size-1 dimension's stride, ATen's errors."""
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.randn(5), torch.ones(5))
        t = ttorch.Tensor({"a": dual})
        for got, want in (((t * 2).a, dual * 2), ((-t).a, -dual), ((t * t).a, dual * dual)):
            assert torch.equal(fwAD.unpack_dual(got).tangent, fwAD.unpack_dual(want).tangent)
    column = torch.randn(1, 3).t()  # contiguous, stride (1, 3)
    assert (ttorch.Tensor({"a": column}) + 1).a.stride() == (column + 1).stride()
    nc11 = torch.randn(2, 3, 1, 1).contiguous(memory_format=torch.channels_last)
    assert (ttorch.Tensor({"a": nc11}) + 1).a.stride() == (nc11 + 1).stride()
    i = torch.arange(3)
    with pytest.raises(RuntimeError, match="alpha must not be a floating point"):
        ttorch.add(ttorch.Tensor({"a": i}), ttorch.Tensor({"a": i}), alpha=1.0)
    with pytest.raises(RuntimeError, match="Subtraction, the `-` operator, with a bool"):
        ttorch.Tensor({"a": torch.randn(3)}) - True


def test_conjugate_and_negative_views_keep_their_bits_in_consolidated_trees_and_steps():
    import treetensor.optim as topt
    c = ttorch.Tensor({"a": torch.tensor([1., 2., 3.])}).consolidate()
    n = ttorch.Tensor({"a": torch._neg_view(c.a)}).consolidate()  # not c's buffer: a copy
    assert torch.equal((n + 0).a, torch.tensor([-1., -2., -3.])) and float(n.sum()) == -6.0
    z = ttorch.Tensor({"a": torch.tensor([1 + 1j, 2 + 2j])}).consolidate()
    zc = ttorch.Tensor({"a": z.a.conj()}).consolidate()
    assert torch.equal((zc * 1).a, torch.tensor([1 - 1j, 2 - 2j]))
    zc.add_(torch.tensor(1j))  # zc's leaf is a resolved copy, not a view of z
    assert torch.equal(zc.a, torch.tensor([1 + 0j, 2 - 1j]))
    p = ttorch.Tensor({"w": torch._neg_view(torch.zeros(3))})
    topt.SGD(p, lr=1.0).step(ttorch.Tensor({"w": torch.ones(3)}))
    assert torch.equal(p.w, -torch.ones(3))


def test_complex_python_scalars_as_torch_takes_them():
    shapes = {"a": (2,), "b": {"x": (1,)}}
    assert torch.equal(ttorch.full(shapes, 1j).a, torch.full((2,), 1j))
    z = ttorch.zeros(shapes, dtype=torch.complex64)
    assert torch.equal(z.fill_(2 - 1j).b.x, torch.full((1,), 2 - 1j))
    assert torch.equal(ttorch.full_like(z, 1j).a, torch.full((2,), 1j, dtype=torch.complex64))
    assert torch.equal(ttorch.add(z, z, alpha=1j).a, torch.add(z.a, z.a, alpha=1j))
    t = ttorch.Tensor({"a": torch.tensor([1., 2.]), "b": {"x": torch.tensor([-1.])}})
    for tree in (t, t.consolidate()):
        for got, want in ((tree + 1j, lambda x: x + 1j), (2j * tree, lambda x: 2j * x),
                          (ttorch.add(tree, 1 - 1j), lambda x: torch.add(x, 1 - 1j))):
            assert got.a.dtype == torch.complex64
            assert torch.equal(got.a, want(t.a)) and torch.equal(got.b.x, want(t.b.x))


def test_list_indices_as_torch_reads_them():
    d = {"a": torch.arange(12.).reshape(4, 3), "b": {"x": torch.arange(4)}}
    t = ttorch.Tensor(d)
    for key in ([0, 1], [-1, 0, -1], [True, False, True, False], [3]):
        got = t[key]
        assert torch.equal(got.a, d["a"][key]) and torch.equal(got.b.x, d["b"]["x"][key]), key
    with pytest.raises(IndexError, match="index at leaf 'a'"):
        t[[4]]
    with pytest.raises(IndexError):
        t[[True, False]]  # a mask of the wrong length, as torch refuses it
