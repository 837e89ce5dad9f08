//! An independent check of the pipeline's ordering on the device timelines.
//!
//! Each module moves Loading → Loaded → InUse → Used → Freed. The steps are
//! taken by host callbacks enqueued on the streams themselves (the copy
//! stream marks Loaded when its copies are done; the compute stream marks
//! InUse just before the module's kernels and Used just after), and by the
//! loader and unloader on the host. A step from any other phase is a
//! violation: a module used before its load completed, a slot reloaded or
//! freed while still in use.

use super::signal::lock;
use std::sync::Mutex;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Loading,
    Loaded,
    InUse,
    Used,
    Freed,
}

pub struct Audit {
    phases: Mutex<Vec<Option<Phase>>>,
    violations: Mutex<Vec<String>>,
}

impl Audit {
    pub fn new(modules: usize) -> Self {
        Audit { phases: Mutex::new(vec![None; modules]), violations: Mutex::new(vec![]) }
    }

    /// Move `module` from `from` to `to`, recording a violation if it was elsewhere.
    pub fn step(&self, module: usize, from: Option<Phase>, to: Phase) {
        let mut phases = lock(&self.phases);
        if phases[module] != from {
            lock(&self.violations).push(format!("module {module}: {to:?} while {:?} (expected {from:?})", phases[module]));
        }
        phases[module] = Some(to);
    }

    /// A slot is about to be loaded again: its previous occupant must be freed.
    pub fn expect_freed(&self, module: usize, reuser: usize) {
        let phase = lock(&self.phases)[module];
        if phase != Some(Phase::Freed) {
            lock(&self.violations).push(format!("module {reuser} loads into the slot of module {module}, which is {phase:?}"));
        }
    }

    pub fn violations(&self) -> Vec<String> {
        lock(&self.violations).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_steps_pass_and_others_are_caught() {
        let a = Audit::new(2);
        a.step(0, None, Phase::Loading);
        a.step(0, Some(Phase::Loading), Phase::Loaded);
        a.step(0, Some(Phase::Loaded), Phase::InUse);
        a.step(0, Some(Phase::InUse), Phase::Used);
        a.step(0, Some(Phase::Used), Phase::Freed);
        a.expect_freed(0, 1);
        assert!(a.violations().is_empty());
        // Used before its load completed, its slot reloaded while in use,
        // then freed while in use.
        a.step(1, None, Phase::Loading);
        a.step(1, Some(Phase::Loaded), Phase::InUse);
        a.expect_freed(1, 0);
        a.step(1, Some(Phase::Used), Phase::Freed);
        assert_eq!(a.violations().len(), 3, "{:?}", a.violations());
    }
}
