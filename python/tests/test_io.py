"""treetensor.torch.load / save against PyTorch's own torch.load / torch.save: the same objects
(types, key types, key order, values bitwise), a training checkpoint that trains on after the
round trip, and hostile or malformed files refused without running their code."""
import collections
import inspect
import io
import os
import pathlib
import sys
import zipfile

import pytest
import torch

import treetensor.torch as ttorch
from treetensor.common import Object


def assert_same(a, b, at="<root>"):
    """a and b are the same Python object tree: types, dict key types and order, values
    (tensors bitwise, with dtype, shape, stride, requires_grad and Parameter-ness)."""
    assert type(a) is type(b), f"{at}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{at}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{at}.{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), at
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{at}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.requires_grad) == (b.dtype, b.shape, b.stride(),
                                                                    b.requires_grad), at
        assert torch.equal(a.detach(), b.detach()), at
    else:
        assert a == b, at


def model():
    # 14 parameter tensors (optimizer ids 0..13: "10" sorts before "2" as a string) and
    # BatchNorm buffers.
    layers = [torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten()]
    layers += [torch.nn.Linear(4 * 6 * 6, 16)] + [torch.nn.Linear(16, 16) for _ in range(4)]
    return torch.nn.Sequential(*layers)


def train_step(m, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    m(torch.randn(2, 3, 8, 8, generator=g)).square().mean().backward()
    opt.step()


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    train_step(m, opt, 1)
    path = tmp_path / "ck.pt"
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, path)
    return path, m, opt


def test_a_training_checkpoint_reads_as_torch_load_gives_it(checkpoint):
    path, _, _ = checkpoint
    ours = ttorch.load(path, tree=False)
    assert_same(ours, torch.load(path, weights_only=True))
    assert list(ours["optimizer"]["state"]) == list(range(14))  # int keys, the file's order
    assert type(ours["model"]) is collections.OrderedDict


def test_a_training_checkpoint_reads_as_trees(checkpoint):
    path, m, opt = checkpoint
    ck = ttorch.load(path)
    assert isinstance(ck, Object) and ck.epoch == 3
    assert isinstance(ck.model, ttorch.Tensor)
    assert sorted(ck.model.keys()) == sorted(m.state_dict().keys())
    for k, v in m.state_dict().items():
        assert torch.equal(ck.model[k], v), k
    state = ck.optimizer.state
    assert isinstance(state, Object) and state.keys() == list(range(14))
    assert list(state.to_dict()) == list(range(14))
    for i, p in enumerate(m.parameters()):
        assert isinstance(state[i], ttorch.Tensor)
        assert torch.equal(state[i].exp_avg, opt.state[p]["exp_avg"]), i
        assert torch.equal(state[i].exp_avg_sq, opt.state[p]["exp_avg_sq"]), i
    assert ck.optimizer.param_groups[0]["params"] == list(range(14))
    # A tree-level op on the loaded trees, against the loop over the state dict.
    total = ck.model.abs().sum()
    assert torch.allclose(total, sum(v.abs().sum() for v in m.state_dict().values()))


def test_a_checkpoint_tree_to_dict_loads_into_torch_and_trains_on(checkpoint):
    path, m, opt = checkpoint
    d = ttorch.load(path).to_dict()  # nested dicts down to the tensors, as torch.load's
    assert type(d["model"]) is dict and type(d["optimizer"]["state"][0]) is dict
    assert type(d["optimizer"]["param_groups"][0]) is dict  # inside lists too
    m2 = model()
    m2.load_state_dict(d["model"])
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    opt2.load_state_dict(d["optimizer"])
    for a, b in ((m, opt), (m2, opt2)):
        train_step(a, b, 2)
    for (name, p), q in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), name


DTYPES_WITHOUT_TYPED_STORAGE = [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
                                torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                                torch.float8_e8m0fnu, torch.complex32]


def bits(x):
    """x's bytes (every dtype compares through them: float8 and complex32 have no equal)."""
    return x.reshape(-1).contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES_WITHOUT_TYPED_STORAGE)
