#!/usr/bin/env python3
"""Writes tests/data/optim_pytorch.safetensors: learning-rate sequences of torch.optim.lr_scheduler
and parameter-group optimizer steps, computed by PyTorch. Run it with a Python that has torch
(Debian's python3-torch 1.13: its schedulers' formulas are 2.x's; its Adam updates the first moment
with mul_/add_ where 2.x uses lerp_, a last-bit difference that the tests' tolerance covers).
The build and the tests never run this; they read the file it wrote."""
import sys
import torch
from safetensors_writer import save  # noqa: E402  (tests/scripts/safetensors_writer.py)

out = {}


def sched_case(name, make, lrs=(0.1,), steps=20):
    params = [torch.zeros(1, requires_grad=True) for _ in lrs]
    opt = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)], lr=lrs[0])
    sched = make(opt)
    seq = [sched.get_last_lr()]
    for _ in range(steps):
        opt.step()
        sched.step()
        seq.append(sched.get_last_lr())
    out["sched." + name] = torch.tensor(seq, dtype=torch.float64)


L = torch.optim.lr_scheduler
sched_case("lambda", lambda o: L.LambdaLR(o, lambda e: 0.95 ** e), lrs=(0.1, 0.01))
sched_case("step", lambda o: L.StepLR(o, step_size=3, gamma=0.5))
sched_case("linear", lambda o: L.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=6), steps=12)
sched_case("cosine", lambda o: L.CosineAnnealingLR(o, T_max=10, eta_min=0.001), steps=30)
sched_case("warmup_cosine", lambda o: L.SequentialLR(
    o, [L.LinearLR(o, start_factor=0.2, total_iters=4), L.CosineAnnealingLR(o, T_max=16, eta_min=1e-4)],
    milestones=[4]), lrs=(0.1, 0.05), steps=25)
sched_case("warmup_cosine_floor", lambda o: L.SequentialLR(
    o, [L.LinearLR(o, start_factor=0.25, total_iters=3), L.CosineAnnealingLR(o, T_max=7, eta_min=1e-3),
        L.LambdaLR(o, lambda e: 1e-3 / 0.1)], milestones=[3, 10]), steps=15)

# Parameter groups: the MLP of mlp_pytorch.safetensors, weights and biases in separate groups.
sys.path.insert(0, ".")
from safetensors_reader import load  # noqa: E402
ref = load(sys.argv[1])
x, y = ref["x"], ref["y"]


def mlp():
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                            torch.nn.Linear(16, 16))
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(ref[n])
    return m


def groups_case(name, make, steps=3):
    m = mlp()
    ws = [p for n, p in m.named_parameters() if n.endswith("weight")]
    bs = [p for n, p in m.named_parameters() if n.endswith("bias")]
    opt = make(ws, bs)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    for n, p in m.named_parameters():
        out[f"groups.{name}.{n}"] = p.detach().clone()


groups_case("adamw", lambda ws, bs: torch.optim.AdamW(
    [{"params": ws, "weight_decay": 0.1}, {"params": bs, "weight_decay": 0.0, "lr": 0.02}], lr=0.01))
groups_case("sgd", lambda ws, bs: torch.optim.SGD(
    [{"params": ws, "momentum": 0.9}, {"params": bs, "lr": 0.05, "maximize": True}], lr=0.1))
groups_case("adam_maximize", lambda ws, bs: torch.optim.Adam(
    [{"params": ws}, {"params": bs, "amsgrad": True}], lr=0.01, maximize=True))
save(out, "optim_pytorch.safetensors")
print("wrote optim_pytorch.safetensors:", len(out), "tensors with torch", torch.__version__)
