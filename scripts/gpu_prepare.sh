#!/usr/bin/env bash
# Prepares, on a development machine, what scripts/gpu_check.sh needs on the
# GPU machine that its repository copy does not carry:
#   .gpudeps/deps.tar.xz   the Debian -dev packages the build links against
#                          (that machine has nvcc and cuBLAS but none of
#                          them, and no network), unpacked there into a
#                          private folder, never into /;
#   .gpumodel_a/, .gpumodel_b/
#                          the default model in two parts, since one device
#                          call carries at most 64 MiB (repository included).
# All three folders are added to .git/info/exclude: they travel only when a
# call names them in `carry`, and stay on the warm machine between calls.
#
# Then, with the device tool (device time is counted from the first call):
#   call 1: carry [".gpumodel_a"], command "true"
#   call 2: carry [".gpumodel_b", ".gpudeps"], command "bash scripts/gpu_check.sh"
# (without the model: one call, carry [".gpudeps"]; the model tests skip).
#
# Usage: scripts/gpu_prepare.sh [--no-model]
set -euo pipefail
cd "$(dirname "$0")/.."

# (In a git worktree .git is a file: ask git where the exclude file is.)
EXCLUDE=$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
for d in .gpudeps .gpumodel_a .gpumodel_b; do
  grep -qxF "/$d/" "$EXCLUDE" 2>/dev/null || echo "/$d/" >> "$EXCLUDE"
done

# The HTTP server (libmicrohttpd) and the HTTP clients of test_http and
# bench_load (libcurl), with the runtime libraries they load. Only the
# libraries that machine lacks are put on its loader path (gpu_env.sh), so
# listing ones it may have (libssl3, zlib) costs only room.
HTTP_PKGS="libmicrohttpd-dev libmicrohttpd12 libgnutls30 libgmp10 libhogweed6 libnettle8 libidn2-0
libp11-kit0 libtasn1-6 libunistring2 libffi8 libcurl4-openssl-dev libcurl4 libbrotli1
libgssapi-krb5-2 libk5crypto3 libkrb5-3 libkrb5support0 libcom-err2 libkeyutils1 libldap-2.5-0
libsasl2-2 libsasl2-modules-db libdb5.3 libnghttp2-14 libpsl5 librtmp1 libssh2-1 libssl3 libzstd1
zlib1g"
# The packages of scripts/setup.sh that the build needs, with their runtime
# libraries, and pkgconf in case that machine has no pkg-config. Not
# nettle-dev: a build linked against the carried libnettle puts it before the
# machine's own, whose libgnutls then misses newer symbols; --verify is
# unavailable in GPU builds.
PKGS="pkgconf pkgconf-bin libpkgconf3 libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0
libpcre2-posix3 libopenblas-openmp-dev libopenblas0-openmp libgfortran5 libquadmath0 libcjson-dev
libcjson1 libutf8proc-dev libutf8proc2 libsqlite3-dev libsqlite3-0 libcmocka-dev libcmocka0
$HTTP_PKGS"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/debs" "$tmp/root"
(cd "$tmp/debs" && apt-get download $PKGS >/dev/null 2>&1) || {
  echo "gpu_prepare: apt-get download failed (run apt-get update first?)" >&2; exit 1; }
for f in "$tmp"/debs/*.deb; do dpkg -x "$f" "$tmp/root"; done
# Static libraries and documentation are not needed there; they would only
# take room in the 64 MiB a call carries.
find "$tmp/root" -name '*.a' -delete
rm -rf "$tmp/root/usr/share/doc" "$tmp/root/usr/share/man" "$tmp/root/usr/share/lintian"
mkdir -p .gpudeps
tar -cJf .gpudeps/deps.tar.xz -C "$tmp/root" .
echo "gpu_prepare: .gpudeps/deps.tar.xz ($(du -h .gpudeps/deps.tar.xz | cut -f1))"

[ "${1:-}" = "--no-model" ] && exit 0
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || { echo "gpu_prepare: $MODEL is missing (scripts/setup.sh fetches it)" >&2; exit 1; }
rm -rf .gpumodel_a .gpumodel_b
mkdir -p .gpumodel_a .gpumodel_b
split -b 53500000 -d -a 2 "$MODEL" "$tmp/part."
mv "$tmp/part.00" .gpumodel_a/
mv "$tmp"/part.0[1-9] .gpumodel_b/
sha256sum "$MODEL" | cut -d' ' -f1 > .gpumodel_b/sha256
echo "gpu_prepare: model split into .gpumodel_a ($(du -sh .gpumodel_a | cut -f1)) and .gpumodel_b ($(du -sh .gpumodel_b | cut -f1))"
