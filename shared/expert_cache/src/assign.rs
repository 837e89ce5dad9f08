//! Where each activated routed expert of one MoE layer runs this step: on the
//! CPU, on the device from the cache, or on the device after a copy over PCIe.
//!
//! Three assignments, switchable by config (`expert_assignment`):
//! - [`AssignmentKind::Static`] (KTransformers): every routed expert on the CPU.
//! - [`AssignmentKind::HybriMoe`]: HybriMoE's dynamic intra-layer scheduling
//!   (§IV-B), a simulation of the CPU, device and PCIe timelines.
//! - [`AssignmentKind::Dali`]: DALI's Greedy Assignment (Algorithm 1).
//!
//! # The layer-time model
//!
//! Every plan is scored by the same model, [`simulate`], which is also how the
//! hybrid placement is expected to execute a plan:
//! - the CPU runs its experts one after another: `Σ cpu(tokens)`;
//! - PCIe copies the [`Side::DeviceAfterTransfer`] experts back to back from
//!   the layer's start, highest load first;
//! - the device runs its cached experts first, then each copied expert as soon
//!   as both its copy has landed and the device is free.
//!
//! The layer takes `max(cpu, device)` ([`Plan::predicted`]). For a fixed split
//! this device order is the best one (Johnson's rule for a two-stage flow
//! shop: jobs with no copy first, then, with the copy time constant and device
//! time growing with load, highest load first), so the model's value of a
//! split is that split's best time and the exhaustive optimum over splits is
//! the model's optimum.
//!
//! An expert routed no tokens (`tokens == 0`) has nothing to compute: every
//! assignment leaves it on the CPU side, where it costs nothing and wastes
//! no copy.
//!
//! Decisions are allocation-free once a [`Scratch`] and a [`Plan`] have grown
//! to the layer's size: the hybrid placement calls [`assign_into`] once per
//! MoE layer per step (see `examples/assign_overhead.rs` for its cost).

use crate::{Active, CostModel};
use std::cmp::Reverse;
use std::fmt;
use std::str::FromStr;

/// Which assignment decides the sides (config `expert_assignment`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AssignmentKind {
    Static,
    HybriMoe,
    Dali,
}

impl AssignmentKind {
    pub const ALL: [AssignmentKind; 3] =
        [AssignmentKind::Static, AssignmentKind::HybriMoe, AssignmentKind::Dali];

    pub fn as_str(self) -> &'static str {
        match self {
            AssignmentKind::Static => "static",
            AssignmentKind::HybriMoe => "hybrimoe",
            AssignmentKind::Dali => "dali",
        }
    }
}

