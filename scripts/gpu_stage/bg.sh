#!/usr/bin/env bash
# Device prep in the background (setsid), from /tmp/src: GGUF, builds of the new tree and the base
# (BASE_TARGETS, default bench_gpu).
cd /tmp/src
T0=$(date +%s); st() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/whl/*.whl > /tmp/pip.log 2>&1
( PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/gen_random_gguf.py --preset llama31-8b --type f16 \
    --out /tmp/gguf.tmp > /tmp/gen.log 2>&1 && mv /tmp/gguf.tmp /tmp/llama31-8b.f16.gguf
  echo "gen rc $? at $(( $(date +%s) - T0 )) s" >> /tmp/gen.log ) &
st "gpu_check build"
OUT=/tmp/bgout IS_GPU_CTEST=0 IS_GPU_SANITIZE=0 bash scripts/gpu_check.sh > /tmp/bg_check.log 2>&1
st "gpu_check rc $?"
tail -8 /tmp/bg_check.log
cmake --build build-gpu -j "$(nproc)" --target bench_gpu bench_load bench_ingest bench_encode_host inferscale-cli > /tmp/bg_build2.log 2>&1
st "bench targets rc $?"
touch /tmp/build.done
# BASE_TARGETS=none: no baseline (a short loan measures this tree alone: WHO=new).
if [ "${BASE_TARGETS:-}" != none ]; then
for i in $(seq 1 200); do [ -f /tmp/base.tar.gz ] && break; sleep 2; done
rm -rf /tmp/base-src && mkdir -p /tmp/base-src && tar -xzf /tmp/base.tar.gz -C /tmp/base-src
ROOT=/tmp/src/build-gpu/deps; LIBDIR=$ROOT/usr/lib/x86_64-linux-gnu
export PKG_CONFIG_PATH="$LIBDIR/pkgconfig:$LIBDIR/openblas-openmp/pkgconfig:$ROOT/usr/share/pkgconfig"
EXTRA=(); command -v pkg-config >/dev/null || EXTRA=(-DPKG_CONFIG_EXECUTABLE=$ROOT/usr/bin/pkgconf)
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S /tmp/base-src -B build-base "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DIS_CUDA=ON "${EXTRA[@]}" > /tmp/bg_base_cmake.log 2>&1 &&
  cmake --build build-base -j "$(nproc)" --target ${BASE_TARGETS:-bench_gpu} > /tmp/bg_base.log 2>&1
st "base build rc $?"
fi
touch /tmp/base.done
wait
st "gen: $(tail -1 /tmp/gen.log)"
st done
