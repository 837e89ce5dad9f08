//! A persistent CPU worker pool for the hot path.
//!
//! Threads are started once, optionally pinned to cores, and grouped into
//! NUMA nodes. A parallel region publishes a borrowed closure and a task count
//! per node; every thread (the caller included, as thread 0 of node 0) claims
//! task indices of its own node from an atomic counter until they run out.
//! Nothing is allocated per region. Idle workers spin briefly, because decode
//! issues regions every few tens of microseconds, and then sleep on a condvar
//! so an idle server does not burn its cores.
//!
//! Nodes keep their tasks: a thread of node 1 never runs node 0's tasks, so
//! each node only touches the weights placed in its own memory. On a one-node
//! machine a two-node pool is simulated by splitting the threads, which is how
//! the NUMA code paths are tested here.

use crossbeam_utils::CachePadded;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// How many threads each NUMA node gets, and whether (and where) to pin them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    pub threads_per_node: Vec<usize>,
    /// Pin worker thread `i` (counted over all nodes, the caller being 0) to
    /// `cores[i]` when `cores` is given, else to the `i`-th core this process
    /// may run on.
    pub pin: bool,
    /// The cores to pin to, in thread order: node 0's threads take the first
    /// slice, node 1's the next, and so on. `None`: the process's own cores.
    pub cores: Option<Vec<usize>>,
}

impl PoolConfig {
    /// One node with `threads` threads.
    pub fn single_node(threads: usize) -> Self {
        PoolConfig { threads_per_node: vec![threads.max(1)], pin: false, cores: None }
    }

    /// One node using every core this process may run on, pinned.
    pub fn all_cores() -> Self {
        Self::split(0, 1).expect("one node always fits")
    }

    /// `threads` pinned threads (0: every core) split as evenly as possible
    /// into `nodes` NUMA nodes (simulated on a one-node machine).
    pub fn split(threads: usize, nodes: usize) -> Result<Self, String> {
        let threads = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        Ok(PoolConfig { threads_per_node: split_threads(threads, nodes)?, pin: true, cores: None })
    }

    /// [`Self::split`] pinned to the explicit core list `cores` (empty: not
    /// set, which is [`Self::split`]). `threads` 0 means one thread per
    /// listed core; more threads than cores, or a core this process may not
    /// run on, is an error naming them. Nodes take consecutive slices.
    pub fn on_cores(threads: usize, nodes: usize, cores: &[usize]) -> Result<Self, String> {
        if cores.is_empty() {
            return Self::split(threads, nodes);
        }
        let allowed = allowed_cores();
        let refused: Vec<usize> = cores.iter().copied().filter(|c| !allowed.contains(c)).collect();
        if !refused.is_empty() {
            return Err(format!(
                "cores {} are not among the cores this process may run on ({})",
                format_cpu_list(&refused),
                format_cpu_list(&allowed)
            ));
        }
        let threads = if threads == 0 { cores.len() } else { threads };
        if threads > cores.len() {
            return Err(format!("threads = {threads} is more than the {} cores of `cores` ({})", cores.len(), format_cpu_list(cores)));
        }
        Ok(PoolConfig { threads_per_node: split_threads(threads, nodes)?, pin: true, cores: Some(cores[..threads].to_vec()) })
    }

    /// How many NUMA nodes the pool has.
    pub fn nodes(&self) -> usize {
        self.threads_per_node.len().max(1)
    }

    /// The cores each node's threads are pinned to (thread 0, the caller,
    /// counted at the first one), or `None` when the pool is not pinned.
    pub fn node_cores(&self) -> Option<Vec<Vec<usize>>> {
        if !self.pin {
            return None;
        }
        let cores = self.cores.clone().unwrap_or_else(allowed_cores);
        let mut at = 0;
        let slices = self
            .threads_per_node
            .iter()
            .map(|&n| {
                let slice = cores.get(at..(at + n.max(1)).min(cores.len())).unwrap_or_default().to_vec();
                at += n.max(1);
                slice
            })
            .collect();
        Some(slices)
    }

