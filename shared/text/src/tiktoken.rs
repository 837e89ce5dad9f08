//! Kimi-K2's tokenizer as published: `tiktoken.model` plus the added tokens
//! of `tokenizer_config.json`, turned into a `tokenizers` pipeline.
//!
//! Kimi-K2 ships no `tokenizer.json`. Its `tokenization_kimi.py` builds a
//! `tiktoken.Encoding` from `tiktoken.model` (one `base64(token bytes) rank`
//! line per token), Kimi's own split regex ([`KIMI_PATTERN`]) and special
//! tokens at the ids right after the ranks, named by `added_tokens_decoder`
//! or `<|reserved_token_{id}|>`.
//!
//! Why a `tokenizers` byte-level BPE and not `tiktoken-rs`: the rest of
//! [`crate::Tokenizer`] (added vocabulary and special-token matching,
//! `split_special_tokens`, the byte-level decoder, streaming decode) is
//! written against `tokenizers::Tokenizer`; converting once at load time
//! keeps all of it, where a second encoder would need a second copy of each.
//! The conversion is the one `transformers`' `TikTokenConverter` makes
//! (Llama 3's `tokenizer.json` came out of it):
//!
//! * Tiktoken merges, among adjacent parts, the pair whose concatenation has
//!   the lowest rank, until none is a token. A BPE merge list reproduces
//!   that when every split of every token into two tokens is a merge,
//!   ordered by the rank of the token it makes. Splits whose parts rank
//!   *after* the token are kept: tiktoken makes such a token out of rank
//!   order once its parts exist, and so does the BPE's merge queue.
//! * Tiktoken looks a whole pre-tokenized piece up before merging
//!   (`ignore_merges`), which is the only way to get a token that is no
//!   merge of two tokens at all; real tiktoken files have some.
//! * Tiktoken ranks are raw bytes; `tokenizers`' byte-level BPE spells each
//!   byte as a character of GPT-2's byte alphabet ([`byte_alphabet`]), so
//!   the vocabulary is the ranks spelled that way, and the `ByteLevel`
//!   pre-tokenizer and decoder map text to and from that alphabet.
//!
//! The one difference from tiktoken: when two *overlapping* pairs would make
//! the same token (parts `ab`, `a`, `ba` of `ababa` with `aba` a token),
//! tiktoken merges the left one and the merge list the one whose parts rank
//! lower. `transformers`' conversion has the same difference; it needs a
//! token that two different splits make, met twice in one piece. (On a
//! 163,584-rank file trained on Python sources it did not occur in 9.8 M
//! tokens of held-out text; see the README.) And `tokenization_kimi.py`
//! cuts text into chunks of at most 25,000 consecutive whitespace or
//! non-whitespace characters before encoding, because tiktoken's merging is
//! quadratic in a piece's length; the merge queue here is not, so text is
//! not cut, and only a piece longer than that can encode differently.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use base64::Engine as _;
use serde_json::Value as Json;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::tokenizer::TokenizerError;

/// Kimi-K2's split pattern, verbatim from its `tokenization_kimi.py`.
///
/// The `[...&&[^\p{Han}]]` class intersections need no translation:
/// `tokenizers` is built with `fancy-regex` here (see the workspace
/// `Cargo.toml`), which hands character classes to the `regex` crate, and
/// that supports `&&`; it is also the engine tiktoken itself matches this
/// pattern with. (Oniguruma, `tokenizers`' other engine, reads `&&` the
/// same way.) The test checks the splits against Python tiktoken's.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// How many special-token ids follow the ranks in Kimi-K2's
/// `tokenization_kimi.py` (`num_reserved_special_tokens`): its vocabulary is
/// 163,584 ranks plus these 256.
pub const NUM_RESERVED_SPECIAL_TOKENS: u32 = 256;

/// The name Kimi-K2 gives a special-token id that `added_tokens_decoder`
/// does not name.
pub fn reserved_token_name(id: u32) -> String {
    format!("<|reserved_token_{id}|>")
}

