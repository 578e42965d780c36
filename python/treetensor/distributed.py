"""``treetensor.distributed``: collectives on trees over ``torch.distributed`` (DESIGN.md §14).

    import treetensor.distributed as tdist
    tdist.all_reduce(grads, group=dist.group.WORLD)          # in place, every rank
    works = tdist.all_reduce(grads, async_op=True)           # then w.wait() for each

A consolidated tree (``t.consolidate()``, ``treetensor.nn``'s gradient tree) is reduced in
buckets: contiguous ranges of each buffer holding whole leaves, at most ``bucket_cap_mb`` MiB
(DDP's 25; a larger leaf is a bucket of its own), one ``all_reduce`` per bucket and no copy;
the padding between leaves is zero and stays zero under SUM. Any other tree is reduced leaf
by leaf. Before any data moves the ranks agree, as the C++ layer's collectives do (§14): one
small all_reduce of a hash over the op, every leaf's path, dtype and shape, and the calls about
to be made; where a rank differs, every rank raises ValueError naming the first differing path
(or the op, or the bucketing) and what each rank has, and the group stays usable. Either way
the calls go in sorted-path order, so every rank issues the same sequence;
issue collectives on one group from one thread at a time (two threads interleaving raw c10d
calls can pair different tensors across ranks: the C++ layer's ordered collectives exist for
that, §14).

Small reductions on a Gloo group go by direct exchange instead of Gloo's ``all_reduce``: a
CPU tensor whose peers' copies add up to at most ``EXCHANGE_MAX_BYTES`` (512 KiB, counted as
``(world size - 1) x its bytes``: on 2 ranks a tensor of 512 KiB), reduced by SUM (any dtype
but bool and complex) or by MAX / MIN (integer dtypes), is sent to every peer and received from
every peer (``ProcessGroup.send`` / ``recv`` with the tag ``EXCHANGE_TAG``), then reduced
locally in rank order, rank 0's copy first, so every rank holds the same bits; on 2 ranks the
values are Gloo's (a + b is b + a; NaN payloads may differ). Gloo's all_reduce of 2 local
ranks took 0.5 to 2 ms from 64 B to 512 KiB on the 2-core Xeon, the exchange 0.1 to 0.5 ms;
from 1 MiB up Gloo's pipelined ring is as fast or faster. But an exchange waits longer for
the peer's side of it when the ranks compute between reductions: in the ``train`` workload's
policy step (2 ranks, 2 cores) one exchanged buffer cost 1.0 ms more than Gloo's all_reduce,
while exchanges in flight together overlap (1, 2, 4 and 8 pieces of its 188 KB gradient
buffer: 3.2, 3.6, 3.8, 4.1 ms a step by exchange, 2.1, 2.6, 4.1, 6.4 ms by Gloo; its 28 leaves
5.2-5.7 ms against 8.7-9.0). So ``all_reduce`` exchanges only when it makes at least
``EXCHANGE_MIN_CALLS`` (4) reductions in one call, and its agreement's single all_reduce goes
by Gloo's. ``EXCHANGE_MAX_BYTES`` and ``EXCHANGE_MIN_CALLS`` must be the same on every rank
(``EXCHANGE_MAX_BYTES = 0``: always Gloo's): ``all_reduce``'s agreement compares them and
raises ValueError on every rank where they differ. A program's own ``isend`` / ``irecv`` on
the group must not use ``EXCHANGE_TAG``. The works ``all_reduce(async_op=True)`` returns for
exchanged leaves reduce in ``wait()`` (``_ExchangeWork``: no ``get_future()``).
"""
import datetime as _datetime
import functools as _functools
import hashlib as _hashlib
import sys as _sys
import time as _time
import warnings as _warnings

import torch as _torch

from .torch import Tensor, tree_flatten

__all__ = ["EXCHANGE_MAX_BYTES", "EXCHANGE_MIN_CALLS", "EXCHANGE_TAG", "all_reduce"]

_MiB = 1 << 20
EXCHANGE_MAX_BYTES = 512 << 10
EXCHANGE_MIN_CALLS = 4
EXCHANGE_TAG = 0x74726565  # "tree"


# What the local reduction can add, max and min on the CPU: decided before anything is posted.
_EXCHANGE_DTYPES = frozenset((_torch.float16, _torch.bfloat16, _torch.float32, _torch.float64,
                              _torch.int8, _torch.uint8, _torch.int16, _torch.int32, _torch.int64))