def test_dtypes_saved_as_untyped_storage_round_trip_both_ways(dtype, tmp_path):
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (2, 3, 8), dtype=torch.uint8, generator=g)
    x = raw.view(dtype)  # every bit pattern, NaNs included, compared as bytes
    sd = {"x": x, "t": x[:, 1].t(), "s": x[0, 0, :1].squeeze()}  # views of one storage
    torch.save(sd, tmp_path / "torch.pt")
    ours = ttorch.load(tmp_path / "torch.pt", tree=False)
    for k in sd:
        assert ours[k].dtype == dtype and ours[k].stride() == sd[k].stride(), k
        assert torch.equal(bits(ours[k]), bits(sd[k])), k
    assert ours["t"].untyped_storage().data_ptr() == ours["x"].untyped_storage().data_ptr()
    ttorch.save(sd, tmp_path / "ours.pt")
    back = torch.load(tmp_path / "ours.pt", weights_only=True)
    for k in sd:
        assert back[k].dtype == dtype and torch.equal(bits(back[k]), bits(sd[k])), k


def test_conjugate_and_negative_views_keep_their_values(tmp_path):
    z = torch.tensor([1 + 2j, 3 - 1j, -0.5 + 0j])
    views = {"conj": z.conj(), "neg": torch._neg_view(torch.tensor([1., -2.])), "plain": z}
    assert views["conj"].is_conj() and views["neg"].is_neg()
    torch.save(views, tmp_path / "torch.pt")
    ours = ttorch.load(tmp_path / "torch.pt", tree=False)
    torch.save(views, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    legacy = ttorch.load(tmp_path / "legacy.pt", tree=False)
    for k, v in views.items():
        assert torch.equal(legacy[k], v), k
    ttorch.save(views, tmp_path / "ours.pt")
    back = torch.load(tmp_path / "ours.pt", weights_only=True)
    for k, v in views.items():
        assert torch.equal(ours[k], v) and torch.equal(back[k], v), k
    assert ours["conj"].is_conj() and ours["neg"].is_neg()


def test_a_lone_surrogate_in_a_str_reads_and_writes_as_torch_does(tmp_path):
    obj = {"\ud800": torch.ones(1), "v": "x\udfffy"}  # pickle writes them ("surrogatepass")
    torch.save(obj, tmp_path / "s.pt")
    assert_same(ttorch.load(tmp_path / "s.pt", tree=False),
                torch.load(tmp_path / "s.pt", weights_only=True))
    tree = ttorch.load(tmp_path / "s.pt")  # no tensor tree (keys must be text): an Object
    assert isinstance(tree, Object) and torch.equal(tree["\ud800"], torch.ones(1))
    ttorch.save(obj, tmp_path / "ours.pt")
    assert_same(torch.load(tmp_path / "ours.pt", weights_only=True), obj)


def test_object_to_dict_refuses_a_cycle_and_save_names_it(tmp_path):
    o = Object({"a": 1})
    o.x = o
    with pytest.raises(ValueError, match="contains itself"):
        o.to_dict()
    with pytest.raises((TypeError, ValueError), match="cycle"):
        ttorch.save(o, tmp_path / "o.pt")


def test_saved_trees_load_into_pytorch_and_train_on_bitwise(checkpoint, tmp_path):
    path, m, opt = checkpoint
    ttorch.save(ttorch.load(path), tmp_path / "again.pt")
    back = torch.load(tmp_path / "again.pt", weights_only=True)
    assert list(back["optimizer"]["state"]) == list(range(14))
    m2 = model()
    m2.load_state_dict(back["model"])
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])
    for seed in (2, 3):
        train_step(m, opt, seed)
        train_step(m2, opt2, seed)
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k


