//! `duplex bench-kernels` and `duplex bench-engine`: performance as ratios to limits
//! measured in the same run. Machines are shared and noisy, so a number is
//! only quoted next to the DRAM read bandwidth measured alongside it.

use crate::{load_progress, BenchArgs, BenchKernelsArgs};
use anyhow::{bail, Result};
use duplex_toolkit::reference::argmax;
use duplex_kernels::quant::QuantKind;
use duplex_toolkit::kernel_bench::{
    format_gemv_bandwidth, format_moe_layer_bandwidth, gemv_bandwidth, moe_layer_bandwidth, random_blocks, random_fp8, random_moe_layers, read_bandwidth, BenchFormat,
};
use duplex_kernels::cpu::isa;
use duplex_kernels::pool::{PoolConfig, ThreadPool};
use duplex_model::{BlockTable, ForwardTimings, Logits, Model, SeqInput};
use std::time::{Duration, Instant};

const GB: f64 = 1e9;

fn row(name: &str, bytes_per_s: f64, limit: f64) {
    println!("| {name} | {:.1} | {:.2} |", bytes_per_s / GB, bytes_per_s / limit);
}

pub fn kernels(args: BenchKernelsArgs) -> Result<()> {
    let pool = ThreadPool::new(&args.pool.config()?);
    let isa = isa::detect();
    let passes = args.passes.max(1);
    println!(
        "ISA {}, {} threads in {} node(s), {} MiB buffer, best of {passes} passes\n",
        isa.name(),
        pool.threads(),
        pool.nodes(),
        args.buffer_mib
    );
    // Passes interleave the bandwidth and kernel measurements, so that load
    // from other tenants of the machine hits the limit and the kernels alike;
    // each figure is its best pass.
    let buf = random_fp8(&pool, args.buffer_mib << 20, 1);
    // The kernels' weights: the same bytes, in a segment-like file when asked.
    let scratch = match &args.buffer_dir {
        Some(dir) => {
            let scratch = duplex_ipc::ScratchSegment::create(dir, buf.len(), |m| m[..buf.len()].copy_from_slice(&buf))?;
            let m = duplex_ipc::touch_and_measure(&scratch, scratch.path())?;
            println!("{}\n", duplex_ipc::describe_pages("kernel weights", scratch.path(), scratch.len() as u64, &m));
            Some(scratch)
        }
        None => None,
    };
    let weights: &[u8] = scratch.as_deref().map_or(&buf, |s| &s[..buf.len()]);
    // One thread on a 1 MiB matrix that stays in its cache: what the kernel
    // computes when memory is not in the way, next to one thread's DRAM read.
    let one = ThreadPool::new(&PoolConfig::single_node(1));
    let cached = &buf[..512 * 2048];
    // GGUF k-quants (a Q4_K_M file: gate and up in Q4_K, down in Q6_K in
    // some layers and Q4_K in the others), each in its own buffer of valid
    // blocks, in process memory (--buffer-dir moves the FP8 weights only).
    let len = args.buffer_mib << 20;
    let (q4k, q6k) = (BenchFormat::Quant(QuantKind::Q4K), BenchFormat::Quant(QuantKind::Q6K));
    // All-Q4_K layers are whole Q4_K blocks end to end: the Q4_K GEMVs read them too.
    let q4k_buf = random_blocks(&pool, QuantKind::Q4K, len, 2);
    let q6k_buf = random_blocks(&pool, QuantKind::Q6K, len, 3);
    let moe_q6 = random_moe_layers(&pool, [q4k, q4k, q6k], 7168, 2048, len, 5);
    let q4k_cached = 512 * QuantKind::Q4K.row_bytes(2048)?;
    let mut best = [0.0f64; 11];
    for _ in 0..passes {
        let pass = [
            read_bandwidth(&pool, isa, &buf, 1, 1),
            read_bandwidth(&pool, isa, &buf, pool.threads(), 1),
            gemv_bandwidth(&pool, isa, weights, 2048, 7168, 1),
            gemv_bandwidth(&pool, isa, weights, 7168, 2048, 1),
            moe_layer_bandwidth(&pool, isa, weights, 7168, 2048, 8, 1, 1),
            // Each call is short (tens of µs): the best of many.
            (0..64).map(|_| gemv_bandwidth(&one, isa, cached, 512, 2048, 1)).fold(0.0, f64::max),
            format_gemv_bandwidth(&pool, isa, q4k, &q4k_buf, 2048, 7168, 1),
            format_gemv_bandwidth(&pool, isa, q6k, &q6k_buf, 7168, 2048, 1),
            format_moe_layer_bandwidth(&pool, isa, [q4k; 3], &q4k_buf, 7168, 2048, 8, 1, 1),
            format_moe_layer_bandwidth(&pool, isa, [q4k, q4k, q6k], &moe_q6, 7168, 2048, 8, 1, 1),
            (0..64).map(|_| format_gemv_bandwidth(&one, isa, q4k, &q4k_buf[..q4k_cached], 512, 2048, 1)).fold(0.0, f64::max),
        ];
        best.iter_mut().zip(pass).for_each(|(b, p)| *b = b.max(p));
    }
    let all = best[1];
    println!("| measurement | GB/s | fraction of read bandwidth ({} threads) |", pool.threads());
    println!("| --- | --- | --- |");
    row("DRAM read, 1 thread", best[0], all);
    row(&format!("DRAM read, {} threads", pool.threads()), all, all);
    // DeepSeek-V3 expert shapes: gate/up are 7168 → 2048, down is 2048 → 7168.
    row("FP8 GEMV 7168→2048 (gate/up), batch 1", best[2], all);
    row("FP8 GEMV 2048→7168 (down), batch 1", best[3], all);
    row("MoE layer, V3 dims (8 routed + 1 shared experts), batch 1", best[4], all);
    row("FP8 GEMV 2048→512, 1 thread, weights in cache", best[5], all);
    row("Q4_K GEMV 7168→2048 (gate/up), batch 1", best[6], all);
    row("Q6_K GEMV 2048→7168 (down), batch 1", best[7], all);
    row("MoE layer, V3 dims, Q4_K gate/up/down, batch 1", best[8], all);
    row("MoE layer, V3 dims, Q4_K gate/up, Q6_K down, batch 1", best[9], all);
    row("Q4_K GEMV 2048→512, 1 thread, weights in cache", best[10], all);
    Ok(())
}

