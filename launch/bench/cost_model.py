#!/usr/bin/env python3
"""A cost model of one H100 SXM over the emulated GPU's launch log (AMP_EMU_LAUNCH_LOG).

A model, not a measurement: it prices each logged device operation from what its launch site
declared (bytes read and written, FLOPs) and its geometry, with the constants below, and prints per
training step the modeled time, the ten operations that take longest, the step's floor and the
share of the time that is host launch overhead, with and without a CUDA graph.

  cost_model.py LOG [--gpt N_LAYER,N_EMBD,TOKENS | --mlp WIDTH,LAYERS,BATCH] [--act-bytes 2]

How an operation is priced (seconds):
  kernel   max(bytes / (HBM_BW * HBM_REACHABLE * fill), flops / (CUDA_CORE_FLOPS * fill)),
           fill = min(1, blocks / SMS): a grid of fewer blocks than SMs reaches that fraction; the
           fused attention's kernels (tensor-core products) at ATTENTION_FLOPS, measured, instead.
           cuDNN's fused attention (the emulated GPU's stand-in kernels, cudnn_reference_*) at
           CUDNN_SDPA_FORWARD_FLOPS and _BACKWARD_FLOPS, measured.
  GEMM     max(flops / (peak * eff), bytes / (HBM_BW * HBM_REACHABLE)); peak TENSOR_FLOPS for
           bf16/fp16 inputs, FP32_GEMM_FLOPS for fp32 (TF32 off) and fp64; eff = GEMM_EFFICIENCY
           for more than GEMM_FULL_FLOPS, below it GEMM_EFFICIENCY * min(1, tiles / SMS), tiles the
           GEMM_TILE x GEMM_TILE output tiles of all its batch: a small GEMM cannot fill the SMs.
  memset   bytes / (HBM_BW * HBM_REACHABLE); device-to-device copy twice its bytes (read + write);
           host<->device copy bytes / PCIE_BW.
  collective  the bytes one rank sends / NVLINK_BUS_BW: all-reduce 2 (n - 1) / n of its buffer, all-gather
           (n - 1) times its part, all-to-all (n - 1) / n of its send buffer, broadcast the buffer; 0 for 1 rank.
Every operation costs at least KERNEL_MIN_S on the device. The host issues one operation every
LAUNCH_HOST_S (LAUNCH_GRAPH_S inside a CUDA graph); an operation starts when it has been issued and
the one before it has finished (one stream: overlap between streams is not modeled). The step's
modeled time is when its last operation ends; the launch-overhead share is the part of it the
device spends waiting for the host.

The floor: the step's GEMM FLOPs at TENSOR_FLOPS (fp32 GEMMs at FP32_GEMM_FLOPS) plus, at HBM_BW,
the bytes that must move once: the optimizer's multi-tensor launches as declared (weights, their
low-precision copies, gradients and optimizer state, each read or written once) and the saved
activations (--gpt / --mlp, see saved_activation_bytes).
"""
import argparse
import json
import sys

# --- H100 SXM (the figures the model was specified with)
HBM_BW = 3.35e12            # bytes/s
HBM_REACHABLE = 0.80        # of HBM_BW, by a well-formed kernel
TENSOR_FLOPS = 990e12       # dense bf16/fp16 tensor-core FLOP/s
GEMM_EFFICIENCY = 0.70      # reached by a GEMM of more than GEMM_FULL_FLOPS
GEMM_FULL_FLOPS = 1e9
GEMM_TILE = 128             # output tile edge, for the fill of smaller GEMMs
FP32_GEMM_FLOPS = 60e12     # fp32 GEMMs, TF32 off (PyTorch's default)
TF32_FLOPS = 495e12         # fp32 GEMMs in TF32 on the tensor cores (--allow-tf32): the datasheet's dense rate
SMS = 132
LAUNCH_HOST_S = 4e-6        # host time per launch
LAUNCH_GRAPH_S = 1e-6       # the same inside a CUDA graph
NVLINK_BUS_BW = 370e9       # all-reduce bus bandwidth, 8 H100s
# --- our own estimates
CUDA_CORE_FLOPS = 67e12     # fp32 non-tensor FLOP/s (element-wise arithmetic)
# --- measured
ATTENTION_FLOPS = 77e12     # the fused attention's kernels (attention_*: mma.sync, ldmatrix, no pipelining yet):
                            # their declared FLOPs over their time on an H200 (same SMs and clocks as an H100
                            # SXM), 2026-11-26, GPT-2 small: 90 forward, 87 dq, 66 dk/dv, 77 in all (TFLOP/s).
                            # The kernels changed since (cp.async, ldmatrix.trans, 128-row forward blocks:
                            # docs/GPU.md), and the dq pass became one product a tile from the dS the dk/dv
                            # pass keeps; all are priced at the old ones' rate until hardware times them
