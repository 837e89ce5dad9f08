//! Structured output in the decode loop. A constrained sequence carries its
//! grammar matcher and the mask of its next token. Each step, the masks of
//! the sequences that will sample after the forward pass are filled on
//! another thread while the pass runs ([`fill_masks`]), so the grammar's
//! CPU work hides behind the model's; the sampler then applies the mask
//! and the matcher is told the chosen token.

use duplex_grammar::{GrammarError, Matcher, TokenMask};
use duplex_model::sampling::{SampledToken, Sampler};
use std::collections::HashSet;

pub struct Constrained {
    matcher: Matcher,
    /// The request's stop ids, allowed only where the output may end.
    stop_ids: Vec<u32>,
    mask: TokenMask,
    /// Whether `mask` is that of the next token (or why it could not be).
    filled: Option<Result<(), GrammarError>>,
}

impl Constrained {
    pub fn new(matcher: Matcher, stop_ids: &HashSet<u32>) -> Self {
        let mut stop_ids: Vec<u32> = stop_ids.iter().copied().collect();
        stop_ids.sort_unstable();
        Constrained { matcher, stop_ids, mask: TokenMask::default(), filled: None }
    }

    /// Computes the mask of the next token.
    pub fn fill(&mut self) {
        self.filled = Some(self.matcher.fill_mask(&self.stop_ids, &mut self.mask));
    }

    /// Samples the next token from `logits` under the mask (filled now if
    /// the step did not) and advances the matcher past it. The error names
    /// what went wrong, for the client.
    pub fn sample(&mut self, sampler: &mut Sampler, logits: &[f32]) -> Result<SampledToken, String> {
        if self.filled.is_none() {
            self.fill();
        }
        self.filled.take().unwrap_or(Ok(())).map_err(|e| e.to_string())?;
        let token = sampler.sample_with_mask(logits, Some(&self.mask)).map_err(|e| e.to_string())?;
        self.matcher.accept(token.id).map_err(|e| e.to_string())?;
        Ok(token)
    }

    /// Advances past a token sampled elsewhere (the prefill worker's first).
    pub fn accept(&mut self, id: u32) -> Result<(), GrammarError> {
        self.filled = None;
        self.matcher.accept(id)
    }

    /// The output is complete: nothing but a stop token could follow.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_finished()
    }
}

/// Fills the masks of the sequences that sample after this step.
pub fn fill_masks(constrained: Vec<&mut Constrained>) {
    for c in constrained {
        c.fill();
    }
}
