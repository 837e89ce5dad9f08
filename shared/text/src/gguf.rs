//! The tokenizer a GGUF file carries in its metadata, turned into the same
//! `tokenizers` pipeline a `tokenizer.json` describes.
//!
//! llama.cpp's converters store a Hugging Face byte-level BPE tokenizer as
//! `tokenizer.ggml.model = "gpt2"`: the tokens by id, already spelled in
//! GPT-2's byte alphabet; the merges, highest priority first; a type per
//! token; and the name of the pre-tokenizer (`tokenizer.ggml.pre`), because
//! the split regexes themselves are not stored. llama.cpp maps that name to
//! its regexes in `llama-vocab.cpp`; [`pre_tokenizer`] does the same with the
//! regexes each name means there. llama.cpp applies a name's regexes one
//! after another, each splitting the pieces the previous one left and
//! keeping the text between matches as pieces of its own, which is what a
//! `Sequence` of `Split`s with `Isolated` behaviour does here (and what the
//! published `tokenizer.json` files of these models say).
//!
//! Control tokens (type 3) become special added tokens and user-defined
//! ones (type 4) plain added tokens, so that both are matched whole in
//! text, and only control tokens are ignored in client text, which is what
//! llama.cpp's `parse_special` switch and `transformers`' `special` flag
//! both mean.
//!
//! `tokenizer.ggml.model = "llama"` is a SentencePiece BPE vocabulary
//! (Llama 2, Mistral, Mixtral): tokens with scores, and no merges. llama.cpp
//! encodes it by repeatedly merging the adjacent pair whose concatenation is
//! the highest-scoring token, and spells characters no token covers as
//! `<0xXX>` byte tokens. [`sentencepiece_bpe`] makes that a `tokenizers` BPE
//! as `transformers` converts a SentencePiece model (Mixtral's published
//! `tokenizer.json` is one): every split of every token into two tokens is a
//! merge, ranked by the score of the token it makes, with byte fallback, `▁`
//! for spaces, and a `▁` prefixed to the text and to the text after each
//! added token (what llama.cpp's `add_space_prefix` does; `transformers`'
//! legacy Llama tokenizers do the same). The one difference from llama.cpp:
//! when two overlapping pairs in one word would make tokens of equal score
//! (the same token by two splits), llama.cpp merges the left pair and the
//! merge list the split it ranks first.

use std::path::{Path, PathBuf};

use duplex_gguf::vocab::{token_type, GgufVocab};
use duplex_gguf::{Gguf, GgufError, Metadata};
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::tokenizer::{Sources, TokenizerError};

/// GPT-2's split regex. llama.cpp's copy lacks the final `|\s+`; it keeps
/// unmatched text as pieces of its own, and the only text the other
/// branches leave unmatched is whitespace before a non-space that no branch
/// takes with it, which `\s+` takes as the same piece.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3's regex as llama.cpp writes it: `(?i:'s|...)` spelled out as
/// `'[sS]|...`, which matches the same contractions.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's: Llama 3's with one digit per piece.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek-V3's three: digit runs of up to three, CJK/kana runs, then the
/// rest (a punctuation mark may lead an ASCII word).
const DEEPSEEK_V3: [&str; 3] = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

/// DeepSeek LLM's (V1, and DeepSeek-V2's tokenizer): newlines alone, runs
/// of cased letters (llama.cpp's explicit list of the ranges of cased
/// letters, written as escapes because several of its characters have
/// canonical equivalents that an editor or a copy may silently substitute,
/// which would change the ranges) with an optional leading space, ASCII
/// and full-width punctuation runs, trailing whitespace, CJK/Hangul runs,
/// digit runs.
const DEEPSEEK_LLM: [&str; 6] = [
    "[\r\n]",
    concat!(
        r"\s?[",
        r"A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}",
        r"\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}",
        r"\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}",
        r"\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}",
        r"\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}",
        r"\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}",
        r"\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}",
        r"\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}",
        r"\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}",
        r"\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}",
        r"\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}",
        r"\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}",
        r"\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}",
        r"\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}",
        r"\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}",
        "]+",
    ),
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
];