def _exchange_op(tensor, op, pg):
    """The in-place local reduction (``Tensor.add_`` ...) to exchange ``tensor`` for under
    ``op`` on the process group ``pg``, or None where Gloo's all_reduce must do it (module
    docstring). It asks only what the agreement compares on every rank (dtype, shape, op) and
    the group, never the tensor's layout: ranks that chose differently would never pair."""
    import torch.distributed as dist
    if not isinstance(pg, dist.ProcessGroup):  # no group, or not a member: torch's error
        return None
    if (tensor.device.type != "cpu" or tensor.dtype not in _EXCHANGE_DTYPES
            or tensor.layout != _torch.strided or tensor.numel() == 0):
        return None
    world = pg.size()
    if world < 2 or (world - 1) * tensor.numel() * tensor.element_size() > EXCHANGE_MAX_BYTES:
        return None
    if pg.name() != "gloo":
        return None
    if op == dist.ReduceOp.SUM:
        return _torch.Tensor.add_
    if tensor.is_floating_point():  # NaN: Gloo's max and min are not torch's
        return None
    if op == dist.ReduceOp.MAX:
        return lambda a, b: _torch.maximum(a, b, out=a)
    if op == dist.ReduceOp.MIN:
        return lambda a, b: _torch.minimum(a, b, out=a)
    return None


class _ExchangeWork:
    """An all_reduce of one tensor by direct exchange (module docstring), started: every send
    and receive is posted on the process group ``pg`` (its own ranks); a non-contiguous tensor
    is sent as a contiguous copy. ``wait(timeout=None)`` waits for them (``timeout``, a
    timedelta, bounds the whole wait; otherwise the group's timeout applies to each; a lost
    peer raises RuntimeError, and so does every later ``wait()``), then reduces into the
    tensor, once, and returns True. Unlike torch's Work, the tensor is reduced only in
    ``wait()``: ``is_completed()`` is True only after it, and there is no ``get_future()``. A
    work dropped unwaited waits and reduces when it is collected (a transfer freed in flight
    would break the group)."""

    def __init__(self, tensor, reduce, pg):
        self._tensor, self._reduce, self._done, self._failed = tensor, reduce, False, None
        self._rank = pg.rank()
        own = tensor if tensor.is_contiguous() else tensor.contiguous()  # kept in _parts
        self._parts = [own if k == self._rank else _torch.empty_like(own) for k in range(pg.size())]
        self._works = []
        for k, part in enumerate(self._parts):
            if k != self._rank:
                self._works.append(pg.send([own], k, EXCHANGE_TAG))
                self._works.append(pg.recv([part], k, EXCHANGE_TAG))

    def wait(self, timeout=None):
        if self._done:
            return True
        if self._failed is not None:
            raise self._failed
        deadline = None if timeout is None else _time.monotonic() + timeout.total_seconds()
        try:
            while self._works:
                if deadline is None:
                    self._works[0].wait()
                else:
                    # At least 1 ms: c10d reads a zero timeout as none.
                    self._works[0].wait(_datetime.timedelta(seconds=max(1e-3, deadline - _time.monotonic())))
                self._works.pop(0)
        except Exception as e:
            # Gloo closed the pair (a lost peer, a timeout): nothing is in flight any more, and
            # the parts never arrived, so every later wait() raises this too.
            self._failed, self._works = e, []
            raise
        # Every rank runs the same additions on the same operands, rank 0's copy first, so all
        # hold the same bits (NaN payloads too: x86 keeps the first operand's). As c10d writes
        # a leaf: outside autograd, and an inference tensor in inference mode.
        parts, reduce = self._parts, self._reduce
        acc = parts[0]
        inference = self._tensor.is_inference()
        with _torch.inference_mode() if inference else _torch.no_grad():
            for p in parts[1:]:
                reduce(acc, p)
            if acc is not self._tensor:
                self._tensor.copy_(acc)
        self._done = True
        return True

    def __del__(self):
        # Dropped before its wait(), as torch's own works may be: a Gloo send or receive freed
        # in flight leaves the group's pair broken (every later call times out), so it is
        # waited for here, and the tensor reduced, as torch's work would have reduced it.
        if getattr(self, "_works", None) and not _sys.is_finalizing():
            try:
                self.wait()
            except Exception:  # noqa: BLE001  no caller to raise to: the group's next call reports it
                pass

    def is_completed(self):
        return self._done


