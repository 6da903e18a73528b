//! Which GPUs of the node take turns: on a time-sliced GPU whose batch pods
//! take turns, one pod at a time launches, for a turn of a few milliseconds
//! ([`gpushare_utils::priority::TurnLine`]). The limiters take turns on a GPU
//! while its line of the priority table says a turn's length; the daemon
//! says which GPUs do (`--turns-gpu`, `--turn-ms`, `--no-auto-turns`:
//! [`TurnArgs`]).
//!
//! A GPU named by `--turns-gpu` always takes turns. Every other time-sliced
//! GPU takes them by itself ([`TurnPlan::contended`]): while two or more
//! batch pods with a compute cap want it, and until none or one has for
//! [`CALM`]. Host-synchronised pods (a loop that waits for each step, as
//! inference servers do) leave a time-sliced GPU switching between their
//! contexts every few hundred microseconds, which costs it a tenth of its
//! time and serves them unevenly: capped pods then fall short of their
//! caps. Taking turns runs one context at a time, which serves them about
//! their caps (`docs/benchmarks.md`, dense packing); a capped pod already
//! waits whenever its budget runs out, and banks a turn of it while it
//! waits for its turn.
//!
//! Every pod may write the priority table, so the daemon's [`TurnPlan`] is
//! what holds: when the node tables are made, when a GPU starts or stops
//! taking turns, and at every check of them (once a second,
//! [`crate::node_tables::NodeTables::check`]), it claims each line of a GPU
//! taking turns and sets its turn's length, and sets to 0 that of every
//! other GPU of the node that has a line.

mod flags;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gpushare_utils::limits::uuid_key;
use gpushare_utils::priority::NodePriority;
use hypervisor_observer::GpuInfo;
use serde::{Deserialize, Serialize};

pub use flags::{DEFAULT_TURN_MS, TurnArgs, TurnError};

/// How long a GPU that takes turns by itself keeps them once fewer than two
/// capped batch pods want it: pods that pause between bursts (a server
/// between requests) keep their turns, and a GPU does not flip between
/// modes at every pause.
pub const CALM: Duration = Duration::from_secs(1);

/// The GPUs whose batch pods take turns, and how long a turn lasts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnOptions {
    /// Always, by the observer's UUID, each once (`--turns-gpu`).
    pub gpus: Vec<String>,
    /// While two or more capped batch pods want them, by the observer's
    /// UUID: the node's time-sliced GPUs not in `gpus` (none with
    /// `--no-auto-turns`).
    pub auto_gpus: Vec<String>,
    /// How long a turn lasts, µs.
    pub quantum_us: u32,
}

impl TurnOptions {
    /// Whether GPU `uuid` always takes turns.
    pub fn covers(&self, uuid: &str) -> bool {
        self.gpus.iter().any(|g| g.eq_ignore_ascii_case(uuid))
    }

    /// Whether GPU `uuid` takes turns while capped batch pods contend for it.
    pub fn covers_auto(&self, uuid: &str) -> bool {
        self.auto_gpus.iter().any(|g| g.eq_ignore_ascii_case(uuid))
    }
}

/// When a GPU takes turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Never,
    Always,
    /// While capped batch pods contend for it ([`TurnPlan::contended`]).
    Auto,
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
    mode: Mode,
    /// A turn's length while the GPU takes turns, µs.
    quantum_us: u32,
    /// [`Mode::Auto`]: whether it takes turns now.
    engaged: bool,
    /// [`Mode::Auto`], engaged: since when fewer than two capped batch pods
    /// want the GPU.
    calm_since: Option<Instant>,
    /// What the daemon last wrote on the line, or found right there: a line
    /// saying otherwise was changed by a pod (as is any turn on a GPU that
    /// takes none, before the daemon wrote its line).
    said: Option<u32>,
    /// Whether a pod's change, or no free line, was logged as a warning
    /// (later ones are logged at debug level: a pod may rewrite every second).
    warned: bool,
}

