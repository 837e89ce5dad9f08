//! What the open loop sends and when: length distributions, prompts from a
//! JSONL file, and Poisson arrival times.

use anyhow::{bail, Context, Result};
use rand::Rng;
use serde::Deserialize;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// A distribution of token counts, written `N`, `uniform:MIN-MAX` or
/// `normal:MEAN,SD`. Draws are rounded and never below 1.
#[derive(Clone, Debug, PartialEq)]
pub enum Dist {
    Fixed(u32),
    Uniform(u32, u32),
    Normal { mean: f64, sd: f64 },
}

const SYNTAX: &str = "expected N, uniform:MIN-MAX or normal:MEAN,SD";

impl FromStr for Dist {
    type Err = String;

    fn from_str(spec: &str) -> Result<Dist, String> {
        let count = |s: &str| -> Result<u32, String> {
            match s.trim().parse::<u32>() {
                Ok(0) => Err(format!("{spec:?}: token counts must be at least 1")),
                Ok(n) => Ok(n),
                Err(_) => Err(format!("{spec:?}: {s:?} is not a token count ({SYNTAX})")),
            }
        };
        let number = |s: &str| -> Result<f64, String> {
            s.trim().parse::<f64>().ok().filter(|x| x.is_finite()).ok_or_else(|| format!("{spec:?}: {s:?} is not a number ({SYNTAX})"))
        };
        match spec.split_once(':') {
            None => Ok(Dist::Fixed(count(spec)?)),
            Some(("uniform", range)) => {
                let (lo, hi) = range.split_once('-').ok_or_else(|| format!("{spec:?}: {SYNTAX}"))?;
                let (lo, hi) = (count(lo)?, count(hi)?);
                if lo > hi {
                    return Err(format!("{spec:?}: MIN must not exceed MAX"));
                }
                Ok(Dist::Uniform(lo, hi))
            }
            Some(("normal", params)) => {
                let (mean, sd) = params.split_once(',').ok_or_else(|| format!("{spec:?}: {SYNTAX}"))?;
                let (mean, sd) = (number(mean)?, number(sd)?);
                if mean < 1.0 {
                    return Err(format!("{spec:?}: MEAN must be at least 1"));
                }
                if sd < 0.0 {
                    return Err(format!("{spec:?}: SD must not be negative"));
                }
                Ok(Dist::Normal { mean, sd })
            }
            Some((name, _)) => Err(format!("{spec:?}: unknown distribution {name:?} ({SYNTAX})")),
        }
    }
}

impl fmt::Display for Dist {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Dist::Fixed(n) => write!(f, "{n}"),
            Dist::Uniform(lo, hi) => write!(f, "uniform:{lo}-{hi}"),
            Dist::Normal { mean, sd } => write!(f, "normal:{mean},{sd}"),
        }
    }
}

impl Dist {
    pub fn sample(&self, rng: &mut impl Rng) -> u32 {
        match *self {
            Dist::Fixed(n) => n,
            Dist::Uniform(lo, hi) => rng.gen_range(lo..=hi),
            Dist::Normal { mean, sd } => {
                // Box–Muller; 1 - u keeps the logarithm finite.
                let (u, v): (f64, f64) = (rng.gen(), rng.gen());
                let z = (-2.0 * (1.0 - u).ln()).sqrt() * (std::f64::consts::TAU * v).cos();
                (mean + sd * z).round().clamp(1.0, f64::from(u32::MAX)) as u32
            }
        }
    }
}

/// A prompt from `--prompts`: one JSON object per line.
#[derive(Clone, Debug, PartialEq)]
pub struct FilePrompt {
    pub prompt: PromptKind,
    /// Absent: drawn from `--output-tokens`.
    pub max_tokens: Option<u32>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum PromptKind {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Deserialize)]
struct Line {
    prompt: Option<String>,
    tokens: Option<Vec<u32>>,
    max_tokens: Option<u32>,
}

/// Read a JSONL prompt file: lines `{"prompt": "...", "max_tokens": N}` or
/// `{"tokens": [1, 2, 3]}`; blank lines are skipped, other fields ignored.
pub fn read_prompts(path: &Path) -> Result<Vec<FilePrompt>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut prompts = vec![];
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = || format!("{} line {}", path.display(), i + 1);
        let line: Line = serde_json::from_str(line).with_context(at)?;
        let prompt = match (line.prompt, line.tokens) {
            (Some(text), None) if !text.is_empty() => PromptKind::Text(text),
            (None, Some(ids)) if !ids.is_empty() => PromptKind::Tokens(ids),
            (Some(_), Some(_)) | (None, None) => bail!("{}: give one of \"prompt\" (text) or \"tokens\" (ids)", at()),
            _ => bail!("{}: the prompt is empty", at()),
        };
        if line.max_tokens == Some(0) {
            bail!("{}: max_tokens must be at least 1", at());
        }
        prompts.push(FilePrompt { prompt, max_tokens: line.max_tokens });
    }
    if prompts.is_empty() {
        bail!("{} has no prompts", path.display());
    }
    Ok(prompts)
}

