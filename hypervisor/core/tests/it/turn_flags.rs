//! `serve`'s turn flags: which GPUs take turns always (`--turns-gpu`, by
//! index or UUID, not a co-run one), which by themselves (every other
//! time-sliced GPU, unless `--no-auto-turns`), and a turn's length.

use clap::Parser;

use hypervisor_core::turns::{DEFAULT_TURN_MS, TurnArgs, TurnError, TurnOptions};
use hypervisor_corun::CorunArgs;
use hypervisor_observer::{GpuInfo, GpuObserver, SimulatedGpus};

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
