"""Write SmolLM2-135M widened to a 0.5B-parameter shape that computes the same function.

For speed measurements on a model of the size people run (Qwen2.5-0.5B's cost: hidden 960,
intermediate 4864, 30 layers, about 0.54B parameters) whose text is still a real model's (so
acceptance rates, stops and answers mean something), every weight of SmolLM2 keeps its place and
the new rows and columns are zero: the residual stream's new dimensions stay zero, new attention
heads read zero keys and values and write nothing, new MLP units output zero. The RMSNorm weights
are scaled by sqrt(576 / 960) so the norm over the wider stream gives the same values (up to its
epsilon). Output: an HF checkpoint directory (fp32 safetensors + SmolLM2's tokenizer); convert it
with llama.cpp's `convert_hf_to_gguf.py` and quantize it (e.g. Q4_K_M) to get a GGUF.

Usage: python scripts/make_wide_smollm2.py OUT_DIR
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE = 960, 15, 5, 4864


def widen(src: Path, out: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    old_hidden, head_dim = config["hidden_size"], config["hidden_size"] // config["num_attention_heads"]
    if config["num_attention_heads"] // config["num_key_value_heads"] != HEADS // KV_HEADS:
        raise SystemExit("the GQA ratio must stay the same so every query head keeps its key/value head")
    norm_scale = math.sqrt(old_hidden / HIDDEN)
    shapes = {"embed_tokens": (None, HIDDEN), "q_proj": (HEADS * head_dim, HIDDEN),
              "k_proj": (KV_HEADS * head_dim, HIDDEN), "v_proj": (KV_HEADS * head_dim, HIDDEN),
              "o_proj": (HIDDEN, HIDDEN), "gate_proj": (INTERMEDIATE, HIDDEN), "up_proj": (INTERMEDIATE, HIDDEN),
              "down_proj": (HIDDEN, INTERMEDIATE), "lm_head": (None, HIDDEN)}
    weights = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, w in load_file(str(path)).items():
            if name.endswith("norm.weight"):
                wide = torch.zeros(HIDDEN, dtype=w.dtype)
                wide[:old_hidden] = w * norm_scale
            else:
                kind = next(k for k in shapes if f"{k}." in name)
                rows, cols = shapes[kind]
                wide = torch.zeros(rows or w.shape[0], cols, dtype=w.dtype)
                wide[:w.shape[0], :w.shape[1]] = w
            weights[name] = wide.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.update(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  intermediate_size=INTERMEDIATE, head_dim=head_dim)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for extra in src.iterdir():
        if extra.name not in ("config.json",) and extra.suffix != ".safetensors" and extra.is_file():
            shutil.copy(extra, out / extra.name)
    print(f"{out}: {sum(w.numel() for w in weights.values()) / 1e9:.2f}B parameters")


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    from radix_backend.model_executor.loader import hf_directory, resolve_checkpoint

    widen(Path(hf_directory(resolve_checkpoint(None))), Path(sys.argv[1]))


if __name__ == "__main__":
    main()