impl TurnPlan {
    /// The plan for the node's `gpus`: those `options` covers always take
    /// turns, those it covers as automatic take them while contended, the
    /// rest none.
    pub fn new(gpus: &[GpuInfo], options: Option<&TurnOptions>) -> Self {
        let lines = gpus
            .iter()
            .map(|gpu| {
                let mode = match options {
                    Some(options) if options.covers(&gpu.uuid) => Mode::Always,
                    Some(options) if options.covers_auto(&gpu.uuid) => Mode::Auto,
                    _ => Mode::Never,
                };
                Planned {
                    gpu: gpu.clone(),
                    key: uuid_key(&gpu.uuid),
                    mode,
                    quantum_us: options.map_or(0, |options| options.quantum_us),
                    engaged: false,
                    calm_since: None,
                    said: None,
                    warned: false,
                }
            })
            .collect();
        Self { lines }
    }

    /// `capped` batch pods with a compute cap want GPU `uuid` at `now`: a GPU
    /// that takes turns by itself starts at two, and stops once fewer have
    /// for [`CALM`]. Returns whether it started or stopped (its line is then
    /// to be written: [`Self::apply`]).
    pub fn contended(&mut self, uuid: &str, capped: usize, now: Instant) -> bool {
        let Some(line) = self
            .lines
            .iter_mut()
            .find(|line| line.mode == Mode::Auto && line.gpu.uuid.eq_ignore_ascii_case(uuid))
        else {
            return false;
        };
        if capped >= 2 {
            line.calm_since = None;
            if line.engaged {
                return false;
            }
            line.engaged = true;
            tracing::info!(
                gpu = line.gpu.uuid,
                capped,
                turn_us = line.quantum_us,
                "capped batch pods contend for the GPU: they take turns"
            );
            return true;
        }
        if !line.engaged {
            return false;
        }
        let since = *line.calm_since.get_or_insert(now);
        if now.saturating_duration_since(since) < CALM {
            return false;
        }
        line.engaged = false;
        line.calm_since = None;
        tracing::info!(
            gpu = line.gpu.uuid,
            "fewer than two capped batch pods want the GPU: turns stop"
        );
        true
    }

    /// Makes `table`'s lines say the plan: claims the line of each GPU that
    /// takes turns now and sets its turn's length; sets to 0 that of every
    /// other GPU of the plan that has a line.
    pub(crate) fn apply(&mut self, table: &NodePriority) {
        for line in &mut self.lines {
            let target = line.target_us();
            let found = if target > 0 {
                table.claim_turn_line(line.key)
            } else {
                table.turn_line(line.key)
            };
            let Some(turns) = found else {
                if target > 0 {
                    line.warn(
                        "no turn line is free in the priority table: its pods do not take turns",
                    );
                }
                continue;
            };
            let written = turns.quantum_us.load(Ordering::Acquire);
            if written != target {
                turns.set_quantum_us(target);
                match line.said {
                    Some(said) if said == written => {}
                    None if target > 0 => tracing::info!(
                        gpu = line.gpu.uuid,
                        turn_us = target,
                        "batch pods take turns on the GPU"
                    ),
                    _ => line.warn(
                        "a turn's length on the GPU was changed in the priority table: set back",
                    ),
                }
            }
            line.said = Some(target);
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
                    takes_turns: line.target_us() > 0,
                    automatic: line.mode == Mode::Auto,
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
    /// The turn's length the GPU's line must say now, µs (0: no turns).
    fn target_us(&self) -> u32 {
        match self.mode {
            Mode::Always => self.quantum_us,
            Mode::Auto if self.engaged => self.quantum_us,
            Mode::Auto | Mode::Never => 0,
        }
    }

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
    /// Whether the daemon has its batch pods take turns now (`--turns-gpu`,
    /// or by itself while capped batch pods contend for it).
    pub takes_turns: bool,
    /// Whether the GPU takes turns by itself, while capped batch pods
    /// contend for it (not a `--turns-gpu`).
    #[serde(default)]
    pub automatic: bool,
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
