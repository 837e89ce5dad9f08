//! What `duplex bench` measured: per-request samples, their percentiles, the
//! slowdown of each request kind against its solo baseline, the printed
//! tables and the JSON written by `--out`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write;

/// One request as the client saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// `P` (long prefill) or `D` (decode-heavy) in a scenario; `open` in an open-loop run.
    pub kind: String,
    /// When it was sent, in seconds after its run began.
    pub start_s: f64,
    pub prompt_tokens: u32,
    /// Tokens received.
    pub output_tokens: u32,
    /// Time to the first token; absent if none came.
    pub ttft_ms: Option<f64>,
    /// Mean gap between consecutive tokens after the first; absent with fewer than two.
    pub tpot_ms: Option<f64>,
    /// Until the stream finished (or failed).
    pub e2e_ms: f64,
    /// Which worker prefilled the prompt (`decode` or `prefill`), as the server
    /// reported; in `duplex simulate`, the route (`decode_chunked`, `slp`, `dslp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_path: Option<String>,
    /// The gRPC status code's name, if the request failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A sample and the gaps between its tokens, which feed the TPOT
/// distribution but are too many to keep in the JSON.
pub struct Outcome {
    pub sample: Sample,
    pub gaps_ms: Vec<f64>,
    /// The error's message, for the console.
    pub message: Option<String>,
    /// The tokens generated (a chat resends them).
    pub token_ids: Vec<u32>,
}

/// Mean and percentiles of a set of values.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub n: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Stats {
    /// None for no values (or any non-finite one, which would not survive JSON).
    pub fn of(values: &[f64]) -> Option<Stats> {
        if values.is_empty() || values.iter().any(|v| !v.is_finite()) {
            return None;
        }
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Stats {
            n: sorted.len(),
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            p50: percentile(&sorted, 50.0),
            p90: percentile(&sorted, 90.0),
            p99: percentile(&sorted, 99.0),
        })
    }
}

/// The `q`-th percentile (0..=100) of sorted, non-empty values, interpolating
/// linearly between the two nearest ranks (numpy's default).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    let rank = q.clamp(0.0, 100.0) / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// A kind's mean metrics over those of its solo baseline (1P for P, 1D for D).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slowdown {
    pub ttft: Option<f64>,
    pub tpot: Option<f64>,
    pub e2e: Option<f64>,
}

/// The requests of one kind in one run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KindReport {
    pub kind: String,
    /// Requests sent, failed ones included.
    pub requests: usize,
    pub errors: usize,
    pub ttft_ms: Option<Stats>,
    /// Over every gap between consecutive tokens of the kind's requests.
    pub tpot_ms: Option<Stats>,
    /// Over the requests that succeeded.
    pub e2e_ms: Option<Stats>,
    pub output_tokens: u64,
    /// Set for closed-loop scenarios whose baseline ran.
    pub slowdown: Option<Slowdown>,
}

/// One scenario, or the open-loop run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// `1P`, `1P+2D`, … or `open`.
    pub name: String,
    pub wall_s: f64,
    pub requests: usize,
    /// Failed requests by gRPC code name.
    pub errors: BTreeMap<String, usize>,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub prompt_tokens_per_s: f64,
    pub kinds: Vec<KindReport>,
    pub samples: Vec<Sample>,
}

