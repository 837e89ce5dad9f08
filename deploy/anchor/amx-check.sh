#!/usr/bin/env bash
# On a CPU with AMX: everything issue 22 asks of the tiles, in one run.
#
# Usage: deploy/anchor/amx-check.sh [tests|kernels|engine|all]   (default all)
#   tests    the kernels' tests in release, where the hardware tests now run the tile
#            unit against the software model (INT8 products, BF16 pair sums, both
#            self-checks); fails if any of them says it skipped
#   kernels  `quant_matmul` at 128, 512 and 2048 tokens on the AVX-512 and the tile
#            paths, as fractions of the `tdpbssd` peak measured in the same run, and the
#            1-32-token turning point; `matmul_bf16` (FP8 and BF16 weights) the same on
#            the vectors and the BF16 tiles, against the `tdpbf16ps` peak; `mla_decode`
#            at 16 and 128 heads, context 4096, with the `tdpbf16ps` peak (acceptance 3)
#   engine   `duplex bench-engine` on $MODEL, decode at contexts 512 and 4096 and prefill of
#            512 and 2048 tokens, DUPLEX_AMX=off and on alternating for $ROUNDS rounds: the
#            fraction of the roofline with and without the tiles (acceptance 4; its FP8
#            prefill takes the BF16 tiles); then the same on each of $GGUFS that exists
#            (their prefill takes the INT8 tiles: Q8_0 in the Q8_0 file; Q4_K, Q6_K and
#            Q5_0 in the Q4_K_M one)
# Environment: MODEL (default /tmp/bench-synth; make it with
#   `cargo run --release -p duplex-cli -- synth --preset bench --out /tmp/bench-synth`),
#   GGUFS (default "/tmp/anchor/bench-Q8_0.gguf /tmp/anchor/bench-Q4_K_M.gguf", see
#   bench-llama-cpp.sh), THREADS (default:
#   every core), ROUNDS (default 3), OUT_DIR (default /tmp/amx-check). Logs go to
#   $OUT_DIR/<step>.log. Run nothing heavy beside it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MODEL="${MODEL:-/tmp/bench-synth}"
GGUFS="${GGUFS:-/tmp/anchor/bench-Q8_0.gguf /tmp/anchor/bench-Q4_K_M.gguf}"
THREADS="${THREADS:-$(nproc)}"
ROUNDS="${ROUNDS:-3}"
OUT_DIR="${OUT_DIR:-/tmp/amx-check}"

log() { printf '[amx-check %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

cd "$ROOT"
mkdir -p "$OUT_DIR"
for flag in amx_tile amx_int8 amx_bf16; do
    grep -qw "$flag" /proc/cpuinfo || die "this CPU reports no $flag in /proc/cpuinfo: the script is for an AMX machine (Sapphire Rapids or later)"
done

step_tests() {
    log "kernels' tests (release), the hardware tile tests included"
    local out="$OUT_DIR/tests.log"
    cargo test --release -p duplex-kernels -- --nocapture >"$out" 2>&1 || die "tests failed; see $out"
    # The tile tests skip, saying why, where Linux refuses the tile state.
    if grep -n "skipped: this CPU or kernel gives no AMX" "$out"; then
        die "the CPU has AMX but the tile tests skipped (XCR0 or arch_prctl refused the tile state); see $out"
    fi
    grep -E "hardware_.*(ok|FAILED)" "$out" || die "no hardware tile test ran; see $out"
}

step_kernels() {
    log "quant_matmul: AVX-512 against tiles at 128, 512, 2048 tokens, and the turning point"
    cargo bench -p duplex-kernels --bench quant_matmul -- avx512vnni amx --tokens 128,512,2048 2>&1 | tee "$OUT_DIR/quant_matmul.log"
    grep -q "AMX INT8 tile peak" "$OUT_DIR/quant_matmul.log" || die "quant_matmul found no INT8 tiles"
    log "matmul_bf16: FP8 and BF16 weights on the vectors and on BF16 tiles at 128, 512, 2048 tokens, and the turning point"
    cargo bench -p duplex-kernels --bench matmul_bf16 -- --tokens 128,512,2048 2>&1 | tee "$OUT_DIR/matmul_bf16.log"
    grep -q "AMX BF16 tile peak" "$OUT_DIR/matmul_bf16.log" || die "matmul_bf16 found no BF16 tiles in use (see its first line)"
    log "mla_decode: f32 and BF16 pairs (on the tiles where they pass their self-check), context 4096"
    for heads in 16 128; do
        cargo bench -p duplex-kernels --bench mla_decode -- "$THREADS" "$heads" 4096 2>&1 | tee -a "$OUT_DIR/mla_decode.log"
    done
}

# One bench-engine run's lines of interest, tagged: decode tokens/s and fraction of the
# roofline per context, where each decode step's time goes, prefill tokens/s.
engine_run() {
    local tag="$1" model="$2"; shift 2
    env "$@" "$BIN" bench-engine --model "$model" --threads "$THREADS" --contexts 512,4096 --prefill 512,2048 --decode-tokens 32 2>&1 |
        awk -v t="$tag" '/decode, batch 1, context/ || /prefill, [0-9]+ tokens/ || /^\| (512|4096) \|/ {print t " " $0}'
}

step_engine() {
    [[ -f "$MODEL/config.json" ]] || die "no $MODEL; make it: cargo run --release -p duplex-cli -- synth --preset bench --out $MODEL"
    cargo build --release -q --bin duplex
    BIN="$ROOT/target/release/duplex"
    local models=("$MODEL")
    for gguf in $GGUFS; do
        [[ -f "$gguf" ]] && models+=("$gguf") || log "no $gguf: its rounds are left out (deploy/anchor/bench-llama-cpp.sh make)"
    done
    for model in "${models[@]}"; do
        log "bench-engine on $model: DUPLEX_AMX=off and on, $ROUNDS rounds alternating"
        log "columns: decode tokens/s | fraction of the roofline; a step: context | ms | attention ms | MLP/MoE ms | rest ms | ms at roofline; prefill tokens/s"
        for r in $(seq "$ROUNDS"); do
            engine_run "round $r, tiles off" "$model" DUPLEX_AMX=off
            engine_run "round $r, tiles on " "$model" DUPLEX_AMX=on
        done | tee -a "$OUT_DIR/engine.log"
    done
}

case "${1:-all}" in
    tests) step_tests ;;
    kernels) step_kernels ;;
    engine) step_engine ;;
    all) step_tests; step_kernels; step_engine ;;
    *) die "unknown step '$1' (tests, kernels, engine or all)" ;;
esac
log "done; logs in $OUT_DIR"
