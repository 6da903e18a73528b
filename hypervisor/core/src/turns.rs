//! Which GPUs of the node take turns: on a time-sliced GPU whose batch pods
//! take turns, one pod at a time launches, for a turn of a few milliseconds
//! ([`gpushare_utils::priority::TurnLine`]). The limiters take turns on a GPU
//! while its line of the priority table says a turn's length; the daemon
//! says which GPUs do (`--turns-gpu`, `--turn-ms`: [`TurnArgs`]).
//!
//! Every pod may write the priority table, so the daemon's [`TurnPlan`] is
//! what holds: when the node tables are made, and at every check of them
//! (once a second, [`crate::node_tables::NodeTables::check`]), it claims
//! each turns GPU's line and sets its turn's length, and sets to 0 that of
//! every other GPU of the node that has a line.

mod flags;

use std::sync::atomic::Ordering;

use gpushare_utils::limits::uuid_key;
use gpushare_utils::priority::NodePriority;
use hypervisor_observer::GpuInfo;
use serde::{Deserialize, Serialize};

pub use flags::{DEFAULT_TURN_MS, TurnArgs, TurnError};

/// The GPUs whose batch pods take turns, and how long a turn lasts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnOptions {
    /// By the observer's UUID, each once.
    pub gpus: Vec<String>,
    /// How long a turn lasts, µs.
    pub quantum_us: u32,
}

impl TurnOptions {
    /// Whether GPU `uuid` takes turns.
    pub fn covers(&self, uuid: &str) -> bool {
        self.gpus.iter().any(|g| g.eq_ignore_ascii_case(uuid))
    }
}

/// Per GPU of the node, the turn's length its line must say (0: no turns).
#[derive(Debug, Default)]
pub struct TurnPlan {
    lines: Vec<Planned>,
}

#[derive(Debug)]
struct Planned {
    gpu: GpuInfo,
    key: u64,
    quantum_us: u32,
    /// Whether the line was set once already: a later change is a pod's
    /// (as is any turn on a GPU that takes none).
    set: bool,
    /// Whether a pod's change, or no free line, was logged as a warning
    /// (later ones are logged at debug level: a pod may rewrite every second).
    warned: bool,
}

impl TurnPlan {
    /// The plan for the node's `gpus`: those `options` covers take turns,
    /// the rest none.
    pub fn new(gpus: &[GpuInfo], options: Option<&TurnOptions>) -> Self {
        let lines = gpus
            .iter()
            .map(|gpu| Planned {
                gpu: gpu.clone(),
                key: uuid_key(&gpu.uuid),
                quantum_us: options
                    .filter(|options| options.covers(&gpu.uuid))
                    .map_or(0, |options| options.quantum_us),
                set: false,
                warned: false,
            })
            .collect();
        Self { lines }
    }

    /// Makes `table`'s lines say the plan: claims each turns GPU's line and
    /// sets its turn's length; sets to 0 that of every other GPU of the
    /// plan that has a line.
    pub(crate) fn apply(&mut self, table: &NodePriority) {
        for line in &mut self.lines {
            let found = if line.quantum_us > 0 {
                table.claim_turn_line(line.key)
            } else {
                table.turn_line(line.key)
            };
            let Some(turns) = found else {
                if line.quantum_us > 0 {
                    line.warn(
                        "no turn line is free in the priority table: its pods do not take turns",
                    );
                }
                continue;
            };
            let written = turns.quantum_us.load(Ordering::Acquire);
            if written == line.quantum_us {
                line.set = true;
                continue;
            }
            turns.set_quantum_us(line.quantum_us);
            if line.set || line.quantum_us == 0 {
                line.warn("a turn's length on the GPU was changed in the priority table: set back");
            } else {
                tracing::info!(
                    gpu = line.gpu.uuid,
                    turn_us = line.quantum_us,
                    "batch pods take turns on the GPU"
                );
            }
            line.set = true;
        }
    }

    /// What `table` says of each GPU's turns at `now_ns` (`CLOCK_MONOTONIC`);
    /// `pod` names a holder by its pod key.
    pub fn status(
        &self,
        table: Option<&NodePriority>,
        now_ns: u64,
        pod: impl Fn(u64) -> Option<String>,
    ) -> Vec<GpuTurns> {
        self.lines
            .iter()
            .map(|line| {
                let view = table
                    .and_then(|table| table.turn_line(line.key))
                    .map(|turns| turns.view(now_ns));
                let holder_key = view.map_or(0, |view| view.holder);
                GpuTurns {
                    gpu: line.gpu.uuid.clone(),
                    index: line.gpu.index,
                    takes_turns: line.quantum_us > 0,
                    quantum_us: view.map_or(0, |view| view.quantum_us),
                    holder: (holder_key != 0).then(|| pod(holder_key)).flatten(),
                    holder_key,
                    wanting: view.map_or(0, |view| view.wanting),
                    handovers: view.map_or(0, |view| view.handovers),
                }
            })
            .collect()
    }
}

impl Planned {
    fn warn(&mut self, what: &str) {
        if self.warned {
            tracing::debug!(gpu = self.gpu.uuid, "{what}");
        } else {
            tracing::warn!(gpu = self.gpu.uuid, "{what}");
            self.warned = true;
        }
    }
}

/// One GPU's turns, as the status shows them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct GpuTurns {
    /// The GPU's UUID.
    pub gpu: String,
    /// Its NVML index.
    pub index: u32,
    /// Whether the daemon has its batch pods take turns (`--turns-gpu`).
    pub takes_turns: bool,
    /// How long a turn lasts, µs, as its line says now (0: no turns).
    pub quantum_us: u64,
    /// The pod whose turn it is, by id; `None`: nobody's, or a pod the
    /// daemon does not know.
    pub holder: Option<String>,
    /// The holder's pod key; 0: nobody's.
    pub holder_key: u64,
    /// Pods that want a turn now.
    pub wanting: usize,
    /// Turns handed from one pod to another since the line was claimed.
    pub handovers: u64,
}
