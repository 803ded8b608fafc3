#!/usr/bin/env bash
# GPU check of the decode kernels, sized for one short GPU loan (under 8 minutes on an H100/H200; each stage
# has its own timeout):
#   1. environment facts (nvidia-smi, torch/triton versions, the commit);
#   2. tests: the kernel tests compiled for the GPU (RDKV_TEST_DEVICE=cuda: the interpreter's cases plus bf16
#      queries), TriZone decode, the full-cache flash-decoding anchor and the compress side;
#   3. bench: the decode benchmark (contexts 8k/32k/128k, batch 1/8, budgets 2.5/10/25%): the page kernel, with the
#      full-cache anchor at its fastest setting beside SDPA, every ratio against the faster of the two (the kernel
#      over the packed layout pages replaced measured 398 GB/s on the H200, docs/kernels.md);
#   4. generate: end-to-end ms per token of a Llama-3.1-8B-shaped model (random bf16 weights) at 32k/128k,
#      batch 1/8, full cache vs rdkv at 10%/25% (scripts/bench_generate.py);
#   5. compress: the compress-side kernels against their torch paths (scripts/bench_compress_kernels.py);
#   6. prefill: peak GPU memory (torch.cuda.max_memory_allocated) of a plain prefill that keeps its cache against
#      rdkv.prefill, Llama-3.1-8B-shaped (random bf16 weights) at 32k and 128k (scripts/bench_prefill_memory.py).
# STAGES="tests bench generate compress prefill" (the default) picks stages. Not in the default list: sweep (launch
# settings at one point, bench_decode.py --sweep), tune (the sweep, then the table with its fastest setting),
# profile (one decode launch's hardware counters with ncu).
# Run from the repository root. Results go to $OUT (default ./gpu_check_out): env.txt, tests.txt, bench.txt,
# bench_decode.md/json, bench_generate.md/json, bench_compress_kernels.md/json, prefill_memory.md. Exit status: non-zero if a
# stage failed.
#
#   OUT=/tmp/out bash scripts/gpu_check.sh
#   PYTHON=/path/to/python bash scripts/gpu_check.sh     # a python whose torch sees the GPU
#   BENCH_ARGS="--contexts 8192 32768" bash scripts/gpu_check.sh   # a shorter benchmark
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"

pick_python() {
    for p in "${PYTHON:-}" .venv/bin/python python3 python; do
        [ -n "$p" ] || continue
        command -v "$p" >/dev/null 2>&1 || [ -x "$p" ] || continue
        if "$p" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
            echo "$p"; return 0
        fi
    done
    return 1
}
PY=$(pick_python) || { echo "no python with a CUDA torch + triton found (set PYTHON=...)" | tee "$OUT/env.txt"; exit 2; }
# make `import rdkv` / `rdkv.kernels` work from this checkout even if the package is not installed here
if ! "$PY" -c "import rdkv.kernels.page_decode" 2>/dev/null; then
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
fi
if ! "$PY" -c "import rdkv.kernels.page_decode" 2>/dev/null; then
    # no install possible (offline): a shadow package of symlinks with the setup.cfg mapping
    # rdkv.kernels -> kernels/, rdkv.solvers -> solvers/
    SHADOW=$(mktemp -d)
    mkdir "$SHADOW/rdkv"
    for f in "$PWD"/rdkv/*; do ln -s "$f" "$SHADOW/rdkv/"; done
    ln -s "$PWD/kernels" "$SHADOW/rdkv/kernels"
    ln -s "$PWD/solvers" "$SHADOW/rdkv/solvers"
    export PYTHONPATH="$SHADOW${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv 2>&1
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); print(torch.cuda.get_device_name())"
    git log -1 --oneline 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
STAGES=${STAGES:-tests bench generate compress prefill}
stage() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }

if stage tests; then
    echo "== kernel tests on CUDA =="
    t0=$(date +%s)
    # compiling the kernel variants dominates: spread the tests over processes when pytest-xdist is there
    XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
    # shellcheck disable=SC2086
    RDKV_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-180}" "$PY" -m pytest -q -p no:cacheprovider $XDIST tests/test_kernel_decode.py \
        tests/test_page_decode.py tests/test_kernel_flash_decode.py tests/test_kernel_compress.py 2>&1 | tee "$OUT/tests.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    echo "tests took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/tests.txt"
fi

if stage bench; then
    echo "== decode benchmark =="
    t0=$(date +%s)
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-180}" "$PY" scripts/bench_decode.py --device cuda --no-deq --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    echo "benchmark took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.txt"
fi

if stage generate; then
    echo "== end-to-end decode, Llama-3.1-8B shape =="
    t0=$(date +%s)
    timeout "${GENERATE_TIMEOUT:-120}" "$PY" scripts/bench_generate.py --device cuda --out "$OUT" ${GENERATE_ARGS:-} 2>&1 | tee "$OUT/generate.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    echo "end-to-end took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/generate.txt"
fi

if stage sweep; then
    echo "== launch settings at 128k, batch 1, 10% =="
    timeout "${SWEEP_TIMEOUT:-150}" "$PY" scripts/bench_decode.py --device cuda --out "$OUT" --sweep "${SWEEP_AT:-131072,1,0.1}" 2>&1 | tee "$OUT/sweep.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if stage tune; then
    echo "== launch settings at 128k, batch 8, 10%, then the table with the fastest =="
    timeout "${TUNE_TIMEOUT:-300}" "$PY" scripts/bench_decode.py --device cuda --out "$OUT" --sweep "${SWEEP_AT:-131072,8,0.1}" --then-table 2>&1 | tee "$OUT/tune.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if stage profile; then
    # hardware counters of one decode launch at 128k, batch 8, 10% (ncu reads them on Firecracker
    # machines; --clock-control none leaves the clocks alone): occupancy, memory throughput, stall reasons
    echo "== ncu: one _page_attn launch =="
    timeout "${PROFILE_TIMEOUT:-150}" ncu --clock-control none --kernel-name regex:_page_attn --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section LaunchStats --section SchedulerStats \
        "$PY" scripts/bench_decode.py --device cuda --contexts 131072 --batches 8 --budgets 0.1 --no-deq --quick 2>&1 | tee "$OUT/ncu.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if stage prefill; then
    echo "== prefill peak GPU memory, Llama-3.1-8B shape, full cache vs rdkv.prefill =="
    timeout "${PREFILL_TIMEOUT:-120}" "$PY" scripts/bench_prefill_memory.py --model llama-8b-random --dtype bfloat16 \
        --device cuda --contexts ${PREFILL_CONTEXTS:-32768 131072} --paths full prefill prefill-layer 2>&1 | tee "$OUT/prefill_memory.md"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if stage compress; then
    echo "== compress-side kernels vs torch =="
    timeout "${COMPRESS_TIMEOUT:-60}" "$PY" scripts/bench_compress_kernels.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/bench_compress.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
