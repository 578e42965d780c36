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
(DDP's ``find_unused_parameters``: that gradient is zero on the rank that did not use it), and
``backward()`` returns once every bucket is averaged. Buckets go by the backend's all_reduce,
also the small ones ``treetensor.distributed`` reduces by direct exchange: beside a training
step the exchange was slower (the policy of the ``train`` workload, one 188 KB bucket on 2
Gloo ranks: 1.2-1.5 ms longer a step in four runs, the README's ``train`` table). With
``broadcast_buffers`` (DDP's, on by default) the module's buffers are broadcast from rank 0 at
the end of every backward.

``ModuleTree.step_in_backward(opt)`` (PyTorch's optimizer-in-backward recipe) takes ``opt``'s
step during backward: each bucket, once its gradients are complete (with a group: once its
average is), is stepped on a worker thread by the optimizer's kernel over that bucket's range
of the buffers, beside the rest of backward; ``backward()`` returns with every bucket stepped
and the step counted. Its method says what changes.

Paths are the ``state_dict``'s names split at the dots (``layer1.0.conv1.weight`` is the path
``layer1/0/conv1/weight``). What models hold, handled:

- tied parameters (one ``Parameter`` under two names) are one leaf, at the first name
  ``named_parameters()`` gives; ``aliases`` maps every other name to it;
- frozen parameters (``requires_grad=False`` when consolidated) go to ``frozen``, outside the
  gradient buffer and the optimizer's tree (unfreezing one later needs a new consolidation);
- mixed dtypes and devices: one buffer per (dtype, device), as ``consolidate()`` groups;
- buffers (BatchNorm's statistics) are consolidated in ``buffers``; the module updates them in
  place, so they stay views;
- checkpoints: ``torch.save`` / ``treetensor.torch.save`` of ``state_dict()`` and
  ``load_state_dict`` of ``torch.load`` / ``treetensor.torch.load(f, tree=False)`` work as
  before (``load_state_dict`` wants a dict: ``treetensor.torch.load``'s default gives a tree,
  whose ``to_dict()`` is that dict);
  ``load_state_dict`` (without ``assign=True``) copies into the views;
- ``.grad`` set to None (``zero_grad(set_to_none=True)`` here, ``model.zero_grad()``,
  ``torch.optim``'s ``zero_grad``) or to another tensor: the new gradient autograd makes is
  copied into its view and the view put back as ``.grad``, by backward's hooks where they are
  installed (with a process group, before its bucket goes), else by ``grads``; a parameter
  no backward reached since
  gets a zero gradient (never an older one; unlike PyTorch's None, torch.optim's momentum and
  Adam then still move it). A copy per parameter replaces the fill and the accumulating add:
  cheaper on large gradients (one pass over them instead of two), dearer on many small ones;
- one process (no group): backward runs no hook of ours until ``zero_grad(set_to_none=True)``
  is first called; ``grads`` and ``zero_grad()`` check and repair, so read the gradients
  through ``grads`` (``opt.step(tree.grads)``);
- a backward that raised half way: the next one starts clean;
- ``model.share_memory()`` (the storage stays, its memory moves); ``copy.deepcopy(model)``,
  ``pickle`` and ``torch.save(model)``: the copy is an ordinary module (no hooks of ours);
- ``consolidate_module`` of a module consolidated before closes the previous tree.

Refused, with an error naming the parameter's path: parameters or buffers whose memory
overlaps (one a slice of another: consolidation would separate them) and meta tensors, at
``consolidate_module``; a parameter moved or converted after it (``model.to(dtype)``,
``.cuda()``, ``.half()``: its data no longer lies in the buffer, so the optimizer would train a
copy), and ``backward(create_graph=True)`` (a gradient with a graph cannot live in the buffer),
at the next backward that reaches it where the hooks are installed, else at the next
``grads`` or ``zero_grad()``; parameters replaced by
``load_state_dict(assign=True)`` on the module or a submodule, by that call; a parameter or
submodule replaced by hand (``model.fc.weight = nn.Parameter(...)``, ``model.fc =
nn.Linear(...)``), parameters or submodules added or deleted, and a parameter frozen
(``requires_grad_(False)``) or unfrozen after consolidation, at the next ``grads`` (the tree
would train the old tensors, move the frozen one or never the unfrozen one). Consolidate after
moving or changing the model. With a process group, a buffer the module replaces (a new tensor
assigned, as some forwards do) is copied into its view at the end of backward and the module
holds the view again, so the broadcast carries it (DDP looks its buffers up anew); one of
another shape, dtype or device, or None, is a RuntimeError there. Under
``torch.inference_mode()`` the trees are made outside it (inference tensors cannot train).
Sparse gradients (``Embedding(sparse=True)``) become dense.
"""
import warnings
import weakref

import torch as _torch

if _torch.distributed.is_available():
    # torch.distributed.nn.functional binds ``group.WORLD`` as a default argument when it is
    # first imported. Imported after init_process_group (torch.optim's first step imports it,
    # through torch._dynamo) it holds the default group past destroy_process_group, and with
    # it Gloo's worker threads: one that lets go of a finished all_reduce of a bucket view
    # during interpreter finalization must take the GIL to free the view's Python object, and
    # Python ends that thread in a way C++ turns into an abort. Imported now (programs import
    # this module before they make a group) it binds None, and destroy_process_group joins
    # those threads.
    import torch.distributed.nn  # noqa: F401

from . import optim
from .distributed import (_digest, _disagreement, _dtype_text, _exchange, _refuse, bucket_plan,
                          buffers_of, start_all_reduce, wait_each)
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


def _consolidate_in_place(named):
    """A consolidated tree whose leaves are the tensors of `named` (name -> tensor), each now a
    view into one buffer per (dtype, device): values copied once, then ``t.data = view``."""
    if not named:
        return Tensor({}), []
    copies = Tensor.consolidate(Tensor(_nest((n, t.detach()) for n, t in named.items())))
    views, spec = tree_flatten(copies)
    order = [".".join(p) for p in spec.paths()]
    with _torch.no_grad():
        for name, view in zip(order, views):
            named[name].data = view
    # The module's own tensors now lie where consolidate() laid the copies: consolidate() of
    # their tree recognises the layout and gives the property back without a copy.
    tree = Tensor.consolidate(Tensor(_nest(named.items())))  # a submodule 'consolidate' is a key
    return tree, order


def _check_layout(tensors):
    """Refuses tensors consolidation cannot keep as they are: meta tensors (no data), sparse
    and mkldnn ones (no strided storage to view), and two
    different tensors whose memory overlaps (one a slice of another, or a buffer registered
    over a parameter's data: consolidation would separate them). Views of one buffer that do
    not overlap (a consolidated module) are fine. `tensors`: (what, name, tensor) triples,
    what being "parameter" or "buffer"."""
    spans = {}
    for what, name, t in tensors:
        if isinstance(t, _torch.nn.parameter.UninitializedTensorMixin):
            raise ValueError(f"treetensor.nn.consolidate_module: {what} '{name}' is not "
                             f"initialized yet (a lazy module): run a forward pass first")
        if t.is_meta:
            raise ValueError(f"treetensor.nn.consolidate_module: {what} '{name}' is on the meta "
                             f"device (no data to consolidate): materialize the model first "
                             f"(module.to_empty(device=...) and initialise it)")
        if t.layout != _torch.strided:
            raise ValueError(f"treetensor.nn.consolidate_module: {what} '{name}' has layout "
                             f"{t.layout} (a consolidated buffer holds strided tensors only)")
        if t.numel():
            lo = t.storage_offset() * t.element_size()
            spans.setdefault((t.device, t.untyped_storage()._cdata), []).append(
                (lo, lo + t.numel() * t.element_size(), f"{what} '{name}'"))
    for same_storage in spans.values():
        same_storage.sort()
        for (_, end, first), (start, _, second) in zip(same_storage, same_storage[1:]):
            if start < end:
                raise ValueError(f"treetensor.nn.consolidate_module: {first} and {second} share "
                                 f"memory but are different tensors; consolidating would "
                                 f"separate them (tie them as one tensor)")


def _noop_hook(*args):
    return None


class _Hook:
    """A hook of a live ModuleTree. A copy of the module (copy.deepcopy, pickle, torch.save of
    the whole module) is an ordinary module: its copy of the hook is a no-op."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __reduce__(self):
        return (_noop_factory, ())


def _noop_factory():
    return _noop_hook


class _Places:
    """Where a module's tensors sit when it is consolidated: each submodule in its parent, each
    parameter (or buffer) in its submodule's dict, and how many parameters and submodules each
    submodule has, so that one replaced or added after consolidation (``model.fc =
    nn.Linear(...)``, ``model.fc.weight = nn.Parameter(...)``, ``register_parameter``, a new
    submodule) is found by identity checks. Modules are held weakly: the tree is held by hooks
    on them."""

    def __init__(self, module):
        self.module = weakref.ref(module)
        self.children, self.counts = [], []
        for path, sub in module.named_modules(remove_duplicate=False):
            parent = weakref.ref(sub)
            for key, child in sub._modules.items():
                self.children.append((parent, key, None if child is None else weakref.ref(child),
                                      f"{path}.{key}" if path else key))
            self.counts.append((parent, len(sub._parameters), len(sub._modules), path))

    def slot(self, name, kind="_parameters"):
        """The dict of the submodule holding tensor `name`, and its key there."""
        prefix, _, key = name.rpartition(".")
        sub = self.module()
        for part in prefix.split(".") if prefix else ():  # not get_submodule: its getattr
            sub = sub._modules[part]                       # finds a method named like a child
        return getattr(sub, kind), key

    def changed(self):
        """The path of a submodule replaced or removed, or of one whose parameters were added
        or removed, since; None when there is none."""
        for parent, key, child, path in self.children:
            p = parent()
            if p is not None and p._modules.get(key) is not (None if child is None else child()):
                return f"submodule '{path}' was replaced or removed"
        for sub, params, modules, path in self.counts:
            s = sub()
            if s is not None and len(s._parameters) != params:
                return f"the parameters of '{path or '<root>'}' were added or removed"
            if s is not None and len(s._modules) != modules:
                return f"the submodules of '{path or '<root>'}' were added or removed"
        return None


def _tree_of(attr, tree):
    """The open ModuleTree whose ``attr`` (``params`` or ``_grads``) is ``tree``, else None
    (for treetensor.optim: a module's trees know its order and repair its gradients)."""
    for t in list(_live.values()):
        if getattr(t, attr) is tree:
            return t
    return None


optim._module_tree_lookup = _tree_of

# module -> its open ModuleTree: the tree lives as long as its module (the parameters' hooks
# hold it weakly), and holds the module weakly, so neither keeps the other alive.
_live = weakref.WeakKeyDictionary()


def _model_entries(named, aliases, buffers, settings):
    """What every rank's model must have alike for their broadcasts and buckets to pair: (kind,
    name, its description in words)."""
    def tensor(t):
        return f"{_dtype_text(t)} {list(t.shape)} on {t.device.type}"
    return ([("parameter", n, tensor(p) + ("" if p.requires_grad else ", frozen"))
             for n, p in named.items()] +
            [("parameter", n, f"tied to '{first}'") for n, first in aliases.items()] +
            [("buffer", n, tensor(b)) for n, b in buffers.items()] +
            [("setting", "bucket_cap_mb, first_bucket_cap_mb, broadcast_buffers",
              ", ".join(repr(x) for x in settings))])


def _raise_refused(problem, group):
    """Raises this rank's `problem`; with a group, after the agreement, so the peers raise too,
    naming it, instead of waiting for this rank's calls."""
    if group is not None:
        _refuse(problem, group)
    raise problem


def _agree_model(entries, group):
    """Every rank consolidating the same model with the same settings (DDP's constructor checks
    its parameters' shapes across ranks too), or ValueError on every rank naming the first
    difference before anything moves: calls of other sizes would not pair (Gloo aborts the
    process on a size mismatch)."""
    signatures = _exchange(_digest(repr(entries)), lambda: {"entries": entries}, group)
    if signatures is not None:
        raise ValueError(f"treetensor.nn.consolidate_module: the ranks' models differ: "
                         f"{_disagreement(signatures, _model_difference, group)}")


def _model_difference(mine, theirs, rank, other):
    """The first entry rank `other` has otherwise than ours, in words."""
    if "refused" in theirs:
        return f"rank {other} refused it ({theirs['refused']})"
    ours = {e[:2]: e[2] for e in mine["entries"]}
    peer = {e[:2]: e[2] for e in theirs["entries"]}
    for key in list(ours) + [k for k in peer if k not in ours]:
        kind, name = key
        if key not in peer:
            return f"rank {rank} has {kind} '{name}', rank {other} has none"
        if key not in ours:
            return f"rank {other} has {kind} '{name}', rank {rank} has none"
        if ours[key] != peer[key]:
            return f"{kind} '{name}': rank {rank} has {ours[key]}, rank {other} has {peer[key]}"
    return "their orders of parameters differ"


def _refuse_assign(state_dict, prefix, metadata, below):
    """load_state_dict(assign=True) would put new tensors in the module where its trees hold
    consolidated views (the optimizer would train the old ones): refused before it assigns any."""
    if metadata.get("assign_to_params_buffers", False):
        hit = next((n for n in below if prefix + n in state_dict), None)
        if hit is not None:
            raise RuntimeError(
                f"treetensor.nn: load_state_dict(assign=True) would replace '{prefix + hit}' of a "
                f"consolidated module (its trees, and an optimizer over them, would keep the old "
                f"tensor): nothing was loaded; load without assign=True (it copies into the "
                f"consolidated views) or call consolidate_module again after loading")


class ModuleTree:
    """A module's parameters, gradients and buffers as consolidated trees (made by
    :func:`consolidate_module`).

    ``params``: the trainable parameters (``requires_grad=True``), a consolidated
    ``treetensor.torch.Tensor`` whose leaves are the module's ``Parameter`` objects. ``grads``:
    its gradients, consolidated with the same layout; leaf ``p`` is ``params`` leaf ``p``'s
    ``.grad``. ``frozen``: the other parameters. ``buffers``: the module's buffers. ``aliases``:
    tied names -> the leaf's name. ``param_buffers`` / ``grad_buffers``: the 1-D buffers (one
    per dtype and device; the padding between leaves is zero)."""

    _closed = False  # close() ran (consolidate_module of its module again runs it)

    def __init__(self, module, process_group, bucket_cap_mb, first_bucket_cap_mb, broadcast_buffers):
        self._module = weakref.ref(module)
        named, self.aliases = {}, {}
        first = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in first:
                self.aliases[name] = first[id(p)]
            else:
                first[id(p)] = name
                named[name] = p
        buffers = dict(module.named_buffers())
        try:
            _check_layout([("parameter", n, t) for n, t in named.items()] +
                          [("buffer", n, t) for n, t in buffers.items()])
        except ValueError as e:
            _raise_refused(e, process_group)
        if process_group is not None:
            _agree_model(_model_entries(named, self.aliases, buffers, (
                bucket_cap_mb, first_bucket_cap_mb, broadcast_buffers)), process_group)
        trainable = {n: p for n, p in named.items() if p.requires_grad}
        frozen = {n: p for n, p in named.items() if not p.requires_grad}
        self.params, self._order = _consolidate_in_place(trainable)
        self.frozen, frozen_order = _consolidate_in_place(frozen)
        self._frozen_leaves = [(n, frozen[n]) for n in frozen_order]
        self.buffers, _ = _consolidate_in_place(buffers)
        self._leaves = [trainable[n] for n in self._order]
        self._module_order = list(trainable)  # named_parameters()'s: torch.optim's positions
        self._named_order = list(named)  # the same, frozen parameters included
        self._places = _Places(module)
        self._param_slots = [self._places.slot(n) for n in self._order]
        self._buffer_slots = [(*self._places.slot(n, "_buffers"), n, t) for n, t in buffers.items()]
        self.param_buffers = buffers_of(self._leaves)
        self._grads = Tensor.consolidate(zeros_like(self.params)) if self._leaves else Tensor({})
        self._grad_leaves = tree_flatten(self._grads)[0]
        self.grad_buffers = buffers_of(self._grad_leaves)
        # A leaf of each gradient buffer: a buffer's views share one version counter, which an
        # in-place edit of any of them (clip_grad_norm_'s) advances.
        heads = {g.untyped_storage().data_ptr(): g for g in self._grad_leaves}
        self._grad_heads = list(heads.values())
        self._module_buffers = buffers_of(tree_flatten(self.buffers)[0])
        with _torch.no_grad():
            for p, g in zip(self._leaves, self._grad_leaves):
                if p.grad is not None:  # gradients accumulated before consolidation are kept
                    g.copy_(p.grad)
                p.grad = g
        self._ptrs = [p.data_ptr() for p in self._leaves]
        self._storages = [p.untyped_storage()._cdata for p in self._leaves]
        for cdata in set(self._storages):
            _buffer_owner[cdata] = self
        self._group = process_group
        self._broadcast_buffers = broadcast_buffers and process_group is not None
        if process_group is not None:
            self._broadcast(self.param_buffers + buffers_of(tree_flatten(self.frozen)[0]) +
                            self._module_buffers)
        self._buckets = _Buckets(self, bucket_cap_mb * _MiB, first_bucket_cap_mb * _MiB)
        self._hooks = self._load_hooks(module)
        self._hooked = False
        # Without a group the parameters' hooks would only check and repair, which `grads` and
        # zero_grad() do too: a backward then calls no Python per parameter (the policy's 28
        # hooks took 75 us of its 1.4 ms step) until zero_grad(set_to_none=True) asks for them.
        if process_group is not None:
            self._hook_parameters()

    def _hook_parameters(self):
        if not self._hooked:
            self._hooked = True
            self._hooks += [p.register_post_accumulate_grad_hook(_Hook(self._buckets.hook(i)))
                            for i, p in enumerate(self._leaves)]

    def _load_hooks(self, module):
        # load_state_dict (on the module or any submodule) runs the pre hook of the module it
        # was called on first: it refuses assign=True for every consolidated tensor below that
        # module. The post hooks of each module it loads check that module's own parameters.
        index = {n: i for i, n in enumerate(self._order)}
        consolidated = list(self._order) + [n for n, _ in self._frozen_leaves] + \
            [name for _, _, name, _ in self._buffer_slots]
        hooks = []
        for prefix, sub in module.named_modules():
            start = f"{prefix}." if prefix else ""
            below = [n[len(start):] for n in consolidated if n.startswith(start)]
            if below:
                hooks.append(sub.register_load_state_dict_pre_hook(_Hook(
                    lambda m, sd, pre, meta, *rest, below=below: _refuse_assign(sd, pre, meta, below))))
            own = [(k, index[start + k]) for k in sub._parameters if start + k in index]
            if own:
                hooks.append(sub.register_load_state_dict_post_hook(
                    _Hook(lambda m, keys, own=own: self._after_load(m, own))))
        return hooks

    def _broadcast_module_buffers(self):
        # A buffer the module replaced (assigned a new tensor, as some forwards do) is copied
        # into its view, which the module holds again: the broadcast of the consolidated
        # buffers then carries it, the same calls on every rank (DDP looks its buffers up anew).
        for d, key, name, view in self._buffer_slots:
            now = d.get(key)
            if now is view:
                continue
            if now is None or now.shape != view.shape or now.dtype != view.dtype or \
                    now.device != view.device:
                raise RuntimeError(
                    f"treetensor.nn: buffer '{name}' was replaced by "
                    f"{'None' if now is None else f'a {now.dtype} {list(now.shape)} tensor'} "
                    f"after consolidate_module (it was {view.dtype} {list(view.shape)}): "
                    f"call consolidate_module again")
            with _torch.no_grad():
                view.copy_(now)
            d[key] = view
        self._broadcast(self._module_buffers)

    def _broadcast(self, buffers):
        import torch.distributed as dist
        src = dist.get_global_rank(self._group, 0)
        for buf in buffers:
            dist.broadcast(buf, src=src, group=self._group)

    @property
    def grads(self):
        """The gradient tree, consolidated like ``params``: leaf ``p`` is ``params`` leaf
        ``p``'s ``.grad``. Before returning it, every ``.grad`` that is not its view is put
        back: a gradient autograd made after ``.grad`` was cleared (or one assigned by hand) is
        copied into its view (a sparse one made dense), a None one (cleared, and no backward
        reached it since) becomes a zero view; so the buffer never holds an older gradient.
        Raises RuntimeError naming the parameter's path for a module moved or converted after
        consolidation and for a gradient with a graph (``backward(create_graph=True)``)."""
        self._buckets.settle()
        self._check_params()
        for i, (p, g) in enumerate(zip(self._leaves, self._grad_leaves)):
            if p.grad is not g:
                self._check_grad(i, p)
        return self._grads

    def _check_params(self):
        # What a step over the tree would get wrong without a word: a parameter or submodule
        # replaced, moved or converted, frozen or unfrozen since consolidation. Asked before
        # every step (tree.grads, and torch's loop over the .grad fields).
        self._check_places()
        ptrs = self._ptrs
        for i, p in enumerate(self._leaves):
            if p.data_ptr() != ptrs[i]:
                self._check_data(i, p)
            if not p.requires_grad:
                raise RuntimeError(
                    f"treetensor.nn: parameter '{self._order[i]}' was frozen "
                    f"(requires_grad=False) after consolidate_module: a step over the tree "
                    f"would still move it (torch.optim skips it); unfreeze it before the step, "
                    f"or call consolidate_module again (and make the optimizer over its params)")
        for name, p in self._frozen_leaves:
            if p.requires_grad:
                raise RuntimeError(
                    f"treetensor.nn: parameter '{name}' was unfrozen (requires_grad=True) after "
                    f"consolidate_module: it is not in the tree's params, so no step would move "
                    f"it; call consolidate_module again (and make the optimizer over its params)")

    def _check_places(self):
        # A tensor or submodule replaced by hand: the trees would train the old one.
        changed = self._places.changed() or next(
            (f"parameter '{self._order[i]}' was replaced (or deleted)"
             for i, (params, key) in enumerate(self._param_slots)
             if params.get(key) is not self._leaves[i]), None)
        if changed is not None:
            raise RuntimeError(f"treetensor.nn: {changed} after consolidate_module: the "
                               f"optimizer would train the old tensors, not the module's; call "
                               f"consolidate_module again (and make the optimizer over its params)")

    def zero_grad(self, set_to_none=False):
        """Zeroes every gradient: one fill per gradient buffer (padding included); a ``.grad``
        cleared or replaced since is its view again. Raises as ``grads`` does for a moved
        module. ``set_to_none=True`` (torch's ``zero_grad(set_to_none=True)``): writes nothing
        and sets every parameter's ``.grad`` to None; autograd then makes each new gradient
        and backward's hooks (installed by the first such call) copy it into its view:
        one pass over the gradients where the fill and autograd's accumulating add take two,
        cheaper on large parameters (ResNet-50), dearer on many small ones (the policy).
        Default False: the fill."""
        self._buckets.settle()
        if set_to_none:
            # Backward's hooks copy each new gradient while it is still in cache: on ResNet-50
            # a step took 180 ms so and 197 ms with the copies left to `grads` (100 MB cold).
            self._hook_parameters()
            for p in self._leaves:
                p.grad = None
            return
        ptrs = self._ptrs
        for i, (p, g) in enumerate(zip(self._leaves, self._grad_leaves)):
            if p.data_ptr() != ptrs[i]:
                self._check_data(i, p)
            if p.grad is not g:  # cleared or replaced since: its view again
                p.grad = g
        for buf in self.grad_buffers:
            buf.zero_()

    def step_in_backward(self, optimizer):
        """Takes ``optimizer``'s step during every backward from now on, bucket by bucket on a
        worker thread as the buckets' gradients are complete (with a process group: averaged),
        beside the rest of backward: PyTorch's optimizer-in-backward recipe, on the free core
        and without a Python step per parameter. ``backward()`` returns once every bucket is
        stepped (the step counted); the ``optimizer.step()`` of an unchanged loop then only
        acknowledges it, so the loop needs no change, and the next forward sees the new
        parameters. ``None`` turns it off (and ends the worker).

        ``optimizer``: a ``treetensor.optim`` Adam, AdamW or SGD over this tree's ``params``
        (its state consolidated as they are, as it makes it). Each bucket's step reads the
        options (lr from a scheduler included) as it runs: change them between steps. What
        changes, as in PyTorch's recipe:

        - the gradients a step uses are backward's, so clipping, unscaling (``GradScaler``:
          not supported) or editing them between backward and ``step()``, or in a
          post-accumulate-grad hook of one's own, is too late; the optimizer's
          ``param_groups``, through which GradScaler unscales, raise RuntimeError until
          ``step()`` acknowledges the step; ``step(other_grads)`` raises RuntimeError, and so
          do a second backward before ``step()`` (accumulating gradients) and the ``step()``
          after gradients edited in place or replaced since backward (``clip_grad_norm_``,
          even one clipping nothing, ``zero_grad()``; it acknowledges the step all the same);
          every backward
          that reaches the parameters steps them;
        - ``step()``'s pre and post hooks run when it acknowledges the step, after it;
        - a parameter that backward still needs after its gradient is complete (a
          ``detach()`` of it saved by a later node) makes autograd raise its in-place error.

        The worker holds one of the asyncs worker ids (``TREETENSOR_ASYNCS_THREADS``, 8 by
        default) until ``step_in_backward(None)``, ``close()`` or the module is collected.
        A nested backward (reentrant checkpointing) is part of the one in progress. Raises
        TypeError for another optimizer, ValueError for one over other parameters,
        RuntimeError when called during backward or before ``step()`` acknowledged the last
        backward's step (``close()`` leaves that step for ``step()`` to acknowledge).
        A bucket's failed step is raised by ``backward()``: the buckets before it stepped, the
        later ones skip the step, which is counted (no bucket takes it twice). After a
        backward that raised half way, the buckets it launched are stepped and the step
        counted, with a RuntimeWarning at the next ``step()``, ``zero_grad()``, ``grads`` or
        backward."""
        if optimizer is not None:
            if not isinstance(optimizer, optim._TreeOptimizer):
                raise TypeError(f"step_in_backward: expected a treetensor.optim optimizer, got "
                                f"{type(optimizer).__name__}")
            if optimizer.params is not self.params:
                raise ValueError("step_in_backward: the optimizer is over other parameters; make "
                                 "it over this tree's params")
        self._buckets.settle()
        current = self._buckets.optimizer
        if current is not None and current is not optimizer and current._taken is not None:
            raise RuntimeError(f"step_in_backward: {type(current).__name__}.step() has not "
                               f"acknowledged the step the last backward took; call it first")
        self._step_in_backward(optimizer)

    def _step_in_backward(self, optimizer):
        from .asyncs import Thread
        old = self._buckets.worker
        if optimizer is None:
            self._buckets.step_with(None, None)
        else:
            try:
                worker = old or Thread("step in backward")
            except RuntimeError as e:
                raise RuntimeError(f"step_in_backward: {e}; each module stepping in backward "
                                   f"holds one until its step_in_backward(None), close() or "
                                   f"the module is collected") from e
            self._buckets.step_with(optimizer, worker)
            self._hook_parameters()
        if old is not None and optimizer is None:
            old.close()

    @property
    def module(self):
        """The consolidated module (None once it is gone: a tree does not keep it alive)."""
        return self._module()

    def state_dict(self):
        """The module's ``state_dict()`` (its tensors are the trees' views). Raises
        RuntimeError once the module is gone (a tree does not keep it alive)."""
        module = self.module
        if module is None:
            raise RuntimeError("treetensor.nn: ModuleTree.state_dict(): the module is gone (it "
                               "was garbage-collected; a tree does not keep its module alive)")
        return module.state_dict()

    def close(self):
        """Removes the hooks (no more reduction or checks) and lets go of the process group;
        the tensors stay views. ``consolidate_module`` of the same module closes its previous
        tree itself. Under torchrun call it before ``destroy_process_group()``: a Gloo group
        still referenced when the interpreter exits is torn down during finalization, where
        its threads can abort the process. Import this module before ``init_process_group``
        (see its imports: otherwise torch itself can hold the group past
        ``destroy_process_group``). Raises RuntimeError, changing nothing, while a backward of
        the module runs."""
        if self._buckets._running():
            raise RuntimeError("treetensor.nn: close() cannot run while a backward of the module "
                               "runs (its hooks and step are in use): close after backward returns")
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._closed = True
        self._buckets.settle()
        self._step_in_backward(None)  # a step not acknowledged stays for step() to acknowledge
        self._group = None
        module = self.module
        if module is not None and _live.get(module) is self:
            del _live[module]

    def _after_load(self, module, own):
        # A module whose own _load_from_state_dict puts new Parameter objects in it (the pre
        # hook refuses assign=True): the trees would train the old ones.
        for key, i in own:
            if module._parameters.get(key) is not self._leaves[i]:
                raise RuntimeError(
                    f"treetensor.nn: parameter '{self._order[i]}' was replaced by "
                    f"load_state_dict(assign=True) after consolidate_module: the optimizer "
                    f"would train the old tensor; load without assign=True (it copies into the "
                    f"consolidated views) or call consolidate_module again")
            self._check_data(i, self._leaves[i])

    def _restore_grads(self):
        # Every .grad is its view again before the buckets go: one that model.zero_grad() set
        # to None and this backward did not reach gets a zero view (never an older gradient).
        for i, (p, g) in enumerate(zip(self._leaves, self._grad_leaves)):
            if p.grad is not g:
                self._check_grad(i, p)

    def _check_data(self, i, p):
        if p.data_ptr() == self._ptrs[i]:
            return
        if p.untyped_storage()._cdata == self._storages[i]:
            self._ptrs[i] = p.data_ptr()  # the same storage, its memory moved (share_memory_)
            return
        if self._closed:
            raise RuntimeError(
                f"treetensor.nn: parameter '{self._order[i]}' no longer lies in this closed "
                f"tree's buffer (consolidate_module of its module made a new tree since, or the "
                f"module moved): use the tree the last consolidate_module returned, and an "
                f"optimizer over its params")
        other = _buffer_owner.get(p.untyped_storage()._cdata)
        if other is not None and other is not self:
            raise RuntimeError(
                f"treetensor.nn: parameter '{self._order[i]}' now lies in the buffer of another "
                f"consolidate_module's tree (a submodule of this model, or a module sharing "
                f"it, was consolidated since): the optimizer over this tree would train a stale "
                f"copy; consolidate one module holding every parameter (parameter groups of its "
                f"optimizer give parts their own options)")
        raise RuntimeError(
            f"treetensor.nn: parameter '{self._order[i]}' no longer lies in its consolidated "
            f"buffer (the module was moved or converted, e.g. .to()/.cuda()/.half(), or its "
            f"data replaced, after consolidate_module): the optimizer would train a stale copy; "
            f"call consolidate_module again after moving the model")

    def _check_grad(self, i, p):
        g = self._grad_leaves[i]
        if p.grad is g:
            return
        with _torch.no_grad():
            if p.grad is None:
                g.zero_()
            elif p.grad.requires_grad:
                raise RuntimeError(
                    f"treetensor.nn: the gradient of '{self._order[i]}' has a graph "
                    f"(backward(create_graph=True)); a consolidated gradient buffer cannot hold "
                    f"one: close() the ModuleTree for double backward, or use torch.autograd.grad")
            else:  # .grad was set to None and autograd made a new one (sparse: made dense)
                g.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
            p.grad = g


# The live tree whose consolidated parameter buffer a storage is (by its _cdata), for the error
# when another tree took a parameter (a shared or sub module consolidated again).
_buffer_owner = weakref.WeakValueDictionary()


class _Buckets:
    """DDP's reducer over the gradient buffers: fixed buckets, launched in order as backward
    completes them (see the module docstring)."""

    def __init__(self, tree, cap, first_cap):
        # Weak: the tree owns this state, and a cycle would keep both (and step_in_backward's
        # worker, with its asyncs id) until Python's cyclic collector ran.
        self._tree = weakref.ref(tree)
        self.bucket_of, self.ranges, self.counts = [], [], []
        self._plan(cap, first_cap)
        self.task = None  # the autograd graph task this state belongs to
        self.end = None  # a weakref to the callback queued on it: dead once the task is gone
        self.adopted = None  # that callback, when it ran at the end of a nested backward
        self.optimizer = self.worker = self.steps = None  # step_in_backward's
        self._reset()

    @property
    def tree(self):
        return self._tree()

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
        self.leaves_of = [[p for p, b in zip(self.tree._leaves, self.bucket_of) if b == k]
                          for k in range(len(self.ranges))]

    def _reset(self):
        self.pending = list(self.counts)
        self.next = 0
        self.works = []
        self.jobs = []
        self.failed = []  # a bucket's step raised: the later ones skip theirs

    def step_with(self, optimizer, worker):
        """The optimizer's step per bucket from now on (None: no more); see
        ModuleTree.step_in_backward. Planned first: a refused plan changes nothing."""
        if self._running():
            raise RuntimeError("treetensor.nn: step_in_backward cannot change while a backward "
                               "of the module runs")
        steps = planned = None
        if optimizer is not None:
            buffers = {b.untyped_storage().data_ptr(): k for k, b in enumerate(self.tree.grad_buffers)}
            ranges = [(buffers[v.untyped_storage().data_ptr()], v.storage_offset(),
                       v.storage_offset() + v.numel()) for v in self.ranges]
            steps = optimizer._range_steps(self.tree._grads, ranges)
            planned = list(optimizer._moments().values())
        if self.optimizer is not None and self.optimizer is not optimizer:
            self.optimizer._before_step = None  # a step not acknowledged stays: step() will
        self.optimizer, self.worker, self.steps, self.planned = optimizer, worker, steps, planned
        if optimizer is not None:
            optimizer._before_step = weakref.WeakMethod(self.settle)  # nor keeps the tree alive

    def _enter(self, task):
        # A hook under another graph task than the state's. A nested backward (reentrant
        # checkpointing) belongs to the backward in progress; after one that ended inside
        # the outer one (adopted), the outer one's end is queued now. Else it is the first
        # hook of a new backward: the state of one that raised before its end (its callback
        # never ran) is settled or dropped first.
        if self.adopted is not None:
            self.adopted = None
            self.task = task
            self._queue_end()
            return
        if self._running():
            return
        self.settle()
        self.task = task
        self._reset()
        if self.steps is not None:
            self._begin_step()
        self._queue_end()

    def _queue_end(self):
        # Its only strong reference is the graph task's (not a frame a traceback could keep).
        end = _EndOfBackward(self)
        self.end = weakref.ref(end)
        _torch.autograd.Variable._execution_engine.queue_callback(end)

    def _adopt(self, end):
        # A nested backward ended inside the outer one's node: the state is the outer one's,
        # finished by its end (queued at our next hook under it) or at the next use.
        self.adopted = end

    def _running(self):
        # A backward began (its first hook ran) and its graph task still holds our callback:
        # it is in progress (on this thread, or another), not one that raised.
        return self.task is not None and (self.adopted is not None or
                                          (self.end is not None and self.end() is not None))

    def settle(self):
        """After a backward that raised once it had launched buckets' steps (its end, which
        waits for them, never ran): waits for them and counts the step, so no bucket takes it
        twice (the buckets not launched skip it; a step() right after only acknowledges it),
        with a RuntimeWarning saying so; a bucket's error is raised. Called where the next use
        of the parameters or gradients starts; does nothing while a backward runs."""
        if self.adopted is not None and _torch._C._current_graph_task_id() == -1:
            self.adopted = None  # the outer backward ended with no hook of ours under it
            self._finish()
            return
        if self.task is None or self.steps is None or self._running():
            return
        launched, jobs = self.next, self.jobs
        self.task = None
        self._reset()
        errors = _outcomes(jobs)
        if launched:
            self._count(partial=True)
        if errors:
            raise errors[0]
        if launched:
            warnings.warn(f"treetensor.nn: the backward that raised had stepped {launched} of "
                          f"{len(self.ranges)} gradient buckets (step_in_backward); that step is "
                          f"counted, the other buckets' parameters skipped it", RuntimeWarning,
                          stacklevel=3)

    def hook(self, i):
        # Runs once per parameter per backward: the common path is two identity tests (the
        # leaf still in its buffer, .grad still its view), the rest only when one fails. It
        # holds the buckets weakly: autograd keeps it in C++, where Python's cycle collector
        # cannot see the cycle parameter -> hook -> tree -> module -> parameter.
        me, grad, ptrs = weakref.ref(self), self.tree._grad_leaves[i], self.tree._ptrs

        def on_grad(p):
            self = me()
            tree = None if self is None else self.tree
            if tree is None:  # the tree was dropped: the module trains as a plain one
                return
            if p.data_ptr() != ptrs[i]:
                tree._check_data(i, p)
            task = _torch._C._current_graph_task_id()
            if task != self.task:
                self._enter(task)
            if p.grad is not grad:
                self._take_grad(i, p, grad)
            if tree._group is not None or self.steps is not None:
                self.pending[self.bucket_of[i]] -= 1
                if self.next < len(self.pending) and self.pending[self.next] == 0:
                    self._launch_ready()
        return on_grad

    def _take_grad(self, i, p, view):
        # A gradient autograd made (.grad was set to None) goes into its view. With the step on
        # the worker and no group (whose reduction, launched here, reads the view), so does the
        # copy, ahead of its bucket's step in the worker's order: on ResNet-50 the 100 MB of
        # copies cost backward ~20 ms on the training thread.
        new = p.grad
        if (self.steps is None or self.tree._group is not None or new is None or new.requires_grad
                or new.layout != _torch.strided or new.dtype != view.dtype):
            self.tree._check_grad(i, p)
            return
        self.jobs.append(self.worker.submit(view.copy_, new))
        p.grad = view

    def _launch(self, b):
        work = None
        group = self.tree._group
        if group is not None:
            import torch.distributed as dist
            view = self.ranges[b]
            view.div_(dist.get_world_size(group))
            # Not by direct exchange: beside the rest of the step, Gloo's device thread then
            # woke 2.7x as often per read and used twice the CPU (module docstring: the cost).
            work = start_all_reduce(view, dist.ReduceOp.SUM, group, exchange=False)
            self.works.append(work)
        if self.steps is not None:
            # A node that saved a parameter (a detach() of it) and runs later must see it was
            # modified in place (autograd's error), as after an ordinary step.
            _torch.autograd.graph.increment_version(self.leaves_of[b])
            self.jobs.append(self.worker.submit(_step_bucket, work, self.steps[b], self.step_number,
                                                self.failed))

    def _launch_ready(self):
        while self.next < len(self.ranges) and self.pending[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def _begin_step(self):
        opt = self.optimizer
        if opt._taken is not None and not opt._taken_partial:
            raise RuntimeError(
                f"treetensor.nn: a second backward before {type(opt).__name__}.step() "
                f"acknowledged the step the first one took (step_in_backward steps in every "
                f"backward, so gradients cannot accumulate over several): call step() after "
                f"each backward, or step_in_backward(None)")
        if opt._taken is not None and opt._taken_partial:
            opt._taken = None  # the batch of a backward that raised was skipped: go on
        moments = list(opt._moments().values())
        if len(moments) != len(self.planned) or any(a is not b for a, b in zip(moments, self.planned)):
            self.step_with(opt, self.worker)  # a state loaded since lies in new buffers
        self.step_number = opt.state["step"] + 1

    def _finish(self):
        # End of backward: gradients this step did not reach are made zero views first, then
        # the buckets holding them go, in order (DDP's find_unused_parameters).
        try:
            self.tree._restore_grads()
            if self.tree._group is not None or self.steps is not None:
                while self.next < len(self.ranges):
                    self._launch(self.next)
                    self.next += 1
                if self.steps is not None:
                    self._finish_step()  # each bucket's job waited for its average first
                else:
                    for w in self.works:
                        w.wait()
                if self.tree._broadcast_buffers:
                    self.tree._broadcast_module_buffers()
        except BaseException:
            if self.steps is not None and self.next:  # no launched step may outlive backward
                _outcomes(self.jobs)  # (waited for already after a bucket's error)
                self._count(partial=True)
            raise
        finally:
            self.task = None
            self._reset()

    def _finish_step(self):
        # Every bucket's step ran: the step is counted. Or one raised: backward raises its
        # error (the buckets before it were stepped, the later ones skipped it) and _finish's
        # handler counts the step as partial, so that no bucket takes it twice.
        errors = _outcomes(self.jobs)
        if errors:
            raise errors[0]
        self._count(partial=False)

    def _count(self, partial):
        # The step is taken (partial: by some buckets only) and counted; step() acknowledges
        # it once; after a partial one a new backward may come first (the batch skipped).
        opt = self.optimizer
        opt.state["step"] = self.step_number
        opt._taken, opt._taken_partial = self.tree._grads, partial
        opt._taken_edits = None if partial else _GradEdits(self.tree)


class _GradEdits:
    """What changed the gradients of a module's tree since it was made, or None: an in-place
    edit (a buffer's views share one version counter) or a ``.grad`` replaced or cleared. Holds
    tensors, not the tree (which holds the optimizer)."""

    __slots__ = ("heads", "versions", "leaves", "grads")

    def __init__(self, tree):
        self.heads, self.leaves, self.grads = tree._grad_heads, tree._leaves, tree._grad_leaves
        self.versions = [g._version for g in self.heads]

    def __call__(self):
        if any(g._version != v for g, v in zip(self.heads, self.versions)):
            return "the gradients were changed in place (clip_grad_norm_, a zero_grad())"
        for p, g in zip(self.leaves, self.grads):
            if p.grad is not g:
                return "a .grad was replaced or set to None (zero_grad(), p.grad = ...)"
        return None


class _EndOfBackward:
    """The callback queued on a backward's graph task: the graph task holds it until it ends,
    so a weak reference to it tells a backward in progress from one that raised."""

    __slots__ = ("buckets", "__weakref__")

    def __init__(self, buckets):
        self.buckets = buckets

    def __call__(self):
        if _torch._C._current_autograd_node() is not None:
            self.buckets._adopt(self)  # a nested backward's end, inside an outer one's node
            return
        self.buckets._finish()


def _outcomes(jobs):
    """Waits for every job; their errors, in order."""
    return [e for _, e in wait_each(job.result for job in jobs)]


def _step_bucket(work, step, n, failed):
    # On the tree's worker: the bucket's average first (with a group), then its step, unless
    # an earlier bucket's step failed.
    try:
        if work is not None:
            work.wait()
        if not failed:
            step(n)
    except BaseException:
        failed.append(True)
        raise


def consolidate_module(module, *, process_group=None, bucket_cap_mb=25, first_bucket_cap_mb=1,
                       broadcast_buffers=True):
    """Consolidates ``module``'s parameters, gradients and buffers in place and returns their
    trees (:class:`ModuleTree`; semantics, handled cases and errors in this module's docstring).
    A module consolidated before gets a new tree over the same buffers (consolidate()
    recognises their layout: nothing is copied) and its previous tree is closed.

    ``process_group``: None (one process: no reduction) or a ``torch.distributed`` group
    (``torch.distributed.group.WORLD`` under torchrun) whose ranks all call this with the same
    model: parameters and buffers are broadcast from its first rank, gradients averaged during
    backward. ``bucket_cap_mb`` / ``first_bucket_cap_mb``: bucket sizes in MiB (DDP's names and
    defaults, 25 and 1). ``broadcast_buffers`` (DDP's, default True): with a group, the
    module's buffers (BatchNorm statistics) are broadcast from the first rank at the end of
    every backward, one call per buffer, so the next forward sees rank 0's as under DDP.

    Raises TypeError for a non-Module, ValueError for non-positive bucket sizes, for a
    parameter or buffer on the meta device, and for two parameters (or buffers) whose memory
    overlaps, naming them. With a group the ranks first agree (one all_reduce of a digest, as
    DDP's constructor checks its parameters' shapes): ValueError on every rank, before
    anything is broadcast, when their models differ (names, dtypes, shapes, device types,
    ties, frozen parameters, buffers) or their bucket sizes or ``broadcast_buffers`` do,
    naming the first difference; a rank's own error above is raised there and named by its
    peers ("rank 1 refused it ...")."""
    problem = None
    if not isinstance(module, _torch.nn.Module):
        problem = TypeError(f"consolidate_module: expected a torch.nn.Module, got {type(module).__name__}")
    elif bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
        problem = ValueError(f"consolidate_module: bucket sizes must be positive, got "
                             f"bucket_cap_mb={bucket_cap_mb}, first_bucket_cap_mb={first_bucket_cap_mb}")
    if problem is not None:
        _raise_refused(problem, process_group)
    previous = _live.get(module)
    if previous is not None:
        previous.close()
    # Outside inference mode, whose views would be inference tensors that cannot train, unless
    # the model itself was made under it (its tensors are inference tensors already).
    made_in_inference = _torch.is_inference_mode_enabled() and any(
        t.is_inference() for t in module.parameters()
        if not isinstance(t, _torch.nn.parameter.UninitializedTensorMixin))
    with _torch.inference_mode(made_in_inference):
        tree = ModuleTree(module, process_group, bucket_cap_mb, first_bucket_cap_mb,
                          broadcast_buffers)
    _live[module] = tree
    return tree
