"""``treetensor.optim``: torch.optim's Adam, AdamW and SGD over a tree of parameters, each step
one single-pass kernel per parameter (or, when the trees are consolidated, per buffer) in
C++ with the GIL released (DESIGN.md §12).

    params = ttorch.Tensor(dict(model.named_parameters()))  # the model's own tensors
    opt = treetensor.optim.Adam(params, lr=1e-3)
    opt.step()               # with the parameters' .grad; or opt.step(grads), a tree of them

To train on one buffer, consolidate the model itself (``treetensor.nn.consolidate_module``,
whose ``params`` are the module's tensors as views of it): ``params.consolidate()`` of a
model's parameters makes a copy, which the optimizer would train instead of the model. Every
parameter needs a ``.grad`` (RuntimeError naming the first without one, where torch.optim
skips it): a tree's leaves take their steps together (one ``step`` count); consolidate_module's
gradients are zero, not None, for parameters a backward did not reach.

Options, defaults and arithmetic are torch.optim's (``Adam(lr=1e-3, betas=(0.9, 0.999),
eps=1e-8, weight_decay=0, amsgrad=False, maximize=False)``, AdamW's ``weight_decay=1e-2``,
``SGD(lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, maximize=False)``);
the results agree with torch.optim's to rounding (the kernels' order of operations is
PyTorch's; ATen may fuse a multiply-add where these round twice). The state (``opt.state``:
``step`` and the moment trees) has the parameters' structure and is consolidated when they
are. Bad options raise ValueError as torch.optim's do; a gradient tree of another structure,
dtype or shape raises before any parameter changes, naming the path; complex parameters raise
TypeError at construction (torch.optim steps their real view; step ``torch.view_as_real``).

Each optimizer is a ``torch.optim.Optimizer`` with one parameter group, the tree's leaves in
its flatten order: ``param_groups[0]`` holds the options a step reads (so ``group["lr"] = x``
and ``torch.optim.lr_scheduler`` work), step hooks run, and ``state_dict()`` /
``load_state_dict()`` use torch.optim's format (``{"state": {i: {"step", "exp_avg", ...}},
"param_groups": [{..., "param_names", "params"}]}``): parameter i is leaf i of the tree's
flatten order (sorted keys), ``param_names`` its dotted path. A loaded group with
``param_names`` (ours, or torch.optim's over ``model.named_parameters()``) is matched by name,
so a torch.optim checkpoint loads here whatever its order; one without (torch.optim's before
2.6) is matched by position, torch.optim's own rule: over a ``treetensor.nn`` module's
``params``, position i is the i-th parameter of ``module.parameters()`` (what such a
checkpoint's optimizer was built over), else leaf i of the flatten order. torch.optim loads
ours by position too: build it over
``[named[n] for n in sd["param_groups"][0]["param_names"]]``.
"""
import contextlib
import functools
import re

import torch
import torch.optim.optimizer as _torch_optimizer

from . import _C
from .torch import Tensor, tree_flatten, zeros_like

__all__ = ["Adam", "AdamW", "SGD"]


def _check(ok, what, value):
    if not ok:
        raise ValueError(f"Invalid {what}: {value}")


def _torch_flags(owner, capturable=False, differentiable=False):
    """torch.optim's implementation flags: ``foreach`` and ``fused`` are taken and change
    nothing (every step here is one single-pass kernel per buffer, and agrees with torch's
    fused and foreach steps to rounding); ``capturable`` and ``differentiable``, which would
    change what a step is, are refused when true.
    @raises ValueError naming the flag."""
    for name, on in (("capturable", capturable), ("differentiable", differentiable)):
        if on:
            raise ValueError(f"{owner}: {name}=True is not supported (treetensor.optim's steps "
                             f"are not CUDA-graph capturable nor differentiable); torch.optim "
                             f"has it")


def _state_like(params):
    s = zeros_like(params)
    return Tensor.consolidate(s) if Tensor.is_consolidated(params) else s  # keys come first