def start_all_reduce(tensor, op, group, exchange=True):
    """Starts an all_reduce of ``tensor`` in place, without the agreement: by direct exchange
    where it applies (module docstring) and ``exchange`` is true, else
    ``torch.distributed.all_reduce(async_op=True)``. Returns the work to ``wait()`` for before
    the tensor is read or written. Every rank must call it with a tensor of the same dtype and
    shape, the same op, the same ``exchange`` and the same ``EXCHANGE_MAX_BYTES``."""
    import torch.distributed as dist
    pg = dist.group.WORLD if group is None else group
    reduce = _exchange_op(tensor, op, pg) if exchange else None
    if reduce is None:
        return dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return _ExchangeWork(tensor, reduce, pg)


def buffer_of(view):
    """The whole 1-D buffer a consolidated leaf views (consolidate() allocates each group's
    buffer as all of one storage)."""
    storage = view.untyped_storage()
    numel = storage.nbytes() // view.element_size()
    return _torch.empty(0, dtype=view.dtype, device=view.device).set_(storage, 0, (numel,))


def buffers_of(leaves):
    """The whole buffers the consolidated ``leaves`` view, each once, in the leaves' order."""
    seen, out = set(), []
    for leaf in leaves:
        key = leaf.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            out.append(buffer_of(leaf))
    return out


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


def _op_name(op):
    # ReduceOp.SUM is a RedOpType (named); ReduceOp(ReduceOp.SUM) an instance that only compares.
    import torch.distributed as dist
    named = getattr(op, "name", None) or next(
        (k for k, v in dist.ReduceOp.RedOpType.__members__.items() if op == v), None)
    return str(op) if named is None else named


