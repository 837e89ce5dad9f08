//! Generation for one sequence: prefill, then sample and decode until a stop
//! condition, streaming text deltas as they become final.
//!
//! `Engine` owns the model, tokenizer and KV pool. Later the serving workers
//! drive the same pieces with continuous batching; this is the single-request
//! loop the CLI uses and the reference the batched one is tested against.

use crate::kv_cache::{BlockTable, KvPool};
use crate::model::{ForwardError, LoadError, Logits, Model, Precision};
use crate::sampling::{SampledToken, Sampler, SamplingError, SamplingParams};
use crate::stop::StopStrings;
use crate::tokenizer::{IncrementalDecoder, Tokenizer, TokenizerError};
use std::path::Path;
use std::time::{Duration, Instant};

/// KV cache block size in tokens.
pub const KV_BLOCK_SIZE: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("the tokenizer has {tokenizer} tokens but the model's vocab_size is only {model}")]
    VocabTooSmall { tokenizer: usize, model: usize },
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens; the context limit is {limit}")]
    PromptTooLong { prompt: usize, limit: usize },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("stop strings must not be empty")]
    EmptyStopString,
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// What a request asks of generation, beyond the prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Extra token ids that end generation (EOS always does, unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation; the text is cut before them.
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Prefill the prompt in chunks of at most this many tokens.
    pub prefill_chunk: usize,
}

impl Default for GenerationParams {
    fn default() -> Self {
        GenerationParams {
            max_tokens: 256,
            sampling: SamplingParams::default(),
            stop_token_ids: vec![],
            stop: vec![],
            ignore_eos: false,
            prefill_chunk: 512,
        }
    }
}

pub use duplex_text::FinishReason;

/// One generated token, as streamed.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    pub token: SampledToken,
    /// Text that became final with this token (may be empty).
    pub text: String,
}

/// The finished generation.
#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<SampledToken>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// From the start of the request to the first sampled token.
    pub ttft: Duration,
    /// From the first to the last sampled token.
    pub decode_time: Duration,
}

impl Generation {
    pub fn token_ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.id).collect()
    }

    /// Decode speed: tokens after the first, per second of decode time.
    pub fn decode_tokens_per_s(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        if n == 0 || self.decode_time.is_zero() {
            0.0
        } else {
            n as f64 / self.decode_time.as_secs_f64()
        }
    }
}

pub use duplex_text::sampling_defaults;

pub struct Engine {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub precision: Precision,
    pool: KvPool,
    context_limit: usize,
}

impl Engine {
    /// Load the model and tokenizer in `dir`, with a KV pool for `context`
    /// tokens (capped at the model's `max_position_embeddings`).
    pub fn load(dir: &Path, precision: Precision, context: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<Self, EngineError> {
        Self::load_with(dir, &[], precision, context, progress)
    }

    /// [`Engine::load`] with `overrides` of a GGUF model's metadata
    /// (`KEY=TYPE:VALUE`, see [`crate::source::ModelSource::locate_with`]);
    /// they change the model, not its tokenizer.
    pub fn load_with(dir: &Path, overrides: &[String], precision: Precision, context: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<Self, EngineError> {
        let source = crate::source::ModelSource::locate_with(dir, overrides)?;
        let model = Model::load_source(&source, &duplex_kernels::pool::PoolConfig::all_cores(), progress)?;
        let tokenizer = Tokenizer::from_model_path(dir)?;
        if tokenizer.vocab_size() > model.cfg.vocab_size {
            return Err(EngineError::VocabTooSmall { tokenizer: tokenizer.vocab_size(), model: model.cfg.vocab_size });
        }
        let context_limit = context.clamp(1, model.cfg.max_position_embeddings);
        let pool = model.new_kv_pool(context_limit.div_ceil(KV_BLOCK_SIZE), KV_BLOCK_SIZE);
        Ok(Engine { model, tokenizer, precision, pool, context_limit })
    }

    pub fn context_limit(&self) -> usize {
        self.context_limit
    }

    /// Generate a continuation of `prompt`, calling `on_token` for every
    /// sampled token.
    pub fn generate(&mut self, prompt: &[u32], params: &GenerationParams, on_token: &mut dyn FnMut(&TokenEvent)) -> Result<Generation, GenerateError> {
        if prompt.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        if prompt.len() >= self.context_limit {
            return Err(GenerateError::PromptTooLong { prompt: prompt.len(), limit: self.context_limit });
        }
        if params.max_tokens == 0 {
            return Err(GenerateError::ZeroMaxTokens);
        }
        if params.stop.iter().any(|s| s.is_empty()) {
            return Err(GenerateError::EmptyStopString);
        }
        let mut sampler = Sampler::new(params.sampling.clone(), prompt)?;
        let mut table = BlockTable::default();
        let result = self.run(prompt, params, &mut sampler, &mut table, on_token);
        self.pool.release(&mut table);
        result
    }

    fn run(
        &mut self,
        prompt: &[u32],
        params: &GenerationParams,
        sampler: &mut Sampler,
        table: &mut BlockTable,
        on_token: &mut dyn FnMut(&TokenEvent),
    ) -> Result<Generation, GenerateError> {
        let start = Instant::now();
        let mut logits = vec![];
        for chunk in prompt.chunks(params.prefill_chunk.max(1)) {
            logits = self.model.forward(&mut self.pool, table, chunk, self.precision, Logits::Last)?;
        }
        let mut eos: Vec<u32> = params.stop_token_ids.clone();
        if !params.ignore_eos {
            eos.extend(self.tokenizer.eos_token_ids());
            eos.extend(&self.model.cfg.eos_token_ids);
        }
        let mut decoder = IncrementalDecoder::with_prompt(&self.tokenizer, prompt);
        let mut stops = StopStrings::new(params.stop.clone());
        let mut tokens = vec![];
        let mut text = String::new();
        let mut ttft = Duration::ZERO;
        let (finish_reason, hit_stop_string) = loop {
            let token = sampler.sample(&logits);
            if tokens.is_empty() {
                ttft = start.elapsed();
            }
            let id = token.id;
            let (delta, hit_stop) = stops.push(&decoder.push(&self.tokenizer, id));
            text.push_str(&delta);
            tokens.push(token.clone());
            on_token(&TokenEvent { token, text: delta });
            if hit_stop || eos.contains(&id) {
                break (FinishReason::Stop, hit_stop);
            }
            if tokens.len() >= params.max_tokens || table.len >= self.context_limit {
                break (FinishReason::Length, false);
            }
            logits = self.model.forward(&mut self.pool, table, &[id], self.precision, Logits::Last)?;
        };
        if !hit_stop_string {
            // The text is final: flush what the decoder and the stop-string
            // matcher held back.
            let (mut tail, _) = stops.push(&decoder.finish(&self.tokenizer));
            tail.push_str(&stops.finish());
            if !tail.is_empty() {
                text.push_str(&tail);
            }
        }
        let decode_time = start.elapsed() - ttft;
        Ok(Generation { tokens, text, finish_reason, prompt_tokens: prompt.len(), ttft, decode_time })
    }
}
