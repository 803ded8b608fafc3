import os

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

torch.set_grad_enabled(False)

if os.environ.get("RDKV_TEST_C_LIBRARY"):  # a sanitizer build of kernels/cpu_dequant.c (test_cpu_dequant.py)
    import ctypes

    from rdkv.kernels import cpu_dequant

    _lib = cpu_dequant.bind(ctypes.CDLL(os.environ["RDKV_TEST_C_LIBRARY"]))
    cpu_dequant.library = lambda: _lib


def tiny_llama(seed: int = 0, dtype=torch.float32) -> LlamaForCausalLM:
    """A random-weight Llama with GQA (4 query heads over 2 KV heads, head_dim 32)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_gemma3(seed: int = 0, window: int = 16) -> Gemma3ForCausalLM:
    """A random-weight Gemma 3: MQA, q/k norms, sliding-window layers (``window``) and one full layer."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=window,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=1024)
    return Gemma3ForCausalLM(cfg).eval()


SMALL = dict(v_group=32, k_group=32, k_block=16)


@pytest.fixture
def llama():
    return tiny_llama()


def recorded(model, ids, **record_options):
    """(record, output) of one prefill of ``ids`` inside ``rdkv.record(model, **record_options)``."""
    import rdkv

    with rdkv.record(model, **record_options) as rec:
        out = model(ids, use_cache=True)
    return rec, out


def load_real(name: str):
    """``rdkv.models.load(name)``, skipped where this transformers version converts the model's tokenizer into
    single characters, which load refuses (Gemma 3's GGUF under transformers 5.2, the compat suite's)."""
    import rdkv

    try:
        return rdkv.models.load(name)
    except rdkv.models.TokenizerSplitsCharacters as e:
        pytest.skip(str(e))
