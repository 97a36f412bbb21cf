#!/usr/bin/env bash
# The GPU check: one command on a lent GPU machine that has no internet (docs/gpu.md).
#
#   benchmarks/gpu_check.sh [OUT_DIR]        (make gpu-check; OUT_DIR default gpu-check-out)
#
# 1. the environment (GPU, torch, CUDA, triton) into OUT_DIR/env.txt;
# 2. tests/cuda (greedy fp32 equal to transformers with CUDA graphs at padded batch sizes,
#    chunked prefill, radix hits and retraction; bf16 within tolerance; the kernels in fp32,
#    fp16 and bf16; the HTTP server on CUDA), its log and JUnit XML into OUT_DIR;
# 3. bench_offline_throughput.py --device cuda on `small` and on an 8B Llama-3-shaped random
#    checkpoint built on the GPU (radixserve and transformers in the same run), and
#    bench_graphed_step.py (the plain-torch step of the same shape in one CUDA graph, and the
#    device copy bandwidth), as JSON lines into OUT_DIR;
# 4. the table of gpu_table.py, printed last and written to OUT_DIR/table.md.
#
# Checkpoints are built locally (tests build theirs; the benchmark models go to
# ~/.cache/radixserve/bench). Each step has a time limit (seconds, overridable through the
# environment; the whole took 7.5 minutes on an H200); a step that fails or runs out of time is
# reported and the next one runs. Exit status: non-zero when any step failed.
# STEPS: which parts run, a comma-separated subset of tests,small,8b (default all three), so
# that a short lease can split the check over two calls.
# PY: the Python to use (default: .venv/bin/python if present, else python3 with src/ on the
# path, for machines that have a CUDA torch but no install of this project).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check-out}
mkdir -p "$OUT"
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET RADIXSERVE_CUDA_TEST_DEVICE
BENCH=${RADIXSERVE_BENCH_DIR:-$HOME/.cache/radixserve/bench}
T_TESTS=${T_TESTS:-300}
T_SMALL=${T_SMALL:-180}
T_BUILD=${T_BUILD:-60}
T_8B=${T_8B:-150}
T_GRAPHED=${T_GRAPHED:-45}
STEPS=",${STEPS:-tests,small,8b},"
failed=()

step() {  # step NAME TIMEOUT LOG COMMAND...
    local name=$1 limit=$2 log=$3
    shift 3
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout "$limit" "$@" > >(tee "$log") 2>"$log.err"
    local rc=$?
    echo "-- $name: exit $rc after $((SECONDS - start))s"
    if [[ $rc -ne 0 ]]; then failed+=("$name (exit $rc)"); tail -n 15 "$log.err"; fi
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
} 2>&1 | tee "$OUT/env.txt"

if [[ $STEPS == *,tests,* ]]; then
step "tests/cuda" "$T_TESTS" "$OUT/tests_cuda.log" \
    "$PY" -m pytest -q -p no:cacheprovider --durations=10 tests/cuda \
    --junitxml="$OUT/tests_cuda.xml"
fi

COMMON=(--device cuda --dtype bfloat16 --batch-sizes 1,64 --min-input-len 128
        --max-input-len 128 --max-total-tokens 65536)
if [[ $STEPS == *,small,* ]]; then
step "small: radixserve vs transformers" "$T_SMALL" "$OUT/small.offline.jsonl" \
    "$PY" benchmarks/bench_offline_throughput.py --model small "${COMMON[@]}" \
    --output-len 128 --prefill-len 2048
step "small: graphed plain-torch step" "$T_GRAPHED" "$OUT/small.graphed.jsonl" \
    "$PY" benchmarks/bench_graphed_step.py --model "$BENCH/small" --label small \
    --batch-sizes 1,64 --context 192
fi

if [[ $STEPS == *,8b,* ]]; then
step "8B shape: build on the GPU" "$T_BUILD" "$OUT/build_8b.log" \
    "$PY" benchmarks/make_gpu_model.py --out "$BENCH"
step "8B shape: radixserve vs transformers" "$T_8B" "$OUT/llama3-8b-shape.offline.jsonl" \
    "$PY" benchmarks/bench_offline_throughput.py --model "$BENCH/llama3-8b-shape" \
    "${COMMON[@]}" --output-len 64 --prefill-len 4096
step "8B shape: graphed plain-torch step" "$T_GRAPHED" "$OUT/llama3-8b-shape.graphed.jsonl" \
    "$PY" benchmarks/bench_graphed_step.py --model "$BENCH/llama3-8b-shape" \
    --label llama3-8b-shape --batch-sizes 1,64 --context 160
fi

echo "== summary"
"$PY" benchmarks/gpu_table.py "$OUT" | tee "$OUT/table.md"
if [[ ${#failed[@]} -gt 0 ]]; then
    printf 'FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "all steps passed"
