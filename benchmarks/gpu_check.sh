#!/usr/bin/env bash
# The GPU check: build forecache's CUDA llama.cpp offline, prove it lossless on the GPU, and
# measure the target (Qwen2-57B-A14B in llama.cpp's Q4_K_M mix at a 24 GiB budget) against stock llama.cpp's
# placements. Every result is a JSON file in OUT.
#
#   benchmarks/gpu_check.sh bundle        here, with network: write .gpu-bundle/ (the trimmed
#                                         llama.cpp source, xz, and the wheels the GPU machine
#                                         lacks); carry it with the repository (under 64 MiB)
#   benchmarks/gpu_check.sh build OUT     step 1, about 6 min: the patched CUDA build
#   benchmarks/gpu_check.sh test OUT      step 2, about 8 min: the unpatched CUDA reference, the
#                                         lossless tests on CUDA, forecache doctor --json
#   benchmarks/gpu_check.sh bench OUT     step 3, about 8 min: write the 57B q4_k_m GGUF, then
#                                         policy_bench (offload,ncmoe,lru,static,promoe; 512-token
#                                         prompt, 128 tokens) at --gpu-budget 24GiB
#   benchmarks/gpu_check.sh all OUT       the three steps in one go (about 22 min)
#
# Each step does what an earlier one left undone (on a fresh machine `test` builds first), so
# three calls of under 10 minutes each, back to back on one machine, finish the check. OUT gets
# seven files: build.json/.log, doctor.json, lossless.json/.log, policy_bench.json/.log.
# --cpu runs every step on the CPU build with the tiny model instead: the dry run the test suite
# does (tests/test_gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
STEP=$1; shift
OUT=""
CPU=0
for a in "$@"; do
    case "$a" in
        --cpu) CPU=1 ;;
        -*) usage ;;
        *) OUT=$a ;;
    esac
done
BUNDLE=.gpu-bundle
log() { echo "[gpu_check] $*" >&2; }

bundle() {
    local py=${PYTHON:-.venv/bin/python}
    [ -x "$py" ] || { log "run make setup first (or set PYTHON)"; exit 1; }
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/wheels"
    local tmp; tmp=$(mktemp -d)
    "$py" -m forecache.build --export-source "$tmp/llama-src"
    tar -C "$tmp" -cJf "$BUNDLE/llama-src.tar.xz" llama-src
    rm -rf "$tmp"
    # What forecache needs that the GPU machine's Python 3.12 lacks (pure-Python wheels).
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        -d "$BUNDLE/wheels" "gguf>=0.17" "diskcache>=5.6.1"
    log "wrote $BUNDLE ($(du -sh "$BUNDLE" | cut -f1)); the repository and it travel together:"
    log "$(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1) tracked + the bundle, under 64 MiB"
}

[ "$STEP" = bundle ] && { bundle; exit 0; }
[ -n "$OUT" ] || usage
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ "$CPU" = 1 ]; then
    PY=${PYTHON:-.venv/bin/python}
    export FORECACHE_CUDA=0
    BACKEND=cpu
    installed=$("$PY" -c "from forecache.build import installed_build_info as i; \
print((i() or {}).get('backend', 'none'))")
    if [ "$installed" != cpu ] && [ "$installed" != none ]; then
        log "--cpu is the dry run of a CPU build; this environment has a $installed build, which it would replace"
        exit 1
    fi
else
    # The machine's own Python (PyTorch's environment there: numpy, onnxruntime, pytest, cmake,
    # scikit-build-core); the machine is a throwaway, so the builds install into it.
    PY=${PYTHON:-python3}
    export FORECACHE_CUDA=1 FORECACHE_CUDA_ARCHS=${FORECACHE_CUDA_ARCHS:-native}
    export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
    BACKEND=cuda
fi

