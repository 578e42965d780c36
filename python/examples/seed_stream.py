"""The seed experiment (DI-treetensor's stream test) on treetensor, on the CPU.

min / native / linear / stream: N independent matmuls S1xS2 @ S2xS3 as a Python loop over
torch, as one tree call, and as one tree call over M lanes (ttorch.stream(M)). The seed used
N=200, S=512 on a GPU; only the device ('cpu') and S changed here.

    python python/examples/seed_stream.py [S] [M] [N] [T]   # the Python treetensor is installed in
"""
import argparse
import time

import torch

import treetensor.torch as ttorch

ap = argparse.ArgumentParser(description="The seed experiment on the CPU: N matmuls "
                             "S x 2S @ 2S x 4S as a Python loop, one tree call, and stream(M).")
ap.add_argument("S", nargs="?", type=int, default=32, help="the matmuls' size (default 32)")
ap.add_argument("M", nargs="?", type=int, default=2, help="lanes of the stream(M) row (default 2)")
ap.add_argument("N", nargs="?", type=int, default=200, help="leaves, i.e. matmuls (default 200)")
ap.add_argument("T", nargs="?", type=int, default=20, help="timed repetitions, best kept (default 20)")
args = ap.parse_args()
S, M, N, T = args.S, args.M, args.N, args.T
S1, S2, S3 = S, 2 * S, 4 * S
device = "cpu"


def timed(fn):
    fn()  # warm-up
    best = float("inf")
    for _ in range(T):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main():
    torch.manual_seed(0)
    a = ttorch.randn({f"a{i}": (S1, S2) for i in range(N)}, device=device)
    b = ttorch.randn({f"a{i}": (S2, S3) for i in range(N)}, device=device)
    a_list = [a[f"a{i}"] for i in range(N)]
    b_list = [b[f"a{i}"] for i in range(N)]

    def test_min():  # the bound a perfect M-way split could reach: N/M leaves in a loop
        return [torch.matmul(a_list[i], b_list[i]) for i in range(N // M)]

    def test_native():
        return [torch.matmul(a_list[i], b_list[i]) for i in range(N)]

    def test_linear():
        return ttorch.matmul(a, b)

    def test_stream():
        with ttorch.stream(M):
            return ttorch.matmul(a, b)

    def test_auto():
        with ttorch.stream("auto"):
            return ttorch.matmul(a, b)

    want = test_native()
    for fn in (test_linear, test_stream, test_auto):  # same values (to BLAS rounding)
        got = fn()
        assert all(torch.allclose(got[f"a{i}"], want[i], rtol=1e-4, atol=1e-4) for i in range(N)), fn.__name__

    rows = [(name, timed(fn)) for name, fn in
            [("min", test_min), ("native", test_native), ("linear", test_linear),
             (f"stream({M})", test_stream), ("stream('auto')", test_auto)]]
    native = dict(rows)["native"]
    print(f"seed: {N} leaves of {S1}x{S2} @ {S2}x{S3}, {device}, best of {T}")
    for name, ms in rows:
        print(f"{name:>16} {ms:9.3f} ms  {native / ms:5.2f}x native")


if __name__ == "__main__":
    main()
