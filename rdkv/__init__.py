"""rdkv: rate-distortion KV-cache compression for Hugging Face transformers decoders."""
from . import methods, models
from .api import compress
from .attention import install, record
from .calibrate import calibrate, fit_layer_gains, tune_prior
from .errors import BudgetInfeasible, CorruptFile, NotRecorded, RDKVError
from .fold import FoldPolicy
from .records import Record
from .io import load, save
from .layerwise import prefill
from .methods import RDKV
from .trizone import PackSpec, TriZoneCache

__all__ = ["record", "compress", "prefill", "install", "calibrate", "fit_layer_gains", "tune_prior", "save", "load", "RDKV",
           "FoldPolicy", "PackSpec", "TriZoneCache", "Record",
           "RDKVError", "BudgetInfeasible", "NotRecorded", "CorruptFile", "methods", "models"]
