"""A minimal safetensors reader and writer (little-endian; F32, BF16, F16, I32, I64), enough
to load H3 conditioning weights into detdit.nn modules without another dependency:

    model.load_state_dict(detdit.safetensors.load_file("h3_conditioning.safetensors"))

Malformed files raise ValueError naming the file and the problem."""
import json
import struct

import torch

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32,
           "I64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


def load_file(path):
    """{name: tensor} (CPU, owning its memory) from a safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: truncated file ({len(data)} bytes, no header length)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if 8 + header_len > len(data):
        raise ValueError(f"{path}: header length {header_len} runs past the end of the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + header_len])
    except ValueError as e:
        raise ValueError(f"{path}: malformed JSON header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header must be a JSON object")
    body = memoryview(data)[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has dtype {info.get('dtype')!r}; supported: {sorted(_DTYPES)}")
        shape, (begin, end) = list(info["shape"]), info["data_offsets"]
        numel = 1
        for d in shape:
            numel *= d
        size = numel * torch.tensor([], dtype=dtype).element_size()
        if not (0 <= begin <= end <= len(body)) or end - begin != size:
            raise ValueError(f"{path}: tensor {name} has byte range [{begin}, {end}) for shape {shape} {info['dtype']} "
                             f"({size} bytes) in a {len(body)}-byte data section")
        raw = bytearray(body[begin:end])
        flat = torch.frombuffer(raw, dtype=dtype) if size else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(shape)
    return tensors


def save_file(tensors, path):
    """Write {name: tensor} (contiguous CPU copies) as safetensors, names sorted."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for raw in chunks:
            f.write(raw)
