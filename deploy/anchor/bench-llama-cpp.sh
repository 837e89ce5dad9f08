#!/usr/bin/env bash
# GGUFs of the `bench` synth model (FP8, DeepSeek-V3 shaped) and llama-bench on them.
#
# Usage: deploy/anchor/bench-llama-cpp.sh [make|bench|all]   (default all)
#   make   $MODEL (HF dir, FP8) -> $OUT_DIR/bench-Q8_0.gguf (the converter's own Q8_0, FP8
#          dequantised with weight_scale_inv) and $OUT_DIR/bench-Q4_K_M.gguf (llama-quantize
#          --allow-requantize from that Q8_0: no F16 intermediate, which would be ~10 GB);
#          skips files already there. Symlinks them into /tmp/anchor when OUT_DIR is elsewhere.
#   bench  llama-bench -t $THREADS, prefill -p 512,2048 -n 0 and decode -p 0 -n 32 -d 512,4096,
#          -r 3, on each GGUF; JSON and markdown results and `uptime` in $OUT_DIR/results-<time>/
# Environment: LCP_WORK (default /tmp/lcp), MODEL (default /tmp/bench-synth; make it with
#   `cargo run --release -p duplex-cli -- synth --preset bench --out /tmp/bench-synth`),
#   OUT_DIR (default /tmp/anchor; put it on /dev/shm when the disk is short: 5.6 + 3.2 GB),
#   THREADS (default 2), REPS (default 3).
# Run nothing heavy beside `bench`: the numbers would be meaningless.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${LCP_WORK:-/tmp/lcp}"
LCPP="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp"
BIN="$LCPP/build/bin"
PY="$WORK/venv/bin/python"
MODEL="${MODEL:-/tmp/bench-synth}"
OUT_DIR="${OUT_DIR:-/tmp/anchor}"
THREADS="${THREADS:-2}"
REPS="${REPS:-3}"

log() { printf '[bench-llama-cpp %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
. "$HERE/lib.sh"

[[ -x "$BIN/llama-bench" && -x "$PY" ]] || die "run deploy/anchor/build-llama-cpp.sh tools pydeps first"
mkdir -p "$OUT_DIR" /tmp/anchor
Q8="$OUT_DIR/bench-Q8_0.gguf"
Q4="$OUT_DIR/bench-Q4_K_M.gguf"

step_make() {
    [[ -f "$MODEL/config.json" ]] || die "no $MODEL; make it: cargo run --release -p duplex-cli -- synth --preset bench --out $MODEL"
    ensure_converter
    if [[ ! -f "$Q8" ]]; then
        log "converting $MODEL -> $Q8 (--outtype q8_0)"
        "$PY" "$CONV/convert_hf_to_gguf.py" "$MODEL" --outtype q8_0 --outfile "$Q8.part" > "$OUT_DIR/convert.log" 2>&1 \
            || { tail -30 "$OUT_DIR/convert.log" >&2; die "conversion failed (log $OUT_DIR/convert.log)"; }
        mv "$Q8.part" "$Q8"
    fi
    if [[ ! -f "$Q4" ]]; then
        log "quantizing $Q8 -> $Q4 (Q4_K_M, --allow-requantize)"
        "$BIN/llama-quantize" --allow-requantize "$Q8" "$Q4.part" Q4_K_M "$THREADS" > "$OUT_DIR/quantize.log" 2>&1 \
            || { tail -30 "$OUT_DIR/quantize.log" >&2; die "llama-quantize failed (log $OUT_DIR/quantize.log)"; }
        mv "$Q4.part" "$Q4"
    fi
    if [[ "$(cd "$OUT_DIR" && pwd)" != /tmp/anchor ]]; then
        ln -sf "$Q8" /tmp/anchor/bench-Q8_0.gguf
        ln -sf "$Q4" /tmp/anchor/bench-Q4_K_M.gguf
    fi
    ls -la "$Q8" "$Q4" >&2
}

step_bench() {
    [[ -f "$Q8" && -f "$Q4" ]] || die "no GGUFs in $OUT_DIR: run '$0 make' first"
    local res="$OUT_DIR/results-$(date -u +%Y%m%dT%H%M%SZ)"
    mkdir -p "$res"
    for m in "$Q4" "$Q8"; do
        local tag; tag="$(basename "$m" .gguf)"
        for kind in prefill decode; do
            local args
            if [[ $kind == prefill ]]; then args=(-p 512,2048 -n 0); else args=(-p 0 -n 32 -d 512,4096); fi
            log "$tag $kind: uptime: $(uptime)"
            uptime > "$res/$tag-$kind.uptime"
            "$BIN/llama-bench" -m "$m" -t "$THREADS" "${args[@]}" -r "$REPS" -o json > "$res/$tag-$kind.json" 2> "$res/$tag-$kind.log"
            uptime >> "$res/$tag-$kind.uptime"
            "$PY" "$HERE/bench_summary.py" "$res/$tag-$kind.json" | tee "$res/$tag-$kind.txt"
        done
    done
    log "results in $res"
}

case "${1:-all}" in
    make) step_make ;;
    bench) step_bench ;;
    all) step_make; step_bench ;;
    *) die "unknown step '$1' (make, bench, all)" ;;
esac
