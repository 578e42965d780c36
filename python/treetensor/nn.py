"""``treetensor.nn``: a module's parameters, gradients and buffers as consolidated trees whose
leaves *are* the module's own tensors (DESIGN.md §21), so a training step sees one buffer per
(dtype, device) where PyTorch sees one tensor per parameter: FSDP's flat parameters and DDP's
``gradient_as_bucket_view``, for any ``torch.nn.Module``.

    model = MyModel()
    tree = treetensor.nn.consolidate_module(model)             # after .to(device), before training
    opt = treetensor.optim.Adam(tree.params, lr=1e-3)          # one single-pass kernel per buffer
    for x, y in data:
        tree.zero_grad()                                       # one fill per gradient buffer
        loss_fn(model(x), y).backward()                        # .grad of each parameter: a view
        opt.step(tree.grads)

Under ``torchrun`` pass ``process_group=torch.distributed.group.WORLD``: the parameters and
buffers are broadcast from rank 0 (as DDP's constructor does) and, during ``backward()``, each
bucket of the gradient buffer is averaged across ranks (``div_(world size)``, then an
``all_reduce``, DDP's default) as soon as its last gradient is written, while backward goes on
with the rest of the model (DDP's reducer). Buckets are contiguous ranges of a gradient buffer
taken from its end (the parameters backward reaches first, in the tree's sorted-path order): the
first up to ``first_bucket_cap_mb`` MiB, the others up to ``bucket_cap_mb`` MiB, DDP's 1 and 25.
They are launched in that fixed order on every rank; a bucket holding a parameter that a step
did not use (and, to keep the order, every bucket after it) is launched when backward ends
(DDP's ``find_unused_parameters``: its gradient is the zero ``zero_grad`` wrote), and ``backward()`` returns once every bucket is averaged.

Paths are the ``state_dict``'s names split at the dots (``layer1.0.conv1.weight`` is the path
``layer1/0/conv1/weight``). What models hold, handled:

- tied parameters (one ``Parameter`` under two names) are one leaf, at the first name
  ``named_parameters()`` gives; ``aliases`` maps every other name to it;
- frozen parameters (``requires_grad=False``) go to ``frozen``, outside the gradient buffer and
  the optimizer's tree;
- mixed dtypes and devices: one buffer per (dtype, device), as ``consolidate()`` groups;
- buffers (BatchNorm's statistics) are consolidated in ``buffers``; the module updates them in
  place, so they stay views;
- checkpoints: ``torch.save`` / ``treetensor.torch.save`` of ``state_dict()`` and
  ``load_state_dict`` of ``torch.load`` / ``treetensor.torch.load`` work as before;
- ``load_state_dict`` (without ``assign=True``) copies into the views;
- ``model.zero_grad()`` / ``torch.optim``'s ``zero_grad`` (``.grad`` set to None): the next
  backward's new gradient is copied into its view and the view put back as ``.grad``; a
  parameter that backward did not reach gets a zero gradient (never an older one). So
  ``torch.optim``'s ``zero_grad`` costs a copy per parameter: use ``zero_grad()`` here.

Refused, with an error naming the parameter's path: two parameters sharing one storage (e.g. one
a slice of another: consolidation would separate them), at ``consolidate_module``; a parameter
moved or converted after it (``model.to(dtype)``, ``.cuda()``, ``.half()``: its data no longer
lies in the buffer, so the optimizer would train a copy), at the next ``backward()`` that reaches
it; parameters replaced by ``load_state_dict(assign=True)``, by that call. Consolidate after
moving the model. Not detected: a parameter attribute assigned a new ``Parameter`` by hand.
"""
import torch as _torch

from .distributed import bucket_plan, buffer_of
from .torch import Tensor, tree_flatten, zeros_like

__all__ = ["ModuleTree", "consolidate_module"]

_MiB = 1 << 20


def _nest(named):
    """{'a.b': v} -> {'a': {'b': v}} (a state dict's names as tree paths)."""
    root = {}
    for name, value in named:
        *parents, leaf = name.split(".")
        node = root
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return root


def _buffers_of(leaves):
    seen, out = set(), []
    for leaf in leaves:
        key = leaf.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            out.append(buffer_of(leaf))
    return out


def _consolidate_in_place(named):
    """A consolidated tree whose leaves are the tensors of `named` (name -> tensor), each now a
    view into one buffer per (dtype, device): values copied once, then ``t.data = view``."""
    if not named:
        return Tensor({}), []
    copies = Tensor(_nest((n, t.detach()) for n, t in named.items())).consolidate()
    views, spec = tree_flatten(copies)
    order = [".".join(p) for p in spec.paths()]
    with _torch.no_grad():
        for name, view in zip(order, views):
            named[name].data = view
    # The module's own tensors now lie where consolidate() laid the copies: consolidate() of
    # their tree recognises the layout and gives the property back without a copy.
    tree = Tensor(_nest(named.items())).consolidate()
    return tree, order


