import os
import sys

import pytest
import torch

import treetensor.torch as ttorch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _linear_mode():
    """Every test starts and ends in the default (linear) mode."""
    ttorch.stream(1)
    yield
    ttorch.stream(1)


def dicts_equal(tree, d):
    """tree (ttorch.Tensor) has exactly the structure and values of the nested dict d."""
    assert sorted(type(tree).keys(tree)) == sorted(d.keys())  # a key "keys" comes before the method
    for k, v in d.items():
        got = tree[k]
        if isinstance(v, dict):
            dicts_equal(got, v)
        else:
            assert isinstance(got, torch.Tensor), k
            assert got.dtype == v.dtype and got.shape == v.shape, k
            assert torch.equal(got, v) or (torch.isnan(v).any() and torch.allclose(got, v, equal_nan=True)), k
