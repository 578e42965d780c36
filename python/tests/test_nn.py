"""treetensor.nn.consolidate_module against PyTorch itself: the trees' leaves are the module's
own tensors, training through them matches torch.optim on the unconsolidated model, and every
case DESIGN.md §21 names (tied, frozen, mixed dtypes, buffers, unused parameters, moved models,
checkpoints, 2 ranks against DistributedDataParallel) is handled or refused naming the path."""
import copy
import os
import subprocess
import sys

import pytest
import torch

import treetensor.nn as tnn
import treetensor.optim as topt
import treetensor.torch as ttorch

HERE = os.path.dirname(os.path.abspath(__file__))
EPS32 = torch.finfo(torch.float32).eps


class Net(torch.nn.Module):
    def __init__(self, tied=False, frozen=False, double_head=False):
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 4, 3)
        self.bn = torch.nn.BatchNorm1d(4)
        self.fc = torch.nn.Linear(4 * 6, 4 * 6)
        self.out = torch.nn.Linear(4 * 6, 4 * 6)
        if tied:
            self.out.weight = self.fc.weight
        if frozen:
            self.conv.requires_grad_(False)
        if double_head:
            self.head = torch.nn.Linear(4 * 6, 3).double()

    def forward(self, x):
        h = self.out(torch.tanh(self.fc(self.bn(self.conv(x)).flatten(1))))
        return h.double() @ self.head.weight.T if hasattr(self, "head") else h


def pair(**kw):
    torch.manual_seed(0)
    ref = Net(**kw)
    ours = Net(**kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(8, 2, 8, generator=g)


def leaves(t):
    return ttorch.tree_flatten(t)[0]


def adam_bound(w, lr, steps):
    # test_optim.py's bound: per step a few ulps of |w| and of the lr-sized update.
    return (steps + 1) * EPS32 * (w.abs() + 16 * lr)


def test_leaves_are_the_module_tensors():
    _, m = pair()
    tree = tnn.consolidate_module(m)
    assert tree.params.is_consolidated() and tree.grads.is_consolidated() and tree.buffers.is_consolidated()
    named = dict(m.named_parameters())
    paths = [".".join(p) for p in ttorch.tree_flatten(tree.params)[1].paths()]
    assert paths == sorted(named)
    for path, leaf, g in zip(paths, leaves(tree.params), leaves(tree.grads)):
        assert leaf is named[path] and named[path].grad is g
        assert leaf.untyped_storage().data_ptr() == tree.param_buffers[0].untyped_storage().data_ptr()
        assert g.untyped_storage().data_ptr() == tree.grad_buffers[0].untyped_storage().data_ptr()
    bufs = dict(m.named_buffers())
    for path, leaf in zip(ttorch.tree_flatten(tree.buffers)[1].paths(), leaves(tree.buffers)):
        assert leaf.data_ptr() == bufs[".".join(path)].data_ptr()


def train(ref, ours, tree, steps=4, lr=1e-2, set_to_none=False):
    opt_ref = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=lr)
    opt = topt.Adam(tree.params, lr=lr)
    x = batch()
    for _ in range(steps):
        opt_ref.zero_grad()
        loss_ref = ref(x).square().mean()
        loss_ref.backward()
        if set_to_none:
            ours.zero_grad()  # .grad = None: the hook copies the new gradient into its view
        else:
            tree.zero_grad()
        loss = ours(x).square().mean()
        loss.backward()
        assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-5)
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            if p.grad is not None:
                # The first step's gradients are bitwise torch's (same model, same values).
                assert torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-6), name
        opt_ref.step()
        opt.step(tree.grads)
    return opt_ref


@pytest.mark.parametrize("kw", [{}, {"tied": True}, {"frozen": True}, {"double_head": True}],
                         ids=["plain", "tied", "frozen", "mixed-dtypes"])
@pytest.mark.parametrize("set_to_none", [False, True], ids=["tree.zero_grad", "model.zero_grad"])
def test_one_step_matches_torch_adam(kw, set_to_none):
    ref, ours = pair(**kw)
    tree = tnn.consolidate_module(ours)
    train(ref, ours, tree, steps=1, set_to_none=set_to_none)
    for (name, p), q in zip(ref.state_dict().items(), ours.state_dict().values()):
        assert q.dtype == p.dtype, name
        assert ((q - p).abs() <= adam_bound(p, 1e-2, 1)).all(), name
    if set_to_none:
        for p, g in zip(leaves(tree.params), leaves(tree.grads)):
            assert p.grad is g


def test_training_follows_torch_over_steps():
    ref, ours = pair()
    tree = tnn.consolidate_module(ours)
    train(ref, ours, tree, steps=6)
    # BatchNorm's running statistics were updated through the buffer views.
    assert ours.bn.running_mean.data_ptr() == tree.buffers.bn.running_mean.data_ptr()
    assert torch.allclose(ours.bn.running_mean, ref.bn.running_mean, rtol=1e-2, atol=1e-3)
    assert ours.bn.num_batches_tracked.item() == 6


def test_tied_parameter_is_one_leaf_with_an_alias():
    _, m = pair(tied=True)
    tree = tnn.consolidate_module(m)
    assert tree.aliases == {"out.weight": "fc.weight"}
    assert m.out.weight is m.fc.weight and m.fc.weight is tree.params.fc.weight
    assert "out.weight" in m.state_dict() and "weight" not in tree.params.out.keys()


def test_a_submodule_named_like_a_module_method():
    """nn.Module allows a child called `half` or `to` (its __getattr__ is not reached for them):
    consolidation finds it in _modules, where get_submodule's getattr finds the method."""
    m = torch.nn.Module()
    m.half = torch.nn.Linear(3, 2)
    tree = tnn.consolidate_module(m)
    assert m._modules["half"].weight is tree.params["half"].weight
    m._modules["half"](torch.ones(1, 3)).sum().backward()
    assert torch.equal(tree.grads["half"].bias, torch.ones(2))


def test_frozen_parameters_stay_out_of_the_gradient_buffer():
    ref, m = pair(frozen=True)
    tree = tnn.consolidate_module(m)
    assert sorted(tree.frozen.conv.keys()) == ["bias", "weight"] and "conv" not in tree.params.keys()
    before = m.conv.weight.detach().clone()
    train(ref, m, tree, steps=2)
    assert torch.equal(m.conv.weight, before) and m.conv.weight.grad is None


