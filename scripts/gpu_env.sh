# Sourced by the scripts that run on the GPU machine (gpu_check.sh,
# gpu_eval_locomo.sh): prints what the machine has, makes the -dev packages
# carried in .gpudeps usable (a private root, pkg-config and the loader
# pointed at it) and reassembles the default model carried in two parts.
# Expects REPO, BUILD and a section() function; sets CMAKE_EXTRA.
section machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1 | head -3
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
nvcc --version 2>&1 | tail -2
grep -E '^(PRETTY_NAME)=' /etc/os-release 2>/dev/null
echo "cores: $(nproc)"
for t in gcc g++ cmake ninja make pkg-config compute-sanitizer; do
  printf '  %-18s %s\n' "$t" "$(command -v $t || echo missing)"
done

section dependencies
MODS="libpcre2-8 openblas libcjson libutf8proc sqlite3 cmocka libmicrohttpd libcurl"
PKGCFG=$(command -v pkg-config || true)
have_mods() {
  [ -n "$PKGCFG" ] || return 1
  PKG_CONFIG_PATH="/usr/lib/x86_64-linux-gnu/openblas-openmp/pkgconfig:${PKG_CONFIG_PATH:-}" \
    "$PKGCFG" --exists $MODS
}
CMAKE_EXTRA=()
if have_mods; then
  echo "system pkg-config finds: $MODS"
elif [ -f .gpudeps/deps.tar.xz ]; then
  ROOT=$BUILD/deps # outside .gpudeps, which travels
  rm -rf "$ROOT" && mkdir -p "$ROOT"
  tar -xJf .gpudeps/deps.tar.xz -C "$ROOT"
  # The .pc files name /usr: point them at the private root.
  find "$ROOT" -name '*.pc' -exec sed -i "s#/usr#$ROOT/usr#g" {} +
  # libmicrohttpd.pc names gnutls as a private requirement, which matters
  # only to static links; its -dev package (and theirs) is not carried.
  sed -i '/^Requires.private:/d' "$ROOT"/usr/lib/x86_64-linux-gnu/pkgconfig/libmicrohttpd.pc 2>/dev/null
  LIBDIR=$ROOT/usr/lib/x86_64-linux-gnu
  export PKG_CONFIG_PATH="$LIBDIR/pkgconfig:$LIBDIR/openblas-openmp/pkgconfig:$ROOT/usr/share/pkgconfig:${PKG_CONFIG_PATH:-}"
  # Runtime libraries the system lacks (libgfortran for OpenBLAS, ...), and
  # only those, go on LD_LIBRARY_PATH; the build's RUNPATH finds the rest.
  mkdir -p "$ROOT/ldlib"
  SYSLIBS=$( (ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null) | awk 'NR > 1 {print $1}')
  for f in "$LIBDIR"/*.so.* "$LIBDIR"/openblas-openmp/*.so.*; do
    n=$(basename "$f")
    grep -qxF "$n" <<< "$SYSLIBS" || ln -sf "$f" "$ROOT/ldlib/$n"
  done
  export LD_LIBRARY_PATH="$ROOT/ldlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "private libraries: $(ls "$ROOT/ldlib" | tr '\n' ' ')"
  if [ -z "$PKGCFG" ]; then
    PKGCFG=$ROOT/usr/bin/pkgconf
    CMAKE_EXTRA+=("-DPKG_CONFIG_EXECUTABLE=$PKGCFG")
  fi
  if have_mods; then echo "found in .gpudeps: $MODS"; else echo "still missing: $MODS"; fi
else
  echo "missing -dev packages and no .gpudeps/deps.tar.xz (run scripts/gpu_prepare.sh here)"
fi

section model
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$MODEL" ] && [ -d .gpumodel_a ] && [ -d .gpumodel_b ]; then
  mkdir -p models
  cat .gpumodel_a/part.* .gpumodel_b/part.* > "$MODEL.part"
  if [ "$(sha256sum "$MODEL.part" | cut -d' ' -f1)" = "$(cat .gpumodel_b/sha256)" ]; then
    mv "$MODEL.part" "$MODEL"
    echo "reassembled $MODEL"
  else
    rm -f "$MODEL.part"
    echo "model parts do not match their sha256: the model tests will skip"
  fi
fi
[ -f "$MODEL" ] && ls -la "$MODEL" || echo "no $MODEL: the default-model tests skip"