CUDNN_SDPA_FORWARD_FLOPS = 276e12   # cuDNN's fused attention (cudnn_reference_*): PyTorch's cuDNN SDPA kernels on an
CUDNN_SDPA_BACKWARD_FLOPS = 204e12  # H100 SXM (issue 36, ncu), GPT-2 small (B 8, T 1024, 12 x 64, 12 layers):
                            # forward 0.56 ms for 155 GFLOP (causal), backward 1.49 + 0.40 ms (its dO.O and
                            # dq conversion kernels) for 387 GFLOP. PyTorch's backward is the non-deterministic
                            # one; ours asks for the deterministic algorithm, not yet timed on hardware
PCIE_BW = 25e9              # host<->device copies, bytes/s
KERNEL_MIN_S = 2e-6         # the shortest a kernel takes on the device


def hbm(nbytes, fill=1.0):
    return nbytes / (HBM_BW * HBM_REACHABLE * max(fill, 1e-9))


def gemm_time(op):
    flops = op["flops"]
    narrow = op["a"] in ("bf16", "f16")
    tf32 = op.get("compute") == "TF32"
    peak = TENSOR_FLOPS if narrow else TF32_FLOPS if tf32 else FP32_GEMM_FLOPS
    eff = GEMM_EFFICIENCY if narrow or tf32 else 1.0
    if flops <= GEMM_FULL_FLOPS:
        tiles = -(-op["m"] // GEMM_TILE) * -(-op["n"] // GEMM_TILE) * op["batch"]
        eff *= min(1.0, tiles / SMS)
    return max(flops / (peak * eff), hbm(op["read"] + op["written"]))


def op_time(op):
    kind = op["op"]
    if kind == "kernel":
        blocks = op["grid"][0] * op["grid"][1] * op["grid"][2]
        fill = min(1.0, blocks / SMS)
        name = op["name"]
        rate = (ATTENTION_FLOPS if name.startswith("attention_") else
                CUDNN_SDPA_FORWARD_FLOPS if name.startswith("cudnn_reference_forward") else
                CUDNN_SDPA_BACKWARD_FLOPS if name.startswith("cudnn_reference_backward") else CUDA_CORE_FLOPS)
        t = max(hbm(op["read"] + op["written"], fill), op["flops"] / (rate * fill))
    elif kind == "gemm":
        t = gemm_time(op)
    elif kind == "memset":
        t = hbm(op["bytes"])
    elif kind == "memcpy":
        t = hbm(2 * op["bytes"]) if op["kind"] == "d2d" else op["bytes"] / PCIE_BW
    elif kind in ("all_reduce", "all_gather", "all_to_all", "broadcast"):
        t = sent_bytes(kind, op["bytes"], op["ranks"]) / NVLINK_BUS_BW
    else:
        return 0.0
    return max(t, KERNEL_MIN_S)


def sent_bytes(kind, nbytes, n):
    """What one rank sends, as comm/comm_bytes.h counts it: nbytes is the buffer this rank contributes
    (an all-gather's one part, an all-to-all's whole send buffer)."""
    if n <= 1:
        return 0
    return {"all_reduce": 2 * (n - 1) * nbytes / n, "all_gather": (n - 1) * nbytes,
            "all_to_all": (n - 1) * nbytes / n, "broadcast": nbytes}[kind]


def simulate(times, per_launch):
    """When the last operation ends, and the device's busy time, issuing one every per_launch."""
    end = 0.0
    for i, t in enumerate(times):
        end = max(end, (i + 1) * per_launch) + t
    return end


def saved_activation_bytes(args):
    """The activations a step must write once (forward) to read in backward, at the least."""
    a = args.act_bytes
    if args.gpt:
        layers, c, tokens = args.gpt
        # Per layer and token: LayerNorm outputs 2C, q/k/v 3C, attention output C, MLP hidden 4C
        # and its GELU 4C in the autocast dtype; the fp32 residual stream twice (2C x 4 bytes).
        return layers * tokens * (14 * c * a + 2 * c * 4)
    if args.mlp:
        width, layers, batch = args.mlp
        return layers * batch * width * 2 * a  # each layer's input and pre-activation
    return 0


class LogError(Exception):
    """A log this model cannot read: the message names the file (and the line)."""


def steps_of(path):
    """(step, its operations, its peak bytes) of every complete step. A last line cut short (a dry run
    killed while writing) is left out with the step it was in; any other line that is no operation of
    the emulated GPU's log is LogError."""
    steps, cur, step = [], None, None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError as e:
        raise LogError(f"{path}: cannot be read: {e.strerror or e}") from None
    for n, line in enumerate(lines, 1):
        try:
            op = json.loads(line)
            if not isinstance(op, dict) or not isinstance(op.get("op"), str):
                raise ValueError("no \"op\" field")
        except ValueError as e:
            if n == len(lines) and not line.endswith("\n"):
                print(f"{path}: line {n} is cut short (a run killed while writing it): left out", file=sys.stderr)
                break
            raise LogError(f"{path}: line {n} is not an operation of the emulated GPU's launch log "
                           f"(AMP_EMU_LAUNCH_LOG): {e}") from None
        try:
            if op["op"] == "step_begin":
                cur, step = [], op["step"]
            elif op["op"] == "step":
                if cur is not None:
                    steps.append((step, cur, op["peak_bytes"]))
                cur = None
            elif cur is not None:
                cur.append(op)
        except KeyError as e:
            raise LogError(f"{path}: line {n}: a {op['op']} record without {e}") from None
    return steps


def label(op):
    if op["op"] == "kernel":
        g, b = op["grid"], op["block"]
        name = op["name"]
        if name.startswith("multi_tensor_kernel"):  # the op is what tells them apart
            name = "multi_tensor_kernel " + op["params"].split(", ", 1)[-1].rstrip(")")
        else:
            params = op["params"]
            name += " " + (params if len(params) <= 60 else params[:57] + "...")
        return f'{name} <<<{g[0]}x{g[1]}x{g[2]}, {b[0]}x{b[1]}x{b[2]}>>>'
    if op["op"] == "gemm":
        return f'{op["name"]} m={op["m"]} n={op["n"]} k={op["k"]} batch={op["batch"]} {op["a"]}->{op["c"]}'
    if op["op"] == "memcpy":
        return f'memcpy {op["kind"]} {op["bytes"]} B'
    return f'{op["op"]} {op.get("bytes", 0)} B'


COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "broadcast")
IB_BW = 50e9  # bytes/s a GPU over InfiniBand (one 400 Gb/s NIC per GPU)


