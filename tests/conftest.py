"""Shared test fixtures: the embedded SmolLM2 checkpoint and tiny random-weight checkpoints.

The tiny models use SmolLM2's real tokenizer (vocab 49152, chat template) so that tests can send
real text through the whole stack, while a forward pass costs next to nothing on a 2-core CPU.
Markers `slow` and `gpu` are registered in pyproject.toml, and so is one per folder (`core`,
`kernels`, `lang`, `adapters`, `server`, `bench`), given to every test in it: `-m "server and not
slow"`. The tests of the repository as a whole (layering, docs, packaging, demo, examples) sit here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

# Set before transformers / huggingface_hub are imported by any test module: they read these once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["HAYSTACK_TELEMETRY_ENABLED"] = "False"  # Haystack would post usage events (tests are offline)
# Tests compare the engine with HF transformers' fp32 outputs, so engines built without an explicit
# `quantization=` run the fp32 reference path. The quantized default ("auto": int4 on GGUF models)
# is tested against that reference in test_quantized.py, and the example scripts run with it.
os.environ.setdefault("RADIX_BACKEND_QUANTIZATION", "none")

import pytest  # noqa: E402
import torch  # noqa: E402

if TYPE_CHECKING:
    from radix_backend.model_executor.loader import Checkpoint

TINY_VOCAB = 49152  # SmolLM2's tokenizer
TINY_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=TINY_VOCAB, max_position_embeddings=2048,
                   # wider than HF's default 0.02 so that random logits have clear argmaxes and
                   # greedy comparisons against HF do not hinge on float rounding of near-ties
                   initializer_range=0.1)


@pytest.fixture(scope="session", autouse=True)
def _test_environment() -> Iterator[None]:
    """Keep tests polite on a shared 2-core box and off the network."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Checkpoint:
    """The embedded SmolLM2-135M-Instruct (its GGUF, read in place)."""
    from radix_backend.model_executor.loader import resolve_checkpoint  # lazily: a broken package fails only its users

    return resolve_checkpoint(None)


FOLDERS = ("core", "kernels", "lang", "adapters", "server", "bench")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test on the shared SmolLM2 engine is marked `slow` (`-m "not slow"` skips them); a
    module's own `engine` fixture (another model or config) replaces the shared one and is not.
    Every test in a folder gets the folder's marker."""
    here = Path(__file__).parent
    for item in items:
        defs = getattr(item, "_fixtureinfo", None) and item._fixtureinfo.name2fixturedefs.get("engine")
        if defs and not defs[-1].baseid.endswith(".py"):
            item.add_marker(pytest.mark.slow)
        folder = item.path.relative_to(here).parts[0] if item.path.is_relative_to(here) else ""
        if folder in FOLDERS:
            item.add_marker(getattr(pytest.mark, folder))


@pytest.fixture(scope="session")
def engine():
    """The one SmolLM2 engine of the whole test run: the process-shared `get_engine()` that the
    adapters and the DSL use by default (modules that need another model or config override it)."""
    from radix_backend.engine import get_engine

    return get_engine()


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_checkpoint: Checkpoint) -> str:
    """The embedded model as an fp32 HF checkpoint dir (written once into the user cache), for
    loading it with transformers as the reference."""
    from radix_backend.model_executor.loader import hf_directory

    return str(hf_directory(smollm2_checkpoint))


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_hf_dir: str):
    """The embedded model in HF transformers, fp32: the reference the engine's greedy tokens match."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_checkpoint: Checkpoint):
    """SmolLM2's tokenizer with its chat template."""
    from radix_backend.model_executor.loader import load_tokenizer

    return load_tokenizer(smollm2_checkpoint)


def _save_tiny(model_cls, config, tokenizer, directory: Path) -> Path:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(str(directory))  # safetensors
    tokenizer.save_pretrained(str(directory))
    return directory


