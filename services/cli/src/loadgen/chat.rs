//! The multi-turn chat workload (`--chat-turns`): what prefix caching is
//! for. Each turn resends the whole conversation, the previous answer
//! included, plus a new user message; with the cache only the new part is
//! prefilled. After each turn a control request with a fresh prompt of the
//! same length, which shares no prefix with anything sent before, measures
//! what the turn would cost without the cache on the same server at the
//! same moment: the ratio of the two TTFTs is the cache's effect, per turn.
//! (Against a server with `prefix_caching = false` the ratio is about 1.)

use super::report::{Outcome, RunReport};
use super::{random_prompt, request, send, Client, Shape};
use anyhow::{bail, Result};
use duplex_proto::v1::{generate_request, TokenIds};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// How the conversation is sized, and the TTFTs it measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Chat {
    pub turns: u32,
    /// The first turn's prompt (a system prompt and the first message).
    pub first_tokens: u32,
    /// Each later turn's new user message.
    pub message_tokens: u32,
    /// Each answer, resent in the next turn.
    pub answer_tokens: u32,
    pub per_turn: Vec<ChatTurn>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatTurn {
    pub turn: u32,
    pub prompt_tokens: u32,
    /// TTFT of the turn, and of the fresh prompt of the same length after it.
    pub ttft_ms: Option<f64>,
    pub fresh_ttft_ms: Option<f64>,
}

impl ChatTurn {
    /// TTFT with the conversation cached ÷ without.
    pub fn ratio(&self) -> Option<f64> {
        match (self.ttft_ms, self.fresh_ttft_ms) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        }
    }
}

impl Chat {
    /// Positions the last turn needs: its prompt and its answer.
    pub fn positions(&self) -> u64 {
        u64::from(self.first_tokens) + u64::from(self.turns.saturating_sub(1)) * (u64::from(self.answer_tokens) + u64::from(self.message_tokens)) + u64::from(self.answer_tokens)
    }

    /// The per-turn table, in Markdown.
    pub fn table(&self) -> String {
        let ms = |v: Option<f64>| v.map_or_else(|| "–".to_string(), |v| format!("{v:.1}"));
        let mut out = String::from("| turn | prompt tokens | TTFT (ms) | fresh prompt TTFT (ms) | cached ÷ fresh |\n| --- | --- | --- | --- | --- |\n");
        for t in &self.per_turn {
            let ratio = t.ratio().map_or_else(|| "–".to_string(), |r| format!("{r:.2}"));
            out += &format!("| {} | {} | {} | {} | {ratio} |\n", t.turn, t.prompt_tokens, ms(t.ttft_ms), ms(t.fresh_ttft_ms));
        }
        out
    }
}

/// Hold the conversation; one run per turn, with its two requests (kinds
/// `chat` and `fresh`).
pub async fn run(client: &Client, vocab: u32, mut chat: Chat, seed: u64) -> Result<(Chat, Vec<RunReport>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let ids = |rng: &mut ChaCha8Rng, n: u32| -> Vec<u32> { (0..n).map(|_| rng.gen_range(0..vocab)).collect() };
    let mut history = ids(&mut rng, chat.first_tokens);
    let mut runs = vec![];
    for turn in 1..=chat.turns {
        let start = Instant::now();
        let prompt_tokens = history.len() as u32;
        let turn_request = request(generate_request::Prompt::Tokens(TokenIds { ids: history.clone() }), chat.answer_tokens);
        let answer = send(client, "chat", turn_request, start).await;
        if let Some(code) = &answer.sample.error {
            bail!("turn {turn} failed: {code}: {}", answer.message.clone().unwrap_or_default());
        }
        // Only the time to the first token matters here.
        let fresh = send(client, "fresh", random_prompt(&mut rng, vocab, Shape { prompt: prompt_tokens, output: 1 }), start).await;
        chat.per_turn.push(ChatTurn { turn, prompt_tokens, ttft_ms: answer.sample.ttft_ms, fresh_ttft_ms: fresh.sample.ttft_ms });
        eprintln!("turn {turn}: {prompt_tokens} prompt tokens, TTFT {:.1} ms, a fresh prompt's {:.1} ms", answer.sample.ttft_ms.unwrap_or(f64::NAN), fresh.sample.ttft_ms.unwrap_or(f64::NAN));
        // The next turn: all of this one, its answer, a new message.
        history.extend(&answer.token_ids);
        history.extend(ids(&mut rng, chat.message_tokens));
        let outcomes: [Outcome; 2] = [answer, fresh];
        runs.push(RunReport::new(&format!("turn {turn}"), &outcomes, start.elapsed().as_secs_f64()));
    }
    Ok((chat, runs))
}
