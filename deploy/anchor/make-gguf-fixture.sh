#!/usr/bin/env bash
# Hugging Face model dir -> llama.cpp GGUF (converter's F16) -> llama-quantize QTYPE
# (default Q4_K_M) -> reference.json of llama.cpp's greedy continuations and per-step
# top-10 logprobs for the prompts of the source dir's own reference.json.
#
# Usage: deploy/anchor/make-gguf-fixture.sh SRC_MODEL_DIR OUT_DIR
# Environment:
#   LCP_WORK   where deploy/anchor/build-llama-cpp.sh built llama.cpp (default /tmp/lcp)
#   QTYPE      llama-quantize type (default Q4_K_M); the GGUF is OUT_DIR/model-$QTYPE.gguf
#   OUTTYPE    converter output type (default f16); OUTTYPE=$QTYPE-less conversions (f32, bf16,
#              q8_0) with QTYPE=none write OUT_DIR/model-$OUTTYPE.gguf and skip llama-quantize
#   PROMPTS    reference.json whose prompts' input_ids are used (default SRC_MODEL_DIR/reference.json;
#              PROMPTS=none: no reference.json)
#   N_PREDICT  greedy tokens per prompt (default 32); THREADS (default 2)
#   TMP_DIR    where the intermediate F16 GGUF goes (default $LCP_WORK/tmp); removed afterwards
#              unless KEEP_F16=1
# Needs build-llama-cpp.sh's three steps (tools, pydeps, pyllama) done.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${LCP_WORK:-/tmp/lcp}"
LCPP="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp"
BIN="$LCPP/build/bin"
PY="$WORK/venv/bin/python"
QTYPE="${QTYPE:-Q4_K_M}"
OUTTYPE="${OUTTYPE:-f16}"
N_PREDICT="${N_PREDICT:-32}"
THREADS="${THREADS:-2}"
TMP_DIR="${TMP_DIR:-$WORK/tmp}"

log() { printf '[make-gguf-fixture %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

(( $# == 2 )) || die "usage: $0 SRC_MODEL_DIR OUT_DIR"
SRC="$(cd "$1" && pwd)"
OUT="$2"
PROMPTS="${PROMPTS:-$SRC/reference.json}"
[[ -f "$SRC/config.json" ]] || die "$SRC has no config.json"
[[ -x "$BIN/llama-quantize" && -x "$PY" ]] || die "run deploy/anchor/build-llama-cpp.sh first (LCP_WORK=$WORK)"
mkdir -p "$OUT" "$TMP_DIR"

# 1. The converter copy with unknown pre-tokenizer hashes mapped to gpt-2 (lib.sh).
. "$HERE/lib.sh"
ensure_converter

# 2. Convert.
F16="$TMP_DIR/$(basename "$SRC")-$OUTTYPE.gguf"
log "converting $SRC -> $F16 (--outtype $OUTTYPE)"
"$PY" "$CONV/convert_hf_to_gguf.py" "$SRC" --outtype "$OUTTYPE" --outfile "$F16" > "$TMP_DIR/convert.log" 2>&1 \
    || { tail -30 "$TMP_DIR/convert.log" >&2; die "conversion failed (log $TMP_DIR/convert.log)"; }
grep -i "pre-tokenizer\|chkhsh" "$TMP_DIR/convert.log" | head -3 >&2 || true

# 3. Quantize.
if [[ "$QTYPE" == none ]]; then
    GGUF="$OUT/model-$OUTTYPE.gguf"
    mv "$F16" "$GGUF"
else
    GGUF="$OUT/model-$QTYPE.gguf"
    log "quantizing -> $GGUF ($QTYPE)"
    "$BIN/llama-quantize" "$F16" "$GGUF" "$QTYPE" "$THREADS" > "$TMP_DIR/quantize.log" 2>&1 \
        || { tail -30 "$TMP_DIR/quantize.log" >&2; die "llama-quantize failed (log $TMP_DIR/quantize.log)"; }
    [[ "${KEEP_F16:-0}" == 1 ]] || rm -f "$F16"
fi

# 4. Tokenizer files beside it.
for f in tokenizer.json tokenizer_config.json; do
    [[ -f "$SRC/$f" ]] && cp "$SRC/$f" "$OUT/$f"
done

# 5. Reference.
if [[ "$PROMPTS" != none ]]; then
    [[ -f "$PROMPTS" ]] || die "no prompts file $PROMPTS (set PROMPTS=none to skip the reference)"
    log "llama.cpp greedy continuations + top-10 logprobs for the prompts of $PROMPTS"
    "$PY" "$HERE/llama_reference.py" --model "$GGUF" --prompts "$PROMPTS" --out "$OUT/reference.json" \
        --n-predict "$N_PREDICT" --threads "$THREADS"
fi

# 6. What llama.cpp chose per tensor.
log "tensor types in $GGUF:"
"$PY" "$LCPP/gguf-py/gguf/scripts/gguf_dump.py" "$GGUF" 2>/dev/null \
    | awk '$0 ~ /^ *[0-9]+: +[0-9]+ \|/ { n=split($0, f, "|"); t=f[3]; gsub(/ /, "", t); name=f[4]; gsub(/ /, "", name);
            gsub(/blk\.[0-9]+\./, "blk.N.", name); c[name" "t]++ } END { for (k in c) print "  " k " x" c[k] }' | sort >&2
log "done: $(du -sh "$OUT" | cut -f1) in $OUT"
