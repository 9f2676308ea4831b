#!/usr/bin/env bash
# The GPU benchmark of BENCHMARKS.md, in one device call (bench/bench_gpu.c):
#   1. writes the random-weight Llama-3.1-8B-shaped GGUF onto the machine's
#      local disk (bench/gen_random_gguf.py: tools/make_random_gguf.py's
#      writer with the numbers drawn on the GPU), in the background;
#   2. builds and checks the CUDA backend (scripts/gpu_check.sh: ctest -L gpu;
#      compute-sanitizer only when IS_GPU_SANITIZE=1), then builds bench_gpu;
#   3. times TTFT vs k and throughput vs users (bench_gpu), before/after
#      configurations side by side;
#   4. runs Hugging Face transformers on the same shape (bench/hf_reference.py)
#      as the outside reference.
# Results: $OUT/summary.md (the tables), $OUT/logs.tar.gz (every log and CSV).
#
# Carry: .gpudeps (scripts/gpu_prepare.sh), .whl (the `gguf` wheel: the
# image has numpy but not gguf), and for the default-model tests the model
# in two parts: a first call with .gpumodel_a copies its part into models/
# (kept on the warm machine), this one carries .gpumodel_b:
#   call A: carry [".gpumodel_a"], command "mkdir -p models/parts && cp .gpumodel_a/part.* models/parts/"
#   call B: carry [".gpumodel_b", ".gpudeps", ".whl"], command "bash bench/run_gpu_bench.sh"
#
# Environment: BENCH_ARGS (extra bench_gpu arguments), BENCH_TYPE (f16),
# GEMM_BENCH=1 (bench_gemm_gpu, GEMM_ARGS), ATTN_BENCH=1 (bench_attn_gpu, ATTN_ARGS),
# NCU=1 (Nsight Compute on bench_gemm_gpu -P; NCU_KERNELS, NCU_TIMEOUT),
# NCU_ATTN=case (Nsight Compute's stall samples on bench_attn_gpu -P case),
# BENCH=0 to stop after the checks, micro-benchmarks and sanitizer runs (no GGUF,
# no bench_gpu),
# HF=0 to skip transformers, GEN_ONLY_CPU=1 to draw with numpy, GEN_AFTER_CHECK=1
# to write the GGUF after the checks, CTEST_TIMEOUT (per test, 200 s),
# IS_CUDA_OPTIONS (the CUDA backend's options, cuda/options.h, for every program),
# BENCH2_ARGS (a second bench_gpu run after the first, e.g. the op profile -p).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_common.sh

stamp "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -1), $(nproc) cores"

# The default model from its two parts (see above), where present.
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$MODEL" ] && ls models/parts/part.* >/dev/null 2>&1 && [ -d .gpumodel_b ]; then
  cat models/parts/part.* .gpumodel_b/part.* > "$MODEL.part"
  if [ "$(sha256sum "$MODEL.part" | cut -d' ' -f1)" = "$(cat .gpumodel_b/sha256)" ]; then
    mv "$MODEL.part" "$MODEL"; stamp "default model reassembled"
  else
    rm -f "$MODEL.part"; stamp "default model parts do not match their sha256"
  fi
fi

# 1. The GGUF, in the background (gen_gguf). GEN_AFTER_CHECK=1: written
# after the checks, not beside them (the tests then have the GPU to
# themselves).
[ "${GEN_AFTER_CHECK:-0}" = 1 ] || [ "${BENCH:-1}" = 0 ] || gen_gguf

# 2. Build and check.
OUT=$LOG IS_GPU_SANITIZE=${IS_GPU_SANITIZE:-0} timeout "${CHECK_TIMEOUT:-400}" bash scripts/gpu_check.sh \
  > "$LOG/check.out" 2>&1
CHECK_RC=$?
sed -n '/=== summary/,$p' "$LOG/check.out" | tee -a "$SUMMARY"
grep -E 'rel err|identical|arena|inject|FAILED|SKIPPED|PASSED' "$LOG/ctest.log" 2>/dev/null \
  | grep -vE '^\s*$' | head -80 >> "$SUMMARY"