/// Builds the tokenizer of a directory that has `tiktoken.model` but no
/// `tokenizer.json`: the ranks of `path`, Kimi's split pattern, and the
/// special tokens of `tokenizer_config.json` (`tc`, read from `tc_path`).
pub fn load(
    path: &Path,
    tc: Option<&Json>,
    tc_path: &Path,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_owned(),
        source,
    })?;
    let ranks = parse_ranks(&text).map_err(|message| TokenizerError::Tiktoken {
        path: path.to_owned(),
        message,
    })?;
    let added = added_tokens(tc, tc_path, ranks.len() as u32)?;
    build(&ranks, &added).map_err(|message| TokenizerError::Tiktoken {
        path: path.to_owned(),
        message,
    })
}

/// The ranks of a `tiktoken.model`, indexed by rank. Like tiktoken's
/// `load_tiktoken_bpe`, blank lines are skipped; unlike it, a rank missing
/// or given twice is an error, because the special tokens' ids start right
/// after the ranks and a gap would shift every one of them.
pub fn parse_ranks(text: &str) -> Result<Vec<Vec<u8>>, String> {
    let mut by_rank: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
    let mut seen: HashMap<Vec<u8>, u32> = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        let line_no = index + 1;
        if line.trim().is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(token), Some(rank), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(format!(
                "line {line_no}: expected `<base64 token> <rank>`, got {line:?}"
            ));
        };
        let token = base64::engine::general_purpose::STANDARD
            .decode(token)
            .map_err(|e| format!("line {line_no}: token {token:?} is not base64: {e}"))?;
        let rank: u32 = rank.parse().map_err(|e| {
            format!("line {line_no}: rank {rank:?} is not a number in 0..2^32: {e}")
        })?;
        if token.is_empty() {
            return Err(format!("line {line_no}: empty token"));
        }
        if let Some(first) = seen.insert(token.clone(), rank) {
            return Err(format!(
                "line {line_no}: token {:?} already has rank {first}",
                String::from_utf8_lossy(&token)
            ));
        }
        if by_rank.insert(rank, token).is_some() {
            return Err(format!("line {line_no}: rank {rank} is given twice"));
        }
    }
    if by_rank.is_empty() {
        return Err("no ranks".into());
    }
    if let Some((expected, found)) = by_rank
        .keys()
        .enumerate()
        .find(|&(i, &rank)| i as u64 != u64::from(rank))
    {
        return Err(format!(
            "ranks must be 0, 1, 2, ... without gaps (the special tokens' ids follow them), but rank {expected} is missing (next is {found})"
        ));
    }
    let ranks: Vec<Vec<u8>> = by_rank.into_values().collect();
    // Byte-level BPE starts from single bytes: one that is not a token
    // could not be encoded at all (tiktoken would panic on it).
    let singles: std::collections::HashSet<&[u8]> = ranks
        .iter()
        .filter(|t| t.len() == 1)
        .map(Vec::as_slice)
        .collect();
    if let Some(byte) = (0..=255u8).find(|b| !singles.contains(&[*b][..])) {
        return Err(format!(
            "byte 0x{byte:02x} has no rank; every single byte must be a token"
        ));
    }
    Ok(ranks)
}

/// One entry of `added_tokens_decoder`, or a reserved special token.
#[derive(Clone, Debug, PartialEq)]
pub struct Added {
    pub id: u32,
    pub token: AddedToken,
}

