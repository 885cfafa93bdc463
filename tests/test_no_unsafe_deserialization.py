"""No code of the services can turn received bytes into code: no pickle (nor what uses it
underneath: torch.load without weights_only=True, torch.distributed's *_object
collectives, shelve, marshal, dill, joblib), no eval/exec, no yaml.load, no numpy load with
pickles allowed. State and checkpoints are safetensors and JSON (docs/security.md).

A syntax-tree scan of every module under services/, so a new use fails here with its file
and line, however it is spelled (``from pickle import loads`` too)."""

from __future__ import annotations

import ast
import pathlib

from support import parse_python

SERVICES = pathlib.Path(__file__).resolve().parent.parent / "services"
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal", "copyreg"}
BANNED_BUILTINS = {"eval", "exec"}
TORCH_PICKLING = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
                  "recv_object_list"}


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name and isinstance(kw.value, ast.Constant):
            return kw.value.value
    return None


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def findings(source: str, where: str) -> list[str]:
    """Every unsafe deserialization in one module's source, as 'where:line: what'."""
    out = []
    for node in ast.walk(parse_python(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            out += [f"{where}:{line}: import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            out.append(f"{where}:{line}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            last = name.rsplit(".", 1)[-1]
            if isinstance(node.func, ast.Name) and name in BANNED_BUILTINS:
                out.append(f"{where}:{line}: {name}()")
            elif name.endswith("torch.load"):
                if _keyword(node, "weights_only") is not True:
                    out.append(f"{where}:{line}: {name}() without weights_only=True")
            elif last in TORCH_PICKLING:
                out.append(f"{where}:{line}: {name}() pickles what other processes send")
            elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                out.append(f"{where}:{line}: {name}()")
            elif last == "load" and name.split(".")[0] in ("np", "numpy") and _keyword(node, "allow_pickle") is True:
                out.append(f"{where}:{line}: {name}(allow_pickle=True)")
    return out


def test_the_scan_finds_each_kind_it_looks_for():
    bad = """
import pickle
from marshal import loads
torch.load(f)
torch.load(f, weights_only=False)
eval(text)
exec(code)
dist.all_gather_object(out, mine)
yaml.load(text)
np.load(f, allow_pickle=True)
"""
    assert len(findings(bad, "x.py")) == 9
    fine = "torch.load(f, weights_only=True)\nmodel.eval()\nnp.load(f)\nyaml.safe_load(t)\njson.loads(t)\n"
    assert findings(fine, "y.py") == []


def test_no_service_module_deserializes_unsafely():
    modules = sorted(SERVICES.rglob("*.py"))
    assert len(modules) > 100  # the scan sees the whole tree, not an empty folder
    found = [f for path in modules for f in findings(path.read_text(), str(path.relative_to(SERVICES)))]
    assert found == []
