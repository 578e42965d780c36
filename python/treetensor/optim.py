"""``treetensor.optim``: torch.optim's Adam, AdamW and SGD over a tree of parameters, each step
one single-pass kernel per parameter (or, when the trees are consolidated, per buffer) in
C++ with the GIL released (DESIGN.md §12).

    params = ttorch.Tensor(dict(model.named_parameters())).consolidate()  # optional
    opt = treetensor.optim.Adam(params, lr=1e-3)
    opt.step(grads)          # a tree of gradients; without it, the parameters' .grad

Options, defaults and arithmetic are torch.optim's (``Adam(lr=1e-3, betas=(0.9, 0.999),
eps=1e-8, weight_decay=0, amsgrad=False, maximize=False)``, AdamW's ``weight_decay=1e-2``,
``SGD(lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, maximize=False)``);
the results agree with torch.optim's to rounding (the kernels' order of operations is
PyTorch's; ATen may fuse a multiply-add where these round twice). The state (``opt.state``:
``step`` and the moment trees) has the parameters' structure and is consolidated when they
are. Bad options raise ValueError as torch.optim's do; a gradient tree of another structure,
dtype or shape raises before any parameter changes, naming the path; complex parameters raise
TypeError at construction (torch.optim steps their real view; step ``torch.view_as_real``).
"""
from . import _C
from .torch import Tensor, tree_flatten, zeros_like

__all__ = ["Adam", "AdamW", "SGD"]


def _check(ok, what, value):
    if not ok:
        raise ValueError(f"Invalid {what}: {value}")


def _state_like(params):
    s = zeros_like(params)
    return s.consolidate() if params.is_consolidated() else s


class _TreeOptimizer:
    def __init__(self, params, defaults):
        if not isinstance(params, Tensor):
            raise TypeError(f"{type(self).__name__}: params must be a treetensor.torch.Tensor "
                            f"(a tree of parameters), got {type(params).__name__}")
        leaves, spec = tree_flatten(params)
        for i, p in enumerate(leaves):
            if p.is_complex():
                # torch.optim steps a complex parameter as its real view; these kernels do not.
                raise TypeError(f"{type(self).__name__}: the parameter at "
                                f"'{'.'.join(spec.paths()[i]) or '<root>'}' is complex ({p.dtype}); "
                                f"treetensor.optim steps real dtypes only (torch.view_as_real "
                                f"gives a real view to optimise)")
        self.params = params
        self.defaults = defaults
        self.state = {"step": 0}

    def _grads(self, grads):
        if grads is not None:
            return grads
        grads = self.params.grad
        leaves, spec = tree_flatten(grads) if isinstance(grads, Tensor) else ([grads], None)
        for i, g in enumerate(leaves):
            if g is None:
                where = ".".join(spec.paths()[i]) if spec is not None else "<root>"
                raise RuntimeError(f"{type(self).__name__}.step: the parameter at '{where or '<root>'}' "
                                   f"has no .grad (call backward() first, or pass a tree of grads)")
        return grads

    def zero_grad(self, set_to_none=True):
        """Clears every parameter's .grad (set_to_none=False: fills it with zeros)."""
        for p in tree_flatten(self.params)[0]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()


class Adam(_TreeOptimizer):
    """torch.optim.Adam over a tree of parameters (L2 weight decay added to the gradient)."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, maximize=False):
        _check(lr >= 0, "learning rate", lr)
        _check(eps >= 0, "epsilon value", eps)
        _check(0 <= betas[0] < 1, "beta parameter at index 0", betas[0])
        _check(0 <= betas[1] < 1, "beta parameter at index 1", betas[1])
        _check(weight_decay >= 0, "weight_decay value", weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize))
        self.state["exp_avg"] = _state_like(params)
        self.state["exp_avg_sq"] = _state_like(params)
        if amsgrad:
            self.state["max_exp_avg_sq"] = _state_like(params)

    def step(self, grads=None):
        """One step with `grads` (a tree of the parameters' structure; default: their .grad)."""
        grads = self._grads(grads)
        d, s = self.defaults, self.state
        _C._adam_step(self.params, grads, s["exp_avg"], s["exp_avg_sq"], s["step"] + 1, d["lr"],
                      d["betas"][0], d["betas"][1], d["eps"], d["weight_decay"], d["amsgrad"],
                      d["maximize"], self._decoupled, s.get("max_exp_avg_sq"))
        s["step"] += 1


class AdamW(Adam):
    """torch.optim.AdamW over a tree of parameters (decoupled weight decay, default 1e-2)."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)


class SGD(_TreeOptimizer):
    """torch.optim.SGD over a tree of parameters (momentum, dampening, nesterov, weight decay)."""

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 *, maximize=False):
        _check(lr >= 0, "learning rate", lr)
        _check(momentum >= 0, "momentum value", momentum)
        _check(weight_decay >= 0, "weight_decay value", weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov, maximize=maximize))
        self.state["momentum_buffer"] = _state_like(params)

    def step(self, grads=None):
        """One step with `grads` (a tree of the parameters' structure; default: their .grad)."""
        grads = self._grads(grads)
        d, s = self.defaults, self.state
        _C._sgd_step(self.params, grads, s["momentum_buffer"], s["step"] + 1, d["lr"], d["momentum"],
                     d["dampening"], d["weight_decay"], d["nesterov"], d["maximize"])
        s["step"] += 1
