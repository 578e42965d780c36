"""treetensor.distributed's direct exchange for small reductions on Gloo, on 3 spawned ranks
(exchange_worker.py): the same bits on every rank, in rank order, Gloo's all_reduce where the
exchange does not apply (and in calls of fewer than EXCHANGE_MIN_CALLS reductions), dropped
and failed calls that leave the group working, and an error, not a hang, when a peer is gone. The 2-rank training
path (buckets during backward, bitwise DDP's) is test_nn.py's."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(HERE, "exchange_worker.py"), *args], env=env,
                          capture_output=True, text=True, timeout=180)


def test_three_ranks_reduce_in_rank_order():
    done = worker()
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_a_dead_peer_raises_instead_of_hanging():
    done = worker("dead")
    assert done.returncode == 0 and "rank 0 raised:" in done.stdout, done.stdout + done.stderr


def test_without_a_process_group_torch_s_error_passes_through():
    import torch.distributed as dist

    import treetensor.distributed as tdist
    import treetensor.torch as ttorch
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        tdist.all_reduce(ttorch.Tensor({"x": torch.ones(2)}))


def test_leaves_that_share_memory_are_found_whatever_lies_between():
    """all_reduce's check before any call (no group needed): a non-contiguous leaf reaching
    over others hides no overlap among them; interleaved views do not overlap."""
    import treetensor.torch as ttorch
    from treetensor.distributed import _write_conflict
    w = torch.zeros(10, 10)
    for tree, want in (({"a": w[0:5], "b": w[:, 0], "c": w[2]}, "paths 'a' and 'c' share memory"),
                       ({"a": w[0], "b": w[0]}, "paths 'a' and 'b' share memory"),
                       ({"a": torch.ones(1).expand(4)}, "path 'a': elements of the leaf share memory"),
                       ({"a": w[:, 0::2], "b": w[:, 1::2]}, None)):
        leaves, spec = ttorch.tree_flatten(ttorch.Tensor(tree))
        got = _write_conflict(spec, leaves)
        assert (got is None) if want is None else (want in got), got
