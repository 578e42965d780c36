"""The main job's `train` workload (DESIGN.md §21): a training step on treetensor's pieces
against PyTorch's own, OneFlow CI's protocol. One model source for both sides, one constant
input per rank, warm-up steps, then timed steps with the loss synced (`.item()`) every step;
relative speed = PyTorch ms / treetensor ms, the median over alternating runs.

Sides (each starts from one saved state dict):
  torch          eager (DistributedDataParallel on 2 ranks), Adam(fused=True),
                 zero_grad(set_to_none=True), metrics computed and written inline
  torch 2 threads  reference (1 process): torch with 2 intra-op threads, the core the
                 protocol's one thread leaves idle (which ours' worker threads use)
  torch best     its strongest settings: gradient_as_bucket_view=True, the metrics on a Python
                 thread beside the optimizer step and the next forward (zero_grad to None, so
                 nothing waits for the thread before backward: faster than keeping the
                 gradients: ResNet-50, 1 process, 217 -> 189 ms; 2 ranks 1.06-1.11x torch)
  ours           treetensor.nn.consolidate_module (on 2 ranks the gradient buffers averaged
                 after backward: OURS_OVERLAP says why), treetensor.optim.Adam (one
                 single-pass kernel per buffer),
                 zero_grad (one fill per buffer; on ResNet-50 set_to_none=True: the
                 gradients copied into the buffer during backward), metrics on an asyncs
                 thread beside the optimizer step on ResNet-50, inline on the policy
                 (OURS_ASYNC_METRICS says why); on ResNet-50 in one process the step taken
                 during backward on a worker, bucket by bucket (ModuleTree.step_in_backward;
                 OURS_STEP_IN_BACKWARD says where)
  ours -flat     ablation: torch's fused Adam instead of the flat step (so after backward)
  ours -async    ablation (ResNet-50): metrics inline
  ours +async    ablation (the policy): metrics on an asyncs thread
  ours -inbackward  ablation (ResNet-50, 1 process): the step after backward
  ours +inbackward  ablation (ResNet-50, 2 ranks): each bucket averaged and stepped during
                 backward (the step follows the bucket's average, so it needs the overlap)
  ours +overlap  ablation (2 ranks): the gradient buckets averaged during backward
                 (consolidate_module's process_group: DDP's reducer), the step after it
  ours +exchange the policy on 2 ranks with its gradient buffer (188 KB) averaged by
                 treetensor.distributed's direct exchange instead of Gloo's all_reduce (what
                 treetensor.nn did before this row measured it slower: why it no longer does)
Metrics each step: the loss, the gradient norm (over per-parameter norms, as
clip_grad_norm_) and a histogram of log10 per-parameter gradient norms, a JSON line written to
a file (where each side computes them: class Metrics).

Models: `policy`, DI-engine's PPO actor-critic shape (an MLP encoder with LayerNorm, actor and
critic heads: 28 small parameter tensors, 47 K parameters) at batch 64; `resnet50`, torchvision's ResNet-50
(its state_dict names and shapes are checked against data/models/resnet50.json) at small
batches. Every side is verified before its times count: after one step from the state dict
its parameters are torch's within the Adam bound of the optimizer tests, and its losses agree
with torch's to 1e-4 relative for as long as torch's own for-loop and fused Adam do (at least
2 steps, at most 30: training is chaotic, rounding differences grow, on ResNet-50 at batch 1
to 2% in 5 steps between PyTorch's two Adams); an unverified side exits 2.

    python bench_train.py [--models policy,resnet50] [--batches 1,2] [--size 112] [--ranks 1,2]
                          [--steps N] [--warmup N] [--runs N] [--json out/train.json]
"""
import argparse
import concurrent.futures
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LR = 1e-4
EPS32 = torch.finfo(torch.float32).eps
# Training trajectories are chaotic: PyTorch's own for-loop Adam and its fused Adam, from one
# state on one input, agree to 1e-7 in the policy's loss for 100 steps, then part (1.9e-4 by
# step 300); on ResNet-50 at batch 1 (BatchNorm over 16 values in layer4) they are 6e-4
# apart at step 3 and 2% at step 5. So losses are compared while those two agree.
VERIFY_STEPS = 30
# Alternating runs per side: the policy's 2-rank steps swing by 30% between runs minutes apart
# on this shared host (torch 2.9-3.8 ms), and its runs are cheap (0.3 s); ResNet-50's are not.
RUNS = {"policy": 9, "resnet50": 5}
NOISE = 0.25  # a row whose runs spread by a quarter of its median claims nothing (as every workload)


