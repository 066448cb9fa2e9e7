"""The C++ op cases (cases/) as the Python tests and scripts/torch_compare.py read them.

tests/support/export_cases.cc (the build's tests/detdit_export_cases) writes a suite's cases
as one safetensors file each and an index.json: per case its inputs (the bytes of the case's
own generator), its plans' index tensors, its non-tensor arguments (eps, activation, ...) and,
unless exported --forward-only, every output as the case computes it on the CPU (the
reference backend the C++ suites, `detdit verify` and `detdit bench` compare with). load()
reads them back as Case objects; export() runs the program, export_for_tests() with the
cases the tests read (also as ``python3 tests/python/op_cases.py DIR``, which needs neither
torch nor the extension: scripts/torch_compile_check.sh runs it outside its chroot).
"""
import json
import os
import subprocess
import sys

PROGRAM = "detdit_export_cases"
# Cases the tests read beyond the export's default size (op and name: export()'s --case).
NAMED = [f"{op} {dtype} H=20 interleaved_S257_T3_B2{suffix}"
         for op, suffix in (("gate_residual", " contiguous gate"), ("adaln_row_gather", ""))
         for dtype in ("float32", "bfloat16", "float16")]
NAMED += ["rmsnorm modulated bfloat16 H=20 interleaved_S257_T3_B2",
          "adaln_modulation bfloat16 H=20 D=24 interleaved_S257_T3_B2",
          "final_adaln_out bfloat16 H=20 D=24 interleaved_S257_T3_B2",
          # past the size limit since the family conventions' smaller cases joined the op
          "timestep_sinusoid float32 T=8192 C=2"]


def program_path(build_dir=None):
    """The exporter of the build in build_dir (default $DETDIT_BUILD_DIR), or a message saying
    why there is none."""
    build_dir = build_dir or os.environ.get("DETDIT_BUILD_DIR")
    if not build_dir:
        return None, (f"DETDIT_BUILD_DIR is not set: the op cases come from the C++ build's "
                      f"tests/{PROGRAM} (build it: cmake --build build --target {PROGRAM})")
    path = os.path.join(build_dir, "tests", PROGRAM)
    if not os.access(path, os.X_OK):
        return None, (f"{path} is missing: build it (cmake --build {build_dir} --target {PROGRAM}); "
                      f"the op-case tests need the C++ cases' inputs and outputs")
    return path, None


