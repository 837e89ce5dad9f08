//! Token sampling: penalties, temperature, top-k, top-p, min-p.
//!
//! The semantics follow what users of vLLM and llama.cpp expect, so that a
//! request tuned against those servers behaves the same here:
//!
//! 1. penalties (repetition over prompt + generated tokens, HF/vLLM style;
//!    presence and frequency over generated tokens, OpenAI style);
//! 2. greedy argmax when `temperature == 0` (the filters below cannot change
//!    the argmax, so they are skipped);
//! 3. temperature, then top-k, top-p and min-p, each on the survivors of the
//!    previous step;
//! 4. a draw from the renormalised distribution of what is left.
//!
//! The reported log-probabilities come from `log_softmax` of the *raw* model
//! logits, before penalties and temperature, as vLLM reports them by default:
//! they describe the model, not the sampling policy.
//!
//! A structured-output constraint ([`TokenMask`], filled by
//! `duplex-grammar`) is applied first, before every step above and in every
//! mode: a token it forbids gets logit `-inf`. The logprobs are then those of
//! the masked row (the model's distribution renormalised over the allowed
//! tokens), as vLLM reports them: it applies the grammar bitmask to the
//! logits before its sampler sees them. A forbidden token never appears in
//! `top_logprobs`.
//!
//! Malformed rows never panic: NaN is treated as `-inf` (a token the model
//! cannot produce) and `+inf` as `f32::MAX`, so one bad lane cannot poison the
//! softmax of the whole row.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// The most top log-probabilities a request may ask for; the OpenAI API caps
/// `top_logprobs` at 20 and vLLM follows it.
pub const MAX_LOGPROBS: usize = 20;

/// The largest temperature accepted. Beyond this the distribution is uniform
/// to within float precision, so a larger value is almost surely a client bug.
pub const MAX_TEMPERATURE: f32 = 100.0;

/// Per-request sampling settings. Every field has an "off" value, and missing
/// fields deserialize to the defaults, so `{}` is plain temperature-1 sampling.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax, ties to the lowest id).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` disables the filter.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose
    /// probability mass reaches `top_p` (always at least one); `1` disables it.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p * p_max`; `0` disables it.
    pub min_p: f32,
    /// HF/vLLM repetition penalty over prompt and generated tokens: a positive
    /// logit is divided by it, a non-positive one multiplied; `1` disables it.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty: subtracted once from the logit of every token
    /// generated so far.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted from a token's logit once per time
    /// it has been generated so far.
    pub frequency_penalty: f32,
    /// Seed for the sampler's RNG; `None` draws one from OS entropy.
    pub seed: Option<u64>,
    /// `Some(n)`: also return the `n` most likely tokens with their logprobs.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: None,
        }
    }
}

/// A [`SamplingParams`] field outside its accepted range. Each message names
/// the field, the range and the offending value so it can go straight back to
/// the client in a 400 response.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("temperature must be finite and in [0, {MAX_TEMPERATURE}], got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("repetition_penalty must be finite and > 0, got {0}")]
    RepetitionPenalty(f32),
    #[error("presence_penalty must be in [-2, 2], got {0}")]
    PresencePenalty(f32),
    #[error("frequency_penalty must be in [-2, 2], got {0}")]
    FrequencyPenalty(f32),
    #[error("logprobs must be at most {MAX_LOGPROBS}, got {0}")]
    Logprobs(usize),
}

impl SamplingParams {
    /// Deterministic argmax decoding with every filter and penalty off.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Checks every field's range. The comparisons are written so that NaN
    /// fails them (`!(x >= 0.0)` rather than `x < 0.0`).
    pub fn validate(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        if !(0.0..=MAX_TEMPERATURE).contains(&t) {
            return Err(SamplingError::Temperature(t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(SamplingError::RepetitionPenalty(r));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(SamplingError::PresencePenalty(self.presence_penalty));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(SamplingError::FrequencyPenalty(self.frequency_penalty));
        }
        match self.logprobs {
            Some(n) if n > MAX_LOGPROBS => Err(SamplingError::Logprobs(n)),
            _ => Ok(()),
        }
    }
}

/// Which ids of a logits row a constraint allows at one step: a bitset, bit
/// `id % 32` of word `id / 32` (the layout of llguidance's masks, so that
/// filling one is a copy). Ids at or past [`TokenMask::len`] are forbidden.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    len: usize,
}

impl TokenMask {
    /// A mask over `len` ids that allows none of them.
    pub fn new(len: usize) -> Self {
        Self { words: vec![0; len.div_ceil(32)], len }
    }

    /// How many ids the mask covers (the logits row's width).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn allows(&self, id: u32) -> bool {
        let i = id as usize;
        i < self.len && self.words[i / 32] >> (i % 32) & 1 == 1
    }

    /// Allows `id`; ids past the mask's width are ignored.
    pub fn allow(&mut self, id: u32) {
        let i = id as usize;
        if i < self.len {
            self.words[i / 32] |= 1 << (i % 32);
        }
    }

    pub fn forbid(&mut self, id: u32) {
        let i = id as usize;
        if i < self.len {
            self.words[i / 32] &= !(1 << (i % 32));
        }
    }

    /// Forbids every id.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// The bits, for filling the mask wholesale. Bits past `len` in the last
    /// word are ignored by [`TokenMask::allows`] but counted by nothing, so a
    /// writer need not clear them.
    pub fn words_mut(&mut self) -> &mut [u32] {
        &mut self.words
    }

    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// How many ids are allowed.
    pub fn count_allowed(&self) -> usize {
        (0..self.len as u32).filter(|&id| self.allows(id)).count()
    }
}

