"""``treetensor.distributed``: collectives on trees over ``torch.distributed`` (DESIGN.md §14).

    import treetensor.distributed as tdist
    tdist.all_reduce(grads, group=dist.group.WORLD)          # in place, every rank
    works = tdist.all_reduce(grads, async_op=True)           # then w.wait() for each

A consolidated tree (``t.consolidate()``, ``treetensor.nn``'s gradient tree) is reduced in
buckets: contiguous ranges of each buffer holding whole leaves, at most ``bucket_cap_mb`` MiB
(DDP's 25; a larger leaf is a bucket of its own), one ``all_reduce`` per bucket and no copy;
the padding between leaves is zero and stays zero under SUM. Any other tree is reduced leaf
by leaf. Either way the calls go in sorted-path order, so every rank issues the same sequence;
issue collectives on one group from one thread at a time (two threads interleaving raw c10d
calls can pair different tensors across ranks: the C++ layer's ordered collectives exist for
that, §14).
"""
import torch as _torch

from .torch import Tensor, tree_flatten

__all__ = ["all_reduce"]

_MiB = 1 << 20


def buffer_of(view):
    """The whole 1-D buffer a consolidated leaf views (consolidate() allocates each group's
    buffer as all of one storage)."""
    storage = view.untyped_storage()
    numel = storage.nbytes() // view.element_size()
    return _torch.empty(0, dtype=view.dtype, device=view.device).set_(storage, 0, (numel,))


def bucket_plan(leaves, caps):
    """Buckets over consolidated leaves, in the order given: a list of (view of a buffer range,
    indices of the leaves it covers). ``caps(k)`` is bucket k's size limit in bytes; a bucket
    never spans two buffers, and holds at least one leaf."""
    buckets, current = [], None  # current: [buffer, lo, hi, indices], offsets in elements
    for i, leaf in enumerate(leaves):
        buf, off = buffer_of(leaf), leaf.storage_offset()
        lo, hi = off, off + leaf.numel()
        if current is not None:
            same = buf.untyped_storage().data_ptr() == current[0].untyped_storage().data_ptr()
            span = (max(hi, current[2]) - min(lo, current[1])) * leaf.element_size()
            if not same or span > caps(len(buckets)):
                buckets.append((current[0][current[1]:current[2]], current[3]))
                current = None
        if current is None:
            current = [buf, lo, hi, []]
        current[1], current[2] = min(lo, current[1]), max(hi, current[2])
        current[3].append(i)
    if current is not None:
        buckets.append((current[0][current[1]:current[2]], current[3]))
    return buckets


def all_reduce(tree, op=None, *, group=None, async_op=False, bucket_cap_mb=25):
    """Reduces every leaf of ``tree`` across the ranks of ``group`` in place (``op``:
    ``torch.distributed.ReduceOp``, default SUM; ``group``: default the world), as
    ``torch.distributed.all_reduce`` does for one tensor; every rank must call it with a tree
    of the same structure, dtypes and shapes. Consolidated trees go in buckets of at most
    ``bucket_cap_mb`` MiB (module docstring). Returns None, or with ``async_op=True`` the list
    of ``Work`` objects (wait for each before reading the tree).

    Raises TypeError if ``tree`` is not a ``treetensor.torch.Tensor``, ValueError for a
    non-positive ``bucket_cap_mb``; ``torch.distributed``'s errors (no process group, a
    peer's mismatch or timeout) pass through."""
    import torch.distributed as dist
    if not isinstance(tree, Tensor):
        raise TypeError(f"treetensor.distributed.all_reduce: expected a treetensor.torch.Tensor, "
                        f"got {type(tree).__name__}")
    if bucket_cap_mb <= 0:
        raise ValueError(f"treetensor.distributed.all_reduce: bucket_cap_mb must be positive, got {bucket_cap_mb}")
    leaves = tree_flatten(tree)[0]
    if tree.is_consolidated():
        cap = bucket_cap_mb * _MiB
        views = [v for v, _ in bucket_plan(leaves, lambda k: cap)]
    else:
        views = leaves
    op = dist.ReduceOp.SUM if op is None else op
    works = [dist.all_reduce(v, op=op, group=group, async_op=True) for v in views]
    if async_op:
        return works
    for w in works:
        w.wait()
    return None