def export(out_dir, *args, build_dir=None):
    """Runs the exporter into out_dir with the given arguments (e.g. "--op", "rmsnorm");
    raises RuntimeError with its output when it fails or is missing."""
    path, why = program_path(build_dir)
    if path is None:
        raise RuntimeError(why)
    run = subprocess.run([path, "--out", str(out_dir), *args], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{PROGRAM} failed (exit {run.returncode}): {run.stdout}{run.stderr}")
    return out_dir


def export_for_tests(out_dir, build_dir=None):
    """The export the tests read (load_for_tests): the default set in out_dir/default, NAMED in
    out_dir/named."""
    export(os.path.join(out_dir, "default"), build_dir=build_dir)
    export(os.path.join(out_dir, "named"), *(arg for name in NAMED for arg in ("--case", name)), build_dir=build_dir)
    return out_dir


def load_for_tests(directory):
    """The cases export_for_tests wrote."""
    return load(os.path.join(directory, "default")) + load(os.path.join(directory, "named"))


class Case:
    """One exported op case: ``tensors`` {name: CPU tensor} (inputs, and the expected outputs
    where the export ran the case), ``inputs`` and ``outputs`` the specs of each (name, phase,
    dtype, shape, position_dim), ``arguments`` {name: str}, ``plans`` {name: spec}."""

    def __init__(self, directory, entry, copy=True):
        self.op, self.name, self.file = entry["op"], entry["name"], entry["file"]
        self.numerics = entry["numerics"]
        self.arguments = entry["arguments"]
        self.has_backward = entry["has_backward"]
        self.outputs_written = entry["outputs_written"]
        self.inputs = [t for t in entry["tensors"] if not t["output"]]
        self.outputs = [t for t in entry["tensors"] if t["output"]]
        self.plans = {p["name"]: p for p in entry["plans"]}
        from detdit.safetensors import load_file  # here: export() runs without the extension
        # copies: the mapped views would keep the file open and are not resizable (copy=False: the
        # views, for cases of gigabytes that are copied to a device anyway)
        tensors = load_file(os.path.join(directory, self.file))
        self.tensors = {k: v.clone() for k, v in tensors.items()} if copy else tensors

    def __repr__(self):
        return f"{self.op} {self.name}"

    def __getitem__(self, name):
        return self.tensors[name]

    def __contains__(self, name):
        return name in self.tensors

    def eps(self):
        return float(self.arguments["eps"])

    def index(self, name="plan"):
        """(timestep_indices, token_tags) int64 (S,) of the plan's index case."""
        return self.tensors[name + ".timestep_indices"], self.tensors[name + ".token_tags"]

    def rows(self, name="plan"):
        """The (S,) row of each position: ti*3 + tag (AdaLN rows) or ti (timestep rows)."""
        ti, tags = self.index(name)
        return ti * 3 + tags if self.plans[name]["rows"] == "adaln" else ti

    def plan(self, name="plan", device="cpu"):
        """The binding's plan of the case's plan `name`, as the C++ case builds it."""
        import detdit
        spec = self.plans[name]
        ti, tags = (t.to(device) for t in self.index(name))
        if spec["rows"] == "adaln":
            return detdit.plan(ti, tags, spec["num_timesteps"], batch=spec["batch"])
        return detdit.plan_from_rows(ti, spec["num_timesteps"], batch=spec["batch"])


def load(directory, copy=True):
    """Every case of an export, in the index's order (copy=False: tensors are views of the
    mapped files)."""
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    return [Case(directory, entry, copy) for entry in index["cases"]]


def find(cases, op, name=None):
    """The first case of op (whose name is `name`, when given); a KeyError naming what the
    export has otherwise."""
    for c in cases:
        if c.op == op and (name is None or c.name == name):
            return c
    raise KeyError(f"no exported {op} case named {name!r}; the export has: "
                   f"{[c.name for c in cases if c.op == op]}")


def form_chunker(c, grad_name):
    """The views of a C++ form case's modulation (cases/forms_cases.cc) as a function of its
    parent ((B, 6, H) per sample, (B, F, 6, H) per frame, (B, S, 6, H) per token): chunk i
    as parent[:, i] / parent[:, :, i], or with the chunk dimension kept (parent[:, i:i+1] /
    parent[:, :, i:i+1]) where the case's gradient output (grad_name, the view's shape) has
    the parent's rank; grad_name None: without it (a forward-only export lists no gradient)."""
    rank = c["modulation"].dim()
    keep = grad_name is not None and len(next(t for t in c.outputs if t["name"] == grad_name)["shape"]) == rank

    def views(parent, chunks):
        picked = [slice(i, i + 1) if keep else i for i in chunks]
        return [parent[:, i] if rank == 3 else parent[:, :, i] for i in picked]
    return views


def form_views(c, chunks, grad_name):
    """Chunks `chunks` of the case's own modulation parent (form_chunker)."""
    return form_chunker(c, grad_name)(c["modulation"], chunks)


def is_form_case(c):
    return "upcast" in c.arguments


def table_chunk(table, hidden, chunk):
    """Chunk `chunk` of (R, 6H) AdaLN rows as the (R, H) strided view the C++ case reads."""
    return table[:, chunk * hidden:(chunk + 1) * hidden]



if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: DETDIT_BUILD_DIR=build python3 tests/python/op_cases.py DIR")
    try:
        export_for_tests(sys.argv[1])
    except RuntimeError as e:
        sys.exit(f"op_cases.py: {e}")