def test_mixed_dtypes_get_one_buffer_each():
    _, m = pair(double_head=True)
    tree = tnn.consolidate_module(m)
    assert sorted(str(b.dtype) for b in tree.param_buffers) == ["torch.float32", "torch.float64"]
    assert len(tree.grad_buffers) == 2


def test_zero_grad_is_one_fill_per_buffer_padding_included():
    _, m = pair()
    tree = tnn.consolidate_module(m)
    m(batch()).sum().backward()
    assert any(b.abs().sum() > 0 for b in tree.grad_buffers)
    tree.zero_grad()
    assert all(torch.count_nonzero(b) == 0 for b in tree.grad_buffers)


def test_zero_grad_set_to_none_copies_the_gradients_in_backward():
    """zero_grad(set_to_none=True) writes nothing and leaves .grad None; `grads` never hands
    out the stale buffer (zero views before any backward); each new gradient is copied into
    its view (equal to the fill path's), one no backward reached is zero, one assigned by hand
    is copied in; training matches the fill path bitwise."""
    _, a = pair()
    _, b = pair()
    ta, tb = tnn.consolidate_module(a), tnn.consolidate_module(b)
    x = batch()
    b(x).sum().backward()
    stale = [buf.clone() for buf in tb.grad_buffers]
    tb.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in leaves(tb.params))
    assert all(torch.equal(buf, old) for buf, old in zip(tb.grad_buffers, stale))
    grads = tb.grads  # no backward since: zero views, never the stale values
    assert all(p.grad is g for p, g in zip(leaves(tb.params), leaves(grads)))
    assert all(torch.count_nonzero(buf) == 0 for buf in tb.grad_buffers)
    opt_a, opt_b = topt.Adam(ta.params, lr=1e-2), topt.Adam(tb.params, lr=1e-2)
    for _ in range(3):
        ta.zero_grad()
        tb.zero_grad(set_to_none=True)
        a(x).square().mean().backward()
        b(x).square().mean().backward()
        for p, g, want in zip(leaves(tb.params), leaves(tb.grads), leaves(ta.grads)):
            assert p.grad is g and torch.equal(g, want)
        opt_a.step(ta.grads)
        opt_b.step(tb.grads)
    assert all(torch.equal(p, q) for p, q in zip(leaves(ta.params), leaves(tb.params)))
    tb.zero_grad(set_to_none=True)
    b.out(torch.ones(2, 24)).sum().backward()  # reaches out.* only
    assert torch.count_nonzero(tb.grads.fc.weight) == 0 and b.fc.weight.grad is tb.grads.fc.weight
    b.fc.bias.grad = torch.full((24,), 3.0)  # assigned by hand: copied into its view
    assert torch.equal(tb.grads.fc.bias, torch.full((24,), 3.0)) and b.fc.bias.grad is tb.grads.fc.bias


def test_set_to_none_then_fill_and_sparse_gradients():
    """The fill zero_grad() after set_to_none puts every view back as .grad (grads works again,
    zeroed); after set_to_none a sparse gradient is copied into its view dense."""
    _, m = pair()
    tree = tnn.consolidate_module(m)
    m(batch()).sum().backward()
    tree.zero_grad(set_to_none=True)
    tree.zero_grad()
    assert all(p.grad is g for p, g in zip(leaves(tree.params), leaves(tree.grads)))
    assert all(torch.count_nonzero(b) == 0 for b in tree.grad_buffers)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    t = tnn.consolidate_module(emb)
    t.zero_grad(set_to_none=True)
    emb(torch.tensor([1, 4, 4])).sum().backward()
    want = torch.zeros(10, 3)
    want[1], want[4] = 1, 2
    g = t.grads.weight  # copies the sparse gradient in, dense
    assert emb.weight.grad is g and torch.equal(g, want)


def test_a_parameter_another_tree_took_is_refused_naming_it():
    """A submodule (or a module sharing it) consolidated again takes its parameters into the new
    tree's buffer: the first tree says so, not that the model was moved."""
    shared = torch.nn.Linear(4, 3)
    g = torch.nn.Sequential(shared, torch.nn.Tanh(), torch.nn.Linear(3, 2))
    d = torch.nn.Sequential(shared, torch.nn.Linear(3, 1))
    first = tnn.consolidate_module(g)
    second = tnn.consolidate_module(d)
    with pytest.raises(RuntimeError, match=r"parameter '0\.(bias|weight)' now lies in the buffer of another "
                                           r"consolidate_module's tree"):
        first.zero_grad()
    second.zero_grad()  # the tree that took them works
    part = tnn.consolidate_module(g[2])
    with pytest.raises(RuntimeError, match=r"parameter '[02]\.(bias|weight)' now lies in the buffer of another"):
        first.grads
    part.zero_grad()


@pytest.mark.parametrize("move", ["to-double", "load_state_dict-assign"])
def test_a_moved_model_is_refused_naming_the_path(move):
    ref, m = pair()
    tree = tnn.consolidate_module(m)
    x = batch()
    if move == "to-double":
        m.double()
        m(x.double()).sum().backward()  # one process: no hook; grads and zero_grad refuse
        with pytest.raises(RuntimeError, match=r"parameter '(out|fc|bn|conv)\.(bias|weight)' no longer lies"):
            tree.grads
        with pytest.raises(RuntimeError, match=r"parameter '(out|fc|bn|conv)\.(bias|weight)' no longer lies"):
            tree.zero_grad()
    else:
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(RuntimeError, match=r"assign=True\) would replace '(conv|bn|fc|out)\.\w+' of a consolidated module.*nothing was loaded"):
            m.load_state_dict({k: v.clone() + 1 for k, v in ref.state_dict().items()}, assign=True)
        assert {id(p) for p in m.parameters()} == {id(p) for p in leaves(tree.params)}  # none replaced
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_load_after_model_zero_grad_and_a_failed_backward():
    """model.zero_grad() (.grad None) then load_state_dict works; a backward that raised half
    way leaves the next one correct (an unused parameter's view is zeroed, not stale)."""
    ref, m = pair()
    tree = tnn.consolidate_module(m)
    m.zero_grad()
    m.load_state_dict(ref.state_dict())

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    x = batch()
    with pytest.raises(RuntimeError, match="boom"):
        m.out(Boom.apply(m.fc(m.bn(m.conv(x)).flatten(1)))).sum().backward()
    m(x).sum().backward()
    m.zero_grad()
    m.out(torch.ones(2, 24)).sum().backward()  # reaches out.* only
    with pytest.raises(RuntimeError, match=r"parameter at '(bn|conv|fc)\.(bias|weight)' has no \.grad .*"
                                           r"for a consolidated module pass tree\.grads"):
        topt.SGD(tree.params, lr=0.1).step()  # .grad None: torch.optim would skip it
    assert torch.count_nonzero(tree.grads.fc.weight) == 0 and m.fc.weight.grad is tree.grads.fc.weight
    assert torch.equal(m.out.bias.grad, torch.full((24,), 2.0))


