//! Stop strings over streamed text: holds back text that might be the start
//! of a stop string, and finds stop strings that span token boundaries.
//!
//! Shared by the single-request engine (`duplex_model::generation`) and the
//! router, which applies stop strings to the tokens the workers stream.

/// Matches stop strings against text that arrives in pieces.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Generated text so far (after the last emitted byte, held-back text).
    text: String,
    emitted: usize,
}

impl StopStrings {
    /// A matcher for `stops`. Empty stop strings would match everywhere;
    /// callers reject them before they get here.
    pub fn new(stops: Vec<String>) -> Self {
        StopStrings { stops, text: String::new(), emitted: 0 }
    }

    /// Add decoded text; returns the text now safe to emit and whether a stop
    /// string was hit (in which case the text is cut before it).
    pub fn push(&mut self, delta: &str) -> (String, bool) {
        let search_from = self.emitted;
        self.text.push_str(delta);
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.text[search_from..].find(s.as_str()).map(|i| search_from + i))
            .min();
        if let Some(cut) = hit {
            self.text.truncate(cut);
            return (self.take(cut), true);
        }
        // Keep back the longest suffix that is a proper prefix of a stop string.
        let held = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(|&k| s.is_char_boundary(k)).map(move |k| &s[..k]))
            .filter(|p| self.text[self.emitted..].ends_with(p))
            .map(|p| p.len())
            .max()
            .unwrap_or(0);
        let upto = self.text.len() - held;
        (self.take(upto), false)
    }

    fn take(&mut self, upto: usize) -> String {
        let out = self.text[self.emitted..upto].to_string();
        self.emitted = upto;
        out
    }

    /// At the end: everything not yet emitted.
    pub fn finish(&mut self) -> String {
        let end = self.text.len();
        self.take(end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for d in deltas {
            let (t, hit) = s.push(d);
            out.push_str(&t);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&s.finish());
        (out, false)
    }

    #[test]
    fn stop_string_across_deltas_is_cut() {
        assert_eq!(run(&["END"], &["hello E", "N", "D more"]), ("hello ".into(), true));
        assert_eq!(run(&["\n\n", "xyz"], &["a\n", "\nb"]), ("a".into(), true));
    }

    #[test]
    fn held_back_prefix_is_released_when_it_diverges() {
        let mut s = StopStrings::new(vec!["END".to_string()]);
        assert_eq!(s.push("abc E"), ("abc ".into(), false));
        assert_eq!(s.push("Nx"), ("ENx".into(), false));
        assert_eq!(run(&["END"], &["a", "EN"]), ("aEN".into(), false));
    }

    #[test]
    fn multibyte_stop_strings() {
        assert_eq!(run(&["世界"], &["你好世", "界!"]), ("你好".into(), true));
        assert_eq!(run(&["🙂"], &["ok 🙂 no"]), ("ok ".into(), true));
    }

    #[test]
    fn no_stops_passes_everything_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }
}
