"""Every code example in README.md and docs/*.md runs, on the CPU (pytest; part of
scripts/test.sh, so of CI).

A fenced block's info string says what it is:
- ``sh``: run by ``bash -euo pipefail`` in a scratch copy of the repository (its tracked
  files; ``build/`` links to the build the tests use, $DETDIT_BUILD_DIR or build/), with
  Debian's /usr/bin first on PATH;
- ``python``: run by this interpreter (/usr/bin/python3 in CI) with the extension from
  python/, in the same scratch copy;
- ``cpp`` / ``c++``: a block with ``main()`` is compiled against include/ and libdetdit.a,
  linked and run; one without is an op case (cases/) and is compiled (-fsyntax-only)
  against the repository's headers, not run, since a case only runs linked into a driver;
- ``text``: pseudo-code, synopses, output, trees: not run.
A block without an info string fails test_every_block_says_what_it_is, so no example is
left unrun by omission. A comment on the line before a fence changes that block:
- ``<!-- doc-test: skip REASON -->``: not run; pytest reports the skip with REASON (for
  examples that need a GPU, MPI across GPUs, or minutes);
- ``<!-- doc-test: prelude FILE -->`` (python): FILE, under tests/docs/, runs first and
  defines the inputs the example takes as given.
"""
import glob
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.abspath(os.environ.get("DETDIT_BUILD_DIR") or os.path.join(REPO, "build"))
DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
RUN_TAGS = {"sh", "python", "cpp", "c++"}
TIMEOUT_S = 900

_FENCE = re.compile(r"^(\s*)```(.*)$")
_DIRECTIVE = re.compile(r"^\s*<!-- doc-test: (skip|prelude) (.+?) -->\s*$")


class Block:
    def __init__(self, doc, line, tag, code, directive):
        self.doc, self.line, self.tag, self.code = doc, line, tag, code
        self.skip = directive.group(2) if directive and directive.group(1) == "skip" else None
        self.prelude = directive.group(2) if directive and directive.group(1) == "prelude" else None

    @property
    def name(self):
        return f"{self.doc}:{self.line}:{self.tag or 'untagged'}"


def blocks_of(doc):
    lines = open(os.path.join(REPO, doc)).read().split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening:
            indent, start, body = opening.group(1), i, []
            i += 1
            while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            assert i < len(lines), f"{doc}:{start + 1}: the fence opened here is never closed"
            directive = _DIRECTIVE.match(lines[start - 1]) if start > 0 else None
            found.append(Block(doc, start + 1, opening.group(2).strip(), "\n".join(body) + "\n", directive))
        i += 1
    return found


ALL_BLOCKS = [b for doc in DOCS for b in blocks_of(doc)]
RUNNABLE = [b for b in ALL_BLOCKS if b.tag in RUN_TAGS]


def test_every_block_says_what_it_is():
    problems = [f"{b.name}: no info string (sh, python, cpp, c++ or text)" for b in ALL_BLOCKS if not b.tag]
    problems += [f"{b.name}: unknown info string {b.tag!r}" for b in ALL_BLOCKS if b.tag and b.tag not in
                 RUN_TAGS | {"text"}]
    problems += [f"{b.name}: a doc-test comment on a text block" for b in ALL_BLOCKS
                 if b.tag == "text" and (b.skip or b.prelude)]
    problems += [f"{b.name}: prelude {b.prelude} is not a file under tests/docs/" for b in ALL_BLOCKS if b.prelude
                 and not os.path.isfile(os.path.join(REPO, "tests", "docs", os.path.basename(b.prelude)))]
    problems += [f"{b.name}: a prelude on a {b.tag} block (python only)" for b in ALL_BLOCKS
                 if b.prelude and b.tag != "python"]
    assert not problems, "\n".join(problems)
    assert len(RUNNABLE) >= 10, f"only {len(RUNNABLE)} runnable blocks found: is the parser broken?"


@pytest.fixture(scope="session")
def scratch(tmp_path_factory):
    """A copy of the repository's tracked files (as in the working tree) whose build/ is the
    tests' build, so examples may write where they like."""
    root = tmp_path_factory.mktemp("docs") / "detdit"
    files = subprocess.run(["git", "-C", REPO, "ls-files", "-z"], check=True, capture_output=True).stdout
    for rel in files.decode().split("\0"):
        source = os.path.join(REPO, rel)
        if rel and os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            shutil.copy2(source, os.path.join(root, rel))
    os.symlink(BUILD, os.path.join(root, "build"))
    return str(root)