# ---- models (one source for both sides) ---------------------------------------------------

class Bottleneck(torch.nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(torch.nn.Module):
    """torchvision.models.resnet50's architecture and state_dict names."""

    def __init__(self, num_classes=1000):
        super().__init__()
        nn = torch.nn
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._layer(64, 3)
        self.layer2 = self._layer(128, 4, 2)
        self.layer3 = self._layer(256, 6, 2)
        self.layer4 = self._layer(512, 3, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def _layer(self, planes, blocks, stride=1):
        nn = torch.nn
        down = None
        if stride != 1 or self.inplanes != planes * 4:
            down = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride, bias=False),
                                 nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, down)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def fc_block(i, o):
    nn = torch.nn
    return [nn.Linear(i, o), nn.LayerNorm(o), nn.ReLU()]


class Policy(torch.nn.Module):
    """DI-engine's PPO actor-critic (VAC) shape: an FC encoder, a discrete actor head and a
    value head, small layers with LayerNorm (many small parameter tensors)."""

    def __init__(self, obs=64, actions=6):
        super().__init__()
        nn = torch.nn
        self.encoder = nn.Sequential(*fc_block(obs, 128), *fc_block(128, 128), *fc_block(128, 64))
        self.actor = nn.Sequential(*fc_block(64, 64), *fc_block(64, 64), nn.Linear(64, actions))
        self.critic = nn.Sequential(*fc_block(64, 64), nn.Linear(64, 1))

    def forward(self, obs):
        h = self.encoder(obs)
        return self.actor(h), self.critic(h).squeeze(-1)


def policy_inputs(batch, rank, size):
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(batch, 64, generator=g),
            (torch.randint(0, 6, (batch,), generator=g), torch.randn(batch, generator=g)))


def policy_loss(out, target):
    logits, value = out
    action, ret = target
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1).mean()
    return torch.nn.functional.nll_loss(logp, action) + 0.5 * (value - ret).square().mean() - 0.01 * entropy


def resnet_inputs(batch, rank, size):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 1000, (batch,), generator=g)


def resnet_loss(out, target):
    return torch.nn.functional.cross_entropy(out, target)


MODELS = {"policy": (Policy, policy_inputs, policy_loss), "resnet50": (ResNet50, resnet_inputs, resnet_loss)}


def check_resnet50_names():
    with open(os.path.join(ROOT, "data", "models", "resnet50.json")) as f:
        want = [(t["key"], tuple(t["shape"])) for t in json.load(f)["tensors"]]
    got = [(k, tuple(v.shape)) for k, v in ResNet50().state_dict().items()]
    if got != want:
        raise SystemExit("bench_train: ResNet50 here differs from torchvision's state_dict (data/models)")


# ---- metrics -------------------------------------------------------------------------------

def compute_metrics(out, loss, grads):
    # Per-leaf norms with one foreach call on every side: treetensor's per-leaf tree call
    # (grads.norm()) measured 2.6x slower here on the policy's 22 leaves (149 vs 57 us).
    write_metrics(out, loss, grad_norms(grads if isinstance(grads, list) else tree_leaves(grads)))


def grad_norms(leaves):
    return torch.stack(torch._foreach_norm(leaves))


def write_metrics(out, loss, norms):
    total = torch.linalg.vector_norm(norms)
    hist = torch.histc(norms.clamp_min(1e-12).log10(), bins=16, min=-12, max=4)
    out.write(json.dumps({"loss": float(loss), "grad_norm": float(total),
                          "hist": [int(c) for c in hist.tolist()]}) + "\n")


