"""treetensor.distributed's direct exchange (its module docstring) on 3 Gloo ranks, spawned here;
run by test_distributed.py under a timeout. Exit status 0 and "ok" when, on every rank:
- small tensors in calls of EXCHANGE_MIN_CALLS reductions or more go by exchange, and large
  ones (or any, with EXCHANGE_MAX_BYTES = 0, or in calls of fewer reductions, or sparse) by
  Gloo's all_reduce, as the docstring says, seen from the Work objects all_reduce returns;
- works dropped unwaited still reduce and leave the group working; a call that fails part way
  raises and leaves nothing in flight; inference tensors and ReduceOp instances are reduced;
  a rank outside the group gets a warning and nothing is done;
- a SUM by exchange is bitwise ((a0 + a1) + a2) on every rank, for float32 values whose sum
  depends on the order (so a rank adding in its own order would differ), float64, float16 and
  int64; Gloo's own SUM of the same tensors is that sum within the rounding of 2 additions; a
  Parameter is reduced in place outside autograd (as c10d writes it);
- MAX and MIN of integers are exact; of floats, and on bool, Gloo's all_reduce is used;
- wait() is idempotent (the reduction happens once) and takes a timedelta;
- the path does not depend on a leaf's layout (channels_last on one rank), and a NaN sum has
  the same bits on every rank;
- no Gloo thread outlives destroy_process_group (nothing of an exchange holds the group).

With the argument `dead`, 2 ranks: rank 1 leaves the group without reducing, and rank 0's
exchange must raise RuntimeError (the peer is gone) instead of hanging."""
import datetime
import gc
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_threads import gloo_threads

WORLD = 3


def check(ok, what):
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def values(rank, dtype, n=64):
    # Magnitudes spread over many binades so that float sums depend on their order.
    g = torch.Generator().manual_seed(100 + rank)
    if dtype.is_floating_point:
        span = 2 if dtype == torch.float16 else 6  # float16: sums stay finite (no inf - inf)
        x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-span, span + 1, (n,), generator=g)
        return x.to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def with_others(x):
    """A tree of `x` at 'x' (its first path) and as many small leaves more as make all_reduce
    exchange (EXCHANGE_MIN_CALLS calls)."""
    import treetensor.distributed as tdist
    import treetensor.torch as ttorch
    return ttorch.Tensor({"x": x, **{f"y{i}": torch.ones(2) for i in range(tdist.EXCHANGE_MIN_CALLS - 1)}})


def reduced(tensor, op):
    import treetensor.distributed as tdist
    t = with_others(tensor.clone())
    works = tdist.all_reduce(t, op=op, async_op=True)
    check(len(works) == tdist.EXCHANGE_MIN_CALLS, f"{len(works)} works for {tdist.EXCHANGE_MIN_CALLS} leaves")
    works[0].wait()
    works[0].wait()  # idempotent: reduced once
    for w in works[1:]:
        w.wait()
    return t.x, type(works[0]).__name__


def check_few_calls(rank):
    """Fewer than EXCHANGE_MIN_CALLS reductions in a call go by Gloo's all_reduce, every one."""
    import treetensor.distributed as tdist
    import treetensor.torch as ttorch
    few = tdist.EXCHANGE_MIN_CALLS - 1
    t = ttorch.Tensor({f"y{i}": torch.full((4,), float(rank + 1)) for i in range(few)})
    works = tdist.all_reduce(t, async_op=True)
    kinds = [type(w).__name__ for w in works]
    for w in works:
        w.wait()
    check(len(works) == few and "_ExchangeWork" not in kinds, f"{few} leaves went by {kinds}")
    check(all(torch.equal(t[f"y{i}"], torch.full((4,), 6.0)) for i in range(few)), f"{few} leaves' SUM")


def check_dropped_and_failed_calls(rank):
    """Works dropped unwaited (as torch's may be) still reduce, and the group goes on; a call
    whose leaf fails to start (uint16: Gloo's all_reduce refuses it) raises on every rank and
    leaves nothing in flight: the next collective answers at once."""
    import treetensor.distributed as tdist
    import treetensor.torch as ttorch
    t = with_others(torch.full((8,), float(rank + 1)))
    works = tdist.all_reduce(t, async_op=True)
    check(type(works[0]).__name__ == "_ExchangeWork", f"went by {type(works[0]).__name__}")
    del works
    gc.collect()
    check(torch.equal(t.x, torch.full((8,), 6.0)), f"a dropped work did not reduce: {t.x}")
    mixed = ttorch.Tensor({"a": torch.ones(4, dtype=torch.uint16),
                           **{f"f{i}": torch.ones(8192) for i in range(tdist.EXCHANGE_MIN_CALLS)}})
    try:
        tdist.all_reduce(mixed)
    except RuntimeError:
        pass
    else:
        raise AssertionError(f"rank {rank}: a uint16 leaf was reduced")
    x = torch.ones(1)
    start = time.monotonic()
    dist.all_reduce(x)
    check(x.item() == WORLD and time.monotonic() - start < 10, "the group after a failed call")