/// llama.cpp's `default`, also what it uses when `tokenizer.ggml.pre` is
/// missing: punctuation runs, then GPT-2's regex, digit runs, and three
/// ASCII digits at a time.
const DEFAULT: [&str; 4] = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];

/// What a `tokenizer.ggml.pre` name means: its split regexes, in order,
/// and whether whole pieces that are tokens skip the merges (llama.cpp's
/// `ignore_merges`, set for Llama 3, as its `tokenizer.json` sets it).
struct PreTokenizer {
    regexes: &'static [&'static str],
    ignore_merges: bool,
    /// Whether BOS is added when the metadata does not say
    /// (`tokenizer.ggml.add_bos_token` absent): llama.cpp's default for
    /// the name.
    add_bos: bool,
    /// Whether text is NFC-normalised first, as Qwen2's `tokenizer.json`
    /// does. llama.cpp does not; the two differ only on text that is not
    /// in NFC already, where the model's own tokenizer is the one to follow.
    nfc: bool,
}

/// The names Duplex knows, as llama.cpp spells them (several names share
/// one set of regexes there; only the common ones are listed).
const KNOWN_PRE: &[&str] = &["default", "gpt-2", "phi-2", "llama3", "llama-v3", "llama-bpe", "qwen2", "deepseek-r1-qwen", "deepseek-llm", "deepseek-v3", "kimi-k2"];

fn pre_tokenizer(name: &str) -> Option<PreTokenizer> {
    const fn plain(regexes: &'static [&'static str]) -> PreTokenizer {
        PreTokenizer { regexes, ignore_merges: false, add_bos: false, nfc: false }
    }
    Some(match name {
        "default" => plain(&DEFAULT),
        "gpt-2" | "phi-2" => plain(&[GPT2]),
        "llama3" | "llama-v3" | "llama-bpe" => PreTokenizer { regexes: &[LLAMA3], ignore_merges: true, add_bos: true, nfc: false },
        "qwen2" | "deepseek-r1-qwen" => PreTokenizer { nfc: true, ..plain(&[QWEN2]) },
        "deepseek-llm" => plain(&DEEPSEEK_LLM),
        "deepseek-v3" => plain(&DEEPSEEK_V3),
        // Kimi-K2's own split (its tiktoken pattern), one regex as llama.cpp's.
        "kimi-k2" => plain(&[crate::tiktoken::KIMI_PATTERN]),
        _ => return None,
    })
}

/// The directory a GGUF file is in (`.` for a bare file name).
pub(crate) fn parent_dir(file: &Path) -> PathBuf {
    match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Everything [`crate::tokenizer::Tokenizer::from_gguf`] needs, from the
/// metadata of `gguf`.
pub(crate) fn sources(gguf: &Gguf) -> Result<Sources, TokenizerError> {
    let md = gguf.metadata();
    let path = gguf.path().to_path_buf();
    let vocab = GgufVocab::from_metadata(md)?;
    let err = |message: String| TokenizerError::GgufTokenizer { path: path.clone(), message };
    let (inner, default_add_bos) = match vocab.model.as_str() {
        "gpt2" => {
            let pre_name = vocab.pre.as_deref().unwrap_or("default");
            let pre = pre_tokenizer(pre_name).ok_or_else(|| {
                err(format!(
                    "tokenizer.ggml.pre is {pre_name:?}, a pre-tokenizer Duplex does not know (known: {})",
                    KNOWN_PRE.join(", ")
                ))
            })?;
            (byte_level_bpe(&vocab, &pre).map_err(err)?, pre.add_bos)
        }
        // llama.cpp adds BOS to SentencePiece vocabularies unless told not to.
        "llama" => (sentencepiece_bpe(&vocab, md)?.map_err(err)?, true),
        other => return Err(err(format!("tokenizer.ggml.model is {other:?}, which Duplex does not support (supported: gpt2, llama)"))),
    };
    let mut eos_ids: Vec<u32> = vocab.eos_token_id.into_iter().collect();
    eos_ids.extend(end_of_turn_ids(md, vocab.tokens.len())?);
    let template_path = path.clone();
    Ok(Sources {
        inner,
        tokenizer_path: path.clone(),
        bos_id: vocab.bos_token_id,
        eos_ids,
        add_bos: vocab.add_bos_token.unwrap_or(default_add_bos),
        add_eos: vocab.add_eos_token.unwrap_or(false),
        bos_token: None,
        eos_token: None,
        template_path,
        template_source: vocab.chat_template,
        no_template: format!("{} has no tokenizer.chat_template", path.display()),
    })
}

/// `tokenizer.ggml.eot_token_id` and `eom_token_id` where present:
/// llama.cpp ends generation on them as on EOS (Llama 3's `<|eot_id|>`,
/// `<|eom_id|>`).
pub(crate) fn end_of_turn_ids(md: &Metadata, n_tokens: usize) -> Result<Vec<u32>, GgufError> {
    let mut ids = vec![];
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = md.usize(key)? {
            if id >= n_tokens {
                return Err(md.error(key, format!("token id {id} is outside the vocabulary of {n_tokens}")));
            }
            ids.push(id as u32);
        }
    }
    Ok(ids)
}

