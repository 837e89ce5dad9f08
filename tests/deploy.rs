//! The deployment (docker/, deploy/) against the code it deploys:
//!
//! - every metric the Grafana dashboard queries is one that
//!   `duplex_telemetry::ALL` lists, used as its kind allows (quantiles over a
//!   histogram's `_bucket`, `rate()` of counters, gauges as they are), with
//!   labels and label values the metric has, every required panel is there
//!   (stream-loading prefill's included), and the panels' layout is sound;
//! - a real `duplex serve`, its prefill worker on an emulated accelerator,
//!   exports each of those metrics from the process that `exported_by` names;
//! - Prometheus scrapes the three processes at the ports of deploy/duplex.toml;
//! - deploy/duplex.toml is read by the real config code of each process, its
//!   host names and ports agree with the compose files' services, and its
//!   [prefill] section spells out every setting (stream-loading prefill's at
//!   their defaults: `device = "auto"`);
//! - the compose files have what the issue asks for (GPU reservations, the
//!   shared /dev/shm, health checks, restart policies, monitoring), and the
//!   CPU file is the GPU file without its GPUs;
//! - the Dockerfiles run as non-root on slim runtime images.
//!
//! Validating the compose files with docker-compose and the Prometheus file
//! with promtool is deploy/check.sh's job; the tests here also run those tools
//! where they are installed.

use duplex_decode::config::{DecodeArgs, DecodeConfig};
use duplex_prefill::config::{PrefillArgs, PrefillConfig};
use duplex_router::config::{RouterArgs, RouterConfig};
use duplex_telemetry::{Kind, Metric, Process, ALL};
use duplex_tests::{collect, greedy_request, prompt, Options, Server};
use serde_json::Value as Json;
use serde_yaml::Value as Yaml;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const MAIN_COMPOSE: &str = "deploy/docker-compose.yml";
const CPU_COMPOSE: &str = "deploy/docker-compose.cpu.yml";
const CONFIG: &str = "deploy/duplex.toml";
const PROMETHEUS: &str = "deploy/prometheus/prometheus.yml";
const DASHBOARD: &str = "deploy/grafana/dashboards/duplex.json";
const DATASOURCES: &str = "deploy/grafana/provisioning/datasources/prometheus.yml";
const DASHBOARD_PROVIDERS: &str = "deploy/grafana/provisioning/dashboards/duplex.yml";
/// Where the compose files mount deploy/duplex.toml in the containers.
const CONFIG_IN_CONTAINER: &str = "/etc/duplex/duplex.toml";
/// Labels Prometheus attaches to every scraped series.
const TARGET_LABELS: &[&str] = &["job", "instance", "process"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("cannot read {rel}: {e}"))
}

fn yaml(rel: &str) -> Yaml {
    serde_yaml::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel} is not valid YAML: {e}"))
}

fn dashboard() -> Json {
    serde_json::from_str(&read(DASHBOARD)).unwrap_or_else(|e| panic!("{DASHBOARD} is not valid JSON: {e}"))
}

// ---------------------------------------------------------------- configs

/// The three processes' settings, read from deploy/duplex.toml by their own
/// config code (unknown keys and bad values are errors there).
struct Configs {
    router: RouterConfig,
    decode: DecodeConfig,
    prefill: PrefillConfig,
}

fn configs() -> Configs {
    let path = Some(root().join(CONFIG));
    let router = RouterArgs { config: path.clone(), ..Default::default() }.resolve().unwrap_or_else(|e| panic!("{CONFIG} [router]: {e:#}"));
    let decode = DecodeArgs { config: path.clone(), ..Default::default() }.resolve().unwrap_or_else(|e| panic!("{CONFIG} [decode]: {e:#}"));
    let prefill = PrefillArgs { config: path, ..Default::default() }.resolve().unwrap_or_else(|e| panic!("{CONFIG} [prefill]: {e:#}"));
    Configs { router, decode, prefill }
}

#[test]
fn config_file_suits_containers() {
    let c = configs();
    for (who, host) in [("router", &c.router.host), ("decode", &c.decode.host), ("prefill", &c.prefill.host)] {
        assert_eq!(host, "0.0.0.0", "[{who}] host must be 0.0.0.0 in a container, or nothing outside it can connect");
    }
    assert_eq!(c.decode.instance, c.prefill.instance, "both workers must name the same segments");
    assert_eq!(c.decode.shm_dir, c.prefill.shm_dir, "both workers must use the same shm_dir");
    assert!(c.decode.metrics_port != 0 && c.prefill.metrics_port != 0, "Prometheus scrapes the workers' metrics ports");
    assert_eq!(c.router.decode_worker, format!("http://decode:{}", c.decode.port), "router → decode worker: the compose service `decode`");
    assert_eq!(c.router.prefill_worker, format!("http://prefill:{}", c.prefill.port), "router → prefill worker: the compose service `prefill`");
    assert_eq!(c.router.model, c.decode.model);
    assert_eq!(c.router.model, c.prefill.model);
    // The GPU deployment's prefill worker runs stream-loading prefill on its
    // GPU (the CUDA image); in the CPU image `auto` falls back to the CPU.
    assert_eq!(c.prefill.device, "auto", "[prefill] device: auto uses the GPU the compose file reserves for the prefill worker");
}

/// The keys a section of deploy/duplex.toml sets (`key = value` lines).
fn config_keys(section: &str) -> BTreeSet<String> {
    let mut current = String::new();
    let mut keys = BTreeSet::new();
    for line in read(CONFIG).lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = name.trim().to_string();
        } else if current == section && !line.starts_with('#') {
            if let Some((key, _)) = line.split_once('=') {
                keys.insert(key.trim().to_string());
            }
        }
    }
    keys
}

