"""The top-level ``kernels/`` and ``solvers/`` never hide an installed package of their name, and still import as
``rdkv.kernels`` / ``rdkv.solvers``: from the repository root (the root first on ``sys.path``, as ``python -m
pytest``, ``python -c``, a notebook or an IDE start it) and from an installed wheel."""
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.metadata, importlib.util, json, sys
sys.path.insert(0, sys.argv[1])
import transformers.activations
from transformers import LlamaForCausalLM
import rdkv, rdkv.kernels.cpu_dequant, rdkv.solvers.mckp
top = importlib.util.find_spec("kernels")
try:
    installed = str(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
except importlib.metadata.PackageNotFoundError:
    installed = None
print(json.dumps({"kernels_origin": top.origin if top else None, "kernels_installed": installed, "rdkv": rdkv.__file__,
                  "rdkv.kernels": list(rdkv.kernels.__path__), "cpu_dequant": rdkv.kernels.cpu_dequant.__file__,
                  "mckp": rdkv.solvers.mckp.__file__, "model": LlamaForCausalLM.__name__}))
"""


def probe(cwd: Path, first: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(first)], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_root_first_on_path_keeps_installed_kernels_and_our_kernels():
    got = probe(ROOT, ROOT)
    # the name `kernels` is Hugging Face's package where installed (transformers >= 5.25 requires it); elsewhere at
    # most the namespace folder, which has no origin: never a regular package of the repository's
    assert got["kernels_origin"] == got["kernels_installed"], got
    assert Path(got["rdkv"]) == ROOT / "rdkv" / "__init__.py"
    assert got["rdkv.kernels"] == [str(ROOT / "kernels")]
    assert Path(got["cpu_dequant"]) == ROOT / "kernels" / "cpu_dequant.py"
    assert Path(got["mckp"]) == ROOT / "solvers" / "mckp.py"
    assert got["model"] == "LlamaForCausalLM"


def test_wheel_installs_kernels_and_solvers_inside_rdkv(tmp_path):
    src = tmp_path / "src"  # a copy, so that the build leaves nothing in the checkout
    for name in ("rdkv", "kernels", "solvers"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("rdkv-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(site)
    assert {"rdkv/kernels/cpu_dequant.c", "rdkv/kernels/page_decode.py", "rdkv/solvers/mckp.py"} <= names
    assert not any(n.split("/")[0] in ("kernels", "solvers") for n in names), "a top-level import name was installed"
    got = probe(tmp_path, site)
    assert Path(got["rdkv"]) == site / "rdkv" / "__init__.py"
    assert Path(got["cpu_dequant"]) == site / "rdkv" / "kernels" / "cpu_dequant.py"
    assert Path(got["mckp"]) == site / "rdkv" / "solvers" / "mckp.py"