def check_other_leaves(rank):
    """By exchange as by Gloo: inference tensors, a sparse leaf (Gloo's, beside exchanged
    ones), an op given as a ReduceOp instance."""
    import treetensor.distributed as tdist
    import treetensor.torch as ttorch
    with torch.inference_mode():
        t = with_others(torch.full((4,), float(rank + 1)))
    tdist.all_reduce(t)
    check(torch.equal(t.x, torch.full((4,), 6.0)), "inference tensors by exchange")
    sparse = torch.sparse_coo_tensor([[rank]], [float(rank + 1)], (WORLD,))
    t = with_others(sparse)
    works = tdist.all_reduce(t, async_op=True)
    check(type(works[0]).__name__ != "_ExchangeWork" and type(works[1]).__name__ == "_ExchangeWork",
          f"a sparse leaf beside dense ones: {[type(w).__name__ for w in works]}")
    for w in works:
        w.wait()
    t = with_others(torch.full((4,), float(rank + 1)))
    tdist.all_reduce(t, op=dist.ReduceOp(dist.ReduceOp.SUM))
    check(torch.equal(t.x, torch.full((4,), 6.0)), "op=ReduceOp(ReduceOp.SUM)")


def check_outside_the_group(rank):
    """A rank outside the group: torch's warning, nothing done."""
    import warnings
    import treetensor.distributed as tdist
    import treetensor.torch as ttorch
    group = dist.new_group([0, 2])
    t = ttorch.Tensor({"x": torch.full((4,), float(rank + 1))})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tdist.all_reduce(t, group=group)
    want = torch.full((4,), 2.0 if rank == 1 else 4.0)
    check(got is None and torch.equal(t.x, want), f"rank {rank} with group [0, 2]: {t.x}")
    check((rank == 1) == any("not in the group" in str(w.message) for w in caught), f"warnings: {caught}")
    dist.destroy_process_group(group)


