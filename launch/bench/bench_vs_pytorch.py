#!/usr/bin/env python3
"""amp_train beside PyTorch: the same model, batch, optimizer, threads and steps.

Runs `amp_train` (its per-step `step_ms` from --metrics) and the equivalent PyTorch loop on the CPU,
for fp32 and bf16 autocast, and prints each median step and amp_train's ratio to the faster PyTorch.
Each side runs --rounds times, the sides taking turns, so that a slow spell of a shared machine falls
on both sides alike.
--model mlp (default): the MLP at 2048 x 256 and 4096 x 512 (WIDTHxBATCH), SGD with momentum; also
bench_mlp's step for the same configuration (the model's step alone) with amp_train's ratio to it,
and the scaler's share of bench_mlp's fp16 step.
--model gpt: the main job's GPT (nanoGPT's GPT-2 on bytes; --sizes are N_EMBDxBATCH, 4 layers,
4 heads, block 64) on a text file, AdamW with nanoGPT's weight-decay groups; tokens/s too. --data may
be an llm.c token shard instead (then the vocabulary is GPT-2's 50257). PyTorch comes from Debian's
python3-torch (/usr/bin/python3) and, with --venv, from the newest wheel on PyPI in a virtual environment that
--make-venv creates (a large download: the wheel pulls CUDA libraries, about 3.5 GB; only the CPU
is used). Python is needed by this script only, never by the build or the tests.

How each side is timed (the first --warmup steps of every run are left out on both sides):
  amp_train: the step_ms of each timed step in its --metrics, the wall time from one step's start to
    the next one's (on CUDA the device may run ahead of the host; the step's figures are read back in
    the background); its figure is the median of those steps over every round.
  PyTorch on the CPU: each timed step between two time.perf_counter() calls, its loss read (.item())
    as amp_train reads its own; its figure is the median of those steps over every round.
  PyTorch on CUDA: the warmup steps, torch.cuda.synchronize(), a CUDA event, the timed steps back to
    back as its users run them (no .item(), no synchronize: nothing waits for the GPU but what PyTorch
    does itself, as the GradScaler's inf check in scaler.step), an end event, one synchronize; a round's
    figure is the events' elapsed time / the timed steps, and the side's the median of its rounds'.
    Its peak memory too: torch.cuda.max_memory_allocated() and max_memory_reserved() (MiB in the
    table, bytes in the JSON).
Device memory, the same measure on both sides (--device cuda): what the driver counts for the process
beyond its CUDA context (cudaMemGetInfo): PyTorch's free bytes at its first CUDA call (which makes the
context) less its free bytes after the timed steps, its caching allocator keeping what it was given
(so a lower bound of its peak, should it have emptied its cache: it does so only to retry an
allocation that failed); amp_train's own figure (its metrics' end record, device_memory_bytes), taken
the same way and also at each segment its allocator takes, over the training steps. So each includes the allocator's cache, cuBLAS's and cuDNN's workspaces
and the kernels loaded; "dev MiB" in the table (the most over the rounds), and "÷ dev", amp_train's
over the smaller of the eager peers'.

--compile: PyTorch's loop again with model = torch.compile(model) (the default mode), its own column
beside eager's, with amp_train's ratio to it (÷ compile: ours / compile). It compiles in the warmup
steps, so --warmup is raised to 3 at least. Where torch.compile fails (no C compiler, no Triton, ...)
that column says so, with the message, and the rest of the benchmark goes on.

--budget SECONDS: the whole benchmark's time (default: none; under launch/scripts/gpu_check.sh, its
stage's limit less 20 s, read from GPU_CHECK_STAGE_LIMIT). A round starts only where the rounds so far
say it ends in time, each run is stopped at the budget's end (its processes killed), and the figures
are those of the rounds that finished: fewer rounds, not none. torch.compile's run stopped so, before
its column has a figure, is that column's failure ("did not finish within --budget"); any other run
stopped so leaves its round out. Each run's
figure is printed as it comes (a "round" line), so a benchmark killed from outside leaves them too;
SIGTERM or SIGINT stops the run under way with it.

--device cuda: both sides on the GPU (amp_train --device cuda, bench_mlp --device cuda), PyTorch from
--python (default: this interpreter), written as its users write it: autocast on "cuda", GradScaler
for fp16, and for the GPT F.scaled_dot_product_attention (causal) and AdamW(fused=True). Defaults on
the GPU: the MLP at 4096 x 512 in fp32, bf16 and fp16 (with the scaler); the GPT at the main job's
shape (128 wide, batch 16, bf16); --gpt2-small: 12 layers, 12 heads, 768 wide, block 1024, batch 8,
bf16, on bytes; --gpt2-medium: 24 layers, 16 heads, 1024 wide, the same block, batch and dtype, on
bytes. Without --data the GPT trains on generated text (the timing does not depend on it).
Stops (exit 2) when PyTorch has no usable CUDA. --json FILE: every figure, for
launch/scripts/gpu_check.sh.
--gpt2-124m: GPT-2 124M as its users train it: GPT-2's vocabulary (50257 tokens), 12 layers,
12 heads, 768 wide, block 1024, batch 8, bf16, the tanh GELU (GPT-2's own; amp_train --gelu tanh),
AdamW with nanoGPT's groups, clipping at 1.0, on token data in llm.c's shard format (--data SHARD;
without it a generated shard of random tokens: the timing does not depend on them).

  launch/bench/bench_vs_pytorch.py                          # Debian's PyTorch
  launch/bench/bench_vs_pytorch.py --make-venv --venv .venv-torch
  launch/bench/bench_vs_pytorch.py --sizes 2048x256 --modes fp32 --steps 30
  launch/bench/bench_vs_pytorch.py --model gpt --data build/example/kjv.txt
  launch/bench/bench_vs_pytorch.py --device cuda --amp-train build/cuda/launch/amp_train --bench-mlp build/cuda/launch/bench_mlp
  launch/bench/bench_vs_pytorch.py --device cuda --model gpt --gpt2-small --compile --amp-train build/cuda/launch/amp_train
  launch/bench/bench_vs_pytorch.py --device cuda --model gpt --gpt2-124m --compile --amp-train build/cuda/launch/amp_train
  launch/bench/bench_vs_pytorch.py --device cuda --model gpt --gpt2-medium --compile --amp-train build/cuda/launch/amp_train
  launch/bench/bench_vs_pytorch.py --device cuda --model gpt --gpt2-124m --data fineweb_train_000001.bin
"""
import argparse
import array
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time

