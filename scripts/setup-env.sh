#!/usr/bin/env bash
# Create the virtual environment and install shardwise into it.
#
# torch goes in first, so the package's `torch>=2.4` requirement is already met and
# pip never pulls a CUDA build by accident. A torch you already have is kept: if the
# base interpreter imports torch (your CUDA build, say), the environment sees it.
# Set TORCH_SPEC to choose another torch (default torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${1:-}
STAMP="$VENV/.shardwise-installed$EXTRAS"

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: keeping the torch of $PY ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
  exit 0  # already installed and the requirements did not change
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing ${TORCH_SPEC:-torch==2.13.0}"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q ${TORCH_SPEC:-torch==2.13.0}
fi
echo "setup: installing shardwise$EXTRAS"
"$VENV/bin/python" -m pip install -q -e ".$EXTRAS"
touch "$STAMP"