/// Token ids for synthetic prompts: deterministic, spread over the tokenizer range.
fn prompt(len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 7919 + 13) % vocab.min(2048)) as u32).collect()
}

pub fn end_to_end(args: BenchArgs) -> Result<()> {
    if args.decode_tokens == 0 || args.contexts.contains(&0) || args.prefill.contains(&0) {
        bail!("--contexts, --prefill and --decode-tokens take lengths of at least 1");
    }
    let dir = &args.model.model;
    let precision = args.model.dtype;
    let pool_config = args.pool.config()?;
    // Keeps the segment mapped for as long as the model's weights are views into it.
    let mut _store = None;
    let model = match &args.weights_dir {
        Some(weights_dir) => {
            let name = duplex_ipc::weight_segment_name("bench");
            let t0 = Instant::now();
            let source = args.model.source()?;
            let (store, how) = duplex_ipc::WeightStore::open_or_build_placed(weights_dir, &name, &source, 1, &mut |_, _| {})?;
            println!("weight segment {} {how:?} in {:.1} s", store.path().display(), t0.elapsed().as_secs_f64());
            let model = duplex_ipc::load_model(&store, &source, &pool_config)?;
            println!("{}", store.describe_pages(&store.huge_pages()?));
            _store = Some(store);
            model
        }
        None => {
            let (bar, mut progress) = load_progress(dir);
            let model = Model::load_source(&args.model.source()?, &pool_config, &mut progress)?;
            bar.finish_and_clear();
            model
        }
    };
    let cfg = &model.cfg;
    let max = args.contexts.iter().map(|c| c + args.decode_tokens).chain(args.prefill.iter().copied()).max().unwrap_or(0);
    if max > cfg.max_position_embeddings {
        bail!("benchmark needs {max} positions but the model allows {}", cfg.max_position_embeddings);
    }
    let (pool, isa) = (&model.cpu.pool, model.cpu.isa);
    let buf = random_fp8(pool, args.buffer_mib << 20, 1);
    let mut bandwidth = read_bandwidth(pool, isa, &buf, pool.threads(), 5);
    let activated = model.activated_bytes_per_token();
    println!(
        "{}: {} layers, hidden {}, {} experts (top {}), dtype {precision:?}, ISA {} (block-quantized products: {}), {} threads",
        dir.display(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        isa.name(),
        duplex_kernels::quant::DotPath::for_isa(isa).name(),
        pool.threads()
    );
    let chunk = 512;
    let mut decode = vec![];
    for &ctx in &args.contexts {
        let mut kv = model.new_kv_pool((ctx + args.decode_tokens).div_ceil(16), 16);
        let mut table = BlockTable::default();
        let mut logits = vec![];
        for c in prompt(ctx, cfg.vocab_size).chunks(chunk) {
            logits = model.forward(&mut kv, &mut table, c, precision, Logits::Last)?;
        }
        // Each round rewinds to the prompt and decodes the same tokens again
        // over the same cache blocks, so the rounds differ only in noise.
        let prompt_logits = logits;
        let mut best: Option<(Duration, ForwardTimings)> = None;
        for _ in 0..args.decode_rounds {
            table.len = ctx;
            logits = prompt_logits.clone();
            let mut timings = ForwardTimings::default();
            let t0 = Instant::now();
            for _ in 0..args.decode_tokens {
                let tokens = [argmax(&logits)];
                let seq = SeqInput { table: &mut table, tokens: &tokens };
                logits = model.forward_batch(&mut kv, &mut [seq], precision, Logits::Last, &mut timings)?;
            }
            let elapsed = t0.elapsed();
            if best.is_none_or(|(b, _)| elapsed < b) {
                best = Some((elapsed, timings));
            }
        }
        let (elapsed, timings) = best.expect("at least one round");
        decode.push((ctx, elapsed.div_f64(args.decode_tokens as f64), timings));
        // Bandwidth again right after each decode run: the limit is the best seen.
        bandwidth = bandwidth.max(read_bandwidth(pool, isa, &buf, pool.threads(), 3));
    }
    drop(buf);
    let roofline = bandwidth / activated as f64;
    println!(
        "read bandwidth {:.1} GB/s (best of the runs around each measurement); activated bytes per token {:.1} MB; decode roofline {:.1} tokens/s\n",
        bandwidth / GB,
        activated as f64 / 1e6,
        roofline
    );
    println!("| measurement | tokens/s (best of {} rounds for decode) | fraction of roofline |", args.decode_rounds);
    println!("| --- | --- | --- |");
    for &(ctx, step, _) in &decode {
        let tps = 1.0 / step.as_secs_f64();
        println!("| decode, batch 1, context {ctx} | {tps:.2} | {:.2} |", tps / roofline);
    }
    // Where a decode step goes, next to the time its weights take at the
    // measured bandwidth: what is left over is the work that reads no weights.
    println!("\n| decode step, context | ms | attention ms | MLP/MoE ms | rest ms (embedding, LM head, sampling) | ms at roofline |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (ctx, step, t) in decode {
        let per_token = |d: Duration| d.as_secs_f64() * 1e3 / args.decode_tokens as f64;
        let (attention, ffn) = (per_token(t.attention), per_token(t.ffn));
        let ms = step.as_secs_f64() * 1e3;
        println!("| {ctx} | {ms:.1} | {attention:.1} | {ffn:.1} | {:.1} | {:.1} |", ms - attention - ffn, 1e3 / roofline);
    }
    println!();
    println!("| measurement | tokens/s |");
    println!("| --- | --- |");
    for &len in &args.prefill {
        let mut kv = model.new_kv_pool(len.div_ceil(16), 16);
        let mut table = BlockTable::default();
        let t0 = Instant::now();
        for c in prompt(len, cfg.vocab_size).chunks(chunk) {
            model.forward(&mut kv, &mut table, c, precision, Logits::Last)?;
        }
        println!("| prefill, {len} tokens | {:.1} |", len as f64 / t0.elapsed().as_secs_f64());
    }
    Ok(())
}
