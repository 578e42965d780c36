#!/usr/bin/env python3
"""Writes the io tests' fixture files with PyTorch (what Python users hand treetensor) and
checks files that treetensor wrote (what Python users get back).

  fixtures.py write DIR          writes DIR/<name>.pt|.safetensors and DIR/<name>.expect.json
  fixtures.py check FILE EXPECT  torch.load(FILE) must equal EXPECT (the .expect.json form)
  fixtures.py check-module FILE  a TinyNet's load_state_dict(torch.load(FILE)) must succeed
  fixtures.py check-safetensors FILE EXPECT  a safetensors file, read here by hand, must match
  fixtures.py check-adam FIXTURE FILE  FILE must be adam_named's state (FIXTURE) after one more
                                       step with zero parameters and unit gradients, as PyTorch
                                       takes it, with ids in order
  fixtures.py check-adam-groups FIXTURE PARAMS STATE  PARAMS (a state dict) and STATE (an
                                       optimizer state dict) must be adam_groups' checkpoint
                                       (FIXTURE) after two more torch.optim.Adam steps

The expect form lists every leaf with its key path (a list of keys; list items by index),
Python type and value (tensors: dtype, shape, flat values, requires_grad, Parameter), every
container's type (dicts: with their keys in order), and which dict keys are ints. Run with the venv's Python (scripts/setup.sh:
PyTorch 2.x from PyPI)."""
import collections
import copy
import json
import struct
import sys

import torch


class TinyNet(torch.nn.Module):
    """A conv, a batch norm (buffers and num_batches_tracked) and a linear layer."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3)
        self.bn = torch.nn.BatchNorm2d(3)
        self.fc = torch.nn.Linear(12, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def values_of(t):
    t = t.detach()
    if t.is_complex():
        return [[float(z.real), float(z.imag)] for z in t.reshape(-1).tolist()]
    if t.dtype == torch.bool:
        return [bool(v) for v in t.reshape(-1).tolist()]
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return [float(v) for v in t.double().reshape(-1).tolist()]
    return [int(v) for v in t.reshape(-1).tolist()]


def describe(obj, path, out):
    """Appends obj's leaves and containers under `path` to `out`."""
    if isinstance(obj, torch.Tensor):
        out["leaves"].append({"path": path, "type": "Tensor", "dtype": str(obj.dtype).replace("torch.", ""),
                              "shape": list(obj.shape), "values": values_of(obj),
                              "requires_grad": obj.requires_grad,
                              "parameter": isinstance(obj, torch.nn.Parameter)})
    elif isinstance(obj, dict):
        kind = "OrderedDict" if isinstance(obj, collections.OrderedDict) else "dict"
        out["containers"].append({"path": path, "kind": kind, "keys": [str(k) for k in obj]})
        for k, v in obj.items():
            if isinstance(k, int) and not isinstance(k, bool):
                out["int_keys"].append(path + [str(k)])
            describe(v, path + [str(k)], out)
    elif isinstance(obj, (list, tuple)):
        out["containers"].append({"path": path, "kind": "list" if isinstance(obj, list) else "tuple"})
        for i, v in enumerate(obj):
            describe(v, path + [str(i)], out)
    elif obj is None:
        out["leaves"].append({"path": path, "type": "NoneType"})
    elif isinstance(obj, bool):
        out["leaves"].append({"path": path, "type": "bool", "value": obj})
    elif isinstance(obj, int):
        out["leaves"].append({"path": path, "type": "int", "value": obj})
    elif isinstance(obj, float):
        out["leaves"].append({"path": path, "type": "float", "value": obj})
    elif isinstance(obj, complex):
        out["leaves"].append({"path": path, "type": "complex", "value": [obj.real, obj.imag]})
    elif isinstance(obj, str):
        out["leaves"].append({"path": path, "type": "str", "value": obj})
    elif isinstance(obj, bytes):
        out["leaves"].append({"path": path, "type": "bytes", "value": list(obj)})
    elif isinstance(obj, torch.dtype):
        out["leaves"].append({"path": path, "type": "torch.dtype", "value": str(obj).replace("torch.", "")})
    elif isinstance(obj, torch.device):
        out["leaves"].append({"path": path, "type": "torch.device", "value": str(obj)})
    else:
        raise TypeError(f"fixture value of type {type(obj)} at {path}")


def expectation(obj):
    out = {"leaves": [], "containers": [], "int_keys": []}
    describe(obj, [], out)
    return out


def adam_state(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 2, 4, 4)).sum().backward()
    opt.step()
    return opt.state_dict()


