#!/usr/bin/env bash
# The GPU check: forecache's CUDA build, built here and carried to a GPU machine, measured there in
# one call against stock llama.cpp's best on replayed (real-like) routing. Every result is a JSON
# file in OUT.
#
#   benchmarks/gpu_check.sh wheels        here, on a machine with nvcc (no GPU needed): build the
#                                         patched and the unpatched CUDA llama-cpp-python (sm_90,
#                                         AVX2 host code: about 50 min on 2 cores the first time,
#                                         minutes once ccache holds ggml's CUDA kernels) and stage
#                                         them, one copy of each library, with the wheels the GPU
#                                         machine lacks, into .gpu-bundle/ (tar + xz, about 42 MB)
#   benchmarks/gpu_check.sh run OUT       on the GPU machine, one call of about 8 min: install the
#                                         bundle, doctor, write the 57B model (Q4_K_M mix) and a
#                                         draft of Qwen2-0.5B's shape, replay OLMoE-fitted
#                                         routing at 24 GiB (all-gpu, ncmoe with --no-mmap and
#                                         with mmap, promoe with and without prompt banks,
#                                         infinity), speculative decoding (stock's best and
#                                         promoe with the same draft, acceptance replayed), a
#                                         batch job (stock's and forecache's fastest plans by the
#                                         batch roofline, with and without micro-batches, each
#                                         request reading its own rows of the routing), the real
#                                         OLMoE trace, promoe's timeline, 12 GiB, every expert
#                                         resident against all-gpu and the replay's own cost, a
#                                         4096-token prompt against stock at its best ubatch,
#                                         promoe over the disk tier (a quarter of the experts in
#                                         host memory), the other routings, then the lossless
#                                         subset as time allows
#   benchmarks/gpu_check.sh setup OUT     run's first steps only (the bundle, doctor, the model, the
#                                         routings): a short first call that shows the carried
#                                         build runs there, then `run` on the same warm machine
#   benchmarks/gpu_check.sh run OUT --cpu the same on the CPU build with the tiny model: the dry
#                                         run the test suite does (tests/test_gpu_check.py)
#
# OUT gets at most eight files: doctor.json, traces.json, bench_fit24.json, bench_fit12.json,
# bench_fixed.json (every expert resident; the replay's own cost), bench_routings.json,
# lossless.json and run.log. Steps are time-boxed
# (FORECACHE_GPU_CHECK_BUDGET seconds in all, default 560) and run in order of importance, so a
# call that runs short still returns what it measured.
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

