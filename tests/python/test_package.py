"""The package's surface: detdit.__version__ is the repository's VERSION (python/setup.py
writes it), `import detdit` alone makes detdit.nn and detdit.safetensors available, and
setup.py run without torch says what it needs."""
import os
import subprocess
import sys

import detdit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_version_is_the_version_file():
    with open(os.path.join(REPO, "VERSION")) as f:
        assert detdit.__version__ == f.readline().strip()


def test_import_detdit_brings_its_submodules():
    # a fresh interpreter: this one has imported the submodules explicitly elsewhere
    code = "import detdit; print(detdit.safetensors.load_file.__name__, detdit.nn.H3Conditioning.__name__)"
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["load_file", "H3Conditioning"]


def test_setup_without_torch_says_what_it_needs():
    # an interpreter that cannot import torch (a python3 without it, or pip's isolated build):
    # one message naming the need and the fix, no traceback
    setup = os.path.join(REPO, "python", "setup.py")
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; "
            f"runpy.run_path({setup!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    assert "torch cannot be imported by " + sys.executable in out.stderr, out.stderr
    assert "pip install --no-build-isolation ./python" in out.stderr, out.stderr