environment() {
    [ "$CPU" = 1 ] && return 0
    [ -f "$BUNDLE/llama-src.tar.xz" ] || { log "no $BUNDLE: run '$0 bundle' where there is network, and carry it"; exit 1; }
    if ! "$PY" -c "import gguf, diskcache" 2>/dev/null; then
        log "installing $(ls "$BUNDLE"/wheels | tr '\n' ' ')into $("$PY" -c 'import sys; print(sys.prefix)')"
        "$PY" -m pip install -q --no-index --no-deps "$BUNDLE"/wheels/*.whl
    fi
    # forecache itself runs from this checkout; pip never reaches for an index there
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PIP_NO_INDEX=1
    if [ ! -d "$BUNDLE/llama-src" ]; then
        tar -C "$BUNDLE" -xJf "$BUNDLE/llama-src.tar.xz"
    fi
    export FORECACHE_LLAMA_SOURCE=$PWD/$BUNDLE/llama-src
}

step_build() {
    environment
    local t0=$SECONDS
    "$PY" -m forecache.build --backend "$BACKEND" 2>&1 | tee "$OUT/build.log" >&2
    "$PY" -c "import json; from forecache.build import installed_build_info as i; \
print(json.dumps(dict(i(), step_s=$((SECONDS - t0))), indent=1))" > "$OUT/build.json"
    log "build: $(cat "$OUT/build.json" | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(d["backend"], d["key"])')"
}

step_test() {
    step_build
    "$PY" -m forecache.build --reference --backend "$BACKEND" 2>&1 | tee -a "$OUT/build.log" >&2
    "$PY" -m forecache doctor --json > "$OUT/doctor.json"
    local tests=(tests/test_lossless.py tests/test_default_placement.py
                 "tests/test_prefetch.py::test_promoe_is_lossless"
                 "tests/test_stage.py::test_staged_prompt_passes_are_lossless"
                 tests/test_little.py
                 "tests/test_speculative.py::test_greedy_speculation_is_the_model")
    local select=()
    # the dry run takes one weight type of each test: the whole set runs in the suite itself
    [ "$CPU" = 1 ] && { tests=(tests/test_lossless.py); select=(-k "q8_0"); }
    set +e
    "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}" "${select[@]}" \
        --junitxml "$OUT/.lossless.xml" 2>&1 | tee "$OUT/lossless.log" >&2
    local rc=${PIPESTATUS[0]}
    set -e
    "$PY" - "$OUT/.lossless.xml" "$rc" > "$OUT/lossless.json" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
cases = [{"test": f"{c.get('classname')}::{c.get('name')}", "seconds": float(c.get("time", 0)),
          "outcome": ("failed" if c.find("failure") is not None or c.find("error") is not None
                      else "skipped" if c.find("skipped") is not None else "passed")}
         for c in suite.iter("testcase")]
print(json.dumps({"exit_code": int(sys.argv[2]), "passed": sum(c["outcome"] == "passed" for c in cases),
                  "failed": sum(c["outcome"] == "failed" for c in cases), "cases": cases}, indent=1))
EOF
    rm -f "$OUT/.lossless.xml"  # lossless.json has it; the device tool returns 8 files at most
    log "lossless tests: exit $rc (details in $OUT/lossless.log)"
}

step_bench() {
    environment
    if ! "$PY" -c "from forecache.native import patch_version; patch_version()" 2>/dev/null; then
        step_build
    fi
    local model args
    if [ "$CPU" = 1 ]; then
        model=$OUT/tiny-q4_k_m.gguf
        args=(--gpu-budget 1GiB --prompt-len 64 --gen 16 --prompts 1 --threads 2)
        [ -f "$model" ] || "$PY" -m forecache make-model "$model" --preset tiny --type q4_k_m
    else
        model=${FORECACHE_GPU_CHECK_MODEL:-$HOME/.cache/forecache/qwen2-57b-a14b-random-q4_k_m.gguf}
        args=(--gpu-budget 24GiB --prompt-len 512 --gen 128 --prompts 1)
        if [ ! -f "$model" ]; then
            mkdir -p "$(dirname "$model")"
            "$PY" -m forecache make-model "${model%.gguf}.part.gguf" --preset qwen2-57b-a14b \
                --type q4_k_m
            mv "${model%.gguf}.part.gguf" "$model"
        fi
    fi
    "$PY" benchmarks/policy_bench.py -m "$model" \
        --policies offload,ncmoe,lru,static,promoe,promoe+spec,promoe+little,promoe+resident \
        "${args[@]}" --json "$OUT/policy_bench.json" >&2  # its table: the run's output
    # batch plans: the roofline model's predictions next to measured batch jobs (issue 22)
    "$PY" benchmarks/batch_plans.py --requests 32 --max-tokens 32 --repeats 2 \
        --json "$OUT/batch_plans.json" >&2
}

case "$STEP" in
    build) step_build ;;
    test) step_test ;;
    bench) step_bench ;;
    all) step_test; step_bench ;;
    *) usage ;;
esac
log "done: results in $OUT"
