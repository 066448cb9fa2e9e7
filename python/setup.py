"""Builds the detdit Python package and its PyTorch extension (detdit._C) against the installed torch.

One step, from a clone of the repository, in an environment that has torch:

    pip install --no-build-isolation ./python

first builds the C++ library with CMake (cmake and a C++17 compiler on PATH; docs/python.md):
libdetdit.a alone (-DDETDIT_LIBRARY_ONLY=ON: no IO library, so neither nlohmann-json nor
OpenSSL; no MPI or NCCL: the extension communicates through torch.distributed), with this
torch's libstdc++ ABI (torch._C._GLIBCXX_USE_CXX11_ABI), and with
the CUDA backend exactly when this torch has CUDA (then nvcc must be under torch's CUDA_HOME),
in setuptools' build directory (python/build/), so a second install rebuilds incrementally.
DETDIT_CMAKE_ARGS adds arguments to that CMake configuration (e.g.
-DDETDIT_CUDA_ARCHITECTURES=90).

DETDIT_BUILD_DIR=DIR links DIR/libdetdit.a, a library built beforehand, instead:

    cmake -S . -B build -G Ninja && cmake --build build --target detdit
    DETDIT_BUILD_DIR=$PWD/build pip install --no-build-isolation ./python

Either way the library's ABI must be torch's (its symbols are read with nm; a mismatch is
refused). A CUDA build of the library under a CPU-only torch links the toolkit's static cudart
($CUDA_HOME) and serves CPU tensors. The version is the repository's VERSION file.
"""
import glob
import os
import shlex
import shutil
import subprocess
import sys

try:
    import torch
except ImportError as error:
    # The usual cause: pip isolated the build (it installs its own torch, or none, in a
    # temporary environment), or the python3 that builds is not the one with torch (a pyenv
    # or other python3 first on PATH, or a venv made from it).
    sys.exit(f"detdit setup.py: torch cannot be imported by {sys.executable} (Python "
             f"{sys.version.split()[0]}): {error}.\n"
             "The extension is built against the torch it will run with (its headers and its libstdc++ "
             "ABI), so torch must be installed in the environment that builds it, and pip must not "
             "isolate the build:\n"
             "    pip install --no-build-isolation ./python\n"
             "run by a Python that can `import torch` (Debian: apt-get install python3-torch, then "
             "/usr/bin/python3 -m venv --system-site-packages venv; docs/python.md).")
from setuptools import setup
from torch.utils import cpp_extension

here = os.path.dirname(os.path.abspath(__file__))
repo = os.path.dirname(here)
# relative to the directory setup.py (or pip) was started in, resolved before the chdir
prebuilt_dir = os.path.abspath(os.environ["DETDIT_BUILD_DIR"]) if os.environ.get("DETDIT_BUILD_DIR") else None
os.chdir(here)  # setuptools wants paths relative to setup.py; its build/ lands in python/


def fail(message):
    sys.exit("detdit setup.py: " + message)


with open(os.path.join(repo, "VERSION")) as f:
    version = f.readline().strip()
# detdit.__version__ comes from this generated file (python/.gitignore), so the package
# reports the version it was built from, installed or used in place.
with open(os.path.join(here, "detdit", "_version.py"), "w") as f:
    f.write(f'__version__ = "{version}"  # written by python/setup.py from VERSION\n')

torch_has_cuda = torch.version.cuda is not None
torch_new_abi = bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def run(command, what):
    print("detdit setup.py: " + " ".join(shlex.quote(c) for c in command), flush=True)
    if subprocess.run(command).returncode != 0:
        fail(f"{what} failed (its output is above): {' '.join(shlex.quote(c) for c in command)}")


