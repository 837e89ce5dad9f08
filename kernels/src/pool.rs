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

/// How many threads each NUMA node gets, and whether to pin them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    pub threads_per_node: Vec<usize>,
    /// Pin worker thread `i` (counted over all nodes, the caller being 0) to core `i`.
    pub pin: bool,
}

impl PoolConfig {
    /// One node with `threads` threads.
    pub fn single_node(threads: usize) -> Self {
        PoolConfig { threads_per_node: vec![threads.max(1)], pin: false }
    }

    /// One node using every core this process may run on, pinned.
    pub fn all_cores() -> Self {
        Self::split(0, 1).expect("one node always fits")
    }

    /// `threads` pinned threads (0: every core) split as evenly as possible
    /// into `nodes` NUMA nodes (simulated on a one-node machine).
    pub fn split(threads: usize, nodes: usize) -> Result<Self, String> {
        let threads = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        if nodes == 0 || nodes > threads {
            return Err(format!("threads must be at least the number of NUMA nodes, and nodes at least 1 ({threads} threads, {nodes} nodes)"));
        }
        let per = threads / nodes;
        let mut threads_per_node = vec![per; nodes];
        threads_per_node[0] += threads - per * nodes;
        Ok(PoolConfig { threads_per_node, pin: true })
    }
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
        let cores = if config.pin { core_affinity::get_core_ids().unwrap_or_default() } else { vec![] };
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
        let pool = ThreadPool::new(&PoolConfig { threads_per_node: vec![1, 2], pin: false });
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
}
