#!/usr/bin/env python3
"""amp_train beside PyTorch: the same model, batch, optimizer, threads and steps, timed the same way.

Runs `amp_train` (its per-step `step_ms` from --metrics) and the equivalent PyTorch loop on the CPU,
for fp32 and bf16 autocast, and prints each median step and amp_train's ratio to the faster PyTorch.
Each side runs --rounds times, the sides taking turns, and its figure is the median of its timed
steps over every round, so that a slow spell of a shared machine falls on both sides alike.
--model mlp (default): the MLP at 2048 x 256 and 4096 x 512 (WIDTHxBATCH), SGD with momentum; also
bench_mlp's step for the same configuration (the model's step alone) with amp_train's ratio to it,
and the scaler's share of bench_mlp's fp16 step.
--model gpt: the main job's GPT (nanoGPT's GPT-2 on bytes; --sizes are N_EMBDxBATCH, 4 layers,
4 heads, block 64) on a text file, AdamW with nanoGPT's weight-decay groups; tokens/s too. PyTorch comes from Debian's python3-torch
(/usr/bin/python3) and, with --venv, from the newest wheel on PyPI in a virtual environment that
--make-venv creates (a large download: the wheel pulls CUDA libraries, about 3.5 GB; only the CPU
is used). Python is needed by this script only, never by the build or the tests.

  launch/bench_vs_pytorch.py                          # Debian's PyTorch
  launch/bench_vs_pytorch.py --make-venv --venv .venv-torch
  launch/bench_vs_pytorch.py --sizes 2048x256 --modes fp32 --steps 30
  launch/bench_vs_pytorch.py --model gpt --data build/example/kjv.txt
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

TORCH_LOOP = r'''
import json, sys, time, torch
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
torch.manual_seed(0)
w, b, layers = cfg["width"], cfg["batch"], cfg["layers"]
mods = []
for i in range(layers):
    mods.append(torch.nn.Linear(w, w))
    if i + 1 < layers:
        mods.append(torch.nn.ReLU())
model = torch.nn.Sequential(*mods)
opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
# A pool of samples produced once, as amp_train's synthetic data is (after its first pass).
pool = 16
xs = torch.randn(pool, b, w)
with torch.no_grad():
    ys = torch.relu(xs @ torch.randn(w, w) / w ** 0.5)
times = []
for step in range(cfg["steps"]):
    t0 = time.perf_counter()
    x, y = xs[step % pool], ys[step % pool]
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg["bf16"]):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    loss_value = loss.item()  # amp_train reads its loss every step too
    times.append((time.perf_counter() - t0) * 1e3)
print(json.dumps({"times": times, "version": torch.__version__, "loss": loss_value}))
'''


TORCH_GPT_LOOP = r'''
import json, math, sys, time, torch
import torch.nn as nn, torch.nn.functional as F
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
torch.manual_seed(0)
V, T, L, H, C, B = 256, cfg["block"], cfg["layers"], cfg["heads"], cfg["width"], cfg["batch"]
class Attn(nn.Module):
    def __init__(self):
        super().__init__(); self.c_attn = nn.Linear(C, 3 * C); self.c_proj = nn.Linear(C, C)
    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(C), Attn(), nn.LayerNorm(C)
        self.c_fc, self.c_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))
class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList([Block() for _ in range(L)]); self.ln_f = nn.LayerNorm(C)
    def forward(self, idx, tgt):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for b in self.h: x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, V).float(), tgt.view(-1))
model = GPT()
decay = [p for p in model.parameters() if p.dim() >= 2]
other = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=1e-3)
data = torch.tensor(list(open(cfg["data"], "rb").read()), dtype=torch.int64)
n = len(data) * 9 // 10 - T - 1
times = []
for step in range(cfg["steps"]):
    t0 = time.perf_counter()
    starts = [((step * B + j) * T) % n for j in range(B)]
    x = torch.stack([data[s:s + T] for s in starts]); y = torch.stack([data[s + 1:s + T + 1] for s in starts])
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg["bf16"]):
        loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    loss_value = loss.item()
    times.append((time.perf_counter() - t0) * 1e3)
print(json.dumps({"times": times, "version": torch.__version__, "loss": loss_value}))
'''

GPT_LAYERS, GPT_HEADS, GPT_BLOCK = 4, 4, 64


def run_amp_train(binary, width, batch, layers, mode, steps, threads, data=None, extra=()):
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        common = ["--device", "cpu", "--batch-size", str(batch), "--steps", str(steps), "--threads", str(threads),
                  "--amp", "off" if mode == "fp32" else "bf16", "--log-every", "0", "--metrics", metrics]
        if data:
            cmd = [binary, "--model", "gpt", "--data", data, "--n-layer", str(GPT_LAYERS), "--n-head", str(GPT_HEADS),
                   "--n-embd", str(width), "--block-size", str(GPT_BLOCK), "--optimizer", "adamw", "--lr", "1e-3",
                   "--weight-decay", "0.1", "--clip-grad-norm", "1"] + common
        else:
            cmd = [binary, "--width", str(width), "--layers", str(layers), "--optimizer", "sgd", "--lr", "0.01",
                   "--momentum", "0.9"] + common
        subprocess.run(cmd + list(extra), check=True, stdout=subprocess.DEVNULL)
        with open(metrics) as f:
            recs = [json.loads(line) for line in f]
        return [r["step_ms"] for r in recs if "step" in r and "event" not in r]


def run_torch(python, width, batch, layers, mode, steps, threads, data=None):
    cfg = {"width": width, "batch": batch, "layers": layers, "steps": steps, "threads": threads, "lr": 0.01,
           "momentum": 0.9, "bf16": mode == "bf16"}
    if data:
        cfg.update({"data": data, "layers": GPT_LAYERS, "heads": GPT_HEADS, "block": GPT_BLOCK})
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([python, "-c", TORCH_GPT_LOOP if data else TORCH_LOOP, json.dumps(cfg)], check=True,
                         capture_output=True, text=True, env=env)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["times"], res["version"]


def run_bench_mlp(binary, width, batch, layers, modes, steps, threads):
    """bench_mlp's median step_ms per mode, and its scaler% per mode (SGD with momentum 0.9, as here)."""
    out = subprocess.run([binary, "--width", str(width), "--batch", str(batch), "--layers", str(layers), "--modes",
                          ",".join(modes), "--steps", str(steps), "--warmup", "2", "--threads", str(threads),
                          "--momentum", "0.9"],
                         check=True, capture_output=True, text=True).stdout
    step, scaler = {}, {}
    for line in out.splitlines():
        f = line.split()
        if f and f[0] in modes and len(f) >= 8:
            step[f[0]], scaler[f[0]] = float(f[1]), float(f[7].rstrip("%"))
    missing = [m for m in modes if m not in step]
    if missing:
        sys.exit(f"bench_mlp printed no step for {missing}:\n{out}")
    return step, scaler


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--amp-train", default=os.path.join(root, "build/release/launch/amp_train"))
    ap.add_argument("--amp-train-flags", default="",
                    help="more flags for amp_train, e.g. '--bf16-rounded-weight-grads' (PyTorch's rounding)")
    ap.add_argument("--bench-mlp", default=os.path.join(root, "build/release/launch/bench_mlp"),
                    help="mlp: the model's step alone, for the same configuration")
    ap.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    ap.add_argument("--data", help="gpt: the text file to train on (launch/run_example.sh makes build/example/kjv.txt)")
    ap.add_argument("--sizes", help="WIDTHxBATCH,... (mlp: 2048x256,4096x512; gpt: 128x32,256x32)")
    ap.add_argument("--modes", default="fp32,bf16")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of each side, taken in turn, so that a slow spell of this machine falls on both "
                         "(each side's figure: the median of its timed steps over every round; default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--system-python", default="/usr/bin/python3", help="the interpreter with Debian's python3-torch")
    ap.add_argument("--venv", help="a virtual environment with PyTorch from PyPI, compared too")
    ap.add_argument("--make-venv", action="store_true", help="create --venv and pip install torch into it first")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.model == "gpt" and not (a.data and os.path.isfile(a.data)):
        ap.error("--model gpt needs --data FILE, a text file (launch/run_example.sh makes build/example/kjv.txt)")
    data = a.data if a.model == "gpt" else None
    a.sizes = a.sizes or ("128x32,256x32" if data else "2048x256,4096x512")
    if not os.access(a.amp_train, os.X_OK):
        ap.error(f"--amp-train: {a.amp_train} is not an executable (build it: launch/build.sh release)")
    if not data and not os.access(a.bench_mlp, os.X_OK):
        ap.error(f"--bench-mlp: {a.bench_mlp} is not an executable (build it: launch/build.sh release)")
    if a.make_venv:
        if not a.venv:
            ap.error("--make-venv needs --venv DIR")
        subprocess.run([sys.executable, "-m", "venv", a.venv], check=True)
        subprocess.run([os.path.join(a.venv, "bin/pip"), "install", "-q", "torch"], check=True)
    peers = []
    versions = {}
    if subprocess.run([a.system_python, "-c", "import torch"], capture_output=True).returncode == 0:
        peers.append(("debian", a.system_python))
    else:
        print(f"note: {a.system_python} has no torch (apt-get install python3-torch)", file=sys.stderr)
    if a.venv:
        peers.append(("pypi", os.path.join(a.venv, "bin/python")))
    if not peers:
        sys.exit("no PyTorch to compare with: install python3-torch, or pass --venv (with --make-venv)")

    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    modes = a.modes.split(",")
    print(f"{'size':>10} {'mode':>5} {'amp_train ms':>13} " + " ".join(f"{'torch ' + n + ' ms':>17}" for n, _ in peers) +
          f" {'ratio':>6} {'per round':>16}" + (f" {'amp_train tok/s':>16} {'torch tok/s':>12}" if data else
                                               f" {'bench_mlp ms':>13} {'÷ bench_mlp':>11}"))
    scaler_shares = []
    for width, batch in sizes:
        # Each round runs every side once, in turn; a side's figure pools its timed steps over the rounds.
        ours = {m: [] for m in modes}
        theirs = {m: {n: [] for n, _ in peers} for m in modes}
        bench_ms = {m: [] for m in modes}
        shares = []
        for _ in range(a.rounds):
            if not data:
                bench = run_bench_mlp(a.bench_mlp, width, batch, a.layers, modes + ["fp16"],
                                      max(3, a.steps - a.warmup), a.threads)
                for m in modes:
                    bench_ms[m].append(bench[0][m])
                shares.append(bench[1]["fp16"])
            for mode in modes:
                ours[mode].append(run_amp_train(a.amp_train, width, batch, a.layers, mode, a.steps, a.threads,
                                                data, shlex.split(a.amp_train_flags))[a.warmup:])
                for name, python in peers:
                    times, version = run_torch(python, width, batch, a.layers, mode, a.steps, a.threads, data)
                    versions[name] = version
                    theirs[mode][name].append(times[a.warmup:])
        if shares:
            scaler_shares.append(f"{width}x{batch} {statistics.median(shares):.2f} %")
        for mode in modes:
            pooled = lambda runs: statistics.median([t for run in runs for t in run])
            mine = pooled(ours[mode])
            peer_ms = [pooled(theirs[mode][n]) for n, _ in peers]
            best = min(peer_ms)
            per_round = [statistics.median(ours[mode][r]) /
                         min(statistics.median(theirs[mode][n][r]) for n, _ in peers) for r in range(a.rounds)]
            rounds = ",".join(f"{x:.2f}" for x in per_round)
            extra = (f" {batch * GPT_BLOCK / mine * 1e3:>16.0f} {batch * GPT_BLOCK / best * 1e3:>12.0f}" if data else
                     f" {statistics.median(bench_ms[mode]):>13.1f} {mine / statistics.median(bench_ms[mode]):>11.2f}")
            print(f"{width:>5}x{batch:<4} {mode:>5} {mine:>13.1f} " + " ".join(f"{t:>17.1f}" for t in peer_ms) +
                  f" {mine / best:>6.2f} {rounds:>16}" + extra, flush=True)
    print(f"ratio: amp_train's median step over the faster PyTorch's, each the median of its timed steps over "
          f"{a.rounds} round(s) (per round: that round's own ratio); PyTorch " +
          ", ".join(f"{n} {v}" for n, v in versions.items()))
    if scaler_shares:
        print("the scaler's share of bench_mlp's fp16 step (scale, inf/NaN check, update): " + ", ".join(scaler_shares))


if __name__ == "__main__":
    main()
