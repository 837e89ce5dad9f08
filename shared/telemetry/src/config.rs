//! Where every process's settings come from: one mechanism (figment) for the
//! router, the decode worker and the prefill worker. Each later source
//! overrides the earlier ones, key by key:
//! 1. the defaults (the config struct's `Default`);
//! 2. the process's `[section]` of the TOML config file (`--config`);
//! 3. environment variables `DUPLEX_<SECTION>_<KEY>` (`DUPLEX_DECODE_MAX_BATCH_SIZE`),
//!    after any older alias of a key (`DUPLEX_API_KEY`);
//! 4. command-line flags, those the user gave.
//!
//! Unknown keys, sections and variables are errors, and every error names the
//! key, where its value came from (file, variable or flag) and the problem.

use figment::error::Kind;
use figment::providers::{Format, Toml};
use figment::value::{Dict, Map, Tag, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::Path;

/// The sections of the config file: one per process.
pub const SECTIONS: [&str; 3] = ["router", "decode", "prefill"];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{0}")]
    Invalid(String),
}

/// Names of the sources, as `describe` tells them apart.
const DEFAULTS: &str = "the defaults";
const ENVIRONMENT: &str = "environment";
const FLAGS: &str = "command-line flags";

/// One process's settings, source by source; [`Layers::extract`] merges them.
#[derive(Debug)]
pub struct Layers {
    section: &'static str,
    figment: Figment,
}

impl Layers {
    /// The defaults of section `section` (one of [`SECTIONS`]).
    pub fn new<T: Serialize + Default>(section: &'static str) -> Layers {
        let defaults = Layer { name: DEFAULTS, section, values: to_dict(&T::default()) };
        Layers { section, figment: Figment::from(defaults) }
    }

    /// Adds the section of the TOML file at `path`. A file that cannot be
    /// read or parsed, or that has a section of no process, is an error.
    pub fn file(mut self, path: Option<&Path>) -> Result<Layers, ConfigError> {
        let Some(path) = path else { return Ok(self) };
        std::fs::File::open(path).map_err(|source| ConfigError::Io { path: path.display().to_string(), source })?;
        let file = Figment::from(Toml::file_exact(path));
        let data = file.data().map_err(|e| ConfigError::Invalid(format!("config file {}: {}", path.display(), e.kind)))?;
        if let Some(other) = data.get(&Profile::Default).into_iter().flat_map(|d| d.keys()).find(|k| !SECTIONS.contains(&k.as_str())) {
            return Err(ConfigError::Invalid(format!("config file {}: unknown section [{other}]; expected one of {SECTIONS:?}", path.display())));
        }
        self.figment = self.figment.merge(file);
        Ok(self)
    }

