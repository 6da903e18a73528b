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
    /// How long a turn lasts on a --turns-gpu, in milliseconds.
    #[arg(
        long,
        value_name = "MS",
        default_value_t = DEFAULT_TURN_MS,
        value_parser = clap::value_parser!(u32).range(1..=100),
        requires = "turns_gpus"
    )]
    pub turn_ms: u32,
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
    /// The options, `None` without `--turns-gpu`; each GPU by the UUID the
    /// observer reports, once. A GPU of `corun` is refused.
    pub fn options(
        &self,
        gpus: &[GpuInfo],
        corun: Option<&CorunOptions>,
    ) -> Result<Option<TurnOptions>, TurnError> {
        if self.turns_gpus.is_empty() {
            return Ok(None);
        }
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
        Ok(Some(TurnOptions {
            gpus: uuids,
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
        assert_eq!(options(&[], &gpus), Ok(None));
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
        assert_eq!(
            apart.expect("options").expect("turns").gpus,
            [gpus[0].uuid.clone()]
        );
    }

    #[test]
    fn a_turn_is_1_to_100_ms_and_needs_a_turns_gpu() {
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
        assert!(parse(&["--turn-ms", "7"]).is_err(), "no --turns-gpu");
    }
}