def communication(ops):
    """What this rank sends in the step (comm/comm_bytes.h's count), the gradients' share of it against
    a ring all-reduce and against the gather it replaced, and the time on 8 GPUs over NVLink and 64 over
    InfiniBand. The buffers summed in order (the gradient buckets) are the all-to-alls (their whole send
    buffers: G bytes)."""
    comm = [op for op in ops if op["op"] in COLLECTIVES]
    if not comm:
        return
    n = comm[0]["ranks"]
    sent = sum(sent_bytes(op["op"], op["bytes"], n) for op in comm)
    g = sum(op["bytes"] for op in comm if op["op"] == "all_to_all")
    buckets = sum(op["op"] == "all_to_all" for op in comm)
    ring = 2 * (n - 1) * g / n
    print(f"  communication     {sent / 1e6:9.1f} MB sent by this rank of {n} in {len(comm)} collectives "
          f"({sent / ring if ring else float('nan'):.3f} x a ring all-reduce of the {buckets} buffers summed in order, "
          f"{g / 1e6:.1f} MB; gathering every buffer sends {(n - 1) * g / 1e6:.1f} MB)")
    if g:
        print(f"    their sum modeled: 8 GPUs on NVLink {2 * 7 / 8 * g / NVLINK_BUS_BW * 1e3:.2f} ms "
              f"(gathered: {7 * g / NVLINK_BUS_BW * 1e3:.2f}), 64 GPUs on InfiniBand at {IB_BW / 1e9:.0f} GB/s a GPU "
              f"{2 * 63 / 64 * g / IB_BW * 1e3:.1f} ms (gathered: {63 * g / IB_BW * 1e3:.1f})")


