"""Data-parallel training on treetensor's pieces: copy this, put in your model and your data.

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --epochs 2
    python examples/train_ddp.py                 # one process: the same code, no reduction

What replaces what (DESIGN.md §21):
  DistributedDataParallel(model, gradient_as_bucket_view=True)
      -> tree = treetensor.nn.consolidate_module(model, process_group=WORLD): parameters and
         gradients live in one buffer per dtype/device; gradient buckets are averaged across
         ranks while backward runs, as DDP's are
  torch.optim.AdamW(model.parameters(), fused=True)
      -> treetensor.optim.AdamW(tree.params): one single-pass kernel per buffer
  optimizer.zero_grad()
      -> tree.zero_grad(): one fill per buffer (the gradients stay where they are)
  metrics computed inline
      -> on an asyncs thread, beside the optimizer step
Checkpoints are the model's state_dict, written with treetensor.torch.save (torch.load reads
them) and loaded back with load_state_dict.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import treetensor.asyncs as asyncs
import treetensor.nn as tnn
import treetensor.optim as topt
import treetensor.torch as ttorch


def make_model():  # your model
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def make_data():  # your data: 1024 samples of a fixed random linear map, so the loss falls
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    return TensorDataset(x, x @ torch.randn(16, 4, generator=g))


def write_metrics(out, step, loss, grads):
    norms = torch.stack(torch._foreach_norm(grads))
    out.write(json.dumps({"step": step, "loss": float(loss),
                          "grad_norm": float(torch.linalg.vector_norm(norms))}) + "\n")
    out.flush()


def main():
    ap = argparse.ArgumentParser(description="Data-parallel training on treetensor's pieces "
                                 "(run under torchrun for several ranks; see the module docstring).")
    ap.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    ap.add_argument("--out", default="train_ddp_out",
                    help="folder for the metrics (JSON lines) and the checkpoint (default train_ddp_out)")
    args = ap.parse_args()
    distributed = "WORLD_SIZE" in os.environ  # launched by torchrun
    if distributed:
        dist.init_process_group("gloo")  # "nccl" on GPUs
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    model = make_model()  # move it first (model.to(device)): consolidation keeps it where it is
    tree = tnn.consolidate_module(model, process_group=dist.group.WORLD if distributed else None)
    opt = topt.AdamW(tree.params, lr=3e-3)
    grads = [p.grad for p in model.parameters()]  # views of tree.grad_buffers
    data = make_data()
    sampler = DistributedSampler(data) if distributed else None
    loader = DataLoader(data, batch_size=32, sampler=sampler, shuffle=sampler is None)
    os.makedirs(args.out, exist_ok=True)
    metrics_file = open(os.path.join(args.out, f"metrics.rank{rank}.jsonl"), "w")
    metrics = asyncs.Thread("metrics")
    pending, step = None, 0
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            if pending is not None:
                pending.result()  # the previous step's metrics have read its gradients
            tree.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # on torchrun: averaged across ranks when it returns
            pending = metrics.submit(write_metrics, metrics_file, step, loss.detach(), grads)
            opt.step(tree.grads)
            step += 1
        if rank == 0:
            ttorch.save(tree.state_dict(), os.path.join(args.out, "model.pt"))
            print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)
    if pending is not None:
        pending.result()
    metrics.close()
    metrics_file.close()
    if distributed:
        tree.close()  # before destroy_process_group, while the tree is alive (ModuleTree.close)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