    /// What the pool runs on, for the log: threads, nodes, cores.
    pub fn describe(&self) -> String {
        let threads: usize = self.threads_per_node.iter().map(|&n| n.max(1)).sum();
        let place = match (&self.cores, self.pin) {
            (Some(cores), _) => format!("pinned to cores {}", format_cpu_list(cores)),
            (None, true) => "pinned to the first cores this process may run on".to_string(),
            (None, false) => "not pinned".to_string(),
        };
        format!("{threads} threads in {} NUMA node(s) {:?}, {place}", self.nodes(), self.threads_per_node)
    }
}

/// The pool node that computes routed expert `expert` on a pool of `nodes`
/// nodes. The CPU backend sends experts there and the weight segment places
/// their weights in that node's memory, so both must use this one rule.
pub fn expert_node(expert: usize, nodes: usize) -> usize {
    expert % nodes.max(1)
}

/// `threads` split as evenly as possible over `nodes`, node 0 taking the rest.
fn split_threads(threads: usize, nodes: usize) -> Result<Vec<usize>, String> {
    if nodes == 0 || nodes > threads {
        return Err(format!("threads must be at least the number of NUMA nodes, and nodes at least 1 ({threads} threads, {nodes} nodes)"));
    }
    let per = threads / nodes;
    let mut threads_per_node = vec![per; nodes];
    threads_per_node[0] += threads - per * nodes;
    Ok(threads_per_node)
}

/// The cores the calling thread may run on (its affinity mask), ascending.
pub fn allowed_cores() -> Vec<usize> {
    let mut ids: Vec<usize> = core_affinity::get_core_ids().unwrap_or_default().into_iter().map(|c| c.id).collect();
    ids.sort_unstable();
    ids
}

/// Parse a CPU list as Linux prints them (`0-11,24-35`, `3`, `0, 2-4`): comma
/// separated cores or inclusive ranges, in the order given. Blank: the empty
/// list (not set). Reversed ranges, empty pieces, non-numbers and repeated
/// cores are errors naming the piece.
pub fn parse_cpu_list(text: &str) -> Result<Vec<usize>, String> {
    if text.trim().is_empty() {
        return Ok(vec![]);
    }
    let number = |s: &str, piece: &str| s.trim().parse::<usize>().map_err(|_| format!("{piece:?} in the CPU list {text:?} is not a core number or a range like 0-7"));
    let mut cores = vec![];
    for piece in text.split(',') {
        let piece = piece.trim();
        if piece.is_empty() {
            return Err(format!("the CPU list {text:?} has an empty piece (two commas, or a comma at an end)"));
        }
        let (first, last) = match piece.split_once('-') {
            Some((a, b)) => (number(a, piece)?, number(b, piece)?),
            None => (number(piece, piece)?, number(piece, piece)?),
        };
        if first > last {
            return Err(format!("the range {piece:?} in the CPU list {text:?} runs backwards"));
        }
        for core in first..=last {
            if cores.contains(&core) {
                return Err(format!("core {core} appears twice in the CPU list {text:?}"));
            }
            cores.push(core);
        }
    }
    Ok(cores)
}

/// A core list in the CPU-list notation, runs folded: `[0,1,2,5]` → `0-2,5`.
pub fn format_cpu_list(cores: &[usize]) -> String {
    let mut parts: Vec<String> = vec![];
    let mut i = 0;
    while i < cores.len() {
        let mut j = i;
        while j + 1 < cores.len() && cores[j + 1] == cores[j] + 1 {
            j += 1;
        }
        parts.push(if j == i { cores[i].to_string() } else { format!("{}-{}", cores[i], cores[j]) });
        i = j + 1;
    }
    parts.join(",")
}