# What both PyTorch loops share: the configuration, the mode, torch.compile, and how steps are timed.
TORCH_COMMON = r'''
import json, sys, time, traceback, torch
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
torch.manual_seed(0)
dev, mode = cfg["device"], cfg["mode"]
cuda = dev == "cuda"
# The device memory this process holds beyond its context, as the driver counts it: the free bytes at
# the first CUDA call, which makes the context, less the free bytes after the timed steps (report()).
free_at_start = torch.cuda.mem_get_info()[0] if cuda else 0
dtype = torch.float16 if mode == "fp16" else torch.bfloat16  # (unused by fp32: autocast is off)
scaler = (torch.amp.GradScaler("cuda") if hasattr(torch.amp, "GradScaler") else torch.cuda.amp.GradScaler()) \
    if mode == "fp16" else None
if cfg["compile"]:
    # A failure anywhere (torch.compile, or its first calls: no C compiler, no Triton) is the compile
    # column's: one JSON line saying so, for the caller, which goes on without it.
    def compile_failed(kind, e, tb):
        traceback.print_exception(kind, e, tb)
        lines = [l.strip() for l in f"{kind.__name__}: {e}".splitlines()
                 if l.strip() and "TORCHDYNAMO_VERBOSE" not in l and "TORCH_LOGS" not in l]  # (its hints)
        print(json.dumps({"compile_error": " / ".join(lines[:4])[:600]}), flush=True)  # then exit 1, as ever
    sys.excepthook = compile_failed

def maybe_compile(model):
    return torch.compile(model) if cfg["compile"] else model  # the default mode; compiled at its first calls

def run(step):
    """The warmup steps, then the timed ones. The CPU: each timed step's ms, its loss read (amp_train reads
    its own every step). CUDA: one figure, the timed steps' mean, between two events around all of them,
    run back to back as users run them: no .item(), no synchronize (the GradScaler's own check stays)."""
    warmup, steps = cfg["warmup"], cfg["steps"]
    for s in range(warmup):
        loss = step(s)
    if cuda:
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for s in range(warmup, steps):
            loss = step(s)
        end.record()
        torch.cuda.synchronize()
        return [begin.elapsed_time(end) / (steps - warmup)], loss
    times = []
    for s in range(warmup, steps):
        t0 = time.perf_counter()
        loss = step(s)
        loss.item()
        times.append((time.perf_counter() - t0) * 1e3)
    return times, loss

def report(step, **extra):
    times, loss = run(step)
    out = {"times": times, "version": torch.__version__, "loss": loss.item(),
           "gpu": torch.cuda.get_device_name() if cuda else "", **extra}
    if cuda:
        out.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                   max_memory_reserved=torch.cuda.max_memory_reserved(),
                   device_memory=free_at_start - torch.cuda.mem_get_info()[0])
    print(json.dumps(out))
'''

TORCH_LOOP = TORCH_COMMON + r'''
w, b, layers = cfg["width"], cfg["batch"], cfg["layers"]
mods = []
for i in range(layers):
    mods.append(torch.nn.Linear(w, w))
    if i + 1 < layers:
        mods.append(torch.nn.ReLU())
model = torch.nn.Sequential(*mods).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
model = maybe_compile(model)
# A pool of samples produced once, as amp_train's synthetic data is (after its first pass).
pool = 16
xs = torch.randn(pool, b, w).to(dev)
with torch.no_grad():
    ys = torch.relu(xs @ torch.randn(w, w).to(dev) / w ** 0.5)
def step(s):
    x, y = xs[s % pool], ys[s % pool]
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
    return loss
report(step)
'''


