#!/usr/bin/env bash
# Build the llama.cpp "anchor" (issue 22) from the sources vendored in the
# llama-cpp-python==0.3.36 sdist (llama.cpp commit 0c1e570, ggml 0.25.3), as
# /work/shared/anchors.md describes, plus a Python venv able to run
# convert_hf_to_gguf.py and llama-cpp-python (built from the same, patched sources).
#
# Usage: deploy/anchor/build-llama-cpp.sh [STEP...]
#   steps (default: all, in this order):
#     tools    sdist download, AMX patch, cmake build of the llama.cpp binaries
#     pydeps   venv with torch (CPU), numpy, safetensors, sentencepiece, transformers, gguf-py
#     pyllama  llama-cpp-python==0.3.36 built from the same patched sources (~10 min on 2 cores)
# Environment:
#   LCP_WORK  work dir (default /tmp/lcp); everything goes there
#   JOBS      parallel compile jobs (default 2)
#   LCP_ARCH  native (default: -march=native, into build/) or avx2 (AVX2, FMA, F16C and BMI2
#             only, into build-avx2/: llama.cpp as a CPU without AVX-512 runs it, to set
#             beside Duplex under DUPLEX_ISA=avx2; tools step only)
#   LCP_TARGETS  cmake targets (default: llama-bench llama-quantize llama-completion llama-cli
#                llama-gguf-split)
# Idempotent: every step checks what is already there and skips it.
#
# AMX is compiled out (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16 after -march=native in
# ggml/src/ggml-cpu/CMakeLists.txt): its buffer type breaks the DeepSeek-V3 layout on Intel
# hosts (see anchors.md). Harmless on machines without AMX. Say so when quoting numbers.
set -euo pipefail

WORK="${LCP_WORK:-/tmp/lcp}"
JOBS="${JOBS:-2}"
VERSION=0.3.36
TARGETS="${LCP_TARGETS:-llama-bench llama-quantize llama-completion llama-cli llama-gguf-split}"
SRC="$WORK/llama_cpp_python-$VERSION"
LCPP="$SRC/vendor/llama.cpp"
ARCH="${LCP_ARCH:-native}"
case "$ARCH" in
    native) BUILD="$LCPP/build"; ARCH_FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2) BUILD="$LCPP/build-avx2"
          ARCH_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF) ;;
    *) echo "LCP_ARCH must be native or avx2, not '$ARCH'" >&2; exit 1 ;;
esac
VENV="$WORK/venv"

