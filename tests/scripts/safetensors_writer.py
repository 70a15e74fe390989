"""A minimal safetensors writer (little-endian, the dtypes the fixtures use), so that fixture scripts
need nothing beyond torch; save_plain needs nothing at all (plain Python float64 values)."""
import json
import struct


def write(entries, path):
    """entries: name -> (safetensors dtype, shape, raw bytes); written in sorted name order."""
    header, blobs, offset = {}, [], 0
    for name in sorted(entries):
        dtype, shape, data = entries[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def save(tensors, path):
    """tensors: name -> torch tensor (F32, F64, F16, BF16, I64)."""
    import torch
    names = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64"}
    entries = {}
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        data = t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        entries[name] = (names[t.dtype], t.shape, data)
    write(entries, path)


def save_plain(tensors, path):
    """tensors: name -> (shape, flat list of float64 values), written as F64."""
    write({name: ("F64", shape, struct.pack("<%dd" % len(flat), *flat)) for name, (shape, flat) in tensors.items()},
          path)
