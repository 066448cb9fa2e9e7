"""The package's surface: detdit.__version__ is the repository's VERSION (python/setup.py
writes it), and `import detdit` alone makes detdit.nn and detdit.safetensors available."""
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