/// Send times of a Poisson process of `rate` per second, in seconds from the
/// start: the first at 0, then exponential gaps. Stops after `count` arrivals
/// or past `duration` seconds, whichever comes first (one must be given).
pub fn arrivals(rate: f64, count: Option<usize>, duration: Option<f64>, rng: &mut impl Rng) -> Vec<f64> {
    let mut times = vec![];
    let mut t = 0.0;
    while count.is_none_or(|n| times.len() < n) && duration.is_none_or(|d| t < d) && (count.is_some() || duration.is_some()) {
        times.push(t);
        let u: f64 = rng.gen();
        t += -(1.0 - u).ln() / rate;
    }
    times
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn distribution_specs_parse_and_print() {
        for (spec, want) in [
            ("128", Dist::Fixed(128)),
            ("uniform:100-400", Dist::Uniform(100, 400)),
            ("uniform:5-5", Dist::Uniform(5, 5)),
            ("normal:300,50", Dist::Normal { mean: 300.0, sd: 50.0 }),
            ("normal:300.5, 0", Dist::Normal { mean: 300.5, sd: 0.0 }),
        ] {
            assert_eq!(spec.parse::<Dist>(), Ok(want.clone()), "{spec}");
            assert_eq!(want.to_string().parse::<Dist>(), Ok(want));
        }
    }

    #[test]
    fn bad_distribution_specs_are_clear_errors() {
        for (spec, needle) in [
            ("", "is not a token count"),
            ("0", "at least 1"),
            ("-3", "is not a token count"),
            ("abc", "expected N, uniform:MIN-MAX or normal:MEAN,SD"),
            ("uniform:400-100", "MIN must not exceed MAX"),
            ("uniform:100", "expected N, uniform:MIN-MAX"),
            ("uniform:0-5", "at least 1"),
            ("normal:300", "normal:MEAN,SD"),
            ("normal:300,-1", "SD must not be negative"),
            ("normal:x,1", "\"x\" is not a number"),
            ("normal:inf,1", "is not a number"),
            ("poisson:3", "unknown distribution \"poisson\""),
        ] {
            let e = spec.parse::<Dist>().unwrap_err();
            assert!(e.contains(needle), "{spec:?}: {e}");
        }
    }

    #[test]
    fn draws_stay_in_range_and_match_the_mean() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let uniform = Dist::Uniform(100, 400);
        let draws: Vec<u32> = (0..10_000).map(|_| uniform.sample(&mut rng)).collect();
        assert!(draws.iter().all(|&d| (100..=400).contains(&d)));
        assert!(draws.contains(&100) && draws.contains(&400));
        let normal = Dist::Normal { mean: 300.0, sd: 50.0 };
        let draws: Vec<f64> = (0..20_000).map(|_| f64::from(normal.sample(&mut rng))).collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        let sd = (draws.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / draws.len() as f64).sqrt();
        assert!((mean - 300.0).abs() < 2.0 && (sd - 50.0).abs() < 2.0, "mean {mean}, sd {sd}");
        // A wide normal is clamped at 1 token, not wrapped or zero.
        let wide = Dist::Normal { mean: 1.0, sd: 100.0 };
        assert!((0..1000).all(|_| wide.sample(&mut rng) >= 1));
    }

    #[test]
    fn poisson_gaps_have_the_asked_mean() {
        let rate = 4.0;
        let times = arrivals(rate, Some(20_001), None, &mut ChaCha8Rng::seed_from_u64(42));
        assert_eq!(times.len(), 20_001);
        assert_eq!(times[0], 0.0);
        let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
        // Exponential gaps: mean = sd = 1/rate; 20k samples put both within ~2%.
        assert!((mean * rate - 1.0).abs() < 0.03, "mean gap {mean}");
        assert!((sd * rate - 1.0).abs() < 0.05, "gap sd {sd}");
        // The same seed gives the same schedule.
        assert_eq!(arrivals(rate, Some(50), None, &mut ChaCha8Rng::seed_from_u64(42)), times[..50]);
    }

    #[test]
    fn arrivals_stop_at_the_first_limit() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let by_time = arrivals(10.0, None, Some(5.0), &mut rng);
        assert!(by_time.iter().all(|&t| t < 5.0) && (30..80).contains(&by_time.len()), "{}", by_time.len());
        assert_eq!(arrivals(10.0, Some(3), Some(100.0), &mut rng).len(), 3);
        assert!(arrivals(10.0, None, None, &mut rng).is_empty());
    }

    #[test]
    fn prompt_files_read_and_reject_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        std::fs::write(&path, "{\"prompt\": \"Hello\", \"max_tokens\": 8, \"id\": 1}\n\n{\"tokens\": [1, 2, 3]}\n").unwrap();
        let prompts = read_prompts(&path).unwrap();
        assert_eq!(prompts[0], FilePrompt { prompt: PromptKind::Text("Hello".into()), max_tokens: Some(8) });
        assert_eq!(prompts[1], FilePrompt { prompt: PromptKind::Tokens(vec![1, 2, 3]), max_tokens: None });
        for (body, needle) in [
            ("{\"prompt\": \"a\", \"tokens\": [1]}", "line 1: give one of"),
            ("{\"max_tokens\": 3}", "give one of"),
            ("{\"tokens\": []}", "the prompt is empty"),
            ("{\"prompt\": \"a\", \"max_tokens\": 0}", "max_tokens must be at least 1"),
            ("{\"tokens\": [-1]}", "line 1"),
            ("not json", "line 1"),
            ("\n\n", "has no prompts"),
        ] {
            std::fs::write(&path, body).unwrap();
            let e = format!("{:#}", read_prompts(&path).unwrap_err());
            assert!(e.contains(needle), "{body:?}: {e}");
        }
        let e = format!("{:#}", read_prompts(&dir.path().join("missing.jsonl")).unwrap_err());
        assert!(e.contains("cannot read") && e.contains("missing.jsonl"), "{e}");
    }
}
