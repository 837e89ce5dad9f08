//! `duplex serve` gives the decode and prefill workers disjoint cores, and
//! every thread of each worker stays on its own set.

use duplex_kernels::pool::{allowed_cores, parse_cpu_list};
use duplex_tests::*;

/// Each thread of process `pid`: its name and the cores it may run on.
fn thread_cores(pid: u32) -> Vec<(String, Vec<usize>)> {
    let mut out = vec![];
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else { continue }; // exited meanwhile
        let field = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_else(|| panic!("no {key} in {status}")).trim().to_string();
        out.push((field("Name:"), parse_cpu_list(&field("Cpus_allowed_list:")).unwrap()));
    }
    assert!(!out.is_empty());
    out
}

#[test]
fn serve_gives_each_worker_its_own_cores() {
    let _serial = serial();
    let server = Server::start(Options::default());
    let allowed = allowed_cores();
    // The test config's prefill worker runs on the CPU: the two halves,
    // decode the lower one; one core is shared.
    let n = allowed.len();
    let (decode, prefill) = if n == 1 { (allowed.clone(), allowed.clone()) } else { (allowed[..n - n / 2].to_vec(), allowed[n - n / 2..].to_vec()) };
    for (name, set) in [("decode worker", &decode), ("prefill worker", &prefill)] {
        let pid = server.pid_of(name);
        for (thread, cores) in thread_cores(pid) {
            assert!(cores.iter().all(|c| set.contains(c)), "{name} thread {thread:?} may run on {cores:?}, outside its set {set:?}");
        }
    }
    let log = server.log();
    if n > 1 {
        let list = duplex_kernels::pool::format_cpu_list;
        let said = format!("cores: decode worker {}, prefill worker {}", list(&decode), list(&prefill));
        assert!(log.contains(&said), "{said:?} not in the log:\n{log}");
        assert!(decode.iter().all(|c| !prefill.contains(c)));
    }
    assert_eq!(log.matches("compute pool: 1 threads").count(), 2, "each worker logs its pool:\n{log}");
}
