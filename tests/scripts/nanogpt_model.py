"""nanoGPT's GPT-2 in PyTorch (its architecture and parameter names, written out here from its
description), for the fixture scripts: gpt_class(V, T, L, H, C) is a GPT of that vocabulary, block
size, layers, heads and width, whose forward(idx, targets) returns (logits, mean cross-entropy). The
lm_head is tied to wte; the MLP's GELU is the erf form (nanoGPT's)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def gpt_class(V, T, L, H, C):
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
            att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
            return self.c_proj(y)

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(C, 4 * C)
            self.c_proj = nn.Linear(4 * C, C)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(C), Attn(), nn.LayerNorm(C), Mlp()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(V, C), wpe=nn.Embedding(T, C),
                                                  h=nn.ModuleList([Block() for _ in range(L)]), ln_f=nn.LayerNorm(C)))

        def forward(self, idx, targets):
            t = idx.size(1)
            x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t))
            for blk in self.transformer.h:
                x = blk(x)
            logits = F.linear(self.transformer.ln_f(x), self.transformer.wte.weight)  # tied lm_head
            return logits, F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))

    return GPT