stamp "gpu_check rc $CHECK_RC"
[ "${GEN_AFTER_CHECK:-0}" = 1 ] && [ "${BENCH:-1}" != 0 ] && gen_gguf
if [ -f "$LOG/cmake.log" ] && [ -d build-gpu ]; then
  if ! cmake --build build-gpu -j "$(nproc)" --target bench_gpu > "$LOG/build_bench.log" 2>&1; then
    stamp "bench_gpu build FAILED"; tail -20 "$LOG/build_bench.log"; exit 1
  fi
fi

# 2b. Micro-benchmarks, once the GGUF writer has left the GPU: GEMM_BENCH=1
# (bench_gemm_gpu: the skinny products against cuBLAS; GEMM_ARGS, e.g. -s for
# the whole sweep of cuts), ATTN_BENCH=1 (bench_attn_gpu: attention alone at
# the kv request's shapes, old and new plans, a split sweep; ATTN_ARGS).
micro_bench() { # target, its arguments, log name
  if [ -n "$GEN_PID" ]; then wait "$GEN_PID"; GEN_PID=; fi
  if cmake --build build-gpu -j "$(nproc)" --target "$1" > "$LOG/build_$3.log" 2>&1; then
    stamp "$1 $2"
    timeout 120 "build-gpu/bench/$1" $2 2>&1 | tee "$LOG/$3.log" >> "$SUMMARY"
  else
    stamp "$1 build FAILED"; tail -20 "$LOG/build_$3.log" >> "$SUMMARY"
  fi
}
[ "${GEMM_BENCH:-0}" = 1 ] && micro_bench bench_gemm_gpu "${GEMM_ARGS:-}" gemm
[ "${ATTN_BENCH:-0}" = 1 ] && micro_bench bench_attn_gpu "${ATTN_ARGS:-}" attn

# Nsight Compute, for 2c and 2d, where installed.
NCU_BIN=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)

# 2c. Nsight Compute on the products (NCU=1): bench_gemm_gpu -P (each stacked
# product of a layer once at 30 rows, cuBLAS and skinny), the kernels whose
# names match NCU_KERNELS; clocks left alone (METHOD.md).
if [ "${NCU:-0}" = 1 ]; then
  if [ -n "$NCU_BIN" ] && cmake --build build-gpu -j "$(nproc)" --target bench_gemm_gpu > "$LOG/build_ncu.log" 2>&1; then
    stamp "ncu on bench_gemm_gpu -P"
    timeout "${NCU_TIMEOUT:-150}" "$NCU_BIN" --clock-control none --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      -k "regex:${NCU_KERNELS:-skinny|nvjet|gemm|xmma|sm90}" build-gpu/bench/bench_gemm_gpu -P > "$LOG/ncu.log" 2>&1
    stamp "ncu rc $?"
    grep -E "^  [A-Za-z_].*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Grid Size|Block Size|Waves Per SM|Compute \(SM\) Throughput|L1/TEX Hit|L2 Hit|Warp Cycles Per Issued|Cluster Size|rel diff" \
      "$LOG/ncu.log" >> "$SUMMARY"
  else
    stamp "ncu: not found or bench_gemm_gpu not built"
  fi
fi

# 2d. Nsight Compute on the attention (NCU_ATTN=case, a bench_attn_gpu -P
# case: 3 is the 30-token query at k = 50): one launch after two, warp
# states and the per-instruction stall samples; the report and its SASS
# page (CSV) go to $OUT for reading elsewhere.
if [ -n "${NCU_ATTN:-}" ]; then
  if [ -n "$NCU_BIN" ] && cmake --build build-gpu -j "$(nproc)" --target bench_attn_gpu > "$LOG/build_ncu_attn.log" 2>&1; then
    stamp "ncu on bench_attn_gpu -P $NCU_ATTN"
    timeout "${NCU_TIMEOUT:-150}" "$NCU_BIN" --clock-control none --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SourceCounters --import-source no \
      -k "regex:flash_kernel" -o "$OUT/attn" -f build-gpu/bench/bench_attn_gpu -P "$NCU_ATTN" -r 3 \
      > "$LOG/ncu_attn.log" 2>&1
    stamp "ncu rc $?"
    "$NCU_BIN" --import "$OUT/attn.ncu-rep" --page source --csv --print-source sass > "$OUT/attn_sass.csv" 2>> "$LOG/ncu_attn.log"
    "$NCU_BIN" --import "$OUT/attn.ncu-rep" --page details > "$LOG/ncu_attn_details.log" 2>&1
    grep -E "Duration|Warp Cycles Per Issued|Stall|Issued Warp|Registers" "$LOG/ncu_attn_details.log" >> "$SUMMARY"
  else
    stamp "ncu: not found or bench_attn_gpu not built"
  fi