def test_create_graph_is_refused_naming_the_path():
    m = torch.nn.Linear(3, 1)
    tree = tnn.consolidate_module(m)
    m(torch.randn(4, 3)).pow(2).sum().backward(create_graph=True)  # one process: no hook
    with pytest.raises(RuntimeError, match="gradient of '(weight|bias)' has a graph"):
        tree.grads
    for p in m.parameters():
        p.grad = None  # the reference cycle create_graph makes


def test_gradients_accumulated_before_consolidation_are_kept():
    ref, m = pair()
    for model in (ref, m):
        model(batch()).sum().backward()
    tree = tnn.consolidate_module(m)
    for (name, p), q in zip(ref.named_parameters(), m.parameters()):
        assert torch.equal(q.grad, p.grad), name
    assert torch.equal(tree.grads.fc.weight, ref.fc.weight.grad)
    m(batch()).sum().backward()  # and they accumulate into the buffer, as torch's do
    ref(batch()).sum().backward()
    assert torch.allclose(tree.grads.fc.weight, ref.fc.weight.grad, rtol=0, atol=1e-6)
    again = tnn.consolidate_module(m)  # a second consolidation keeps them too
    assert torch.equal(again.grads.fc.weight, tree.grads.fc.weight)


def test_consolidating_again_closes_the_first_tree():
    ref, m = pair()
    first = tnn.consolidate_module(m)
    second = tnn.consolidate_module(m)  # the same model again: a new tree, the first closed
    assert first._hooks == [] and second.params.fc.weight is m.fc.weight
    m.double()
    third = tnn.consolidate_module(m)  # after moving: as the error message says
    m(batch().double()).sum().backward()
    assert m.fc.weight.grad is third.grads.fc.weight and third.grads.fc.weight.dtype == torch.float64


def test_copies_of_a_consolidated_model_are_ordinary_modules(tmp_path):
    import copy
    ref, m = pair()
    tnn.consolidate_module(m)
    c = copy.deepcopy(m)
    c.load_state_dict(ref.state_dict())
    c(batch()).sum().backward()
    torch.save(m, str(tmp_path / "whole.pt"))
    back = torch.load(str(tmp_path / "whole.pt"), weights_only=False)
    back(batch()).sum().backward()
    assert torch.equal(back.fc.weight, m.fc.weight)


def test_share_memory_keeps_training_the_views():
    ref, m = pair()
    tree = tnn.consolidate_module(m)
    m.share_memory()
    train(ref, m, tree, steps=1)


def test_overlapping_buffers_and_meta_models_are_refused():
    m = torch.nn.Module()
    base = torch.zeros(4)
    m.register_buffer("a", base)
    m.register_buffer("b", base[:2])
    with pytest.raises(ValueError, match="buffer '(a|b)' and buffer '(a|b)' share memory"):
        tnn.consolidate_module(m)
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="parameter '(weight|bias)' is on the meta device"):
        tnn.consolidate_module(meta)
    with pytest.raises(ValueError, match="parameter '0.weight' is not initialized yet"):
        tnn.consolidate_module(torch.nn.Sequential(torch.nn.LazyLinear(3)))
    sparse = torch.nn.Linear(2, 2)
    sparse.s = torch.nn.Parameter(torch.eye(3).to_sparse())
    before = sparse.weight.data_ptr()
    with pytest.raises(ValueError, match="parameter 's' has layout torch.sparse_coo"):
        tnn.consolidate_module(sparse)
    assert sparse.weight.data_ptr() == before  # nothing moved


def test_shared_storage_is_refused_naming_both():
    m = torch.nn.Module()
    base = torch.zeros(10)
    m.a = torch.nn.Parameter(base[:6])
    m.b = torch.nn.Parameter(base[4:])  # overlaps a: consolidation would separate them
    with pytest.raises(ValueError, match="parameter 'a' and parameter 'b' share memory"):
        tnn.consolidate_module(m)
    lin = torch.nn.Linear(3, 3)  # a buffer registered over a parameter's data
    lin.register_buffer("alias", lin.weight.data)
    with pytest.raises(ValueError, match="buffer 'alias' and parameter 'weight' share memory"):
        tnn.consolidate_module(lin)


def test_a_tensor_or_submodule_changed_by_hand_is_refused_at_grads():
    """The tree would train the old tensors: replaced, added or frozen after consolidation."""
    def changes():
        yield "parameter 'fc.weight' was replaced", lambda m: setattr(
            m.fc, "weight", torch.nn.Parameter(torch.ones_like(m.fc.weight)))
        yield "submodule 'out' was replaced", lambda m: setattr(m, "out", torch.nn.Linear(24, 24))
        yield "parameters of 'fc' were added", lambda m: m.fc.register_parameter(
            "extra", torch.nn.Parameter(torch.zeros(2)))
        yield "submodules of '<root>' were added", lambda m: setattr(m, "extra", torch.nn.Linear(2, 2))
        yield "parameter 'fc.bias' was frozen", lambda m: m.fc.bias.requires_grad_(False)
    for message, change in changes():
        _, m = pair()
        tree = tnn.consolidate_module(m)
        m(batch()).sum().backward()
        tree.grads  # fine before the change
        change(m)
        with pytest.raises(RuntimeError, match=message):
            tree.grads
        tree = tnn.consolidate_module(m)  # consolidating again takes the change
        if "frozen" in message:
            assert ("fc", "bias") in [tuple(q) for q in ttorch.tree_flatten(tree.frozen)[1].paths()]
        tree.grads


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_replaced_parameter_is_refused_in_torchs_loop_too(set_to_none):
    """model.zero_grad() + backward + opt.step() (the .grad fields, not tree.grads): a parameter
    or submodule replaced since consolidation was left untrained without a word, or refused
    as having no .grad."""
    for change in (lambda m: setattr(m, "out", torch.nn.Linear(24, 24)),
                   lambda m: setattr(m.fc, "weight", torch.nn.Parameter(torch.ones_like(m.fc.weight)))):
        _, m = pair()
        tree = tnn.consolidate_module(m)
        opt = topt.Adam(tree.params)
        change(m)
        m.zero_grad(set_to_none=set_to_none)
        m(batch()).sum().backward()
        with pytest.raises(RuntimeError, match=r"was replaced.* after consolidate_module: the optimizer "
                                               r"would train the old tensors"):
            opt.step()