def _token_ids(tokenizer) -> dict[str, int | None]:
    return dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer Llama (GQA 4:2, tied embeddings) with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_COMMON, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
                         **_token_ids(smollm2_tokenizer))
    return _save_tiny(LlamaForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer Qwen3: qk-norm, head_dim (32) set apart from hidden/heads (16),
    untied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=False, rope_theta=1_000_000.0,
                         rms_norm_eps=1e-6, **_token_ids(smollm2_tokenizer))
    return _save_tiny(Qwen3ForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer Mistral (GQA, untied embeddings, no sliding window)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**TINY_COMMON, tie_word_embeddings=False, sliding_window=None, rope_theta=10000.0,
                           rms_norm_eps=1e-5, **_token_ids(smollm2_tokenizer))
    return _save_tiny(MistralForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_mistral"))


@pytest.fixture(scope="session")
def tiny_llama_bias_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer Llama with `attention_bias` (q, k, v and o) and `mlp_bias`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_COMMON, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
                         attention_bias=True, mlp_bias=True, **_token_ids(smollm2_tokenizer))
    return _save_tiny(LlamaForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_llama_bias"))


TINY_WINDOW = 64  # the sliding window of `tiny_mistral_window_dir`: shorter than its 2048 positions


@pytest.fixture(scope="session")
def tiny_mistral_window_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer Mistral whose sliding window (64) is shorter than its context."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**TINY_COMMON, tie_word_embeddings=False, sliding_window=TINY_WINDOW, rope_theta=10000.0,
                           rms_norm_eps=1e-5, **_token_ids(smollm2_tokenizer))
    return _save_tiny(MistralForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_mistral_window"))


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer Phi-3 (fused qkv and gate_up weights, full rotary)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(**TINY_COMMON, tie_word_embeddings=False, rms_norm_eps=1e-5, **_token_ids(smollm2_tokenizer))
    return _save_tiny(Phi3ForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_phi3"))


@pytest.fixture(scope="session")
def tiny_granite_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer Granite: embedding, attention, residual and logit multipliers."""
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(**TINY_COMMON, tie_word_embeddings=True, rms_norm_eps=1e-5, embedding_multiplier=12.0,
                           attention_multiplier=0.1, residual_multiplier=0.22, logits_scaling=8.0,
                           **_token_ids(smollm2_tokenizer))
    return _save_tiny(GraniteForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_granite"))


TINY_LONGROPE_ORIGINAL = 256  # `tiny_phi4_dir`'s original_max_position_embeddings (of 1024)


@pytest.fixture(scope="session")
def tiny_phi4_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer Phi-4-mini shape: 3/4 of each head rotated, LongRoPE, tied embeddings."""
    from transformers import Phi3Config, Phi3ForCausalLM

    head_dim = TINY_COMMON["hidden_size"] // TINY_COMMON["num_attention_heads"]
    rotary_half = int(head_dim * 0.75) // 2
    common = {**TINY_COMMON, "max_position_embeddings": 1024}
    config = Phi3Config(**common, tie_word_embeddings=True, rms_norm_eps=1e-5, partial_rotary_factor=0.75,
                        original_max_position_embeddings=TINY_LONGROPE_ORIGINAL,
                        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 10 for i in range(rotary_half)],
                                      "long_factor": [2.0 + i for i in range(rotary_half)]},
                        **_token_ids(smollm2_tokenizer))
    return _save_tiny(Phi3ForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_phi4"))


TINY_GEMMA_WINDOW = 16  # the sliding window of the tiny Gemma 2/3 models' local layers


def _save_tiny_random_norms(model_cls, config, tokenizer, directory: Path) -> Path:
    """As `_save_tiny`, with the norm weights drawn at random: HF initialises Gemma's (1 + w) norms at
    w = 0 and other norms at 1, which would hide a missing or doubled offset, or a misplaced norm."""
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer Gemma (1): GeGLU, (1 + w) norms, scaled embeddings, head_dim 32."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(**TINY_COMMON, head_dim=32, hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                         **_token_ids(smollm2_tokenizer))
    return _save_tiny_random_norms(GemmaForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_gemma"))


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 4-layer Gemma 2: local/global layers (window 16), soft-capped attention scores
    and logits (caps small enough to bend random scores), sandwich norms, query_pre_attn_scalar."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    common = {**TINY_COMMON, "num_hidden_layers": 4}
    config = Gemma2Config(**common, head_dim=32, query_pre_attn_scalar=24, sliding_window=TINY_GEMMA_WINDOW,
                          attn_logit_softcapping=3.0, final_logit_softcapping=5.0, rms_norm_eps=1e-6,
                          **_token_ids(smollm2_tokenizer))
    return _save_tiny_random_norms(Gemma2ForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_gemma2"))


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 4-layer Gemma 3 (text): q/k norms, local layers with their own RoPE base and
    a global one with linear RoPE scaling, window 16."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    common = {**TINY_COMMON, "num_hidden_layers": 4}
    config = Gemma3TextConfig(
        **common, head_dim=32, query_pre_attn_scalar=32, sliding_window=TINY_GEMMA_WINDOW, rms_norm_eps=1e-6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}},
        **_token_ids(smollm2_tokenizer))
    return _save_tiny_random_norms(Gemma3ForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_gemma3"))


TINY_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 3-layer Qwen2-MoE: 8 experts (top 2, not renormalised), a sigmoid-gated shared
    expert, q/k/v biases, layer 1 dense (`mlp_only_layers`)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    common = {**TINY_COMMON, "num_hidden_layers": 3}
    config = Qwen2MoeConfig(**common, **TINY_MOE, num_experts=8, shared_expert_intermediate_size=96,
                            norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False,
                            **_token_ids(smollm2_tokenizer))
    return _save_tiny(Qwen2MoeForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_qwen2_moe"))


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer Qwen3-MoE: q/k norms, 8 experts, top 2 renormalised (`norm_topk_prob`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**TINY_COMMON, **TINY_MOE, num_experts=8, norm_topk_prob=True, head_dim=32,
                            tie_word_embeddings=False, **_token_ids(smollm2_tokenizer))
    return _save_tiny(Qwen3MoeForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer Mixtral: 4 experts, top 2 renormalised, a sliding window of 32."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**TINY_COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                           tie_word_embeddings=False, **_token_ids(smollm2_tokenizer))
    return _save_tiny(MixtralForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_mixtral"))


@pytest.fixture(scope="session")
def tiny_olmo2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random-weight 2-layer OLMo 2: norms after attention and MLP, q/k norms over every head."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    config = Olmo2Config(**TINY_COMMON, rms_norm_eps=1e-6, tie_word_embeddings=False, **_token_ids(smollm2_tokenizer))
    return _save_tiny_random_norms(Olmo2ForCausalLM, config, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_olmo2"))


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir: Path):
    """An fp32 CPU engine on the tiny Llama, one per test module."""
    from radix_backend import Engine

    with Engine(str(tiny_llama_dir), kv_cache_tokens=4096, device="cpu", dtype="float32") as eng:
        yield eng