class Metrics:
    """Where the metrics run. "inline": computed and written in the step. "thread" (PyTorch's
    best, a Python thread) and "asyncs" (ours, a treetensor asyncs thread): a job reads the
    gradients themselves beside the optimizer step (which reads them too and writes only the
    parameters), then makes and writes the metrics from the norms while the next step runs;
    that step waits only until the job has read the gradients (wait_read()), before its first
    write to them (Run._step says where). One job in flight: a submit waits for the previous one. A snapshot
    of the gradients instead (a copy, 100 MB a step on ResNet-50) cost more on the 2 cores than
    the norms it moved off the step."""

    def __init__(self, mode, path):
        self.mode, self.file, self.pending = mode, open(path, "w"), None
        self.read = threading.Event()
        self.read.set()
        if mode == "thread":
            self.pool = concurrent.futures.ThreadPoolExecutor(1)
        elif mode == "asyncs":
            import treetensor.asyncs as asyncs
            self.pool = asyncs.Thread("metrics")

    def submit(self, loss, grads):
        loss = loss.detach()
        if self.mode == "inline":
            compute_metrics(self.file, loss, grads)
            return
        self.wait()
        # This step's gradients: DDP points .grad at new bucket views when it rebuilds its
        # buckets after the first step.
        leaves = grads if isinstance(grads, list) else tree_leaves(grads)
        self.read.clear()
        try:
            self.pending = self.pool.submit(self._job, loss, leaves)
        except BaseException:
            self.read.set()  # no job will: the next step must not wait for it
            raise

    def _job(self, loss, leaves):
        try:
            norms = grad_norms(leaves)
        finally:
            self.read.set()
        write_metrics(self.file, loss, norms)

    def wait_read(self):
        self.read.wait()

    def wait(self):
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self):
        self.wait()
        if self.mode == "thread":
            self.pool.shutdown()
        elif self.mode == "asyncs":
            self.pool.close()
        self.file.close()


def tree_leaves(tree):
    from treetensor.torch import tree_flatten
    return tree_flatten(tree)[0]


# ---- sides ---------------------------------------------------------------------------------

# Our zero_grad per model: set_to_none=True where its copy in backward beats the fill and the
# accumulating add (ResNet-50: 161 tensors, 100 MB of gradients: zero_grad + backward 111 ->
# 106 ms), the fill where the parameters are many and small (the policy: 28 tensors, 47 K
# parameters, where set_to_none's hooks cost more than the fill: a step 1.45 -> 1.74 ms);
# 1 process, AMD EPYC.
OURS_SET_TO_NONE = {"policy": False, "resnet50": True}
YARDSTICK = "torch for-loop"  # torch.optim.Adam's for-loop step: verification only, not timed
# Where our metrics run per model: on an asyncs thread beside the optimizer step and the next
# step where the step is long (ResNet-50), inline where it is short (the policy). The metrics
# are Python calls holding the GIL for ~0.2 ms a step, so on another thread they stall the
# training thread's own Python, and 2 ranks on 2 cores leave no idle core for the thread:
# policy steps 1.54 -> 1.49 ms (1 process) and 2.86 -> 2.25 ms (2 ranks) inline; 2-core Xeon.
OURS_ASYNC_METRICS = {"policy": False, "resnet50": True}
# Where our optimizer steps during backward (ModuleTree.step_in_backward), bucket by bucket on
# a worker, per (model, ranks): ResNet-50 in one process, whose buckets complete early in
# backward (layer4 holds 60% of the parameters) and whose 100 MB step (and gradient copies)
# then run on the free core (222 -> 181 ms a step); not on 2 ranks, where no core is free
# (406 -> 433 ms); not the policy, whose one bucket completes only at backward's end, so the
# step cannot overlap and the per-parameter hooks it needs cost more (1.82 -> 1.85 ms).
# 2-core Xeon.
OURS_STEP_IN_BACKWARD = {("policy", 1): False, ("policy", 2): False,
                         ("resnet50", 1): True, ("resnet50", 2): False}
# Whether our gradient buckets are averaged during backward on 2 ranks (consolidate_module's
# process_group) or the buffers after it: after. 2 ranks on 2 cores leave no core for Gloo's
# threads beside backward, so the overlap only adds work (the policy's 28 Python hooks) and
# contention: ResNet-50 at batch 1 1.00-1.04x torch overlapped, 1.05-1.07x after; the policy
# 1.09-1.12x overlapped, 1.15-1.18x after (4 runs each, 2-core Xeon).
OURS_OVERLAP = False