/// deploy/duplex.toml's [prefill] spells out every setting of the prefill
/// worker, the stream-loading prefill ones included, so that operators see
/// what the GPU deployment runs with.
#[test]
fn config_file_lists_every_prefill_setting() {
    let all: BTreeSet<String> = serde_json::to_value(PrefillConfig::default()).unwrap().as_object().unwrap().keys().cloned().collect();
    let set = config_keys("prefill");
    let missing: Vec<&String> = all.difference(&set).collect();
    assert!(missing.is_empty(), "{CONFIG} [prefill] does not set {missing:?}");
    let unknown: Vec<&String> = set.difference(&all).collect();
    assert!(unknown.is_empty(), "{CONFIG} [prefill] sets unknown keys {unknown:?}");
    // The stream-loading prefill settings at their defaults.
    let c = configs().prefill;
    let d = PrefillConfig::default();
    let (ours, defaults) = (serde_json::to_value(&c).unwrap(), serde_json::to_value(&d).unwrap());
    for key in ["device", "slp_threshold_tokens", "device_memory_mib", "cuda_device", "emulated_h2d_gb_per_s", "ring_slots", "ring_turning_point_tokens", "dense_budget_mib"] {
        assert_eq!(ours[key], defaults[key], "{CONFIG} [prefill] {key} differs from the default");
    }
}

// ---------------------------------------------------------------- compose

fn services(compose: &Yaml) -> &serde_yaml::Mapping {
    compose["services"].as_mapping().expect("a services mapping")
}

/// A sequence of scalars (or one scalar) as strings.
fn strings(v: &Yaml) -> Vec<String> {
    match v {
        Yaml::Sequence(s) => s.iter().map(|x| scalar(x).unwrap_or_default()).collect(),
        other => scalar(other).into_iter().collect(),
    }
}