TORCH_GPT_LOOP = TORCH_COMMON + r'''
import array, math, struct
import torch.nn as nn, torch.nn.functional as F
V, T, L, H, C, B = cfg["vocab"], cfg["block"], cfg["layers"], cfg["heads"], cfg["width"], cfg["batch"]
gelu = "tanh" if cfg["gelu"] == "tanh" else "none"  # F.gelu's "none" is the erf GELU
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
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate=gelu))
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
model = maybe_compile(model)  # after the optimizer, as nanoGPT does
raw = open(cfg["data"], "rb").read()
if cfg["data_format"] == "llmc":
    # llm.c's shard: 256 little-endian int32 (magic, version, token count, zeros), then uint16 tokens;
    # all of them train, as amp_train's tokens do without --val-data.
    magic, version, count = struct.unpack_from("<3i", raw)
    if magic != 20240520 or version != 1 or len(raw) != 1024 + 2 * count:
        sys.exit(f"{cfg['data']}: not an llm.c shard of uint16 tokens (magic {magic}, version {version}, "
                 f"{count} tokens in {len(raw)} bytes)")
    tokens = array.array("H", raw[1024:])
    if sys.byteorder == "big":
        tokens.byteswap()
    data = torch.frombuffer(tokens, dtype=torch.int16).to(torch.int64) & 0xFFFF  # int16: every PyTorch has it
    n = count - T - 1
else:  # text: bytes, the first nine tenths train (amp_train's split)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
    n = len(data) * 9 // 10 - T - 1
del raw
data = data.to(dev)
def step(s):
    starts = [((s * B + j) * T) % n for j in range(B)]
    x = torch.stack([data[i:i + T] for i in starts]); y = torch.stack([data[i + 1:i + T + 1] for i in starts])
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
    return loss
report(step, fused_adamw=fused)
'''

GPT_LAYERS, GPT_HEADS, GPT_BLOCK = 4, 4, 64          # the main job's GPT (launch/scripts/run_example.sh)
GPT2_SMALL = {"layers": 12, "heads": 12, "block": 1024, "sizes": "768x8", "modes": "bf16"}
GPT2_MEDIUM = {"layers": 24, "heads": 16, "block": 1024, "sizes": "1024x8", "modes": "bf16"}
GPT2_124M = dict(GPT2_SMALL, vocab=50257, gelu="tanh")  # GPT-2's own: its vocabulary and tanh GELU
GPT2_VOCAB = 50257
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_INTS = 20240520, 1, 256
AMP_FLAG = {"fp32": "off", "bf16": "bf16", "fp16": "fp16"}


