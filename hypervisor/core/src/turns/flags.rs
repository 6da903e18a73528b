//! `serve`'s turn flags, and the [`TurnOptions`] they make once the GPUs and
//! the co-run ones are known (an index names a GPU through the observer).

use hypervisor_corun::CorunOptions;
use hypervisor_observer::GpuInfo;

use super::TurnOptions;

/// How long a turn lasts by default, ms.
pub const DEFAULT_TURN_MS: u32 = 10;

/// `serve`'s turn flags.
#[derive(Debug, Clone, clap::Args)]
pub struct TurnArgs {
    /// Have this time-sliced GPU's batch pods take turns (one pod at a time
    /// launches, for --turn-ms each): its UUID or index; repeatable. Not a
    /// --corun-gpu.
    #[arg(long = "turns-gpu", value_name = "UUID|INDEX")]
    pub turns_gpus: Vec<String>,
    /// How long a turn lasts, in milliseconds.
    #[arg(
        long,
        value_name = "MS",
        default_value_t = DEFAULT_TURN_MS,
        value_parser = clap::value_parser!(u32).range(1..=100)
    )]
    pub turn_ms: u32,
    /// Take turns only on the --turns-gpu GPUs. Without it, every other
    /// time-sliced GPU takes turns by itself while two or more batch pods
    /// with a compute cap want it.
    #[arg(long)]
    pub no_auto_turns: bool,
}

/// Why the turn flags cannot be followed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TurnError {
    /// `--turns-gpu` names a GPU the observer does not list.
    #[error("--turns-gpu {0}: no such GPU (a UUID or an index the observer lists)")]
    UnknownGpu(String),
    /// `--turns-gpu` names a co-run GPU.
    #[error(
        "--turns-gpu {named}: {uuid} is also a --corun-gpu; its pods' processes are clients of \
         one MPS context there, and turns are for time-sliced GPUs"
    )]
    Corun {
        /// As the flag named it.
        named: String,
        /// Its UUID.
        uuid: String,
    },
}

impl TurnArgs {
    /// The options, `None` where no GPU takes turns (no `--turns-gpu`, and
    /// `--no-auto-turns`); each GPU by the UUID the observer reports, once.
    /// A `--turns-gpu` of `corun` is refused; the GPUs that take turns by
    /// themselves are the others, less those of `corun`.
    pub fn options(
        &self,
        gpus: &[GpuInfo],
        corun: Option<&CorunOptions>,
    ) -> Result<Option<TurnOptions>, TurnError> {
        let mut uuids: Vec<String> = Vec::new();
        for named in &self.turns_gpus {
            let uuid = GpuInfo::find(gpus, named)
                .map(|g| g.uuid.clone())
                .ok_or_else(|| TurnError::UnknownGpu(named.clone()))?;
            if corun.is_some_and(|corun| corun.covers(&uuid)) {
                return Err(TurnError::Corun {
                    named: named.clone(),
                    uuid,
                });
            }
            if !uuids.contains(&uuid) {
                uuids.push(uuid);
            }
        }
        let auto_gpus: Vec<String> = if self.no_auto_turns {
            Vec::new()
        } else {
            gpus.iter()
                .map(|gpu| &gpu.uuid)
                .filter(|uuid| !uuids.contains(uuid))
                .filter(|uuid| !corun.is_some_and(|corun| corun.covers(uuid)))
                .cloned()
                .collect()
        };
        if uuids.is_empty() && auto_gpus.is_empty() {
            return Ok(None);
        }
        Ok(Some(TurnOptions {
            gpus: uuids,
            auto_gpus,
            quantum_us: self.turn_ms * 1_000,
        }))
    }
}