fi

# 5. compute-sanitizer on the new kernels' tests (SANITIZE_NEW=1; SANITIZE_TESTS
# = "tool:test ..." to choose: a test of test_cuda_ops, or @binary for a whole
# test program of tests/cuda, e.g. memcheck:@test_flash_engines), short.
# A function, so that a BENCH=0 call runs it too.
sanitize_new() {
  [ "${SANITIZE_NEW:-0}" = 1 ] || return 0
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  for run in ${SANITIZE_TESTS:-racecheck:test_attention_bf16 memcheck:test_attention_bf16 memcheck:test_inject \
             racecheck:test_matmul memcheck:test_matmul memcheck:test_add_rmsnorm}; do
    tool=${run%%:*} filt=${run#*:} bin=test_cuda_ops
    case $filt in @*) bin=${filt#@} filt=; ;; esac
    IS_TEST_FILTER=$filt IS_CUDA_TEST_NO_OOM=1 timeout "${SAN_TIMEOUT:-35}" "$SAN" --tool "$tool" \
      --error-exitcode 97 --print-limit 10 "build-gpu/tests/cuda/$bin" > "$LOG/san_${tool}_${filt:-$bin}.log" 2>&1
    rc=$?
    stamp "$tool ${filt:-$bin}: rc $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$LOG/san_${tool}_${filt:-$bin}.log" | tr '\n' ' ')"
  done
}

# The -dev packages gpu_check.sh unpacked, for the programs run from here on.
DEPS_LD=$REPO/build-gpu/deps/ldlib
[ -d "$DEPS_LD" ] && export LD_LIBRARY_PATH="$DEPS_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ "${BENCH:-1}" = 0 ]; then stamp "BENCH=0: no GGUF, no bench_gpu"; sanitize_new; exit 0; fi
if [ -n "$GEN_PID" ]; then wait "$GEN_PID"; fi
stamp "gguf: $(tail -2 "$LOG/gen.log" | tr '\n' ' ')"
[ -s "$GGUF" ] || { stamp "no GGUF"; exit 1; }
ls -la "$GGUF" >> "$SUMMARY"

# 3. Our benchmark.
stamp "bench_gpu ${BENCH_ARGS:-}"
timeout "${BENCH_TIMEOUT:-330}" build-gpu/bench/bench_gpu -m "$GGUF" -o "$LOG/bench.csv" ${BENCH_ARGS:-} \
  2>&1 | tee "$LOG/bench.log" | tee -a "$SUMMARY"
stamp "bench_gpu rc ${PIPESTATUS[0]}"
# A second run in the same call where BENCH2_ARGS is set (e.g. the op
# profile, -p, beside the live timings).
if [ -n "${BENCH2_ARGS:-}" ]; then
  stamp "bench_gpu $BENCH2_ARGS"
  timeout "${BENCH_TIMEOUT:-330}" build-gpu/bench/bench_gpu -m "$GGUF" -o "$LOG/bench2.csv" $BENCH2_ARGS \
    2>&1 | tee "$LOG/bench2.log" | tee -a "$SUMMARY"
  stamp "bench_gpu rc ${PIPESTATUS[0]}"
fi

# 4. The outside reference.
if [ "${HF:-1}" = 1 ]; then
  PYTHONUNBUFFERED=1 timeout "${HF_TIMEOUT:-150}" python3 bench/hf_reference.py --csv "$LOG/hf.csv" \
    ${HF_ARGS:-} 2>&1 | grep -vE 'Warning|warn\(' | tee "$LOG/hf.log" | tee -a "$SUMMARY"
  stamp "hf_reference rc ${PIPESTATUS[0]}"
fi
sanitize_new
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >> "$SUMMARY" 2>&1