log() { printf '[build-llama-cpp %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

mkdir -p "$WORK"

# A venv is needed by every step (cmake/ninja come from PyPI wheels; the machine has none).
ensure_venv() {
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating venv $VENV"
        python3 -m venv "$VENV"
    fi
    if [[ ! -x "$VENV/bin/cmake" ]]; then
        log "installing cmake and ninja wheels into the venv"
        "$VENV/bin/pip" install -q cmake ninja
    fi
    export PATH="$VENV/bin:$PATH"
}

ensure_sources() {
    local sdist="$WORK/llama_cpp_python-$VERSION.tar.gz"
    if [[ ! -f "$sdist" ]]; then
        log "downloading the llama-cpp-python==$VERSION sdist"
        # Only llama-cpp-python as source: '--no-binary :all:' would build its build
        # dependencies (cmake, ...) from source too, which takes ages.
        "$VENV/bin/pip" download -q --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$VERSION" -d "$WORK"
    fi
    [[ -f "$sdist" ]] || die "sdist $sdist missing after download"
    if [[ ! -f "$LCPP/CMakeLists.txt" ]]; then
        log "extracting $sdist"
        tar xzf "$sdist" -C "$WORK"
    fi
    local cm="$LCPP/ggml/src/ggml-cpu/CMakeLists.txt"
    if ! grep -q -- '-mno-amx-tile' "$cm"; then
        log "patching $cm: AMX compiled out after -march=native"
        grep -q 'list(APPEND ARCH_FLAGS -march=native)' "$cm" \
            || die "no 'list(APPEND ARCH_FLAGS -march=native)' in $cm: the recipe does not fit this version"
        sed -i 's/list(APPEND ARCH_FLAGS -march=native)/list(APPEND ARCH_FLAGS -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16)/' "$cm"
    fi
}

step_tools() {
    ensure_sources
    if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
        log "configuring llama.cpp in $BUILD"
        cmake -S "$LCPP" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${ARCH_FLAGS[@]}" \
            -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
    fi
    local missing=()
    for t in $TARGETS; do [[ -x "$BUILD/bin/$t" ]] || missing+=("$t"); done
    if (( ${#missing[@]} )); then
        log "building ${missing[*]} with -j$JOBS (a few minutes per target on 2 cores)"
        cmake --build "$BUILD" -j"$JOBS" --target "${missing[@]}"
    else
        log "llama.cpp binaries already built: $TARGETS"
    fi
    for t in $TARGETS; do [[ -x "$BUILD/bin/$t" ]] || die "$BUILD/bin/$t was not built"; done
    if grep -q 'AMX' <("$BUILD/bin/llama-bench" --list-devices 2>&1 || true); then
        log "warning: llama-bench mentions AMX"
    fi
    log "binaries in $BUILD/bin"
}

step_pydeps() {
    ensure_sources
    if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        log "installing torch (CPU) from download.pytorch.org"
        if ! "$VENV/bin/pip" install -q --no-cache-dir --retries 1 --timeout 20 torch --index-url https://download.pytorch.org/whl/cpu; then
            # The PyPI wheel is the CUDA build: it needs the nvidia-* wheels (~3 GB) to import,
            # even on CPU. --no-cache-dir: no second copy of them in ~/.cache/pip.
            log "the PyTorch CPU index failed; installing the PyPI torch wheel (CUDA build, ~4.5 GB) instead"
            "$VENV/bin/pip" install -q --no-cache-dir torch
        fi
        # triton (1 GB) is only for torch.compile on GPUs; the converter never needs it.
        "$VENV/bin/pip" uninstall -y -q triton 2>/dev/null || true
    fi
    if ! "$VENV/bin/python" -c 'import numpy, safetensors, sentencepiece, transformers, google.protobuf' 2>/dev/null; then
        log "installing numpy safetensors sentencepiece transformers protobuf"
        # transformers: the converter reads the config and the BPE tokenizer with it
        # (requirements-convert_hf_to_gguf.txt pins 4.57.6).
        "$VENV/bin/pip" install -q --no-cache-dir "numpy<2.3" safetensors "sentencepiece<0.3" \
            "transformers==4.57.6" "protobuf>=4.21,<5"
    fi
    # The vendored gguf-py, not the PyPI one: it must match the converter.
    if ! "$VENV/bin/python" -c 'import gguf, sys; sys.exit(0 if "vendor/llama.cpp/gguf-py" in gguf.__file__ else 1)' 2>/dev/null; then
        log "installing the vendored gguf-py (editable)"
        "$VENV/bin/pip" install -q -e "$LCPP/gguf-py"
    fi
    "$VENV/bin/python" -c 'import torch, numpy, safetensors, sentencepiece, transformers, gguf; print("torch", torch.__version__, "numpy", numpy.__version__, "gguf", gguf.__file__)'
}

step_pyllama() {
    ensure_sources
    if "$VENV/bin/python" -c 'import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == "'"$VERSION"'" else 1)' 2>/dev/null; then
        log "llama-cpp-python $VERSION already installed"
        return
    fi
    log "building llama-cpp-python $VERSION from $SRC (same patched sources; ~10 min on 2 cores)"
    # No build isolation: the venv already has cmake/ninja; scikit-build-core is added here.
    "$VENV/bin/pip" install -q "scikit-build-core>=0.9.2" typing-extensions "numpy<2.3" diskcache jinja2
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        "$VENV/bin/pip" install --no-build-isolation --no-deps -v "$SRC" > "$WORK/pyllama-build.log" 2>&1 \
        || { tail -40 "$WORK/pyllama-build.log" >&2; die "llama-cpp-python build failed (log: $WORK/pyllama-build.log)"; }
    "$VENV/bin/python" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__, llama_cpp.__file__)'
}

steps=("$@")
(( ${#steps[@]} )) || steps=(tools pydeps pyllama)
ensure_venv
for s in "${steps[@]}"; do
    case "$s" in
        tools|pydeps|pyllama) log "step $s"; "step_$s" ;;
        all) for t in tools pydeps pyllama; do log "step $t"; "step_$t"; done ;;
        *) die "unknown step '$s' (tools, pydeps, pyllama, all)" ;;
    esac
done
log "done"