/// A YAML scalar as a string (numbers too: ports are often unquoted).
fn scalar(v: &Yaml) -> Option<String> {
    match v {
        Yaml::String(s) => Some(s.clone()),
        Yaml::Number(n) => Some(n.to_string()),
        Yaml::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// `${VAR:-default}` → `default`; other text unchanged.
fn with_defaults(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').expect("unterminated ${") + start;
        let inner = &rest[start + 2..end];
        out.push_str(inner.split_once(":-").map_or("", |(_, d)| d));
        rest = &rest[end + 1..];
    }
    out + rest
}

/// The service's volumes as (source, target, options) with defaults filled in.
fn volumes(service: &Yaml) -> Vec<(String, String, String)> {
    service["volumes"]
        .as_sequence()
        .map(|vs| {
            vs.iter()
                .map(|v| match v {
                    Yaml::String(s) => {
                        let s = with_defaults(s);
                        let parts: Vec<&str> = s.split(':').collect();
                        (parts[0].to_string(), parts.get(1).copied().unwrap_or(parts[0]).to_string(), parts.get(2).copied().unwrap_or("").to_string())
                    }
                    long => (
                        with_defaults(&scalar(&long["source"]).unwrap_or_default()),
                        scalar(&long["target"]).unwrap_or_default(),
                        if long["read_only"].as_bool() == Some(true) { "ro".into() } else { String::new() },
                    ),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Container ports a service publishes.
fn published(service: &Yaml) -> BTreeSet<u16> {
    strings(&service["ports"]).iter().map(|p| with_defaults(p).rsplit(':').next().unwrap().split('/').next().unwrap().parse().expect("a container port")).collect()
}

fn gpu_devices(service: &Yaml) -> Vec<Yaml> {
    service["deploy"]["resources"]["reservations"]["devices"].as_sequence().cloned().unwrap_or_default()
}

/// What both compose files must have.
fn check_compose(rel: &str, gpus: bool) {
    let compose = yaml(rel);
    let c = configs();
    let svc = services(&compose);
    let get = |name: &str| svc.get(name).unwrap_or_else(|| panic!("{rel}: no service `{name}`"));
    for name in ["router", "decode", "prefill", "prometheus", "grafana"] {
        let s = get(name);
        assert!(s["restart"].as_str().is_some_and(|r| r != "no"), "{rel}: {name} has no restart policy");
        assert!(!strings(&s["healthcheck"]["test"]).is_empty(), "{rel}: {name} has no health check");
    }

    // The Duplex processes: the right binary, the config file, the model.
    let model = c.router.model.to_str().unwrap().to_string();
    for (name, binary) in [("router", "duplex-router"), ("decode", "duplex-decode"), ("prefill", "duplex-prefill")] {
        let s = get(name);
        let command = strings(&s["command"]);
        assert_eq!(command.first().map(String::as_str), Some(binary), "{rel}: {name} runs {command:?}");
        assert!(command.windows(2).any(|w| w[0] == "--config" && w[1] == CONFIG_IN_CONTAINER), "{rel}: {name} does not read {CONFIG_IN_CONTAINER}");
        let vols = volumes(s);
        assert!(vols.iter().any(|(src, dst, _)| src == "./duplex.toml" && dst == CONFIG_IN_CONTAINER), "{rel}: {name} does not mount ./duplex.toml: {vols:?}");
        let (src, _, opts) = vols.iter().find(|(_, dst, _)| *dst == model).unwrap_or_else(|| panic!("{rel}: {name} does not mount the model at {model}: {vols:?}"));
        assert_eq!(opts, "ro", "{rel}: {name} should mount the model read-only");
        assert!(root().join("deploy").join(src).join("config.json").exists(), "{rel}: the default model directory {src} has no config.json");
        assert!(s["build"]["context"].as_str() == Some(".."), "{rel}: {name} builds from the repository root");
        let dockerfile = s["build"]["dockerfile"].as_str().unwrap_or_default();
        let expected = if gpus && name != "router" { "docker/Dockerfile.cuda" } else { "docker/Dockerfile" };
        assert_eq!(dockerfile, expected, "{rel}: {name}'s image");
        assert!(root().join(dockerfile).exists());
        if name == "router" {
            assert!(gpu_devices(s).is_empty(), "{rel}: the router needs no GPU");
        }
    }

    // The router: published ports, health.
    let router = get("router");
    assert_eq!(published(router), BTreeSet::from([c.router.http_port, c.router.grpc_port]), "{rel}: the router publishes its HTTP and gRPC ports");
    let test = strings(&router["healthcheck"]["test"]).join(" ");
    assert!(test.contains(&c.router.http_port.to_string()) && test.contains("/health"), "{rel}: router health check `{test}`");
    let depends: Vec<String> = match &router["depends_on"] {
        Yaml::Mapping(m) => m.keys().filter_map(scalar).collect(),
        other => strings(other),
    };
    assert!(depends.contains(&"decode".into()) && depends.contains(&"prefill".into()), "{rel}: router depends_on {depends:?}");

    // The workers: ports, health on the metrics port, the shared /dev/shm, GPUs.
    let shm_dir = c.decode.shm_dir.to_str().unwrap();
    let mut shm_volumes = BTreeSet::new();
    for (name, port, metrics_port, gpu) in [("decode", c.decode.port, c.decode.metrics_port, "1"), ("prefill", c.prefill.port, c.prefill.metrics_port, "0")] {
        let s = get(name);
        let expose: BTreeSet<String> = strings(&s["expose"]).into_iter().collect();
        assert_eq!(expose, BTreeSet::from([port.to_string(), metrics_port.to_string()]), "{rel}: {name} exposes");
        assert!(s["ports"].is_null(), "{rel}: the {name} worker's gRPC port is internal; publish nothing");
        let test = strings(&s["healthcheck"]["test"]).join(" ");
        assert!(test.contains(&metrics_port.to_string()) && test.contains("/metrics"), "{rel}: {name} health check `{test}`");
        let (src, _, _) = volumes(s).into_iter().find(|(_, dst, _)| dst == shm_dir).unwrap_or_else(|| panic!("{rel}: {name} mounts nothing at {shm_dir}"));
        shm_volumes.insert(src);
        let devices = gpu_devices(s);
        if gpus {
            assert_eq!(devices.len(), 1, "{rel}: {name} reserves one GPU");
            let d = &devices[0];
            assert_eq!(d["driver"].as_str(), Some("nvidia"));
            assert_eq!(strings(&d["device_ids"]), vec![gpu.to_string()], "{rel}: {name} gets GPU {gpu}");
            assert!(strings(&d["capabilities"]).contains(&"gpu".into()));
        } else {
            assert!(devices.is_empty(), "{rel}: the CPU file reserves a GPU for {name}");
        }
    }
    assert_eq!(shm_volumes.len(), 1, "{rel}: the workers must mount the same volume at {shm_dir}: {shm_volumes:?}");
    let shm = shm_volumes.into_iter().next().unwrap();
    let volume = &compose["volumes"][shm.as_str()];
    assert_eq!(volume["driver_opts"]["type"].as_str(), Some("tmpfs"), "{rel}: volume `{shm}` must be a tmpfs: {volume:?}");
    let opts = with_defaults(volume["driver_opts"]["o"].as_str().unwrap_or_default());
    assert!(opts.split(',').any(|o| o.starts_with("size=")), "{rel}: set the size of `{shm}` (Docker's default /dev/shm is 64 MB)");
    assert!(opts.split(',').any(|o| o == "mode=1777"), "{rel}: the non-root workers must be able to write to `{shm}`");

    // Monitoring.
    let prometheus = volumes(get("prometheus"));
    assert!(prometheus.iter().any(|(src, dst, _)| src == "./prometheus/prometheus.yml" && dst == "/etc/prometheus/prometheus.yml"), "{rel}: {prometheus:?}");
    let grafana = volumes(get("grafana"));
    assert!(grafana.iter().any(|(src, dst, _)| src == "./grafana/provisioning" && dst == "/etc/grafana/provisioning"), "{rel}: {grafana:?}");
    let providers = yaml(DASHBOARD_PROVIDERS);
    let dashboards_dir = providers["providers"][0]["options"]["path"].as_str().expect("a dashboard provider path");
    assert!(grafana.iter().any(|(src, dst, _)| src == "./grafana/dashboards" && dst == dashboards_dir), "{rel}: grafana must mount ./grafana/dashboards at {dashboards_dir}: {grafana:?}");
    for (src, _, _) in prometheus.iter().chain(&grafana).filter(|(src, _, _)| src.starts_with("./")) {
        assert!(root().join("deploy").join(src).exists(), "{rel}: {src} does not exist");
    }
}

#[test]
fn gpu_compose_file() {
    check_compose(MAIN_COMPOSE, true);
}

#[test]
fn cpu_compose_file() {
    check_compose(CPU_COMPOSE, false);
}

/// docker-compose 1.29 cannot remove the GPU reservations with an override,
/// so the CPU file is a whole file: it must stay the GPU file minus its GPUs.
#[test]
fn cpu_compose_file_is_the_gpu_file_without_gpus() {
    let mut expected = yaml(MAIN_COMPOSE);
    for name in ["decode", "prefill"] {
        let service = expected["services"][name].as_mapping_mut().unwrap();
        service.remove("deploy").expect("the GPU file's workers have deploy: (their GPU reservations)");
        service.insert("image".into(), "duplex:cpu".into());
        service.get_mut("build").and_then(Yaml::as_mapping_mut).expect("a build section").insert("dockerfile".into(), "docker/Dockerfile".into());
    }
    let cpu = yaml(CPU_COMPOSE);
    assert!(cpu == expected, "{CPU_COMPOSE} differs from {MAIN_COMPOSE} by more than the workers' GPUs and image:\n{}", serde_yaml::to_string(&cpu).unwrap());
}

// ---------------------------------------------------------------- Prometheus

#[test]
fn prometheus_scrapes_the_three_processes() {
    let c = configs();
    let prom = yaml(PROMETHEUS);
    let mut targets = BTreeSet::new();
    for job in prom["scrape_configs"].as_sequence().expect("scrape_configs") {
        let path = job["metrics_path"].as_str().unwrap_or("/metrics");
        for group in job["static_configs"].as_sequence().into_iter().flatten() {
            for t in strings(&group["targets"]) {
                targets.insert(format!("{t}{path}"));
            }
        }
    }
    let compose = yaml(MAIN_COMPOSE);
    for (service, port) in [("router", c.router.http_port), ("decode", c.decode.metrics_port), ("prefill", c.prefill.metrics_port)] {
        let want = format!("{service}:{port}/metrics");
        assert!(targets.contains(&want), "{PROMETHEUS} does not scrape {want}: {targets:?}");
        assert!(services(&compose).contains_key(service), "{PROMETHEUS} scrapes `{service}`, which is no compose service");
    }
    let ds = yaml(DATASOURCES);
    assert_eq!(ds["datasources"][0]["url"].as_str(), Some("http://prometheus:9090"), "{DATASOURCES}");
}

// ---------------------------------------------------------------- dashboard

struct Query {
    panel: String,
    expr: String,
    legend: String,
}

/// Every query of every panel, rows' nested panels included.
fn queries(dash: &Json) -> Vec<Query> {
    fn walk(panels: &Json, out: &mut Vec<Query>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or_default().to_string();
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = t["expr"].as_str() {
                    out.push(Query { panel: title.clone(), expr: expr.to_string(), legend: t["legendFormat"].as_str().unwrap_or_default().to_string() });
                }
            }
            walk(&p["panels"], out);
        }
    }
    let mut out = vec![];
    walk(&dash["panels"], &mut out);
    out
}

/// One use of a `duplex_` series in an expression.
#[derive(Debug)]
struct Use {
    series: String,
    metric: &'static Metric,
    suffix: &'static str,
    /// The function or aggregation the series is the argument of.
    within: String,
    matchers: Vec<(String, String, String)>,
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn metric_of(series: &str) -> Option<(&'static Metric, &'static str)> {
    if let Some(m) = ALL.iter().find(|m| m.name == series) {
        return Some((m, ""));
    }
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = series.strip_suffix(suffix) {
            if let Some(m) = ALL.iter().find(|m| m.name == base && m.kind == Kind::Histogram) {
                return Some((m, suffix));
            }
        }
    }
    None
}

/// The name of the call whose argument list encloses byte `at` of `expr`:
/// `rate` for `rate(x[1m])`, `sum` for `sum by (le) (x)`.
fn enclosing_call(expr: &str, at: usize) -> String {
    let b = expr.as_bytes();
    let mut depth = 0i32;
    let mut i = at;
    while i > 0 {
        i -= 1;
        match b[i] {
            b')' => depth += 1,
            b'(' if depth > 0 => depth -= 1,
            b'(' => {
                // The word before this parenthesis, skipping a `by (...)` or
                // `without (...)` clause.
                let before = expr[..i].trim_end();
                let before = if before.ends_with(')') {
                    let open = before.rfind('(').unwrap();
                    let clause = before[..open].trim_end();
                    clause.trim_end_matches(|c: char| c.is_ascii_alphabetic()).trim_end()
                } else {
                    before
                };
                let start = before.rfind(|c: char| !is_ident(c)).map_or(0, |p| p + 1);
                return before[start..].to_string();
            }
            _ => {}
        }
    }
    String::new()
}

/// The label matchers `{a="x", b=~"y|z"}` at the start of `s`.
fn matchers(s: &str) -> Vec<(String, String, String)> {
    let Some(body) = s.strip_prefix('{') else { return vec![] };
    let body = &body[..body.find('}').expect("unterminated matcher")];
    body.split(',')
        .filter(|m| !m.trim().is_empty())
        .map(|m| {
            let op_at = m.find(['=', '!']).expect("a matcher operator");
            let label = m[..op_at].trim().to_string();
            let rest = &m[op_at..];
            let op_len = if rest.starts_with("=~") || rest.starts_with("!~") || rest.starts_with("!=") { 2 } else { 1 };
            let value = rest[op_len..].trim().trim_matches('"').to_string();
            (label, rest[..op_len].to_string(), value)
        })
        .collect()
}

/// Every `duplex_` series in `expr`; panics on names that no process exports.
fn uses(q: &Query) -> Vec<Use> {
    let expr = &q.expr;
    let mut out = vec![];
    let mut i = 0;
    let b = expr.as_bytes();
    while i < b.len() {
        let c = b[i] as char;
        if c == '"' {
            i += 1 + expr[i + 1..].find('"').expect("unterminated string") + 1;
            continue;
        }
        if is_ident(c) && (i == 0 || !is_ident(b[i - 1] as char)) {
            let end = expr[i..].find(|c: char| !is_ident(c)).map_or(expr.len(), |e| i + e);
            let word = &expr[i..end];
            if word.starts_with("duplex_") {
                let (metric, suffix) = metric_of(word).unwrap_or_else(|| {
                    panic!("panel `{}` queries `{word}`, which no Duplex process exports (duplex_telemetry::ALL)\n  {expr}", q.panel)
                });
                out.push(Use { series: word.to_string(), metric, suffix, within: enclosing_call(expr, i), matchers: matchers(&expr[end..]) });
            }
            i = end;
            continue;
        }
        i += 1;
    }
    out
}

/// A metric's labels and their values, from its help text
/// ("...; label part = total | attention | moe.").
fn labels_of(m: &Metric) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for piece in m.help.split("label ").skip(1) {
        let (name, values) = piece.split_once(" = ").expect("label NAME = VALUES");
        let values = values.split(['.', ';']).next().unwrap();
        out.insert(name.trim().to_string(), values.split('|').map(|v| v.trim().to_string()).collect());
    }
    out
}

/// The labels of every `by (...)` clause in `expr`.
fn by_labels(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (at, _) in expr.match_indices("by") {
        let before_ok = at == 0 || !is_ident(expr.as_bytes()[at - 1] as char);
        let rest = expr[at + 2..].trim_start();
        if before_ok && rest.starts_with('(') {
            let inner = &rest[1..rest.find(')').unwrap()];
            out.extend(inner.split(',').map(|l| l.trim().to_string()).filter(|l| !l.is_empty()));
        }
    }
    out
}

const RATES: &[&str] = &["rate", "irate", "increase"];

#[test]
fn dashboard_queries_exported_metrics_as_their_kinds_allow() {
    let dash = dashboard();
    let qs = queries(&dash);
    assert!(qs.len() >= 20, "the dashboard has only {} queries", qs.len());
    for q in &qs {
        let uses = uses(q);
        assert!(!uses.is_empty(), "panel `{}` queries no Duplex metric: {}", q.panel, q.expr);
        let ctx = || format!("panel `{}`: {}", q.panel, q.expr);
        let mut known_labels: BTreeSet<String> = TARGET_LABELS.iter().map(|s| s.to_string()).collect();
        for u in &uses {
            let within = u.within.as_str();
            match (u.metric.kind, u.suffix) {
                (Kind::Counter, _) => assert!(RATES.contains(&within), "counter {} must be inside rate()/increase(), not `{within}`; {}", u.series, ctx()),
                (Kind::Gauge, _) => assert!(!RATES.contains(&within), "gauge {} inside {within}(); {}", u.series, ctx()),
                (Kind::Histogram, "") => panic!("histogram {} has no bare series; use _bucket, _sum or _count; {}", u.series, ctx()),
                (Kind::Histogram, "_bucket") => {
                    assert!(RATES.contains(&within), "{} must be inside rate(); {}", u.series, ctx());
                    assert!(q.expr.contains("histogram_quantile("), "{} outside histogram_quantile(); {}", u.series, ctx());
                    assert!(by_labels(&q.expr).contains("le"), "histogram_quantile over {} must keep `le`; {}", u.series, ctx());
                    known_labels.insert("le".into());
                }
                (Kind::Histogram, _) => assert!(RATES.contains(&within), "{} must be inside rate()/increase(); {}", u.series, ctx()),
            }
            let labels = labels_of(u.metric);
            for (label, op, value) in &u.matchers {
                let values = labels.get(label).unwrap_or_else(|| panic!("{} has no label `{label}` (its labels: {labels:?}); {}", u.metric.name, ctx()));
                if op == "=" || op == "=~" {
                    for v in value.split('|') {
                        assert!(values.contains(v), "{}{{{label}}} never has the value `{v}` (only {values:?}); {}", u.metric.name, ctx());
                    }
                }
            }
            known_labels.extend(labels.into_keys());
        }
        let by = by_labels(&q.expr);
        for l in &by {
            assert!(known_labels.contains(l), "`by ({l})`: no metric of this query has label `{l}`; {}", ctx());
        }
        for piece in q.legend.split("{{").skip(1) {
            let l = piece.split("}}").next().unwrap().trim();
            assert!(by.contains(l) || TARGET_LABELS.contains(&l), "legend `{}` uses `{l}`, which the query aggregates away; {}", q.legend, ctx());
        }
    }
}

#[test]
fn dashboard_has_every_required_panel() {
    use duplex_telemetry as t;
    let dash = dashboard();
    let qs = queries(&dash);
    let mut panels: BTreeMap<&str, Vec<&Query>> = BTreeMap::new();
    for q in &qs {
        panels.entry(q.panel.as_str()).or_default().push(q);
    }
    let has_panel = |what: &str, pred: &dyn Fn(&[&Query]) -> bool| {
        assert!(panels.values().any(|qs| pred(qs)), "{DASHBOARD} has no panel for {what}");
    };
    let quantiles = |metric: &'static str| {
        move |qs: &[&Query]| {
            ["0.5", "0.9", "0.99"].iter().all(|p| qs.iter().any(|q| q.expr.contains(&format!("histogram_quantile({p},")) && q.expr.contains(&format!("{metric}_bucket"))))
        }
    };
    has_panel("TTFT p50/p90/p99", &quantiles(t::TIME_TO_FIRST_TOKEN));
    has_panel("TPOT p50/p90/p99", &quantiles(t::TIME_PER_OUTPUT_TOKEN));
    has_panel("requests per second by outcome", &|qs| {
        qs.iter().any(|q| q.expr.contains(&format!("rate({}[", t::REQUESTS)) && by_labels(&q.expr).contains("outcome"))
    });
    has_panel("prompt and generated tokens per second", &|qs| {
        [t::PROMPT_TOKENS, t::GENERATION_TOKENS].iter().all(|m| qs.iter().any(|q| q.expr.contains(&format!("rate({m}["))))
    });
    has_panel("running and waiting requests", &|qs| [t::REQUESTS_RUNNING, t::REQUESTS_WAITING].iter().all(|m| qs.iter().any(|q| q.expr.contains(m))));
    has_panel("KV pool usage", &|qs| qs.iter().any(|q| q.expr.contains(t::KV_BLOCKS_USED) && q.expr.contains(t::KV_BLOCKS_CAPACITY) && q.expr.contains('/')));
    has_panel("decode batch size", &|qs| qs.iter().any(|q| q.expr.contains(t::DECODE_BATCH_SIZE)));
    has_panel("decode step time split into attention and MoE", &|qs| {
        qs.iter().any(|q| {
            uses(q).iter().any(|u| {
                u.metric.name == t::DECODE_STEP_TIME
                    && by_labels(&q.expr).contains("part")
                    && u.matchers.iter().filter(|(l, _, _)| l == "part").all(|(_, op, v)| op == "=~" && v.contains("attention") && v.contains("moe"))
            })
        })
    });
    has_panel("prefill throughput", &|qs| {
        qs.iter().any(|q| q.expr.contains(&format!("rate({}[", t::PREFILL_TOKENS)) || q.expr.contains(&format!("{}_bucket", t::PREFILL_THROUGHPUT)))
    });
    has_panel("stream-loading prefill ring slots", &|qs| qs.iter().any(|q| q.expr.contains(t::PREFILL_SLP_RING_SLOTS)));
    has_panel("stream-loading prefill overlap efficiency", &|qs| qs.iter().any(|q| q.expr.contains(t::PREFILL_SLP_OVERLAP)));
    has_panel("weight bytes streamed per second", &|qs| qs.iter().any(|q| q.expr.contains(&format!("rate({}[", t::PREFILL_SLP_STREAMED_BYTES))));
    has_panel("stream-loading prefill stall time p50/p99", &|qs| {
        ["0.5", "0.99"].iter().all(|p| {
            qs.iter().any(|q| q.expr.contains(&format!("histogram_quantile({p},")) && q.expr.contains(&format!("{}_bucket", t::PREFILL_SLP_STALL)))
        })
    });
    has_panel("prefix cache hit rate", &|qs| qs.iter().any(|q| q.expr.contains(t::PREFIX_CACHE_HITS) && q.expr.contains(t::PREFIX_CACHE_QUERIES) && q.expr.contains('/')));
    let rows: Vec<&str> = dash["panels"].as_array().into_iter().flatten().filter(|p| p["type"] == "row").filter_map(|p| p["title"].as_str()).collect();
    assert!(rows.contains(&"Stream-loading prefill"), "{DASHBOARD} has no row \"Stream-loading prefill\" (rows: {rows:?})");

    // Every panel reads the provisioned data source.
    let uid = yaml(DATASOURCES)["datasources"][0]["uid"].as_str().expect("a data source uid").to_string();
    fn check_ds(panels: &Json, uid: &str) {
        for p in panels.as_array().into_iter().flatten() {
            if p["type"] != "row" {
                assert_eq!(p["datasource"]["uid"].as_str(), Some(uid), "panel `{}` reads another data source", p["title"]);
                for t in p["targets"].as_array().into_iter().flatten() {
                    assert_eq!(t["datasource"]["uid"].as_str(), Some(uid), "a query of panel `{}` reads another data source", p["title"]);
                }
            }
            check_ds(&p["panels"], uid);
        }
    }
    check_ds(&dash["panels"], &uid);
    assert!(dash["uid"].as_str().is_some_and(|u| !u.is_empty()), "the dashboard needs a fixed uid");
}

/// Grafana's layout: unique panel ids, every panel inside the 24-column grid
/// and none overlapping another.
#[test]
fn dashboard_layout_is_consistent() {
    let dash = dashboard();
    let mut ids = BTreeSet::new();
    let mut boxes: Vec<(String, i64, i64, i64, i64)> = vec![];
    fn walk(panels: &Json, ids: &mut BTreeSet<i64>, boxes: &mut Vec<(String, i64, i64, i64, i64)>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or_default().to_string();
            let id = p["id"].as_i64().unwrap_or_else(|| panic!("panel `{title}` has no id"));
            assert!(ids.insert(id), "panel id {id} (`{title}`) is used twice");
            let g = &p["gridPos"];
            let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| g[k].as_i64().unwrap_or_else(|| panic!("panel `{title}`: gridPos.{k}")));
            assert!(x >= 0 && y >= 0 && w > 0 && h > 0 && x + w <= 24, "panel `{title}`: gridPos {g}");
            boxes.push((title, x, y, w, h));
            walk(&p["panels"], ids, boxes);
        }
    }
    walk(&dash["panels"], &mut ids, &mut boxes);
    for (i, a) in boxes.iter().enumerate() {
        for b in &boxes[i + 1..] {
            let apart = a.1 + a.3 <= b.1 || b.1 + b.3 <= a.1 || a.2 + a.4 <= b.2 || b.2 + b.4 <= a.2;
            assert!(apart, "panels `{}` and `{}` overlap", a.0, b.0);
        }
    }
}

