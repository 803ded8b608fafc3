"""rdkv: rate-distortion KV-cache compression for Hugging Face transformers decoders."""
from . import models
from .api import CompressConfig, attach, compress, detach, release
from .errors import RDKVError
from .trizone import PackSpec, TriZoneCache

__all__ = ["attach", "compress", "detach", "release", "CompressConfig", "PackSpec", "TriZoneCache", "RDKVError", "models"]
