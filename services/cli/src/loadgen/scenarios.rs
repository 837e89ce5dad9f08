//! The closed-loop scenarios of §4.5 of the cloud-grade-SLO paper (its
//! Figure 18): a long prefill request P and a decode-heavy request D, each
//! lasting about as long when alone, run alone (1P, 1D: the baselines) and
//! together (1P+1D, 2D, 1P+2D).

use super::report::{Calibration, Outcome};
use super::{random_prompt, send, Client, Shape};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// One long prompt, one or two output tokens.
    P,
    /// A short prompt, many output tokens.
    D,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::P => "P",
            Kind::D => "D",
        }
    }
}

/// The requests a scenario keeps in flight, one slot each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scenario {
    pub name: &'static str,
    pub slots: &'static [Kind],
}

/// In the paper's order: the two baselines first.
pub const ALL: [Scenario; 5] = [
    Scenario { name: "1P", slots: &[Kind::P] },
    Scenario { name: "1D", slots: &[Kind::D] },
    Scenario { name: "1P+1D", slots: &[Kind::P, Kind::D] },
    Scenario { name: "2D", slots: &[Kind::D, Kind::D] },
    Scenario { name: "1P+2D", slots: &[Kind::P, Kind::D, Kind::D] },
];

/// `--scenario`: names separated by commas, or `all`. Parsed into the
/// paper's order, with the solo baselines the mixes need added in front.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenarios(pub Vec<Scenario>);

impl FromStr for Scenarios {
    type Err = String;

    fn from_str(spec: &str) -> Result<Scenarios, String> {
        let names: Vec<String> = ALL.iter().map(|s| s.name.to_string()).collect();
        let mut wanted = vec![];
        for part in spec.split(',').map(str::trim) {
            if part.eq_ignore_ascii_case("all") {
                wanted.extend(ALL);
                continue;
            }
            let Some(s) = ALL.iter().find(|s| s.name.eq_ignore_ascii_case(part)) else {
                return Err(format!("unknown scenario {part:?}; the scenarios are {}, or all", names.join(", ")));
            };
            wanted.push(*s);
            // A mix is compared with its kinds alone.
            for kind in s.slots {
                wanted.push(ALL[if *kind == Kind::P { 0 } else { 1 }]);
            }
        }
        Ok(Scenarios(ALL.iter().filter(|s| wanted.contains(s)).copied().collect()))
    }
}

/// The shapes of P and D.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub p: Shape,
    pub d: Shape,
}

impl Sizes {
    fn shape(&self, kind: Kind) -> Shape {
        match kind {
            Kind::P => self.p,
            Kind::D => self.d,
        }
    }
}

/// One request of `shape` alone, with a fresh random prompt.
async fn probe(client: &Client, vocab: u32, shape: Shape, rng: &mut ChaCha8Rng, what: &str) -> Result<Outcome> {
    let outcome = send(client, "probe", random_prompt(rng, vocab, shape), Instant::now()).await;
    if let Some(code) = &outcome.sample.error {
        bail!("the {what} failed ({code}); is the server healthy?");
    }
    Ok(outcome)
}

/// Pick D's output length so that D alone lasts about as long as P alone,
/// capped by the context: time P once, guess from the token rate of a short
/// decode, then time D at the guess and scale it. The second step matters
/// because a decode step slows down as the context grows.
pub async fn calibrate(client: &Client, vocab: u32, context: u32, p: Shape, d_prompt: u32, rng: &mut ChaCha8Rng) -> Result<(u32, Calibration)> {
    let room = context.saturating_sub(d_prompt).max(2);
    let tokens = |x: f64| x.round().clamp(2.0, f64::from(room)) as u32;
    // Warm up first: the first request may pay for lazy setup on the server.
    probe(client, vocab, Shape { prompt: d_prompt, output: 4.min(room) }, rng, "warm-up request").await?;
    let long = probe(client, vocab, p, rng, "probe of P").await?.sample.e2e_ms;
    let short = probe(client, vocab, Shape { prompt: d_prompt, output: 64.min(room) }, rng, "decode probe").await?;
    let (Some(ttft), Some(tpot)) = (short.sample.ttft_ms, short.sample.tpot_ms) else {
        bail!("the decode probe returned too few tokens to time; set --decode-tokens");
    };
    let guess = tokens(1.0 + (long - ttft) / tpot.max(1e-3));
    let at_guess = probe(client, vocab, Shape { prompt: d_prompt, output: guess }, rng, "probe of D").await?.sample.e2e_ms;
    let n = tokens(f64::from(guess) * long / at_guess.max(1e-3));
    Ok((n, Calibration { long_e2e_ms: long, short_ttft_ms: ttft, short_tpot_ms: tpot, guess_tokens: guess, guess_e2e_ms: at_guess }))
}

/// Run a scenario: every slot sends its kind of request, and again as soon
/// as it finishes, until `seconds` have passed (each slot sends at least
/// one). Requests in flight at the deadline run to their end.
pub async fn run(client: &Client, vocab: u32, scenario: Scenario, sizes: Sizes, seconds: f64, seed: u64) -> Result<(Vec<Outcome>, f64)> {
    let bar = ProgressBar::new((seconds * 10.0).ceil() as u64).with_prefix(scenario.name);
    bar.set_style(ProgressStyle::with_template("{prefix:>6} [{bar:30}] {elapsed:>3} {msg}").expect("valid template"));
    let (done, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let slots: Vec<_> = scenario
        .slots
        .iter()
        .enumerate()
        .map(|(i, &kind)| {
            let (client, bar, done, failed) = (client.clone(), bar.clone(), done.clone(), failed.clone());
            // Each slot its own stream of prompts, so results do not depend on scheduling.
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((i as u64 + 1) << 32));
            tokio::spawn(async move {
                let mut outcomes = vec![];
                while outcomes.is_empty() || Instant::now() < deadline {
                    let outcome = send(&client, kind.name(), random_prompt(&mut rng, vocab, sizes.shape(kind)), start).await;
                    if outcome.sample.error.is_some() {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                    bar.set_message(format!("{} done, {} failed", done.load(Ordering::Relaxed), failed.load(Ordering::Relaxed)));
                    outcomes.push(outcome);
                }
                outcomes
            })
        })
        .collect();
    let ticker = {
        let bar = bar.clone();
        tokio::spawn(async move {
            loop {
                bar.set_position((start.elapsed().as_secs_f64() * 10.0) as u64);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    // In slot order, so that P comes before D in the report.
    let mut outcomes = vec![];
    for slot in slots {
        outcomes.extend(slot.await.context("a scenario's request loop failed")?);
    }
    ticker.abort();
    bar.finish_and_clear();
    Ok((outcomes, start.elapsed().as_secs_f64()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(spec: &str) -> Vec<&'static str> {
        spec.parse::<Scenarios>().unwrap().0.iter().map(|s| s.name).collect()
    }

    #[test]
    fn scenario_lists_parse_with_their_baselines() {
        assert_eq!(names("all"), ["1P", "1D", "1P+1D", "2D", "1P+2D"]);
        assert_eq!(names("1P"), ["1P"]);
        assert_eq!(names("2d"), ["1D", "2D"]);
        assert_eq!(names("1P+2D,1P"), ["1P", "1D", "1P+2D"]);
        let e = "3D".parse::<Scenarios>().unwrap_err();
        assert!(e.contains("unknown scenario \"3D\"") && e.contains("1P, 1D, 1P+1D, 2D, 1P+2D, or all"), "{e}");
    }
}
