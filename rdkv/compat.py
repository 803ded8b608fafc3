"""The one name transformers changed within rdkv's supported range: a model's cache keyword.

transformers 5.25 renamed ``past_key_values`` to ``cache`` in a forward's and ``generate``'s arguments and in a
model output's fields (the old names still work there, with a deprecation warning); 5.2 knows only
``past_key_values``. rdkv passes and reads the cache under the installed version's name, and so can its users."""
from typing import Any

from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE_KWARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_kwargs(cache: Cache | None) -> dict[str, Cache | None]:
    """The keyword argument that hands ``cache`` to a forward or ``generate`` on the installed transformers:
    ``model.generate(ids, **rdkv.cache_kwargs(cache), max_new_tokens=32)`` runs warning-free on 5.2 and 5.25+.

    Args:
        cache: the cache to pass (a :class:`rdkv.TriZoneCache`, a ``DynamicCache``, or ``None``).
    """
    return {CACHE_KWARG: cache}


def output_cache(out: Any) -> Cache | None:
    """The cache a model output carries (``out.cache`` on transformers 5.25+, ``out.past_key_values`` before).

    Args:
        out: what a forward of a transformers model returned.
    """
    return getattr(out, CACHE_KWARG)
