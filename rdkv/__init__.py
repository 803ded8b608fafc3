"""rdkv: rate-distortion KV-cache compression for Hugging Face transformers decoders."""
from . import methods, models
from .api import CompressConfig, attach, compress, detach, release
from .calibrate import calibrate, fit_layer_gains, tune_prior
from .errors import BudgetInfeasible, CorruptFile, NotRecorded, RDKVError
from .fold import FoldPolicy
from .io import load, save
from .trizone import PackSpec, TriZoneCache

__all__ = ["attach", "calibrate", "fit_layer_gains", "tune_prior", "compress", "detach", "release", "save", "load", "CompressConfig", "FoldPolicy", "PackSpec", "TriZoneCache",
           "RDKVError", "BudgetInfeasible", "NotRecorded", "CorruptFile", "methods", "models"]