/// A [`TokenMask`] that leaves no token to sample: the constraint and the
/// stop tokens disagree (e.g. a grammar that is complete, for a request that
/// ignores its stop tokens). The sequence must end with this error; there is
/// no token that would keep the output valid.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("the output constraint allows none of the {width} tokens at this step")]
pub struct NothingAllowed {
    pub width: usize,
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct SampledToken {
    /// Index into the logits row.
    pub id: u32,
    /// `log_softmax` of the raw logits at `id`.
    pub logprob: f32,
    /// The requested number of most likely tokens under the raw logits, most
    /// likely first (ties to the lowest id); empty unless `logprobs` was set.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Samples one sequence's tokens. It keeps the state the penalties need and a
/// seed, so a request with a seed reproduces its output exactly.
///
/// The draw for the `n`-th generated token uses its own ChaCha stream `n` of
/// the seed, so the random numbers depend only on (seed, position): a
/// sequence whose first token was sampled by one worker and the rest by
/// another ([`Sampler::resume`]) samples exactly what one worker would have.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    /// Tokens generated so far: the stream of the next draw.
    step: u64,
    /// Distinct prompt tokens; the repetition penalty covers them, presence
    /// and frequency penalties do not.
    prompt: HashSet<u32>,
    /// How often each token has been generated. Sparse, because a sequence
    /// touches a tiny part of a ~129k vocabulary and a server holds many.
    counts: HashMap<u32, u32>,
    /// Scratch `(id, logit-then-weight)` row, reused across calls so that
    /// decoding does not allocate a vocab-sized buffer per token.
    candidates: Vec<(u32, f32)>,
    /// Scratch copy of a row with a [`TokenMask`] applied, reused likewise.
    masked: Vec<f32>,
}

impl Sampler {
    /// Validates `params` and starts a sequence whose prompt is `prompt`.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Result<Self, SamplingError> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(rand::random);
        Ok(Self {
            params,
            seed,
            step: 0,
            prompt: prompt.iter().copied().collect(),
            counts: HashMap::new(),
            candidates: Vec::new(),
            masked: Vec::new(),
        })
    }

    /// A sampler that continues a sequence after `generated` tokens were
    /// sampled elsewhere with the same parameters (and seed).
    pub fn resume(params: SamplingParams, prompt: &[u32], generated: &[u32]) -> Result<Self, SamplingError> {
        let mut sampler = Self::new(params, prompt)?;
        for &id in generated {
            sampler.record(id);
        }
        Ok(sampler)
    }

    /// The validated parameters this sampler runs with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Applies the repetition, presence and frequency penalties to `logits`
    /// in place, given the prompt and the tokens generated so far. Ids beyond
    /// the row are ignored. [`Sampler::sample`] does this itself; it is public
    /// so callers (and tests) can see exactly what the penalties do.
    pub fn apply_penalties(&self, logits: &mut [f32]) {
        if !self.has_penalties() {
            return;
        }
        for id in self.penalized_ids() {
            if let Some(x) = logits.get_mut(id as usize) {
                *x = self.penalize(id, *x);
            }
        }
    }

    /// Chooses the next token from `logits` (one row, vocab long) and records
    /// it as generated, for the penalties.
    ///
    /// An all `-inf`/NaN row yields id 0 (the argmax fallback) with the
    /// uniform logprob `-ln(len)`, the limit of a row of equal logits, so the
    /// result stays finite.
    ///
    /// # Panics
    ///
    /// If `logits` is empty: there is no token to return.
    pub fn sample(&mut self, logits: &[f32]) -> SampledToken {
        assert!(!logits.is_empty(), "Sampler::sample: empty logits row");
        let lse = log_sum_exp(logits);
        let id = self.choose(logits);
        self.record(id);

        let logprob_of = |x: f32| -> f32 {
            match lse {
                Some(lse) => (f64::from(sanitize(x)) - lse) as f32,
                None => -(logits.len() as f32).ln(),
            }
        };
        let top_logprobs = match self.params.logprobs {
            Some(n) => top_n(logits, n)
                .into_iter()
                .map(|(i, x)| (i, logprob_of(x)))
                .collect(),
            None => Vec::new(),
        };
        SampledToken {
            id,
            logprob: logprob_of(logits[id as usize]),
            top_logprobs,
        }
    }

    /// [`Sampler::sample`] of `logits` with every id that `mask` forbids
    /// set to `-inf` first (no mask: exactly `sample`). The token and its
    /// logprobs come from the masked row (see the module comment). If the
    /// model gives no allowed token a finite logit, the allowed tokens are
    /// taken as equally likely, so the choice still obeys the mask.
    ///
    /// # Errors
    ///
    /// [`NothingAllowed`] if the mask allows no id of the row; nothing is
    /// recorded then.
    ///
    /// # Panics
    ///
    /// If `logits` is empty, as `sample`.
    pub fn sample_with_mask(&mut self, logits: &[f32], mask: Option<&TokenMask>) -> Result<SampledToken, NothingAllowed> {
        let Some(mask) = mask else {
            return Ok(self.sample(logits));
        };
        let mut masked = std::mem::take(&mut self.masked);
        masked.clear();
        masked.extend(logits.iter().enumerate().map(|(i, &x)| if mask.allows(i as u32) { x } else { f32::NEG_INFINITY }));
        let allowed = || (0..logits.len() as u32).filter(|&id| mask.allows(id));
        if masked.iter().all(|&x| sanitize(x) == f32::NEG_INFINITY) {
            if allowed().next().is_none() {
                self.masked = masked;
                return Err(NothingAllowed { width: logits.len() });
            }
            for id in allowed() {
                masked[id as usize] = 0.0;
            }
        }
        let token = self.sample(&masked);
        self.masked = masked;
        Ok(token)
    }

