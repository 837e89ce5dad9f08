//! Routed experts' weights in the memory of the NUMA node that computes them
//! (paper §3.5: keep cross-socket traffic off the decode path).
//!
//! The CPU backend sends routed expert `e` to pool node
//! [`expert_node`]`(e, nodes)`. When the weight segment is built for a pool
//! of several nodes, each expert's pages get a shared memory policy that
//! prefers that node, so its threads read the expert from local DRAM. Pool
//! node `k` is taken to be the machine's NUMA node `k`: the operator lays
//! out `cores` so that node `k`'s slice is the cores of socket `k`.
//!
//! A tmpfs file takes its pages' node from its shared policy when the pages
//! are allocated, so the policy is set (by `mbind` through a mapping of the
//! range) before the file's space is reserved and written. The policy lives
//! with the file, not with the mapping, so it outlives that mapping and the
//! rename into place.
//!
//! `MPOL_PREFERRED`, not `MPOL_BIND`: a node that runs out of memory then
//! spills to another node instead of failing the build.
//!
//! Non-expert tensors (attention, norms, router, shared experts, embedding,
//! LM head) are left to the default policy: every thread of every node reads
//! them, so no node is the right home, and in the hybrid placement they are
//! copied to the device once and not read from host memory while decoding.
//!
//! A pool node the machine does not have (on a one-node machine `numa_nodes`
//! only splits the threads) keeps its experts unplaced; node ids beyond the
//! machine's are never passed to `mbind`. Nothing here fails a build: what
//! could not be placed is said once, in the [`PlacementReport`].

use crate::segment::human;
use duplex_kernels::pool::expert_node;
use nix::libc;
use std::collections::BTreeMap;
use std::fs::File;

/// `mbind` modes (linux/mempolicy.h); the libc crate does not export them.
pub const MPOL_PREFERRED: i32 = 1;

/// Where the machine's memory nodes are listed (the CPU-list notation).
const HAS_MEMORY: &str = "/sys/devices/system/node/has_memory";

/// A page-aligned byte range of the segment file to be placed on `node`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedRange {
    pub start: usize,
    pub len: usize,
    pub node: usize,
}

/// The routed expert a tensor belongs to: `….experts.{e}.…` (DeepSeek-V3,
/// Qwen3-MoE: `mlp.experts`, Mixtral: `block_sparse_moe.experts`). Shared
/// experts (`shared_experts.`) are not routed experts.
pub fn routed_expert(name: &str) -> Option<usize> {
    let (_, rest) = name.split_once(".experts.")?;
    rest.split('.').next()?.parse().ok()
}

/// The plan: for tensors `(name, file offset, length)`, the page-aligned
/// ranges to place and on which node. A routed expert's tensor goes to
/// `expert_node(e, nodes)`; anything else is left out, and so is every page
/// shared with a neighbour of another node (or none) and any run smaller
/// than a page. Consecutive tensors (by offset) of the same node form one
/// range, which keeps the ranges to about one per expert. Empty for one node.
pub fn plan<'a>(tensors: impl IntoIterator<Item = (&'a str, usize, usize)>, nodes: usize, page: usize) -> Vec<PlannedRange> {
    if nodes <= 1 {
        return vec![];
    }
    let mut by_offset: Vec<(usize, usize, Option<usize>)> =
        tensors.into_iter().map(|(name, at, len)| (at, at + len, routed_expert(name).map(|e| expert_node(e, nodes)))).collect();
    by_offset.sort_unstable();
    let mut out = vec![];
    let mut push = |run: Option<(usize, usize, usize)>| {
        if let Some((start, end, node)) = run {
            let (start, end) = (start.div_ceil(page) * page, end / page * page);
            if end > start {
                out.push(PlannedRange { start, len: end - start, node });
            }
        }
    };
    // The current run: (first byte, end, node).
    let mut run: Option<(usize, usize, usize)> = None;
    for (at, end, node) in by_offset {
        match (node, &mut run) {
            (Some(n), Some((_, run_end, run_node))) if n == *run_node => *run_end = end,
            (Some(n), _) => {
                push(run.take());
                run = Some((at, end, n));
            }
            (None, _) => push(run.take()),
        }
    }
    push(run);
    out
}

/// What placement did, said once by whoever built the segment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlacementReport {
    /// Pool nodes the plan was made for (1: no placement asked).
    pub nodes: usize,
    /// Bytes given a policy preferring each node.
    pub placed: BTreeMap<usize, u64>,
    /// Planned bytes left to the default policy.
    pub unplaced: u64,
    /// Why bytes were left unplaced.
    pub note: Option<String>,
}

