#!/usr/bin/env bash
# Set up forecache in ./.venv: Python dependencies, then the patched llama.cpp build (cached in
# ~/.cache/forecache after the first time), then forecache itself. Safe to re-run.
# Offline: PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR (wheels) FORECACHE_LLAMA_SOURCE=TREE (from
# `forecache build --export-source TREE`), and FORECACHE_VENV_SYSTEM_SITE=1 to reuse the
# machine's own numpy/onnxruntime.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "forecache setup: error: Python 3.10 or newer is needed (found: $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.x" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    echo "[forecache setup] creating .venv"
    # FORECACHE_VENV_SYSTEM_SITE=1 lets the venv see packages the machine already has (offline
    # machines with numpy/onnxruntime preinstalled).
    if [ "${FORECACHE_VENV_SYSTEM_SITE:-0}" = 1 ]; then
        "$PY" -m venv --system-site-packages .venv
    else
        "$PY" -m venv .venv
    fi
fi
# (the grep drops pip's notes about unreachable extra indexes; pip's exit status is kept)
pip_install() {
    .venv/bin/python -m pip install -q --disable-pip-version-check "$@" \
        2> >(grep -v "^WARNING: Location" >&2)
}

# scikit-build-core builds llama-cpp-python without build isolation (works offline with --source).
echo "[forecache setup] installing build requirements"
pip_install "scikit-build-core>=0.9.2"
# The patched build first: installing forecache would otherwise pull a stock llama-cpp-python.
.venv/bin/python -m forecache.build
echo "[forecache setup] installing forecache"
pip_install -e ".[test]"
.venv/bin/python -c "from forecache.native import patch_version; patch_version()"
echo "[forecache setup] done: .venv/bin/forecache is ready"