    /// The sampling pipeline proper; returns the chosen id.
    fn choose(&mut self, logits: &[f32]) -> u32 {
        let mut cands = std::mem::take(&mut self.candidates);
        cands.clear();
        cands.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &x)| (i as u32, sanitize(x))),
        );
        if self.has_penalties() {
            for id in self.penalized_ids() {
                if let Some(c) = cands.get_mut(id as usize) {
                    c.1 = sanitize(self.penalize(id, c.1));
                }
            }
        }

        // First maximum, so greedy ties go to the lowest id and an all -inf
        // row falls back to id 0.
        let (best, max) = cands
            .iter()
            .fold((0, f32::NEG_INFINITY), |(bi, bx), &(i, x)| {
                if x > bx {
                    (i, x)
                } else {
                    (bi, bx)
                }
            });
        let id = if self.params.temperature == 0.0 || max == f32::NEG_INFINITY {
            best
        } else {
            self.draw(&mut cands, max)
        };
        self.candidates = cands;
        id
    }

    /// Temperature, top-k, top-p, min-p, then the draw. `max` is the largest
    /// (finite) logit in `cands`.
    fn draw(&mut self, cands: &mut Vec<(u32, f32)>, max: f32) -> u32 {
        let SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            ..
        } = self.params;

        // Shift before scaling, so the best token gets weight exactly 1 and
        // nothing overflows, even at tiny temperatures (softmax ignores the
        // shift). From here on `cands` holds unnormalised probabilities
        // `exp((x - max) / T)`: one exp per token, and every filter works on
        // them directly (exp is monotone, so the ranking is unchanged; tokens
        // that underflow to weight 0 can never be drawn anyway).
        cands.retain(|&(_, x)| x > f32::NEG_INFINITY);
        for c in cands.iter_mut() {
            c.1 = ((c.1 - max) / temperature).exp();
        }

        if top_k > 0 && top_k < cands.len() {
            cands.select_nth_unstable_by(top_k - 1, by_value_desc);
            cands.truncate(top_k);
        }
        if top_p < 1.0 {
            nucleus(cands, top_p);
        }
        if min_p > 0.0 {
            // p / p_max = w / 1: no normalisation needed.
            cands.retain(|&(_, w)| w >= min_p);
        }

        // Inverse-CDF draw. Total and running sum are accumulated the same
        // way, so `r < total` ensures a hit; zero weights are never chosen.
        // The best token (weight 1) survives every filter: `total >= 1`.
        let total: f64 = cands.iter().map(|&(_, w)| f64::from(w)).sum();
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        // The record() of this token advances `step` after the draw.
        rng.set_stream(self.step);
        let r = rng.gen::<f64>() * total;
        let mut acc = 0.0f64;
        for &(id, w) in cands.iter() {
            acc += f64::from(w);
            if acc > r {
                return id;
            }
        }
        // Only if `r` rounded up to `total`: take the last positive weight.
        cands
            .iter()
            .rev()
            .find(|&&(_, w)| w > 0.0)
            .map_or(0, |&(id, _)| id)
    }

    fn has_penalties(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    /// Each token in the prompt or generated so far, once: the repetition
    /// penalty must not be applied twice to a token that is in both.
    fn penalized_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.prompt.iter().copied().chain(
            self.counts
                .keys()
                .copied()
                .filter(|id| !self.prompt.contains(id)),
        )
    }

    /// The penalised value of logit `x` of token `id`. Repetition first, then
    /// frequency and presence, in vLLM's order.
    fn penalize(&self, id: u32, x: f32) -> f32 {
        let p = &self.params;
        let x = if x > 0.0 {
            x / p.repetition_penalty
        } else {
            x * p.repetition_penalty
        };
        match self.counts.get(&id) {
            Some(&n) if n > 0 => x - p.frequency_penalty * n as f32 - p.presence_penalty,
            _ => x,
        }
    }

    fn record(&mut self, id: u32) {
        self.step += 1;
        *self.counts.entry(id).or_insert(0) += 1;
    }
}

/// NaN becomes `-inf` and `+inf` becomes `f32::MAX`, so every later max,
/// subtraction and exp is well defined.
fn sanitize(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x.min(f32::MAX)
    }
}

/// Highest value (logit or weight) first, equal values by lowest id, so that
/// every filter's cut is deterministic. Values are never NaN here.
fn by_value_desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// `log(sum(exp(x)))` of the sanitised row, or `None` if every entry is
/// `-inf` (no distribution to speak of). Accumulates in f64: a 129k-term f32
/// sum would lose digits the logprobs are meant to report.
fn log_sum_exp(logits: &[f32]) -> Option<f64> {
    let max = logits
        .iter()
        .map(|&x| sanitize(x))
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let sum: f64 = logits
        .iter()
        .map(|&x| f64::from((sanitize(x) - max).exp()))
        .sum();
    Some(f64::from(max) + sum.ln())
}

/// The `n` largest sanitised logits, highest first, ties to the lowest id.
/// An insertion list beats sorting the row: `n <= 20` and almost every entry
/// fails the first comparison.
fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (i, &x) in logits.iter().enumerate() {
        let x = sanitize(x);
        if top.len() == n && x <= top[n - 1].1 {
            continue;
        }
        // After any equal values: they have lower ids.
        let pos = top.partition_point(|&(_, y)| y >= x);
        top.insert(pos, (i as u32, x));
        top.truncate(n);
    }
    top
}

/// Keeps the smallest highest-first prefix of `cands` whose mass reaches
/// `top_p` of the total (at least one token). Values are weights.
///
/// Sorting a 129k row per token would cost milliseconds. Instead bisect on
/// rank: partition the undecided range `lo..hi` around its middle with an
/// O(n) selection and keep the half that holds the cut, so the work is
/// n + n/2 + ... = O(n). Only the last few candidates are sorted.
fn nucleus(cands: &mut Vec<(u32, f32)>, top_p: f32) {
    let total: f64 = cands.iter().map(|&(_, w)| f64::from(w)).sum();
    let target = f64::from(top_p) * total;
    // Invariant: `cands[..lo]` outranks the rest, is in the nucleus and has
    // mass `acc < target`; the cut lies in `lo..hi`.
    let (mut lo, mut hi, mut acc) = (0, cands.len(), 0.0f64);
    while hi - lo > 32 {
        let mid = lo + (hi - lo) / 2;
        cands[lo..hi].select_nth_unstable_by(mid - lo, by_value_desc);
        let upper: f64 = cands[lo..mid].iter().map(|&(_, w)| f64::from(w)).sum();
        if acc + upper >= target {
            hi = mid;
        } else {
            acc += upper;
            lo = mid;
        }
    }
    cands[lo..hi].sort_unstable_by(by_value_desc);
    let cut = cands[lo..hi].iter().position(|&(_, w)| {
        acc += f64::from(w);
        acc >= target
    });
    if let Some(k) = cut {
        hi = lo + k + 1;
    }
    // Rounding can leave the sum a hair under the target: then keep `..hi`.
    cands.truncate(hi);
}