def sides(model, ranks):
    """The sides of one configuration, in their round-robin order."""
    toggle = "ours -async" if OURS_ASYNC_METRICS[model] else "ours +async"
    one = ["torch", "torch best", "ours", "ours -flat", toggle]
    if model == "resnet50":
        one.append("ours -inbackward" if OURS_STEP_IN_BACKWARD[(model, ranks)] else "ours +inbackward")
    if ranks == 1:
        return one + ["torch 2 threads"]
    # ResNet-50's buffers are all past the exchange's limit: its +exchange would be `ours`.
    return one + ["ours -overlap" if OURS_OVERLAP else "ours +overlap"] + \
        (["ours +exchange"] if model == "policy" else [])


class Run:
    """One side's model, optimizer and metrics; step() is one timed training step."""

    def __init__(self, side, make, state, loss_fn, group, tmp, set_to_none=False, async_metrics=True,
                 step_in_backward=False):
        import treetensor.nn as tnn
        import treetensor.optim as topt
        self.model = make()
        self.model.load_state_dict(state)
        self.loss_fn, self.group, self.tree, self.side = loss_fn, group, None, side
        ours = side.startswith("ours")
        if ours:
            mode = "asyncs" if async_metrics != (side in ("ours -async", "ours +async")) else "inline"
        else:
            mode = "thread" if side == "torch best" else "inline"
        self.metrics = Metrics(mode, tmp + ".metrics.jsonl")
        if ours:
            toggled = side in ("ours -inbackward", "ours +inbackward")
            in_backward = step_in_backward != toggled and side != "ours -flat"
            # The step during backward follows each bucket's average there: it needs the overlap.
            overlap = group is not None and (
                OURS_OVERLAP != (side in ("ours -overlap", "ours +overlap")) or in_backward)
            self.exchange = side == "ours +exchange"
            self.tree = tnn.consolidate_module(self.model, process_group=group if overlap else None)
            self.params = [p for p in self.model.parameters()]
            self.after_backward = self._reduce_buffers if group is not None and not overlap else None
            if side == "ours -flat":
                self.opt = torch.optim.Adam(self.params, lr=LR, fused=True)
                self.opt_step = lambda grads: self.opt.step()
            else:
                self.opt = topt.Adam(self.tree.params, lr=LR)
                self.opt_step = self.opt.step
                if in_backward:
                    self.tree.step_in_backward(self.opt)
            self.set_to_none = set_to_none
            self.zero_grad = lambda: self.tree.zero_grad(set_to_none=set_to_none)
            self.forward = self.model
        else:
            self.forward = self.model if group is None else torch.nn.parallel.DistributedDataParallel(
                self.model, process_group=group, gradient_as_bucket_view=(side == "torch best"))
            self.params = list(self.model.parameters())
            forloop = side == YARDSTICK
            self.opt = torch.optim.Adam(self.params, lr=LR, fused=not forloop, foreach=False if forloop else None)
            self.opt_step = lambda grads: self.opt.step()
            self.set_to_none = True  # every torch side: "torch best" measured faster so too
            self.zero_grad = lambda: self.opt.zero_grad(set_to_none=True)
            self.after_backward = None

    def _reduce_buffers(self):
        import treetensor.distributed as tdist
        for b in self.tree.grad_buffers:
            b.div_(dist.get_world_size(self.group))
            tdist.start_all_reduce(b, dist.ReduceOp.SUM, self.group, exchange=self.exchange).wait()

    def step(self, x, target):
        # The metrics job reads the last step's gradients until wait_read(): wait before the
        # first write to them, zero_grad's fill, or backward where zero_grad sets them to None
        # (writes nothing), so the forward runs beside the job.
        if not self.set_to_none:
            self.metrics.wait_read()
        self.zero_grad()
        loss = self.loss_fn(self.forward(x), target)
        self.metrics.wait_read()
        loss.backward()
        if self.after_backward is not None:
            self.after_backward()
        grads = self.tree.grads if self.tree is not None else [p.grad for p in self.params]
        self.metrics.submit(loss, grads)
        self.opt_step(grads)
        return loss.item()

    def close(self):
        self.metrics.close()
        if self.tree is not None:
            self.tree.close()


def adam_bound(w, steps):
    return (steps + 1) * EPS32 * (w.abs() + 16 * LR)


def timed(run, inputs, steps, group):
    """`steps` steps of `run`, each timed: (median ms, losses)."""
    if group is not None:
        dist.barrier(group)
    step_ms, losses = [], []
    with intra_op_threads(run):
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(run.step(*inputs))
            step_ms.append((time.perf_counter() - t0) * 1e3)
    # The median step: one step preempted on a shared VM does not move it.
    return statistics.median(step_ms), losses