def _layout_buffers(name, tree, params):
    """The consolidated buffers of ``tree`` when its leaves lie at ``params``' offsets in
    buffers of the same number, else ValueError naming ``name``."""
    from .distributed import buffers_of
    leaves, ref = tree_flatten(tree)[0], tree_flatten(params)[0]
    if not (isinstance(tree, Tensor) and Tensor.is_consolidated(tree)) or len(leaves) != len(ref) or any(
            a.storage_offset() != b.storage_offset() or a.shape != b.shape
            for a, b in zip(leaves, ref)):
        raise ValueError(f"the optimizer's {name} are not consolidated as its parameters; a step "
                         f"over buffer ranges needs one layout")
    return buffers_of(leaves)


_KERNEL_NAME = re.compile(r"^(adamw?|sgd)_step(_single_pass)?: ")


@contextlib.contextmanager
def _errors_named(name):
    """The C++ kernels name themselves in their errors; the user called `name` (``Adam.step``)."""
    try:
        yield
    except (ValueError, TypeError) as e:
        text, renamed = _KERNEL_NAME.subn(f"{name}: ", str(e), count=1)
        if not renamed:
            raise
        raise type(e)(text) from None


# torch.optim's global step hook tables (registration fills them in place) and the profiler's
# switch, looked up once: a step asks them every time. A torch without them: always wrap.
_GLOBAL_HOOKS = (getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None),
                 getattr(_torch_optimizer, "_global_optimizer_post_hooks", None))
_PROFILING = getattr(torch.autograd, "_profiler_enabled", None)


def _hooks_or_profiler(opt):
    """Whether a step must go through torch.optim's hook and profiler wrapper: a step hook of
    the optimizer or a global one, or the autograd profiler on (unknown: yes)."""
    if None in _GLOBAL_HOOKS or _PROFILING is None:
        return True
    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or
                _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1] or _PROFILING())


def _step_entry(step):
    """torch.optim.Optimizer's step wrapper (pre/post hooks, a record_function named as
    torch's) when something would see it; else the step alone: the wrapper's record_function
    costs ~40 us per step here, 2% of a small model's training step."""
    wrapped = torch.optim.Optimizer.profile_hook_step(step)

    @functools.wraps(step)
    def entry(self, *args, **kwargs):
        if _hooks_or_profiler(self):
            return wrapped(self, *args, **kwargs)
        return step(self, *args, **kwargs)

    entry.hooked = True  # torch.optim.Optimizer.__init__ then wraps it no further
    return entry


class _State(dict):
    """``opt.state``: ``step`` and the moment trees by name, not torch.optim's state per
    parameter; looking one up by a parameter raises a KeyError that says so (torch's printed the
    whole tensor)."""

    __slots__ = ()

    def __missing__(self, key):
        if isinstance(key, str):
            raise KeyError(key)
        what = f"a {type(key).__name__}"
        if isinstance(key, torch.Tensor):
            what += f" of shape {list(key.shape)}"
        raise KeyError(f"treetensor.optim: opt.state is looked up by name ({sorted(self)}): 'step' "
                       f"and the moment trees, consolidated as the parameters, not by parameter "
                       f"as torch.optim's (got {what}); a parameter's moments are "
                       f"opt.state['exp_avg'][path], or state_dict()['state'][index] in torch's form")


def _paths(spec):
    return [".".join(p) or "<root>" for p in spec.paths()]