#[cfg(test)]
mod tests {

    #[test]
    fn resumed_sampler_continues_the_same_stream() {
        let params = SamplingParams { temperature: 1.3, top_k: 50, repetition_penalty: 1.2, presence_penalty: 0.4, seed: Some(7), ..SamplingParams::default() };
        let rows: Vec<Vec<f32>> = (0..12).map(|i| (0..300).map(|j| (((i * 31 + j * 17) % 97) as f32) * 0.05).collect()).collect();
        let prompt = [3, 5, 8];
        let mut one = Sampler::new(params.clone(), &prompt).unwrap();
        let all: Vec<u32> = rows.iter().map(|r| one.sample(r).id).collect();
        let mut first = Sampler::new(params.clone(), &prompt).unwrap();
        let head: Vec<u32> = rows[..4].iter().map(|r| first.sample(r).id).collect();
        let mut rest = Sampler::resume(params, &prompt, &head).unwrap();
        let tail: Vec<u32> = rows[4..].iter().map(|r| rest.sample(r).id).collect();
        assert_eq!([head, tail].concat(), all);
    }
    use super::*;
    use proptest::prelude::*;

    fn seeded(params: SamplingParams, seed: u64) -> Sampler {
        Sampler::new(
            SamplingParams {
                seed: Some(seed),
                ..params
            },
            &[],
        )
        .unwrap()
    }