/// The tokens after the ranks, in id order: ids `num_ranks ..
/// num_ranks + 256` (further if `added_tokens_decoder` names a higher id),
/// each as `added_tokens_decoder` describes it or else as the reserved
/// special token `<|reserved_token_{id}|>`, as `tokenization_kimi.py` makes
/// them. Every id in the range gets a token, so that `tokenizers`, which
/// numbers added tokens consecutively after the vocabulary, gives each its
/// own id.
pub fn added_tokens(
    tc: Option<&Json>,
    tc_path: &Path,
    num_ranks: u32,
) -> Result<Vec<Added>, TokenizerError> {
    let bad = |message: String| TokenizerError::Field {
        path: tc_path.to_owned(),
        field: "added_tokens_decoder",
        message,
    };
    let mut named: BTreeMap<u32, AddedToken> = BTreeMap::new();
    match tc.and_then(|j| j.get("added_tokens_decoder")) {
        None | Some(Json::Null) => {}
        Some(Json::Object(entries)) => {
            for (key, entry) in entries {
                let id: u32 = key
                    .parse()
                    .map_err(|_| bad(format!("key {key:?} is not a token id")))?;
                if id < num_ranks {
                    return Err(bad(format!(
                        "id {id} is inside tiktoken.model's {num_ranks} ranks; added tokens come after them"
                    )));
                }
                let content = entry
                    .get("content")
                    .and_then(Json::as_str)
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| {
                        bad(format!(
                            "entry {id} needs a non-empty string `content`, got {entry}"
                        ))
                    })?;
                let flag = |name: &str, default: bool| match entry.get(name) {
                    None | Some(Json::Null) => Ok(default),
                    Some(Json::Bool(b)) => Ok(*b),
                    Some(v) => Err(bad(format!(
                        "entry {id}: `{name}` must be true or false, got {v}"
                    ))),
                };
                // Defaults as transformers' AddedToken: not special,
                // normalized unless special.
                let special = flag("special", false)?;
                let token = AddedToken::from(content, special)
                    .lstrip(flag("lstrip", false)?)
                    .rstrip(flag("rstrip", false)?)
                    .single_word(flag("single_word", false)?)
                    .normalized(flag("normalized", !special)?);
                named.insert(id, token);
            }
        }
        Some(other) => {
            return Err(bad(format!(
                "must be an object of id -> token, got {other}"
            )))
        }
    }
    let reserved_end = num_ranks
        .checked_add(NUM_RESERVED_SPECIAL_TOKENS)
        .ok_or_else(|| bad(format!("{num_ranks} ranks plus {NUM_RESERVED_SPECIAL_TOKENS} special tokens overflow the id range")))?;
    let mut out: Vec<Added> = (num_ranks..reserved_end)
        .map(|id| Added {
            id,
            token: named
                .remove(&id)
                .unwrap_or_else(|| AddedToken::from(reserved_token_name(id), true)),
        })
        .collect();
    // Past Kimi's reserved range only named ids: `tokenizers` cannot leave
    // an id out, so they must follow on without a gap.
    for (id, token) in named {
        let next = reserved_end + (out.len() as u32 - NUM_RESERVED_SPECIAL_TOKENS);
        if id != next {
            return Err(bad(format!(
                "id {id} ({:?}) leaves ids {next}..{id} without a token; past the {NUM_RESERVED_SPECIAL_TOKENS} reserved ids after the ranks, added ids must be consecutive",
                token.content
            )));
        }
        out.push(Added { id, token });
    }
    Ok(out)
}

