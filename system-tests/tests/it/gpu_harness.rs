//! The GPU check's harness and the benchmarks, in the test command's reach:
//! their own tests (`scripts/gpu/selftest`, pytest) parse every option,
//! compute their statistics and figures from known inputs, and run every
//! check and every benchmark dry against fakes of the CUDA programs, the
//! co-run and packing ones against this build's daemon (`--simulate-gpus`)
//! and the fake MPS control daemon. Without pytest the tests fail with the
//! command that installs it: a check that did not run never passes. The
//! harness's files and the benchmarks' run as two tests, at once: each
//! mostly waits on the programs it runs.

use std::path::Path;

use system_tests::{artifacts, tools};

const DRY_RUN: &str = "scripts/gpu/selftest/test_dry_run.py";

#[test]
fn the_gpu_check_runs_every_check_dry() {
    selftest(&[DRY_RUN]);
}

#[test]
fn the_benchmarks_and_the_harness_pass_their_own_tests() {
    selftest(&["scripts/gpu/selftest", &format!("--ignore={DRY_RUN}")]);
}

fn root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs pytest on these files of `scripts/gpu/selftest` (paths from the
/// repository's root, and pytest's options).
fn selftest(args: &[&str]) {
    // Built here, so that no selftest is skipped for want of a build.
    let daemon = artifacts::hypervisor();
    artifacts::limiter();
    mps_fake::program();
    let build = daemon.parent().expect("<target>/<profile>");
    let output = tools::command("python3")
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"])
        .args(args)
        .current_dir(root())
        .env("GPUSHARE_SELFTEST_TARGET", build)
        .env_remove("OUT")
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        !text.contains("No module named pytest"),
        "pytest is not installed (scripts/test.sh installs it under target/tools):\n{text}"
    );
    assert!(output.status.success(), "{text}");
    // Every test ran: a skipped one (an MPS daemon already running, say)
    // checked nothing.
    assert!(!text.contains(" skipped"), "{text}");
}