def check_sums(rank):
    import treetensor.distributed as tdist
    import treetensor.torch as ttorch
    parts = {dt: [values(r, dt) for r in range(WORLD)] for dt in
             (torch.float32, torch.float64, torch.float16, torch.int64)}
    for dtype, p in parts.items():
        want = (p[0] + p[1]) + p[2]
        got, kind = reduced(p[rank], dist.ReduceOp.SUM)
        check(kind == "_ExchangeWork", f"{dtype} SUM of 64 elements went by {kind}")
        check(torch.equal(got, want), f"{dtype} SUM by exchange is not (a0 + a1) + a2")
    other = (parts[torch.float32][0] + parts[torch.float32][2]) + parts[torch.float32][1]
    check(not torch.equal(other, (parts[torch.float32][0] + parts[torch.float32][1]) + parts[torch.float32][2]),
          "the float32 values do not depend on the order of addition: the test cannot fail")
    saved, tdist.EXCHANGE_MAX_BYTES = tdist.EXCHANGE_MAX_BYTES, 0
    try:
        p = parts[torch.float32]
        got, kind = reduced(p[rank], dist.ReduceOp.SUM)
    finally:
        tdist.EXCHANGE_MAX_BYTES = saved
    check(kind != "_ExchangeWork", "EXCHANGE_MAX_BYTES = 0 still exchanged")
    want = (p[0] + p[1]) + p[2]
    bound = 2 * torch.finfo(torch.float32).eps * (p[0].abs() + p[1].abs() + p[2].abs())
    check(bool(((got - want).abs() <= bound).all()), "Gloo's SUM is not the sum within 2 roundings")
    weight = torch.nn.Parameter(torch.full((3,), float(rank + 1)))  # written outside autograd, as c10d does
    t = with_others(weight)
    tdist.all_reduce(t)
    check(t.x is weight and torch.equal(weight.detach(), torch.full((3,), 6.0)) and weight.grad_fn is None,
          "a parameter's SUM by exchange")
    big = torch.ones(tdist.EXCHANGE_MAX_BYTES // 4 // (WORLD - 1) + 1)
    got, kind = reduced(big, dist.ReduceOp.SUM)
    check(kind != "_ExchangeWork" and bool((got == WORLD).all()), f"a tensor over the limit went by {kind}")
    small = torch.full((4,), float(rank + 1))
    work = tdist.start_all_reduce(small, dist.ReduceOp.SUM, None, exchange=False)  # treetensor.nn's
    work.wait()
    check(type(work).__name__ != "_ExchangeWork" and torch.equal(small, torch.full((4,), 6.0)),
          f"start_all_reduce(exchange=False) went by {type(work).__name__}")


def check_layouts_and_nan(rank):
    """The path is chosen from what the agreement compares, never the layout: one rank's
    channels_last leaf pairs with the others' contiguous ones. A NaN's bits (sign, payload)
    are the same on every rank, as Gloo's are. wait() takes a timedelta."""
    import datetime
    import treetensor.distributed as tdist
    import treetensor.torch as ttorch
    x = torch.full((1, 3, 4, 4), float(rank + 1))
    if rank == 0:
        x = x.to(memory_format=torch.channels_last)
    t = with_others(x)
    works = tdist.all_reduce(t, async_op=True)
    check(type(works[0]).__name__ == "_ExchangeWork", f"a channels_last leaf went by {type(works[0]).__name__}")
    for w in works:
        w.wait(datetime.timedelta(seconds=30))
    check(t.x is x and torch.equal(x, torch.full((1, 3, 4, 4), 6.0)), "channels_last SUM by exchange")
    # Ranks 0 and 1 hold NaNs of opposite signs, rank 2 a number: adding in another order
    # than rank 0's (a1 + a0 on rank 1) keeps the other NaN (x86 keeps one operand's).
    nan = torch.full((64,), -float("nan") if rank == 0 else float("nan") if rank == 1 else 1.0)
    got, _ = reduced(nan, dist.ReduceOp.SUM)
    bits = [torch.zeros(64, dtype=torch.int32) for _ in range(WORLD)]
    dist.all_gather(bits, got.view(torch.int32))
    check(all(torch.equal(b, bits[0]) for b in bits), f"NaN sums differ in bits across ranks: {bits}")


def check_max_min(rank):
    ints, floats = values(rank, torch.int32), values(rank, torch.float32)
    for op, fn in ((dist.ReduceOp.MAX, torch.maximum), (dist.ReduceOp.MIN, torch.minimum)):
        got, kind = reduced(ints, op)
        want = fn(fn(values(0, torch.int32), values(1, torch.int32)), values(2, torch.int32))
        check(kind == "_ExchangeWork" and torch.equal(got, want), f"int32 {op}: {kind}")
        got, kind = reduced(floats, op)
        want = fn(fn(values(0, torch.float32), values(1, torch.float32)), values(2, torch.float32))
        check(kind != "_ExchangeWork" and torch.equal(got, want), f"float32 {op} went by {kind}")
    flags = torch.tensor([rank == 0, rank == 1, False, True])
    got, kind = reduced(flags, dist.ReduceOp.SUM)
    check(kind != "_ExchangeWork", "a bool SUM was exchanged")


def run(rank, init_file):
    import treetensor.distributed  # noqa: F401  before the group exists (treetensor.nn says why)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    check_sums(rank)
    check_few_calls(rank)
    check_dropped_and_failed_calls(rank)
    check_other_leaves(rank)
    check_outside_the_group(rank)
    check_layouts_and_nan(rank)
    check_max_min(rank)
    dist.barrier()
    dist.destroy_process_group()
    # No exchange may hold the group: its Gloo threads, torn down at interpreter exit, abort.
    gc.collect()
    left = gloo_threads()
    if left:
        raise AssertionError(f"rank {rank}: Gloo threads outlive destroy_process_group: {left}")


def run_dead(rank, init_file):
    import treetensor.distributed as tdist  # before the group exists (treetensor.nn says why)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone without a word: no destroy_process_group, no reduction
    try:  # the exchange itself (all_reduce's agreement, one all_reduce, is Gloo's)
        tdist.start_all_reduce(torch.ones(8), dist.ReduceOp.SUM, None).wait()
    except RuntimeError as e:
        print(f"rank 0 raised: {str(e).splitlines()[0]}", flush=True)
        os._exit(0)
    raise AssertionError("rank 0: an exchange with a dead peer returned")


if __name__ == "__main__":
    dead = sys.argv[1:] == ["dead"]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run_dead if dead else run, args=(os.path.join(d, "init"),), nprocs=2 if dead else WORLD,
                 join=True)
    print("ok")
    sys.exit(0)