/// Restrict every thread of this process to `cores` (what `taskset -a -p`
/// does), and so every thread they start later, which inherits the mask.
/// A worker given a core set calls this before building its pool, so that
/// its unpinned threads (the engine thread that is the pool's thread 0, the
/// runtime's, an emulated device's) stay off the other worker's cores too.
pub fn restrict_process_to(cores: &[usize]) -> Result<(), String> {
    if cores.is_empty() {
        return Err("an empty core set".into());
    }
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cores {
        if c >= libc::CPU_SETSIZE as usize {
            return Err(format!("core {c} is beyond the {} cores sched_setaffinity can name", libc::CPU_SETSIZE));
        }
        // SAFETY: c < CPU_SETSIZE was checked above.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // Two passes: a thread started while the first pass ran, by a thread
    // not yet restricted, is caught by the second.
    for _ in 0..2 {
        let tasks = std::fs::read_dir("/proc/self/task").map_err(|e| format!("cannot list /proc/self/task: {e}"))?;
        for task in tasks.flatten() {
            let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<libc::pid_t>().ok()) else { continue };
            // SAFETY: `set` is a valid cpu_set_t of the size passed.
            if unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
                let e = std::io::Error::last_os_error();
                // A thread that exited since the listing is no error.
                if e.raw_os_error() != Some(libc::ESRCH) {
                    return Err(format!("cannot restrict thread {tid} to cores {}: {e}", format_cpu_list(cores)));
                }
            }
        }
    }
    Ok(())
}

/// The task body of a parallel region: `(node, task)`.
type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    /// The current region's closure. Written by the caller before it bumps
    /// `generation` and only read by workers after they observe the bump.
    job: Mutex<Option<&'static Job>>,
    generation: AtomicU64,
    /// Per node: next task to claim, and how many there are.
    next: Vec<CachePadded<AtomicUsize>>,
    count: Vec<CachePadded<AtomicUsize>>,
    /// Workers (not the caller) still inside the current region.
    active: AtomicUsize,
    /// A task panicked in this region.
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    node_of_thread: Vec<usize>,
    /// Serialises regions: the pool runs one at a time.
    region: Mutex<()>,
}

/// Spin iterations before a waiting thread sleeps (tens of microseconds).
const SPIN_LIMIT: u32 = 1 << 14;

thread_local! {
    /// Set inside a task, to catch a region started from within a region.
    static IN_REGION: Cell<bool> = const { Cell::new(false) };
    /// This thread's index in its pool (the caller of a region is 0).
    static THREAD_INDEX: Cell<usize> = const { Cell::new(0) };
}

/// Index of the calling thread within the pool whose region it is running,
/// in `0..pool.threads()`: tasks use it to pick per-thread scratch.
pub fn thread_index() -> usize {
    THREAD_INDEX.get()
}

impl ThreadPool {
    pub fn new(config: &PoolConfig) -> Self {
        let nodes = config.threads_per_node.len().max(1);
        let mut node_of_thread = vec![];
        for (node, &n) in config.threads_per_node.iter().enumerate() {
            node_of_thread.extend(std::iter::repeat_n(node, n.max(1)));
        }
        if node_of_thread.is_empty() {
            node_of_thread.push(0);
        }
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            generation: AtomicU64::new(0),
            next: (0..nodes).map(|_| CachePadded::new(AtomicUsize::new(0))).collect(),
            count: (0..nodes).map(|_| CachePadded::new(AtomicUsize::new(0))).collect(),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        // Workers are pinned; the calling thread is left alone, since it
        // belongs to the application.
        let cores: Vec<core_affinity::CoreId> = match (&config.cores, config.pin) {
            (_, false) => vec![],
            (Some(list), true) => list.iter().map(|&id| core_affinity::CoreId { id }).collect(),
            (None, true) => core_affinity::get_core_ids().unwrap_or_default(),
        };
        let workers = node_of_thread
            .iter()
            .enumerate()
            .skip(1)
            .map(|(i, &node)| {
                let shared = shared.clone();
                let core = cores.get(i).copied();
                std::thread::Builder::new()
                    .name(format!("duplex-worker-{i}"))
                    .spawn(move || {
                        if let Some(core) = core {
                            core_affinity::set_for_current(core);
                        }
                        THREAD_INDEX.set(i);
                        worker_loop(&shared, node)
                    })
                    .expect("spawn worker thread")
            })
            .collect();
        ThreadPool { shared, workers, node_of_thread, region: Mutex::new(()) }
    }

    pub fn threads(&self) -> usize {
        self.node_of_thread.len()
    }