    /// Logits whose softmax is exactly `probs`.
    fn logits_of(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|&p| p.ln() as f32).collect()
    }

    /// Frequencies of each id over `draws` samples of the same row.
    fn histogram(s: &mut Sampler, logits: &[f32], draws: usize) -> Vec<usize> {
        let mut h = vec![0; logits.len()];
        for _ in 0..draws {
            h[s.sample(logits).id as usize] += 1;
        }
        h
    }

    /// Pearson's chi-square statistic of `observed` against `expected` probs.
    fn chi_square(observed: &[usize], expected: &[f64]) -> f64 {
        let n: usize = observed.iter().sum();
        observed
            .iter()
            .zip(expected)
            .map(|(&o, &p)| {
                let e = p * n as f64;
                (o as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// 99.9th percentile of chi-square with 3 degrees of freedom.
    const CHI2_3DF_999: f64 = 16.27;

    #[test]
    fn defaults_and_greedy() {
        let d = SamplingParams::default();
        assert_eq!(d.temperature, 1.0);
        assert_eq!((d.top_k, d.top_p, d.min_p), (0, 1.0, 0.0));
        assert_eq!(d.repetition_penalty, 1.0);
        assert_eq!((d.presence_penalty, d.frequency_penalty), (0.0, 0.0));
        assert_eq!((d.seed, d.logprobs), (None, None));
        assert_eq!(d.validate(), Ok(()));
        let g = SamplingParams::greedy();
        assert_eq!(g.temperature, 0.0);
        assert_eq!(g.validate(), Ok(()));
    }

    #[test]
    fn serde_fills_missing_fields_with_defaults() {
        let p: SamplingParams = serde_json::from_str(r#"{"temperature":0.5,"seed":7}"#).unwrap();
        assert_eq!(
            p,
            SamplingParams {
                temperature: 0.5,
                seed: Some(7),
                ..SamplingParams::default()
            }
        );
        let empty: SamplingParams = serde_json::from_str("{}").unwrap();
        assert_eq!(empty, SamplingParams::default());
        let back: SamplingParams =
            serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }

    #[test]
    fn validate_rejects_each_bad_field_by_name() {
        type Edit = fn(&mut SamplingParams);
        let cases: &[(&str, Edit)] = &[
            ("temperature", |p| p.temperature = -1.0),
            ("temperature", |p| p.temperature = f32::NAN),
            ("temperature", |p| p.temperature = f32::INFINITY),
            ("temperature", |p| p.temperature = 101.0),
            ("top_p", |p| p.top_p = 0.0),
            ("top_p", |p| p.top_p = 1.5),
            ("top_p", |p| p.top_p = f32::NAN),
            ("min_p", |p| p.min_p = -0.1),
            ("min_p", |p| p.min_p = 1.1),
            ("min_p", |p| p.min_p = f32::NAN),
            ("repetition_penalty", |p| p.repetition_penalty = 0.0),
            ("repetition_penalty", |p| p.repetition_penalty = -1.0),
            ("repetition_penalty", |p| {
                p.repetition_penalty = f32::INFINITY
            }),
            ("repetition_penalty", |p| p.repetition_penalty = f32::NAN),
            ("presence_penalty", |p| p.presence_penalty = 2.5),
            ("presence_penalty", |p| p.presence_penalty = -2.5),
            ("presence_penalty", |p| p.presence_penalty = f32::NAN),
            ("frequency_penalty", |p| p.frequency_penalty = 2.01),
            ("frequency_penalty", |p| {
                p.frequency_penalty = f32::NEG_INFINITY
            }),
            ("logprobs", |p| p.logprobs = Some(21)),
        ];
        for (field, edit) in cases {
            let mut p = SamplingParams::default();
            edit(&mut p);
            let err = p.validate().expect_err(field);
            let msg = err.to_string();
            assert!(msg.starts_with(&format!("{field} must be")), "{msg}");
            assert!(Sampler::new(p, &[]).is_err());
        }
        assert_eq!(
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            }
            .validate()
            .unwrap_err()
            .to_string(),
            "temperature must be finite and in [0, 100], got -1"
        );
        assert_eq!(
            SamplingParams {
                logprobs: Some(21),
                ..Default::default()
            }
            .validate(),
            Err(SamplingError::Logprobs(21))
        );
    }

    #[test]
    fn validate_accepts_range_edges() {
        let edges = [
            SamplingParams {
                temperature: 100.0,
                top_p: 1e-9,
                min_p: 1.0,
                repetition_penalty: 1e-3,
                presence_penalty: -2.0,
                frequency_penalty: 2.0,
                logprobs: Some(20),
                top_k: usize::MAX,
                seed: Some(u64::MAX),
            },
            SamplingParams {
                min_p: 0.0,
                presence_penalty: 2.0,
                frequency_penalty: -2.0,
                logprobs: Some(0),
                ..SamplingParams::greedy()
            },
        ];
        for p in edges {
            assert_eq!(p.validate(), Ok(()), "{p:?}");
        }
    }

    #[test]
    fn greedy_is_argmax_with_ties_to_lowest_id() {
        let mut s = seeded(SamplingParams::greedy(), 0);
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 2.9]).id, 1);
        assert_eq!(s.sample(&[1.0, 5.0, 5.0, 5.0]).id, 1);
        assert_eq!(s.sample(&[7.0, 7.0]).id, 0);
        assert_eq!(s.sample(&[f32::NAN, 1.0, f32::NAN]).id, 1);
        assert_eq!(s.sample(&[1.0, f32::INFINITY, f32::INFINITY]).id, 1);
    }

    #[test]
    fn masked_rows_fall_back_to_id_zero() {
        let rows = [
            vec![f32::NEG_INFINITY; 5],
            vec![f32::NAN; 5],
            vec![f32::NAN, f32::NEG_INFINITY, f32::NAN],
            vec![f32::NAN],
        ];
        for params in [SamplingParams::greedy(), SamplingParams::default()] {
            let mut s = Sampler::new(
                SamplingParams {
                    logprobs: Some(3),
                    ..params
                },
                &[],
            )
            .unwrap();
            for row in &rows {
                let t = s.sample(row);
                assert_eq!(t.id, 0);
                let uniform = -(row.len() as f32).ln();
                assert_eq!(t.logprob, uniform);
                assert!(t.top_logprobs.iter().all(|&(_, lp)| lp == uniform));
            }
        }
    }

    #[test]
    fn nan_logits_are_never_sampled() {
        let mut s = seeded(SamplingParams::default(), 3);
        let row = [f32::NAN, 0.0, f32::NAN, 0.0];
        for _ in 0..1000 {
            let id = s.sample(&row).id;
            assert!(id == 1 || id == 3);
        }
    }

    #[test]
    fn infinite_logit_takes_all_the_mass() {
        let mut s = seeded(
            SamplingParams {
                logprobs: Some(2),
                ..Default::default()
            },
            4,
        );
        for _ in 0..200 {
            let t = s.sample(&[3.0, f32::INFINITY, 1.0]);
            assert_eq!(t.id, 1);
            assert_eq!(t.logprob, 0.0);
            assert_eq!(t.top_logprobs[0], (1, 0.0));
            // 3 - f32::MAX: no mass to speak of, yet still finite.
            assert_eq!(t.top_logprobs[1].0, 0);
            assert!(t.top_logprobs[1].1 < -1e38);
        }
    }

    #[test]
    fn same_seed_same_sequence_different_seed_differs() {
        let row: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams {
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.1,
            frequency_penalty: 0.2,
            ..Default::default()
        };
        let run = |seed| {
            let mut s = Sampler::new(
                SamplingParams {
                    seed: Some(seed),
                    ..params.clone()
                },
                &[1, 2, 3],
            )
            .unwrap();
            (0..2000).map(|_| s.sample(&row).id).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let rows: Vec<Vec<f32>> = (0..20u32)
            .map(|r| {
                (0..64)
                    .map(|i| ((i * 7 + r * 13) % 31) as f32 * 0.3)
                    .collect()
            })
            .collect();
        for t in [0.01, 0.5, 1.0, 2.0, 100.0] {
            let mut s = seeded(
                SamplingParams {
                    temperature: t,
                    top_k: 1,
                    ..Default::default()
                },
                t.to_bits() as u64,
            );
            let mut g = seeded(SamplingParams::greedy(), 0);
            for row in &rows {
                assert_eq!(s.sample(row).id, g.sample(row).id, "temperature {t}");
            }
        }
    }

    #[test]
    fn tiny_top_p_keeps_only_the_top_token() {
        let row = logits_of(&[0.2, 0.25, 0.3, 0.25]);
        let mut s = seeded(
            SamplingParams {
                top_p: 1e-6,
                temperature: 5.0,
                ..Default::default()
            },
            5,
        );
        assert_eq!(histogram(&mut s, &row, 2000), vec![0, 0, 2000, 0]);
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_the_mass() {
        let row = logits_of(&[0.2, 0.5, 0.3]);
        for (top_p, kept) in [(0.45, vec![1]), (0.7, vec![1, 2]), (0.9, vec![0, 1, 2])] {
            let mut s = seeded(
                SamplingParams {
                    top_p,
                    ..Default::default()
                },
                6,
            );
            let h = histogram(&mut s, &row, 3000);
            for (id, &count) in h.iter().enumerate() {
                assert_eq!(count > 0, kept.contains(&id), "top_p {top_p}: {h:?}");
            }
        }
    }

    /// The nucleus by full sort, as the definition reads.
    fn nucleus_by_sort(cands: &[(u32, f32)], top_p: f32) -> Vec<u32> {
        let mut sorted = cands.to_vec();
        sorted.sort_by(by_value_desc);
        let total: f64 = sorted.iter().map(|&(_, w)| f64::from(w)).sum();
        let mut acc = 0.0;
        let mut ids = Vec::new();
        for &(id, w) in &sorted {
            ids.push(id);
            acc += f64::from(w);
            if acc >= f64::from(top_p) * total {
                break;
            }
        }
        ids.sort_unstable();
        ids
    }

    #[test]
    fn nucleus_bisection_matches_full_sort_on_a_wide_row() {
        // A flat row: the nucleus spans thousands of tokens, so the bisection
        // runs many rounds. Integer weights keep every sum exact.
        let cands: Vec<(u32, f32)> = (0..5000u32)
            .map(|i| (i, ((i * 7919) % 1000 + 1) as f32))
            .collect();
        for top_p in [0.01, 0.3, 0.5, 0.9, 0.999] {
            let mut got = cands.clone();
            nucleus(&mut got, top_p);
            let mut ids: Vec<u32> = got.iter().map(|c| c.0).collect();
            ids.sort_unstable();
            assert_eq!(ids, nucleus_by_sort(&cands, top_p), "top_p {top_p}");
        }
    }

    #[test]
    fn min_p_drops_tokens_below_the_scaled_max() {
        // p_max = 0.5, min_p = 0.2: the cut is 0.1, so only token 3 goes.
        let row = logits_of(&[0.5, 0.3, 0.15, 0.05]);
        let mut s = seeded(
            SamplingParams {
                min_p: 0.2,
                ..Default::default()
            },
            7,
        );
        let h = histogram(&mut s, &row, 5000);
        assert_eq!(h[3], 0, "{h:?}");
        assert!(h[..3].iter().all(|&c| c > 0), "{h:?}");
        // Renormalised over the three survivors.
        assert!(chi_square(&h[..3], &[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]) < 13.82);
    }

    #[test]
    fn temperature_one_matches_the_distribution() {
        let probs = [0.1, 0.2, 0.3, 0.4];
        let mut s = seeded(SamplingParams::default(), 2024);
        let h = histogram(&mut s, &logits_of(&probs), 20_000);
        let chi2 = chi_square(&h, &probs);
        assert!(chi2 < CHI2_3DF_999, "chi2 {chi2}, counts {h:?}");
        for (&c, &p) in h.iter().zip(&probs) {
            assert!((c as f64 / 20_000.0 - p).abs() < 0.015, "{h:?}");
        }
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        // softmax(log p / T) is proportional to p^(1/T).
        let probs = [0.1, 0.2, 0.3, 0.4];
        for t in [0.5f32, 2.0] {
            let powed: Vec<f64> = probs
                .iter()
                .map(|p: &f64| p.powf(1.0 / f64::from(t)))
                .collect();
            let z: f64 = powed.iter().sum();
            let expected: Vec<f64> = powed.iter().map(|p| p / z).collect();
            let mut s = seeded(
                SamplingParams {
                    temperature: t,
                    ..Default::default()
                },
                11,
            );
            let h = histogram(&mut s, &logits_of(&probs), 20_000);
            assert!(chi_square(&h, &expected) < CHI2_3DF_999, "T={t}: {h:?}");
        }
    }

    #[test]
    fn top_k_renormalises_over_survivors() {
        let probs = [0.1, 0.2, 0.3, 0.4];
        let mut s = seeded(
            SamplingParams {
                top_k: 2,
                ..Default::default()
            },
            12,
        );
        let h = histogram(&mut s, &logits_of(&probs), 20_000);
        assert_eq!(&h[..2], &[0, 0]);
        let p3 = h[3] as f64 / 20_000.0;
        assert!((p3 - 4.0 / 7.0).abs() < 0.015, "{h:?}");
    }

    #[test]
    fn repetition_penalty_follows_hf_formula() {
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..Default::default()
            },
            &[0, 1, 99],
        )
        .unwrap();
        s.record(2);
        s.record(1); // in the prompt too: still penalised only once
        let mut row = [4.0, -3.0, 6.0, 5.0, 0.0];
        s.apply_penalties(&mut row);
        assert_eq!(row, [2.0, -6.0, 3.0, 5.0, 0.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_follow_openai_formula() {
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 0.5,
                frequency_penalty: 0.25,
                ..Default::default()
            },
            &[3], // prompt tokens do not count for these two
        )
        .unwrap();
        for id in [0, 0, 0, 1, 7] {
            s.record(id);
        }
        let mut row = [1.0, 1.0, 1.0, 1.0];
        s.apply_penalties(&mut row);
        assert_eq!(row, [1.0 - 0.75 - 0.5, 1.0 - 0.25 - 0.5, 1.0, 1.0]);
    }

    #[test]
    fn all_penalties_compose_in_vllm_order() {
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 1.5,
                presence_penalty: -1.0,
                frequency_penalty: 2.0,
                ..Default::default()
            },
            &[],
        )
        .unwrap();
        s.record(0);
        s.record(0);
        s.record(1);
        let mut row = [3.0, -2.0, 3.0];
        s.apply_penalties(&mut row);
        assert_eq!(
            row,
            [3.0 / 1.5 - 2.0 * 2.0 + 1.0, -2.0 * 1.5 - 2.0 + 1.0, 3.0]
        );
    }

    #[test]
    fn no_penalties_leave_the_row_alone() {
        let mut s = seeded(SamplingParams::default(), 0);
        s.record(0);
        let mut row = [1.0, f32::NAN, -1.0];
        s.apply_penalties(&mut row);
        assert_eq!(row[0], 1.0);
        assert!(row[1].is_nan());
        assert_eq!(row[2], -1.0);
    }

    #[test]
    fn sample_records_tokens_for_the_penalties() {
        // Greedy with a strong frequency penalty must cycle through the
        // near-tied tokens rather than repeat the argmax.
        let mut s = seeded(
            SamplingParams {
                frequency_penalty: 2.0,
                ..SamplingParams::greedy()
            },
            0,
        );
        let row = [1.0, 0.9, 0.8];
        let ids: Vec<u32> = (0..3).map(|_| s.sample(&row).id).collect();
        assert_eq!(ids, [0, 1, 2]);
    }

    #[test]
    fn repetition_penalty_covers_the_prompt() {
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..SamplingParams::greedy()
            },
            &[0],
        )
        .unwrap();
        assert_eq!(s.sample(&[2.0, 1.5]).id, 1);
    }

    #[test]
    fn logprobs_come_from_raw_logits_and_are_sorted() {
        let row = [0.5f32, 2.0, -1.0, 2.0, 0.0];
        let mut s = Sampler::new(
            SamplingParams {
                logprobs: Some(5),
                temperature: 0.3,
                repetition_penalty: 1.7,
                top_k: 2,
                seed: Some(1),
                ..Default::default()
            },
            &[1],
        )
        .unwrap();
        let z: f64 = row.iter().map(|&x| f64::from(x).exp()).sum();
        for _ in 0..20 {
            let t = s.sample(&row);
            let lp = &t.top_logprobs;
            assert_eq!(lp.len(), 5);
            let mass: f64 = lp.iter().map(|&(_, l)| f64::from(l).exp()).sum();
            assert!((mass - 1.0).abs() < 1e-5, "{mass}");
            assert!(lp.windows(2).all(|w| w[0].1 >= w[1].1), "{lp:?}");
            assert_eq!(lp[0].0, 1, "ties go to the lowest id");
            assert_eq!(lp[1].0, 3);
            for &(id, l) in lp {
                let expect = (f64::from(row[id as usize]) - z.ln()) as f32;
                assert!((l - expect).abs() < 1e-6);
            }
            let own = lp.iter().find(|&&(id, _)| id == t.id).unwrap();
            assert_eq!(own.1, t.logprob);
        }
    }

    #[test]
    fn logprobs_only_when_asked() {
        let row = [0.0, 1.0, 2.0];
        let mut s = seeded(SamplingParams::default(), 0);
        assert!(s.sample(&row).top_logprobs.is_empty());
        let mut s = seeded(
            SamplingParams {
                logprobs: Some(0),
                ..Default::default()
            },
            0,
        );
        assert!(s.sample(&row).top_logprobs.is_empty());
        let mut s = seeded(
            SamplingParams {
                logprobs: Some(2),
                ..Default::default()
            },
            0,
        );
        let ids: Vec<u32> = s.sample(&row).top_logprobs.iter().map(|t| t.0).collect();
        assert_eq!(ids, [2, 1]);
    }

    #[test]
    fn unseeded_samplers_work() {
        let mut s = Sampler::new(SamplingParams::default(), &[]).unwrap();
        assert!(s.sample(&[0.0, 0.0]).id < 2);
        assert_eq!(s.params(), &SamplingParams::default());
    }

    #[test]
    #[should_panic(expected = "empty logits row")]
    fn empty_row_panics() {
        seeded(SamplingParams::default(), 0).sample(&[]);
    }

    fn mask_of(len: usize, ids: &[u32]) -> TokenMask {
        let mut m = TokenMask::new(len);
        for &id in ids {
            m.allow(id);
        }
        m
    }

    #[test]
    fn token_mask_bits() {
        let mut m = mask_of(70, &[0, 31, 32, 69, 70, 1000]);
        assert_eq!(m.words().len(), 3);
        assert!(m.allows(0) && m.allows(31) && m.allows(32) && m.allows(69));
        assert!(!m.allows(1) && !m.allows(70) && !m.allows(1000));
        assert_eq!(m.count_allowed(), 4);
        m.forbid(31);
        assert!(!m.allows(31));
        // Bits past the width in the last word do not count.
        m.words_mut()[2] = u32::MAX;
        assert!(!m.allows(96));
        assert_eq!(m.count_allowed(), 3 + 5);
        m.clear();
        assert_eq!(m.count_allowed(), 0);
    }

    #[test]
    fn greedy_obeys_the_mask_and_logprobs_are_of_the_masked_row() {
        let row = [5.0f32, 1.0, 0.0, 3.0];
        let mut s = seeded(SamplingParams { logprobs: Some(4), ..SamplingParams::greedy() }, 0);
        let t = s.sample_with_mask(&row, Some(&mask_of(4, &[1, 3]))).unwrap();
        assert_eq!(t.id, 3);
        let z = (1.0f64.exp() + 3.0f64.exp()).ln();
        assert!((t.logprob - (3.0 - z) as f32).abs() < 1e-6);
        let ids: Vec<u32> = t.top_logprobs.iter().map(|&(id, _)| id).collect();
        assert_eq!(&ids[..2], &[3, 1]);
        assert!(t.top_logprobs[2..].iter().all(|&(_, l)| l == f32::NEG_INFINITY), "forbidden tokens have no probability: {:?}", t.top_logprobs);
        // No mask is plain sampling.
        assert_eq!(s.sample_with_mask(&row, None).unwrap().id, 0);
    }

    #[test]
    fn a_mask_that_allows_nothing_is_an_error() {
        let mut s = seeded(SamplingParams::default(), 0);
        assert_eq!(s.sample_with_mask(&[1.0, 2.0], Some(&mask_of(2, &[]))), Err(NothingAllowed { width: 2 }));
        // Ids beyond a narrower mask are forbidden too.
        assert_eq!(s.sample_with_mask(&[1.0, 2.0, 3.0], Some(&mask_of(2, &[]))), Err(NothingAllowed { width: 3 }));
        assert_eq!(s.sample_with_mask(&[1.0, 2.0, 3.0], Some(&mask_of(3, &[2]))).unwrap().id, 2);
    }

    #[test]
    fn allowed_tokens_without_a_finite_logit_are_equally_likely() {
        let row = [9.0, f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY];
        let mask = mask_of(4, &[1, 2, 3]);
        let mut greedy = seeded(SamplingParams::greedy(), 0);
        assert_eq!(greedy.sample_with_mask(&row, Some(&mask)).unwrap().id, 1);
        let mut s = seeded(SamplingParams::default(), 3);
        let mut h = [0usize; 4];
        for _ in 0..3000 {
            h[s.sample_with_mask(&row, Some(&mask)).unwrap().id as usize] += 1;
        }
        assert_eq!(h[0], 0);
        assert!(h[1..].iter().all(|&c| c > 800), "{h:?}");
    }

    // ----- properties -----

    /// Logits on a coarse grid, so that shifting and scaling cannot merge
    /// distinct values and the reference filters below see the same order as
    /// the sampler; sprinkled with NaN and infinities.
    fn logit() -> impl Strategy<Value = f32> {
        prop_oneof![
            20 => (-80i32..=80).prop_map(|i| i as f32 * 0.25),
            1 => Just(f32::NAN),
            1 => Just(f32::NEG_INFINITY),
        ]
    }

    fn params() -> impl Strategy<Value = SamplingParams> {
        (
            prop_oneof![Just(0.0f32), 0.05f32..5.0],
            prop_oneof![Just(0usize), 1usize..12],
            prop_oneof![Just(1.0f32), 0.01f32..1.0],
            prop_oneof![Just(0.0f32), 0.0f32..1.0],
            prop_oneof![Just(1.0f32), 0.5f32..2.0],
            -2.0f32..=2.0,
            -2.0f32..=2.0,
            any::<u64>(),
            prop::option::of(0usize..=MAX_LOGPROBS),
        )
            .prop_map(
                |(temperature, top_k, top_p, min_p, rep, pres, freq, seed, logprobs)| {
                    SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        repetition_penalty: rep,
                        presence_penalty: pres,
                        frequency_penalty: freq,
                        seed: Some(seed),
                        logprobs,
                    }
                },
            )
    }

    /// Necessary conditions for `id` to survive the filters of `p` on the
    /// penalised row `pen`, written independently of the implementation: a
    /// full sort with tie-tolerant cuts and a little slack on the mass cuts.
    fn survives(p: &SamplingParams, pen: &[f32], id: usize) -> Result<(), String> {
        let v = |i: usize| sanitize(pen[i]);
        let max = (0..pen.len()).map(v).fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return if id == 0 {
                Ok(())
            } else {
                Err("masked row must give 0".into())
            };
        }
        let x = v(id);
        if x == f32::NEG_INFINITY {
            return Err("chose a masked token".into());
        }
        let above = |i: usize| (0..pen.len()).filter(|&j| v(j) > v(i)).count();
        if p.temperature == 0.0 {
            return if above(id) == 0 && (0..id).all(|j| v(j) < x) {
                Ok(())
            } else {
                Err("not the first argmax".into())
            };
        }
        if p.top_k > 0 && above(id) >= p.top_k {
            return Err(format!("{} tokens above, top_k {}", above(id), p.top_k));
        }
        // Top-k set including every token tied at its edge (a superset).
        let in_k = |j: usize| p.top_k == 0 || above(j) < p.top_k;
        let w = |j: usize| (f64::from(v(j) - max) / f64::from(p.temperature)).exp();
        let z: f64 = (0..pen.len()).filter(|&j| in_k(j)).map(w).sum();
        let mass_above: f64 = (0..pen.len()).filter(|&j| in_k(j) && v(j) > x).map(w).sum();
        if p.top_p < 1.0 && mass_above / z >= f64::from(p.top_p) + 1e-4 {
            return Err(format!(
                "mass above {} >= top_p {}",
                mass_above / z,
                p.top_p
            ));
        }
        if w(id) < f64::from(p.min_p) - 1e-4 {
            return Err(format!("ratio {} < min_p {}", w(id), p.min_p));
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn sampled_tokens_survive_the_filters(
            p in params(),
            rows in prop::collection::vec(prop::collection::vec(logit(), 1..48), 1..6),
            prompt in prop::collection::vec(0u32..64, 0..8),
        ) {
            prop_assert_eq!(p.validate(), Ok(()));
            let mut s = Sampler::new(p.clone(), &prompt).unwrap();
            for row in &rows {
                let mut pen = row.clone();
                s.apply_penalties(&mut pen);
                let t = s.sample(row);
                prop_assert!((t.id as usize) < row.len());
                if let Err(why) = survives(&p, &pen, t.id as usize) {
                    return Err(TestCaseError::fail(format!("id {}: {why}; row {pen:?}", t.id)));
                }

                prop_assert!(t.logprob <= 1e-6 && !t.logprob.is_nan());
                let want = p.logprobs.map_or(0, |n| n.min(row.len()));
                prop_assert_eq!(t.top_logprobs.len(), want);
                prop_assert!(t.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
                if want == row.len() {
                    let mass: f64 = t.top_logprobs.iter().map(|&(_, l)| f64::from(l).exp()).sum();
                    prop_assert!((mass - 1.0).abs() < 1e-4, "mass {}", mass);
                }
            }
        }

        #[test]
        fn masked_sampling_never_picks_a_forbidden_token(
            p in params(),
            rows in prop::collection::vec(prop::collection::vec(logit(), 1..48), 1..6),
            allowed in prop::collection::vec(any::<bool>(), 48),
        ) {
            let mut s = Sampler::new(p, &[1, 2]).unwrap();
            for row in &rows {
                let ids: Vec<u32> = (0..row.len() as u32).filter(|&i| allowed[i as usize]).collect();
                let mask = mask_of(row.len(), &ids);
                match s.sample_with_mask(row, Some(&mask)) {
                    Ok(t) => {
                        prop_assert!(mask.allows(t.id), "chose forbidden {}", t.id);
                        prop_assert!(!t.logprob.is_nan() && t.logprob > f32::NEG_INFINITY);
                        prop_assert!(t.top_logprobs.iter().all(|&(id, l)| mask.allows(id) || l == f32::NEG_INFINITY));
                    }
                    Err(e) => prop_assert!(ids.is_empty(), "{e}"),
                }
            }
        }

        #[test]
        fn nucleus_matches_full_sort(
            weights in prop::collection::vec(0u32..50, 1..400),
            top_p in 0.001f32..1.0,
        ) {
            // Small integer weights: sums are exact and ties are common.
            let cands: Vec<(u32, f32)> =
                weights.iter().enumerate().map(|(i, &w)| (i as u32, w as f32)).collect();
            let mut got = cands.clone();
            nucleus(&mut got, top_p);
            let mut ids: Vec<u32> = got.iter().map(|c| c.0).collect();
            ids.sort_unstable();
            prop_assert_eq!(ids, nucleus_by_sort(&cands, top_p));
        }

        #[test]
        fn same_seed_reproduces(
            p in params(),
            row in prop::collection::vec(logit(), 1..32),
        ) {
            let mut a = Sampler::new(p.clone(), &[1, 2]).unwrap();
            let mut b = Sampler::new(p, &[1, 2]).unwrap();
            for _ in 0..16 {
                prop_assert_eq!(a.sample(&row), b.sample(&row));
            }
        }

        #[test]
        fn arbitrary_floats_never_panic(
            p in params(),
            row in prop::collection::vec(any::<f32>(), 1..32),
        ) {
            let mut s = Sampler::new(p, &[0, 5, 1000]).unwrap();
            for _ in 0..4 {
                let t = s.sample(&row);
                prop_assert!((t.id as usize) < row.len());
                prop_assert!(!t.logprob.is_nan());
            }
        }
    }
}