def report(step, ops, peak, args):
    times = [op_time(op) for op in ops]
    device = sum(times)
    eager = simulate(times, LAUNCH_HOST_S)
    graph = simulate(times, LAUNCH_GRAPH_S)
    gemm_flops = sum(op["flops"] for op in ops if op["op"] == "gemm" and op["a"] in ("bf16", "f16"))
    # The fused attention's products are matrix products (tensor-core work, as FlashAttention does
    # them): the floor counts them as it counted the batched GEMMs they replace.
    gemm_flops += sum(op["flops"] for op in ops if op["op"] == "kernel" and
                      op["name"].startswith(("attention_", "cudnn_reference_")))
    fp32_flops = sum(op["flops"] for op in ops if op["op"] == "gemm" and op["a"] not in ("bf16", "f16")
                     and op.get("compute") != "TF32")
    tf32_flops = sum(op["flops"] for op in ops if op["op"] == "gemm" and op.get("compute") == "TF32")
    optimizer = sum(op["read"] + op["written"] for op in ops
                    if op["op"] == "kernel" and ("AdamOp" in op["params"] or "SgdOp" in op["params"]))
    acts = saved_activation_bytes(args)
    floor = gemm_flops / TENSOR_FLOPS + fp32_flops / FP32_GEMM_FLOPS + tf32_flops / TF32_FLOPS + (optimizer + acts) / HBM_BW
    undeclared = sum(1 for op in ops if op["op"] == "kernel" and not op["declared"])
    gemm_time_total = sum(t for t, op in zip(times, ops) if op["op"] == "gemm")
    print(f"step {step}: {len(ops)} device operations ({sum(op['op'] == 'gemm' for op in ops)} GEMMs)"
          + (f", {undeclared} kernels without a declared cost" if undeclared else ""))
    print(f"  modeled step      {eager * 1e3:9.2f} ms   (in a CUDA graph {graph * 1e3:.2f} ms; device busy "
          f"{device * 1e3:.2f} ms, GEMMs {gemm_time_total * 1e3:.2f} ms)")
    print(f"  floor             {floor * 1e3:9.2f} ms   (GEMMs {(gemm_flops + fp32_flops + tf32_flops) / 1e12:.3f} TFLOP; "
          f"weights, gradients, optimizer state {optimizer / 1e9:.3f} GB; saved activations {acts / 1e9:.3f} GB)")
    print(f"  modeled / floor   {eager / floor if floor else float('nan'):9.2f}")
    print(f"  launch overhead   {100 * (eager - device) / eager:8.1f} %  of the step "
          f"({100 * (graph - device) / graph:.1f} % in a CUDA graph; the host issues the step's {len(ops)} "
          f"operations in {len(ops) * LAUNCH_HOST_S * 1e3:.2f} ms, {len(ops) * LAUNCH_GRAPH_S * 1e3:.2f} ms)")
    print(f"  peak device memory {peak / 2**30:8.2f} GiB")
    communication(ops)
    # Kernels that move more than 1 MB with fewer blocks than SMs (they cannot reach the bandwidth).
    thin = {}
    for op in ops:
        if op["op"] == "kernel" and op["read"] + op["written"] > 1e6:
            blocks = op["grid"][0] * op["grid"][1] * op["grid"][2]
            if blocks < SMS:
                thin.setdefault((label(op), blocks), []).append(op["read"] + op["written"])
    print(f"  kernels moving > 1 MB on fewer than {SMS} blocks: {sum(len(v) for v in thin.values())}"
          + "".join(f"\n    {len(v)} x {max(v) / 1e6:.1f} MB at most, {b} blocks: {k}" for (k, b), v in thin.items()))
    # The ten longest, operations of one name and geometry summed (a layer's kernels repeat).
    groups = {}
    for t, op in zip(times, ops):
        key = label(op)
        g = groups.setdefault(key, [0.0, 0, 0])
        g[0] += t
        g[1] += 1
        g[2] += op.get("read", 0) + op.get("written", 0) + (op.get("bytes", 0) if op["op"] != "kernel" else 0)
    print("  ten longest (operations of one name and shape summed):")
    print(f"  {'ms':>8} {'share':>6} {'calls':>5} {'GB':>8}  operation")
    for key, (t, n, b) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:10]:
        print(f"  {t * 1e3:8.2f} {100 * t / device:5.1f}% {n:5d} {b / 1e9:8.3f}  {key}")


def three_counts(text):
    """'A,B,C' of positive whole numbers (argparse names the flag when this raises)."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if len(counts) != 3 or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': three positive whole numbers, comma-separated")
    return counts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log")
    p.add_argument("--gpt", type=three_counts, help="N_LAYER,N_EMBD,TOKENS")
    p.add_argument("--mlp", type=three_counts, help="WIDTH,LAYERS,BATCH")
    p.add_argument("--act-bytes", type=int, default=2, help="bytes of an activation (2: bf16/fp16 autocast)")
    p.add_argument("--last", action="store_true", help="only the last step (the steady state)")
    args = p.parse_args()
    if args.act_bytes < 1:
        p.error(f"--act-bytes {args.act_bytes}: a positive number of bytes")
    try:
        steps = steps_of(args.log)
    except LogError as e:
        print(f"cost_model: {e}", file=sys.stderr)
        sys.exit(2)
    if not steps:
        print(f"cost_model: {args.log}: no complete training step (is AMP_EMU_LAUNCH_LOG set, and --device cuda?)",
              file=sys.stderr)
        sys.exit(2)
    for step, ops, peak in steps[-1:] if args.last else steps:
        try:
            report(step, ops, peak, args)
        except KeyError as e:  # a field this model prices by: another version's log
            print(f"cost_model: {args.log}: step {step}: an operation without {e}, which the model prices by "
                  "(a log written by another version of amp_train?)", file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    main()
