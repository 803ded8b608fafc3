"""rdkv: rate-distortion KV-cache compression for Hugging Face transformers decoders."""
from . import methods, models
from .api import CompressConfig, attach, compress, detach, release
from .errors import RDKVError
from .io import load, save
from .trizone import PackSpec, TriZoneCache

__all__ = ["attach", "compress", "detach", "release", "save", "load", "CompressConfig", "PackSpec", "TriZoneCache",
           "RDKVError", "methods", "models"]
