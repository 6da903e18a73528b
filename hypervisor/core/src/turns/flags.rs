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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use hypervisor_corun::CorunArgs;
    use hypervisor_observer::{GpuObserver, SimulatedGpus};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        turns: TurnArgs,
        #[command(flatten)]
        corun: CorunArgs,
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("hv").chain(args.iter().copied()))
    }

    fn options(args: &[&str], gpus: &[GpuInfo]) -> Result<Option<TurnOptions>, TurnError> {
        let cli = parse(args).expect("flags parse");
        let corun = cli.corun.options(gpus, false).expect("co-run options");
        cli.turns.options(gpus, corun.as_ref())
    }

    #[test]
    fn an_index_or_a_uuid_names_a_turns_gpu_once() {
        let gpus = SimulatedGpus::new(3).gpus().expect("gpus");
        assert_eq!(options(&["--no-auto-turns"], &gpus), Ok(None));
        let uuid2 = gpus[2].uuid.to_lowercase();
        let args = [
            "--turns-gpu",
            "0",
            "--turns-gpu",
            &uuid2,
            "--turns-gpu",
            "2",
        ];
        assert_eq!(
            options(&args, &gpus),
            Ok(Some(TurnOptions {
                gpus: vec![gpus[0].uuid.clone(), gpus[2].uuid.clone()],
                auto_gpus: vec![gpus[1].uuid.clone()],
                quantum_us: DEFAULT_TURN_MS * 1_000,
            }))
        );
        let seven = options(&["--turns-gpu", "1", "--turn-ms", "7"], &gpus);
        assert_eq!(seven.expect("options").expect("turns").quantum_us, 7_000);
    }

    #[test]
    fn an_unknown_gpu_is_refused_by_its_name() {
        let gpus = SimulatedGpus::new(2).gpus().expect("gpus");
        for unknown in ["2", "GPU-nope"] {
            let error = options(&["--turns-gpu", unknown], &gpus).expect_err("unknown");
            assert_eq!(error, TurnError::UnknownGpu(unknown.to_owned()));
            assert!(error.to_string().contains(unknown), "{error}");
        }
    }

    #[test]
    fn a_corun_gpu_cannot_take_turns() {
        let gpus = SimulatedGpus::new(2).gpus().expect("gpus");
        let error = options(
            &[
                "--corun-gpu",
                &gpus[1].uuid,
                "--turns-gpu",
                "0",
                "--turns-gpu",
                "1",
            ],
            &gpus,
        )
        .expect_err("refused");
        assert_eq!(
            error,
            TurnError::Corun {
                named: "1".to_owned(),
                uuid: gpus[1].uuid.clone(),
            }
        );
        let text = error.to_string();
        assert!(
            text.contains("--corun-gpu") && text.contains(&gpus[1].uuid),
            "{text}"
        );
        // Each on GPUs of its own: both go.
        let apart = options(&["--corun-gpu", "1", "--turns-gpu", "0"], &gpus);
        let apart = apart.expect("options").expect("turns");
        assert_eq!(apart.gpus, [gpus[0].uuid.clone()]);
        assert!(apart.auto_gpus.is_empty(), "{apart:?}");
    }

    #[test]
    fn every_other_time_sliced_gpu_takes_turns_by_itself_unless_told_not_to() {
        let gpus = SimulatedGpus::new(3).gpus().expect("gpus");
        let by_default = options(&[], &gpus).expect("options").expect("turns");
        assert!(by_default.gpus.is_empty(), "{by_default:?}");
        assert_eq!(
            by_default.auto_gpus,
            gpus.iter().map(|g| g.uuid.clone()).collect::<Vec<_>>()
        );
        assert_eq!(by_default.quantum_us, DEFAULT_TURN_MS * 1_000);
        // Not a co-run GPU, nor one that always takes turns.
        let some = options(
            &["--corun-gpu", "2", "--turns-gpu", "0", "--turn-ms", "4"],
            &gpus,
        )
        .expect("options")
        .expect("turns");
        assert_eq!(
            (some.gpus, some.auto_gpus, some.quantum_us),
            (
                vec![gpus[0].uuid.clone()],
                vec![gpus[1].uuid.clone()],
                4_000
            )
        );
        // Told not to: only the named ones.
        let named = options(&["--turns-gpu", "1", "--no-auto-turns"], &gpus)
            .expect("options")
            .expect("turns");
        assert_eq!(
            (named.gpus, named.auto_gpus),
            (vec![gpus[1].uuid.clone()], Vec::new())
        );
    }

    #[test]
    fn a_turn_is_1_to_100_ms() {
        for ms in ["0", "101", "x"] {
            assert!(
                parse(&["--turns-gpu", "0", "--turn-ms", ms]).is_err(),
                "{ms}"
            );
        }
        for ms in ["1", "100"] {
            assert!(
                parse(&["--turns-gpu", "0", "--turn-ms", ms]).is_ok(),
                "{ms}"
            );
        }
        // The length of the turns GPUs take by themselves too.
        assert!(parse(&["--turn-ms", "7"]).is_ok(), "no --turns-gpu");
    }
}
