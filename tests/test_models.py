"""Tests for rdkv.models: GGUF conversion and caching, error messages, and the retrieval probe."""

import json
import time
from types import SimpleNamespace

import pytest
import torch
import transformers

import rdkv.models as models


@pytest.fixture(scope="module")
def smollm():
    """SmolLM2 from the default cache folder (converted there once, on the first run ever)."""
    return models.load("smollm2-135m")


def test_conversion_then_fast_reload(tmp_path, monkeypatch):
    monkeypatch.setenv("RDKV_CACHE_DIR", str(tmp_path))
    start = time.perf_counter()
    models.load("smollm2-135m")
    converted = time.perf_counter() - start
    folder = models.converted_dir("smollm2-135m")
    assert folder.parent == tmp_path and transformers.__version__ in folder.name
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no partial folder left
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    start = time.perf_counter()
    model, tokenizer = models.load("smollm2-135m", dtype=torch.bfloat16)
    reloaded = time.perf_counter() - start
    print(f"conversion {converted:.1f} s, reload {reloaded:.1f} s")
    assert reloaded < 10
    assert getattr(model, "hf_quantizer", None) is None
    assert model.dtype == torch.bfloat16 and not model.training

    model, tokenizer = models.load(str(folder))  # a plain folder loads directly
    assert type(model).__name__ == "LlamaForCausalLM"


def test_smollm_shape(smollm):
    model, tokenizer = smollm
    config = model.config
    assert "Llama" in type(model).__name__
    assert config.num_hidden_layers == 30
    assert config.num_key_value_heads == 3 and config.num_attention_heads == 9
    assert config.hidden_size // config.num_attention_heads == 64
    assert model.dtype == torch.float32 and not model.training
    assert tokenizer("Hello world")["input_ids"]


def test_retrieval_probe_is_answered(smollm):
    model, tokenizer = smollm
    probe = models.retrieval_prompt(1000, 0.5, tokenizer, seed=0)
    prompt = tokenizer(probe["context"] + probe["question"], return_tensors="pt")["input_ids"]
    answer = tokenizer(probe["answer"], add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert 900 <= prompt.shape[1] <= 1100
    with torch.no_grad():
        logits = model(torch.cat([prompt, answer], dim=1), logits_to_keep=answer.shape[1] + 1).logits[0]
    predicted = logits[:-1].argmax(-1)  # teacher-forced greedy prediction of each answer token
    assert predicted.tolist() == answer[0].tolist(), tokenizer.decode(predicted)


def test_retrieval_prompt_shape(smollm):
    _, tokenizer = smollm
    probe = models.retrieval_prompt(500, 0.5, tokenizer, seed=3)
    assert probe == models.retrieval_prompt(500, 0.5, tokenizer, seed=3)
    needle = f"The secret code {probe['code']} unlocks the{probe['answer']}"
    assert len(probe["code"]) == 5 and probe["context"].count(needle) == 1
    assert probe["answer"].startswith(" ") and probe["question"].endswith("unlocks the")
    first = models.retrieval_prompt(500, 0.0, tokenizer, seed=3)["context"]
    last = models.retrieval_prompt(500, 1.0, tokenizer, seed=3)["context"]
    assert first.startswith(needle) and last.endswith(needle)
    assert first.replace(needle + "\n\n", "") == last.replace("\n\n" + needle, "")  # same prose
    assert models.retrieval_prompt(500, 0.5, tokenizer, seed=4)["context"] != probe["context"]


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError) as err:
        models.load("no-such-model")
    for name in models.MODELS:
        assert name in str(err.value)


def test_missing_package_names_pip_command(tmp_path, monkeypatch):
    monkeypatch.setenv("RDKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(models.MODELS, "smollm2-135m",
                        {**models.MODELS["smollm2-135m"], "module": "no_such_package_rdkv"})
    with pytest.raises(ModuleNotFoundError) as err:
        models.load("smollm2-135m")
    assert isinstance(err.value, models.ModelPackageMissing)
    assert models.MODELS["smollm2-135m"]["pip"] in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RDKV_CACHE_DIR", str(tmp_path))

    def interrupted(name, workdir):
        (workdir / "config.json").write_text("{}")  # a half-written folder
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_gguf_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.load("smollm2-135m")
    assert list(tmp_path.iterdir()) == []


def test_a_tokenizer_that_does_not_round_trip_is_refused(smollm, tmp_path):
    """A converted folder whose tokenizer another transformers version wrote can load and tokenize every
    space as a special token, silently; load refuses such a folder and says what to delete."""
    model, tokenizer = smollm
    models.check_tokenizer(tokenizer, tmp_path)  # the real one round-trips
    broken = type(tokenizer).from_pretrained(models.converted_dir("smollm2-135m"))
    broken.decode = lambda ids, **kw: tokenizer.decode(ids).replace(" ", "<|endoftext|>")
    with pytest.raises(models.RDKVError, match="does not round-trip.*delete that folder"):
        models.check_tokenizer(broken, tmp_path)


def test_a_tokenizer_that_splits_text_into_characters_is_refused(tmp_path):
    """It round-trips, so only the token count gives it away (Gemma 3's GGUF converted under transformers 5.2)."""
    class CharLevel:
        def __call__(self, text, add_special_tokens=False):
            return SimpleNamespace(input_ids=[ord(c) for c in text])

        def decode(self, ids):
            return "".join(map(chr, ids))

    with pytest.raises(models.TokenizerSplitsCharacters, match=r"single characters \(48 tokens for 48 characters\)"):
        models.check_tokenizer(CharLevel(), tmp_path)