wheels() {
    local py=${PYTHON:-.venv/bin/python}
    [ -x "$py" ] || { log "run make setup first (or set PYTHON)"; exit 1; }
    command -v nvcc >/dev/null || { log "no nvcc on PATH: the CUDA build needs the CUDA toolkit"; exit 1; }
    local cuda=${CUDA_HOME:-} c
    for c in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
        [ -z "$cuda" ] && [ -x "$c/bin/nvcc" ] && cuda=$(readlink -f "$c")
    done
    [ -n "$cuda" ] || { log "cannot find the CUDA toolkit of $(command -v nvcc): set CUDA_HOME"; exit 1; }
    if [ ! -e "$cuda/lib64/libcublas.so" ] && [ ! -e "$cuda/targets/x86_64-linux/lib/libcublas.so" ]; then
        # the toolkit image ships without cuBLAS: take it from NVIDIA's wheel of the same major
        local major; major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
        local tmp; tmp=$(mktemp -d)
        log "cuBLAS missing from $cuda: installing it from the nvidia-cublas $major wheel"
        "$py" -m pip download -q --no-deps -d "$tmp" "nvidia-cublas>=$major,<$((major + 1))"
        (cd "$tmp" && unzip -q -o ./*.whl)
        local lib; lib=$(readlink -f "$cuda/lib64")
        cp "$tmp"/nvidia/cu"$major"/include/* "$cuda/include/"
        cp "$tmp"/nvidia/cu"$major"/lib/* "$lib/"
        ln -sf libcublas.so."$major" "$lib/libcublas.so"
        ln -sf libcublasLt.so."$major" "$lib/libcublasLt.so"
        rm -rf "$tmp"
    fi
    # Hopper (sm_90: H100, H200), host code for any x86-64 CPU with AVX2 (the GPU machine's CPU is
    # not this one); without a libcuda here the build cannot link CUDA's virtual memory API
    export FORECACHE_CUDA=1 FORECACHE_CUDA_ARCHS=${FORECACHE_CUDA_ARCHS:-90}
    local flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    ldconfig -p | grep -q 'libcuda\.so\b' || flags="$flags -DGGML_CUDA_NO_VMM=ON"
    export FORECACHE_CMAKE_ARGS="${FORECACHE_CMAKE_ARGS:-$flags}"
    command -v ccache >/dev/null || log "no ccache: every build compiles ggml's CUDA kernels again (apt-get install ccache)"
    local stage; stage=$(mktemp -d)
    "$py" - "$stage" <<'EOF'
import subprocess, sys
from pathlib import Path
from forecache.build import build_config, cached_wheel
stage = Path(sys.argv[1])
for name, stock in (("patched", False), ("reference", True)):
    wheel, info = cached_wheel(build_config("cuda", stock=stock))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(stage / name), str(wheel)], check=True)
    print(f"[gpu_check] {name}: {wheel.name} ({info['key']})", file=sys.stderr)
EOF
    # one copy of each library: the wheel holds the same .so under several names
    "$py" - "$stage" <<'EOF'
import hashlib, os, sys
from pathlib import Path
seen = {}
for p in sorted(Path(sys.argv[1]).rglob("*.so*")):
    if p.is_symlink() or not p.is_file():
        continue
    h = hashlib.sha256(p.read_bytes()).hexdigest()
    if h in seen and seen[h].parent == p.parent:
        p.unlink()
        p.symlink_to(seen[h].name)
    elif h in seen:
        p.unlink()
        p.symlink_to(os.path.relpath(seen[h], p.parent))
    else:
        seen[h] = p
EOF
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/wheels"
    # each file beside its twin in the other build, and a dictionary (-9: 64 MiB) that spans
    # them: the two libggml-cuda.so (60 MB each, alike) then cost about one (80 MB -> 42 MB)
    (cd "$stage" && find patched reference \( -type f -o -type l \) \
        | awk '{ r = $0; sub(/^[^\/]*\//, "", r); print r "\t" $0 }' | sort | cut -f2) \
        > "$stage.list"
    tar -C "$stage" --no-recursion -cf - -T "$stage.list" | xz -T0 -9 > "$BUNDLE/site.tar.xz"
    rm -f "$stage.list"
    rm -rf "$stage"
    # what forecache needs that the GPU machine's Python 3.12 lacks (pure-Python wheels)
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        -d "$BUNDLE/wheels" "gguf>=0.17" "diskcache>=5.6.1"
    # a real decode trace of a 64-expert top-8 model, when this checkout has the shared ones
    local real=../shared/traces/olmoe_1b_7b_nf4gemm_decode_4x512.npz
    [ -f "$real" ] && cp "$real" "$BUNDLE/olmoe-real.npz"
    log "wrote $BUNDLE ($(du -sh "$BUNDLE" | cut -f1)); carry it with the working tree (64 MiB in all:"
    log "untrack the shipped GGUFs for the call, they are not needed there)"
}

[ "$STEP" = wheels ] && { wheels; exit 0; }
[ "$STEP" = run ] || [ "$STEP" = setup ] || usage
[ -n "$OUT" ] || usage
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec 2> >(tee -a "$OUT/run.log" >&2)
T0=$SECONDS
BUDGET=${FORECACHE_GPU_CHECK_BUDGET:-560}
left() { echo $((BUDGET - (SECONDS - T0))); }

if [ "$CPU" = 1 ]; then
    PY=${PYTHON:-.venv/bin/python}
    export FORECACHE_CUDA=0
    WORK=$OUT/.work
    MODEL=$WORK/tiny-q4_k_m.gguf
    PRESET=tiny
    DRAFT_PRESET=tiny-draft
    BIG=1GiB; SMALL=1GiB; FULL=1GiB; PROMPT=64; LONG=128; GEN=16; THREADS=(--threads 2)
    BANK_AB=promoe+bank
    BATCH_REQUESTS=6; BATCH_SCALE=0.05
    LOSSLESS=(-k "(test_every_policy_equals_unpatched and tiny-q8_0) or split_model_gives")
else
    # the machine's own Python (PyTorch's environment: numpy, onnxruntime, pytest, click); the
    # carried builds go first on its path, forecache runs from this checkout
    PY=${PYTHON:-python3}
    [ -f "$BUNDLE/site.tar.xz" ] || { log "no $BUNDLE/site.tar.xz: run '$0 wheels' first and carry $BUNDLE"; exit 1; }
    SITE=/tmp/forecache-site
    if [ ! -d "$SITE/patched" ]; then
        mkdir -p "$SITE" && xz -dc "$BUNDLE/site.tar.xz" | tar -C "$SITE" -xf -
        "$PY" -m pip install -q --no-index --no-deps --target "$SITE/deps" "$BUNDLE"/wheels/*.whl
    fi
    export PYTHONPATH=$SITE/patched:$SITE/deps:$PWD${PYTHONPATH:+:$PYTHONPATH}
    # cuBLAS and the CUDA runtime: the system's, else NVIDIA's wheels in this Python
    if ! ldconfig -p | grep -q 'libcublas\.so\.'; then
        for d in $("$PY" -c 'import glob, os, sys
for p in sys.path:
    for d in glob.glob(os.path.join(p, "nvidia", "cu*", "lib")) + glob.glob(os.path.join(p, "nvidia", "*", "lib")):
        print(d)' 2>/dev/null | sort -u); do
            LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        done
        export LD_LIBRARY_PATH
    fi
    export FORECACHE_REFERENCE_DIR=$SITE/reference PIP_NO_INDEX=1
    WORK=${FORECACHE_GPU_CHECK_WORK:-/tmp/forecache-gpu-check}
    PRESET=${FORECACHE_GPU_CHECK_PRESET:-qwen2-57b-a14b}
    DRAFT_PRESET=qwen2-0.5b
    MODEL=$WORK/$PRESET-random-q4_k_m.gguf
    BIG=24GiB; SMALL=12GiB; FULL=64GiB; PROMPT=512; LONG=4096; GEN=64; THREADS=()
    BANK_AB=promoe+nobank
    BATCH_REQUESTS=96; BATCH_SCALE=0.2
    # and a split model (its shards' experts in pinned host memory, the disk tier per shard), and
    # host experts computed whole beside the slots' products, with copies on their stream
    LOSSLESS=(-k "q8_0 or split_model_gives or disk_tier_reads_each_shard or computed_whole")
fi
mkdir -p "$WORK"
# a build that does not load ends the call here, while the device time left allows another
"$PY" -m forecache doctor --json > "$OUT/doctor.json" || { log "doctor failed: the build does not run here"; exit 1; }
if [ ! -f "$MODEL" ]; then
    log "writing the $PRESET model ($(left) s left)"
    "$PY" -m forecache make-model "${MODEL%.gguf}.part.gguf" --preset "$PRESET" --type q4_k_m >&2
    mv "${MODEL%.gguf}.part.gguf" "$MODEL"
fi
# speculation's draft: a dense model of Qwen2-0.5B's shape with the model's vocabulary (0.4 GB)
DRAFT=$WORK/$DRAFT_PRESET-random-q4_k_m.gguf
if [ ! -f "$DRAFT" ]; then
    "$PY" -m forecache make-model "${DRAFT%.gguf}.part.gguf" --preset "$DRAFT_PRESET" --type q4_k_m >&2
    mv "${DRAFT%.gguf}.part.gguf" "$DRAFT"
fi
log "model ready after $((SECONDS - T0)) s"

if [ ! -f "$WORK/traces.json" ]; then
    "$PY" benchmarks/replay_traces.py -m "$MODEL" --out "$WORK/traces" --prefill "$PROMPT" \
        --decode $((GEN + 16)) --json "$WORK/traces.json" >&2
fi
cp "$WORK/traces.json" "$OUT/traces.json"
if [ "$STEP" = setup ]; then log "setup done after $((SECONDS - T0)) s"; exit 0; fi

# policy_bench with a time box: NAME TRACE BUDGET POLICIES [FLAGS...] (BUDGET -: none given)
bench() {
    local name=$1 trace=$2 budget=$3 policies=$4 t
    shift 4
    t=$(left)
    if [ "$t" -lt 30 ]; then log "skipped $name: $t s left"; return 0; fi
    local tr=(); [ "$trace" != none ] && tr=(--routing-trace "$trace")
    local gb=(); [ "$budget" != - ] && gb=(--gpu-budget "$budget")
    log "bench $name ($t s left)"
    timeout "$t" "$PY" benchmarks/policy_bench.py -m "$MODEL" "${gb[@]}" \
        --policies "$policies" --prompt-len "$PROMPT" --gen "$GEN" --prompts 1 \
        "${THREADS[@]}" "${tr[@]}" "$@" --json "$OUT/bench_$name.json" >&2 \
        || log "bench $name did not finish (exit $?)"
}
# one bench's report moved into another's under KEY (the device returns at most 8 files):
# keep_in FROM INTO KEY
keep_in() {
    "$PY" - "$OUT/$1" "$OUT/$2" "$3" <<'EOF'
import json, sys
from pathlib import Path
src, dst, key = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
if src.exists():
    report = json.loads(dst.read_text()) if dst.exists() else {}
    report[key] = json.loads(src.read_text())
    dst.write_text(json.dumps(report, indent=1))
    src.unlink()
EOF
}
FIT=$WORK/traces/olmoe-fit.npz
# "default" in a run list is what a user gets without --policy (cache/choice.py: the cache only
# where neither its prompt nor its decode is estimated slower than stock's, from the routing
# replayed): the chosen policy's run of the same call, with the reason (no load of its own)
# promoe's prompt banks against its prompts without them (the H100's prefill spent 280 of 390 ms
# in 1241 expert groups, 2026-11-26): promoe+nobank here, promoe+bank on a CPU build, where
# promoe has none
bench fit24 "$FIT" "$BIG" "all-gpu,ncmoe,ncmoe-mmap,promoe,$BANK_AB,infinity,default"
# speculative decoding at the target: stock's best with the draft and promoe with the same draft
# (promoe without one is fit24's, measured above), the draft's acceptance replayed at a per-token
# rate of 0.7, what the published acceptances of Qwen's small drafts give at draft lengths of 4
# to 16 (benchmarks/spec_sim.py prints them); kept in bench_fit24.json as "spec"
bench spec "$FIT" "$BIG" "ncmoe,ncmoe+draft,promoe+draft" --draft "$DRAFT" --acceptance 0.7
keep_in bench_spec.json bench_fit24.json spec
# a batch job (before the steps earlier calls have measured): stock llama.cpp's and
# forecache's plans the batch roofline predicts fastest, the same requests each reading its own
# rows of the fitted routing, kept in bench_fit24.json as "batch"
t=$(left)
if [ "$t" -ge 60 ]; then
    log "batch ($t s left)"
    timeout $((t < 210 ? t : 210)) "$PY" benchmarks/batch_bench.py -m "$MODEL" \
        --routing-trace "$FIT" --gpu-budget "$BIG" --requests "$BATCH_REQUESTS" \
        --scale "$BATCH_SCALE" --per-kind 1 "${THREADS[@]}" --json "$OUT/bench_batch.json" >&2 \
        || log "batch did not finish (exit $?)"
    keep_in bench_batch.json bench_fit24.json batch
else
    log "skipped batch: $t s left"
fi
# the real OLMoE trace mapped onto the model, the routing to beat (into bench_routings.json)
REAL=$BUNDLE/olmoe-real.npz
if [ -f "$REAL" ]; then bench r_olmoe-real "$REAL" "$BIG" ncmoe,promoe,infinity,default; fi
# where promoe's time goes, layer by layer (a run of its own: recording costs a little), kept
# in bench_fit24.json as "timeline_run" (the device returns at most 8 files)
bench timeline "$FIT" "$BIG" promoe --timeline
keep_in bench_timeline.json bench_fit24.json timeline_run
# at 12 GiB half of each layer's experts miss: promoe without its copy stream beside it (a
# decoded token's product waiting on the host for its copies; the same run on a CPU build)
bench fit12 "$FIT" "$SMALL" ncmoe,ncmoe-mmap,promoe,promoe+nostream,default
# the fixed cost when nothing misses: every expert in a slot against every layer on the GPU,
# both replayed, and the replay's own cost (every layer on the GPU on the model's own routing)
bench full "$FIT" "$FULL" all-gpu,promoe
bench own none "$FULL" all-gpu
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
parts = {n: out / f"bench_{n}.json" for n in ("full", "own")}
json.dump({n: json.loads(p.read_text()) for n, p in parts.items() if p.exists()},
          open(out / "bench_fixed.json", "w"), indent=1)
for p in parts.values():
    p.unlink(missing_ok=True)
EOF
# a long prompt: 4096 tokens against stock at its best ubatch (a larger one is how stock users
# speed up long prompts; 1024 is never its best in simulation), kept in bench_fit24.json as
# "prefill_4k"
bench p4k "$FIT" "$BIG" "ncmoe,ncmoe@ub2048,ncmoe@ub4096,promoe,promoe@ub2048" \
    --prompt-len "$LONG" --gen 4
keep_in bench_p4k.json bench_fit24.json prefill_4k
# the disk tier on this build: a quarter of the experts in host slots, the rest read from the
# model file with direct I/O (kept in bench_fit12.json as "disk_run"); the CPU build's device
# slots, host memory there, a quarter of the experts too
DISK_HOST=$("$PY" - "$MODEL" "$CPU" <<'EOF'
import sys
from forecache.cache.disk import host_weight_bytes
from forecache.gguf.header import read_model_file
mf = read_model_file(sys.argv[1])
cpu = sys.argv[2] == "1"
# the weights the host keeps and a quarter of the experts (host slots take the largest layer's
# size), one more a layer for rounding; on a CPU build the device slots besides
layer = max(mf.layer_expert_bytes()) * len(mf.moe_layers())
print(host_weight_bytes(mf, on_gpu=not cpu) + (mf.n_expert // 4 + 1) * layer * (2 if cpu else 1))
EOF
)
if [ "$CPU" = 1 ]; then DISK_DEV=(- --cache-fraction 0.25); else DISK_DEV=("$BIG"); fi
# (promoe only: lru's 128-token prompt took 36 s on the H100, 2026-11-26)
bench disk "$FIT" "${DISK_DEV[0]}" promoe "${DISK_DEV[@]:1}" --host-budget "$DISK_HOST" \
    --gen 8 --prompt-len $((PROMPT < 64 ? PROMPT : 64))
keep_in bench_disk.json bench_fit12.json disk_run
# the other routings, in one file with the real trace's
for r in "$WORK/traces/uniform.npz" "$WORK/traces/skewed.npz"; do
    if [ -f "$r" ]; then bench "r_$(basename "$r" .npz)" "$r" "$BIG" ncmoe,promoe,default; fi
done
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
parts = sorted(out.glob("bench_r_*.json"))
json.dump({p.stem[len("bench_r_"):]: json.loads(p.read_text()) for p in parts},
          open(out / "bench_routings.json", "w"), indent=1)
for p in parts:
    p.unlink()
EOF

# the lossless subset on this build, against the carried unpatched reference
t=$(left)
if [ "$t" -ge 45 ]; then
    log "lossless subset ($t s left)"
    set +e
    timeout "$t" "$PY" -m pytest -q -p no:cacheprovider tests/test_lossless.py tests/test_split.py \
        tests/test_hot_path.py \
        "${LOSSLESS[@]}" \
        --junitxml "$WORK/lossless.xml" >&2
    rc=$?
    set -e
    "$PY" - "$WORK/lossless.xml" "$rc" > "$OUT/lossless.json" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print(json.dumps({"exit_code": int(sys.argv[2]), "passed": 0, "failed": 0, "cases": []}))
    sys.exit(0)
suite = root if root.tag == "testsuite" else root.find("testsuite")
cases = [{"test": f"{c.get('classname')}::{c.get('name')}", "seconds": float(c.get("time", 0)),
          "outcome": ("failed" if c.find("failure") is not None or c.find("error") is not None
                      else "skipped" if c.find("skipped") is not None else "passed")}
         for c in suite.iter("testcase")]
print(json.dumps({"exit_code": int(sys.argv[2]), "passed": sum(c["outcome"] == "passed" for c in cases),
                  "failed": sum(c["outcome"] == "failed" for c in cases), "cases": cases}, indent=1))
EOF
else
    log "lossless subset skipped: $t s left"
fi
log "done after $((SECONDS - T0)) s: results in $OUT"
