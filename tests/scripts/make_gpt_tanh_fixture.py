#!/usr/bin/env python3
"""Writes tests/data/gpt_tanh_reference.safetensors: the logits and loss, in float64, of the GPT of
tests/data/gpt_pytorch.safetensors (its weights, tokens and targets) with GPT-2's own GELU, the tanh
form (Hugging Face's gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))).

Plain Python, float64, no torch and no numpy: the forward is written out here from nanoGPT's
description (pre-LayerNorm blocks, causal attention, a 4x MLP, the head tied to wte). Before writing,
the same code with the erf GELU is checked against PyTorch's own float64 logits in that file (to
1e-12): the reference is PyTorch's GPT but for the GELU. The build and the tests never run this:
    python3 tests/scripts/make_gpt_tanh_fixture.py tests/data/gpt_pytorch.safetensors tests/data/gpt_tanh_reference.safetensors"""
import math
import sys

from safetensors_reader import load_plain as load  # tests/scripts/safetensors_reader.py
from safetensors_writer import save_plain as save  # tests/scripts/safetensors_writer.py


def rows(t):  # (shape [r, c], flat) -> list of rows
    (r, c), flat = t
    return [flat[i * c:(i + 1) * c] for i in range(r)]


def linear(x, w, b):  # x: rows of in, w: [out, in] rows, b: [out]
    return [[sum(a * c for a, c in zip(xi, wo)) + bo for wo, bo in zip(w, b)] for xi in x]


def layer_norm(x, w, b, eps=1e-5):
    out = []
    for xi in x:
        mu = sum(xi) / len(xi)
        var = sum((v - mu) ** 2 for v in xi) / len(xi)
        s = 1.0 / math.sqrt(var + eps)
        out.append([(v - mu) * s * wi + bi for v, wi, bi in zip(xi, w, b)])
    return out


def gelu_erf(v):
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


def gelu_tanh(v):
    return 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def forward(p, tokens, B, T, gelu):
    L = 1 + max(int(k.split(".")[2]) for k in p if k.startswith("transformer.h."))
    V, C = p["transformer.wte.weight"][0]
    H = 2  # the fixture's heads (make_gpt_fixture.py)
    D = C // H
    wte, wpe = rows(p["transformer.wte.weight"]), rows(p["transformer.wpe.weight"])
    vec = lambda name: p[name][1]
    logits = []
    for s in range(B):
        x = [[a + c for a, c in zip(wte[tokens[s * T + t]], wpe[t])] for t in range(T)]
        for i in range(L):
            pre = "transformer.h.%d." % i
            h = layer_norm(x, vec(pre + "ln_1.weight"), vec(pre + "ln_1.bias"))
            qkv = linear(h, rows(p[pre + "attn.c_attn.weight"]), vec(pre + "attn.c_attn.bias"))
            y = [[0.0] * C for _ in range(T)]
            for hd in range(H):
                q = [r[hd * D:(hd + 1) * D] for r in qkv]
                k = [r[C + hd * D:C + (hd + 1) * D] for r in qkv]
                v = [r[2 * C + hd * D:2 * C + (hd + 1) * D] for r in qkv]
                for t in range(T):
                    sc = [sum(a * b for a, b in zip(q[t], k[u])) / math.sqrt(D) for u in range(t + 1)]
                    m = max(sc)
                    e = [math.exp(z - m) for z in sc]
                    z = sum(e)
                    for j in range(D):
                        y[t][hd * D + j] = sum(e[u] / z * v[u][j] for u in range(t + 1))
            a = linear(y, rows(p[pre + "attn.c_proj.weight"]), vec(pre + "attn.c_proj.bias"))
            x = [[xa + ya for xa, ya in zip(xr, ar)] for xr, ar in zip(x, a)]
            h = layer_norm(x, vec(pre + "ln_2.weight"), vec(pre + "ln_2.bias"))
            f = linear(h, rows(p[pre + "mlp.c_fc.weight"]), vec(pre + "mlp.c_fc.bias"))
            f = [[gelu(v) for v in r] for r in f]
            m = linear(f, rows(p[pre + "mlp.c_proj.weight"]), vec(pre + "mlp.c_proj.bias"))
            x = [[xa + ma for xa, ma in zip(xr, mr)] for xr, mr in zip(x, m)]
        h = layer_norm(x, vec("transformer.ln_f.weight"), vec("transformer.ln_f.bias"))
        logits.extend(linear(h, wte, [0.0] * V))
    return logits


def loss_of(logits, targets):
    total = 0.0
    for row, t in zip(logits, targets):
        m = max(row)
        total += m + math.log(sum(math.exp(v - m) for v in row)) - row[t]
    return total / len(targets)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    p = load(src)
    (B, T), tokens = p["tokens"]
    targets = p["targets"][1]
    tokens = [int(v) for v in tokens]
    targets = [int(v) for v in targets]
    pytorch = p["f64.logits"][1]
    erf = [v for r in forward(p, tokens, B, T, gelu_erf) for v in r]
    worst = max(abs(a - b) for a, b in zip(erf, pytorch))
    if worst > 1e-12:
        sys.exit("make_gpt_tanh_fixture: the erf forward differs from PyTorch's by %g: not writing" % worst)
    logits = forward(p, tokens, B, T, gelu_tanh)
    V = len(logits[0])
    flat = [v for r in logits for v in r]
    loss = loss_of(logits, targets)
    save({"tanh.f64.logits": ([B, T, V], flat), "tanh.f64.loss": ([], [loss])}, dst)
    print("wrote", dst, "loss", loss, "(erf forward within %g of PyTorch's)" % worst)


if __name__ == "__main__":
    main()