def every_kind():
    base = torch.arange(12.0)
    return collections.OrderedDict([
        ("z", {10: torch.ones(2), 2: torch.zeros(1, dtype=torch.int16), "s": "text"}),
        ("a", [None, True, -(2**63), 1.5, 2 - 3j, "é", b"\x00\xff", torch.bfloat16,
               torch.device("cpu"), (1, (2, [3]))]),
        ("param", torch.nn.Parameter(torch.randn(3, 2))),
        ("frozen", torch.nn.Parameter(torch.randn(2), requires_grad=False)),
        ("views", {"row": base.view(3, 4)[1], "col": base.view(3, 4)[:, 2], "whole": base}),
        ("empty", {}),
        # a tree's Parameter leaves stay Parameters, as a dict's do (they were written as tensors)
        ("t", ttorch.Tensor({"b": torch.randn(2), "a": {"c": torch.tensor(7)},
                             "p": torch.nn.Parameter(torch.randn(2))})),
    ])


def as_dicts(x):
    # What torch.save makes of a tree: nested dicts in sorted key order.
    if isinstance(x, ttorch.Tensor):
        return {k: as_dicts(x[k]) for k in sorted(x.keys())}
    if isinstance(x, dict):
        return type(x)((k, as_dicts(v)) for k, v in x.items())
    return x


def test_every_kind_of_value_round_trips_both_ways(tmp_path):
    obj = every_kind()
    ttorch.save(obj, tmp_path / "ours.pt")
    assert_same(torch.load(tmp_path / "ours.pt", weights_only=True), as_dicts(obj))
    torch.save(as_dicts(obj), tmp_path / "torch.pt")
    assert_same(ttorch.load(tmp_path / "torch.pt", tree=False), as_dicts(obj))
    back = torch.load(tmp_path / "ours.pt", weights_only=True)["views"]
    assert back["row"].untyped_storage().data_ptr() == back["whole"].untyped_storage().data_ptr()


def test_sets_round_trip(tmp_path):
    ttorch.save({"s": {1, 2, 3}}, tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True) == {"s": {1, 2, 3}}
    assert ttorch.load(tmp_path / "s.pt", tree=False) == {"s": {1, 2, 3}}


def test_a_tree_round_trips(tmp_path):
    t = ttorch.Tensor({"w": torch.randn(3, 4), "x": {"b": torch.arange(5), "a": torch.ones(())}})
    ttorch.save(t, tmp_path / "t.pt")
    back = ttorch.load(tmp_path / "t.pt")
    assert isinstance(back, ttorch.Tensor)
    assert (back == t).all()
    assert back.x.b.dtype == torch.int64


def test_a_tree_given_to_torch_save_loads_as_a_tree_by_both(tmp_path):
    """torch.save pickles a tree as treetensor._C.Tensor.__new__ and its nested dict: torch.load's
    weights-only default and ttorch.load both give the tree back, inside containers too."""
    t = ttorch.Tensor({"w": torch.randn(3, 4), "x": {"b": torch.arange(5)}})
    torch.save({"params": t, "again": t, "step": 3}, tmp_path / "t.pt")
    for back in (torch.load(tmp_path / "t.pt"), ttorch.load(tmp_path / "t.pt")):
        assert isinstance(back["params"], ttorch.Tensor) and back["step"] == 3
        assert back["params"].x.b.dtype == torch.int64 and torch.equal(back["params"].w, t.w)
        assert (back["again"] == t).all()
    plain = ttorch.load(tmp_path / "t.pt", tree=False)
    assert isinstance(plain["params"], dict) and torch.equal(plain["params"]["x"]["b"], t.x.b)
    import copy, pickle
    for back in (pickle.loads(pickle.dumps(t)), copy.deepcopy(t), copy.copy(t)):
        assert isinstance(back, ttorch.Tensor) and (back == t).all()
    # The class itself is never made by a file (NEWOBJ without a state left it unmade).
    with zipfile.ZipFile(tmp_path / "new.pt", "w") as z:
        z.writestr("new/data.pkl", b"\x80\x02ctreetensor._C\nTensor\n)\x81.")
        z.writestr("new/version", "3\n")
    with pytest.raises(pickle.UnpicklingError, match="treetensor._C.Tensor"):
        torch.load(tmp_path / "new.pt")
    with pytest.raises(RuntimeError, match="global 'treetensor._C.Tensor' is not allowed"):
        ttorch.load(tmp_path / "new.pt")