@contextlib.contextmanager
def intra_op_threads(run):
    """The side's intra-op threads while it runs: 2 for `torch 2 threads` (the reference that
    gives torch the core one process leaves idle), else the protocol's 1."""
    two = run.side == "torch 2 threads"
    if two:
        torch.set_num_threads(2)
    try:
        yield
    finally:
        if two:
            torch.set_num_threads(1)


def verify(ref_losses, yard_losses, ref_first, losses, first, other_threads=False):
    """None, or why a side's run does not match torch's: the parameters after the first step
    within the Adam bound; the losses to 1e-4 relative for as long as torch's own for-loop
    and fused Adam agree so (at least 2 steps, at most VERIFY_STEPS). `other_threads`: the
    side's kernels ran on another number of threads, so its gradients agree only to rounding,
    and Adam's first step (lr * g / |g|, up to eps) moves a parameter whose gradient is
    rounding-sized by +-lr on either side: the bound grows by 2 lr, and only the first loss
    (before any step) is compared, since training from there parts chaotically (on ResNet-50,
    6e-4 apart at step 2)."""
    for i, (a, b) in enumerate(zip(ref_first, first)):
        if not bool(((a - b).abs() <= adam_bound(a, 1) + (2 * LR if other_threads else 0)).all()):
            return f"parameter {i} after step 1 differs by {float((a - b).abs().max()):.3g}"
    for i, (a, y, b) in enumerate(zip(ref_losses, yard_losses, losses)):
        if i >= 2 and abs(a - y) > 1e-4 * abs(a):
            break  # torch's two Adams have parted: rounding has grown past what is comparable
        if abs(a - b) > 1e-4 * abs(a):
            return f"step {i + 1}: loss {b} vs torch's {a} (for-loop Adam: {y})"
        if other_threads:
            break
    return None


def measure(cfg, rank, group, args):
    """Every side of one (model, batch, ranks) configuration, alternating runs (RUNS)."""
    model, batch = cfg
    make, inputs_of, loss_fn = MODELS[model]
    torch.manual_seed(0)
    state = make().state_dict()
    inputs = inputs_of(batch, rank, args.size)
    ranks = 1 if group is None else 2
    sides_now = sides(model, ranks)
    steps = args.steps or (100 if model == "policy" else 3)
    warmup = args.warmup or (10 if model == "policy" else 2)
    # Every side lives at once and the runs go round-robin, alternating the order, so a drift
    # of the (shared, virtual) machine's speed reaches every side alike.
    runs, losses, first, times = {}, {}, {}, {s: [] for s in sides_now}
    with tempfile.TemporaryDirectory() as tmp:
        for s in sides_now:
            runs[s] = Run(s, make, state, loss_fn, group, os.path.join(tmp, s.replace(" ", "")),
                          set_to_none=OURS_SET_TO_NONE[model], async_metrics=OURS_ASYNC_METRICS[model],
                          step_in_backward=OURS_STEP_IN_BACKWARD[(model, ranks)])
            with intra_op_threads(runs[s]):
                losses[s] = [runs[s].step(*inputs)]
                first[s] = [p.detach().clone() for p in runs[s].model.parameters()]
                losses[s] += [runs[s].step(*inputs) for _ in range(warmup - 1)]
        for r in range(args.runs or RUNS[model]):
            for s in (sides_now if r % 2 == 0 else sides_now[::-1]):
                ms, more = timed(runs[s], inputs, steps, group)
                times[s].append(ms)
                losses[s] += more
        for run in runs.values():
            run.close()
        del runs
        yard = Run(YARDSTICK, make, state, loss_fn, group, os.path.join(tmp, "forloop"))
        yard_losses = [yard.step(*inputs) for _ in range(min(VERIFY_STEPS, len(losses["torch"])))]
        yard.close()
    failures = {s: why for s in sides_now[1:]
                if (why := verify(losses["torch"], yard_losses, first["torch"], losses[s], first[s],
                                  other_threads=s == "torch 2 threads"))}
    return times, failures