def build_library(build_temp):
    """Configures and builds libdetdit.a for this torch; returns its path."""
    cmake = shutil.which("cmake")
    if cmake is None:
        fail("cmake not found on PATH: install it (Debian: apt-get install cmake ninja-build), or build the library "
             "yourself and point DETDIT_BUILD_DIR at its build directory")
    build_dir = os.path.join(os.path.abspath(build_temp), "libdetdit")
    configure = [cmake, "-S", repo, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", "-DDETDIT_LIBRARY_ONLY=ON",
                 "-DDETDIT_ENABLE_MPI=OFF", "-DDETDIT_ENABLE_NCCL=OFF", f"-DDETDIT_CXX11_ABI={int(torch_new_abi)}"]
    # the generator is chosen once, when the build directory is created
    if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")) and shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    if torch_has_cuda:
        # the toolkit torch's extension build uses (CUDA_HOME), so both halves agree
        nvcc = os.path.join(cpp_extension.CUDA_HOME or "/usr/local/cuda", "bin", "nvcc")
        if not os.path.isfile(nvcc):
            fail(f"this torch ({torch.__version__}) has CUDA {torch.version.cuda} but {nvcc} does not exist: set "
                 "CUDA_HOME to a CUDA toolkit, or build the CPU kernels only with "
                 "DETDIT_CMAKE_ARGS=-DDETDIT_ENABLE_CUDA=OFF")
        configure += ["-DDETDIT_ENABLE_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    else:
        configure += ["-DDETDIT_ENABLE_CUDA=OFF"]
    configure += shlex.split(os.environ.get("DETDIT_CMAKE_ARGS", ""))  # last, so they win
    run(configure, "configuring libdetdit with CMake")
    run([cmake, "--build", build_dir, "--target", "detdit", "--parallel", str(os.cpu_count() or 1)],
        "building libdetdit")
    return os.path.join(build_dir, "libdetdit.a")


def check_abi(library):
    """The library's std::string must be torch's: a new-ABI object defines symbols tagged cxx11
    (e.g. Status::to_string[abi:cxx11]), an old-ABI one none."""
    symbols = subprocess.run(["nm", "--defined-only", library], check=True, capture_output=True, text=True).stdout
    library_new_abi = "cxx11" in symbols
    if library_new_abi != torch_new_abi:
        names = {True: "the new (C++11) libstdc++ ABI", False: "the pre-C++11 libstdc++ ABI"}
        fail(f"{library} uses {names[library_new_abi]} but this torch ({torch.__version__}) uses "
             f"{names[torch_new_abi]} (torch._C._GLIBCXX_USE_CXX11_ABI is {torch_new_abi}): configure the library "
             f"with -DDETDIT_CXX11_ABI={int(torch_new_abi)}, or leave DETDIT_BUILD_DIR unset to build it here")


def runtime_libraries(library):
    """(libraries, library_dirs) the extension needs besides torch's."""
    members = subprocess.run(["ar", "t", library], check=True, capture_output=True, text=True).stdout.split()
    library_has_cuda = not any(m.startswith("cuda_unavailable") for m in members)
    if not (library_has_cuda and not torch_has_cuda):
        return ["pthread"], []
    # A CUDA build of the library needs the CUDA runtime: a CUDA torch brings its (shared)
    # cudart; with a CPU-only torch the static cudart of the toolkit that built the library is
    # linked, and only CPU tensors can reach detdit anyway.
    cuda_home = os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME or "/usr/local/cuda"
    cudart = [d for d in (os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "targets", "x86_64-linux", "lib"))
              if os.path.isfile(os.path.join(d, "libcudart_static.a"))]
    if not cudart:
        fail(f"{library} is a CUDA build and this torch ({torch.__version__}) has no CUDA, so the extension links "
             f"the toolkit's libcudart_static.a, which is not under {cuda_home} (set CUDA_HOME), or build detdit "
             "with -DDETDIT_ENABLE_CUDA=OFF")
    return ["cudart_static", "dl", "rt", "pthread"], cudart[:1]


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, after it has the library: built here, or DETDIT_BUILD_DIR's."""

    def build_extensions(self):
        if prebuilt_dir:
            library = os.path.join(prebuilt_dir, "libdetdit.a")
            if not os.path.isfile(library):
                fail(f"{library} not found: DETDIT_BUILD_DIR must be a CMake build directory of detdit "
                     f"(cmake -S {repo} -B DIR -G Ninja && cmake --build DIR --target detdit), or leave it unset to "
                     "build the library here")
        else:
            library = build_library(self.build_temp)
        check_abi(library)
        libraries, library_dirs = runtime_libraries(library)
        for ext in self.extensions:
            ext.extra_objects = [library]
            ext.depends = ext.depends + [library]  # relink when the library changes
            ext.libraries = ext.libraries + libraries  # after torch's (CppExtension set those)
            ext.library_dirs = ext.library_dirs + library_dirs
        super().build_extensions()


# torch's process already holds the shared libstdc++. A compiler that links
# libstdc++ statically into shared objects (the GPU machine's CXX, /opt/gcc/bin/g++,
# does) would put a second copy inside the extension, and the two copies' locales
# do not mix: std::ostringstream << double, in the library's error messages,
# segfaulted there. Naming the shared library before the compiler's own
# libstdc++ resolves every std:: symbol to the one copy torch uses.
link_args = ["-l:libstdc++.so.6"]

torch_version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
compile_args = ["-O2", "-g0", "-ffp-contract=off", "-fno-fast-math"]
if torch_version < (2, 1):
    compile_args.append("-std=c++17")  # torch 1.x's cpp_extension defaults to C++14
macros = []
extension_class = cpp_extension.CppExtension
if torch_has_cuda:
    macros.append(("DETDIT_TORCH_CUDA", "1"))
    extension_class = cpp_extension.CUDAExtension  # adds the CUDA include path, cudart, c10_cuda

setup(
    name="detdit",
    version=version,
    description="Deterministic conditioning-path kernels for diffusion transformers (PyTorch binding)",
    license="Apache-2.0",
    packages=["detdit"],
    package_dir={"detdit": "detdit"},
    ext_modules=[
        extension_class(
            name="detdit._C",
            # one file per layer of the binding (detdit/csrc/*.h say what each holds)
            sources=[f"detdit/csrc/{name}.cpp" for name in
                     ("tensors", "plan", "ops", "distributed", "registration")],
            include_dirs=[os.path.join(repo, "include")],
            define_macros=macros,
            extra_compile_args={"cxx": compile_args} if torch_has_cuda else compile_args,
            # rebuild when the library's public headers or the binding's headers change
            depends=sorted(glob.glob(os.path.join(repo, "include", "detdit", "*.h")))
            + sorted(glob.glob(os.path.join(here, "detdit", "csrc", "*.h"))),
            extra_link_args=link_args,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
)