def _moment(name, where, value, param, target):
    """A loaded moment checked against its parameter (a dense tensor of its shape) and
    converted to its target's dtype and device; ValueError naming ``where`` otherwise."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: {where} is a {type(value).__name__}, not a tensor")
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{name}: {where} has shape {list(value.shape)}; the parameter has "
                         f"{list(param.shape)}")
    if value.layout != torch.strided or value.device.type == "meta":
        raise ValueError(f"{name}: {where} is a {value.layout} tensor on {value.device}; "
                         f"expected a dense one with data")
    try:
        return value.to(device=target.device, dtype=target.dtype)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{name}: {where} cannot become {target.dtype} on {target.device}: "
                         f"{e}") from None


class _TreeOptimizer(torch.optim.Optimizer):
    # torch.optim's options beyond ours, as state_dict() reports them; a loaded group that
    # differs in one of _must_match would be stepped another way than it asks, so is refused.
    _must_match = ("differentiable",)
    _scalar_keys = ("step",)  # what torch.optim keeps per parameter beside the moments

    def _torch_options(self):
        return {"foreach": None, "differentiable": False, "fused": None}

    def _state_keys(self, options=None):  # the moment trees a step with `options` reads
        return ()

    def __init__(self, params, defaults):
        if not isinstance(params, Tensor):
            raise TypeError(f"{type(self).__name__}: params must be a treetensor.torch.Tensor "
                            f"(a tree of parameters), got {type(params).__name__}")
        leaves, spec = tree_flatten(params)
        for i, p in enumerate(leaves):
            if p.is_complex():
                # torch.optim steps a complex parameter as its real view; these kernels do not.
                raise TypeError(f"{type(self).__name__}: the parameter at "
                                f"'{_paths(spec)[i]}' is complex ({p.dtype}); "
                                f"treetensor.optim steps real dtypes only (torch.view_as_real "
                                f"gives a real view to optimise)")
            if not p.is_floating_point():  # a step would fail on it after others had moved
                raise TypeError(f"{type(self).__name__}: the parameter at '{_paths(spec)[i]}' "
                                f"is {p.dtype}; treetensor.optim steps floating dtypes only")
        super().__init__(leaves, defaults)
        self.params = params
        self._leaf_paths = _paths(spec)
        self.state = _State(step=0)
        # torch.optim's order of a treetensor.nn module's parameters, kept from now on (the
        # tree may be closed, or the module consolidated again, before a state_dict()):
        # named_parameters()'s trainable ones, all of them, and the frozen ones' names.
        owner = _module_tree("params", params)
        if owner is not None:
            self._module_names = (list(owner._module_order), list(owner._named_order),
                                  {n for n, _ in owner._frozen_leaves})

    def __getstate__(self):  # torch.optim keeps three attributes; a tree optimizer needs all
        # but its hooks, treetensor.nn's ties to a module's backward (a copy has none) and what an
        # LR scheduler patched in (its wrapper of `step`, as torch.optim's copies drop it)
        hooks = {k for k in self.__dict__ if k.startswith("_optimizer_") and k.endswith("_hooks")}
        dropped = ("_taken", "_taken_partial", "_taken_edits", "_before_step", "step", "_opt_called")
        return {k: v for k, v in self.__dict__.items() if k not in hooks and k not in dropped}

    def __setstate__(self, state):
        super().__setstate__(state)  # torch.optim's: empty hook tables
        self.param_groups[0]["params"] = tree_flatten(self.params)[0]

    def add_param_group(self, param_group):
        if self.param_groups:  # torch.optim.Optimizer.__init__ adds the tree's own group
            raise NotImplementedError(f"{type(self).__name__}.add_param_group: a tree optimizer "
                                      f"has one group, its tree; make another optimizer for "
                                      f"another tree")
        super().add_param_group(param_group)

    @property
    def param_groups(self):
        """torch.optim's groups: one, the tree's. Refused (RuntimeError) between a backward that
        took the step (treetensor.nn's ModuleTree.step_in_backward) and the step() that
        acknowledges it: what reads the gradients through the groups then (GradScaler's unscale_
        and step, a clipping helper) would act after the step, on gradients it already used."""
        if self._taken is not None:
            raise RuntimeError(
                f"{type(self).__name__}: the step was already taken during backward "
                f"(ModuleTree.step_in_backward), so its param_groups are closed until step() "
                f"acknowledges it: gradients unscaled (GradScaler) or clipped now would change "
                f"nothing the step used; call step() first, or step_in_backward(None) to step "
                f"after backward")
        return self.__dict__["param_groups"]

    @param_groups.setter
    def param_groups(self, groups):  # torch.optim.Optimizer.__init__ and __setstate__
        self.__dict__["param_groups"] = groups

    def _options(self):  # what a step reads: a scheduler's writes to the group included
        return self.__dict__["param_groups"][0]

    def state_dict(self):
        """torch.optim's format: per parameter index its step (a float32 scalar tensor) and
        moments (the leaves of ``opt.state``'s trees, not copies); none before the first step,
        as torch.optim. ``param_groups``: the options, ``params`` the indices and
        ``param_names`` the paths. The indices follow ``module.named_parameters()`` for a
        ``treetensor.nn`` module's params (a torch.optim over the module's trainable
        parameters loads it by position), else the tree's flatten order."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        order = self._torch_order()
        group = {k: v for k, v in self._options().items() if k != "params"}
        group.update(self._torch_options())
        group["param_names"] = [self._leaf_paths[i] for i in order]  # torch.optim's names
        group["params"] = list(range(len(order)))
        state = {}
        if self.state["step"] > 0:
            trees = {k: tree_flatten(self.state[k])[0] for k in self._state_keys()}
            for j, i in enumerate(order):
                leaf_state = self._leaf_state({k: v[i] for k, v in trees.items()})
                if leaf_state:
                    state[j] = leaf_state
        state_dict = {"state": state, "param_groups": [group]}
        for hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        return state_dict

    def _leaf_state(self, moments):
        return {"step": torch.tensor(float(self.state["step"])), **moments}

    def load_state_dict(self, state_dict):
        """Loads torch.optim's format (from ``state_dict()`` here or there): the saved group
        replaces ours as torch.optim's does (a scheduler's ``initial_lr`` too); each parameter's
        moments are copied into ``opt.state``'s trees (consolidation kept), cast to the
        parameter's dtype. torch.optim's load_state_dict pre and post hooks run. Raises
        ValueError naming the parameter's index and path when the group's size or names (or,
        over a tree that is not a module's, of more than one leaf, its lack of names), an
        option these kernels do not implement, a moment (not a dense tensor of the parameter's
        shape) or a step (not a whole number, or not every parameter's) differs, or only some
        parameters have state; everything is checked before anything changes."""
        name = f"{type(self).__name__}.load_state_dict"
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        groups = state_dict["param_groups"]
        if len(groups) != 1:
            raise ValueError(f"{name}: loaded state dict has {len(groups)} parameter groups; a "
                             f"tree optimizer has one")
        group, n = groups[0], len(self._leaf_paths)
        torch_options = self._torch_options()
        for k in self._must_match:
            if group.get(k, torch_options[k]) != torch_options[k]:
                raise ValueError(f"{name}: the loaded group has {k}={group[k]!r}; "
                                 f"{self._refusal(k)}")
        per_leaf = [state_dict["state"].get(idx) for idx in self._loaded_ids(name, group, state_dict["state"])]
        have = [i for i, st in enumerate(per_leaf) if st]
        if have and len(have) != n:
            missing = next(i for i in range(n) if not per_leaf[i])
            raise ValueError(f"{name}: parameter {missing} ('{self._leaf_paths[missing]}') has no "
                             f"state while others do; a tree steps all its leaves together")
        options = {**self._options(),
                   **{k: v for k, v in group.items() if k not in ("params", "param_names")}}
        keys = self._state_keys(options)
        step, moments = self._validated(name, per_leaf, keys) if have else (0, None)
        # Checked and converted in full first: a refused load leaves the optimizer as it was.
        self._load_options(options)
        for k in keys:
            for i, target in enumerate(tree_flatten(self.state[k])[0]):
                if moments is None:
                    target.zero_()
                else:
                    target.copy_(moments[k][i])
        self.state["step"] = step
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _torch_order(self):
        """Our leaf indices in torch.optim's order: ``named_parameters()``'s for a
        ``treetensor.nn`` module's params, else the flatten order."""
        if self._module_names is None:
            return list(range(len(self._leaf_paths)))
        index = {path: i for i, path in enumerate(self._leaf_paths)}
        return [index[path] for path in self._module_names[0]]

    def _loaded_ids(self, name, group, state):
        """The loaded group's parameter id for each of our leaves: by ``param_names`` where the
        group has them (ours, or torch.optim's over ``model.named_parameters()``), else by
        position (torch.optim's own rule) in ``module.named_parameters()``'s order for a
        ``treetensor.nn`` module's params (its frozen parameters included when the group has
        them all: torch.optim over ``model.parameters()``); refused for another tree of more
        than one leaf, whose order torch's cannot be known to be. A frozen parameter of the
        module the group holds is skipped when it has no state."""
        module = self._module_names
        trainable, every, frozen = module if module is not None else (None, None, set())
        names = group.get("param_names")
        if names is None and module is None and len(self._leaf_paths) > 1:
            raise ValueError(f"{name}: the loaded group has no 'param_names', and torch.optim "
                             f"numbers parameters in the order its optimizer was given them, "
                             f"which a tree (keys sorted) does not know: load it into an "
                             f"optimizer over treetensor.nn.consolidate_module(model).params, "
                             f"or set the group's 'param_names' (e.g. [n for n, _ in "
                             f"model.named_parameters()])")
        if names is None:
            names = self._leaf_paths if module is None else trainable
            if module is not None and len(group["params"]) == len(every):
                names = every
        n = len(self._leaf_paths)
        if len(group["params"]) - len(frozen.intersection(names)) != n:
            raise ValueError(f"{name}: loaded state dict contains a parameter group of "
                             f"{len(group['params'])} parameters; this tree has {n} leaves" +
                             (f" (its module {len(every)} parameters, the frozen ones "
                              f"included)" if module is not None else ""))
        ids = dict(zip(names, group["params"]))
        for stray in frozen.intersection(names):
            if state.get(ids[stray]):
                raise ValueError(f"{name}: the loaded group's parameter '{stray}' has state but "
                                 f"is frozen here (requires_grad=False), so no leaf of this tree "
                                 f"takes it")
        for path in self._leaf_paths:
            if path not in ids:
                stray = sorted(set(names) - set(self._leaf_paths) - frozen)
                raise ValueError(f"{name}: the loaded group names no parameter '{path}' (it "
                                 f"names {stray or 'a duplicate'} instead)")
        return [ids[path] for path in self._leaf_paths]

    def _refusal(self, key):
        return "treetensor.optim's kernels do not step that way"

    def _load_options(self, options):
        self._options().update(options)

    def _validated(self, name, per_leaf, keys):
        """The loaded state checked whole: the one step of every parameter, and its moments as
        their targets' dtype and device (so the copy_ that loads them cannot fail)."""
        leaves = tree_flatten(self.params)[0]
        # A moment this load adds (amsgrad turned on) takes the parameters' dtype and device.
        targets = {k: tree_flatten(self.state.get(k, self.params))[0] for k in keys}
        moments, steps = {k: [] for k in keys}, set()
        for i, st in enumerate(per_leaf):
            at = f"parameter {i} ('{self._leaf_paths[i]}')"
            for k in self._scalar_keys + keys:
                if k not in st:
                    raise ValueError(f"{name}: {at} has no '{k}' (its state has "
                                     f"{sorted(st)}: another optimizer's checkpoint?)")
            for k in keys:
                moments[k].append(_moment(name, f"'{k}' of {at}", st[k], leaves[i], targets[k][i]))
            steps.add(self._whole_step(name, at, st))
        if len(steps) > 1:
            raise ValueError(f"{name}: the parameters' steps differ ({sorted(steps)}); a tree "
                             f"steps all its leaves together")
        return steps.pop(), moments

    def _whole_step(self, name, at, st):
        try:
            step = self._step_of(st)
        except (TypeError, ValueError, RuntimeError):
            step = st.get("step")
        if not (isinstance(step, (int, float)) and step == step and step >= 0
                and float(step).is_integer()):
            raise ValueError(f"{name}: the step of {at} is {step}; expected a whole number >= 0")
        return int(step)

    @staticmethod
    def _step_of(st):
        return float(st["step"])

    def _grads(self, grads):
        if grads is not None:
            return grads
        grads = Tensor.grad.__get__(self.params)  # the class's: a key 'grad' comes first
        leaves, spec = tree_flatten(grads) if isinstance(grads, Tensor) else ([grads], None)
        for i, g in enumerate(leaves):
            if g is None:
                where = ".".join(spec.paths()[i]) if spec is not None else "<root>"
                hint = ("; for a consolidated module pass tree.grads, in which a parameter "
                        "backward did not reach has a zero gradient: torch.optim skips it"
                        if _module_tree("params", self.params) is not None else "")
                raise RuntimeError(f"{type(self).__name__}.step: the parameter at '{where or '<root>'}' "
                                   f"has no .grad (call backward() first, or pass a tree of grads"
                                   f"{hint})")
        return grads

    def _kernel(self, params, grads, moments, step):  # step `step` (1, 2, ...) in place
        raise NotImplementedError

    def _moments(self):  # the state trees a step reads and writes, by name
        return {k: v for k, v in self.state.items() if k != "step"}

    @_step_entry
    def step(self, grads=None):
        """One step with `grads` (a tree of the parameters' structure; default: their .grad).
        `grads` may instead be torch.optim's closure: it is called with grad enabled (it
        re-evaluates the model and makes the gradients), the step uses the .grad it left, and
        its loss is returned. Right after a backward that took this step already
        (``treetensor.nn``'s ``ModuleTree.step_in_backward``) it only acknowledges that step,
        once; `grads` must then be None (or a closure) or that tree's ``grads`` (RuntimeError
        otherwise: other gradients would be lost)."""
        loss = None
        if callable(grads) and not isinstance(grads, Tensor):
            with torch.enable_grad():
                loss = grads()
            grads = None
        self._step(grads)
        return loss

    def _step(self, grads):
        settle = self._before_step() if self._before_step is not None else None
        if settle is not None:
            settle()
        if self._taken is not None:
            if grads is not None and grads is not self._taken:
                raise RuntimeError(f"{type(self).__name__}.step: this step was already taken "
                                   f"during backward (ModuleTree.step_in_backward) with the "
                                   f"gradients backward made; step(grads) with other gradients "
                                   f"would be lost: acknowledge it with step(), then "
                                   f"step_in_backward(None) to step after backward")
            edits, self._taken, self._taken_partial, self._taken_edits = self._taken_edits, None, False, None
            if edits is not None and (changed := edits()) is not None:
                raise RuntimeError(f"{type(self).__name__}.step: {changed} after backward had "
                                   f"taken this step with the gradients (ModuleTree."
                                   f"step_in_backward): the change did nothing; the step is "
                                   f"acknowledged. To clip or edit gradients, step_in_backward("
                                   f"None) and step after backward; to read their norm, "
                                   f"ttorch.norm(tree.grads) (clip_grad_norm_ writes them even "
                                   f"when it clips nothing)")
            return
        owner = _module_tree("_grads", grads) if grads is not None else None
        if owner is not None:
            # A module's gradient tree, maybe read before torch.optim's zero_grad() cleared the
            # .grad fields (the new gradients are copied into it first) or before a parameter
            # was frozen or moved.
            owner._check_params()
            owner._restore_grads()
        elif grads is None and (module := _module_tree("params", self.params)) is not None:
            # torch's loop (the .grad fields, not tree.grads): a parameter replaced, moved,
            # converted or frozen since consolidation would be stepped wrong without a word.
            module._check_params()
        grads = self._grads(grads)
        with _errors_named(f"{type(self).__name__}.step"):
            self._kernel(self.params, grads, self._moments(), self.state["step"] + 1)
        self.state["step"] += 1

    def _range_steps(self, grads, ranges):
        """For ``treetensor.nn``'s step during backward: one function per ``(buffer, lo, hi)``
        of ``ranges`` (element offsets into the k-th consolidated buffer of ``params``) taking
        step n of those elements only, ``fn(n)``: the step's kernel over slices of the
        parameters', gradients' and moments' buffers, so each element gets the bits a whole
        step gives it. ``grads`` must be consolidated as ``params`` (its ``grads``); raises
        ValueError when the parameters, gradients or moments are not consolidated with one
        layout (a state loaded since is)."""
        trees = {"params": self.params, "grads": grads, **self._moments()}
        buffers = {name: _layout_buffers(name, t, self.params) for name, t in trees.items()}
        name = f"{type(self).__name__}.step"

        def step_of(k, lo, hi):
            sliced = {n: Tensor({"buffer": b[k][lo:hi]}) for n, b in buffers.items()}
            params, grads = sliced.pop("params"), sliced.pop("grads")

            def run(n):
                with _errors_named(name):
                    self._kernel(params, grads, sliced, n)
            return run
        return [step_of(*r) for r in ranges]

    _taken = None  # the grads of a step taken during backward that step() has not acknowledged
    _taken_partial = False  # that step was taken by some buckets only (its backward raised)
    _taken_edits = None  # treetensor.nn's check of the gradients that step used
    _module_names = None  # (trainable, all, frozen) parameter names of a treetensor.nn module
    _before_step = None  # treetensor.nn's: a weak method settling a step a backward left

    def zero_grad(self, set_to_none=True):
        """Clears every parameter's .grad (set_to_none=False: fills it with zeros)."""
        for p in tree_flatten(self.params)[0]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()


# Installed by treetensor.nn (the layer above, which this one does not import): fn(attr, tree)
# -> the open ModuleTree whose `attr` ("params" or "_grads") is `tree`, or None. Without it no
# module is consolidated.
_module_tree_lookup = None


def _module_tree(attr, tree):
    return _module_tree_lookup(attr, tree) if _module_tree_lookup is not None else None


class Adam(_TreeOptimizer):
    """torch.optim.Adam over a tree of parameters (L2 weight decay added to the gradient;
    ``decoupled_weight_decay=True``, as torch's: AdamW's decay)."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False):
        _torch_flags(type(self).__name__, capturable, differentiable)
        self._decoupled = bool(decoupled_weight_decay)
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

    _must_match = ("differentiable", "decoupled_weight_decay")

    def _torch_options(self):
        return {**super()._torch_options(), "capturable": False,
                "decoupled_weight_decay": self._decoupled}

    def _refusal(self, key):
        if key == "decoupled_weight_decay":
            return ("load it into treetensor.optim.Adam" if self._decoupled else
                    "load it into treetensor.optim.AdamW or Adam(decoupled_weight_decay=True)")
        return super()._refusal(key)

    def _state_keys(self, options=None):
        amsgrad = (options or self._options())["amsgrad"]
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())

    def _load_options(self, options):
        super()._load_options(options)
        if self._options()["amsgrad"] and "max_exp_avg_sq" not in self.state:
            self.state["max_exp_avg_sq"] = _state_like(self.params)
        elif not self._options()["amsgrad"]:
            self.state.pop("max_exp_avg_sq", None)

    def _kernel(self, params, grads, moments, step):
        d = self._options()
        _C._adam_step(params, grads, moments["exp_avg"], moments["exp_avg_sq"], step, d["lr"],
                      d["betas"][0], d["betas"][1], d["eps"], d["weight_decay"], d["amsgrad"],
                      d["maximize"], self._decoupled, moments.get("max_exp_avg_sq"))


class AdamW(Adam):
    """torch.optim.AdamW over a tree of parameters (decoupled weight decay, default 1e-2)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         capturable=capturable, differentiable=differentiable,
                         decoupled_weight_decay=True)


class SGD(_TreeOptimizer):
    """torch.optim.SGD over a tree of parameters (momentum, dampening, nesterov, weight decay)."""

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 *, maximize=False, foreach=None, differentiable=False, fused=None):
        _torch_flags(type(self).__name__, differentiable=differentiable)
        _check(lr >= 0, "learning rate", lr)
        _check(momentum >= 0, "momentum value", momentum)
        _check(weight_decay >= 0, "weight_decay value", weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov, maximize=maximize))
        self.state["momentum_buffer"] = _state_like(params)

    def _state_keys(self, options=None):  # without momentum torch.optim keeps no buffer
        return ("momentum_buffer",) if (options or self._options())["momentum"] != 0 else ()

    _scalar_keys = ()

    def _leaf_state(self, moments):  # as torch.optim's SGD: the momentum buffer, no step
        return moments

    @staticmethod
    def _step_of(st):  # a momentum buffer means a step was taken (the first one sets it)
        return 1

    def _kernel(self, params, grads, moments, step):
        d = self._options()
        _C._sgd_step(params, grads, moments["momentum_buffer"], step, d["lr"], d["momentum"],
                     d["dampening"], d["weight_decay"], d["nesterov"], d["maximize"])
