//! `restrict_process_to` moves every thread of the process, including those
//! started before it was called. Its own test binary (its own process),
//! since it changes the affinity of every thread of the process it runs in.

use duplex_kernels::pool::{allowed_cores, restrict_process_to};
use std::sync::mpsc;

#[test]
fn restricting_the_process_moves_threads_that_already_run() {
    let before = allowed_cores();
    let target = vec![*before.last().unwrap()];
    // A thread started before the call, which reads its own affinity when asked.
    let (ask, asked) = mpsc::channel::<()>();
    let (tell, told) = mpsc::channel();
    let early = std::thread::spawn(move || {
        while asked.recv().is_ok() {
            tell.send(allowed_cores()).unwrap();
        }
    });
    ask.send(()).unwrap();
    assert_eq!(told.recv().unwrap(), before);
    restrict_process_to(&target).unwrap();
    ask.send(()).unwrap();
    assert_eq!(told.recv().unwrap(), target, "a thread started earlier");
    assert_eq!(allowed_cores(), target, "the calling thread");
    assert_eq!(std::thread::spawn(allowed_cores).join().unwrap(), target, "a thread started later");
    drop(ask);
    early.join().unwrap();
    assert!(restrict_process_to(&[]).is_err());
    assert!(restrict_process_to(&[1 << 20]).unwrap_err().contains("beyond"));
}