class Deadline:
    """--budget's end: the seconds a run may still take (None: no budget)."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds if seconds else None

    def left(self):
        return None if self.end is None else max(1.0, self.end - time.monotonic())


DEADLINE = Deadline(None)
RUNNING = set()  # the process groups of the runs under way


def stop_runs(signum, _frame):
    """SIGTERM or SIGINT (gpu_check's stage limit, ^C): the runs' process groups go too, then this script.
    (Each run has its own group, so that the budget can stop it whole; the signal that stops this
    script's group would not reach it.)"""
    for group in list(RUNNING):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sys.exit(128 + signum)


def run_within(cmd, check=False, **kw):
    """subprocess.run(cmd, check=check, **kw) stopped at --budget's end: subprocess.TimeoutExpired, its process
    group killed (torch.compile's workers and amp_train with it)."""
    with subprocess.Popen(cmd, start_new_session=True, **kw) as p:  # (process_group= needs Python 3.11)
        RUNNING.add(p.pid)
        try:
            out, err = p.communicate(timeout=DEADLINE.left())
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
        finally:
            RUNNING.discard(p.pid)
    if check and p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, cmd, out, err)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def run_amp_train(binary, width, batch, layers, mode, steps, threads, data=None, extra=(), device="cpu", gpt=None):
    """amp_train's step_ms of every step, and its device memory (its end record's device_memory_bytes:
    the driver's count beyond the context; None on the CPU)."""
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        common = ["--device", device, "--batch-size", str(batch), "--steps", str(steps), "--threads", str(threads),
                  "--amp", AMP_FLAG[mode], "--log-every", "0", "--metrics", metrics]
        if data:
            cmd = [binary, "--model", "gpt", "--data", data, "--n-layer", str(gpt["layers"]), "--n-head",
                   str(gpt["heads"]), "--n-embd", str(width), "--block-size", str(gpt["block"]), "--optimizer", "adamw",
                   "--lr", "1e-3", "--weight-decay", "0.1", "--clip-grad-norm", "1"] + common
            if gpt["data_format"] == "llmc":
                cmd += ["--vocab-size", str(gpt["vocab"])]
            if gpt["gelu"] == "tanh":
                cmd += ["--gelu", "tanh"]
        else:
            cmd = [binary, "--width", str(width), "--layers", str(layers), "--optimizer", "sgd", "--lr", "0.01",
                   "--momentum", "0.9"] + common
        run_within(cmd + list(extra), check=True, stdout=subprocess.DEVNULL)
        with open(metrics) as f:
            recs = [json.loads(line) for line in f]
        end = [r for r in recs if r.get("event") == "end"]
        return ([r["step_ms"] for r in recs if "step" in r and "event" not in r],
                end[-1].get("device_memory_bytes") if end else None)


def run_torch(python, width, batch, layers, mode, steps, warmup, threads, data=None, device="cpu", gpt=None,
              compile_=False):
    """The PyTorch loop's result: "times" (its timed steps' ms; on CUDA one figure, their mean), and on CUDA
    its peak memory. With compile_, a failure is returned as {"error": message}, not raised."""
    cfg = {"width": width, "batch": batch, "layers": layers, "steps": steps, "warmup": warmup, "threads": threads,
           "lr": 0.01, "momentum": 0.9, "mode": mode, "device": device, "compile": compile_}
    if data:
        cfg.update({"data": data, "layers": gpt["layers"], "heads": gpt["heads"], "block": gpt["block"],
                    "sdpa": gpt.get("sdpa", False), "vocab": gpt["vocab"], "gelu": gpt["gelu"],
                    "data_format": gpt["data_format"]})
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    what = f"({python}, {mode}, {width}x{batch}{', torch.compile' if compile_ else ''})"
    try:
        out = run_within([python, "-c", TORCH_GPT_LOOP if data else TORCH_LOOP, json.dumps(cfg)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    except subprocess.TimeoutExpired:
        if not compile_:
            raise
        print(f"torch.compile stopped {what}: --budget spent", file=sys.stderr)
        return {"error": "did not finish within --budget (compiling and its steps took longer than what was left)",
                "budget": True}
    if out.returncode != 0:
        if not compile_:
            sys.exit(f"the PyTorch loop failed {what}:\n{out.stderr[-3000:]}")
        # The compile column's failure: its message (the loop's own line, else stderr's last), and the tail
        # of its stderr here, for the log.
        print(f"torch.compile failed {what}:\n{out.stderr[-3000:]}", file=sys.stderr)
        for line in reversed(out.stdout.strip().splitlines()):
            if line.startswith('{"compile_error"'):
                return {"error": json.loads(line)["compile_error"]}
        tail = [line for line in out.stderr.strip().splitlines() if line.strip()]
        return {"error": (tail[-1] if tail else f"exit {out.returncode}")[:600]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_bench_mlp(binary, width, batch, layers, modes, steps, threads, device="cpu"):
    """bench_mlp's median step_ms per mode, and its scaler% per mode (SGD with momentum 0.9, as here)."""
    out = run_within([binary, "--device", device, "--width", str(width), "--batch", str(batch), "--layers",
                      str(layers), "--modes", ",".join(modes), "--steps", str(steps), "--warmup", "2", "--threads",
                      str(threads), "--momentum", "0.9"], check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True).stdout
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
    rng = random.Random(0)
    words = ["the", "and", "of", "to", "in", "that", "he", "shall", "unto", "for", "his", "a", "they", "be", "is",
             "him", "not", "them", "it", "with", "all", "thou", "thy", "was", "which", "my", "LORD", "me", "said"]
    with open(path, "w") as f:
        n = 0
        while n < size:
            line = " ".join(rng.choice(words) for _ in range(12)) + ".\n"
            f.write(line)
            n += len(line)


def generated_shard(path, count, vocab):
    """A deterministic llm.c shard of `count` random token ids below `vocab`, for timing the GPT alone:
    256 little-endian int32 (magic, version, count, then zeros), then the tokens as little-endian uint16."""
    rng = random.Random(0)
    tokens = array.array("H", (rng.randrange(vocab) for _ in range(count)))
    if sys.byteorder == "big":
        tokens.byteswap()
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{LLMC_HEADER_INTS}i", LLMC_MAGIC, LLMC_VERSION, count, *[0] * (LLMC_HEADER_INTS - 3)))
        f.write(tokens.tobytes())


def is_llmc_shard(path):
    with open(path, "rb") as f:
        return f.read(4) == struct.pack("<i", LLMC_MAGIC)


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
    ap.add_argument("--data", help="gpt: a text file (launch/scripts/run_example.sh makes build/example/kjv.txt), or an "
                                   "llm.c token shard (GPT-2's 50257 tokens); --device cuda: generated text when left "
                                   "out; --gpt2-124m: a shard, generated when left out")
    ap.add_argument("--sizes", help="WIDTHxBATCH,... (mlp: 2048x256,4096x512, cuda 4096x512; gpt: 128x32,256x32, "
                                    "cuda 128x16)")
    ap.add_argument("--modes", help="fp32,bf16 (cpu); fp32,bf16,fp16 (cuda mlp); bf16 (cuda gpt)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--gpt2-small", action="store_true",
                    help="gpt: GPT-2 small's shape (12 layers, 12 heads, 768 wide, block 1024, batch 8, bf16) on bytes")
    ap.add_argument("--gpt2-medium", action="store_true",
                    help="gpt: GPT-2 medium's shape (24 layers, 16 heads, 1024 wide, block 1024, batch 8, bf16) on bytes")
    ap.add_argument("--gpt2-124m", action="store_true",
                    help="gpt: GPT-2 124M as its users train it: that shape with GPT-2's 50257-token vocabulary and "
                         "tanh GELU, on an llm.c token shard (--data; generated when left out)")
    ap.add_argument("--compile", action="store_true",
                    help="PyTorch also with torch.compile(model) (the default mode), its own column and ratio; "
                         "--warmup is at least 3 then (the compilation)")
    ap.add_argument("--block", type=int, help="gpt: the block size (default: 64, the main job's)")
    ap.add_argument("--sdpa", action="store_true",
                    help="gpt on the CPU: PyTorch's attention is F.scaled_dot_product_attention (causal) where it has "
                         "it (2.0 and newer), as nanoGPT's on PyTorch 2; default: nanoGPT's masked_fill and softmax")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of each side, taken in turn, so that a slow spell of this machine falls on both "
                         "(each side's figure: the median over every round; default: %(default)s)")
    ap.add_argument("--budget", type=int,
                    help="seconds for the whole benchmark: the rounds that fit, each run stopped at its end "
                         "(default: none; under gpu_check.sh its stage's limit less 20 s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--system-python", "--python", dest="python",
                    help="the interpreter with PyTorch (default: /usr/bin/python3, Debian's python3-torch; "
                         "--device cuda: this interpreter)")
    ap.add_argument("--venv", help="a virtual environment with PyTorch from PyPI, compared too")
    ap.add_argument("--make-venv", action="store_true", help="create --venv and pip install torch into it first")
    ap.add_argument("--json", help="write every figure to this file")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    for flag, value in (("--sizes", a.sizes), ("--modes", a.modes), ("--json", a.json), ("--venv", a.venv)):
        if value is not None and not value.strip():
            ap.error(f"{flag}: empty (leave it out for the default)")
    # --json is written after the whole benchmark: a path that cannot take it is said now, not then.
    if a.json and (os.path.isdir(a.json) or not os.access(os.path.dirname(os.path.abspath(a.json)), os.W_OK)):
        ap.error(f"--json {a.json}: cannot write a file there (a directory, or its folder is missing or read-only)")
    try:  # split now: a quote left open was a traceback in the first round
        a.amp_train_flags = shlex.split(a.amp_train_flags)
    except ValueError as e:
        ap.error(f"--amp-train-flags {a.amp_train_flags!r}: {e}")
    if a.warmup < 0:
        ap.error("--warmup must be 0 or more")
    if a.compile and a.warmup < 3:
        print(f"note: --compile: --warmup {a.warmup} raised to 3 (torch.compile compiles in the warmup steps)",
              file=sys.stderr)
        a.warmup = 3
    if a.steps <= a.warmup:
        ap.error(f"--steps must exceed --warmup ({a.warmup}{', at least 3 with --compile' if a.compile else ''})")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.budget is not None and a.budget < 1:
        ap.error(f"--budget {a.budget}: a positive number of seconds, please")
    if a.budget is None and os.environ.get("GPU_CHECK_STAGE_LIMIT", "").isdigit():
        a.budget = max(10, int(os.environ["GPU_CHECK_STAGE_LIMIT"]) - 20)  # gpu_check's stage: its limit, less the end
    global DEADLINE
    DEADLINE = Deadline(a.budget)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_runs)
    shapes = [f"--gpt2-{n}" for n, on in (("small", a.gpt2_small), ("medium", a.gpt2_medium), ("124m", a.gpt2_124m)) if on]
    if len(shapes) > 1:
        ap.error(f"{' and '.join(shapes)}: one shape at a time")
    if shapes and a.model != "gpt":
        ap.error(f"{shapes[0]} is a shape of --model gpt")
    build = os.path.join(root, "build", "cuda" if cuda else "release", "launch")
    a.amp_train = a.amp_train or os.path.join(build, "amp_train")
    a.bench_mlp = a.bench_mlp or os.path.join(build, "bench_mlp")
    a.python = a.python or (sys.executable if cuda else "/usr/bin/python3")
    if shutil.which(a.python) is None:  # (a traceback in the first round before)
        ap.error(f"--python {a.python}: no such interpreter (not a file, not executable, or not on PATH)")
    gpt = dict(GPT2_124M) if a.gpt2_124m else dict(GPT2_SMALL) if a.gpt2_small else dict(GPT2_MEDIUM) if a.gpt2_medium \
        else {"layers": GPT_LAYERS, "heads": GPT_HEADS, "block": GPT_BLOCK}
    gpt.setdefault("gelu", "erf")
    if a.block is not None:
        if a.block < 1 or a.model != "gpt":
            ap.error("--block is a positive block size of --model gpt")
        gpt["block"] = a.block
    gpt["sdpa"] = a.sdpa
    gpt_model = a.model == "gpt"
    if shapes:
        a.sizes, a.modes = a.sizes or gpt["sizes"], a.modes or gpt["modes"]
    a.sizes = a.sizes or ("128x16" if cuda else "128x32,256x32") if gpt_model else a.sizes or (
        "4096x512" if cuda else "2048x256,4096x512")
    try:
        sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
        if any(len(s) != 2 or min(s) < 1 for s in sizes):
            raise ValueError
    except ValueError:
        ap.error(f"--sizes {a.sizes}: WIDTHxBATCH,... of positive numbers, please")
    block = gpt["block"]
    tmp = tempfile.TemporaryDirectory()
    if gpt_model and not a.data and a.gpt2_124m:
        # Enough tokens that no sequence repeats, up to 20M (a 40 MB shard): the timing does not depend on them.
        count = min(20_000_000, a.steps * max(b for _, b in sizes) * (block + 1) + block + 1)
        a.data = os.path.join(tmp.name, "tokens_000000.bin")
        generated_shard(a.data, count, GPT2_VOCAB)
        print(f"data: {count} random tokens below {GPT2_VOCAB} in a generated llm.c shard")
    elif gpt_model and not a.data and cuda:
        a.data = os.path.join(tmp.name, "text.txt")
        generated_text(a.data, 4 << 20)
    if gpt_model and not (a.data and os.path.isfile(a.data)):
        ap.error("--model gpt needs --data FILE, a text file (launch/scripts/run_example.sh makes build/example/kjv.txt) "
                 "or an llm.c token shard")
    data = a.data if gpt_model else None
    if data:
        gpt["data_format"] = "llmc" if is_llmc_shard(data) else "text"
        if a.gpt2_124m and gpt["data_format"] != "llmc":
            ap.error(f"--gpt2-124m trains on tokens: --data {data} is no llm.c shard (magic {LLMC_MAGIC})")
        gpt["vocab"] = GPT2_VOCAB if gpt["data_format"] == "llmc" else 256
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
            venv_python = os.path.join(a.venv, "bin/python")
            if not os.access(venv_python, os.X_OK):
                ap.error(f"--venv {a.venv}: no bin/python there (create it with --make-venv)")
            if subprocess.run([venv_python, "-c", "import torch"], capture_output=True).returncode != 0:
                ap.error(f"--venv {a.venv}: its python has no torch (pip install torch there, or --make-venv)")
            peers.append(("pypi", venv_python))
        if not peers:
            sys.exit("no PyTorch to compare with: install python3-torch, or pass --venv (with --make-venv)")

    eager = [n for n, _ in peers]
    # Every PyTorch run: (column, peer, interpreter, compiled); torch.compile's columns after eager's.
    runs = [(n, n, py, False) for n, py in peers] + (
        [(n + " compile", n, py, True) for n, py in peers] if a.compile else [])
    cols = [f"torch {label} ms" for label, *_ in runs]
    widths = [max(17, len(c)) for c in cols]
    mem_cols = (["amp_train dev MiB"] + [f"{label} dev MiB (peak/rsv)" for label, *_ in runs] + ["÷ dev"]) if cuda else []
    mem_widths = [max(6, len(c)) for c in mem_cols]
    print(f"{'size':>10} {'mode':>5} {'amp_train ms':>13} " + " ".join(f"{c:>{w}}" for c, w in zip(cols, widths)) +
          f" {'ratio':>6}" + (f" {'÷ compile':>9}" if a.compile else "") + f" {'per round':>16}" +
          (f" {'amp_train tok/s':>16} {'torch tok/s':>12}" if data else f" {'bench_mlp ms':>13} {'÷ bench_mlp':>11}") +
          "".join(f" {c:>{w}}" for c, w in zip(mem_cols, mem_widths)))
    scaler_shares = []
    rows = []
    compile_error = {}  # peer -> torch.compile's failure; that peer's later compiled runs are skipped
    short = False  # --budget ended a size's rounds early
    for width, batch in sizes:
        # Each round runs every side once, in turn; a side's figure pools its timed steps over the rounds.
        ours = {m: [] for m in modes}
        theirs = {m: {label: [] for label, *_ in runs} for m in modes}
        mem = {m: {} for m in modes}  # column -> (max_memory_allocated, max_memory_reserved, device memory), bytes
        our_dev = {m: [] for m in modes}  # amp_train's device memory of each round, bytes
        bench_ms = {m: [] for m in modes}
        shares = []
        def one_round(r):
            """Every side once, in turn; what they measured (left out whole where --budget ends in it)."""
            got = {"ours": {}, "dev": {}, "theirs": {m: {} for m in modes}, "mem": {m: {} for m in modes}}
            where = f"round {r + 1}/{a.rounds} {width}x{batch}"
            if not data:
                got["bench"] = run_bench_mlp(a.bench_mlp, width, batch, a.layers, list(dict.fromkeys(modes + ["fp16"])),
                                             max(3, a.steps - a.warmup), a.threads, a.device)
            for mode in modes:
                times, dev_bytes = run_amp_train(a.amp_train, width, batch, a.layers, mode, a.steps, a.threads,
                                                 data, a.amp_train_flags, a.device, gpt)
                got["ours"][mode], got["dev"][mode] = times[a.warmup:], dev_bytes
                print(f"{where} {mode}: amp_train {statistics.median(times[a.warmup:]):.2f} ms", flush=True)
                for label, name, python, compiled in runs:
                    if compiled and name in compile_error:
                        continue
                    res = run_torch(python, width, batch, a.layers, mode, a.steps, a.warmup, a.threads, data,
                                    a.device, gpt, compiled)
                    if res.get("budget") and theirs[mode][label]:
                        raise subprocess.TimeoutExpired(label, a.budget)  # its column has figures: the round goes
                    if "error" in res:
                        compile_error[name] = res["error"]
                        continue
                    if not compiled:
                        versions[name] = res["version"] + (", fused AdamW" if res.get("fused_adamw") else "")
                    got["theirs"][mode][label] = res["times"]
                    print(f"{where} {mode}: torch {label} {statistics.median(res['times']):.2f} ms", flush=True)
                    if "max_memory_allocated" in res:
                        got["mem"][mode][label] = (res["max_memory_allocated"], res["max_memory_reserved"],
                                                   res.get("device_memory", 0))
            return got

        done, round_s = 0, 0.0  # the rounds that finished; the last one's seconds
        for r in range(a.rounds):
            if done and DEADLINE.end is not None and time.monotonic() + round_s > DEADLINE.end:
                print(f"round {r + 1}/{a.rounds} {width}x{batch} not started: --budget {a.budget} s would end in it",
                      flush=True)
                break
            t0 = time.monotonic()
            try:
                got = one_round(r)
            except subprocess.TimeoutExpired:
                print(f"round {r + 1}/{a.rounds} {width}x{batch} stopped: --budget {a.budget} s spent; it is left out",
                      flush=True)
                break
            done, round_s = done + 1, time.monotonic() - t0
            if not data:
                for m in modes:
                    bench_ms[m].append(got["bench"][0][m])
                shares.append(got["bench"][1]["fp16"])
            for mode in modes:
                ours[mode].append(got["ours"][mode])
                if got["dev"][mode] is not None:
                    our_dev[mode].append(got["dev"][mode])
                for label, times in got["theirs"][mode].items():
                    theirs[mode][label].append(times)
                for label, m in got["mem"][mode].items():
                    was = mem[mode].get(label, (0, 0, 0))
                    mem[mode][label] = tuple(max(x, y) for x, y in zip(was, m))
        if done == 0:
            print(f"{width}x{batch}: no round finished within --budget {a.budget} s: no figures", flush=True)
            short = True
            continue
        short = short or done < a.rounds
        if shares:
            scaler_shares.append(f"{width}x{batch} {statistics.median(shares):.2f} %")
        for mode in modes:
            pooled = lambda rs: statistics.median([t for r in rs for t in r])
            mine = pooled(ours[mode])
            peer_ms = [pooled(theirs[mode][n]) for n in eager]
            best = min(peer_ms)
            per_round = [statistics.median(ours[mode][r]) /
                         min(statistics.median(theirs[mode][n][r]) for n in eager) for r in range(done)]
            rounds = ",".join(f"{x:.2f}" for x in per_round)
            row = {"model": a.model + (shapes[0].replace("--", "_").replace("-", "_") if shapes else ""),
                   "size": f"{width}x{batch}", "mode": mode, "amp_train_ms": mine,
                   "torch_ms": dict(zip(eager, peer_ms)), "ratio": mine / best, "ratio_per_round": per_round,
                   "rounds": done}
            shown = list(peer_ms)
            best_c = None
            if a.compile:
                # A compiled peer counts only with every round's figure (a failure halfway leaves it out).
                comp_ms = {n: pooled(theirs[mode][n + " compile"]) if len(theirs[mode][n + " compile"]) == done
                           else None for n in eager}
                finished = [v for v in comp_ms.values() if v is not None]
                best_c = min(finished) if finished else None
                row.update({"torch_compile_ms": comp_ms, "ratio_compile": mine / best_c if best_c else None})
                errors = {n: compile_error[n] for n in eager if comp_ms[n] is None and n in compile_error}
                if errors:
                    row["torch_compile_error"] = errors
                shown += [comp_ms[n] for n in eager]
            dev_ratio = None
            if cuda:
                row["torch_max_memory_allocated"] = {label: m[0] for label, m in mem[mode].items()}
                row["torch_max_memory_reserved"] = {label: m[1] for label, m in mem[mode].items()}
                row["torch_device_memory"] = {label: m[2] for label, m in mem[mode].items()}
                mine_dev = max(our_dev[mode]) if our_dev[mode] else None
                eager_dev = [mem[mode][n][2] for n in eager if n in mem[mode] and mem[mode][n][2] > 0]
                dev_ratio = mine_dev / min(eager_dev) if mine_dev and eager_dev else None
                row.update({"amp_train_device_memory": mine_dev, "device_memory_ratio": dev_ratio})
            if data:
                row.update({"layers": gpt["layers"], "heads": gpt["heads"], "block": block, "vocab": gpt["vocab"],
                            "gelu": gpt["gelu"], "data_format": gpt["data_format"],
                            "amp_train_tokens_per_s": batch * block / mine * 1e3,
                            "torch_tokens_per_s": batch * block / best * 1e3})
                if best_c:
                    row["torch_compile_tokens_per_s"] = batch * block / best_c * 1e3
                extra = f" {batch * block / mine * 1e3:>16.0f} {batch * block / best * 1e3:>12.0f}"
            else:
                bm = statistics.median(bench_ms[mode])
                row.update({"layers": a.layers, "bench_mlp_ms": bm, "amp_train_over_bench_mlp": mine / bm if bm > 0 else None,
                            "amp_train_samples_per_s": batch / mine * 1e3, "torch_samples_per_s": batch / best * 1e3})
                extra = f" {bm:>13.1f} {mine / bm:>11.2f}" if bm > 0 else f" {bm:>13.1f} {'-':>11}"
            rows.append(row)
            mib = lambda label: (f"{mem[mode][label][2] / 2**20:.0f} ({mem[mode][label][0] / 2**20:.0f}/"
                                 f"{mem[mode][label][1] / 2**20:.0f})" if label in mem[mode] else "-")
            mem_shown = ([f"{max(our_dev[mode]) / 2**20:.0f}" if our_dev[mode] else "-"] +
                         [mib(label) for label, *_ in runs] +
                         [f"{dev_ratio:.2f}" if dev_ratio else "-"]) if cuda else []
            print(f"{width:>5}x{batch:<4} {mode:>5} {mine:>13.1f} " +
                  " ".join(f"{t:>{w}.1f}" if t is not None else f"{'failed':>{w}}" for t, w in zip(shown, widths)) +
                  f" {mine / best:>6.2f}" +
                  ((f" {mine / best_c:>9.2f}" if best_c else f" {'-':>9}") if a.compile else "") +
                  f" {rounds:>16}" + extra +
                  "".join(f" {v:>{w}}" for v, w in zip(mem_shown, mem_widths)), flush=True)
    timing = {"amp_train": "the median of its step_ms (one step's start to the next's) over the timed steps of "
                           "every round",
              "torch": "per round, the mean step between CUDA events around its timed steps run back to back; "
                       "the median over the rounds" if cuda else
                       "the median of its timed steps (each between time.perf_counter() calls, its loss read) over "
                       "every round"}
    print(f"ratio: amp_train's step over the faster eager PyTorch's" +
          (", ÷ compile: over the faster torch.compile's" if a.compile else "") +
          f", after {a.warmup} warmup steps, over {a.rounds} round(s) (per round: that round's own ratio to eager); "
          f"amp_train: {timing['amp_train']}; PyTorch: {timing['torch']}; PyTorch " +
          ", ".join(f"{n} {v}" for n, v in versions.items()))
    if cuda:
        print("dev MiB: device memory beyond the CUDA context as the driver counts it (cudaMemGetInfo), the same on "
              "both sides, the most over the rounds; (peak/rsv): PyTorch's torch.cuda.max_memory_allocated() and "
              "max_memory_reserved(); ÷ dev: amp_train's over the smaller eager PyTorch's")
    for n, msg in compile_error.items():
        print(f"torch.compile failed ({n}: its column says failed): {msg}")
    if scaler_shares:
        print("the scaler's share of bench_mlp's fp16 step (scale, inf/NaN check, update): " + ", ".join(scaler_shares))
    if a.json:
        part = a.json + ".partial"  # written whole, then renamed: a run killed here leaves no half file
        with open(part, "w") as f:
            json.dump({"device": a.device, "gpu": gpu_name, "pytorch": versions, "steps": a.steps, "warmup": a.warmup,
                       "rounds": a.rounds, "budget": a.budget, "rounds_short": short, "compile": a.compile,
                       "timing": timing, "compile_errors": compile_error, "rows": rows,
                       "scaler_share_fp16": scaler_shares}, f, indent=1)
        os.replace(part, a.json)
    if short:
        print(f"--budget {a.budget} s: fewer rounds than --rounds {a.rounds} (each row's JSON has its own)")
    if not rows:
        sys.exit(f"bench_vs_pytorch: no figures: --budget {a.budget} s ended every size's first round")


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as e:  # amp_train or bench_mlp refused its flags, or failed
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        sys.exit(f"bench_vs_pytorch: {os.path.basename(str(e.cmd[0]))} failed (exit {e.returncode}): "
                 f"{shlex.join(str(c) for c in e.cmd)}" + (f"\n{err.strip()[-3000:]}" if err.strip() else ""))
