# Shared by make-gguf-fixture.sh and bench-llama-cpp.sh (sourced; needs WORK, LCPP, log, die).

# A local copy of the converter in which an unknown BPE pre-tokenizer hash (every
# synthetic tokenizer has one) maps to "gpt-2" instead of raising. The warning with the
# hash is still printed. Sets CONV.
ensure_converter() {
    CONV="$WORK/convert-local"
    if [[ ! -f "$CONV/.patched-v2" ]]; then
        log "making the patched converter copy in $CONV"
        rm -rf "$CONV"; mkdir -p "$CONV"
        cp "$LCPP/convert_hf_to_gguf.py" "$CONV/"
        cp -r "$LCPP/conversion" "$CONV/"
        local base="$CONV/conversion/base.py"
        local pat='raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")'
        [[ $(grep -cF "$pat" "$base") == 1 ]] || die "the converter's pre-tokenizer check is not where expected in $base"
        sed -i 's/raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")/res = "gpt-2"  # deploy\/anchor: unknown pre-tokenizer hash mapped to gpt-2/' "$base"
        grep -qF 'res = "gpt-2"  # deploy/anchor' "$base" || die "patching $base failed"
        # Second change: the Llama-HF (tokenizer.json, SentencePiece-converted BPE) vocab path
        # writes only the tokenizer's tokens, so a model whose embedding is padded past them
        # (tiny-mixtral: 2112 rows, 2048 tokens) fails to load ("token_embd.weight has wrong
        # shape"). Pad it with [PADn] UNUSED tokens up to config's vocab_size, as the
        # sentencepiece path of the same converter does.
        python3 - "$base" <<'PYEOF' || die "patching _set_vocab_llama_hf in $base failed"
import sys
p = sys.argv[1]
s = open(p).read()
old = "        assert len(tokens) == vocab.vocab_size\n"
assert s.count(old) == 1, "no unique 'assert len(tokens) == vocab.vocab_size'"
new = old + (
    "        # deploy/anchor: pad to the model's vocab_size, as _create_vocab_sentencepiece does\n"
    "        for i in range(len(tokens), self.hparams.get(\"vocab_size\", len(tokens))):\n"
    "            tokens.append(f\"[PAD{i}]\".encode(\"utf-8\"))\n"
    "            scores.append(-10000.0)\n"
    "            toktypes.append(gguf.TokenType.UNUSED)\n"
)
open(p, "w").write(s.replace(old, new))
PYEOF
        touch "$CONV/.patched-v2"
    fi
}
