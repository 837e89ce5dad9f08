//! duplex-telemetry: the metric names of every Duplex process, their help
//! texts and histogram buckets, the Prometheus exporter, logging, and the
//! rest of the set-up every process shares ([`config`]: where its settings
//! come from; [`process`]: shutdown signals, listeners).
//!
//! Names follow vLLM where one exists (`time_to_first_token_seconds`,
//! `time_per_output_token_seconds`, `num_requests_running`), so dashboards
//! built for vLLM read naturally. Dashboards and tests import [`ALL`] rather
//! than retyping names.

pub mod config;
pub mod process;
pub mod progress;

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use std::net::SocketAddr;

/// How a metric is exported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric: its name, kind, help text, the process that exports it, and
/// the buckets of a histogram.
#[derive(Clone, Copy, Debug)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    pub exported_by: Process,
    pub buckets: &'static [f64],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Process {
    Router,
    Prefill,
    Decode,
}

/// Latencies from a millisecond to ten minutes.
const LATENCY: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0];
/// Inter-token latencies: a millisecond to ten seconds.
const TOKEN_LATENCY: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 10.0];
const BATCH: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0];
const THROUGHPUT: &[f64] = &[10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 25000.0];
/// Fractions, such as an overlap efficiency.
const RATIO: &[f64] = &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0];
/// Short decisions: a microsecond to ten milliseconds.
const DECISION: &[f64] = &[1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2];
/// Experts per layer.
const EXPERTS: &[f64] = &[0.0, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0, 256.0];
const NONE: &[f64] = &[];

