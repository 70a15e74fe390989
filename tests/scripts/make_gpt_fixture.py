#!/usr/bin/env python3
"""Writes tests/data/gpt_pytorch.safetensors: a small GPT-2 (nanoGPT's architecture and names:
nanogpt_model.py) in PyTorch, its initial weights, a batch of byte tokens, and its
logits, loss and gradients in float64 and float32, plus AdamW steps with nanoGPT's parameter groups.
Run it with a Python that has torch (Debian's python3-torch 1.13). The build and the tests never run
this; they read the file it wrote:  python3 tests/scripts/make_gpt_fixture.py tests/data/gpt_pytorch.safetensors"""
import math
import sys

import torch
from nanogpt_model import gpt_class  # tests/scripts/nanogpt_model.py
from safetensors_writer import save  # tests/scripts/safetensors_writer.py

V, T, L, H, C = 256, 8, 2, 2, 16  # vocab, block size, layers, heads, embedding
B = 3


GPT = gpt_class(V, T, L, H, C)


torch.manual_seed(0)
model = GPT()
with torch.no_grad():  # nanoGPT's init, and LayerNorms moved off ones/zeros so that they matter
    for n, p in model.named_parameters():
        if ".ln_" in n:
            p.copy_((1.0 if n.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
        elif n.endswith("bias"):
            p.normal_(0.0, 0.02)
        else:
            p.normal_(0.0, 0.02 / math.sqrt(2 * L) if n.endswith("c_proj.weight") else 0.02)
text = b"In the beginning God created the heaven and the earth. And the earth was"
data = torch.tensor(list(text), dtype=torch.int64)
idx = torch.stack([data[i * 7:i * 7 + T] for i in range(B)])
tgt = torch.stack([data[i * 7 + 1:i * 7 + T + 1] for i in range(B)])

out = {"tokens": idx, "targets": tgt}
for n, p in model.named_parameters():
    out[n] = p.detach().clone()
for dtype, tag in ((torch.float64, "f64"), (torch.float32, "f32")):
    m = GPT()
    m.load_state_dict(model.state_dict())
    m = m.to(dtype)
    logits, loss = m(idx, tgt)
    loss.backward()
    out[tag + ".logits"], out[tag + ".loss"] = logits.detach(), loss.detach()
    for n, p in m.named_parameters():
        out[tag + ".grad." + n] = p.grad.detach().clone()

# AdamW (lr 1e-2, betas 0.9/0.95, weight decay 0.1 on tensors of 2+ dims, none on the others), 3 steps.
m = GPT()
m.load_state_dict(model.state_dict())
decay = [p for p in m.parameters() if p.dim() >= 2]
other = [p for p in m.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                        lr=1e-2, betas=(0.9, 0.95))
for _ in range(3):
    opt.zero_grad()
    m(idx, tgt)[1].backward()
    opt.step()
for n, p in m.named_parameters():
    out["adamw.after3." + n] = p.detach().clone()

save(out, sys.argv[1])
print("wrote", sys.argv[1], "loss f64", out["f64.loss"].item())