def test_a_parameter_unfrozen_after_consolidation_is_refused_at_grads():
    _, m = pair(frozen=True)
    tree = tnn.consolidate_module(m)
    m.conv.weight.requires_grad_(True)  # the tree's params lack it: no step would move it
    with pytest.raises(RuntimeError, match="parameter 'conv.weight' was unfrozen"):
        tree.grads
    assert "conv.weight" in topt.Adam(tnn.consolidate_module(m).params)._leaf_paths


def test_a_replaced_buffer_is_taken_into_its_view_at_the_end_of_backward():
    """With a process group the module's buffers are broadcast after every backward; one the
    module holds anew is copied into its view first (the same collectives on every rank), or
    refused when it no longer fits the view. Here a group of one rank (Gloo)."""
    import tempfile
    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        try:
            _, m = pair()
            tree = tnn.consolidate_module(m, process_group=dist.group.WORLD)
            view = m.bn.running_mean
            m.bn.running_mean = torch.full((4,), 3.0)
            m(batch()).sum().backward()
            assert m.bn.running_mean is view and tree.buffers.bn.running_mean is view
            m.bn.num_batches_tracked = None  # BatchNorm then counts nothing
            with pytest.raises(RuntimeError, match=r"buffer 'bn.num_batches_tracked' was replaced "
                                                   r"by None after consolidate_module"):
                m(batch()).sum().backward()
            tree.close()
        finally:
            dist.destroy_process_group()


def test_a_gradient_tree_read_once_follows_torch_optims_zero_grad():
    """``grads = tree.grads`` read once, then torch.optim's zero_grad() (set_to_none) each step:
    step(grads) copies the new .grad fields in first, so it trains as torch does."""
    for clear in ("optimizer", "module"):
        ref, m = pair()
        tree = tnn.consolidate_module(m)
        grads = tree.grads
        opt, opt_ref = topt.SGD(tree.params, lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            x = batch() + step
            (opt.zero_grad() if clear == "optimizer" else m.zero_grad())
            opt_ref.zero_grad()
            m(x).square().mean().backward()
            ref(x).square().mean().backward()
            opt.step(grads)
            opt_ref.step()
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=0, atol=1e-6), (clear, name)


