"""treetensor.optim against torch.optim itself: the same parameters, gradients and options,
several steps, plain and consolidated trees. The kernels round as PyTorch's arithmetic does
except where ATen fuses a multiply-add, so the parameters agree within a bound derived from
the step (a few ulps of |w| plus of the lr-sized update per step), not bitwise."""
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import treetensor.optim as topt
import treetensor.torch as ttorch

STEPS = 4


def params():
    g = torch.Generator().manual_seed(1)
    return {"conv": torch.randn(8, 3, 3, 3, generator=g), "fc": {"bias": torch.randn(10, generator=g),
                                                                "weight": torch.randn(10, 8, generator=g)}}


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {"conv": torch.randn(8, 3, 3, 3, generator=g), "fc": {"bias": torch.randn(10, generator=g),
                                                                "weight": torch.randn(10, 8, generator=g)}}


def leaves(d):
    return [d["conv"], d["fc"]["bias"], d["fc"]["weight"]]  # sorted-key order


def agree(got_leaves, want_leaves, lr, what):
    eps = torch.finfo(torch.float32).eps
    for got, want in zip(got_leaves, want_leaves):
        got, want = got.detach(), want.detach()
        bound = (STEPS + 1) * eps * (want.abs() + 16 * lr)  # rounding of |w| and of each update
        assert ((got - want).abs() <= bound).all(), f"{what}: |diff| {(got - want).abs().max()}"


CASES = [
    ("Adam", {}),
    ("Adam", {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    ("Adam", {"lr": 1e-2, "amsgrad": True, "maximize": True}),
    ("AdamW", {"lr": 1e-2}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.3, "amsgrad": True}),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.3, "decoupled_weight_decay": True}),  # torch >= 2.6
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True}),
    # torch.optim's implementation flags: taken, the same step (torch's fused and foreach)
    ("Adam", {"lr": 1e-2, "fused": True}),
    ("AdamW", {"lr": 1e-2, "foreach": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "fused": True}),
]


@pytest.mark.parametrize("consolidated", [False, True], ids=["tree", "consolidated"])
@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_steps_agree_with_torch_optim(name, options, consolidated):
    ref = [torch.nn.Parameter(x) for x in leaves(params())]
    ref_opt = getattr(torch.optim, name)(ref, **options)
    t = ttorch.Tensor(params())
    if consolidated:
        t = t.consolidate()
    opt = getattr(topt, name)(t, **options)
    for step in range(STEPS):
        for p, g in zip(ref, leaves(grads(step))):
            p.grad = g
        ref_opt.step()
        opt.step(ttorch.Tensor(grads(step)))
    assert opt.state["step"] == STEPS
    agree(ttorch.tree_flatten(t)[0], ref, options.get("lr", 1e-3), f"{name} {options}")
    for k in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
        if k in opt.state:
            assert opt.state[k].is_consolidated() == consolidated


def dmap_requires_grad(d):
    return {k: dmap_requires_grad(v) if isinstance(v, dict) else v.requires_grad_() for k, v in d.items()}


def test_step_without_grads_uses_the_parameters_grad():
    t = ttorch.Tensor(dmap_requires_grad(params()))
    ref = [p.detach().clone().requires_grad_() for p in ttorch.tree_flatten(t)[0]]
    opt, ref_opt = topt.SGD(t, lr=0.5), torch.optim.SGD(ref, lr=0.5)
    (t * t).sum().backward()
    sum((p * p).sum() for p in ref).backward()
    opt.step()
    ref_opt.step()
    for got, want in zip(ttorch.tree_flatten(t)[0], ref):
        assert torch.equal(got.detach(), want.detach())  # w - 0.5 * 2w: exact
    opt.zero_grad()
    assert all(p.grad is None for p in ttorch.tree_flatten(t)[0])