impl std::fmt::Display for PlacementReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.nodes == 0 {
            return write!(f, "experts' weights as placed by the process that built the segment");
        }
        if self.nodes == 1 {
            return write!(f, "experts' weights not placed (one pool node)");
        }
        let placed: Vec<String> = self.placed.iter().map(|(n, b)| format!("{} on node {n}", human(*b))).collect();
        write!(f, "experts' weights placed for {} pool nodes: ", self.nodes)?;
        if placed.is_empty() {
            write!(f, "none placed")?;
        } else {
            write!(f, "{}", placed.join(", "))?;
        }
        if self.unplaced > 0 {
            write!(f, "; {} left unplaced", human(self.unplaced))?;
        }
        if let Some(note) = &self.note {
            write!(f, " ({note})")?;
        }
        Ok(())
    }
}

/// The NUMA nodes that have memory, or why they are unknown.
pub fn memory_nodes() -> Result<Vec<usize>, String> {
    let text = std::fs::read_to_string(HAS_MEMORY).map_err(|e| format!("no NUMA information: cannot read {HAS_MEMORY}: {e}"))?;
    duplex_kernels::pool::parse_cpu_list(text.trim()).map_err(|e| format!("cannot parse {HAS_MEMORY}: {e}"))
}

/// The machine's NUMA node of each core, from `/sys/devices/system/node/node*/cpulist`.
pub fn core_nodes() -> Result<BTreeMap<usize, usize>, String> {
    let dir = "/sys/devices/system/node";
    let entries = std::fs::read_dir(dir).map_err(|e| format!("cannot list {dir}: {e}"))?;
    let mut out = BTreeMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(node) = name.to_str().and_then(|n| n.strip_prefix("node")).and_then(|n| n.parse::<usize>().ok()) else { continue };
        let path = entry.path().join("cpulist");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        for core in duplex_kernels::pool::parse_cpu_list(text.trim()).map_err(|e| format!("{}: {e}", path.display()))? {
            out.insert(core, node);
        }
    }
    Ok(out)
}

/// Where a pool's node slices disagree with the machine: pool node `k`'s
/// experts are placed on NUMA node `k`, so its threads should run there.
/// `slices[k]` are the cores of pool node `k`'s threads; `core_nodes` maps a
/// core to its NUMA node. One line per pool node whose cores are elsewhere
/// (say on a machine whose cores alternate between sockets); nothing on a
/// one-node machine, where the nodes are simulated anyway.
pub fn slice_mismatches(slices: &[Vec<usize>], core_nodes: &BTreeMap<usize, usize>) -> Vec<String> {
    let machine_nodes: std::collections::BTreeSet<usize> = core_nodes.values().copied().collect();
    if machine_nodes.len() <= 1 {
        return vec![];
    }
    let mut out = vec![];
    for (k, cores) in slices.iter().enumerate() {
        let elsewhere: Vec<usize> = cores.iter().copied().filter(|c| core_nodes.get(c) != Some(&k)).collect();
        if !elsewhere.is_empty() {
            out.push(format!(
                "pool node {k} computes the experts placed on NUMA node {k}, but its cores {} are not on NUMA node {k}: give node {k}'s slice of `cores` the cores of NUMA node {k}",
                duplex_kernels::pool::format_cpu_list(&elsewhere)
            ));
        }
    }
    out
}

/// Settle a worker on its cores at start: every thread of the process
/// stays on `cores` (when set), not only the pinned pool workers (the
/// engine thread, the async runtime's, an emulated device's). Returns what
/// to log: the core set and pool, then any warnings from [`check_pool`].
pub fn place_worker(pool: &duplex_kernels::pool::PoolConfig, cores: &[usize]) -> Result<(String, Vec<String>), String> {
    let placed = if cores.is_empty() {
        format!("cores: not set; compute pool: {}", pool.describe())
    } else {
        duplex_kernels::pool::restrict_process_to(cores).map_err(|e| format!("cores: {e}"))?;
        format!("cores {}; compute pool: {}", duplex_kernels::pool::format_cpu_list(cores), pool.describe())
    };
    Ok((placed, check_pool(pool)))
}

