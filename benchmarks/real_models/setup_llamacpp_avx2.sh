#!/bin/bash
# Builds llama.cpp's llama-bench and llama-server for AVX2 only (no AVX-512, VNNI, BF16 or AMX), from
# the llama.cpp sources vendored in llama-cpp-python's sdist, into $ANCHORS/llamacpp-avx2: the
# llama.cpp side of the AVX2 proxy (docs/performance.md "An AVX2 proxy on an AVX-512 machine"),
# the build a 2-core AVX2 EPYC makes with GGML_NATIVE, run with its defaults (weight repacking on).
# On an AMX Xeon the shared native build ($ANCHORS/llamacpp-build, ../shared/anchors/setup_llamacpp.sh)
# dies with SIGILL in its AMX kernels unless run with --repack 0; this one does not reach them.
# Downloads llama-cpp-python's sdist when the anchors do not have it. ~15-25 min on 2 cores.
set -euo pipefail
ANCHORS="${ANCHORS:-${TOKENLOOM_ANCHORS_DIR:-$HOME/.cache/tokenloom-anchors}}"
JOBS="${JOBS:-2}"
mkdir -p "$ANCHORS/src"
cd "$ANCHORS/src"
ls llama_cpp_python-*.tar.gz >/dev/null 2>&1 || ls -d llama_cpp_python-*/ >/dev/null 2>&1 \
  || python3 -m pip download -q --no-binary :all: --no-deps llama-cpp-python -d .
if ! ls -d llama_cpp_python-*/ >/dev/null 2>&1; then
  SDIST=$(ls llama_cpp_python-*.tar.gz | sort | tail -1)
  tar xzf "$SDIST"
fi
SRC="$ANCHORS/src/$(ls -d llama_cpp_python-*/ | sort | tail -1)vendor/llama.cpp"
OUT="$ANCHORS/llamacpp-avx2"
# GGML_NATIVE=OFF + the explicit AVX2-era features: what -march=native gives on a Zen 2/3 EPYC.
# LLAMA_USE_PREBUILT_UI=OFF: the default tries to download the web UI at build time.
cmake -S "$SRC" -B "$OUT" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_BF16=OFF \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX_VNNI=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
cmake --build "$OUT" --target llama-bench llama-server -j"$JOBS"
echo "built: $(ls "$OUT/bin/" | grep -E '^llama-' | tr '\n' ' ')"
echo "its ggml CPU options (expect NATIVE OFF, AVX2 ON, every AVX512 / AMX / AVX_VNNI OFF):"
grep -E '^GGML_(NATIVE|AVX[A-Z0-9_]*|AMX[A-Z0-9_]*):' "$OUT/CMakeCache.txt" | tr '\n' ' '; echo
