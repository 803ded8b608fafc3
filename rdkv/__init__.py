"""rdkv: rate-distortion KV-cache compression for Hugging Face transformers decoders."""
import importlib.util as _importlib_util
import sys as _sys
from importlib.machinery import ModuleSpec as _ModuleSpec
from pathlib import Path as _Path


def _source_tree_subpackages() -> None:
    """Make ``rdkv.kernels`` / ``rdkv.solvers`` of a source tree's top-level ``kernels/`` and ``solvers/``.

    Those folders have no ``__init__.py``: a regular package at the repository root would hide Hugging Face's
    ``kernels`` (which transformers imports) whenever the root is on ``sys.path``, while a namespace folder
    loses to any installed package of its name. A wheel puts them inside ``rdkv/``, found the ordinary way;
    in a source tree (editable installs included) they are found here, beside ``rdkv/``."""
    here = _Path(__file__).resolve().parent
    if not (here.parent / "setup.cfg").is_file():
        return
    for name in ("kernels", "solvers"):
        folder = here.parent / name
        if (here / name).is_dir() or not folder.is_dir():
            continue
        spec = _ModuleSpec(f"{__name__}.{name}", None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        module = _importlib_util.module_from_spec(spec)
        _sys.modules[spec.name] = module
        globals()[name] = module


_source_tree_subpackages()

from . import methods, models
from .api import compress
from .attention import install, record
from .calibrate import calibrate, fit_layer_gains, tune_prior
from .compat import cache_kwargs
from .errors import BudgetInfeasible, CorruptFile, NotRecorded, RDKVError
from .fold import FoldPolicy
from .records import Record
from .io import load, save
from .layerwise import prefill
from .methods import RDKV
from .layout import PackSpec
from .trizone import TriZoneCache

__all__ = ["record", "compress", "prefill", "install", "calibrate", "cache_kwargs", "fit_layer_gains", "tune_prior", "save", "load", "RDKV",
           "FoldPolicy", "PackSpec", "TriZoneCache", "Record",
           "RDKVError", "BudgetInfeasible", "NotRecorded", "CorruptFile", "methods", "models"]
