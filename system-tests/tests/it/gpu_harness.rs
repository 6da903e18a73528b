//! The GPU check's harness and the benchmarks, in the test command's reach:
//! their own tests (`scripts/gpu/selftest`, pytest) parse every option,
//! compute their statistics and figures from known inputs, and run every
//! check and every benchmark dry against fakes of the CUDA programs, the
//! co-run and packing ones against this build's daemon (`--simulate-gpus`)
//! and the fake MPS control daemon. Without pytest the test fails with the
//! command that installs it: a check that did not run never passes.

use std::path::Path;

use system_tests::{artifacts, tools};

#[test]
fn the_gpu_harness_and_the_benchmarks_pass_their_own_tests() {
    // Built here, so that no selftest is skipped for want of a build.
    let daemon = artifacts::hypervisor();
    artifacts::limiter();
    mps_fake::program();
    let build = daemon.parent().expect("<target>/<profile>");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let output = tools::command("python3")
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"])
        .arg("scripts/gpu/selftest")
        .current_dir(&root)
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
