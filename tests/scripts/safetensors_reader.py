"""A minimal safetensors reader for fixture scripts (F32 and F64 only)."""
import json
import struct

import torch

_TYPES = {"F32": torch.float32, "F64": torch.float64}


def load(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, h in header.items():
        if name == "__metadata__" or h["dtype"] not in _TYPES:
            continue
        b, e = h["data_offsets"]
        out[name] = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=_TYPES[h["dtype"]]).reshape(h["shape"])
    return out