def _check_unshared(named):
    owner = {}
    for name, p in named.items():
        key = (p.device, p.untyped_storage().data_ptr()) if p.numel() else None
        if key is not None and key in owner:
            raise ValueError(f"treetensor.nn.consolidate_module: parameters '{owner[key]}' and "
                             f"'{name}' share one storage but are different tensors; "
                             f"consolidating would separate them (tie them as one Parameter)")
        if key is not None:
            owner[key] = name


class ModuleTree:
    """A module's parameters, gradients and buffers as consolidated trees (made by
    :func:`consolidate_module`).

    ``params``: the trainable parameters (``requires_grad=True``), a consolidated
    ``treetensor.torch.Tensor`` whose leaves are the module's ``Parameter`` objects. ``grads``:
    its gradients, consolidated with the same layout; leaf ``p`` is ``params`` leaf ``p``'s
    ``.grad``. ``frozen``: the other parameters. ``buffers``: the module's buffers. ``aliases``:
    tied names -> the leaf's name. ``param_buffers`` / ``grad_buffers``: the 1-D buffers (one
    per dtype and device; the padding between leaves is zero)."""

    def __init__(self, module, process_group, bucket_cap_mb, first_bucket_cap_mb):
        self.module = module
        named, self.aliases = {}, {}
        first = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in first:
                self.aliases[name] = first[id(p)]
            else:
                first[id(p)] = name
                named[name] = p
        _check_unshared(named)
        trainable = {n: p for n, p in named.items() if p.requires_grad}
        frozen = {n: p for n, p in named.items() if not p.requires_grad}
        self.params, self._order = _consolidate_in_place(trainable)
        self.frozen, _ = _consolidate_in_place(frozen)
        self.buffers, _ = _consolidate_in_place(dict(module.named_buffers()))
        self._leaves = [trainable[n] for n in self._order]
        self.param_buffers = _buffers_of(self._leaves)
        self.grads = zeros_like(self.params).consolidate() if self._leaves else Tensor({})
        self._grad_leaves = tree_flatten(self.grads)[0]
        self.grad_buffers = _buffers_of(self._grad_leaves)
        with _torch.no_grad():
            for p, g in zip(self._leaves, self._grad_leaves):
                p.grad = g
        self._ptrs = [p.data_ptr() for p in self._leaves]
        self._group = process_group
        if process_group is not None:
            self._broadcast()
        self._buckets = _Buckets(self, bucket_cap_mb * _MiB, first_bucket_cap_mb * _MiB)
        self._hooks = [p.register_post_accumulate_grad_hook(self._buckets.hook(i))
                       for i, p in enumerate(self._leaves)]
        self._hooks.append(module.register_load_state_dict_post_hook(self._after_load))

    def _broadcast(self):
        import torch.distributed as dist
        for buf in self.param_buffers + _buffers_of(tree_flatten(self.frozen)[0]) + \
                _buffers_of(tree_flatten(self.buffers)[0]):
            dist.broadcast(buf, src=dist.get_global_rank(self._group, 0), group=self._group)

    def zero_grad(self):
        """Zeroes every gradient: one fill per gradient buffer (padding included)."""
        for buf in self.grad_buffers:
            buf.zero_()

    def state_dict(self):
        """The module's ``state_dict()`` (its tensors are the trees' views)."""
        return self.module.state_dict()

    def close(self):
        """Removes the gradient hooks (no more reduction or checks) and lets go of the process
        group; the tensors stay views. Under torchrun call it before ``destroy_process_group()``:
        a Gloo group still referenced when the interpreter exits is torn down during
        finalization, where its threads can abort the process."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._group = None

    def _after_load(self, module, incompatible_keys):
        # load_state_dict(assign=True) puts new Parameter objects in the module: the trees
        # would train the old ones.
        params = dict(module.named_parameters())
        for i, leaf in enumerate(self._leaves):
            if params.get(self._order[i]) is not leaf:
                raise RuntimeError(
                    f"treetensor.nn: parameter '{self._order[i]}' was replaced by "
                    f"load_state_dict(assign=True) after consolidate_module: the optimizer "
                    f"would train the old tensor; load without assign=True (it copies into the "
                    f"consolidated views) or call consolidate_module again")
            self._check_leaf(i, leaf)

    def _restore_unused_grads(self):
        # A parameter this backward did not reach, after model.zero_grad() set its .grad to
        # None: its view (which may hold an older gradient) becomes zero and its .grad again.
        for p, g in zip(self._leaves, self._grad_leaves):
            if p.grad is not g:
                with _torch.no_grad():
                    if p.grad is None:
                        g.zero_()
                    else:
                        g.copy_(p.grad)
                    p.grad = g

    def _path(self, i):
        return self._order[i]

    def _check_leaf(self, i, p):
        if p.data_ptr() != self._ptrs[i]:
            raise RuntimeError(
                f"treetensor.nn: parameter '{self._path(i)}' no longer lies in its consolidated "
                f"buffer (the module was moved or converted, e.g. .to()/.cuda()/.half() or "
                f"load_state_dict(assign=True), after consolidate_module): the optimizer would "
                f"train a stale copy; call consolidate_module again after moving the model")
        g = self._grad_leaves[i]
        if p.grad is not g:
            # .grad was set to None (model.zero_grad()) and autograd made a new one: put it back
            # into the gradient buffer.
            with _torch.no_grad():
                g.copy_(p.grad)
                p.grad = g


class _Buckets:
    """DDP's reducer over the gradient buffers: fixed buckets, launched in order as backward
    completes them (see the module docstring)."""

    def __init__(self, tree, cap, first_cap):
        self.tree = tree
        self.bucket_of, self.ranges, self.counts = [], [], []
        self._plan(cap, first_cap)
        self.armed = False
        self._reset()

    def _plan(self, cap, first_cap):
        # From the buffer's end: the parameters backward reaches first (module docstring).
        leaves = self.tree._grad_leaves
        n = len(leaves)
        self.bucket_of = [0] * n
        plan = bucket_plan(leaves[::-1], lambda k: first_cap if k == 0 else cap)
        for b, (view, covered) in enumerate(plan):
            self.ranges.append(view)
            self.counts.append(len(covered))
            for j in covered:
                self.bucket_of[n - 1 - j] = b

    def _reset(self):
        self.pending = list(self.counts)
        self.next = 0
        self.works = []

    def hook(self, i):
        # Runs once per parameter per backward: the common path is two identity tests (the
        # leaf still in its buffer, .grad still its view), the rest only when one fails.
        tree, grad, ptr = self.tree, self.tree._grad_leaves[i], self.tree._ptrs[i]

        def on_grad(p):
            if p.grad is not grad or p.data_ptr() != ptr:
                tree._check_leaf(i, p)
            if not self.armed:
                self.armed = True
                _torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            if tree._group is not None:
                self.pending[self.bucket_of[i]] -= 1
                if self.next < len(self.pending) and self.pending[self.next] == 0:
                    self._launch_ready()
        return on_grad

    def _launch(self, b):
        import torch.distributed as dist
        group = self.tree._group
        view = self.ranges[b]
        view.div_(dist.get_world_size(group))
        self.works.append(dist.all_reduce(view, group=group, async_op=True))

    def _launch_ready(self):
        while self.next < len(self.ranges) and self.pending[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def _finish(self):
        # End of backward: buckets with a parameter the step did not use go now, in order.
        try:
            if self.tree._group is not None:
                while self.next < len(self.ranges):
                    self._launch(self.next)
                    self.next += 1
                for w in self.works:
                    w.wait()
            self.tree._restore_unused_grads()
        finally:
            self.armed = False
            self._reset()


def consolidate_module(module, *, process_group=None, bucket_cap_mb=25, first_bucket_cap_mb=1):
    """Consolidates ``module``'s parameters, gradients and buffers in place and returns their
    trees (:class:`ModuleTree`; semantics, handled cases and errors in this module's docstring).

    ``process_group``: None (one process: no reduction) or a ``torch.distributed`` group
    (``torch.distributed.group.WORLD`` under torchrun) whose ranks all call this with the same
    model: parameters and buffers are broadcast from its first rank, gradients averaged during
    backward. ``bucket_cap_mb`` / ``first_bucket_cap_mb``: bucket sizes in MiB (DDP's names and
    defaults, 25 and 1).

    Raises ValueError naming two parameters that share a storage."""
    if not isinstance(module, _torch.nn.Module):
        raise TypeError(f"consolidate_module: expected a torch.nn.Module, got {type(module).__name__}")
    if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
        raise ValueError(f"consolidate_module: bucket sizes must be positive, got "
                         f"bucket_cap_mb={bucket_cap_mb}, first_bucket_cap_mb={first_bucket_cap_mb}")
    return ModuleTree(module, process_group, bucket_cap_mb, first_bucket_cap_mb)