    pub fn nodes(&self) -> usize {
        self.shared.next.len()
    }

    /// Threads of `node`.
    pub fn threads_of(&self, node: usize) -> usize {
        self.node_of_thread.iter().filter(|&&n| n == node).count()
    }

    /// Run `f(task)` for every `task < n_tasks` on all threads of all nodes.
    pub fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if self.nodes() == 1 {
            self.parallel_for_nodes(&[n_tasks], &|_, t| f(t));
        } else {
            // Spread one logical task list over the nodes in contiguous runs.
            let per = n_tasks.div_ceil(self.nodes());
            self.run_region(&|k| n_tasks.saturating_sub(k * per).min(per), &|node, t| f(node * per + t));
        }
    }

    /// Run `f(node, task)` for every `task < tasks_per_node[node]`, each on a
    /// thread of that node. Returns when all tasks are done. Panics (after
    /// the region ends) if a task panicked.
    pub fn parallel_for_nodes(&self, tasks_per_node: &[usize], f: &(dyn Fn(usize, usize) + Sync)) {
        assert_eq!(tasks_per_node.len(), self.nodes(), "one task count per node");
        self.run_region(&|k| tasks_per_node[k], f);
    }

    /// [`Self::parallel_for_nodes`] with the task counts given per node by
    /// `tasks_of` (so that callers need not allocate a list).
    fn run_region(&self, tasks_of: &dyn Fn(usize) -> usize, f: &(dyn Fn(usize, usize) + Sync)) {
        assert!(!IN_REGION.get(), "ThreadPool regions cannot be nested");
        let total: usize = (0..self.nodes()).map(tasks_of).sum();
        if total == 0 {
            return;
        }
        if self.threads() == 1 {
            THREAD_INDEX.set(0);
            (0..tasks_of(0)).for_each(|t| f(0, t));
            return;
        }
        let _region = self.region.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        for k in 0..self.nodes() {
            s.next[k].store(0, Ordering::Relaxed);
            s.count[k].store(tasks_of(k), Ordering::Relaxed);
        }
        // SAFETY: the closure is only borrowed for this call. Workers read it
        // only between observing the new generation and decrementing
        // `active`, and this function does not return before `active` is
        // zero, after which the slot is cleared. So the 'static is never
        // observed beyond the real lifetime.
        let job: &'static Job = unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync + '_), &'static Job>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(job);
        s.panicked.store(false, Ordering::Relaxed);
        s.active.store(self.workers.len(), Ordering::Relaxed);
        {
            let _g = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.generation.fetch_add(1, Ordering::Release);
            s.wake.notify_all();
        }
        THREAD_INDEX.set(0);
        run_tasks(s, job, 0);
        let mut spins = 0u32;
        while s.active.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < SPIN_LIMIT {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a task in a ThreadPool region panicked");
        }
    }
}

fn run_tasks(s: &Shared, job: &Job, node: usize) {
    let count = s.count[node].load(Ordering::Relaxed);
    IN_REGION.set(true);
    loop {
        let t = s.next[node].fetch_add(1, Ordering::Relaxed);
        if t >= count {
            break;
        }
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(node, t))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
    }
    IN_REGION.set(false);
}