/// The `tokenizers` pipeline of a `llama` (SentencePiece BPE) vocabulary;
/// the outer error is the metadata's (a wrong type), the inner one the
/// vocabulary's.
fn sentencepiece_bpe(vocab: &GgufVocab, md: &Metadata) -> Result<Result<tokenizers::Tokenizer, String>, GgufError> {
    let scores_key = "tokenizer.ggml.scores";
    let scores: Vec<f64> = match md.array(scores_key)? {
        None => return Ok(Err(format!("{scores_key} is missing: a SentencePiece vocabulary is ranked by its scores"))),
        Some(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| v.as_f64().ok_or_else(|| md.error(scores_key, format!("element {i} is {:?}, expected a number", v.value_type()))))
            .collect::<Result<_, _>>()?,
    };
    if scores.len() != vocab.tokens.len() {
        return Ok(Err(format!("{scores_key} has {} entries for {} tokens", scores.len(), vocab.tokens.len())));
    }
    let add_space_prefix = md.bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let unk = match md.usize("tokenizer.ggml.unknown_token_id")? {
        Some(id) => vocab.tokens.get(id).cloned(),
        None => vocab.tokens.iter().zip(&vocab.token_types).find(|(_, &ty)| ty == token_type::UNKNOWN).map(|(t, _)| t.clone()),
    };
    Ok(build_sentencepiece(vocab, &scores, add_space_prefix, unk))
}

fn build_sentencepiece(vocab: &GgufVocab, scores: &[f64], add_space_prefix: bool, unk: Option<String>) -> Result<tokenizers::Tokenizer, String> {
    use tokenizers::decoders::{byte_fallback::ByteFallback, fuse::Fuse, sequence::Sequence as Decoders, strip::Strip};
    use tokenizers::normalizers::{prepend::Prepend, replace::Replace, utils::Sequence as Normalizers};

    let ids = vocab_ids(vocab)?;
    // Every split of every token into two tokens, ranked by the score of
    // the token it makes (then its id, then the parts', for a stable order):
    // the pair llama.cpp merges first is then the lowest-ranked merge.
    let mut ranked: Vec<(f64, u32, u32, u32, usize)> = vec![];
    for (id, token) in vocab.tokens.iter().enumerate() {
        for (at, _) in token.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (ids.get(&token[..at]), ids.get(&token[at..])) {
                ranked.push((scores[id], id as u32, l, r, at));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3))));
    let merges: Merges = ranked
        .iter()
        .map(|&(_, id, _, _, at)| {
            let token = &vocab.tokens[id as usize];
            (token[..at].to_string(), token[at..].to_string())
        })
        .collect();
    let mut builder = BPE::builder().vocab_and_merges(ids, merges).byte_fallback(true).fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let model = builder.build().map_err(|e| format!("tokenizer.ggml.tokens and tokenizer.ggml.scores do not make a BPE model: {e}"))?;

    let replace = |from: &str, to: &str| Replace::new(from, to).map_err(|e| format!("cannot build the {from:?} replacement: {e}"));
    let mut normalizers = vec![];
    let mut decoders = vec![replace("\u{2581}", " ")?.into(), ByteFallback::new().into(), Fuse::new().into()];
    if add_space_prefix {
        normalizers.push(Prepend::new("\u{2581}".into()).into());
        // The prefixed space is no part of the text.
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    normalizers.push(replace(" ", "\u{2581}")?.into());

    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer
        .with_normalizer(Some(Normalizers::new(normalizers)))
        .map_err(|e| format!("cannot set the normalizer: {e}"))?;
    tokenizer.with_decoder(Some(Decoders::new(decoders)));
    add_control_and_user_defined(&mut tokenizer, vocab)?;
    Ok(tokenizer)
}