def report(model, batch, ranks, times, failures):
    base = statistics.median(times["torch"])
    rows = []
    for side, ts in times.items():
        med = statistics.median(ts)
        spread = (max(ts) - min(ts)) / 2
        rows.append({"noisy": spread >= NOISE * med, "model": model, "batch": batch, "ranks": ranks, "side": side, "ms": med,
                     "spread_ms": spread, "runs_ms": ts, "relative_speed": base / med,
                     "verified": side == "torch" or side not in failures,
                     "why": failures.get(side)})
    return rows


def print_rows(rows):
    for r in rows:
        noisy = " (noisy)" if r["noisy"] else ""
        mark = "" if r["verified"] else f"  NOT VERIFIED: {r['why']}"
        print(f"{r['model']:<9} {r['batch']:>5} {r['ranks']:>5}  {r['side']:<14} {r['ms']:>9.2f} "
              f"±{r['spread_ms']:<7.2f} {r['relative_speed']:>6.2f}x{noisy}{mark}", flush=True)


def configs(args):
    out = []
    for m in args.models.split(","):
        for b in ([64] if m == "policy" else [int(x) for x in args.batches.split(",")]):
            out.append((m, b))
    return out


def ranked(rank, args, init_file, out_file):
    import treetensor.nn  # noqa: F401  before the group exists (treetensor.nn's imports say why)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    rows = []
    for cfg in configs(args):
        times, failures = measure(cfg, rank, dist.group.WORLD, args)
        if rank == 0:
            rows += report(cfg[0], cfg[1], 2, times, failures)
            print_rows(rows[-len(times):])
    dist.barrier()
    gc.collect()  # the runs' DDP objects sit in reference cycles and hold the group
    dist.destroy_process_group()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(rows, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="policy,resnet50")
    ap.add_argument("--batches", default="1", help="ResNet-50 batch sizes (the policy: 64)")
    ap.add_argument("--size", type=int, default=112, help="ResNet-50 input height and width")
    ap.add_argument("--ranks", default="1,2", help="1: one process; 2: DDP on 2 local Gloo ranks")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per run (default: policy 100, resnet50 3)")
    ap.add_argument("--warmup", type=int, default=0, help="warm-up steps (default: policy 10, resnet50 2)")
    ap.add_argument("--runs", type=int, default=0, help="alternating runs per side (median; default: policy 9, resnet50 5)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if "resnet50" in args.models:
        check_resnet50_names()
    print(f"train: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 intra-op "
          f"thread per rank, glibc malloc; ms per step, median over {args.runs or 'policy 9 / resnet50 5'} alternating runs of each run's median step "
          f"(± half their range); speed = torch's ms / the row's (relative speed)")
    print(f"{'model':<9} {'batch':>5} {'ranks':>5}  {'side':<14} {'ms':>9} {'spread':<8} {'speed':>7}")
    rows = []
    if "1" in args.ranks.split(","):
        torch.set_num_threads(1)
        for cfg in configs(args):
            times, failures = measure(cfg, 0, None, args)
            rows += report(cfg[0], cfg[1], 1, times, failures)
            print_rows(rows[-len(times):])
    if "2" in args.ranks.split(","):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "rows.json")
            mp.spawn(ranked, args=(args, os.path.join(d, "init"), out), nprocs=2, join=True)
            with open(out) as f:
                rows += json.load(f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config(args, rows), "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["verified"]]
    if bad:
        print(f"bench_train: {len(bad)} row(s) not verified", file=sys.stderr)
        sys.exit(2)


def config(args, rows):
    """The run's record, in the shape scripts/readme_tables.py reads for every workload."""
    return {"command": "python python/bench/bench_train.py " + " ".join(sys.argv[1:]),
            "allocator": "glibc malloc", "threads_per_rank": 1, "runs": args.runs or RUNS,
            "all_verified": all(r["verified"] for r in rows),
            "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "libtorch": torch.__version__.split("+")[0],
                        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                        "blas": blas_name(), "date": datetime.datetime.now(datetime.timezone.utc)
                        .strftime("%Y-%m-%dT%H:%M:%SZ"), "load_average": os.getloadavg()[0]}}


def blas_name():
    """LibTorch's BLAS as its build config names it ("MKL 2024.2-Product" for the PyPI wheel)."""
    for line in torch.__config__.show().splitlines():
        if "Math Kernel Library Version" in line:
            return "MKL " + line.split("Version", 1)[1].split()[0]
        if "BLAS_INFO" in line:
            return line.split("=", 1)[1].split(",")[0].strip()
    return "BLAS unknown"


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    main()