/// [`slice_mismatches`] for `pool` on this machine, for a worker to log at
/// start; nothing for a one-node or unpinned pool.
pub fn check_pool(pool: &duplex_kernels::pool::PoolConfig) -> Vec<String> {
    match (pool.nodes() > 1, pool.node_cores(), core_nodes()) {
        (true, Some(slices), Ok(map)) => slice_mismatches(&slices, &map),
        (true, Some(_), Err(e)) => vec![format!("cannot check that the pool's node slices match the machine's NUMA nodes: {e}")],
        _ => vec![],
    }
}

/// The system page size, which `mbind` ranges must be aligned to.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        page as usize
    } else {
        4096
    }
}

/// Set each planned range's policy on `file` (a tmpfs file whose pages are
/// not allocated yet), for the nodes in `machine` (the nodes with memory;
/// the others are skipped). Stops at the first `mbind` error, which is
/// reported, never returned: the segment is built either way.
pub fn apply(file: &File, plan: &[PlannedRange], nodes: usize, machine: Result<Vec<usize>, String>) -> PlacementReport {
    let mut report = PlacementReport { nodes, ..Default::default() };
    let machine = match machine {
        Ok(m) => m,
        Err(why) => {
            report.unplaced = plan.iter().map(|r| r.len as u64).sum();
            report.note = Some(why);
            return report;
        }
    };
    let mut missing = std::collections::BTreeSet::new();
    let mut failed: Option<String> = None;
    for r in plan {
        if failed.is_some() || !machine.contains(&r.node) {
            if failed.is_none() {
                missing.insert(r.node);
            }
            report.unplaced += r.len as u64;
            continue;
        }
        match bind_range(file, r) {
            Ok(()) => *report.placed.entry(r.node).or_default() += r.len as u64,
            Err(e) => {
                failed = Some(format!("mbind failed, the rest is left unplaced: {e}"));
                report.unplaced += r.len as u64;
            }
        }
    }
    let mut notes = vec![];
    if !missing.is_empty() {
        let missing: Vec<usize> = missing.into_iter().collect();
        notes.push(format!(
            "this machine has no memory node {}: its memory nodes are {}",
            duplex_kernels::pool::format_cpu_list(&missing),
            duplex_kernels::pool::format_cpu_list(&machine)
        ));
    }
    notes.extend(failed);
    report.note = (!notes.is_empty()).then(|| notes.join("; "));
    report
}

