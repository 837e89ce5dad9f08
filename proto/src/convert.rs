//! Between the worker protocol's messages and the engine's types. Messages
//! arrive from another process: nothing here trusts them (`SamplingParams`
//! are validated by whoever builds a `Sampler`).

use crate::worker;
use duplex_grammar::ConstraintSpec;
use duplex_text::sampling::{SampledToken, SamplingParams};
use duplex_text::FinishReason;

impl From<&worker::Sampling> for SamplingParams {
    fn from(s: &worker::Sampling) -> Self {
        SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k as usize,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            seed: Some(s.seed),
            logprobs: s.top_logprobs.map(|n| n as usize),
        }
    }
}

impl From<&SamplingParams> for worker::Sampling {
    /// A request without a seed must have been given one by the caller; `0`
    /// stands in otherwise.
    fn from(p: &SamplingParams) -> Self {
        worker::Sampling {
            temperature: p.temperature,
            top_k: p.top_k.min(u32::MAX as usize) as u32,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            seed: p.seed.unwrap_or(0),
            top_logprobs: p.logprobs.map(|n| n.min(u32::MAX as usize) as u32),
            constraint: None,
        }
    }
}

impl From<&ConstraintSpec> for worker::Constraint {
    fn from(c: &ConstraintSpec) -> Self {
        use worker::constraint::Kind;
        let kind = match c {
            ConstraintSpec::JsonObject => Kind::JsonObject(true),
            ConstraintSpec::JsonSchema(schema) => Kind::JsonSchema(schema.to_string()),
            ConstraintSpec::Lark(grammar) => Kind::Lark(grammar.clone()),
        };
        worker::Constraint { kind: Some(kind) }
    }
}

impl TryFrom<&worker::Constraint> for ConstraintSpec {
    /// What is wrong with the message, for an INVALID_ARGUMENT.
    type Error = String;

    fn try_from(c: &worker::Constraint) -> Result<Self, String> {
        use worker::constraint::Kind;
        match &c.kind {
            Some(Kind::JsonObject(true)) => Ok(ConstraintSpec::JsonObject),
            Some(Kind::JsonObject(false)) => Err("constraint.json_object is false; leave the constraint unset for free text".into()),
            Some(Kind::JsonSchema(text)) => serde_json::from_str(text).map(ConstraintSpec::JsonSchema).map_err(|e| format!("constraint.json_schema is not JSON: {e}")),
            Some(Kind::Lark(grammar)) => Ok(ConstraintSpec::Lark(grammar.clone())),
            None => Err("constraint is set but has no kind (json_object, json_schema or lark)".into()),
        }
    }
}

impl From<&SampledToken> for worker::SampledToken {
    fn from(t: &SampledToken) -> Self {
        worker::SampledToken {
            id: t.id,
            logprob: t.logprob,
            top_logprobs: t.top_logprobs.iter().map(|&(id, logprob)| worker::TopLogprob { id, logprob }).collect(),
            ..Default::default()
        }
    }
}

impl From<&worker::SampledToken> for SampledToken {
    fn from(t: &worker::SampledToken) -> Self {
        SampledToken { id: t.id, logprob: t.logprob, top_logprobs: t.top_logprobs.iter().map(|t| (t.id, t.logprob)).collect() }
    }
}

impl From<FinishReason> for worker::FinishReason {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Stop => worker::FinishReason::Stop,
            FinishReason::Length => worker::FinishReason::Length,
        }
    }
}

/// A token marked `last` whose reason is unspecified (or unknown to this
/// build): the worker that sent it broke the protocol.
#[derive(Debug)]
pub struct NoFinishReason {
    pub id: u32,
    pub raw: i32,
}

impl std::fmt::Display for NoFinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "its last token {} carries no finish reason this router knows (finish_reason = {})", self.id, self.raw)
    }
}

impl std::error::Error for NoFinishReason {}

impl worker::SampledToken {
    /// `t` for the wire, marked last with `finish` when it ends the request.
    pub fn sampled(t: &SampledToken, finish: Option<FinishReason>) -> Self {
        let mut wire = worker::SampledToken::from(t);
        if let Some(reason) = finish {
            wire.last = true;
            wire.set_finish_reason(reason.into());
        }
        wire
    }

    /// Why the request ends with this token, if the worker marked it last.
    pub fn finish(&self) -> Result<Option<FinishReason>, NoFinishReason> {
        if !self.last {
            return Ok(None);
        }
        match worker::FinishReason::try_from(self.finish_reason) {
            Ok(worker::FinishReason::Stop) => Ok(Some(FinishReason::Stop)),
            Ok(worker::FinishReason::Length) => Ok(Some(FinishReason::Length)),
            Ok(worker::FinishReason::Unspecified) | Err(_) => Err(NoFinishReason { id: self.id, raw: self.finish_reason }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_round_trips() {
        let p = SamplingParams { temperature: 0.7, top_k: 40, top_p: 0.9, min_p: 0.05, repetition_penalty: 1.1, presence_penalty: 0.5, frequency_penalty: -0.5, seed: Some(99), logprobs: Some(3) };
        assert_eq!(SamplingParams::from(&worker::Sampling::from(&p)), p);
        let t = SampledToken { id: 5, logprob: -0.25, top_logprobs: vec![(5, -0.25), (9, -1.5)] };
        assert_eq!(SampledToken::from(&worker::SampledToken::from(&t)), t);
    }

    #[test]
    fn finish_reasons_round_trip_and_a_last_token_needs_one() {
        let t = SampledToken { id: 5, logprob: -0.25, top_logprobs: vec![] };
        assert_eq!(worker::SampledToken::sampled(&t, None).finish().unwrap(), None);
        for reason in [FinishReason::Stop, FinishReason::Length] {
            let wire = worker::SampledToken::sampled(&t, Some(reason));
            assert!(wire.last);
            assert_eq!(wire.finish().unwrap(), Some(reason));
        }
        let unspecified = worker::SampledToken { last: true, ..worker::SampledToken::from(&t) };
        assert!(unspecified.finish().unwrap_err().to_string().contains("no finish reason"));
        let unknown = worker::SampledToken { last: true, finish_reason: 9, ..worker::SampledToken::from(&t) };
        assert_eq!(unknown.finish().unwrap_err().raw, 9);
    }

    #[test]
    fn constraints_round_trip_and_bad_ones_are_named() {
        for c in [ConstraintSpec::JsonObject, ConstraintSpec::JsonSchema(serde_json::json!({"type": "array", "maxItems": 2})), ConstraintSpec::Lark("start: \"a\"".into())] {
            assert_eq!(ConstraintSpec::try_from(&worker::Constraint::from(&c)), Ok(c));
        }
        use worker::constraint::Kind;
        let bad = |kind| ConstraintSpec::try_from(&worker::Constraint { kind }).unwrap_err();
        assert!(bad(Some(Kind::JsonSchema("{".into()))).contains("not JSON"));
        assert!(bad(Some(Kind::JsonObject(false))).contains("json_object is false"));
        assert!(bad(None).contains("no kind"));
    }
}