def test_file_objects_and_path_like(tmp_path):
    obj = {"a": torch.randn(4), 0: [1, 2]}
    buf = io.BytesIO()
    ttorch.save(obj, buf)
    buf.seek(0)
    assert_same(torch.load(buf, weights_only=True), obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    assert_same(ttorch.load(buf, tree=False), obj)
    ttorch.save(obj, pathlib.Path(tmp_path) / "p.pt")
    assert_same(ttorch.load(str(tmp_path / "p.pt"), tree=False), obj)


def test_the_legacy_format(tmp_path):
    obj = {"w": torch.randn(2, 3), "step": 7, 5: (1.0, "x")}
    torch.save(obj, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert_same(ttorch.load(tmp_path / "old.pt", tree=False), obj)


def test_map_location_meta_and_mmap(checkpoint):
    path, m, _ = checkpoint
    meta = ttorch.load(path, map_location="meta")
    w = meta.model["0.weight"]
    assert w.device.type == "meta" and w.shape == m[0].weight.shape
    mapped = ttorch.load(path, mmap=True)
    assert torch.equal(mapped.model["0.weight"], m[0].weight.detach())
    on_cpu = ttorch.load(path, map_location=torch.device("cpu"))
    assert on_cpu.model["0.weight"].device.type == "cpu"


def test_bad_arguments():
    with pytest.raises(ValueError, match="weights_only=True"):
        ttorch.load("x.pt", weights_only=False)
    with pytest.raises(TypeError, match="map_location"):
        ttorch.load("x.pt", map_location={"cuda:0": "cpu"})
    with pytest.raises(TypeError, match="path or a binary file object"):
        ttorch.load(3)
    with pytest.raises(ValueError, match="mmap=True needs a path"):
        ttorch.load(io.BytesIO(b""), mmap=True)
    with pytest.raises(RuntimeError, match=r"^the file object <_io\.BytesIO .*>: at byte 0: neither"):
        ttorch.load(io.BytesIO(b"garbage"))  # not the temporary copy's name
    with pytest.raises(RuntimeError, match=r"^the file object <_io\.BytesIO .*>: cannot write: .*meta"):
        ttorch.save({"m": torch.ones(2, device="meta")}, io.BytesIO())  # nor in save's errors


def test_values_the_format_cannot_hold_are_refused_naming_their_path(tmp_path):
    target = tmp_path / "x.pt"
    with pytest.raises(TypeError, match=r"^treetensor\.torch\.save: cannot save a value of type "
                                        r"'object' at 'a\.b\.1' \(it writes what torch\.load"):
        ttorch.save({"a": {"b": [1, object()]}}, target)
    with pytest.raises(TypeError, match=r"the key \(1, 2\).* at 'a'"):
        ttorch.save({"a": {(1, 2): 1}}, target)
    with pytest.raises(TypeError, match=r"the key True"):
        ttorch.save({True: 1}, target)
    with pytest.raises(TypeError, match="int64 range.* at 'big'"):
        ttorch.save({"big": 2**64}, target)
    with pytest.raises(TypeError, match="read alike.* at '<root>'"):
        ttorch.save({1: 1, "1": 2}, target)
    # Tensors a file of dense tensors cannot hold: refused naming the path (the io layer's
    # writer, so C++ io::save says the same), nothing written; and read back refused too.
    for tensor, kind in [(torch.eye(2).to_sparse(), "sparse_coo"), (torch.eye(2).to_sparse_csr(), "sparse_csr"),
                         (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "quantized")]:
        with pytest.raises(ValueError, match=rf"the tensor at 'w\.s' is a {kind} tensor; these files "
                                             r"hold dense tensors \(make it one: \.to_dense\(\), \.dequantize\(\)"):
            ttorch.save({"w": {"s": tensor}}, target)
        assert not target.exists()
    torch.save({"s": torch.eye(2).to_sparse()}, tmp_path / "sparse.pt")
    with pytest.raises(RuntimeError, match=r"_rebuild_sparse_tensor' is not allowed \(this reader builds "
                                           r"dense tensors.*torch\.load\(weights_only=True\) also reads"):
        ttorch.load(tmp_path / "sparse.pt")
    loop = []
    loop.append(loop)
    with pytest.raises(ValueError, match=r"container at '0' is the one at '<root>' again \(a cycle\)"):
        ttorch.save(loop, target)
    d = {"a": torch.ones(1), "b": {}}
    d["b"]["c"] = [d["b"]]
    with pytest.raises(ValueError, match=r"container at 'b\.c\.0' is the one at 'b' again"):
        ttorch.save(d, target)
    shared = [1]  # the same list twice, not inside itself: fine (written twice)
    ttorch.save({"x": shared, "y": shared}, target)
    assert torch.load(target, weights_only=True) == {"x": [1], "y": [1]}
    target.unlink()
    deep = []
    for _ in range(1001):
        deep = [deep]
    with pytest.raises(ValueError, match=r"nested deeper than 1000 levels, at '0\.0\.0"):
        ttorch.save(deep, target)
    assert not target.exists()


def test_a_file_nested_past_the_recursion_limit_loads_with_tree_false(tmp_path):
    """A file nested deeper than Python's recursion limit lets tree=True rebuild (here a limit
    120 frames above the caller's, 200 nested lists): a ValueError naming the file and the way
    out, never a bare RecursionError; tree=False reads it."""
    deep = [torch.ones(1)]
    for _ in range(200):
        deep = [deep]
    path = tmp_path / "deep.pt"
    torch.save(deep, path)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 120)
    try:
        with pytest.raises(ValueError, match=r"deep\.pt nests its lists and dicts deeper .* tree=False"):
            ttorch.load(path)
        got = ttorch.load(path, tree=False)
    finally:
        sys.setrecursionlimit(limit)
    for _ in range(200):
        got = got[0]
    assert torch.equal(got[0], torch.ones(1))


def test_a_failed_save_keeps_the_old_file(tmp_path):
    target = tmp_path / "keep.pt"
    ttorch.save({"a": torch.ones(2)}, target)
    with pytest.raises(TypeError):
        ttorch.save({"a": object()}, target)
    assert_same(torch.load(target, weights_only=True), {"a": torch.ones(2)})
    with pytest.raises(RuntimeError, match="no-such-dir"):
        ttorch.save({"a": torch.ones(2)}, tmp_path / "no-such-dir" / "x.pt")


def test_a_truncated_file_is_an_error_naming_file_and_offset(checkpoint, tmp_path):
    path, _, _ = checkpoint
    cut = tmp_path / "cut.pt"
    cut.write_bytes(path.read_bytes()[:500])
    with pytest.raises(RuntimeError, match=r"cut\.pt: at byte \d+"):
        ttorch.load(cut)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_str_that_is_not_utf8_names_the_file_and_where(tmp_path):
    """torch.load's UnicodeDecodeError, its reason naming the file and the key or value."""
    torch.save({"abc": {"xyz": "hello"}}, tmp_path / "s.pt")
    data = (tmp_path / "s.pt").read_bytes()
    for needle, where in ((b"xyz", "a key of the dict at 'abc'"), (b"hello", "the str at 'abc.xyz'")):
        at = data.index(needle)
        (tmp_path / "bad.pt").write_bytes(data[:at] + b"\xff" + data[at + 1:])
        with pytest.raises(UnicodeDecodeError, match=f"bad.pt: {where} is not UTF-8 \\(invalid start byte\\)"):
            ttorch.load(tmp_path / "bad.pt", tree=False)
        with pytest.raises(UnicodeDecodeError, match=f"the file object <_io.BytesIO .*>: {where} is not"):
            ttorch.load(io.BytesIO((tmp_path / "bad.pt").read_bytes()), tree=False)
    torch.save({"\ud800": {"xyz": "hello"}}, tmp_path / "s.pt")  # a lone surrogate key: as torch
    data = (tmp_path / "s.pt").read_bytes()
    at = data.index(b"hello")
    (tmp_path / "bad.pt").write_bytes(data[:at] + b"\xff" + data[at + 1:])
    with pytest.raises(UnicodeDecodeError, match=r"the str at '\\xed\\xa0\\x80.xyz' is not UTF-8"):
        ttorch.load(tmp_path / "bad.pt", tree=False)


def test_a_hostile_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"x": _Evil(marker)}, tmp_path / "evil.pt")
    with pytest.raises(RuntimeError, match="system"):
        ttorch.load(tmp_path / "evil.pt")
    assert not marker.exists()