macro_rules! metrics_table {
    ($($konst:ident = $name:literal, $kind:ident, $process:ident, $buckets:ident, $help:literal;)*) => {
        $(#[doc = $help] pub const $konst: &str = $name;)*
        /// Every metric a Duplex process exports.
        pub const ALL: &[Metric] = &[$(Metric { name: $name, kind: Kind::$kind, help: $help, exported_by: Process::$process, buckets: $buckets }),*];
    };
}

metrics_table! {
    TIME_TO_FIRST_TOKEN = "duplex_time_to_first_token_seconds", Histogram, Router, LATENCY,
        "Time from a request's arrival at the router to its first token.";
    TIME_PER_OUTPUT_TOKEN = "duplex_time_per_output_token_seconds", Histogram, Router, TOKEN_LATENCY,
        "Time between consecutive output tokens of a request (inter-token latency).";
    E2E_REQUEST_LATENCY = "duplex_e2e_request_latency_seconds", Histogram, Router, LATENCY,
        "Time from a request's arrival to its last token.";
    REQUEST_QUEUE_TIME = "duplex_request_queue_time_seconds", Histogram, Router, LATENCY,
        "Time a request waited in queues before its prefill started.";
    REQUEST_PREFILL_TIME = "duplex_request_prefill_time_seconds", Histogram, Router, LATENCY,
        "Time from the start of a request's prefill to its first token; label path = decode | prefill.";
    PREFILL_ROUTE = "duplex_prefill_route_total", Counter, Router, NONE,
        "Prompts by where the router sent them to be prefilled (the scheduling policy: in chunks on the decode worker, on one prefill device, or on every prefill device); label route = decode_chunked | slp | dslp.";
    REQUESTS = "duplex_requests_total", Counter, Router, NONE,
        "Finished requests; label outcome = stop | length | cancelled | error | rejected | invalid.";
    PROMPT_TOKENS = "duplex_prompt_tokens_total", Counter, Router, NONE,
        "Prompt tokens of admitted requests.";
    GENERATION_TOKENS = "duplex_generation_tokens_total", Counter, Router, NONE,
        "Tokens generated and delivered.";
    REQUESTS_RUNNING = "duplex_num_requests_running", Gauge, Router, NONE,
        "Requests that have started producing tokens and are not finished.";
    REQUESTS_WAITING = "duplex_num_requests_waiting", Gauge, Router, NONE,
        "Admitted requests that have no token yet.";
    KV_BLOCKS_USED = "duplex_kv_blocks_used", Gauge, Decode, NONE,
        "KV cache blocks in use (leased to the prefill worker or held by sequences).";
    KV_BLOCKS_CAPACITY = "duplex_kv_blocks_capacity", Gauge, Decode, NONE,
        "KV cache blocks in the shared pool.";
    DECODE_BATCH_SIZE = "duplex_decode_batch_size", Histogram, Decode, BATCH,
        "Sequences in one decode-worker step (decoding plus prefilling).";
    DECODE_STEP_TIME = "duplex_decode_step_seconds", Histogram, Decode, LATENCY,
        "Time of one decode-worker step; label part = total | attention | moe | cpu_moe | device_wait | device | graph_capture; attention and moe on the CPU engine, and on the hybrid placement cpu_moe (routed experts on the CPU), device_wait (the host blocked on the device), device (its compute, where it reports one) and graph_capture (capturing the step as a device graph and launching it, before the device starts).";
    DECODE_MICRO_BATCH_SIZE = "duplex_decode_micro_batch_size", Histogram, Decode, BATCH,
        "Sequences in each of a hybrid step's two micro-batches; label half = a | b (b absent when the batch runs unsplit).";
    DECODE_OVERLAP = "duplex_decode_overlap_efficiency", Histogram, Decode, RATIO,
        "max(device compute, CPU MoE) ÷ step time of each hybrid step, where the device reports its compute time (the emulated device does).";
    DEVICE_KV_BLOCKS_USED = "duplex_decode_device_kv_blocks_used", Gauge, Decode, NONE,
        "Blocks of the decode worker's device KV pool held by running sequences (hybrid placement).";
    DECODE_GRAPH_LAUNCHES = "duplex_decode_graph_launches_total", Counter, Decode, NONE,
        "Hybrid decode steps launched as one device graph (expert_submit = graph); label exec = instantiated (a graph made for a new step shape) | updated (the kept graph of the step's shape, updated in place).";
    EXPERT_CACHE_LOOKUPS = "duplex_decode_expert_cache_lookups_total", Counter, Decode, NONE,
        "Activated routed experts looked up in the decode device's expert cache (hybrid placement with expert_cache_experts).";
    EXPERT_CACHE_HITS = "duplex_decode_expert_cache_hits_total", Counter, Decode, NONE,
        "Activated routed experts found on the device (cached or prefetched) when their layer ran.";
    EXPERTS_PER_LAYER = "duplex_decode_experts_per_layer", Histogram, Decode, EXPERTS,
        "Activated routed experts of a MoE layer run on each side, per step (the mean over its layers); label side = device | cpu.";
    EXPERT_PREFETCH_BYTES = "duplex_decode_expert_prefetch_bytes_total", Counter, Decode, NONE,
        "Expert bytes copied to the device ahead of their layer; label outcome = copied | wasted (the layer did not use the expert).";
    EXPERT_LAYER_TIME = "duplex_decode_expert_layer_seconds", Histogram, Decode, LATENCY,
        "A MoE layer's routed-expert time per step (the mean over its layers); label kind = predicted (the assignment's cost model) | measured (max of the device's and the CPU's share).";
    EXPERT_DECISION_TIME = "duplex_decode_expert_decision_seconds", Histogram, Decode, DECISION,
        "Time the expert cache spent deciding (assignment, replacement, prefetch choice) per MoE layer, per step (the mean over its layers).";
    DECODE_RUNNING = "duplex_decode_running_sequences", Gauge, Decode, NONE,
        "Sequences in the decode worker's running batch.";
    DECODE_WAITING = "duplex_decode_waiting_sequences", Gauge, Decode, NONE,
        "Requests waiting in the decode worker: for their KV blocks (sequences and leases, first come first served) or for a place in the batch.";
    KV_WAIT_TIME = "duplex_decode_kv_wait_seconds", Histogram, Decode, LATENCY,
        "Time a request waited in the decode worker's first-come first-served queue until its KV blocks (prompt plus max_tokens) were granted.";
    DEVICE_LEASE_WAIT = "duplex_decode_device_lease_wait_seconds", Histogram, Decode, LATENCY,
        "Time a decode request waited, on arrival, for the prefill worker to give back the device it had leased for two-device prefill (revoke to release, or the bound `device_lease_revoke_timeout_seconds`).";
    DEVICE_LEASE_REVOCATIONS = "duplex_decode_device_lease_revocations_total", Counter, Decode, NONE,
        "Device leases the decode worker revoked because a decode request arrived.";
    DEVICE_LEASES = "duplex_decode_device_leases_total", Counter, Decode, NONE,
        "Device leases asked of the decode worker; label outcome = granted | refused.";
    PREFILL_THROUGHPUT = "duplex_prefill_tokens_per_second", Histogram, Prefill, THROUGHPUT,
        "Prompt tokens per second of each prefill; label worker = prefill | decode.";
    PREFILL_TOKENS = "duplex_prefill_tokens_total", Counter, Prefill, NONE,
        "Prompt tokens prefilled; label worker = prefill | decode.";
    PREFILL_TIME = "duplex_prefill_seconds", Histogram, Prefill, LATENCY,
        "Compute time of each prefill; label worker = prefill | decode.";
    PREFILL_QUEUE = "duplex_prefill_queue_length", Gauge, Prefill, NONE,
        "Prompts waiting in the prefill worker's first-come first-served queue.";
    PREFILL_DSLP_FALLBACK = "duplex_prefill_dslp_fallback_total", Counter, Prefill, NONE,
        "Prompts routed to two-device prefill that ran on one device instead because the decode worker's device could not be borrowed; label reason = refused | unreachable | revoked (revoked mid-run and rerun).";
    PREFILL_SLP_RING_SLOTS = "duplex_prefill_slp_ring_slots", Gauge, Prefill, NONE,
        "Experts ring-buffer slots of the last stream-loading prefill (one layer's experts, or 2 beyond the turning point).";
    PREFILL_SLP_STREAMED_BYTES = "duplex_prefill_slp_streamed_bytes_total", Counter, Prefill, NONE,
        "Weight bytes stream-loading prefill copied from the shared host segment to the device.";
    PREFILL_SLP_STALL = "duplex_prefill_slp_stall_seconds", Histogram, Prefill, LATENCY,
        "Time the device's compute stream sat idle waiting for weights, per stream-loading prefill.";
    PREFILL_SLP_OVERLAP = "duplex_prefill_slp_overlap_efficiency", Gauge, Prefill, NONE,
        "max(Σ transfer, Σ compute) ÷ Σ measured time over the layers of the last stream-loading prefill (1 = the shorter fully hidden).";
    WEIGHT_SEGMENT_BYTES = "duplex_weight_segment_bytes", Gauge, Prefill, NONE,
        "Size of the shared weight segment this worker maps.";
    WEIGHT_SEGMENT_HUGE_PAGE_BYTES = "duplex_weight_segment_huge_page_bytes", Gauge, Prefill, NONE,
        "Bytes of the shared weight segment this worker maps with huge pages (hugetlbfs, or transparent huge pages of a tmpfs), measured at start.";
    PREFIX_CACHE_QUERIES = "duplex_prefix_cache_queries_tokens_total", Counter, Decode, NONE,
        "Prompt tokens looked up in the decode worker's prefix cache: every admitted prompt, on either prefill path.";
    PREFIX_CACHE_HITS = "duplex_prefix_cache_hits_tokens_total", Counter, Decode, NONE,
        "Prompt tokens whose KV the prefix cache held, so that no worker prefilled them again.";
    PREFIX_CACHE_EVICTIONS = "duplex_prefix_cache_evictions_total", Counter, Decode, NONE,
        "Idle cached KV blocks (no request held them) taken for new data, least recently used first.";
    PREFIX_CACHE_BLOCKS = "duplex_prefix_cache_blocks", Gauge, Decode, NONE,
        "KV blocks the prefix cache names, held by requests or idle; the idle ones count as free.";
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("cannot set up the Prometheus exporter: {0}")]
    Build(#[from] BuildError),
    #[error("a metrics recorder is already installed in this process")]
    AlreadyInstalled,
}

fn builder() -> Result<PrometheusBuilder, BuildError> {
    let mut b = PrometheusBuilder::new();
    for m in ALL.iter().filter(|m| m.kind == Kind::Histogram) {
        // Without buckets a histogram is exported as a summary, which
        // Prometheus cannot aggregate across processes or compute quantiles of.
        b = b.set_buckets_for_metric(Matcher::Full(m.name.to_string()), m.buckets)?;
    }
    Ok(b)
}

fn describe() {
    for m in ALL {
        match m.kind {
            Kind::Counter => metrics::describe_counter!(m.name, m.help),
            Kind::Gauge => metrics::describe_gauge!(m.name, m.help),
            Kind::Histogram => metrics::describe_histogram!(m.name, m.help),
        }
    }
}

/// Install the global recorder. With `listen`, also serve `/metrics` there
/// (on the current tokio runtime). The handle renders the exposition text,
/// for a process that serves `/metrics` on its own HTTP port.
pub fn install(listen: Option<SocketAddr>) -> Result<PrometheusHandle, TelemetryError> {
    let b = builder()?;
    let handle = match listen {
        Some(addr) => {
            let (recorder, exporter) = b.with_http_listener(addr).build()?;
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).map_err(|_| TelemetryError::AlreadyInstalled)?;
            tokio::spawn(exporter);
            handle
        }
        None => {
            let recorder = b.build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).map_err(|_| TelemetryError::AlreadyInstalled)?;
            handle
        }
    };
    describe();
    Ok(handle)
}