def run(command, cwd, env=None):
    """Runs command in its own process group (an example may start processes), killed whole
    past TIMEOUT_S; asserts it exits 0."""
    env = dict(os.environ, **(env or {}))
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{command[0]} ran past {TIMEOUT_S} s:\n{output[-4000:]}")
    assert process.returncode == 0, f"exit {process.returncode}:\n{output[-8000:]}"
    return output


def link_libraries():
    """What a program linking libdetdit.a needs besides it: the static cudart of a CUDA build."""
    members = subprocess.run(["ar", "t", os.path.join(BUILD, "libdetdit.a")], check=True, capture_output=True,
                             text=True).stdout.split()
    if any(m.startswith("cuda_unavailable") for m in members):
        return ["-lpthread"]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return [f"-L{cuda_home}/lib64", "-lcudart_static", "-ldl", "-lrt", "-lpthread"]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_example_runs(block, scratch, tmp_path):
    if block.skip:
        pytest.skip(f"{block.name}: {block.skip}")
    source = tmp_path / "example"
    if block.tag == "sh":
        # Debian 12's commands (python3, pip) first, as on the machine the docs describe
        path = "/usr/bin:/bin:" + os.environ.get("PATH", "")
        run(["bash", "-euo", "pipefail", "-c", block.code], scratch, {"PATH": path, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    elif block.tag == "python":
        code = block.code
        if block.prelude:
            with open(os.path.join(REPO, "tests", "docs", os.path.basename(block.prelude))) as f:
                code = f.read() + "\n" + code
        source.with_suffix(".py").write_text(code)
        pythonpath = os.path.join(REPO, "python") + os.pathsep + os.environ.get("PYTHONPATH", "")
        run([sys.executable, str(source.with_suffix(".py"))], scratch, {"PYTHONPATH": pythonpath})
    elif re.search(r"\bint main\(", block.code):
        source.with_suffix(".cc").write_text(block.code)
        run(["g++", "-std=c++17", "-O1", "-I", os.path.join(REPO, "include"), str(source.with_suffix(".cc")),
             os.path.join(BUILD, "libdetdit.a"), *link_libraries(), "-o", str(source)], scratch)
        run([str(source)], scratch)
    else:
        source.with_suffix(".cc").write_text(block.code)
        run(["g++", "-std=c++17", "-fsyntax-only", *(f"-I{os.path.join(REPO, d)}" for d in ("include", "src", "")),
             str(source.with_suffix(".cc"))], scratch)


def test_documented_signatures_are_the_real_ones():
    """docs/python.md's table of functions: each row's parameters are the function's, in its
    order, with its defaults; only a last ``numerics`` may be left out (the text above the
    table describes it), since leaving out a middle one misplaces every positional argument
    after it."""
    import ast
    import inspect

    import detdit

    rows = re.findall(r"^\| `(\w+)\((.*?)\)` \|", open(os.path.join(REPO, "docs", "python.md")).read(), re.M)
    assert len(rows) >= 10, f"only {len(rows)} function rows found in docs/python.md"
    problems = []
    for name, documented in rows:
        params = list(inspect.signature(getattr(detdit, name)).parameters.values())
        given = [p.strip() for p in documented.replace("\\|", "|").split(",")]
        if len(given) == len(params) - 1 and params[-1].name == "numerics":
            params = params[:-1]
        names = [g.split("=")[0].strip() for g in given]
        if names != [p.name for p in params]:
            problems.append(f"{name}: documented ({', '.join(names)}), real ({', '.join(p.name for p in params)})")
            continue
        for g, p in zip(given, params):
            if "=" not in g:
                if p.default is not inspect.Parameter.empty:
                    problems.append(f"{name}: {p.name} has a default ({p.default!r}) the table does not show")
                continue
            text = g.split("=", 1)[1].strip()
            value = ast.literal_eval(text.split("|")[0])  # a choice, "none"|"silu", lists the default first
            if value != p.default:
                problems.append(f"{name}: {p.name} defaults to {p.default!r}, documented {text}")
    assert not problems, "\n".join(problems)