/// The names a real server exports, per process: every series the dashboard
/// queries must be exported by the process `exported_by` names, with the
/// right type, and the label values the dashboard selects must occur.
#[test]
fn a_running_server_exports_what_the_dashboard_queries() {
    // The prefill worker on an emulated device with a low stream-loading
    // threshold, so that its SLP metrics are recorded too; then a second
    // server whose decode worker runs the hybrid placement on an emulated
    // device with an expert cache (its steps host-driven), and a third
    // without (its steps launched as device graphs), for their own metrics.
    // A process's exports are the union of all three.
    let mut scrapes: BTreeMap<String, String> = BTreeMap::new();
    for (decode_device, expert_cache_experts) in [("cpu", 0), ("emulated", 8), ("emulated", 0)] {
        let server = Server::start(Options { prefill_threshold_tokens: 64, slp_threshold_tokens: Some(64), decode_device, expert_cache_experts, ..Options::default() });
        let scraped = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
            let mut client = server.grpc_client().await;
            // One prompt through the decode worker's chunked prefill, one through
            // the prefill worker's stream-loading prefill, so that every metric
            // has been recorded.
            for n in [16, 100] {
                let run = collect(&mut client, greedy_request(&prompt(n), 4));
                tokio::time::timeout(Duration::from_secs(60), run).await.expect("a request took over 60 s").expect("a request failed");
            }
            let mut scrapes = vec![];
            for (process, url) in [(Process::Router, format!("{}/metrics", server.http)), (Process::Decode, server.decode_metrics_url()), (Process::Prefill, server.prefill_metrics_url())] {
                scrapes.push((format!("{process:?}"), reqwest::get(&url).await.unwrap().text().await.unwrap()));
            }
            scrapes
        });
        for (process, text) in scraped {
            scrapes.entry(process).or_default().push_str(&text);
        }
    }
    let types = |text: &str| -> BTreeMap<String, String> {
        text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split_once(' ')).map(|(n, k)| (n.to_string(), k.to_string())).collect()
    };
    for q in queries(&dashboard()) {
        for u in uses(&q) {
            let process = format!("{:?}", u.metric.exported_by);
            let text = &scrapes[&process];
            let kind = types(text).get(u.metric.name).cloned();
            let want = format!("{:?}", u.metric.kind).to_lowercase();
            assert_eq!(kind.as_deref(), Some(want.as_str()), "the {process} process does not export {} as a {want}; panel `{}`:\n{text}", u.metric.name, q.panel);
            assert!(text.lines().any(|l| l.starts_with(&format!("{}{{", u.series)) || l.starts_with(&format!("{} ", u.series))), "no series {} from the {process} process", u.series);
            for (label, op, value) in &u.matchers {
                if op == "=" || op == "=~" {
                    for v in value.split('|') {
                        let needle = format!("{label}=\"{v}\"");
                        assert!(text.lines().any(|l| l.starts_with(u.metric.name) && l.contains(&needle)), "no {}{{{needle}}} from the {process} process", u.metric.name);
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------- images

/// The instructions of a Dockerfile's last stage.
fn runtime_stage(rel: &str) -> (String, Vec<String>) {
    let text = read(rel).replace("\\\n", " ");
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    let from = lines.iter().rposition(|l| l.to_ascii_uppercase().starts_with("FROM ")).expect("a FROM");
    (lines[from].to_string(), lines[from + 1..].iter().map(|l| l.to_string()).collect())
}

#[test]
fn images_are_slim_and_run_as_non_root() {
    for (rel, base) in [("docker/Dockerfile", "debian:"), ("docker/Dockerfile.cuda", "nvidia/cuda:")] {
        let (from, stage) = runtime_stage(rel);
        assert!(from.contains(base), "{rel}: the runtime stage is `{from}`");
        let user = stage.iter().rev().find(|l| l.starts_with("USER ")).unwrap_or_else(|| panic!("{rel}: the runtime stage sets no USER"));
        let who = user["USER ".len()..].split(':').next().unwrap().trim();
        assert!(who != "root" && who != "0", "{rel}: runs as {who}");
        let copies = stage.iter().filter(|l| l.starts_with("COPY --from=")).count();
        assert!(copies >= 1, "{rel}: the runtime stage copies no binaries from the build");
        assert!(!stage.iter().any(|l| l.contains("cargo ") || l.contains("COPY . ")), "{rel}: the runtime stage must carry binaries only");
        assert!(stage.iter().any(|l| l.contains("docker/healthcheck")), "{rel}: the health check script is missing");
        let text = read(rel);
        for bin in ["duplex", "duplex-router", "duplex-prefill", "duplex-decode"] {
            assert!(text.contains(&format!("target/release/{bin} ")) || text.contains(&format!("target/release/{bin}\n")), "{rel}: does not ship {bin}");
        }
    }
    assert!(runtime_stage("docker/Dockerfile").0.contains("-slim"), "the CPU runtime image should be a slim Debian");
    let cuda = read("docker/Dockerfile.cuda");
    assert!(cuda.contains("-devel-") && cuda.contains("-runtime-") && cuda.contains("--features"), "docker/Dockerfile.cuda: a CUDA devel builder, a runtime base, --features");
    assert!(cuda.contains("CARGO_FEATURES=duplex-prefill/cuda"), "docker/Dockerfile.cuda: the CUDA backend is the `cuda` feature of duplex-prefill");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(root().join("docker/healthcheck")).unwrap().permissions().mode();
        assert!(mode & 0o111 != 0, "docker/healthcheck must be executable");
    }
    let ignore = read(".dockerignore");
    assert!(ignore.lines().any(|l| l.trim() == "target" || l.trim() == "**/target" || l.trim() == "/target"), ".dockerignore must keep target/ out of the build context");
}

/// Whether `.dockerignore` pattern `pattern` matches `path` (both relative,
/// `/`-separated): `*` within a segment, `**` across any segments, and a
/// pattern that matches a directory excludes what is under it.
fn ignore_matches(pattern: &str, path: &str) -> bool {
    fn glob(p: &[u8], s: &[u8]) -> bool {
        match (p.first(), s.first()) {
            (None, None) => true,
            (Some(b'*'), _) => glob(&p[1..], s) || (!s.is_empty() && s[0] != b'/' && glob(p, &s[1..])),
            (Some(&pc), Some(&sc)) if pc == sc || pc == b'?' && sc != b'/' => glob(&p[1..], &s[1..]),
            _ => false,
        }
    }
    fn segments(p: &[&str], s: &[&str]) -> bool {
        match p.first() {
            None => true, // the pattern matched an ancestor directory of the path
            Some(&"**") => (0..=s.len()).any(|skip| segments(&p[1..], &s[skip..])),
            Some(seg) => !s.is_empty() && glob(seg.as_bytes(), s[0].as_bytes()) && segments(&p[1..], &s[1..]),
        }
    }
    let p: Vec<&str> = pattern.trim_start_matches('/').trim_end_matches('/').split('/').collect();
    let s: Vec<&str> = path.split('/').collect();
    segments(&p, &s)
}

/// What the build context lacks would fail `cargo build` in the image: every
/// file that non-test code compiles in (`include_str!`, `include_bytes!`)
/// must survive `.dockerignore`.
#[test]
fn docker_build_context_keeps_what_the_build_reads() {
    let patterns: Vec<String> = read(".dockerignore").lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('!')).map(String::from).collect();
    assert!(ignore_matches("tests/fixtures/**/*.safetensors", "tests/fixtures/tiny-dsv3/model-00001-of-00002.safetensors"));
    assert!(ignore_matches("**/target", "services/cli/target/debug/x") && ignore_matches("target", "target/release/duplex"));
    assert!(!ignore_matches("tests/fixtures/**/*.safetensors", "tests/fixtures/tiny-dsv3/config.json"));

    fn sources(dir: &Path, rel: &str, out: &mut Vec<(PathBuf, String)>) {
        for entry in std::fs::read_dir(dir).unwrap().map(Result::unwrap) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if rel.is_empty() { name.clone() } else { format!("{rel}/{name}") };
            let path = entry.path();
            if path.is_dir() {
                // Integration tests, benches and examples are not built into the image.
                if !["target", ".git", "tests", "benches", "examples", "deploy", "docker"].contains(&name.as_str()) {
                    sources(&path, &rel, out);
                }
            } else if name.ends_with(".rs") {
                out.push((path, rel));
            }
        }
    }
    let mut files = vec![];
    sources(&root(), "", &mut files);
    let mut checked = 0;
    for (path, rel) in files {
        let text = std::fs::read_to_string(&path).unwrap();
        for macro_name in ["include_str!(\"", "include_bytes!(\""] {
            for (at, _) in text.match_indices(macro_name) {
                let arg = &text[at + macro_name.len()..];
                let arg = &arg[..arg.find('"').unwrap()];
                let dir = Path::new(&rel).parent().unwrap();
                // Normalise `dir/../../x` to a path from the repository root.
                let mut parts: Vec<&str> = dir.iter().map(|c| c.to_str().unwrap()).collect();
                for c in arg.split('/') {
                    match c {
                        ".." => {
                            parts.pop();
                        }
                        "." | "" => {}
                        c => parts.push(c),
                    }
                }
                let included = parts.join("/");
                for p in &patterns {
                    assert!(!ignore_matches(p, &included), "{rel} compiles in {included}, which .dockerignore's `{p}` leaves out of the image build");
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "found no include_str!/include_bytes! at all: is the scan broken?");
}

// ---------------------------------------------------------------- tools

fn available(program: &str, args: &[&str]) -> bool {
    Command::new(program).args(args).output().is_ok_and(|o| o.status.success())
}

/// `docker-compose config` (1.29) and `docker compose config` (v2), where
/// installed, accept both files; so does `promtool check config`.
#[test]
fn external_validators_accept_the_files_where_installed() {
    let repo = root();
    let mut ran = vec![];
    let mut compose_tools: Vec<(&str, Vec<&str>)> = vec![];
    if available("docker-compose", &["version"]) {
        compose_tools.push(("docker-compose", vec![]));
    }
    if available("docker", &["compose", "version"]) {
        compose_tools.push(("docker", vec!["compose"]));
    }
    for (program, prefix) in &compose_tools {
        for file in [MAIN_COMPOSE, CPU_COMPOSE] {
            let out = Command::new(program).args(prefix).args(["-f", file, "config", "-q"]).current_dir(&repo).output().unwrap();
            assert!(out.status.success(), "{program} {prefix:?} -f {file} config: {}", String::from_utf8_lossy(&out.stderr));
            ran.push(format!("{program} {} -f {file} config", prefix.join(" ")));
        }
    }
    if available("promtool", &["--version"]) {
        let out = Command::new("promtool").args(["check", "config", PROMETHEUS]).current_dir(&repo).output().unwrap();
        assert!(out.status.success(), "promtool check config: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        ran.push("promtool check config".into());
    }
    if ran.is_empty() {
        eprintln!("no docker-compose, docker compose or promtool here: deploy/check.sh installs and runs them");
    } else {
        eprintln!("validated with: {}", ran.join("; "));
    }
}