/// `mbind(MPOL_PREFERRED, node)` on a mapping of just this range, unmapped
/// right after: the policy stays with the file. One mapping per range, not
/// one for the file: each `mbind` splits the mapping it lands in, and a real
/// checkpoint's ~15k expert ranges would pass the mapping-count limit.
fn bind_range(file: &File, r: &PlannedRange) -> std::io::Result<()> {
    // SAFETY: the mapping is never read or written, only given a policy.
    let map = unsafe { memmap2::MmapOptions::new().offset(r.start as u64).len(r.len).map(file)? };
    let mut mask = vec![0u64; r.node / 64 + 1];
    mask[r.node / 64] |= 1 << (r.node % 64);
    // maxnode counts bits and the kernel reads one fewer.
    let maxnode = (mask.len() * 64 + 1) as libc::c_ulong;
    // SAFETY: the range is this live mapping; the mask holds maxnode - 1 bits.
    let rc = unsafe { libc::syscall(libc::SYS_mbind, map.as_ptr(), r.len, MPOL_PREFERRED, mask.as_ptr(), maxnode, 0u32) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_experts_are_recognised() {
        assert_eq!(routed_expert("model.layers.3.mlp.experts.17.gate_proj.weight"), Some(17));
        assert_eq!(routed_expert("model.layers.3.mlp.experts.0.down_proj.weight_scale_inv"), Some(0));
        assert_eq!(routed_expert("model.layers.1.block_sparse_moe.experts.5.w1.weight"), Some(5));
        assert_eq!(routed_expert("model.layers.3.mlp.shared_experts.gate_proj.weight"), None);
        assert_eq!(routed_expert("model.layers.3.mlp.gate.weight"), None);
        assert_eq!(routed_expert("model.layers.3.self_attn.q_proj.weight"), None);
        assert_eq!(routed_expert("model.embed_tokens.weight"), None);
    }

    #[test]
    fn the_plan_places_whole_pages_of_each_expert_on_its_node() {
        const P: usize = 4096;
        // A synthetic layout (offsets in the file, sorted by name as the
        // builder lays them out): expert 0 (three tensors, contiguous),
        // expert 1, a shared expert, expert 2 smaller than a page, expert 3
        // straddling pages, then an attention tensor.
        let t = [
            ("model.layers.1.mlp.experts.0.down_proj.weight", 8192, 3 * P),
            ("model.layers.1.mlp.experts.0.gate_proj.weight", 8192 + 3 * P, 2 * P),
            ("model.layers.1.mlp.experts.0.up_proj.weight", 8192 + 5 * P, 2 * P + 64),
            ("model.layers.1.mlp.experts.1.down_proj.weight", 8192 + 7 * P + 64, 4 * P),
            ("model.layers.1.mlp.shared_experts.down_proj.weight", 8192 + 11 * P + 64, 2 * P),
            ("model.layers.1.mlp.experts.2.down_proj.weight", 8192 + 13 * P + 64, 100),
            ("model.layers.1.mlp.experts.3.down_proj.weight", 8192 + 14 * P + 64, 2 * P),
            ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", 8192 + 16 * P + 64, P),
        ];
        let plan2 = plan(t.iter().copied(), 2, P);
        assert_eq!(
            plan2,
            [
                // Expert 0: its three tensors as one range, up to the page
                // it shares with expert 1.
                PlannedRange { start: 8192, len: 7 * P, node: 0 },
                // Expert 1: the whole pages inside it.
                PlannedRange { start: 8192 + 8 * P, len: 3 * P, node: 1 },
                // Expert 2 is under a page; expert 3 keeps its one whole page.
                PlannedRange { start: 8192 + 15 * P, len: P, node: 1 },
            ]
        );
        // The order of the input does not matter.
        let mut reversed = t.to_vec();
        reversed.reverse();
        assert_eq!(plan(reversed, 2, P), plan2);
        // Three nodes: expert 2 → node 2, 3 → node 0.
        let plan3 = plan(t.iter().copied(), 3, P);
        assert_eq!(plan3.iter().map(|r| r.node).collect::<Vec<_>>(), [0, 1, 0]);
        assert!(plan(t.iter().copied(), 1, P).is_empty(), "one node: nothing to place");
        // A larger page: fewer whole pages.
        assert!(plan(t.iter().copied(), 2, 64 * 1024).is_empty());
    }

    #[test]
    fn nodes_the_machine_lacks_are_reported_not_bound() {
        let file = tempfile::tempfile().unwrap();
        let r = |node| PlannedRange { start: 0, len: 4096, node };
        // Node 7 is not in the machine list: skipped without an mbind call.
        let report = apply(&file, &[r(7), r(7)], 8, Ok(vec![0]));
        assert_eq!((report.placed.len(), report.unplaced), (0, 8192));
        let note = report.note.clone().unwrap();
        assert!(note.contains("no memory node 7") && note.contains("nodes are 0"), "{note}");
        assert!(report.to_string().contains("8.0 KiB left unplaced"), "{report}");
        // No NUMA information at all: everything unplaced, the reason kept.
        let report = apply(&file, &[r(0)], 2, Err("no NUMA information".into()));
        assert_eq!((report.unplaced, report.note.as_deref()), (4096, Some("no NUMA information")));
    }

    #[test]
    fn slices_on_the_wrong_socket_are_named() {
        // Two sockets whose cores alternate: even cores on node 0, odd on node 1.
        let alternating: BTreeMap<usize, usize> = (0..8).map(|c| (c, c % 2)).collect();
        let lines = slice_mismatches(&[vec![0, 1, 2, 3], vec![4, 5, 6, 7]], &alternating);
        assert_eq!(lines.len(), 2);
        assert!(lines[0].contains("pool node 0") && lines[0].contains("cores 1,3 are not on NUMA node 0"), "{}", lines[0]);
        assert!(lines[1].contains("cores 4,6 are not on NUMA node 1"), "{}", lines[1]);
        assert!(slice_mismatches(&[vec![0, 2, 4, 6], vec![1, 3, 5, 7]], &alternating).is_empty());
        // One node: nothing to say, the two pool nodes are simulated.
        let one: BTreeMap<usize, usize> = (0..8).map(|c| (c, 0)).collect();
        assert!(slice_mismatches(&[vec![0, 1], vec![2, 3]], &one).is_empty());
        // This machine's map covers the cores this process may use.
        let here = core_nodes().unwrap();
        assert!(duplex_kernels::pool::allowed_cores().iter().all(|c| here.contains_key(c)), "{here:?}");
    }
}
