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

--device cuda: both sides on the GPU (amp_train --device cuda, bench_mlp --device cuda), PyTorch from
--python (default: this interpreter), written as its users write it: autocast on "cuda", GradScaler
for fp16, and for the GPT F.scaled_dot_product_attention (causal) and AdamW(fused=True). Each PyTorch
step ends with torch.cuda.synchronize(), so that its time is the step's. Defaults on the GPU: the MLP
at 4096 x 512 in fp32, bf16 and fp16 (with the scaler); the GPT at the main job's shape (128 wide,
batch 16, bf16); --gpt2-small: 12 layers, 12 heads, 768 wide, block 1024, batch 8, bf16. Without
--data the GPT trains on generated text (the timing does not depend on it). Stops (exit 2) when
PyTorch has no usable CUDA. --json FILE: every figure, for launch/scripts/gpu_check.sh.

  launch/bench/bench_vs_pytorch.py                          # Debian's PyTorch
  launch/bench/bench_vs_pytorch.py --make-venv --venv .venv-torch
  launch/bench/bench_vs_pytorch.py --sizes 2048x256 --modes fp32 --steps 30
  launch/bench/bench_vs_pytorch.py --model gpt --data build/example/kjv.txt
  launch/bench/bench_vs_pytorch.py --device cuda --amp-train build/cuda/launch/amp_train --bench-mlp build/cuda/launch/bench_mlp
  launch/bench/bench_vs_pytorch.py --device cuda --model gpt --gpt2-small --amp-train build/cuda/launch/amp_train
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
dev, mode = cfg["device"], cfg["mode"]
cuda = dev == "cuda"
w, b, layers = cfg["width"], cfg["batch"], cfg["layers"]
mods = []
for i in range(layers):
    mods.append(torch.nn.Linear(w, w))
    if i + 1 < layers:
        mods.append(torch.nn.ReLU())
model = torch.nn.Sequential(*mods).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
dtype = torch.float16 if mode == "fp16" else torch.bfloat16  # (unused by fp32: autocast is off)
scaler = (torch.amp.GradScaler("cuda") if hasattr(torch.amp, "GradScaler") else torch.cuda.amp.GradScaler()) \
    if mode == "fp16" else None
# A pool of samples produced once, as amp_train's synthetic data is (after its first pass).
pool = 16
xs = torch.randn(pool, b, w).to(dev)
with torch.no_grad():
    ys = torch.relu(xs @ torch.randn(w, w).to(dev) / w ** 0.5)
times = []
for step in range(cfg["steps"]):
    t0 = time.perf_counter()
    x, y = xs[step % pool], ys[step % pool]
    opt.zero_grad(set_to_none=True)
    with torch.autocast(dev, dtype=dtype, enabled=mode != "fp32"):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    if scaler:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    if cuda:
        torch.cuda.synchronize()
    else:
        loss_value = loss.item()  # amp_train reads its loss every step too
    times.append((time.perf_counter() - t0) * 1e3)
loss_value = loss.item()
print(json.dumps({"times": times, "version": torch.__version__, "loss": loss_value,
                  "gpu": torch.cuda.get_device_name() if cuda else ""}))
'''


TORCH_GPT_LOOP = r'''
import json, math, sys, time, torch
import torch.nn as nn, torch.nn.functional as F
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
torch.manual_seed(0)
dev, mode = cfg["device"], cfg["mode"]
cuda = dev == "cuda"
V, T, L, H, C, B = 256, cfg["block"], cfg["layers"], cfg["heads"], cfg["width"], cfg["batch"]
class Attn(nn.Module):
    def __init__(self):
        super().__init__(); self.c_attn = nn.Linear(C, 3 * C); self.c_proj = nn.Linear(C, C)
    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        if cuda or (cfg["sdpa"] and hasattr(F, "scaled_dot_product_attention")):
            # as GPU users write it, and nanoGPT on PyTorch 2 (--sdpa): the fused attention
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = F.softmax(att.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf")), dim=-1)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
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
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.h: x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, V).float(), tgt.view(-1))
model = GPT().to(dev)
decay = [p for p in model.parameters() if p.dim() >= 2]
other = [p for p in model.parameters() if p.dim() < 2]
groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
fused = False
if cuda:  # the fused CUDA AdamW, where this PyTorch has it (2.0 and newer)
    try:
        opt = torch.optim.AdamW(groups, lr=1e-3, fused=True)
        fused = True
    except (TypeError, RuntimeError):
        opt = torch.optim.AdamW(groups, lr=1e-3)
else:
    opt = torch.optim.AdamW(groups, lr=1e-3)
dtype = torch.float16 if mode == "fp16" else torch.bfloat16  # (unused by fp32: autocast is off)
scaler = (torch.amp.GradScaler("cuda") if hasattr(torch.amp, "GradScaler") else torch.cuda.amp.GradScaler()) \
    if mode == "fp16" else None
