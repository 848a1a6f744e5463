"""9. Static check: no pickle, marshal, shelve or dill, no unsafe yaml loading, no
allow_pickle=True, no torch.load, anywhere in the packages (an AST walk, so comments
and strings do not count and aliases do). This test's own list of names is the only
place they may appear."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.reliability.common import REPO, metric

PACKAGES = ("kvstore", "engine", "kernels", "api", "tools")
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle",
                     "joblib"}
UNSAFE_YAML = {"load", "load_all", "unsafe_load", "unsafe_load_all", "full_load", "full_load_all"}
SAFE_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def _findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    where = lambda node: f"{path.relative_to(REPO)}:{node.lineno}"  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"{where(node)} imports {a.name}" for a in node.names
                    if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                out.append(f"{where(node)} imports from {node.module}")
            if node.module == "numpy.lib.format" or (node.module.split(".")[0] == "yaml" and any(
                    a.name in UNSAFE_YAML for a in node.names)):
                out.append(f"{where(node)} imports an unsafe loader from {node.module}")
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant)
                                                     and kw.value.value is False):
                    out.append(f"{where(node)} passes allow_pickle={ast.unparse(kw.value)}")
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                if func.value.id == "yaml" and func.attr in UNSAFE_YAML:
                    loader = next((kw.value for kw in node.keywords if kw.arg == "Loader"),
                                  node.args[1] if len(node.args) > 1 else None)
                    name = ast.unparse(loader).split(".")[-1] if loader is not None else ""
                    if name not in SAFE_LOADERS:
                        out.append(f"{where(node)} calls yaml.{func.attr} without a safe Loader")
                if func.value.id == "torch" and func.attr == "load":
                    out.append(f"{where(node)} calls torch.load (pickle)")
                if func.value.id in ("pd", "pandas") and func.attr == "read_pickle":
                    out.append(f"{where(node)} calls read_pickle")
            if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
                out.append(f"{where(node)} calls {func.id}")
    return out


def test_no_unsafe_deserialisation_in_the_packages():
    files = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    findings = [f for p in files for f in _findings(p)]
    metric("static_check", files=len(files), findings=len(findings))
    assert len(files) > 50
    assert findings == [], "\n".join(findings)


def test_the_check_catches_what_it_looks_for(tmp_path, monkeypatch):
    """A check that cannot fail is a defect: feed it each pattern once."""
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom marshal import loads\nimport yaml\nimport numpy as np\n"
                   "yaml.load(s)\nyaml.load(s, Loader=yaml.Loader)\nnp.load(f, allow_pickle=True)\n"
                   "yaml.safe_load(s)\nyaml.load(s, Loader=yaml.SafeLoader)\nnp.load(f)\n"
                   "eval('1')\n")
    monkeypatch.setattr("tests.reliability.test_static.REPO", tmp_path)
    found = _findings(bad)
    assert len(found) == 6, found
