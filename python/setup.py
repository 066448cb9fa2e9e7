"""Builds the detdit PyTorch extension (detdit._C) against the installed torch.

The extension links the static detdit library built by CMake. Its build
directory is $DETDIT_BUILD_DIR (default: <repo>/build); build it first:

    cmake -S . -B build -G Ninja && cmake --build build --target detdit
    /usr/bin/python3 python/setup.py build_ext --inplace      # or
    pip install --no-build-isolation ./python

Any build of libdetdit.a works with any torch that uses the new libstdc++ ABI: with a CUDA build of torch the
CUDA ops run on torch's current stream; a CUDA build of the library under a
CPU-only torch links the toolkit's static cudart ($CUDA_HOME) and serves CPU
tensors.
"""
import glob
import os
import subprocess
import sys

import torch
from setuptools import setup
from torch.utils import cpp_extension

here = os.path.dirname(os.path.abspath(__file__))
repo = os.path.dirname(here)
build_dir = os.path.abspath(os.environ.get("DETDIT_BUILD_DIR", os.path.join(repo, "build")))
library = os.path.join(build_dir, "libdetdit.a")
os.chdir(here)  # setuptools wants paths relative to setup.py; its build/ lands in python/


def fail(message):
    sys.exit("detdit setup.py: " + message)


if not os.path.isfile(library):
    fail(f"{library} not found: build the C++ library first "
         f"(cmake -S {repo} -B {build_dir} -G Ninja && cmake --build {build_dir} --target detdit) "
         "or point DETDIT_BUILD_DIR at its build directory")

# The library's C++ API passes std::string (Status messages), so it must use
# torch's libstdc++ ABI. CMake builds it with the compiler default, the new ABI.
if not torch._C._GLIBCXX_USE_CXX11_ABI:
    fail("this torch uses the pre-C++11 libstdc++ ABI (torch._C._GLIBCXX_USE_CXX11_ABI is False) but libdetdit.a "
         "is built with the new one: use a torch built with the new ABI (Debian's python3-torch, pip torch >= 2.7)")

members = subprocess.run(["ar", "t", library], check=True, capture_output=True, text=True).stdout.split()
library_has_cuda = not any(m.startswith("cuda_unavailable") for m in members)
torch_has_cuda = torch.version.cuda is not None
# A CUDA build of the library needs the CUDA runtime: a CUDA torch brings its
# (shared) cudart; with a CPU-only torch the static cudart of the toolkit that
# built the library is linked, and only CPU tensors can reach detdit anyway.
libraries, library_dirs = ["pthread"], []
if library_has_cuda and not torch_has_cuda:
    cuda_home = os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME or "/usr/local/cuda"
    cudart = [d for d in (os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "targets", "x86_64-linux", "lib"))
              if os.path.isfile(os.path.join(d, "libcudart_static.a"))]
    if not cudart:
        fail(f"{library} is a CUDA build and this torch ({torch.__version__}) has no CUDA, so the extension links "
             f"the toolkit's libcudart_static.a, which is not under {cuda_home} (set CUDA_HOME), or build detdit "
             "with -DDETDIT_ENABLE_CUDA=OFF")
    libraries, library_dirs = ["cudart_static", "dl", "rt", "pthread"], cudart[:1]

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
    version="0.1.0",
    description="Deterministic conditioning-path kernels for diffusion transformers (PyTorch binding)",
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
            extra_objects=[library],
            # rebuild when the library, its public headers or the binding's headers change
            depends=[library] + sorted(glob.glob(os.path.join(repo, "include", "detdit", "*.h")))
            + sorted(glob.glob(os.path.join(here, "detdit", "csrc", "*.h"))),
            libraries=libraries,
            extra_link_args=link_args,
            library_dirs=library_dirs,
        )
    ],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.9",
)
