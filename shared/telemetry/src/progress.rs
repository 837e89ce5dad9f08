//! Progress of long, silent work (filling a weight segment from a 650 GB
//! checkpoint takes many minutes): a bar on a terminal, and otherwise a log
//! line every few seconds, each with bytes done, rate and time left.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// How often a log line is written when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(5);

pub struct ByteProgress {
    what: String,
    started: Instant,
    last_log: Instant,
    bar: Option<indicatif::ProgressBar>,
}

impl ByteProgress {
    /// `what` names the work in the log lines ("building the weight segment").
    pub fn new(what: &str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(0);
            let style = indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}, {eta} left")
                .expect("the template is valid")
                .progress_chars("=> ");
            bar.set_style(style);
            bar.set_message(what.to_string());
            bar
        });
        let now = Instant::now();
        ByteProgress { what: what.to_string(), started: now, last_log: now, bar }
    }

    pub fn update(&mut self, done: u64, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total);
            bar.set_position(done);
            return;
        }
        if self.last_log.elapsed() >= LOG_EVERY || (done == total && self.started.elapsed() >= LOG_EVERY) {
            self.last_log = Instant::now();
            tracing::info!("{}", line(&self.what, done, total, self.started.elapsed()));
        }
    }

    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}

/// "what: 1.2 GiB of 650.0 GiB (0.2%), 1.1 GiB/s, about 9m50s left".
pub fn line(what: &str, done: u64, total: u64, elapsed: Duration) -> String {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let rate = done as f64 / elapsed.as_secs_f64().max(1e-3);
    let percent = if total == 0 { 100.0 } else { 100.0 * done as f64 / total as f64 };
    let left = if rate > 0.0 { total.saturating_sub(done) as f64 / rate } else { f64::INFINITY };
    let left = if left.is_finite() { format!("{}m{:02}s", (left as u64) / 60, (left as u64) % 60) } else { "unknown".into() };
    format!("{what}: {:.1} GiB of {:.1} GiB ({percent:.1}%), {:.2} GiB/s, about {left} left", gib(done as f64), gib(total as f64), gib(rate))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_line_has_bytes_rate_and_time_left() {
        let l = super::line("building", 1 << 30, 4 << 30, std::time::Duration::from_secs(2));
        assert_eq!(l, "building: 1.0 GiB of 4.0 GiB (25.0%), 0.50 GiB/s, about 0m06s left");
    }
}