impl fmt::Display for AssignmentKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not one of [`AssignmentKind::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown expert assignment {0:?}; expected one of: static, hybrimoe, dali")]
pub struct ParseAssignmentKindError(pub String);

impl FromStr for AssignmentKind {
    type Err = ParseAssignmentKindError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        AssignmentKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| ParseAssignmentKindError(s.to_string()))
    }
}

/// Where one activated expert runs this layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Cpu,
    /// On the device, from the cache.
    Device,
    /// Copied over PCIe this layer, then run on the device.
    DeviceAfterTransfer,
}

/// The simulated end of each timeline of a layer, in seconds from its start.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timelines {
    pub cpu: f64,
    pub device: f64,
    pub pcie: f64,
}

impl Timelines {
    /// The layer's time: the later of the two compute sides (the copies end
    /// before the device's last expert starts, so PCIe never ends last).
    pub fn layer(&self) -> f64 {
        self.cpu.max(self.device)
    }
}

/// An assignment of one layer's activated experts, with its simulated times.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// Parallel to the `active` slice it was made for.
    pub sides: Vec<Side>,
    pub cpu: f64,
    pub device: f64,
    pub pcie: f64,
    /// Predicted layer time: `max(cpu, device)` under [`simulate`]'s model.
    pub predicted: f64,
}

impl Plan {
    fn set_times(&mut self, t: Timelines) {
        self.cpu = t.cpu;
        self.device = t.device;
        self.pcie = t.pcie;
        self.predicted = t.layer();
    }
}

/// Reusable buffers, so that a decision per layer per step allocates nothing
/// once they have grown to the largest layer seen.
#[derive(Clone, Debug, Default)]
pub struct Scratch {
    /// Indices into `active` of the experts with tokens, highest load first.
    by_load: Vec<usize>,
    /// HybriMoE's two-ended queue: cached by load descending, then uncached.
    seq: Vec<usize>,
    /// DALI's sort keys, `|t_gpu − t_cpu|` per expert of `active`.
    keys: Vec<f64>,
}

fn cpu_cost(cost: &CostModel, a: &Active) -> f64 {
    if a.tokens == 0 {
        0.0
    } else {
        cost.cpu(a.tokens)
    }
}

fn device_cost(cost: &CostModel, a: &Active) -> f64 {
    if a.tokens == 0 {
        0.0
    } else {
        cost.device(a.tokens)
    }
}

/// Fills `by_load` with the experts that have tokens, highest load first;
/// equal loads keep their order in `active` so every decision is deterministic.
fn sort_by_load(active: &[Active], by_load: &mut Vec<usize>) {
    by_load.clear();
    by_load.extend((0..active.len()).filter(|&i| active[i].tokens > 0));
    by_load.sort_unstable_by_key(|&i| (Reverse(active[i].tokens), i));
}

/// Decides where each of `active` runs; see [`assign_into`] for a variant
/// that reuses the caller's buffers.
pub fn assign(kind: AssignmentKind, active: &[Active], cost: &CostModel) -> Plan {
    let mut plan = Plan::default();
    assign_into(kind, active, cost, &mut Scratch::default(), &mut plan);
    plan
}

/// [`assign`] into `plan`, reusing its `sides` and `scratch`'s buffers.
pub fn assign_into(
    kind: AssignmentKind,
    active: &[Active],
    cost: &CostModel,
    scratch: &mut Scratch,
    plan: &mut Plan,
) {
    plan.sides.clear();
    plan.sides.resize(active.len(), Side::Cpu);
    let times = match kind {
        AssignmentKind::Static => Timelines {
            cpu: active.iter().map(|a| cpu_cost(cost, a)).sum(),
            device: 0.0,
            pcie: 0.0,
        },
        AssignmentKind::HybriMoe => {
            sort_by_load(active, &mut scratch.by_load);
            hybrimoe_timelines(
                active,
                cost,
                &scratch.by_load,
                |i| active[i].cached,
                &mut scratch.seq,
                Some(&mut plan.sides),
            )
        }
        AssignmentKind::Dali => {
            dali_sides(active, cost, &mut scratch.by_load, &mut scratch.keys, &mut plan.sides);
            simulate_with(active, &plan.sides, cost, &mut scratch.by_load)
        }
    };
    plan.set_times(times);
}

/// The simulated timelines of executing `sides` (parallel to `active`) as
/// the module documentation describes. A [`Side::Device`] expert is taken to
/// be resident whatever its `cached` flag says: the plan is what runs.
///
/// Returns `None` when `sides` is not parallel to `active`.
pub fn simulate(active: &[Active], sides: &[Side], cost: &CostModel) -> Option<Timelines> {
    (active.len() == sides.len()).then(|| simulate_with(active, sides, cost, &mut Vec::new()))
}

fn simulate_with(
    active: &[Active],
    sides: &[Side],
    cost: &CostModel,
    by_load: &mut Vec<usize>,
) -> Timelines {
    let mut t = Timelines::default();
    for (a, side) in active.iter().zip(sides) {
        match side {
            Side::Cpu => t.cpu += cpu_cost(cost, a),
            Side::Device => t.device += device_cost(cost, a),
            Side::DeviceAfterTransfer => {}
        }
    }
    sort_by_load(active, by_load);
    for &i in by_load.iter() {
        if sides[i] == Side::DeviceAfterTransfer {
            t.pcie += cost.transfer;
            t.device = t.device.max(t.pcie) + device_cost(cost, &active[i]);
        }
    }
    t
}

/// HybriMoE's simulation (§IV-B, and `HSS` in its released code): the
/// activated experts form one queue, cached ones by load descending followed
/// by uncached ones by load descending. The device takes from the front
/// (cached experts, highest load first, then uncached ones, highest load
/// first, each copied over PCIe right after the previous copy and run once
/// it has landed); the CPU takes from the back (uncached experts, lowest load
/// first, then — "when idle" — cached ones, lowest load first). At each step
/// the side whose timeline would end earlier with its next expert takes it,
/// ties to the device, until the queue is empty.
///
/// Choices the paper leaves open, taken from its code: the comparison is of
/// the two sides' end times after their candidate expert (the code's
/// `gpu_total + gpu_time <= cpu_total + cpu_time`), and copies start at the
/// layer's start and run back to back in the order the device claims them.
/// The paper also re-inserts a landed expert into the device's queue by load,
/// possibly ahead of lighter cached ones; that only reorders the device's
/// work, and running the cached ones first never ends later (no wait for a
/// copy can be filled better), so the code's order is kept.
/// One difference from the code: it charges its CPU intercept once per layer
/// (first CPU expert), whereas here every CPU expert costs
/// `cpu_fixed + cpu_per_token·tokens`, the cost model all assignments share.
///
/// `cached(i)` says whether `active[i]` is resident (the impact-driven
/// prefetch asks "what if it were"); `by_load` is [`sort_by_load`]'s order.
pub(crate) fn hybrimoe_timelines(
    active: &[Active],
    cost: &CostModel,
    by_load: &[usize],
    cached: impl Fn(usize) -> bool,
    seq: &mut Vec<usize>,
    mut sides: Option<&mut [Side]>,
) -> Timelines {
    seq.clear();
    seq.extend(by_load.iter().copied().filter(|&i| cached(i)));
    let n_cached = seq.len();
    seq.extend(by_load.iter().copied().filter(|&i| !cached(i)));

    let mut t = Timelines::default();
    let (mut front, mut back) = (0, seq.len());
    while front < back {
        let f = seq[front];
        let moved = front >= n_cached;
        let copy_end = t.pcie + cost.transfer;
        let device_end = if moved { t.device.max(copy_end) } else { t.device }
            + device_cost(cost, &active[f]);
        let b = seq[back - 1];
        let cpu_end = t.cpu + cpu_cost(cost, &active[b]);
        if device_end <= cpu_end {
            t.device = device_end;
            if moved {
                t.pcie = copy_end;
            }
            if let Some(sides) = sides.as_deref_mut() {
                sides[f] = if moved { Side::DeviceAfterTransfer } else { Side::Device };
            }
            front += 1;
        } else {
            t.cpu = cpu_end;
            if let Some(sides) = sides.as_deref_mut() {
                sides[b] = Side::Cpu;
            }
            back -= 1;
        }
    }
    t
}

/// DALI's Greedy Assignment (Algorithm 1): `t_gpu = max(transfer, compute)`
/// with no transfer for a cached expert, `t_cpu` the CPU cost; experts in
/// descending `|t_gpu − t_cpu|` (equal differences in `active` order) each go
/// to the side whose running total stays smaller with it, ties to the device.
/// An uncached expert given to the device is copied this layer. The running
/// totals are DALI's own estimate, which assumes a copy and its expert's
/// compute overlap fully; the plan's times are then [`simulate`]'s, which
/// does not, so DALI's predicted time can exceed the static one by at most
/// one expert's `min(transfer, compute)` (tests/assignment.rs).
fn dali_sides(
    active: &[Active],
    cost: &CostModel,
    order: &mut Vec<usize>,
    keys: &mut Vec<f64>,
    sides: &mut [Side],
) {
    let t_gpu = |a: &Active| {
        let transfer = if a.cached { 0.0 } else { cost.transfer };
        transfer.max(device_cost(cost, a))
    };
    keys.clear();
    keys.extend(active.iter().map(|a| (t_gpu(a) - cpu_cost(cost, a)).abs()));
    order.clear();
    order.extend((0..active.len()).filter(|&i| active[i].tokens > 0));
    order.sort_unstable_by(|&x, &y| keys[y].total_cmp(&keys[x]).then(x.cmp(&y)));

    let (mut total_gpu, mut total_cpu) = (0.0, 0.0);
    for &i in order.iter() {
        let a = &active[i];
        let (g, c) = (t_gpu(a), cpu_cost(cost, a));
        if total_gpu + g <= total_cpu + c {
            total_gpu += g;
            sides[i] = if a.cached { Side::Device } else { Side::DeviceAfterTransfer };
        } else {
            total_cpu += c;
            sides[i] = Side::Cpu;
        }
    }
}
