"""detdit.safetensors: load_file maps the file instead of reading it (peak memory far below
the file's size), round-trips every dtype, copies only misaligned tensors, never writes
to the file, and refuses malformed files with a ValueError naming the file."""
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

import detdit.safetensors as st

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")


def write_raw(path, header, data):
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + data)


def test_round_trip_every_dtype(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, 2, generator=g).to(torch.float16),
        "i32": torch.randint(-9, 9, (4,), generator=g, dtype=torch.int32),
        "i64": torch.randint(-9, 9, (1, 3), generator=g, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }
    st.save_file(tensors, str(tmp_path / "t.safetensors"))
    loaded = st.load_file(str(tmp_path / "t.safetensors"))
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8)), name


def test_a_misaligned_tensor_is_copied_with_its_values(tmp_path):
    # 3 bf16 (6 bytes) then 4 f32: the f32 data starts 2 bytes past a 4-byte boundary
    a = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    b = torch.tensor([0.1, -7.0, 1e30, 2.0 ** -140])
    raw = a.view(torch.uint8).numpy().tobytes() + b.view(torch.uint8).numpy().tobytes()
    write_raw(tmp_path / "m.safetensors", {"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
                                           "b": {"dtype": "F32", "shape": [4], "data_offsets": [6, 22]}}, raw)
    loaded = st.load_file(str(tmp_path / "m.safetensors"))
    assert loaded["b"].data_ptr() % 4 == 0
    assert torch.equal(loaded["a"].view(torch.int16), a.view(torch.int16))
    assert torch.equal(loaded["b"].view(torch.int32), b.view(torch.int32))


def test_writing_a_tensor_leaves_the_file_alone(tmp_path):
    path = str(tmp_path / "w.safetensors")
    st.save_file({"x": torch.arange(1024, dtype=torch.float32)}, path)
    before = open(path, "rb").read()
    x = st.load_file(path)["x"]
    x.add_(1)
    assert float(x[0]) == 1.0
    assert open(path, "rb").read() == before
    assert float(st.load_file(path)["x"][0]) == 0.0


def test_loading_maps_rather_than_reads(tmp_path):
    # A 128 MiB file: reading it (and copying each tensor, as an earlier reader did) costs
    # 256 MiB of peak memory; a mapping costs next to nothing until the bytes are used.
    path = str(tmp_path / "big.safetensors")
    st.save_file({f"t{i}": torch.full((8 << 20,), float(i)) for i in range(4)}, path)
    # VmHWM, the peak RSS of this process image: ru_maxrss would start at the parent's peak
    script = ("import sys, detdit.safetensors as st\n"
              "def peak(): return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) << 10\n"
              "base = peak(); w = st.load_file(sys.argv[1]); loaded = peak()\n"
              "total = sum(float(t[-1]) for t in w.values())\n"
              "print(loaded - base, total)\n")
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script, path], check=True, capture_output=True, text=True, env=env)
    grown, total = out.stdout.split()
    assert float(total) == 0 + 1 + 2 + 3
    assert int(grown) < 16 << 20, f"load_file grew the peak RSS by {int(grown) >> 20} MiB for a 128 MiB file"


@pytest.mark.parametrize("content, message", [
    (b"", "truncated file (0 bytes"),
    (b"\x01\x02\x03", "truncated file (3 bytes"),
    (struct.pack("<Q", 100) + b"{}", "header length 100 runs past the end of the file (10 bytes)"),
    (struct.pack("<Q", 3) + b"{x}", "malformed JSON header"),
    (struct.pack("<Q", 2) + b"[]", "the header must be a JSON object"),
    (struct.pack("<Q", 10) + b'{"a": 7}  ', "tensor a must be a JSON object"),
    (struct.pack("<Q", 54) + b'{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}' + b"\0" * 8,
     "tensor a has dtype 'F64'"),
])
def test_malformed_files_are_value_errors(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        st.load_file(str(path))
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value), str(e.value)


def test_a_byte_range_that_does_not_fit_is_a_value_error(tmp_path):
    for offsets, data in (([0, 8], b"\0" * 4), ([0, 4], b"\0" * 8), ([4, 12], b"\0" * 8)):
        write_raw(tmp_path / "r.safetensors", {"a": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}, data)
        with pytest.raises(ValueError, match="has byte range"):
            st.load_file(str(tmp_path / "r.safetensors"))