def test_a_legacy_torch_checkpoint_loads_by_the_modules_order():
    """A torch.optim state dict without param_names (torch < 2.6) numbers the parameters in
    module.parameters()'s order, not the tree's sorted paths ('10' before '2')."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(3, 3, bias=False) for _ in range(12)])
    ref = make()
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x = torch.randn(4, 3)
    for _ in range(2):
        opt_ref.zero_grad()
        ref(x).sum().backward()
        opt_ref.step()
    sd = opt_ref.state_dict()
    for group in sd["param_groups"]:
        group.pop("param_names", None)
    m = make()
    m.load_state_dict(ref.state_dict())
    tree = tnn.consolidate_module(m)
    opt = topt.Adam(tree.params, lr=1e-2)
    opt.load_state_dict(sd)
    for k, path in enumerate(opt._leaf_paths):
        i = [n for n, _ in ref.named_parameters()].index(path)
        assert torch.equal(leaves(opt.state["exp_avg"])[k], sd["state"][i]["exp_avg"]), path


def _twelve_linears(frozen=()):
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(3, 3, bias=False) for _ in range(12)])
    for i in frozen:
        m[i].weight.requires_grad_(False)
    return m


def _adam_steps(m, opt, steps, x):
    for _ in range(steps):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()


def test_a_state_dict_of_ours_loads_into_torch_optim_by_position():
    """Our optimizer over a module's params numbers its state_dict as torch.optim over
    module.parameters() does: torch's load_state_dict matches by position, so a checkpoint
    of ours resumes in torch (it numbered the sorted paths: '10.weight' took '2.weight''s
    moments, in silence, the shapes being equal)."""
    x = torch.randn(4, 3)
    ref = _twelve_linears()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    _adam_steps(ref, ref_opt, 2, x)
    m = _twelve_linears()
    tree = tnn.consolidate_module(m)
    opt = topt.Adam(tree.params, lr=1e-2)
    _adam_steps(m, opt, 2, x)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == [n for n, _ in m.named_parameters()]
    resumed = _twelve_linears()
    resumed.load_state_dict(m.state_dict())
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(sd)
    _adam_steps(ref, ref_opt, 2, x)
    _adam_steps(resumed, resumed_opt, 2, x)
    for (name, p), q in zip(ref.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=name)
    topt.Adam(tree.params, lr=1e-2).load_state_dict(resumed_opt.state_dict())  # and back


def test_the_torch_order_outlives_the_tree():
    """The numbering is the module's also after tree.close() or a second consolidate_module
    (it fell back to the sorted paths once the tree was no longer open)."""
    m = _twelve_linears()
    tree = tnn.consolidate_module(m)
    opt = topt.Adam(tree.params, lr=1e-2)
    _adam_steps(m, opt, 1, torch.randn(4, 3))
    order = [n for n, _ in m.named_parameters()]
    tree.close()
    assert opt.state_dict()["param_groups"][0]["param_names"] == order
    tnn.consolidate_module(m)
    assert opt.state_dict()["param_groups"][0]["param_names"] == order
    assert copy.deepcopy(opt).state_dict()["param_groups"][0]["param_names"] == order


def test_a_grads_tree_read_before_a_parameter_is_frozen_is_checked_at_the_step():
    m = _twelve_linears()
    tree = tnn.consolidate_module(m)
    opt = topt.Adam(tree.params, lr=1e-2)
    grads = tree.grads  # read once, reused
    m(torch.randn(4, 3)).sum().backward()
    opt.step(grads)
    m[5].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"parameter '5.weight' was frozen"):
        opt.step(grads)


@pytest.mark.parametrize("named", [False, True], ids=["parameters", "named_parameters"])
def test_torch_optim_over_a_model_with_frozen_parameters_loads(named):
    """torch.optim over model.parameters(), frozen ones included (they never get state): its
    checkpoint loads into ours over the module's trainable params and resumes as torch's."""
    x = torch.randn(4, 3)
    ref = _twelve_linears(frozen=(1, 10))
    ref_opt = torch.optim.Adam(ref.named_parameters() if named else ref.parameters(), lr=1e-2)
    _adam_steps(ref, ref_opt, 2, x)
    sd = ref_opt.state_dict()
    assert len(sd["param_groups"][0]["params"]) == 12 and len(sd["state"]) == 10
    m = _twelve_linears(frozen=(1, 10))
    m.load_state_dict(ref.state_dict())
    tree = tnn.consolidate_module(m)
    opt = topt.Adam(tree.params, lr=1e-2)
    opt.load_state_dict(sd)
    _adam_steps(ref, ref_opt, 2, x)
    _adam_steps(m, opt, 2, x)
    for (name, p), q in zip(ref.named_parameters(), m.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=name)
    sd["state"][1] = dict(sd["state"][0])  # a frozen parameter with state: nowhere to go
    with pytest.raises(ValueError, match=r"parameter '1.weight' has state but is frozen here"):
        opt.load_state_dict(sd)


def test_torch_s_loop_after_a_parameter_is_frozen_or_converted_is_refused():
    """opt.step() over the .grad fields checks what tree.grads checks: a parameter frozen
    after consolidation (it moved on Adam's moments: torch.optim skips it) or a model
    converted (Adam failed on a dtype mismatch naming no parameter)."""
    x = torch.randn(4, 3)
    m = _twelve_linears()
    tree = tnn.consolidate_module(m)
    opt = topt.Adam(tree.params, lr=1e-2)
    _adam_steps(m, opt, 1, x)
    m[3].weight.requires_grad_(False)
    tree.zero_grad()
    m(x).sum().backward()
    before = m[3].weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"parameter '3.weight' was frozen \(requires_grad=False\) "
                                           r"after consolidate_module"):
        opt.step()
    assert torch.equal(m[3].weight, before)
    m[3].weight.requires_grad_(True)
    m.double()
    m(x.double()).sum().backward()
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' no longer lies in its consolidated buffer"):
        opt.step()


def test_consolidating_under_inference_mode_still_trains():
    ref, m = pair()
    with torch.inference_mode():
        tree = tnn.consolidate_module(m)
    assert not any(t.is_inference() for t in leaves(tree.params) + leaves(tree.grads))
    train(ref, m, tree, steps=2)
    with torch.inference_mode():  # a model made under inference mode keeps running there
        built = Net()
        tnn.consolidate_module(built)
        assert built(batch()).shape == (8, 24)


def test_bad_arguments():
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        tnn.consolidate_module({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="bucket sizes must be positive"):
        tnn.consolidate_module(torch.nn.Linear(2, 2), bucket_cap_mb=0)


def test_checkpoints_save_and_load_through_the_views(tmp_path):
    ref, m = pair()
    tree = tnn.consolidate_module(m)
    train(ref, m, tree, steps=2)
    path = str(tmp_path / "model.pt")
    ttorch.save(tree.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == list(m.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in m.state_dict().items())
    # Loading a checkpoint copies into the views: the tree and the optimizer still train it.
    fresh = Net()
    fresh.load_state_dict(torch.load(path, weights_only=True))
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    m.load_state_dict(ttorch.load(path, tree=False))
    for (name, p), q in zip(fresh.named_parameters(), m.parameters()):
        assert torch.equal(p, q), name
    assert leaves(tree.params)[0].data_ptr() == tree.param_buffers[0].data_ptr()
    train(fresh, m, tree, steps=1)


def test_two_ranks_match_distributed_data_parallel():
    """2 Gloo ranks (nn_ddp_worker.py): broadcast, gradients bitwise DDP's, overlap, unused."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, os.path.join(HERE, "nn_ddp_worker.py")], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_example_trains_under_torchrun(tmp_path):
    """examples/train_ddp.py on 2 ranks: it runs, both ranks see the same averaged gradients
    (equal gradient norms every step), the loss falls, and torch.load reads its checkpoint."""
    root = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.join(root, "examples", "train_ddp.py"), "--epochs", "2", "--out",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    import json
    ranks = [[json.loads(line) for line in open(tmp_path / f"metrics.rank{r}.jsonl")] for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 32  # 1024 samples / 2 ranks / batch 32, 2 epochs
    for a, b in zip(*ranks):
        assert a["step"] == b["step"] and a["grad_norm"] == b["grad_norm"]
    assert ranks[0][-1]["loss"] < 0.5 * ranks[0][0]["loss"]
    state = torch.load(str(tmp_path / "model.pt"), weights_only=True)
    assert sorted(state) == sorted(f"{i}.{n}" for i in (0, 1, 3, 5) for n in ("weight", "bias"))


def test_train_bench_verifies_every_row(tmp_path):
    """The main job's train workload on tiny settings: every side verified against torch's."""
    root = os.path.dirname(os.path.dirname(HERE))
    out = tmp_path / "train.json"
    done = subprocess.run([sys.executable, os.path.join(root, "python", "bench", "bench_train.py"), "--models",
                           "policy", "--runs", "1", "--steps", "3", "--warmup", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    import json
    rows = json.load(open(out))["rows"]
    one = ["torch", "torch best", "ours", "ours -flat", "ours +async"]  # the policy's metrics: inline
    assert [(r["ranks"], r["side"]) for r in rows] == [(1, s) for s in one + ["torch 2 threads"]] + \
        [(2, s) for s in one + ["ours +overlap", "ours +exchange"]]
    assert all(r["verified"] and r["ms"] > 0 for r in rows)


def test_allreduce_bench_verifies_every_side(tmp_path):
    """The main job's gradient all_reduce beside the peers on few calls: every side's result
    is exactly the two ranks' sum (tensordict's rows when the peers' venv is given)."""
    root = os.path.dirname(os.path.dirname(HERE))
    out = tmp_path / "allreduce.json"
    cmd = [sys.executable, os.path.join(root, "python", "bench", "bench_allreduce.py"), "--rounds", "1",
           "--calls", "1", "--json", str(out)]
    if os.environ.get("TREETENSOR_PEERS_PYTHON"):
        cmd += ["--peers-python", os.environ["TREETENSOR_PEERS_PYTHON"]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    import json
    rows = json.load(open(out))["rows"]
    timed = [r for r in rows if "status" not in r]
    assert {r["side"] for r in timed} >= {"ours consolidated", "ours per leaf", "torch bucketed", "torch per leaf", "limit"}
    assert all(r["verified"] and r["ms"] > 0 for r in timed)


def _steps_in_backward(opt_cls, kw, in_backward, set_to_none=(False, True, False, True), **net):
    torch.manual_seed(0)
    m = Net(**net)
    tree = tnn.consolidate_module(m, first_bucket_cap_mb=0.0005, bucket_cap_mb=0.001)
    opt = opt_cls(tree.params, lr=1e-2, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    if in_backward:
        tree.step_in_backward(opt)
    x = batch()
    for s in set_to_none:
        tree.zero_grad(set_to_none=s)
        m(x).square().mean().backward()
        opt.step(tree.grads)
        sched.step()
    return m, tree, opt


@pytest.mark.parametrize("opt_cls,kw", [(topt.Adam, {}), (topt.AdamW, {"amsgrad": True}),
                                        (topt.SGD, {"momentum": 0.9, "nesterov": True})],
                         ids=["Adam", "AdamW-amsgrad", "SGD-nesterov"])
@pytest.mark.parametrize("net", [{}, {"frozen": True, "double_head": True}], ids=["plain", "frozen-mixed"])
def test_step_in_backward_is_bitwise_the_step_after_it(opt_cls, kw, net):
    """Bucket by bucket on the worker, gradients copied there after set_to_none, a scheduler's
    lr read at each backward, two buffers: every parameter bitwise the ordinary loop's."""
    ref, _, ref_opt = _steps_in_backward(opt_cls, kw, False, **net)
    m, tree, opt = _steps_in_backward(opt_cls, kw, True, **net)
    assert len(tree._buckets.ranges) >= 3
    for (name, p), q in zip(ref.named_parameters(), m.parameters()):
        assert torch.equal(p, q), name
    assert opt.state["step"] == ref_opt.state["step"] == 4
    for p, g in zip(leaves(tree.params), leaves(tree.grads)):
        assert p.grad is g
    tree.close()
    assert tree._buckets.worker is None


def test_a_grad_scaler_after_a_step_in_backward_is_refused():
    """GradScaler unscales the gradients through param_groups after backward, when the step
    in backward has already used them (still scaled): refused until step() acknowledges it.
    It trained silently on gradients 1024 times too large."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    tree = tnn.consolidate_module(m)
    opt = topt.SGD(tree.params, lr=0.01)
    tree.step_in_backward(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(m(torch.randn(16, 8)).square().mean()).backward()
    with pytest.raises(RuntimeError, match=r"SGD: the step was already taken during backward .*"
                                           r"param_groups are closed until step\(\)"):
        scaler.step(opt)
    opt.step()  # acknowledged: the groups are open again
    assert opt.param_groups[0]["lr"] == 0.01
    tree.close()


def _two_dtypes_loss(m, x):
    return (m[0](x).double() + m[1](x.double())).square().mean()


def test_clipping_after_a_step_in_backward_is_reported_at_step():
    """clip_grad_norm_ after a backward that took the step edits gradients the step already
    used: step() acknowledges the step and raises, naming the cause (it clipped nothing, in
    silence). The ordinary loop, reading tree.grads between, passes."""
    torch.manual_seed(0)
    m = torch.nn.ModuleList([torch.nn.Linear(8, 4), torch.nn.Linear(8, 4).double()])
    tree = tnn.consolidate_module(m)
    assert len(tree.grad_buffers) == 2
    opt = topt.SGD(tree.params, lr=0.01)
    tree.step_in_backward(opt)
    x = torch.randn(16, 8)
    for set_to_none in (True, False):
        tree.zero_grad(set_to_none=set_to_none)
        _two_dtypes_loss(m, x).backward()
        opt.step(tree.grads)
    for head in (m[0].weight, m[1].bias):  # an edit of either buffer
        tree.zero_grad()
        _two_dtypes_loss(m, x).backward()
        head.grad.mul_(0.5)
        with pytest.raises(RuntimeError, match=r"SGD.step: the gradients were changed in place "
                                               r"\(clip_grad_norm_, a zero_grad\(\)\) after backward "
                                               r"had taken this step"):
            opt.step()
        assert opt._taken is None  # acknowledged: the next backward steps again
    tree.zero_grad()
    _two_dtypes_loss(m, x).backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match=r"changed in place.*ttorch.norm\(tree.grads\)"):
        opt.step()
    for clear in (lambda: opt.zero_grad(), lambda: m.zero_grad(), lambda: tree.zero_grad(set_to_none=True)):
        tree.zero_grad()
        _two_dtypes_loss(m, x).backward()
        clear()  # torch's default set_to_none=True: not an in-place edit, still too late
        with pytest.raises(RuntimeError, match=r"a .grad was replaced or set to None"):
            opt.step()
    tree.close()


def test_a_dropped_tree_frees_its_worker_without_the_cycle_collector():
    """The tree and its bucket state form no cycle: a model's tree with step_in_backward, once
    dropped, frees its asyncs worker id at once (8 ids: the 9th model was refused until
    Python's cyclic collector ran)."""
    import gc
    import weakref

    gc.disable()
    try:
        for _ in range(12):
            m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
            tree = tnn.consolidate_module(m)
            opt = topt.Adam(tree.params)
            tree.step_in_backward(opt)
            m(torch.randn(8, 4)).sum().backward()
            opt.step()
            gone = weakref.ref(tree)
            del m, tree, opt
            assert gone() is None
    finally:
        gc.enable()


def test_step_in_backward_refusals_and_off():
    torch.manual_seed(0)
    m, other = Net(), Net()
    tree = tnn.consolidate_module(m)
    with pytest.raises(TypeError, match="expected a treetensor.optim optimizer"):
        tree.step_in_backward(torch.optim.Adam(m.parameters()))
    with pytest.raises(ValueError, match="over other parameters"):
        tree.step_in_backward(topt.Adam(tnn.consolidate_module(other).params))
    opt = topt.Adam(tree.params, lr=1e-2)
    tree.step_in_backward(opt)
    x = batch()
    m(x).sum().backward()
    # The step is taken: other gradients would be lost, a second backward would accumulate.
    with pytest.raises(RuntimeError, match="already taken during backward"):
        opt.step(ttorch.zeros_like(tree.params))
    tree.zero_grad()
    with pytest.raises(RuntimeError, match="a second backward before Adam.step"):
        m(x).sum().backward()  # the refused step() acknowledged nothing
    with pytest.raises(RuntimeError, match="changed in place .* after backward"):
        opt.step()  # acknowledged, the zero_grad after the step's backward reported
    assert opt.state["step"] == 1
    before = [p.detach().clone() for p in m.parameters()]
    tree.zero_grad()
    m(x).sum().backward()
    assert opt.state["step"] == 2
    opt.step()
    moved = [p.detach().clone() for p in m.parameters()]
    assert not any(torch.equal(a, b) for a, b in zip(before, moved))
    tree.step_in_backward(None)  # off: backward steps nothing, step() steps
    tree.zero_grad()
    m(x).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(moved, m.parameters()))
    opt.step()
    assert opt.state["step"] == 3


def _stepping_in_backward():
    """A Net, its tree and an Adam that steps during every backward."""
    torch.manual_seed(0)
    m = Net()
    tree = tnn.consolidate_module(m)
    opt = topt.Adam(tree.params, lr=1e-2)
    tree.step_in_backward(opt)
    return m, tree, opt


def test_close_during_a_backward_is_refused_and_changes_nothing():
    m, tree, opt = _stepping_in_backward()
    x = batch()
    refused = []

    def close_now(grad):
        with pytest.raises(RuntimeError, match="close\\(\\) cannot run while a backward"):
            tree.close()
        refused.append(True)
        return grad

    def hook_output(module, inputs, out):  # its gradient comes after later layers' parameters'
        out.register_hook(close_now)

    handle = m.conv.register_forward_hook(hook_output)
    m(x).sum().backward()
    handle.remove()
    assert refused
    assert opt.state["step"] == 1  # the hooks stayed: that backward took its step
    opt.step()
    tree.close()  # after backward: closes
    tree.zero_grad()
    m(x).sum().backward()
    assert opt.state["step"] == 1  # no hooks, no step during backward


def test_step_in_backward_raises_a_bucket_error_from_backward(monkeypatch):
    torch.manual_seed(0)
    m = Net()
    tree = tnn.consolidate_module(m, first_bucket_cap_mb=0.0005, bucket_cap_mb=0.001)
    opt = topt.Adam(tree.params, lr=1e-2)
    tree.step_in_backward(opt)
    calls = []

    def failing(params, grads, moments, step):
        calls.append(step)
        if len(calls) == 2:
            raise ValueError("Adam.step: bucket 2 failed")
        topt.Adam._kernel(opt, params, grads, moments, step)
    monkeypatch.setattr(opt, "_kernel", failing)
    tree.step_in_backward(opt)  # re-plan over the patched kernel
    with pytest.raises(ValueError, match="bucket 2 failed"):
        m(batch()).sum().backward()
    # The later buckets skipped the step; it is counted (no bucket takes it twice): step()
    # only acknowledges it, and a backward may also come first (the batch skipped).
    assert len(calls) == 2 < len(tree._buckets.ranges)
    assert opt.state["step"] == 1
    before = [p.detach().clone() for p in m.parameters()]
    opt.step()
    assert opt.state["step"] == 1 and all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    tree.close()


class SavesADetachedWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, x, fail=False):
        if fail:  # a hook that raises between b's gradients and a's
            u = self.a(x)
            u.register_hook(lambda g: (_ for _ in ()).throw(ValueError("a NaN check failed")))
        else:
            u = self.a(x) @ self.b.weight.detach()  # saved: read by backward after b's gradient
        return self.b(u).sum()


@pytest.mark.parametrize("fail", [False, True], ids=["in-place-error", "hook-error"])
def test_step_in_backward_after_a_backward_that_raised(fail):
    """b's bucket steps before backward reads b.weight's saved detach(): autograd raises its
    in-place error (an ordinary step's version bump), or a hook raises; either way the
    launched bucket was stepped and the next use counts the step with a warning."""
    torch.manual_seed(0)
    m = SavesADetachedWeight()
    tree = tnn.consolidate_module(m, first_bucket_cap_mb=1e-9, bucket_cap_mb=1e-9)
    opt = topt.Adam(tree.params, lr=1e-2)
    tree.step_in_backward(opt)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    match = "a NaN check failed" if fail else "modified by an inplace operation"
    with pytest.raises((RuntimeError, ValueError), match=match):
        m(torch.ones(2, 3), fail=fail).backward()
    with pytest.warns(RuntimeWarning, match=r"had stepped 2 of 4 gradient buckets"):
        tree.zero_grad()
    assert opt.state["step"] == 1
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]) == n.startswith("a."), n
    # The loop goes on: step() would only acknowledge; skipping it, a new backward steps.
    tree.zero_grad()
    m.b(torch.ones(2, 3)).sum().backward()
    opt.step()
    assert opt.state["step"] == 2
    tree.close()


def _amsgrad_on(opt):
    sd = opt.state_dict()
    sd["param_groups"][0]["amsgrad"] = True
    for st in sd["state"].values():
        st["max_exp_avg_sq"] = st["exp_avg_sq"] * 2
    opt.load_state_dict(sd)  # adds the max_exp_avg_sq tree: a new buffer


def test_step_in_backward_replans_after_a_loaded_state():
    """A load that adds a moment tree (amsgrad turned on): the next backward steps it too."""
    runs = []
    for in_backward in (False, True):
        m, tree, opt = _steps_in_backward(topt.Adam, {}, in_backward, set_to_none=(False,))
        _amsgrad_on(opt)
        for _ in range(2):
            tree.zero_grad()
            m(batch()).square().mean().backward()
            opt.step()
        runs.append((m, opt))
    (ref, ref_opt), (m, opt) = runs
    for p, q in zip(ref.parameters(), m.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(leaves(opt.state["max_exp_avg_sq"])[0], leaves(ref_opt.state["max_exp_avg_sq"])[0])


def test_step_in_backward_waits_for_its_buckets_when_backward_ends_in_an_error():
    """The end of backward raises (an unused parameter's .grad has a graph): the buckets
    already launched are waited for and the step counted before backward raises."""
    torch.manual_seed(0)
    m = SavesADetachedWeight()
    tree = tnn.consolidate_module(m, first_bucket_cap_mb=1e-9, bucket_cap_mb=1e-9)
    opt = topt.Adam(tree.params, lr=1e-2)
    tree.step_in_backward(opt)
    m.a.weight.grad = torch.ones(3, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="'a.weight' has a graph"):
        m.b(torch.ones(2, 3)).sum().backward()  # reaches b only
    assert tree._buckets.worker.in_flight() == 0 and opt.state["step"] == 1
    tree.close()


class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(lambda t: torch.tanh(self.b(t)), torch.tanh(self.a(x)), use_reentrant=True)
        return self.c(h)


def _same_with_and_without(make, train, steps, cap=1e-5):
    """`train(m, tree, opt, in_backward)` from one seed on `make()`, as the ordinary loop and
    with step_in_backward (tiny buckets, Adam): the same steps counted, every parameter
    bitwise equal."""
    runs = []
    for in_backward in (False, True):
        torch.manual_seed(0)
        m = make()
        tree = tnn.consolidate_module(m, first_bucket_cap_mb=cap, bucket_cap_mb=cap)
        opt = topt.Adam(tree.params, lr=1e-2)
        if in_backward:
            tree.step_in_backward(opt)
        train(m, tree, opt, in_backward)
        runs.append((m, opt.state["step"]))
        tree.close()
    (ref, n_ref), (m, n) = runs
    assert n == n_ref == steps
    for (name, p), q in zip(ref.named_parameters(), m.parameters()):
        assert torch.equal(p, q), name


def test_step_in_backward_under_reentrant_checkpointing_and_a_reader_thread():
    """A nested backward (reentrant checkpointing) belongs to the one in progress, and a
    thread reading tree.grads meanwhile settles nothing."""
    import threading
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))

    def train(m, tree, opt, _):
        for _ in range(3):
            tree.zero_grad(set_to_none=True)
            y = m(x).square().mean()
            reader = threading.Thread(target=lambda: tree.grads)
            y.register_hook(lambda g: (reader.start(), reader.join(), g)[2])  # mid-backward
            y.backward()
            opt.step()
    _same_with_and_without(Checkpointed, train, 3)


def test_turning_step_in_backward_off_needs_the_step_acknowledged_and_trees_go_with_modules():
    import gc
    import weakref
    m, tree, opt = _stepping_in_backward()
    m(batch()).sum().backward()  # step 1 taken, not acknowledged
    with pytest.raises(RuntimeError, match="has not acknowledged the step"):
        tree.step_in_backward(None)
    before = [p.detach().clone() for p in m.parameters()]
    opt.step(tree.grads)  # acknowledges only
    assert opt.state["step"] == 1 and all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    tree.step_in_backward(None)
    tree.zero_grad()
    m(batch()).sum().backward()
    opt.step(tree.grads)  # a real step
    assert opt.state["step"] == 2
    assert not any(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    # An open tree does not keep its module alive, nor its worker id, once collected.
    refs = [weakref.ref(m)]
    for _ in range(9):  # more than the asyncs worker ids
        m2 = Net()
        t2 = tnn.consolidate_module(m2)
        t2.step_in_backward(topt.Adam(t2.params))
        refs.append(weakref.ref(m2))
        gc.collect()  # the last tree: its hooks and the module hold each other
    del m, tree, opt, m2, t2
    gc.collect()
    assert all(r() is None for r in refs)
    # ... while the module lives, its tree does, even when the caller keeps only the params:
    # the hooks (which hold it weakly) still copy each new gradient into its view.
    m = Net()
    tree = tnn.consolidate_module(m)
    params, view = tree.params, tree.grads.fc.weight
    tree.zero_grad(set_to_none=True)
    del tree
    gc.collect()
    m(batch()).sum().backward()
    assert m.fc.weight.grad is view and params.fc.weight is m.fc.weight


class CheckpointedFirst(torch.nn.Module):
    """Reentrant checkpointing whose nested backward reaches our hooks first: `a` outside the
    checkpoint (or nothing outside, `inside_only`)."""

    def __init__(self, inside_only):
        super().__init__()
        self.inside_only = inside_only
        self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = x.requires_grad_() if self.inside_only else torch.tanh(self.a(x))
        return checkpoint(lambda t: self.c(torch.tanh(self.b(t))), h, use_reentrant=True)


@pytest.mark.parametrize("inside_only", [False, True], ids=["outer-hook-later", "no-outer-hook"])
def test_step_in_backward_when_a_nested_backward_comes_first(inside_only):
    def train(m, tree, opt, _):
        for k in range(3):
            tree.zero_grad(set_to_none=k == 1)
            m(torch.ones(2, 4) * (k + 1)).square().mean().backward()
            opt.step(tree.grads)
    _same_with_and_without(lambda: CheckpointedFirst(inside_only), train, 3)


def test_step_in_backward_after_an_error_someone_keeps():
    """The create_graph refusal raised from our first hook, its exception kept (as pytest,
    Jupyter's sys.last_value do): the next backward is a new one, not a nested one."""
    kept = []

    def train(m, tree, opt, in_backward):
        if in_backward:
            tree.zero_grad(set_to_none=True)
            with pytest.raises(RuntimeError, match="has a graph") as e:
                m(batch()).square().sum().backward(create_graph=True)
            kept.append(e.value)
        for _ in range(2):
            tree.zero_grad()
            m(batch()).square().mean().backward()
            opt.step()
    _same_with_and_without(Net, train, 2, cap=1e-4)
    assert kept
