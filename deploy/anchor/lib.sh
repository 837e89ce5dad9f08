# Shared by make-gguf-fixture.sh and bench-llama-cpp.sh (sourced; needs WORK, LCPP, log, die).

# A local copy of the converter in which an unknown BPE pre-tokenizer hash (every
# synthetic tokenizer has one) maps to "gpt-2" instead of raising. The warning with the
# hash is still printed. Sets CONV.
ensure_converter() {
    CONV="$WORK/convert-local"
    if [[ ! -f "$CONV/.patched" ]]; then
        log "making the patched converter copy in $CONV"
        rm -rf "$CONV"; mkdir -p "$CONV"
        cp "$LCPP/convert_hf_to_gguf.py" "$CONV/"
        cp -r "$LCPP/conversion" "$CONV/"
        local base="$CONV/conversion/base.py"
        local pat='raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")'
        [[ $(grep -cF "$pat" "$base") == 1 ]] || die "the converter's pre-tokenizer check is not where expected in $base"
        sed -i 's/raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")/res = "gpt-2"  # deploy\/anchor: unknown pre-tokenizer hash mapped to gpt-2/' "$base"
        grep -qF 'res = "gpt-2"  # deploy/anchor' "$base" || die "patching $base failed"
        touch "$CONV/.patched"
    fi
}