data = torch.tensor(list(open(cfg["data"], "rb").read()), dtype=torch.int64)
n = len(data) * 9 // 10 - T - 1
data = data.to(dev)
times = []
for step in range(cfg["steps"]):
    t0 = time.perf_counter()
    starts = [((step * B + j) * T) % n for j in range(B)]
    x = torch.stack([data[s:s + T] for s in starts]); y = torch.stack([data[s + 1:s + T + 1] for s in starts])
    opt.zero_grad(set_to_none=True)
    with torch.autocast(dev, dtype=dtype, enabled=mode != "fp32"):
        loss = model(x, y)
    if scaler:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
    else:
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    if cuda:
        torch.cuda.synchronize()
    else:
        loss_value = loss.item()
    times.append((time.perf_counter() - t0) * 1e3)
loss_value = loss.item()
print(json.dumps({"times": times, "version": torch.__version__, "loss": loss_value, "fused_adamw": fused,
                  "gpu": torch.cuda.get_device_name() if cuda else ""}))
'''

GPT_LAYERS, GPT_HEADS, GPT_BLOCK = 4, 4, 64          # the main job's GPT (launch/scripts/run_example.sh)
GPT2_SMALL = {"layers": 12, "heads": 12, "block": 1024, "sizes": "768x8", "modes": "bf16"}
AMP_FLAG = {"fp32": "off", "bf16": "bf16", "fp16": "fp16"}


def run_amp_train(binary, width, batch, layers, mode, steps, threads, data=None, extra=(), device="cpu", gpt=None):
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        common = ["--device", device, "--batch-size", str(batch), "--steps", str(steps), "--threads", str(threads),
                  "--amp", AMP_FLAG[mode], "--log-every", "0", "--metrics", metrics]
        if data:
            cmd = [binary, "--model", "gpt", "--data", data, "--n-layer", str(gpt["layers"]), "--n-head",
                   str(gpt["heads"]), "--n-embd", str(width), "--block-size", str(gpt["block"]), "--optimizer", "adamw",
                   "--lr", "1e-3", "--weight-decay", "0.1", "--clip-grad-norm", "1"] + common
        else:
            cmd = [binary, "--width", str(width), "--layers", str(layers), "--optimizer", "sgd", "--lr", "0.01",
                   "--momentum", "0.9"] + common
        subprocess.run(cmd + list(extra), check=True, stdout=subprocess.DEVNULL)
        with open(metrics) as f:
            recs = [json.loads(line) for line in f]
        return [r["step_ms"] for r in recs if "step" in r and "event" not in r]


def run_torch(python, width, batch, layers, mode, steps, threads, data=None, device="cpu", gpt=None):
    cfg = {"width": width, "batch": batch, "layers": layers, "steps": steps, "threads": threads, "lr": 0.01,
           "momentum": 0.9, "mode": mode, "device": device}
    if data:
        cfg.update({"data": data, "layers": gpt["layers"], "heads": gpt["heads"], "block": gpt["block"],
                    "sdpa": gpt.get("sdpa", False)})
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([python, "-c", TORCH_GPT_LOOP if data else TORCH_LOOP, json.dumps(cfg)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"the PyTorch loop failed ({python}, {mode}, {width}x{batch}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_bench_mlp(binary, width, batch, layers, modes, steps, threads, device="cpu"):
    """bench_mlp's median step_ms per mode, and its scaler% per mode (SGD with momentum 0.9, as here)."""
    out = subprocess.run([binary, "--device", device, "--width", str(width), "--batch", str(batch), "--layers",
                          str(layers), "--modes", ",".join(modes), "--steps", str(steps), "--warmup", "2", "--threads",
                          str(threads), "--momentum", "0.9"],
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


def generated_text(path, size):
    """Deterministic text of `size` bytes: words of a small vocabulary, for timing the GPT alone."""
    import random
    rng = random.Random(0)
    words = ["the", "and", "of", "to", "in", "that", "he", "shall", "unto", "for", "his", "a", "they", "be", "is",
             "him", "not", "them", "it", "with", "all", "thou", "thy", "was", "which", "my", "LORD", "me", "said"]
    with open(path, "w") as f:
        n = 0
        while n < size:
            line = " ".join(rng.choice(words) for _ in range(12)) + ".\n"
            f.write(line)
            n += len(line)


def require_torch_cuda(python):
    """Stops with a clear message (exit 2) unless `python` has PyTorch with a usable CUDA device."""
    probe = ("import sys\ntry:\n    import torch\nexcept ImportError as e:\n    sys.exit(f'no PyTorch: {e}')\n"
             "if not torch.cuda.is_available():\n"
             "    sys.exit(f'PyTorch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable GPU: '\n"
             "             'torch.cuda.is_available() is False')\n"
             "print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())")
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"bench_vs_pytorch: --device cuda: {python}: {(r.stderr.strip() or r.stdout.strip()).splitlines()[-1]}",
              file=sys.stderr)
        sys.exit(2)
    return r.stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--amp-train", help="default: build/release/launch/amp_train (cpu), build/cuda/launch/amp_train (cuda)")
    ap.add_argument("--amp-train-flags", default="",
                    help="more flags for amp_train, e.g. '--bf16-rounded-weight-grads' (PyTorch's rounding)")
    ap.add_argument("--bench-mlp", help="mlp: the model's step alone, for the same configuration (default: beside "
                                        "--amp-train's default)")
    ap.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    ap.add_argument("--data", help="gpt: the text file to train on (launch/scripts/run_example.sh makes build/example/kjv.txt; "
                                   "--device cuda: generated text when left out)")
    ap.add_argument("--sizes", help="WIDTHxBATCH,... (mlp: 2048x256,4096x512, cuda 4096x512; gpt: 128x32,256x32, "
                                    "cuda 128x16)")
    ap.add_argument("--modes", help="fp32,bf16 (cpu); fp32,bf16,fp16 (cuda mlp); bf16 (cuda gpt)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--gpt2-small", action="store_true",
                    help="gpt: GPT-2 small's shape (12 layers, 12 heads, 768 wide, block 1024, batch 8, bf16)")
    ap.add_argument("--block", type=int, help="gpt: the block size (default: 64, the main job's)")
    ap.add_argument("--sdpa", action="store_true",
                    help="gpt on the CPU: PyTorch's attention is F.scaled_dot_product_attention (causal) where it has "
                         "it (2.0 and newer), as nanoGPT's on PyTorch 2; default: nanoGPT's masked_fill and softmax")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of each side, taken in turn, so that a slow spell of this machine falls on both "
                         "(each side's figure: the median of its timed steps over every round; default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--system-python", "--python", dest="python",
                    help="the interpreter with PyTorch (default: /usr/bin/python3, Debian's python3-torch; "
                         "--device cuda: this interpreter)")
    ap.add_argument("--venv", help="a virtual environment with PyTorch from PyPI, compared too")
    ap.add_argument("--make-venv", action="store_true", help="create --venv and pip install torch into it first")
    ap.add_argument("--json", help="write every figure to this file")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.gpt2_small and a.model != "gpt":
        ap.error("--gpt2-small is a shape of --model gpt")
    build = os.path.join(root, "build", "cuda" if cuda else "release", "launch")
    a.amp_train = a.amp_train or os.path.join(build, "amp_train")
    a.bench_mlp = a.bench_mlp or os.path.join(build, "bench_mlp")
    a.python = a.python or (sys.executable if cuda else "/usr/bin/python3")
    gpt = dict(GPT2_SMALL) if a.gpt2_small else {"layers": GPT_LAYERS, "heads": GPT_HEADS, "block": GPT_BLOCK}
    if a.block is not None:
        if a.block < 1 or a.model != "gpt":
            ap.error("--block is a positive block size of --model gpt")
        gpt["block"] = a.block
    gpt["sdpa"] = a.sdpa
    tmp = tempfile.TemporaryDirectory()
    if a.model == "gpt" and not a.data and cuda:
        a.data = os.path.join(tmp.name, "text.txt")
        generated_text(a.data, 4 << 20)
    if a.model == "gpt" and not (a.data and os.path.isfile(a.data)):
        ap.error("--model gpt needs --data FILE, a text file (launch/scripts/run_example.sh makes build/example/kjv.txt)")
    data = a.data if a.model == "gpt" else None
    if a.gpt2_small:
        a.sizes, a.modes = a.sizes or gpt["sizes"], a.modes or gpt["modes"]
    a.sizes = a.sizes or ("128x16" if cuda else "128x32,256x32") if data else a.sizes or (
        "4096x512" if cuda else "2048x256,4096x512")
    a.modes = a.modes or ("bf16" if cuda and data else "fp32,bf16,fp16" if cuda else "fp32,bf16")
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in AMP_FLAG or (m == "fp16" and not cuda)]
    if bad:
        ap.error(f"--modes {','.join(bad)}: fp32 and bf16, and fp16 (with the scaler) on --device cuda")
    if not os.access(a.amp_train, os.X_OK):
        ap.error(f"--amp-train: {a.amp_train} is not an executable (build it: launch/scripts/build.sh "
                 f"{'cuda' if cuda else 'release'})")
    if not data and not os.access(a.bench_mlp, os.X_OK):
        ap.error(f"--bench-mlp: {a.bench_mlp} is not an executable (build it: launch/scripts/build.sh "
                 f"{'cuda' if cuda else 'release'})")
    peers = []
    versions = {}
    gpu_name = ""
    if cuda:
        if a.venv or a.make_venv:
            ap.error("--venv: on --device cuda PyTorch comes from --python (the node's own)")
        info = require_torch_cuda(a.python)
        gpu_name = info.split(" ", 2)[-1]
        print(f"GPU: {gpu_name}; PyTorch {info.split()[0]} (CUDA {info.split()[1]}) from {a.python}")
        peers.append(("cuda", a.python))
    else:
        if a.make_venv:
            if not a.venv:
                ap.error("--make-venv needs --venv DIR")
            subprocess.run([sys.executable, "-m", "venv", a.venv], check=True)
            subprocess.run([os.path.join(a.venv, "bin/pip"), "install", "-q", "torch"], check=True)
        if subprocess.run([a.python, "-c", "import torch"], capture_output=True).returncode == 0:
            peers.append(("debian", a.python))
        else:
            print(f"note: {a.python} has no torch (apt-get install python3-torch)", file=sys.stderr)
        if a.venv:
            peers.append(("pypi", os.path.join(a.venv, "bin/python")))
        if not peers:
            sys.exit("no PyTorch to compare with: install python3-torch, or pass --venv (with --make-venv)")

    block = gpt["block"]
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    print(f"{'size':>10} {'mode':>5} {'amp_train ms':>13} " + " ".join(f"{'torch ' + n + ' ms':>17}" for n, _ in peers) +
          f" {'ratio':>6} {'per round':>16}" + (f" {'amp_train tok/s':>16} {'torch tok/s':>12}" if data else
                                               f" {'bench_mlp ms':>13} {'÷ bench_mlp':>11}"))
    scaler_shares = []
    rows = []
    for width, batch in sizes:
        # Each round runs every side once, in turn; a side's figure pools its timed steps over the rounds.
        ours = {m: [] for m in modes}
        theirs = {m: {n: [] for n, _ in peers} for m in modes}
        bench_ms = {m: [] for m in modes}
        shares = []
        for _ in range(a.rounds):
            if not data:
                bench = run_bench_mlp(a.bench_mlp, width, batch, a.layers, list(dict.fromkeys(modes + ["fp16"])),
                                      max(3, a.steps - a.warmup), a.threads, a.device)
                for m in modes:
                    bench_ms[m].append(bench[0][m])
                shares.append(bench[1]["fp16"])
            for mode in modes:
                ours[mode].append(run_amp_train(a.amp_train, width, batch, a.layers, mode, a.steps, a.threads,
                                                data, shlex.split(a.amp_train_flags), a.device, gpt)[a.warmup:])
                for name, python in peers:
                    res = run_torch(python, width, batch, a.layers, mode, a.steps, a.threads, data, a.device, gpt)
                    versions[name] = res["version"] + (", fused AdamW" if res.get("fused_adamw") else "")
                    theirs[mode][name].append(res["times"][a.warmup:])
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
            row = {"model": a.model + ("_gpt2_small" if a.gpt2_small else ""), "size": f"{width}x{batch}", "mode": mode,
                   "amp_train_ms": mine, "torch_ms": dict(zip([n for n, _ in peers], peer_ms)), "ratio": mine / best,
                   "ratio_per_round": per_round}
            if data:
                row.update({"layers": gpt["layers"], "heads": gpt["heads"], "block": block,
                            "amp_train_tokens_per_s": batch * block / mine * 1e3,
                            "torch_tokens_per_s": batch * block / best * 1e3})
                extra = f" {batch * block / mine * 1e3:>16.0f} {batch * block / best * 1e3:>12.0f}"
            else:
                bm = statistics.median(bench_ms[mode])
                row.update({"layers": a.layers, "bench_mlp_ms": bm, "amp_train_over_bench_mlp": mine / bm,
                            "amp_train_samples_per_s": batch / mine * 1e3, "torch_samples_per_s": batch / best * 1e3})
                extra = f" {bm:>13.1f} {mine / bm:>11.2f}"
            rows.append(row)
            print(f"{width:>5}x{batch:<4} {mode:>5} {mine:>13.1f} " + " ".join(f"{t:>17.1f}" for t in peer_ms) +
                  f" {mine / best:>6.2f} {rounds:>16}" + extra, flush=True)
    print(f"ratio: amp_train's median step over the faster PyTorch's, each the median of its timed steps over "
          f"{a.rounds} round(s) (per round: that round's own ratio); PyTorch " +
          ", ".join(f"{n} {v}" for n, v in versions.items()))
    if scaler_shares:
        print("the scaler's share of bench_mlp's fp16 step (scale, inf/NaN check, update): " + ", ".join(scaler_shares))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "gpu": gpu_name, "pytorch": versions, "steps": a.steps, "warmup": a.warmup,
                       "rounds": a.rounds, "rows": rows, "scaler_share_fp16": scaler_shares}, f, indent=1)


if __name__ == "__main__":
    main()
