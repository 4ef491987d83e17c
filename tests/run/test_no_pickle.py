"""No pickle on any load path: models, data and partitions come from safetensors, JSON, Arrow.

Unpickling runs code from the file, so a tampered model would run code on the user's machine.
The check reads the package source (``fedavg/``, ``strategies/``) as Python syntax, so words
in docstrings and comments do not count.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve",
                    "marshal"}


def _is_true(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for an attribute chain, ``""`` for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def pickle_uses(source: str) -> list[str]:
    """Lines of ``source`` that unpickle or import a pickling module, as ``"line: what"``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
        else:
            names = []
        found += [f"{node.lineno}: import {n}" for n in names if n in PICKLING_MODULES]
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        last = name.rsplit(".", 1)[-1]
        if last == "load" and name.split(".")[0] == "torch" and \
                not _is_true(_keyword(node, "weights_only")):
            found.append(f"{node.lineno}: {name}( without weights_only=True")
        if last == "load" and name.split(".")[0] in ("np", "numpy") and \
                _is_true(_keyword(node, "allow_pickle")):
            found.append(f"{node.lineno}: {name}( with allow_pickle=True")
        if last == "read_pickle" or (last in ("load", "loads", "Unpickler")
                                     and "pickle" in name):
            found.append(f"{node.lineno}: {name}(")
    return found


def package_files() -> list[Path]:
    files = sorted([*ROOT.glob("fedavg/**/*.py"), *ROOT.glob("strategies/**/*.py")])
    assert len(files) > 20, files  # the package really was found
    return files


def test_no_pickle_in_the_package():
    found = {str(p.relative_to(ROOT)): pickle_uses(p.read_text()) for p in package_files()}
    found = {path: uses for path, uses in found.items() if uses}
    assert not found, f"pickle on a load path: {found}"


@pytest.mark.parametrize("snippet", [
    "import pickle",
    "import joblib as jl",
    "from cloudpickle import loads",
    "import dill.settings",
    "import torch\nsd = torch.load('model.pt')",
    "import torch\nsd = torch.load(path, weights_only=False)",
    "import numpy as np\nx = np.load('x.npy', allow_pickle=True)",
    "import numpy\nx = numpy.load(f, allow_pickle=True)",
    "import pandas as pd\ndf = pd.read_pickle('d.pkl')",
])
def test_the_check_finds_pickle(snippet):
    assert pickle_uses(snippet), snippet


@pytest.mark.parametrize("snippet", [
    '"""Weights never go through pickle."""',
    "# no pickle here",
    "import torch\nsd = torch.load(path, weights_only=True)",
    "import numpy as np\nx = np.load('x.npy')",
    "import numpy as np\nx = np.load('x.npy', allow_pickle=False)",
    "from safetensors.torch import load_file\nsd = load_file('model.safetensors')",
    "import json\nmeta = json.loads(text)",
])
def test_the_check_lets_safe_loading_pass(snippet):
    assert pickle_uses(snippet) == [], snippet