    /// Adds the process's environment: first each `(variable, key)` of
    /// `aliases` that is set, then every `DUPLEX_<SECTION>_<KEY>`.
    pub fn env(self, aliases: &[(&'static str, &str)]) -> Result<Layers, ConfigError> {
        let mut vars = Vec::new();
        for (name, value) in std::env::vars_os() {
            let name = name.to_string_lossy().into_owned();
            let wanted = name.starts_with(&self.env_prefix()) || aliases.iter().any(|(alias, _)| *alias == name);
            if wanted {
                let value = value.into_string().map_err(|_| ConfigError::Invalid(format!("environment variable {name}: not valid UTF-8")))?;
                vars.push((name, value));
            }
        }
        Ok(self.env_from(vars, aliases))
    }

    /// `env` with the variables given (tests do not touch the process's own).
    pub fn env_from(mut self, vars: impl IntoIterator<Item = (String, String)>, aliases: &[(&'static str, &str)]) -> Layers {
        let vars: Vec<(String, String)> = vars.into_iter().collect();
        let defaults = self.figment.find_value(self.section).ok().and_then(|v| v.into_dict()).unwrap_or_default();
        for &(alias, key) in aliases {
            if let Some((_, raw)) = vars.iter().find(|(name, _)| name == alias) {
                let values = Dict::from([(key.to_string(), typed(raw, defaults.get(key)))]);
                self.figment = self.figment.merge(Layer { name: alias, section: self.section, values });
            }
        }
        let prefix = self.env_prefix();
        let values: Dict = vars
            .iter()
            .filter_map(|(name, raw)| name.strip_prefix(&prefix).map(|key| (key.to_ascii_lowercase(), raw)))
            .map(|(key, raw)| {
                let value = typed(raw, defaults.get(&key));
                (key, value)
            })
            .collect();
        self.figment = self.figment.merge(Layer { name: ENVIRONMENT, section: self.section, values });
        self
    }

    /// Adds the flags the user gave: `flags` serialized, its `None` fields
    /// (flags not given) left out.
    pub fn flags(mut self, flags: &impl Serialize) -> Layers {
        let mut values = to_dict(flags);
        values.retain(|_, v| !matches!(v, Value::Empty(..)));
        self.figment = self.figment.merge(Layer { name: FLAGS, section: self.section, values });
        self
    }

    /// The merged settings.
    pub fn extract<T: DeserializeOwned>(&self) -> Result<T, ConfigError> {
        self.figment.extract_inner(self.section).map_err(|e| ConfigError::Invalid(self.explain(e)))
    }

    /// Where the value of `key` came from: "config file duplex.toml",
    /// "environment variable DUPLEX_ROUTER_HTTP_PORT", "flag --http-port" or
    /// "the defaults". Validation errors quote it.
    pub fn source_of(&self, key: &str) -> String {
        match self.figment.find_metadata(&format!("{}.{key}", self.section)) {
            Some(metadata) => describe(metadata, self.section, key),
            None => DEFAULTS.into(),
        }
    }

    /// "invalid <section> setting `key` (from <source>): <problem>".
    pub fn invalid(&self, key: &str, problem: impl std::fmt::Display) -> ConfigError {
        ConfigError::Invalid(format!("invalid {} setting `{key}` (from {}): {problem}", self.section, self.source_of(key)))
    }

    fn env_prefix(&self) -> String {
        format!("DUPLEX_{}_", self.section.to_ascii_uppercase())
    }

    /// One line per error, each naming the key and the source of its value.
    fn explain(&self, error: figment::Error) -> String {
        let lines: Vec<String> = error
            .into_iter()
            .map(|e| {
                // The key is the error's path below the section (figment
                // adds the section at the end), and for an unknown field the
                // field itself.
                let mut path: Vec<&str> = e.path.iter().map(String::as_str).collect();
                if path.last() == Some(&self.section) {
                    path.pop();
                }
                if path.first() == Some(&self.section) {
                    path.remove(0);
                }
                if let Kind::UnknownField(field, _) = &e.kind {
                    if path.last() != Some(&field.as_str()) {
                        path.push(field);
                    }
                }
                let key = path.join(".");
                let source = e.metadata.as_ref().map(|m| describe(m, self.section, &key)).unwrap_or_else(|| "the settings".into());
                match key.is_empty() {
                    true => format!("[{}] from {source}: {}", self.section, e.kind),
                    false => format!("`{}.{key}` from {source}: {}", self.section, e.kind),
                }
            })
            .collect();
        lines.join("\n")
    }
}

/// Names the source of `key`'s value, as precisely as the user set it.
fn describe(metadata: &Metadata, section: &str, key: &str) -> String {
    match (&metadata.source, metadata.name.as_ref()) {
        (Some(figment::Source::File(path)), _) => format!("config file {}", path.display()),
        (_, ENVIRONMENT) => format!("environment variable DUPLEX_{}_{}", section.to_ascii_uppercase(), key.to_ascii_uppercase()),
        (_, FLAGS) => format!("flag --{}", key.replace('_', "-")),
        (_, DEFAULTS) => DEFAULTS.into(),
        (_, alias) => format!("environment variable {alias}"),
    }
}

/// An environment variable's text as the value its key holds: a number or a
/// boolean where the default is one, a comma-separated list where it is a
/// list, else the text (a value of the wrong type is then named at extraction).
fn typed(raw: &str, default: Option<&Value>) -> Value {
    let parsed = match default {
        Some(Value::Num(..)) => raw.trim().parse::<u64>().map(Value::from).or_else(|_| raw.trim().parse::<i64>().map(Value::from)).or_else(|_| raw.trim().parse::<f64>().map(Value::from)).ok(),
        Some(Value::Bool(..)) => raw.trim().parse::<bool>().map(Value::from).ok(),
        Some(Value::Array(..)) => Some(Value::from(raw.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect::<Vec<_>>())),
        _ => None,
    };
    parsed.unwrap_or_else(|| Value::from(raw.to_string()))
}

/// `value` serialized into a figment dictionary (empty if it is no struct).
fn to_dict(value: &impl Serialize) -> Dict {
    Value::serialize(value).ok().and_then(Value::into_dict).unwrap_or_default()
}

/// Values of one section from one source.
struct Layer {
    name: &'static str,
    section: &'static str,
    values: Dict,
}

impl Provider for Layer {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.name)
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let section = Dict::from([(self.section.to_string(), Value::Dict(Tag::Default, self.values.clone()))]);
        Ok(Map::from([(Profile::Default, section)]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, serde::Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Settings {
        port: u16,
        name: String,
        ratio: f64,
        on: bool,
        origins: Vec<String>,
        key: Option<String>,
    }

    impl Default for Settings {
        fn default() -> Self {
            Settings { port: 1, name: "a".into(), ratio: 0.5, on: true, origins: Vec::new(), key: None }
        }
    }

    #[derive(Default, Serialize)]
    struct Flags {
        port: Option<u16>,
        name: Option<String>,
    }

    fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
        vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn file(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("duplex.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    fn load(toml: &str, vars: &[(&str, &str)], flags: Flags) -> Result<(Settings, Layers), String> {
        let (_dir, path) = file(toml);
        let layers = Layers::new::<Settings>("decode").file(Some(&path)).map_err(|e| e.to_string())?.env_from(env(vars), &[("DUPLEX_KEY", "key")]).flags(&flags);
        let settings = layers.extract::<Settings>().map_err(|e| e.to_string())?;
        Ok((settings, layers))
    }

    #[test]
    fn each_source_overrides_the_one_before() {
        let (s, layers) = load("", &[], Flags::default()).unwrap();
        assert_eq!(s, Settings::default());
        assert_eq!(layers.source_of("port"), "the defaults");

        let toml = "[decode]\nport = 2\nname = \"file\"\n[router]\nport = 9\n";
        let (s, layers) = load(toml, &[], Flags::default()).unwrap();
        assert_eq!((s.port, s.name.as_str()), (2, "file"));
        assert!(layers.source_of("port").starts_with("config file ") && layers.source_of("port").ends_with("duplex.toml"), "{}", layers.source_of("port"));

        let (s, layers) = load(toml, &[("DUPLEX_DECODE_PORT", "3"), ("DUPLEX_ROUTER_PORT", "4")], Flags::default()).unwrap();
        assert_eq!((s.port, s.name.as_str()), (3, "file"));
        assert_eq!(layers.source_of("port"), "environment variable DUPLEX_DECODE_PORT");

        let (s, layers) = load(toml, &[("DUPLEX_DECODE_PORT", "3")], Flags { port: Some(5), name: None }).unwrap();
        assert_eq!((s.port, s.name.as_str()), (5, "file"));
        assert_eq!(layers.source_of("port"), "flag --port");
        assert!(layers.source_of("name").starts_with("config file "));
    }

    #[test]
    fn environment_values_take_their_key_type() {
        let vars = [("DUPLEX_DECODE_NAME", "7"), ("DUPLEX_DECODE_RATIO", "2"), ("DUPLEX_DECODE_ON", "false"), ("DUPLEX_DECODE_ORIGINS", "https://a.example, https://b.example")];
        let (s, _) = load("", &vars, Flags::default()).unwrap();
        assert_eq!((s.name.as_str(), s.ratio, s.on), ("7", 2.0, false));
        assert_eq!(s.origins, ["https://a.example", "https://b.example"]);
    }

    #[test]
    fn an_alias_is_overridden_by_the_sections_own_variable() {
        let (s, layers) = load("[decode]\nkey = \"file\"\n", &[("DUPLEX_KEY", "alias")], Flags::default()).unwrap();
        assert_eq!(s.key.as_deref(), Some("alias"));
        assert_eq!(layers.source_of("key"), "environment variable DUPLEX_KEY");
        let (s, _) = load("", &[("DUPLEX_KEY", "alias"), ("DUPLEX_DECODE_KEY", "own")], Flags::default()).unwrap();
        assert_eq!(s.key.as_deref(), Some("own"));
    }

    #[test]
    fn errors_name_the_key_the_source_and_the_problem() {
        let err = load("[decode]\nport = \"x\"\n", &[], Flags::default()).unwrap_err();
        assert!(err.contains("`decode.port`") && err.contains("config file") && err.contains("duplex.toml") && err.contains("invalid type"), "{err}");
        let err = load("[decode]\nprot = 1\n", &[], Flags::default()).unwrap_err();
        assert!(err.contains("`decode.prot`") && err.contains("duplex.toml") && err.contains("unknown field"), "{err}");
        let err = load("", &[("DUPLEX_DECODE_PORT", "many")], Flags::default()).unwrap_err();
        assert!(err.contains("`decode.port` from environment variable DUPLEX_DECODE_PORT") && err.contains("invalid type"), "{err}");
        let err = load("", &[("DUPLEX_DECODE_PROT", "1")], Flags::default()).unwrap_err();
        assert!(err.contains("DUPLEX_DECODE_PROT") && err.contains("unknown field"), "{err}");
        let err = load("[decoder]\nport = 1\n", &[], Flags::default()).unwrap_err();
        assert!(err.contains("unknown section [decoder]") && err.contains("duplex.toml"), "{err}");
        let err = load("[decode\n", &[], Flags::default()).unwrap_err();
        assert!(err.contains("duplex.toml"), "{err}");
        let (_, layers) = load("", &[], Flags { port: Some(0), name: None }).unwrap();
        assert_eq!(layers.invalid("port", "must be at least 1").to_string(), "invalid decode setting `port` (from flag --port): must be at least 1");
        let missing = Layers::new::<Settings>("decode").file(Some(Path::new("/nonexistent/duplex.toml"))).err().unwrap().to_string();
        assert!(missing.contains("/nonexistent/duplex.toml"), "{missing}");
    }
}