impl RunReport {
    /// Summarise a run's outcomes; kinds appear in order of first appearance.
    pub fn new(name: &str, outcomes: &[Outcome], wall_s: f64) -> RunReport {
        let mut kinds: Vec<&str> = vec![];
        for o in outcomes {
            if !kinds.contains(&o.sample.kind.as_str()) {
                kinds.push(&o.sample.kind);
            }
        }
        let kinds: Vec<KindReport> = kinds
            .into_iter()
            .map(|kind| {
                let of_kind: Vec<&Outcome> = outcomes.iter().filter(|o| o.sample.kind == kind).collect();
                let ok: Vec<&Sample> = of_kind.iter().map(|o| &o.sample).filter(|s| s.error.is_none()).collect();
                let ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft_ms).collect();
                let gaps: Vec<f64> = of_kind.iter().filter(|o| o.sample.error.is_none()).flat_map(|o| o.gaps_ms.iter().copied()).collect();
                let e2e: Vec<f64> = ok.iter().map(|s| s.e2e_ms).collect();
                KindReport {
                    kind: kind.to_string(),
                    requests: of_kind.len(),
                    errors: of_kind.len() - ok.len(),
                    ttft_ms: Stats::of(&ttft),
                    tpot_ms: Stats::of(&gaps),
                    e2e_ms: Stats::of(&e2e),
                    output_tokens: of_kind.iter().map(|o| u64::from(o.sample.output_tokens)).sum(),
                    slowdown: None,
                }
            })
            .collect();
        let mut errors = BTreeMap::new();
        for e in outcomes.iter().filter_map(|o| o.sample.error.as_ref()) {
            *errors.entry(e.clone()).or_insert(0) += 1;
        }
        let per_s = |n: f64| if wall_s > 0.0 { n / wall_s } else { 0.0 };
        let output: u64 = outcomes.iter().map(|o| u64::from(o.sample.output_tokens)).sum();
        let prompt: u64 = outcomes.iter().filter(|o| o.sample.error.is_none()).map(|o| u64::from(o.sample.prompt_tokens)).sum();
        RunReport {
            name: name.to_string(),
            wall_s,
            requests: outcomes.len(),
            errors,
            requests_per_s: per_s(outcomes.len() as f64),
            output_tokens_per_s: per_s(output as f64),
            prompt_tokens_per_s: per_s(prompt as f64),
            kinds,
            samples: outcomes.iter().map(|o| o.sample.clone()).collect(),
        }
    }

    pub fn kind(&self, kind: &str) -> Option<&KindReport> {
        self.kinds.iter().find(|k| k.kind == kind)
    }
}

/// Set each scenario kind's slowdown against its solo baseline: P against
/// the `1P` run, D against the `1D` run (the paper's Figure 18).
pub fn add_slowdowns(runs: &mut [RunReport]) {
    let baseline = |runs: &[RunReport], run: &str, kind: &str| runs.iter().find(|r| r.name == run).and_then(|r| r.kind(kind)).cloned();
    let baselines = [("P", baseline(runs, "1P", "P")), ("D", baseline(runs, "1D", "D"))];
    for run in runs.iter_mut() {
        for k in &mut run.kinds {
            let Some((_, Some(base))) = baselines.iter().find(|(kind, _)| *kind == k.kind) else { continue };
            let ratio = |now: &Option<Stats>, then: &Option<Stats>| match (now, then) {
                (Some(a), Some(b)) if b.mean > 0.0 => Some(a.mean / b.mean),
                _ => None,
            };
            k.slowdown = Some(Slowdown { ttft: ratio(&k.ttft_ms, &base.ttft_ms), tpot: ratio(&k.tpot_ms, &base.tpot_ms), e2e: ratio(&k.e2e_ms, &base.e2e_ms) });
        }
    }
}

/// How the closed-loop requests were sized.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClosedLoop {
    pub long_prompt_tokens: u32,
    pub long_output_tokens: u32,
    pub short_prompt_tokens: u32,
    pub decode_tokens: u32,
    pub scenario_seconds: f64,
    /// The solo probes that chose `decode_tokens`; absent when it was given.
    pub calibration: Option<Calibration>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// P alone, end to end.
    pub long_e2e_ms: f64,
    /// A short decode probe alone (64 tokens), which gives the first guess.
    pub short_ttft_ms: f64,
    pub short_tpot_ms: f64,
    /// D with the first guess's output tokens alone, which corrects it.
    pub guess_tokens: u32,
    pub guess_e2e_ms: f64,
}

/// How the open-loop requests were drawn.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpenLoop {
    pub rate: f64,
    pub duration_s: Option<f64>,
    pub requests: Option<usize>,
    /// Length specs (`128`, `uniform:100-400`, `normal:300,50`).
    pub prompt_tokens: String,
    pub output_tokens: String,
    pub prompts_file: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Workload {
    Closed(ClosedLoop),
    Open(OpenLoop),
    Chat(super::chat::Chat),
}

/// Everything `duplex bench --out` writes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub target: String,
    pub model: String,
    pub context_length: u32,
    pub seed: u64,
    pub workload: Workload,
    pub runs: Vec<RunReport>,
}

impl Report {
    pub fn to_json(&self) -> serde_json::Result<String> {
        serde_json::to_string_pretty(self)
    }

