"""treetensor.optim against torch.optim itself: the same parameters, gradients and options,
several steps, plain and consolidated trees. The kernels round as PyTorch's arithmetic does
except where ATen fuses a multiply-add, so the parameters agree within a bound derived from
the step (a few ulps of |w| plus of the lr-sized update per step), not bitwise."""
import pytest
import torch

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


CASES = [
    ("Adam", {}),
    ("Adam", {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    ("Adam", {"lr": 1e-2, "amsgrad": True, "maximize": True}),
    ("AdamW", {"lr": 1e-2}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.3, "amsgrad": True}),
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True}),
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
    lr = options.get("lr", 1e-3)
    eps = torch.finfo(torch.float32).eps
    for got, want in zip(ttorch.tree_flatten(t)[0], ref):
        want = want.detach()
        bound = (STEPS + 1) * eps * (want.abs() + 16 * lr)  # rounding of |w| and of each update
        assert ((got - want).abs() <= bound).all(), f"{name} {options}: |diff| {(got - want).abs().max()}"
    for k in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
        if k in opt.state:
            assert opt.state[k].is_consolidated() == consolidated


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


def dmap_requires_grad(d):
    return {k: dmap_requires_grad(v) if isinstance(v, dict) else v.requires_grad_() for k, v in d.items()}


def test_bad_input_is_refused_before_any_parameter_changes():
    t = ttorch.Tensor(params())
    before = [x.clone() for x in ttorch.tree_flatten(t)[0]]
    opt = topt.Adam(t)
    with pytest.raises(ValueError, match="fc"):
        opt.step(ttorch.Tensor({"conv": torch.ones(8, 3, 3, 3), "fc": {"bias": torch.ones(10)}}))
    with pytest.raises(ValueError, match=r"fc\.weight.*shape"):
        opt.step(ttorch.Tensor({"conv": torch.ones(8, 3, 3, 3), "fc": {"bias": torch.ones(10),
                                                                      "weight": torch.ones(8, 10)}}))
    with pytest.raises(RuntimeError, match=r"the parameter at 'conv' has no \.grad"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ttorch.tree_flatten(t)[0], before))
    assert opt.state["step"] == 0 and float(opt.state["exp_avg"].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        topt.Adam(t, lr=-1)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.0"):
        topt.AdamW(t, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        topt.SGD(t, lr=0.1, nesterov=True)
    with pytest.raises(TypeError, match="params must be a treetensor.torch.Tensor"):
        topt.SGD([torch.ones(1)], lr=0.1)


def test_complex_parameters_are_refused_naming_the_path():
    tree = ttorch.Tensor({"w": torch.zeros(3), "z": {"c": torch.zeros(2, dtype=torch.complex64)}})
    for opt in (topt.Adam, topt.AdamW, topt.SGD):
        with pytest.raises(TypeError, match="parameter at 'z.c' is complex"):
            opt(tree)