def adam_named():
    torch.manual_seed(2)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(6)])
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01)
    return model, opt


def adam_named_state():
    """Adam over 12 parameters (ids 0..11: their order is not the sorted order of "0".."11"),
    constructed from named_parameters(), so the state dict has param_names (PyTorch >= 2.6)."""
    model, opt = adam_named()
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    return opt.state_dict()


def adam_groups():
    """Adam over a Sequential in two param groups, as fine-tuning sets them: weights with weight
    decay, biases without and with amsgrad (their states hold max_exp_avg_sq)."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])
    named = list(model.named_parameters())
    opt = torch.optim.Adam(
        [{"params": [(n, p) for n, p in named if n.endswith("weight")], "weight_decay": 0.01},
         {"params": [(n, p) for n, p in named if n.endswith("bias")], "lr": 5e-3,
          "amsgrad": True}], lr=1e-2, betas=(0.85, 0.995))
    return model, opt


def adam_groups_state():
    """The model and the optimizer after one step: what a training checkpoint holds."""
    model, opt = adam_groups()
    model(torch.randn(5, 3)).pow(2).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def fixtures():
    torch.manual_seed(0)
    model = TinyNet()
    model.train()
    model(torch.randn(4, 2, 4, 4))  # running stats move, num_batches_tracked = 1
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    dtypes = {str(d).replace("torch.", ""): (torch.randn(2, 3) * 10).to(d)
              for d in (torch.float16, torch.bfloat16, torch.float64, torch.float32, torch.int8,
                        torch.uint8, torch.int16, torch.int32, torch.int64, torch.complex64,
                        torch.complex128)}
    dtypes["bool"] = torch.tensor([True, False, True])
    dtypes["zero_d"] = torch.tensor(3.5)
    dtypes["empty"] = torch.zeros(0, 3)
    module_state = copy.deepcopy(model.state_dict())  # before the checkpoint's Adam step runs it
    checkpoint = {
        "epoch": 7, "step": 123456789012, "negative": -5, "big": 2**40 + 3, "lr": 0.0025,
        "name": "run-1 ü", "blob": b"\x00\x7f\x80\xff", "done": True, "nothing": None,
        "z": 1.5 - 2j, "dtype": torch.float16, "device": torch.device("cpu"),
        "shape": torch.Size([2, 3]),
        "metrics": {"loss": [0.5, 0.25], "acc": (0.75, 0.875), "best": {"at": 3}},
        "model": model.state_dict(), "optimizer": adam_state(model),
    }
    return {
        "module_state": module_state,
        "adam_state": adam_state(TinyNet()),
        "checkpoint": checkpoint,
        "views": {"base": base, "rows": base[1:3], "t": base.t(), "col": base[:, 2]},
        "dtypes": dtypes,
        "params": {"w": torch.nn.Parameter(torch.randn(3)), "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
                   "grad": torch.ones(2, requires_grad=True)},
        "plain_tensor": torch.arange(5),
        "tied": {"encoder.weight": base, "decoder.weight": base, "decoder.bias": torch.ones(2)},
        "adam_named": adam_named_state(),
        "adam_groups": adam_groups_state(),
    }


def write_safetensors(path, tensors, metadata):
    """A safetensors file by the format's text, independent of treetensor's writer."""
    names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL"}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write(directory):
    import os
    os.makedirs(directory, exist_ok=True)
    for name, obj in fixtures().items():
        torch.save(obj, f"{directory}/{name}.pt")
        with open(f"{directory}/{name}.expect.json", "w") as f:
            json.dump(expectation(obj), f)
    legacy = fixtures()["checkpoint"]
    torch.save(legacy, f"{directory}/legacy.pt", _use_new_zipfile_serialization=False)
    with open(f"{directory}/legacy.expect.json", "w") as f:
        json.dump(expectation(legacy), f)
    torch.manual_seed(1)
    tensors = {"encoder.w": torch.randn(3, 4), "encoder.b": torch.arange(3, dtype=torch.int64),
               "decoder.w": torch.randn(2).to(torch.bfloat16), "mask": torch.tensor([True, False]),
               "scalar": torch.tensor(2.5, dtype=torch.float64), "empty": torch.zeros(0, 2, dtype=torch.float16)}
    write_safetensors(f"{directory}/tensors.safetensors", tensors, {"format": "pt", "author": "fixtures.py"})
    with open(f"{directory}/tensors.expect.json", "w") as f:
        json.dump(expectation(tensors), f)


def check(path, expect_path):
    got = expectation(torch.load(path))
    with open(expect_path) as f:
        want = json.load(f)
    for part in ("leaves", "containers", "int_keys"):
        g = sorted(json.dumps(x, sort_keys=True) for x in got[part])
        w = sorted(json.dumps(x, sort_keys=True) for x in want[part])
        if g != w:
            missing = set(w) - set(g)
            extra = set(g) - set(w)
            sys.exit(f"{path}: {part} differ\n  expected, not found: {sorted(missing)[:3]}\n"
                     f"  found, not expected: {sorted(extra)[:3]}")
    print(f"{path}: matches {expect_path}")


def check_module(path):
    model = TinyNet()
    model.load_state_dict(torch.load(path), strict=True)
    print(f"{path}: TinyNet.load_state_dict accepted it")


def check_safetensors(path, expect_path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool}
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = bytearray(data[8 + n + b:8 + n + e])
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        tensors[name] = t.view(dtypes[info["dtype"]]).reshape(info["shape"])
    got = expectation(tensors)
    with open(expect_path) as f:
        want = json.load(f)
    g = sorted(json.dumps(x, sort_keys=True) for x in got["leaves"])
    w = sorted(json.dumps(x, sort_keys=True) for x in want["leaves"])
    if g != w:
        sys.exit(f"{path}: tensors differ from {expect_path}")
    print(f"{path}: matches {expect_path}; metadata {header.get('__metadata__')}")


def check_adam(fixture_path, path):
    model, opt = adam_named()
    opt.load_state_dict(torch.load(fixture_path))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            p.grad = torch.ones_like(p)
    opt.step()
    want = opt.state_dict()
    got = torch.load(path)
    _, fresh = adam_named()
    fresh.load_state_dict(got)  # PyTorch accepts it
    if list(got["state"]) != list(range(12)):
        sys.exit(f"{path}: state ids {list(got['state'])}, 0..11 in order expected")
    for key in ("lr", "betas", "eps", "weight_decay", "params", "param_names"):
        if got["param_groups"][0][key] != want["param_groups"][0][key]:
            sys.exit(f"{path}: param group '{key}' is {got['param_groups'][0][key]}")
    for i in range(12):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["state"][i][key], want["state"][i][key])
    print(f"{path}: PyTorch's next Adam step, ids and names in order")


def check_adam_groups(fixture_path, params_path, state_path):
    """params_path and state_path must be the adam_groups checkpoint after two more steps with
    gradients 1 and 2·param, as torch.optim.Adam takes them (within rounding)."""
    model, opt = adam_groups()
    checkpoint = torch.load(fixture_path)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    for k in range(2):
        for p in model.parameters():
            p.grad = torch.ones_like(p) if k == 0 else 2 * p.detach().clone()
        opt.step()
    got_params, got = torch.load(params_path), torch.load(state_path)
    _, fresh = adam_groups()
    fresh.load_state_dict(got)  # PyTorch accepts it
    want = opt.state_dict()
    if list(got["state"]) != list(want["state"]):
        sys.exit(f"{state_path}: state ids {list(got['state'])}, {list(want['state'])} expected")
    for g, w in zip(got["param_groups"], want["param_groups"]):
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "params", "param_names"):
            if g[key] != w[key]:
                sys.exit(f"{state_path}: param group key '{key}' is {g[key]}, {w[key]} expected")
    for i, s in want["state"].items():
        if set(got["state"][i]) != set(s):
            sys.exit(f"{state_path}: state {i} holds {sorted(got['state'][i])}, {sorted(s)} expected")
        for key, value in s.items():
            torch.testing.assert_close(got["state"][i][key], value, rtol=1e-6, atol=1e-7)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got_params[name], value, rtol=1e-6, atol=1e-7)
    print(f"{state_path}: torch.optim.Adam's two steps over two param groups (amsgrad in one)")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "write":
        write(sys.argv[2])
    elif cmd == "check":
        check(sys.argv[2], sys.argv[3])
    elif cmd == "check-module":
        check_module(sys.argv[2])
    elif cmd == "check-adam":
        check_adam(sys.argv[2], sys.argv[3])
    elif cmd == "check-adam-groups":
        check_adam_groups(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "check-safetensors":
        check_safetensors(sys.argv[2], sys.argv[3])
    elif cmd == "write-legacy-many":  # N one-element tensors, legacy format (many storages)
        many = {f"t{k}": torch.tensor([float(k)]) for k in range(int(sys.argv[2]))}
        torch.save(many, sys.argv[3], _use_new_zipfile_serialization=False)
    else:
        sys.exit(f"unknown command {cmd}")