    #[cfg(test)]
    pub fn from_json(text: &str) -> serde_json::Result<Report> {
        serde_json::from_str(text)
    }

    /// The tables `duplex bench` prints, in Markdown: latency per run and
    /// request kind, then throughput and errors per run.
    pub fn tables(&self) -> String {
        let mut out = String::new();
        let closed = matches!(self.workload, Workload::Closed(_));
        let _ = writeln!(out, "| scenario | kind | requests | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | e2e mean (ms) | slowdown | e2e slowdown |");
        let _ = writeln!(out, "| --- | --- | --- | --- | --- | --- | --- | --- |");
        for run in &self.runs {
            for k in &run.kinds {
                let requests = if k.errors > 0 { format!("{} ({} failed)", k.requests, k.errors) } else { k.requests.to_string() };
                // The paper's headline metric per kind: TTFT for prefill, TPOT for decode.
                let slowdown = match (&k.slowdown, k.kind.as_str()) {
                    (Some(s), "P") => s.ttft.map(|x| format!("{x:.2}× TTFT")),
                    (Some(s), "D") => s.tpot.map(|x| format!("{x:.2}× TPOT")),
                    _ => None,
                };
                let e2e_slowdown = k.slowdown.as_ref().and_then(|s| s.e2e).map(|x| format!("{x:.2}×"));
                let _ = writeln!(
                    out,
                    "| {} | {} | {requests} | {} | {} | {} | {} | {} |",
                    run.name,
                    k.kind,
                    triple(&k.ttft_ms),
                    triple(&k.tpot_ms),
                    k.e2e_ms.map(|s| ms(s.mean)).unwrap_or_else(dash),
                    slowdown.unwrap_or_else(|| if closed { dash() } else { "n/a".into() }),
                    e2e_slowdown.unwrap_or_else(|| if closed { dash() } else { "n/a".into() }),
                );
            }
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "| scenario | requests | errors | wall (s) | requests/s | output tokens/s | prompt tokens/s |");
        let _ = writeln!(out, "| --- | --- | --- | --- | --- | --- | --- |");
        for run in &self.runs {
            let errors = if run.errors.is_empty() {
                "0".to_string()
            } else {
                run.errors.iter().map(|(code, n)| format!("{n} {code}")).collect::<Vec<_>>().join(", ")
            };
            let _ = writeln!(
                out,
                "| {} | {} | {errors} | {:.2} | {:.2} | {:.1} | {:.1} |",
                run.name, run.requests, run.wall_s, run.requests_per_s, run.output_tokens_per_s, run.prompt_tokens_per_s
            );
        }
        if let Workload::Chat(chat) = &self.workload {
            let _ = writeln!(out);
            out += &chat.table();
        }
        out
    }
}

fn dash() -> String {
    "–".into()
}

/// Milliseconds with about three significant digits.
pub fn ms(v: f64) -> String {
    match v {
        v if v >= 100.0 => format!("{v:.0}"),
        v if v >= 10.0 => format!("{v:.1}"),
        v => format!("{v:.2}"),
    }
}