fn worker_loop(s: &Shared, node: usize) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        let generation = loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen || s.shutdown.load(Ordering::Acquire) {
                break g;
            }
            spins += 1;
            if spins < SPIN_LIMIT {
                std::hint::spin_loop();
                continue;
            }
            let guard = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            let _guard = s
                .wake
                .wait_while(guard, |_| s.generation.load(Ordering::Acquire) == seen && !s.shutdown.load(Ordering::Acquire))
                .unwrap_or_else(|e| e.into_inner());
        };
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        seen = generation;
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(job) = job {
            run_tasks(s, job, node);
        }
        s.active.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let _g = self.shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.shutdown.store(true, Ordering::Release);
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(&PoolConfig::single_node(threads));
            for n in [0, 1, 5, 1000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.parallel_for(n, &|t| {
                    hits[t].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "threads {threads}, n {n}");
            }
        }
    }

    #[test]
    fn nodes_run_only_their_own_tasks() {
        let pool = ThreadPool::new(&PoolConfig { threads_per_node: vec![1, 2], pin: false, cores: None });
        assert_eq!((pool.nodes(), pool.threads(), pool.threads_of(1)), (2, 3, 2));
        let seen: Vec<Mutex<Vec<usize>>> = (0..2).map(|_| Mutex::new(vec![])).collect();
        for _ in 0..200 {
            pool.parallel_for_nodes(&[7, 3], &|node, t| seen[node].lock().unwrap().push(t));
        }
        assert_eq!(seen[0].lock().unwrap().len(), 1400);
        assert_eq!(seen[1].lock().unwrap().len(), 600);
        // The logical task list is covered once across nodes too.
        let hits: Vec<AtomicUsize> = (0..11).map(|_| AtomicUsize::new(0)).collect();
        pool.parallel_for(11, &|t| {
            hits[t].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn a_panicking_task_is_reported_and_the_pool_survives() {
        let pool = ThreadPool::new(&PoolConfig::single_node(2));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.parallel_for(10, &|t| assert!(t != 3, "boom"));
        }));
        assert!(r.is_err());
        let sum = AtomicUsize::new(0);
        pool.parallel_for(10, &|t| {
            sum.fetch_add(t, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }

    #[test]
    fn workers_sleep_and_wake() {
        let pool = ThreadPool::new(&PoolConfig::single_node(2));
        std::thread::sleep(std::time::Duration::from_millis(50)); // let the worker park
        let sum = AtomicUsize::new(0);
        pool.parallel_for(100, &|t| {
            sum.fetch_add(t, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
    }

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8,10-11").unwrap(), [0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list(" 5 , 1 - 2 ").unwrap(), [5, 1, 2], "whitespace is ignored and the order kept");
        assert_eq!(parse_cpu_list("7").unwrap(), [7]);
        assert_eq!(parse_cpu_list("4-4").unwrap(), [4]);
        assert_eq!(parse_cpu_list("").unwrap(), Vec::<usize>::new());
        assert_eq!(parse_cpu_list("  ").unwrap(), Vec::<usize>::new());
        for (bad, says) in [
            ("3-1", "backwards"),
            ("a", "\"a\""),
            ("1,,2", "empty piece"),
            ("1,", "empty piece"),
            (",1", "empty piece"),
            ("1-", "\"1-\""),
            ("-1", "\"-1\""),
            ("1-2-3", "\"1-2-3\""),
            ("0-2,1", "core 1 appears twice"),
        ] {
            let err = parse_cpu_list(bad).unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }

    #[test]
    fn cpu_lists_format_folded() {
        assert_eq!(format_cpu_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(format_cpu_list(&[3]), "3");
        assert_eq!(format_cpu_list(&[]), "");
        let cores = [0, 1, 2, 3, 8, 10, 11];
        assert_eq!(parse_cpu_list(&format_cpu_list(&cores)).unwrap(), cores);
    }

    #[test]
    fn explicit_core_lists_are_checked() {
        let allowed = allowed_cores();
        assert!(!allowed.is_empty());
        // threads 0: one per listed core; nodes take consecutive slices.
        let c = PoolConfig::on_cores(0, 1, &allowed).unwrap();
        assert_eq!((c.threads_per_node.clone(), c.cores.clone()), (vec![allowed.len()], Some(allowed.clone())));
        let err = PoolConfig::on_cores(allowed.len() + 1, 1, &allowed).unwrap_err();
        assert!(err.contains(&format!("threads = {}", allowed.len() + 1)) && err.contains(&format_cpu_list(&allowed)), "{err}");
        let beyond = allowed.last().unwrap() + 1000;
        let err = PoolConfig::on_cores(1, 1, &[allowed[0], beyond]).unwrap_err();
        assert!(err.contains(&format!("cores {beyond} are not among")) && err.contains(&format_cpu_list(&allowed)), "{err}");
        // An empty list is "not set": today's behaviour.
        assert_eq!(PoolConfig::on_cores(2, 1, &[]).unwrap(), PoolConfig::split(2, 1).unwrap());
        // Fewer threads than cores take the first ones.
        let c = PoolConfig::on_cores(1, 1, &allowed).unwrap();
        assert_eq!(c.cores, Some(vec![allowed[0]]));
    }

    #[test]
    fn nodes_take_consecutive_slices_of_the_core_list() {
        // Only the plan is checked here (these cores need not exist).
        let cores: Vec<usize> = (0..6).collect();
        let c = PoolConfig { threads_per_node: split_threads(6, 2).unwrap(), pin: true, cores: Some(cores) };
        assert_eq!(c.threads_per_node, [3, 3]);
        assert_eq!(c.nodes(), 2);
        assert_eq!(c.node_cores(), Some(vec![vec![0, 1, 2], vec![3, 4, 5]]));
        let uneven = PoolConfig { threads_per_node: split_threads(5, 2).unwrap(), pin: true, cores: Some(vec![9, 8, 7, 6, 5]) };
        assert_eq!(uneven.node_cores(), Some(vec![vec![9, 8, 7], vec![6, 5]]));
        assert_eq!(PoolConfig::single_node(2).node_cores(), None, "not pinned");
        assert!(c.describe().contains("cores 0-5"), "{}", c.describe());
    }

    /// Each thread's affinity, read from inside it (sched_getaffinity on the
    /// calling thread), keyed by its index in the pool.
    fn affinities(pool: &ThreadPool) -> Vec<Option<Vec<usize>>> {
        let seen: Vec<Mutex<Option<Vec<usize>>>> = (0..pool.threads()).map(|_| Mutex::new(None)).collect();
        for _ in 0..200 {
            pool.parallel_for(pool.threads() * 4, &|_| {
                *seen[thread_index()].lock().unwrap() = Some(allowed_cores());
                std::thread::sleep(std::time::Duration::from_millis(2));
            });
            if seen.iter().skip(1).all(|s| s.lock().unwrap().is_some()) {
                break;
            }
        }
        seen.into_iter().map(|s| s.into_inner().unwrap()).collect()
    }

    #[test]
    fn a_pool_on_an_explicit_list_pins_its_workers_there() {
        let allowed = allowed_cores();
        // Reversed, so that worker i's core differs from the i-th allowed
        // core that pinning without a list uses (wherever there are two).
        let mut list = allowed.clone();
        list.reverse();
        let config = PoolConfig::on_cores(0, 1, &list).unwrap();
        let pool = ThreadPool::new(&config);
        let seen = affinities(&pool);
        for i in 1..pool.threads() {
            assert_eq!(seen[i], Some(vec![list[i]]), "worker {i} of a pool on cores {list:?}");
        }
        if allowed.len() >= 2 {
            assert_ne!(list[1], allowed[1]);
        }
    }

    #[test]
    fn a_two_node_pool_pins_each_node_to_its_slice() {
        let allowed = allowed_cores();
        if allowed.len() < 2 {
            // Two nodes need two threads, and two threads two listed cores.
            assert!(PoolConfig::on_cores(0, 2, &allowed).is_err());
            return;
        }
        let list = vec![allowed[1], allowed[0]];
        let pool = ThreadPool::new(&PoolConfig::on_cores(0, 2, &list).unwrap());
        assert_eq!((pool.nodes(), pool.threads_of(0), pool.threads_of(1)), (2, 1, 1));
        // Thread 1 is node 1's only thread: the second slice, list[1].
        let seen = std::sync::Mutex::new(None);
        pool.parallel_for_nodes(&[0, 1], &|node, _| {
            assert_eq!(node, 1);
            *seen.lock().unwrap() = Some((thread_index(), allowed_cores()));
        });
        assert_eq!(seen.into_inner().unwrap(), Some((1, vec![list[1]])));
    }

    #[test]
    fn experts_go_round_robin_over_nodes() {
        assert_eq!((0..5).map(|e| expert_node(e, 2)).collect::<Vec<_>>(), [0, 1, 0, 1, 0]);
        assert_eq!(expert_node(7, 1), 0);
        assert_eq!(expert_node(7, 0), 0, "a pool has at least one node");
    }
}
