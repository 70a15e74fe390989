"""A minimal safetensors reader for fixture scripts: load (torch tensors, F32 and F64) and load_plain
(plain Python: name -> (shape, flat list), F32, F64 and I64; no torch)."""
import json
import struct

_FORMATS = {"F32": ("f", 4), "F64": ("d", 8), "I64": ("q", 8)}


def _entries(path):
    """name -> (header entry, raw bytes), in the header's order."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    return {name: (h, raw[8 + n + h["data_offsets"][0]:8 + n + h["data_offsets"][1]])
            for name, h in header.items() if name != "__metadata__"}


def load(path):
    import torch
    types = {"F32": torch.float32, "F64": torch.float64}
    return {name: torch.frombuffer(bytearray(data), dtype=types[h["dtype"]]).reshape(h["shape"])
            for name, (h, data) in _entries(path).items() if h["dtype"] in types}


def load_plain(path):
    out = {}
    for name, (h, data) in _entries(path).items():
        if h["dtype"] in _FORMATS:
            code, size = _FORMATS[h["dtype"]]
            out[name] = (h["shape"], list(struct.unpack("<%d%s" % (len(data) // size, code), data)))
    return out