/// The `tokenizers` pipeline for `ranks` (indexed by rank) and the tokens
/// after them: byte-level BPE with merges derived from the ranks, Kimi's
/// split pattern, no normalizer and no post-processor (Kimi's tokenizer
/// adds no BOS by itself).
pub fn build(ranks: &[Vec<u8>], added: &[Added]) -> Result<tokenizers::Tokenizer, String> {
    let alphabet = byte_alphabet();
    let spell = |token: &[u8]| {
        token
            .iter()
            .map(|&b| alphabet[usize::from(b)])
            .collect::<String>()
    };
    let rank_of: HashMap<&[u8], u32> = ranks
        .iter()
        .enumerate()
        .map(|(rank, t)| (t.as_slice(), rank as u32))
        .collect();

    let vocab: Vocab = ranks
        .iter()
        .enumerate()
        .map(|(rank, t)| (spell(t), rank as u32))
        .collect();
    let mut merges: Merges = Vec::new();
    for token in ranks.iter().filter(|t| t.len() > 1) {
        let mut splits: Vec<(u32, u32, usize)> = (1..token.len())
            .filter_map(|i| Some((*rank_of.get(&token[..i])?, *rank_of.get(&token[i..])?, i)))
            .collect();
        // Among the splits that make the same token, the one with the
        // lower-ranked parts first (as transformers orders them).
        splits.sort_unstable();
        merges.extend(
            splits
                .into_iter()
                .map(|(_, _, i)| (spell(&token[..i]), spell(&token[i..]))),
        );
    }

    let model = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(true)
        .build()
        .map_err(|e| format!("cannot build the BPE model from the ranks: {e}"))?;
    let split = Split::new(
        SplitPattern::Regex(KIMI_PATTERN.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| format!("the `tokenizers` regex engine rejects Kimi's split pattern: {e}"))?;
    // The pattern does the splitting; ByteLevel only maps bytes to the
    // alphabet (no regex of its own, no prefix space), as in Llama 3's
    // converted tokenizer.json.
    let byte_level = ByteLevel::new(false, true, false);

    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![split.into(), byte_level.into()])));
    tokenizer.with_decoder(Some(byte_level));
    tokenizer
        .add_tokens(added.iter().map(|a| a.token.clone()))
        .map_err(|e| format!("cannot add the special tokens: {e}"))?;

    // `tokenizers` numbers added tokens itself (consecutively after the
    // vocabulary, or the vocabulary's id for a string it already has); any
    // other id than the file's means two tokens share a string.
    for a in added {
        let got = tokenizer.token_to_id(&a.token.content);
        if got != Some(a.id) {
            let holder = got.map_or_else(|| "no id".to_owned(), |id| format!("id {id}"));
            return Err(format!(
                "added token {:?} (id {}) has the same string as another token ({holder})",
                a.token.content, a.id
            ));
        }
    }
    Ok(tokenizer)
}