fn triple(s: &Option<Stats>) -> String {
    s.map(|s| format!("{} / {} / {}", ms(s.p50), ms(s.p90), ms(s.p99))).unwrap_or_else(dash)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(kind: &str, ttft: f64, e2e: f64, tokens: u32, error: Option<&str>) -> Sample {
        Sample {
            kind: kind.into(),
            start_s: 0.25,
            prompt_tokens: 16,
            output_tokens: tokens,
            ttft_ms: Some(ttft),
            tpot_ms: (tokens > 1).then(|| (e2e - ttft) / f64::from(tokens - 1)),
            e2e_ms: e2e,
            prefill_path: Some("decode".into()),
            error: error.map(String::from),
        }
    }

    fn outcome(kind: &str, ttft: f64, gap: f64, tokens: u32) -> Outcome {
        let e2e = ttft + gap * f64::from(tokens - 1);
        Outcome { sample: sample(kind, ttft, e2e, tokens, None), gaps_ms: vec![gap; tokens as usize - 1], message: None, token_ids: vec![] }
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert!((percentile(&v, 50.0) - 50.5).abs() < 1e-12);
        assert!((percentile(&v, 90.0) - 90.1).abs() < 1e-12);
        assert!((percentile(&v, 99.0) - 99.01).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        let s = Stats::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.n, s.mean, s.p50), (3, 2.0, 2.0));
        assert!(Stats::of(&[]).is_none());
        assert!(Stats::of(&[1.0, f64::NAN]).is_none());
    }

    #[test]
    fn slowdowns_are_against_the_solo_runs() {
        let mut runs = vec![
            RunReport::new("1P", &[outcome("P", 100.0, 1.0, 2)], 1.0),
            RunReport::new("1D", &[outcome("D", 5.0, 2.0, 50)], 1.0),
            RunReport::new("1P+1D", &[outcome("P", 150.0, 1.0, 2), outcome("D", 5.0, 3.0, 50)], 1.0),
        ];
        add_slowdowns(&mut runs);
        let mix = &runs[2];
        assert!((mix.kind("P").unwrap().slowdown.as_ref().unwrap().ttft.unwrap() - 1.5).abs() < 1e-12);
        assert!((mix.kind("D").unwrap().slowdown.as_ref().unwrap().tpot.unwrap() - 1.5).abs() < 1e-12);
        assert_eq!(runs[0].kind("P").unwrap().slowdown.as_ref().unwrap().ttft, Some(1.0));
        let tables = Report {
            target: "http://x".into(),
            model: "m".into(),
            context_length: 1024,
            seed: 0,
            workload: Workload::Closed(ClosedLoop {
                long_prompt_tokens: 900,
                long_output_tokens: 1,
                short_prompt_tokens: 16,
                decode_tokens: 50,
                scenario_seconds: 1.0,
                calibration: None,
            }),
            runs,
        }
        .tables();
        assert!(tables.contains("| 1P+1D | P | 1 | 150 / 150 / 150 | 1.00 / 1.00 / 1.00 | 151 | 1.50× TTFT | 1.50× |"), "{tables}");
        assert!(tables.contains("| 1P+1D | D | 1 | 5.00 / 5.00 / 5.00 | 3.00 / 3.00 / 3.00 | 152 | 1.50× TPOT |"), "{tables}");
    }

    #[test]
    fn errors_are_counted_by_code_and_left_out_of_latencies() {
        let failed = Outcome { sample: sample("open", 1.0, 2000.0, 0, Some("ResourceExhausted")), gaps_ms: vec![], message: Some("full".into()), token_ids: vec![] };
        let run = RunReport::new("open", &[outcome("open", 10.0, 2.0, 11), failed], 2.0);
        assert_eq!(run.errors.get("ResourceExhausted"), Some(&1));
        let k = run.kind("open").unwrap();
        assert_eq!((k.requests, k.errors, k.e2e_ms.unwrap().n), (2, 1, 1));
        assert_eq!(k.e2e_ms.unwrap().mean, 30.0);
        assert_eq!(run.requests_per_s, 1.0);
    }

    #[test]
    fn json_round_trips() {
        let mut runs = vec![
            RunReport::new("1P", &[outcome("P", 812.3456789, 0.1, 2)], 1.0 / 3.0),
            RunReport::new("1D", &[outcome("D", 4.2, 1.2345678901234, 300)], 0.7),
        ];
        runs[1].samples[0].prefill_path = None;
        add_slowdowns(&mut runs);
        for workload in [
            Workload::Closed(ClosedLoop {
                long_prompt_tokens: 900,
                long_output_tokens: 1,
                short_prompt_tokens: 16,
                decode_tokens: 300,
                scenario_seconds: 3.0,
                calibration: Some(Calibration { long_e2e_ms: 850.1, short_ttft_ms: 4.0, short_tpot_ms: 1.3, guess_tokens: 650, guess_e2e_ms: 1001.25 }),
            }),
            Workload::Open(OpenLoop {
                rate: 2.5,
                duration_s: None,
                requests: Some(10),
                prompt_tokens: "uniform:100-400".into(),
                output_tokens: "normal:300,50".into(),
                prompts_file: Some("p.jsonl".into()),
            }),
        ] {
            let report = Report { target: "http://127.0.0.1:50051".into(), model: "tiny".into(), context_length: 1024, seed: 7, workload, runs: runs.clone() };
            let json = report.to_json().unwrap();
            assert_eq!(Report::from_json(&json).unwrap(), report, "{json}");
        }
    }
}