@pytest.mark.parametrize("consolidated", [False, True], ids=["tree", "consolidated"])
def test_a_closure_steps_as_torch_optims_and_returns_its_loss(consolidated):
    t = ttorch.Tensor(dmap_requires_grad(params()))
    if consolidated:
        t = t.consolidate().requires_grad_()
    ref = [p.detach().clone().requires_grad_() for p in ttorch.tree_flatten(t)[0]]
    opt, ref_opt = topt.Adam(t, lr=1e-2), torch.optim.Adam(ref, lr=1e-2)

    def closure(ps, o):
        def run():
            o.zero_grad()
            loss = sum((p * p).sum() for p in ps)
            loss.backward()
            return loss
        return run

    for _ in range(STEPS):
        with torch.no_grad():  # as a training loop's step: the closure turns grad on itself
            got = opt.step(closure(ttorch.tree_flatten(t)[0], opt))
            want = ref_opt.step(closure(ref, ref_opt))
        # the same loss of parameters that agree within agree()'s bound: to ~10 ulps of it
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    agree(ttorch.tree_flatten(t)[0], ref, 1e-2, "closure")


def test_bad_input_is_refused_before_any_parameter_changes():
    t = ttorch.Tensor(params())
    before = [x.clone() for x in ttorch.tree_flatten(t)[0]]
    opt = topt.Adam(t)
    with pytest.raises(ValueError, match=r"^Adam\.step: key mismatch at 'fc'"):
        opt.step(ttorch.Tensor({"conv": torch.ones(8, 3, 3, 3), "fc": {"bias": torch.ones(10)}}))
    with pytest.raises(ValueError, match=r"^Adam\.step: at 'fc\.weight': grads has shape"):
        opt.step(ttorch.Tensor({"conv": torch.ones(8, 3, 3, 3), "fc": {"bias": torch.ones(10),
                                                                      "weight": torch.ones(8, 10)}}))
    with pytest.raises(RuntimeError, match=r"the parameter at 'conv' has no \.grad"):
        opt.step()
    with pytest.raises(ValueError, match=r"^SGD\.step: at 'conv': grads has dtype float64"):
        topt.SGD(t, lr=0.1).step(ttorch.Tensor(params()).double())
    with pytest.raises(TypeError, match=r"^AdamW\.step: grads must be a treetensor.torch.Tensor"):
        topt.AdamW(t).step({"conv": torch.ones(8, 3, 3, 3)})
    assert all(torch.equal(a, b) for a, b in zip(ttorch.tree_flatten(t)[0], before))
    assert opt.state["step"] == 0 and float(opt.state["exp_avg"].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        topt.Adam(t, lr=-1)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.0"):
        topt.AdamW(t, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        topt.SGD(t, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"^Adam: capturable=True is not supported"):
        topt.Adam(t, capturable=True)
    with pytest.raises(ValueError, match=r"^SGD: differentiable=True is not supported"):
        topt.SGD(t, lr=0.1, differentiable=True)
    with pytest.raises(TypeError, match="params must be a treetensor.torch.Tensor"):
        topt.SGD([torch.ones(1)], lr=0.1)


def test_complex_parameters_are_refused_naming_the_path():
    tree = ttorch.Tensor({"w": torch.zeros(3), "z": {"c": torch.zeros(2, dtype=torch.complex64)}})
    for opt in (topt.Adam, topt.AdamW, topt.SGD):
        with pytest.raises(TypeError, match="parameter at 'z.c' is complex"):
            opt(tree)


def run_steps(opt, steps, ref=None, ref_opt=None):
    """`steps` (a range) of gradients into ours and, when given, into torch.optim's."""
    for step in steps:
        opt.step(ttorch.Tensor(grads(step)))
        if ref_opt is not None:
            for p, g in zip(ref, leaves(grads(step))):
                p.grad = g
            ref_opt.step()


def saved_and_loaded(state_dict):
    import io
    f = io.BytesIO()
    torch.save(state_dict, f)
    f.seek(0)
    return torch.load(f)


def tree_of(values, consolidated=False):
    """A tree of params()' structure holding copies of `values` (its leaves, in order)."""
    conv, bias, weight = (v.detach().clone() for v in values)
    t = ttorch.Tensor({"conv": conv, "fc": {"bias": bias, "weight": weight}})
    return t.consolidate() if consolidated else t


@pytest.mark.parametrize("consolidated", [False, True], ids=["tree", "consolidated"])
@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_state_dict_through_a_file_resumes_bitwise(name, options, consolidated):
    whole = ttorch.Tensor(params())
    whole = whole.consolidate() if consolidated else whole
    whole_opt = getattr(topt, name)(whole, **options)
    run_steps(whole_opt, range(STEPS))
    first = ttorch.Tensor(params())
    first = first.consolidate() if consolidated else first
    first_opt = getattr(topt, name)(first, **options)
    run_steps(first_opt, range(STEPS // 2))
    checkpoint = saved_and_loaded({"params": [p.clone() for p in ttorch.tree_flatten(first)[0]],
                                   "opt": first_opt.state_dict()})
    t = tree_of(checkpoint["params"], consolidated)
    # The loaded group's options replace these; its decoupled_weight_decay must match (the
    # optimizer's kind: refused otherwise: test_bad_state_dicts_are_refused_naming_the_parameter).
    kind = {k: v for k, v in options.items() if k == "decoupled_weight_decay"}
    opt = getattr(topt, name)(t, lr=123.0, **kind)
    opt.load_state_dict(checkpoint["opt"])
    assert opt.param_groups[0]["lr"] == options.get("lr", 1e-3)
    run_steps(opt, range(STEPS // 2, STEPS))
    for got, want in zip(ttorch.tree_flatten(t)[0], ttorch.tree_flatten(whole)[0]):
        assert torch.equal(got, want), name
    for k in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
        if k in opt.state:
            assert opt.state[k].is_consolidated() == consolidated


MODULE_ORDER = ["fc.weight", "conv", "fc.bias"]  # a model's own order, not the tree's sorted one


def by_path(d):
    return {"conv": d["conv"], "fc.bias": d["fc"]["bias"], "fc.weight": d["fc"]["weight"]}


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_state_dicts_move_between_torch_optim_and_ours(name, options):
    lr = options.get("lr", 1e-3)
    # torch.optim over named parameters in the model's order -> ours, matched by name: half the
    # steps there, the rest here, against all of them there.
    named = {n: torch.nn.Parameter(x) for n, x in by_path(params()).items()}
    ref_opt = getattr(torch.optim, name)([(n, named[n]) for n in MODULE_ORDER], **options)
    for step in range(STEPS // 2):
        for n, g in by_path(grads(step)).items():
            named[n].grad = g
        ref_opt.step()
    t2 = tree_of([named[n] for n in ("conv", "fc.bias", "fc.weight")])
    opt = getattr(topt, name)(t2, **options)
    opt.load_state_dict(saved_and_loaded(ref_opt.state_dict()))
    in_tree_order = [named[n] for n in ("conv", "fc.bias", "fc.weight")]
    run_steps(opt, range(STEPS // 2, STEPS), in_tree_order, ref_opt)
    agree(ttorch.tree_flatten(t2)[0], in_tree_order, lr, f"{name} {options}: torch.optim's state here")
    # ours -> torch.optim: the same format key for key; torch.optim matches by position, so it
    # is built over the parameters in the order param_names gives, and continues from it.
    sd = opt.state_dict()
    ref_sd = ref_opt.state_dict()
    assert sd["param_groups"][0].keys() == ref_sd["param_groups"][0].keys()
    assert sd["param_groups"][0]["param_names"] == ["conv", "fc.bias", "fc.weight"]
    assert [set(s) for s in sd["state"].values()] == [set(s) for s in ref_sd["state"].values()]
    back = {n: torch.nn.Parameter(x.clone()) for n, x in zip(sd["param_groups"][0]["param_names"],
                                                             ttorch.tree_flatten(t2)[0])}
    back_opt = getattr(torch.optim, name)([back[n] for n in sd["param_groups"][0]["param_names"]],
                                          **options)
    back_opt.load_state_dict(saved_and_loaded(sd))
    run_steps(opt, range(STEPS, STEPS + 2), list(back.values()), back_opt)
    agree(list(back.values()), ttorch.tree_flatten(t2)[0], lr, f"{name} {options}: ours in torch.optim")


def test_a_torch_group_without_names_is_refused_by_a_plain_tree():
    """torch.optim over model.parameters() writes no param_names and numbers its parameters in
    the model's order, which a tree of sorted keys cannot know: refused (it was matched in
    sorted order, in silence where the shapes agree); with the names it loads."""
    named = {n: torch.nn.Parameter(x) for n, x in by_path(params()).items()}
    ref_opt = torch.optim.Adam([named[n] for n in MODULE_ORDER])
    for n, g in by_path(grads(0)).items():
        named[n].grad = g
    ref_opt.step()
    sd = ref_opt.state_dict()
    assert "param_names" not in sd["param_groups"][0]
    opt = topt.Adam(tree_of([named[n] for n in ("conv", "fc.bias", "fc.weight")]))
    with pytest.raises(ValueError, match=r"Adam.load_state_dict: the loaded group has no "
                                         r"'param_names'.*consolidate_module\(model\).params"):
        opt.load_state_dict(sd)
    assert opt.state["step"] == 0
    sd["param_groups"][0]["param_names"] = list(MODULE_ORDER)
    opt.load_state_dict(sd)
    for k, n in enumerate(("conv", "fc.bias", "fc.weight")):
        i = MODULE_ORDER.index(n)
        assert torch.equal(ttorch.tree_flatten(opt.state["exp_avg"])[0][k], sd["state"][i]["exp_avg"]), n
    one = torch.nn.Parameter(torch.ones(3))  # a single leaf: no order to know
    one_opt = torch.optim.Adam([one])
    one.grad = torch.ones(3)
    one_opt.step()
    topt.Adam(ttorch.Tensor({"w": one})).load_state_dict(one_opt.state_dict())


def test_param_groups_and_lr_schedulers_work_as_on_torch_optim():
    ref = [torch.nn.Parameter(x) for x in leaves(params())]
    ref_opt = torch.optim.AdamW(ref, lr=0.1)
    t = ttorch.Tensor(params())
    opt = topt.AdamW(t, lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    seen = []
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["lr"]))
    for step in range(STEPS):
        run_steps(opt, [step], ref, ref_opt)
        sched.step()
        ref_sched.step()
    assert seen == [0.1 * 0.5 ** k for k in range(STEPS)]
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 * 0.5 ** STEPS
    assert opt.defaults["lr"] == 0.1  # as torch.optim: the constructor's options
    agree(ttorch.tree_flatten(t)[0], ref, 0.1, "AdamW under StepLR")
    with pytest.raises(NotImplementedError, match="one group, its tree"):
        opt.add_param_group({"params": [torch.zeros(2)]})


def test_bad_state_dicts_are_refused_naming_the_parameter():
    t = ttorch.Tensor(params())
    opt = topt.Adam(t)
    run_steps(opt, range(2))
    good = opt.state_dict()
    other = topt.Adam(ttorch.Tensor(params()))

    def edited(edit):
        sd = saved_and_loaded(good)
        edit(sd)
        return sd

    with pytest.raises(ValueError, match="3 parameters; this tree has 2 leaves"):
        topt.Adam(ttorch.Tensor({"a": torch.zeros(2), "b": torch.zeros(3)})).load_state_dict(good)
    with pytest.raises(ValueError, match="2 parameter groups"):
        other.load_state_dict(edited(lambda sd: sd["param_groups"].append(sd["param_groups"][0])))
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 2 \('fc.weight'\) has shape \[8, 10\]"):
        other.load_state_dict(edited(lambda sd: sd["state"][2].update(exp_avg=torch.zeros(8, 10))))
    with pytest.raises(ValueError, match=r"parameter 1 \('fc.bias'\) has no state while others do"):
        other.load_state_dict(edited(lambda sd: sd["state"].pop(1)))
    with pytest.raises(ValueError, match=r"parameter 0 \('conv'\) has no 'exp_avg_sq'"):
        other.load_state_dict(edited(lambda sd: sd["state"][0].pop("exp_avg_sq")))
    with pytest.raises(ValueError, match=r"steps differ \(\[2, 5\]\)"):
        other.load_state_dict(edited(lambda sd: sd["state"][1].update(step=torch.tensor(5.0))))
    with pytest.raises(ValueError, match="decoupled_weight_decay=True; load it into treetensor.optim.AdamW"):
        other.load_state_dict(topt.AdamW(ttorch.Tensor(params())).state_dict())
    with pytest.raises(ValueError, match=r"parameter 2 \('fc.weight'\) has no 'step' \(its state "
                                         r"has \['exp_avg', 'exp_avg_sq'\]: another optimizer's"):
        other.load_state_dict(edited(lambda sd: sd["state"][2].pop("step")))
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 \('conv'\) is a float, not a tensor"):
        other.load_state_dict(edited(lambda sd: sd["state"][0].update(exp_avg=0.5)))
    with pytest.raises(ValueError, match=r"names no parameter 'fc.bias' \(it names \['fc.b'\] instead\)"):
        other.load_state_dict(edited(lambda sd: sd["param_groups"][0]["param_names"].__setitem__(1, "fc.b")))
    with pytest.raises(ValueError, match="differentiable=True"):
        other.load_state_dict(edited(lambda sd: sd["param_groups"][0].update(differentiable=True)))
    assert other.state["step"] == 0 and float(other.state["exp_avg"].abs().sum()) == 0.0
    assert other.param_groups[0]["lr"] == 1e-3  # nothing changed by a refused load
    other.load_state_dict(good)
    assert other.state["step"] == 2 and torch.equal(other.state["exp_avg"].fc.weight, opt.state["exp_avg"].fc.weight)


def test_step_hooks_global_hooks_and_the_profiler_see_every_step():
    t = ttorch.Tensor(params())
    opt = topt.SGD(t, lr=0.1)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o.state["step"])))
    handle = register_optimizer_step_post_hook(
        lambda o, args, kwargs: seen.append(("global post", o.state["step"])))
    try:
        opt.step(ttorch.Tensor(grads(0)))
    finally:
        handle.remove()
    opt.step(ttorch.Tensor(grads(1)))  # the global hook is gone, the pre hook stays
    assert seen == [("pre", 0), ("global post", 1), ("pre", 1)]
    plain = topt.Adam(ttorch.Tensor(params()))
    with torch.autograd.profiler.profile() as prof:
        plain.step(ttorch.Tensor(grads(0)))
    assert any(e.name == "Optimizer.step#Adam.step" for e in prof.function_events)
    assert plain.state["step"] == 1


def test_pickles_with_an_lr_scheduler_attached_as_torch_optim_does():
    import pickle
    t = ttorch.Tensor(params()).consolidate()
    opt = topt.SGD(t, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    run_steps(opt, range(1))
    sched.step()
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.05
    assert "step" not in vars(clone)  # the scheduler's wrapper stays with the original
    clone.step(ttorch.Tensor(grads(2)))
    assert clone.state["step"] == 2 and opt.state["step"] == 1


def test_copies_and_pickles_step_as_the_original():
    import copy
    import pickle
    t = ttorch.Tensor(params()).consolidate()
    opt = topt.Adam(t, lr=1e-2)
    run_steps(opt, range(2))
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        before = [x.clone() for x in ttorch.tree_flatten(t)[0]]
        clone.step(ttorch.Tensor(grads(2)))
        assert all(torch.equal(a, b) for a, b in zip(ttorch.tree_flatten(t)[0], before)), "original moved"
        assert clone.state["step"] == 3 and opt.state["step"] == 2
        assert clone.param_groups[0]["params"][0] is ttorch.tree_flatten(clone.params)[0][0]
        reference = topt.Adam(ttorch.Tensor(params()).consolidate(), lr=1e-2)  # no copy involved
        run_steps(reference, range(3))
        for a, b in zip(ttorch.tree_flatten(clone.params)[0], ttorch.tree_flatten(reference.params)[0]):
            assert torch.equal(a, b)


def test_a_scheduler_resumes_after_a_load():
    opt = topt.AdamW(ttorch.Tensor(params()), lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for step in range(3):
        run_steps(opt, [step])
        sched.step()
    other = topt.AdamW(ttorch.Tensor(params()), lr=0.1)
    other.load_state_dict(opt.state_dict())
    resumed = torch.optim.lr_scheduler.CosineAnnealingLR(other, T_max=10, last_epoch=2)
    resumed.load_state_dict(sched.state_dict())
    sched.step()
    resumed.step()
    assert other.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert other.param_groups[0]["initial_lr"] == 0.1


def test_loads_that_would_fail_half_way_are_refused_first():
    t = ttorch.Tensor(params())
    opt = topt.Adam(t)
    run_steps(opt, range(2))
    good = saved_and_loaded(opt.state_dict())
    other = topt.Adam(ttorch.Tensor(params()))
    cases = [
        (lambda sd: sd["state"][1].update(exp_avg_sq=torch.empty(10, device="meta")), r"parameter 1 \('fc.bias'\) is a torch.strided tensor on meta"),
        (lambda sd: sd["state"][2].update(exp_avg=torch.zeros(10, 8).to_sparse()), r"parameter 2 \('fc.weight'\) is a torch.sparse_coo tensor"),
        (lambda sd: sd["state"][0].update(step=torch.tensor(float("nan"))), r"step of parameter 0 \('conv'\) is nan"),
        (lambda sd: sd["state"][0].update(step=torch.tensor(2.5)), r"step of parameter 0 \('conv'\) is 2.5"),
        (lambda sd: sd["state"][0].update(step="two"), r"step of parameter 0 \('conv'\) is two"),
    ]
    for edit, message in cases:
        sd = saved_and_loaded(good)
        sd["param_groups"][0]["lr"] = 5.0
        edit(sd)
        with pytest.raises(ValueError, match=message):
            other.load_state_dict(sd)
        assert other.param_groups[0]["lr"] == 1e-3 and other.state["step"] == 0
        assert float(other.state["exp_avg"].abs().sum()) == 0.0


def test_integer_parameters_are_refused_at_construction():
    tree = ttorch.Tensor({"a": torch.zeros(3), "z": torch.zeros(3, dtype=torch.long)})
    for opt in (topt.Adam, topt.AdamW, topt.SGD):
        with pytest.raises(TypeError, match="parameter at 'z' is torch.int64; treetensor.optim steps floating"):
            opt(tree)


def test_state_dict_hooks_run_as_on_torch_optim():
    opt = topt.SGD(ttorch.Tensor(params()), lr=0.1, momentum=0.9)
    run_steps(opt, range(1))
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
    opt.register_state_dict_post_hook(lambda o, sd: dict(sd, extra=1))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert calls == ["save pre", "load pre", "load post"]


def test_a_large_step_has_the_same_bits_on_any_thread_count_and_steps_after_a_fork():
    """A consolidated step over more than one piece (2^18 elements) runs on as many lanes as
    torch.get_num_threads(), as Adam(fused=True) takes the intra-op threads: bitwise the
    one-thread step. A forked child, whose lanes have no threads, still steps (the caller runs
    every piece)."""
    def run(threads):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            torch.manual_seed(4)
            t = ttorch.Tensor({"a": torch.randn(700001), "b": {"c": torch.randn(300, 1000)}}).consolidate()
            opt = topt.AdamW(t, lr=1e-2, amsgrad=True)
            for _ in range(3):
                opt.step(ttorch.Tensor({"a": torch.randn(700001), "b": {"c": torch.randn(300, 1000)}}))
            return ttorch.tree_flatten(t)[0] + ttorch.tree_flatten(opt.state["max_exp_avg_sq"])[0]
        finally:
            torch.set_num_threads(before)
    for x, y in zip(run(1), run(3)):
        assert torch.equal(x, y)
    child = textwrap.dedent("""
        import os, torch, treetensor.torch as ttorch, treetensor.optim as topt
        torch.set_num_threads(2)
        t = ttorch.Tensor({"a": torch.zeros(700001)}).consolidate()
        opt = topt.SGD(t, lr=1.0)
        g = ttorch.Tensor({"a": torch.ones(700001)})
        opt.step(g)  # the lanes' threads start in the parent
        pid = os.fork()
        if pid == 0:
            opt.step(g)
            # Checked on a slice under ATen's grain: GNU OpenMP's pool does not survive a fork.
            os._exit(0 if bool((t.a[::100] == -2).all()) else 3)
        _, status = os.waitpid(pid, 0)
        raise SystemExit(os.waitstatus_to_exitcode(status))
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_state_looked_up_by_a_parameter_says_how_it_is_laid_out():
    """torch.optim code reads opt.state[p]; ours holds the moment trees by name: a KeyError that
    says so (a plain dict's printed the whole tensor), pickles and copies keep the layout."""
    import copy
    import pickle
    p = torch.nn.Parameter(torch.ones(1000))
    opt = topt.Adam(ttorch.Tensor({"w": p}))
    opt.step(ttorch.Tensor({"w": torch.ones(1000)}))
    with pytest.raises(KeyError, match=r"opt.state is looked up by name \(\['exp_avg', 'exp_avg_sq', "
                                       r"'step'\]\).*got a Parameter of shape \[1000\]") as e:
        opt.state[p]
    assert "1., 1." not in str(e.value)
    with pytest.raises(KeyError, match="^'nothing'$"):
        opt.state["nothing"]
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert other.state["step"] == 1 and torch.equal(other.state["exp_avg"]["w"], opt.state["exp_avg"]["w"])
        with pytest.raises(KeyError, match="looked up by name"):
            other.state[p]