def test_a_missing_file_is_file_not_found_as_torch_load_says(tmp_path):
    missing = tmp_path / "missing.pt"
    with pytest.raises(FileNotFoundError) as torch_error:
        torch.load(missing)
    with pytest.raises(FileNotFoundError) as ours:
        ttorch.load(missing)
    assert str(ours.value) == str(torch_error.value) and ours.value.filename == str(missing)


def test_save_writes_through_a_symlink_a_fifo_and_a_hard_link_as_torch_save(tmp_path):
    """A rename would replace the entry: a symlink's regular target is replaced (the link
    stays); a FIFO and a hard-linked file are written in place, as torch.save's open()."""
    import stat
    import threading
    target, link = tmp_path / "epoch1.pt", tmp_path / "latest.pt"
    torch.save({"a": torch.zeros(2)}, target)
    link.symlink_to(target)
    ttorch.save({"a": torch.ones(2)}, link)
    assert link.is_symlink() and torch.equal(torch.load(target)["a"], torch.ones(2))
    dangling = tmp_path / "dangling.pt"
    dangling.symlink_to(tmp_path / "new.pt")
    ttorch.save({"a": torch.ones(2)}, dangling)
    assert dangling.is_symlink() and torch.equal(torch.load(tmp_path / "new.pt")["a"], torch.ones(2))
    twin = tmp_path / "twin.pt"
    os.link(target, twin)
    ttorch.save({"a": torch.full((2,), 3.0)}, twin)
    assert os.stat(target).st_nlink == 2 and torch.equal(torch.load(target)["a"], torch.full((2,), 3.0))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    ttorch.save({"a": torch.arange(3)}, fifo)
    reader.join(30)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert torch.equal(torch.load(io.BytesIO(got[0]))["a"], torch.arange(3))


