"""A minimal safetensors reader and writer (little-endian; F32, BF16, F16, I32, I64), enough
to load H3 conditioning weights into detdit.nn modules without another dependency:

    model.load_state_dict(detdit.safetensors.load_file("h3_conditioning.safetensors"))

load_file memory-maps the file instead of reading it: its tensors are views of a private
(copy-on-write) mapping, so a page of the file is read when a tensor's bytes are first used,
and writing to a tensor changes this process's copy only, never the file. Keep the file as it
is while its tensors live: truncating or rewriting it in place makes a later read fail with
SIGBUS (detdit's writers replace a file by renaming a new one over it, which is safe).

Malformed files raise ValueError naming the file and the problem."""
import json
import mmap
import os
import struct

import torch

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32,
           "I64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


def load_file(path):
    """{name: tensor} (CPU) from a safetensors file, each tensor a view of the mapped file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path}: truncated file ({size} bytes, no header length)")
        # ACCESS_COPY (MAP_PRIVATE): writable, so torch.frombuffer takes it without a warning,
        # and writes stay in this process. The mapping outlives the file descriptor.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    (header_len,) = struct.unpack("<Q", mapped[:8])
    if 8 + header_len > size:
        raise ValueError(f"{path}: header length {header_len} runs past the end of the file ({size} bytes)")
    try:
        header = json.loads(mapped[8:8 + header_len])
    except ValueError as e:
        raise ValueError(f"{path}: malformed JSON header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header must be a JSON object")
    data_start, data_size = 8 + header_len, size - 8 - header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ValueError(f"{path}: tensor {name} must be a JSON object, got {info!r}")
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has dtype {info.get('dtype')!r}; supported: {sorted(_DTYPES)}")
        shape, (begin, end) = list(info["shape"]), info["data_offsets"]
        numel = 1
        for d in shape:
            numel *= d
        element_size = torch.tensor([], dtype=dtype).element_size()
        nbytes = numel * element_size
        if not (0 <= begin <= end <= data_size) or end - begin != nbytes:
            raise ValueError(f"{path}: tensor {name} has byte range [{begin}, {end}) for shape {shape} {info['dtype']} "
                             f"({nbytes} bytes) in a {data_size}-byte data section")
        offset = data_start + begin
        if numel == 0:
            flat = torch.empty(0, dtype=dtype)
        elif offset % element_size == 0:  # the mapping is page-aligned, so the view is aligned to its dtype
            flat = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=offset)
        else:  # a misaligned tensor (the format only promises 8-byte header padding) is copied to aligned memory
            flat = torch.frombuffer(bytearray(mapped[offset:offset + nbytes]), dtype=dtype)
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