/// Token strings to ids. Two ids for one string would leave one of them
/// undecodable and the other unreachable; converters never write that.
fn vocab_ids(vocab: &GgufVocab) -> Result<Vocab, String> {
    let mut ids = Vocab::default();
    for (id, token) in vocab.tokens.iter().enumerate() {
        if let Some(first) = ids.insert(token.clone(), id as u32) {
            return Err(format!("tokenizer.ggml.tokens: token {token:?} is both id {first} and id {id}"));
        }
    }
    Ok(ids)
}

/// Control tokens as special added tokens, user-defined ones as plain
/// added tokens. Every one is in the vocabulary already, so each keeps its
/// id.
fn add_control_and_user_defined(tokenizer: &mut tokenizers::Tokenizer, vocab: &GgufVocab) -> Result<(), String> {
    let added: Vec<AddedToken> = vocab
        .tokens
        .iter()
        .zip(&vocab.token_types)
        .filter_map(|(token, &ty)| match ty {
            token_type::CONTROL => Some(AddedToken::from(token.clone(), true)),
            token_type::USER_DEFINED => Some(AddedToken::from(token.clone(), false)),
            _ => None,
        })
        .collect();
    tokenizer.add_tokens(added).map_err(|e| format!("cannot add the control and user-defined tokens: {e}"))?;
    Ok(())
}

/// The byte-level BPE of a `gpt2` vocabulary with `pre`'s regexes.
fn byte_level_bpe(vocab: &GgufVocab, pre: &PreTokenizer) -> Result<tokenizers::Tokenizer, String> {
    let ids = vocab_ids(vocab)?;
    let merges: Merges = vocab
        .merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            // As llama.cpp splits them: at the first space after the first
            // character, so that a merge may start with a space-like token.
            let first = m.chars().next().map_or(0, char::len_utf8);
            let at = m[first..].find(' ').map(|p| p + first);
            match at {
                Some(at) => Ok((m[..at].to_string(), m[at + 1..].to_string())),
                None => Err(format!("tokenizer.ggml.merges: element {i} ({m:?}) is not two tokens separated by a space")),
            }
        })
        .collect::<Result<_, _>>()?;
    let model = BPE::builder()
        .vocab_and_merges(ids, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| format!("tokenizer.ggml.tokens and tokenizer.ggml.merges do not make a BPE model: {e}"))?;

    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(pre.regexes.len() + 1);
    for regex in pre.regexes {
        let split = Split::new(SplitPattern::Regex((*regex).into()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| format!("the `tokenizers` regex engine rejects the split pattern {regex:?}: {e}"))?;
        steps.push(split.into());
    }
    // The regexes do the splitting; ByteLevel only maps bytes to GPT-2's
    // alphabet (no regex of its own, no prefix space), as in the
    // `tokenizer.json` files these GGUFs were converted from.
    let byte_level = ByteLevel::new(false, true, false);
    steps.push(byte_level.into());

    let mut tokenizer = tokenizers::Tokenizer::new(model);
    if pre.nfc {
        tokenizer
            .with_normalizer(Some(tokenizers::normalizers::unicode::NFC))
            .map_err(|e| format!("cannot set the NFC normalizer: {e}"))?;
    }
    tokenizer.with_pre_tokenizer(Some(Sequence::new(steps)));
    tokenizer.with_decoder(Some(byte_level));
    add_control_and_user_defined(&mut tokenizer, vocab)?;
    Ok(tokenizer)
}