def test_paths_and_file_strings_that_are_not_utf8(tmp_path):
    """Any name Linux allows (os.fsdecode's surrogates, or bytes), as torch.load/save take
    them; a file's own bytes that are not UTF-8 are shown \\xNN in the RuntimeError."""
    name = tmp_path / os.fsdecode(b"y\xff.pt")
    torch.save({"a": torch.ones(1)}, name)
    assert torch.equal(ttorch.load(name).a, torch.ones(1))
    ttorch.save({"a": torch.full((1,), 2.0)}, name)
    assert torch.equal(torch.load(name)["a"], torch.full((1,), 2.0))
    assert torch.equal(ttorch.load(os.fsencode(name)).a, torch.full((1,), 2.0))
    garbage = tmp_path / os.fsdecode(b"z\xfe.pt")
    garbage.write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match=r"z\\xfe\.pt: at byte 0: neither a zip-format"):
        ttorch.load(garbage)
    b = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, b)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b.getvalue().replace(b"collections", b"collecti\xa3ns", 1))
    with pytest.raises(RuntimeError, match=r"bad\.pt: at byte \d+: global 'collecti\\xa3ns\.OrderedDict' is not allowed"):
        ttorch.load(bad)


def test_a_path_with_a_nul_byte_is_a_value_error(tmp_path):
    """As open() and torch.load: the system would take the name before the NUL."""
    for f in (str(tmp_path / "a\x00b"), os.fsencode(tmp_path / "a\x00b")):
        with pytest.raises(ValueError, match="embedded null byte"):
            ttorch.save({"a": torch.ones(1)}, f)
        with pytest.raises(ValueError, match="embedded null byte"):
            ttorch.load(f)
    assert not (tmp_path / "a").exists()