def _digest(text):  # 56 bits: the agreement negates it in an int64
    return int.from_bytes(_hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


_dtype_codes = {}


def _dtype_code(dtype):  # str hashes differ between processes; a digest of the name does not
    code = _dtype_codes.get(dtype)
    if code is None:
        code = _dtype_codes[dtype] = _digest(str(dtype))
    return code


@_functools.lru_cache(maxsize=256)
def _paths_digest(spec):
    return _digest(repr(spec.paths()))


def _fingerprint(op, spec, leaves, views):
    """What every rank must have alike for its calls to pair, hashed the same in every process
    (ints and tuples of ints only): the op, the paths, each leaf's dtype, shape and whether
    it is strided (a sparse leaf goes by Gloo's, a dense one may be exchanged), the element
    count of each call (consolidation and buckets) and the exchange's settings."""
    shapes = hash(tuple((_dtype_code(x.dtype), x.shape, x.layout == _torch.strided) for x in leaves))
    calls = hash(tuple(v.numel() for v in views))
    return _digest(f"{_op_name(op)}|{_paths_digest(spec)}|{shapes}|{calls}|{_exchange_settings()}")


def _exchange_settings():
    # Ranks that chose the exchange differently would never pair: each waits out the timeout.
    return [EXCHANGE_MAX_BYTES, EXCHANGE_MIN_CALLS]


def _describe(path):  # a key with a dot in it is bracketed: 'a.b' is not ['a.b']
    return ".".join(k if k and "." not in k else f"[{k!r}]" for k in path) or "<root>"


def _signature(op, spec, leaves, views):
    """The fingerprint's contents in words, exchanged only when fingerprints differ."""
    return {"op": _op_name(op), "leaves": [(_describe(p), _dtype_text(x), list(x.shape))
                                           for p, x in zip(spec.paths(), leaves)],
            "calls": [v.numel() for v in views],
            "exchange": [repr(v) for v in _exchange_settings()]}  # 4.0 is not 4 here


def _dtype_text(x):
    text = str(x.dtype).replace("torch.", "")
    return text if x.layout == _torch.strided else f"{text} ({str(x.layout).replace('torch.', '')})"


def _difference(mine, theirs, rank, other):
    """The first thing rank `other`'s signature has otherwise than ours, in words."""
    if "refused" in theirs:
        return f"rank {other} refused the call ({theirs['refused']})"
    if mine["op"] != theirs["op"]:
        return f"rank {rank} reduces by {mine['op']}, rank {other} by {theirs['op']}"
    if mine["exchange"] != theirs["exchange"]:
        (b0, c0), (b1, c1) = mine["exchange"], theirs["exchange"]
        return (f"rank {rank} has EXCHANGE_MAX_BYTES {b0} and EXCHANGE_MIN_CALLS {c0}, rank "
                f"{other} {b1} and {c1} (they must be the same on every rank)")
    ours = {p: (d, s) for p, d, s in mine["leaves"]}
    peer = {p: (d, s) for p, d, s in theirs["leaves"]}
    for path in sorted(set(ours) | set(peer)):
        if path not in peer:
            return f"rank {rank} has a leaf at '{path}' that rank {other} lacks"
        if path not in ours:
            return f"rank {other} has a leaf at '{path}' that rank {rank} lacks"
        if ours[path] != peer[path]:
            (d0, s0), (d1, s1) = ours[path], peer[path]
            return f"at '{path}' rank {rank} has {d0} {s0}, rank {other} has {d1} {s1}"
    return (f"rank {rank} makes {len(mine['calls'])} calls of {mine['calls'][:8]} elements, rank "
            f"{other} {len(theirs['calls'])} of {theirs['calls'][:8]} (one tree consolidated, or "
            f"another bucket_cap_mb)")


def _agreement_device(group):
    """Where the agreement's tensor lives: the CPU on a group with Gloo (alone or beside NCCL),
    else the current CUDA device; the same on every rank whatever its arguments, so a rank
    that refuses its own and the peers that do not still make the same call."""
    import torch.distributed as dist
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not _torch.cuda.is_available():
        return _torch.device("cpu")
    return _torch.device("cuda", _torch.cuda.current_device())


def _exchange(fingerprint, signature, group):
    """One all_reduce (MAX of the fingerprint and of its negation: unchanged on every rank iff
    all ranks have it): None when they agree, else every rank's ``signature()``."""
    import torch.distributed as dist
    both = _torch.tensor([fingerprint, -fingerprint], dtype=_torch.int64,
                         device=_agreement_device(group))
    start_all_reduce(both, dist.ReduceOp.MAX, group, exchange=False).wait()  # one: Gloo's
    if both.tolist() == [fingerprint, -fingerprint]:
        return None
    signatures = [None] * dist.get_world_size(group)
    dist.all_gather_object(signatures, signature(), group=group)
    return signatures


def _agree(op, spec, leaves, views, group):
    """Every rank about to make the same calls, or ValueError on every rank naming the first
    difference (nothing has moved yet)."""
    signatures = _exchange(_fingerprint(op, spec, leaves, views),
                           lambda: _signature(op, spec, leaves, views), group)
    if signatures is not None:
        raise ValueError(f"treetensor.distributed.all_reduce: the ranks' trees differ: "
                         f"{_disagreement(signatures, _difference, group)}")


def _disagreement(signatures, difference, group):
    """What the first rank whose signature is not ours has otherwise, in words
    (``difference(mine, theirs, rank, other)``)."""
    import torch.distributed as dist
    rank = dist.get_rank(group)
    other = next((r for r, s in enumerate(signatures) if s != signatures[rank]), None)
    return ("their fingerprints differ" if other is None else
            difference(signatures[rank], signatures[other], rank, other))


def _refuse(problem, group):
    """Raises `problem` (this rank's bad argument) after taking part in the agreement, so the
    peers raise too, naming it, instead of pairing their next call with ours."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        text = f"{type(problem).__name__}: {problem}"
        try:
            _exchange(_digest("refused|" + text), lambda: {"refused": text}, group)
        except Exception:  # noqa: BLE001  the group's own failure: this rank's error says more
            pass
    raise problem


def all_reduce(tree, op=None, *, group=None, async_op=False, bucket_cap_mb=25):
    """Reduces every leaf of ``tree`` across the ranks of ``group`` in place (``op``:
    ``torch.distributed.ReduceOp``, default SUM; ``group``: default the world), as
    ``torch.distributed.all_reduce`` does for one tensor; every rank must call it with a tree
    of the same structure, dtypes and shapes. Consolidated trees go in buckets of at most
    ``bucket_cap_mb`` MiB (module docstring). Returns None, or with ``async_op=True`` the list
    of works (torch's ``Work``, or for a small reduction by exchange, one of at least
    ``EXCHANGE_MIN_CALLS``, an object whose ``wait()`` does the reduction): wait for each
    before reading the tree.

    Raises TypeError if ``tree`` is not a ``treetensor.torch.Tensor``, ValueError for a
    non-positive ``bucket_cap_mb`` or for leaves that share memory (tied weights given twice,
    overlapping slices, an expanded view: named; each such refusal after the agreement, so
    every peer raises ValueError naming it) and, on every rank, when the ranks' trees or ops differ
    (module docstring: the agreement is one blocking all_reduce, also with ``async_op``);
    ``torch.distributed``'s errors (no process group, a timeout) pass through."""
    import torch.distributed as dist
    if not isinstance(tree, Tensor):
        _refuse(TypeError(f"treetensor.distributed.all_reduce: expected a "
                          f"treetensor.torch.Tensor, got {type(tree).__name__}"), group)
    if not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        _refuse(ValueError(f"treetensor.distributed.all_reduce: bucket_cap_mb must be a positive "
                           f"number, got {bucket_cap_mb!r}"), group)
    if dist.is_initialized() and dist.get_rank(group) == -1:  # as torch.distributed.all_reduce
        _warnings.warn("treetensor.distributed.all_reduce: this rank is not in the group: "
                       "nothing to do", UserWarning, stacklevel=2)
        return None
    leaves, spec = tree_flatten(tree)
    if Tensor.is_consolidated(tree):  # its leaves are disjoint views of its buffers
        cap = bucket_cap_mb * _MiB
        views = [v for v, _ in bucket_plan(leaves, lambda k: cap)]
    else:
        views = leaves
        conflict = _write_conflict(spec, leaves)
        if conflict is not None:
            _refuse(ValueError(f"treetensor.distributed.all_reduce: {conflict}"), group)
    op = dist.ReduceOp.SUM if op is None else op
    _agree(op, spec, leaves, views, group)
    # Exchanges pay only in numbers (module docstring); every rank has agreed on len(views).
    exchange = len(views) >= EXCHANGE_MIN_CALLS
    works = []
    try:
        for v in views:
            works.append(start_all_reduce(v, op, group, exchange=exchange))
    except BaseException as e:
        _wait_all(works)  # the calls posted before it: each rank posted the same ones
        _raise_named(e, len(works), spec, views is leaves, views, op)
    if async_op:
        return works
    failed = _wait_all(works)
    if failed:
        i, e = failed[0]
        _raise_named(e, i, spec, views is leaves, views, op)
    return None


def _raise_named(e, i, spec, per_leaf, views, op):
    """Raises the error of call `i` (a leaf, or a bucket of a consolidated tree) as its type with
    the leaf path, dtype and op in the message (Gloo says only "Invalid scalar type"), chained
    to it; KeyboardInterrupt and the like, and types not built from one string, unchanged."""
    if not isinstance(e, Exception):
        raise e
    where = (f"leaf '{_describe(spec.paths()[i])}'" if per_leaf else
             f"bucket {i} of the consolidated buffers")
    try:
        named = type(e)(f"treetensor.distributed.all_reduce: {where} ({_dtype_text(views[i])}, "
                        f"by {_op_name(op)}): {e}")
    except Exception:  # noqa: BLE001  a type not built from one string: the original
        named = None
    if named is None:
        raise e
    raise named from e


def _write_conflict(spec, leaves):
    """Why the leaves cannot be written in place (None when they can), as the C++ layer checks:
    a leaf whose elements share memory (an expanded view), or two leaves that share memory
    (tied weights: reduced twice, and by exchange to other values on each rank). Two
    non-contiguous leaves whose extents meet are taken as disjoint unless they are the same
    view (interleaved columns are), as ATen's get_overlap_status leaves that case."""
    spans = []
    for i, x in enumerate(leaves):
        if x.layout != _torch.strided or x.numel() == 0:
            continue
        if any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
            return (f"path '{_describe(spec.paths()[i])}': elements of the leaf share memory (an "
                    f"expanded or stride-0 view); a collective cannot write it")
        last = sum((n - 1) * st for n, st in zip(x.shape, x.stride())) * x.element_size()
        spans.append((x.data_ptr(), x.data_ptr() + last + x.element_size(), i))
    spans.sort()
    open_spans = []  # those that start before the next one and reach past its start
    for span in spans:
        open_spans = [o for o in open_spans if o[1] > span[0]]
        for o in open_spans:
            if _same_memory(leaves[o[2]], leaves[span[2]]):
                a, b = sorted((o[2], span[2]))
                return (f"paths '{_describe(spec.paths()[a])}' and '{_describe(spec.paths()[b])}' "
                        f"share memory; a collective that writes both would write it twice (pass one)")
        open_spans.append(span)
    return None


def _same_memory(x, y):  # of two leaves whose extents meet
    if x.is_contiguous() and y.is_contiguous():
        return True
    return x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()


def _wait_all(works):
    # A transfer left in flight would break the group's pairs: every work is waited for.
    return wait_each(w.wait for w in works)


def wait_each(waits):
    """Calls every wait (a work's ``wait``, a future's ``result``), also after one raised; the
    failures as (index, error), in order (the caller raises them)."""
    failed = []
    for i, wait in enumerate(waits):
        try:
            wait()
        except BaseException as e:  # noqa: B036  the caller raises it
            failed.append((i, e))
    return failed
