#!/usr/bin/env python3
"""Writes tests/data/gpt_vocab50257_pytorch.safetensors: a 2-layer GPT (nanoGPT's architecture, as in
nanogpt_model.py) with GPT-2's vocabulary of 50257 tokens, trained in float32 by PyTorch for 5
AdamW steps (nanoGPT's groups: weight decay 0.1 on tensors of 2+ dims) on 5 batches of random token
ids, with clipping at 1.0 as nanoGPT's loop does. The file holds the batches and each step's loss and
gradient norm (before clipping); the initial weights are not stored but given by a formula the test
computes too (init_value below): element i of parameter q (in named_parameters order) is
0.02 sin(0.37 i + 1.3 q), LayerNorm weights 1 plus that. Run it with a Python that has torch; the
build and the tests never run this:  python3 tests/scripts/make_gpt2_vocab_fixture.py OUT"""
import sys

import torch
from nanogpt_model import gpt_class  # tests/scripts/nanogpt_model.py
from safetensors_writer import save  # tests/scripts/safetensors_writer.py

V, T, L, H, C = 50257, 8, 2, 2, 16  # vocab, block size, layers, heads, embedding
B, STEPS = 2, 5


GPT = gpt_class(V, T, L, H, C)


def init_value(q, n, is_ln_weight):
    """Parameter q's n elements, computed in float64 and rounded to float32."""
    i = torch.arange(n, dtype=torch.float64)
    v = 0.02 * torch.sin(0.37 * i + 1.3 * q)
    return (v + 1.0 if is_ln_weight else v).to(torch.float32)


torch.manual_seed(0)
model = GPT()
with torch.no_grad():
    for q, (n, p) in enumerate(model.named_parameters()):
        p.copy_(init_value(q, p.numel(), ".ln_" in n and n.endswith("weight")).view(p.shape))
tokens = torch.randint(0, V, (STEPS, B, T + 1), dtype=torch.int64)
decay = [p for p in model.parameters() if p.dim() >= 2]
other = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                        lr=1e-2, betas=(0.9, 0.95), foreach=False)
losses, norms = [], []
for s in range(STEPS):
    opt.zero_grad()
    loss = model(tokens[s, :, :T], tokens[s, :, 1:])[1]
    loss.backward()
    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
    opt.step()
    losses.append(loss.item())
out = {"tokens": tokens, "losses": torch.tensor(losses, dtype=torch.float64),
       "grad_norms": torch.tensor(norms, dtype=torch.float64)}
save(out, sys.argv[1])
print("wrote", sys.argv[1], "losses", losses, "norms", norms)
