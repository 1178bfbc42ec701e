"""The serving core ships into NVIDIA's Triton containers, where moepipe is not installed: it
imports nothing but the standard library, numpy and itself, and the copy the renderer puts
beside every Python model imports and works with moepipe and torch out of reach."""

import ast
import subprocess
import sys
from pathlib import Path

from moepipe.deploy.render.repository import SERVING_CORE, ship_serving_core
from moepipe.deploy.render.templates import templates_root
from moepipe.serving import core

CORE = Path(core.__file__).parent


def _imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports of a module (relative ones are the core's)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_core_imports_only_the_standard_library_numpy_and_itself():
    outside = {path.name: _imports(path) - set(sys.stdlib_module_names) - {"numpy"}
               for path in sorted(CORE.glob("*.py"))}
    assert {name: found for name, found in outside.items() if found} == {}


def test_every_python_model_gets_the_core_and_it_runs_without_moepipe(tmp_path):
    repo = tmp_path / "model_repo"
    python_models = sorted({p.parent.parent.name for p in templates_root().rglob("1/model.py")})
    for name in python_models:
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "1" / "model.py").write_text("")
    (repo / "ensemble" / "1").mkdir(parents=True)  # no model.py: nothing shipped
    shipped = ship_serving_core(repo)
    assert sorted(p.parent.parent.name for p in shipped) == python_models
    assert {"tensorrt_llm", "tensorrt_llm_bls", "preprocessing", "postprocessing"} \
        <= set(python_models)
    assert not (repo / "ensemble" / "1" / SERVING_CORE).exists()
    check = ("import sys\n"
             "sys.modules.update(moepipe=None, torch=None, transformers=None)\n"
             "import numpy as np\n"
             "from serving_core import contract, checks, frontend, triton\n"
             "rows = contract.parse({'input_ids': np.array([[1, 2]], np.int32),\n"
             "                       'request_output_len': np.array([[3]], np.int32)},\n"
             "                      decoupled=True, exclude_default=False)\n"
             "checks.check_rows(rows, checks.Limits(10, 8, 16))\n"
             "print(rows[0].prompt)\n")
    done = subprocess.run([sys.executable, "-c", check], cwd=shipped[0].parent,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "[1, 2]\n", done.stderr