/// Log to stderr; `RUST_LOG` filters (default `info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour codes only on a terminal: in a log file they are noise.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).try_init();
}

/// Log how much of the weight segment a worker maps with huge pages (the
/// line `WeightStore::describe_pages` makes), and export the bytes as
/// [`WEIGHT_SEGMENT_HUGE_PAGE_BYTES`]: a TLB miss every 4 KiB of an expert
/// read is what huge pages save. `Err` is why it could not be told.
pub fn report_weight_pages(report: Result<(String, u64), String>) {
    match report {
        Ok((line, huge_bytes)) => {
            tracing::info!("{line}");
            metrics::gauge!(WEIGHT_SEGMENT_HUGE_PAGE_BYTES).set(huge_bytes as f64);
        }
        Err(e) => tracing::warn!("cannot tell how the weight segment is mapped (/proc/self/smaps): {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_prefixed() {
        let mut names: Vec<&str> = ALL.iter().map(|m| m.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
        assert!(ALL.iter().all(|m| m.name.starts_with("duplex_")));
        assert!(ALL.iter().all(|m| (m.kind == Kind::Histogram) != m.buckets.is_empty()));
    }

    #[test]
    fn histograms_export_buckets_not_summaries() {
        let recorder = builder().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe();
            metrics::histogram!(TIME_TO_FIRST_TOKEN).record(0.3);
        });
        let text = handle.render();
        assert!(text.contains("duplex_time_to_first_token_seconds_bucket{le=\"0.5\"} 1"), "{text}");
        assert!(!text.contains("quantile="), "{text}");
    }
}