/// GPT-2's byte alphabet (`bytes_to_unicode`), which `tokenizers`'
/// `ByteLevel` uses: printable Latin-1 bytes stand for themselves, the
/// others for the characters from U+0100 on, in byte order.
pub fn byte_alphabet() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut alphabet = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        alphabet[usize::from(b)] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).expect("U+0100..U+0143 are characters");
            next += 1;
            c
        };
    }
    alphabet
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranks_text(tokens: &[&[u8]]) -> String {
        let mut all: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        all.extend(tokens.iter().map(|t| t.to_vec()));
        all.iter()
            .enumerate()
            .map(|(rank, t)| {
                format!(
                    "{} {rank}\n",
                    base64::engine::general_purpose::STANDARD.encode(t)
                )
            })
            .collect()
    }

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let a = byte_alphabet();
        assert_eq!(a[usize::from(b'A')], 'A');
        assert_eq!(a[usize::from(b' ')], 'Ġ');
        assert_eq!(a[usize::from(b'\n')], 'Ċ');
        assert_eq!(a[0], 'Ā');
        assert_eq!(a[0xAD], 'Ń');
        let distinct: std::collections::HashSet<char> = a.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn parse_rejects_malformed_files() {
        let err = |text: &str| parse_ranks(text).unwrap_err();
        assert!(err("").contains("no ranks"));
        assert!(err("QQ== 0 extra\n").contains("line 1"));
        assert!(err("QQ==\n").contains("expected"));
        assert!(err("!!! 0\n").contains("not base64"));
        assert!(err("QQ== -1\n").contains("not a number"));
        assert!(err("QQ== 0\nQQ== 1\n").contains("already has rank 0"));
        assert!(err("QQ== 0\nQg== 0\n").contains("rank 0 is given twice"));
        assert!(err("QQ== 0\nQg== 2\n").contains("rank 1 is missing"));
        assert!(err("QQ== 0\n").contains("byte 0x00 has no rank"));
        // Blank lines are skipped, as tiktoken's loader does.
        let text = ranks_text(&[b"ab"]).replace("\n", "\n\n");
        assert_eq!(parse_ranks(&text).unwrap().len(), 257);
    }

    #[test]
    fn merges_reproduce_out_of_order_and_unmergeable_tokens() {
        // 256 "ab"; 257 "xab" (its part "ab" ranks before it, "xa" does not
        // exist); 258 "zzq" (no split into two tokens); 259 "wcd", whose
        // only split is "wc" + "d" with "wc" ranked after it (260).
        let ranks = parse_ranks(&ranks_text(&[b"ab", b"xab", b"zzq", b"wcd", b"wc"])).unwrap();
        let tok = build(&ranks, &[]).unwrap();
        let ids = |s: &str| tok.encode(s, false).unwrap().get_ids().to_vec();
        assert_eq!(ids("xab"), [257]);
        assert_eq!(ids("xabx"), [257, u32::from(b'x')]);
        // "zzq" only as a whole piece; inside "zzqq" it cannot form.
        assert_eq!(ids("zzq"), [258]);
        assert_eq!(ids("zzqq"), [122, 122, 113, 113]);
        // "wcds": "wc" (260) first, then "wc" + "d" makes "wcd" (259), out
        // of rank order as tiktoken does.
        assert_eq!(ids("wcds"), [259, u32::from(b's')]);
        assert_eq!(tok.decode(&ids("wcds zzq"), false).unwrap(), "wcds zzq");
    }

    #[test]
    fn added_tokens_fill_reserved_ids_and_refuse_clashes() {
        let path = Path::new("tokenizer_config.json");
        let tc = serde_json::json!({"added_tokens_decoder": {
            "257": {"content": "[EOS]", "special": true},
            "256": {"content": "[BOS]", "special": true},
            "260": {"content": "<think>", "special": false},
        }});
        let added = added_tokens(Some(&tc), path, 256).unwrap();
        assert_eq!(added.len(), NUM_RESERVED_SPECIAL_TOKENS as usize);
        assert_eq!(added[0].token.content, "[BOS]");
        assert_eq!(added[2].token.content, "<|reserved_token_258|>");
        assert!(added[2].token.special);
        assert!(!added[4].token.special);
        assert_eq!(added.last().unwrap().id, 511);

        let ranks = parse_ranks(&ranks_text(&[])).unwrap();
        let tok = build(&ranks, &added).unwrap();
        assert_eq!(tok.token_to_id("<|reserved_token_300|>"), Some(300));
        assert_eq!(tok.get_vocab_size(true), 512);

        let err = |tc: Json| added_tokens(Some(&tc), path, 256).unwrap_err().to_string();
        assert!(
            err(serde_json::json!({"added_tokens_decoder": {"5": {"content": "x"}}}))
                .contains("inside")
        );
        assert!(
            err(serde_json::json!({"added_tokens_decoder": {"x": {"content": "x"}}}))
                .contains("not a token id")
        );
        assert!(err(serde_json::json!({"added_tokens_decoder": {"300": {}}})).contains("content"));
        // Past the reserved range: consecutive ids extend it, a gap is refused.
        let more = added_tokens(Some(&serde_json::json!({"added_tokens_decoder": {"512": {"content": "<a>"}, "513": {"content": "<b>"}}})), path, 256).unwrap();
        assert_eq!(
            (more.len(), more[257].id, more[257].token.content.as_str()),
            (258, 513, "<b>")
        );
        assert!(
            err(serde_json::json!({"added_tokens_decoder": {"513": {"content": "<b>"}}}))
                .contains("ids 512..513")
        );
        // An added token whose string is a ranked token's (byte "A").
        let clash = added_tokens(
            Some(&serde_json::json!({"added_tokens_decoder": {"256": {"content": "A"}}})),
            path,
            256,
        )
        .unwrap();
        assert!(build(&ranks, &clash).unwrap_err().contains("same string"));
    }
}
