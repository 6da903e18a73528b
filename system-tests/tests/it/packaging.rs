//! The packaging checks, in the test command's reach: the rendered manifests
//! of deploy/ against the upstream schemas of Kubernetes 1.34 to 1.37
//! (scripts/validate-manifests.py), and the shipped limiter's glibc baseline
//! (scripts/build-limiter.sh, then scripts/check-glibc.py). Each fails, with
//! the command that installs what is missing, when its tools are not there:
//! a check that did not run never passes.

use std::path::{Path, PathBuf};
use std::process::Output;

use system_tests::tools;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const INSTALL: &str = "scripts/test.sh installs them under target/tools";

fn run(program: &str, args: &[&str]) -> Output {
    tools::command(program)
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}; {INSTALL}"))
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Exit status 2 of the scripts: a tool missing or not the pinned one.
fn fail_on_missing_tools(what: &str, output: &Output) {
    if output.status.code() == Some(2) {
        panic!(
            "{what}: the tools are not installed ({INSTALL}):\n{}",
            text(output)
        );
    }
}

#[test]
fn every_kustomization_validates_against_kubernetes_1_34_to_1_37() {
    let output = run("python3", &["scripts/validate-manifests.py"]);
    fail_on_missing_tools("scripts/validate-manifests.py", &output);
    let said = text(&output);
    assert!(output.status.success(), "manifests refused:\n{said}");
    for folder in ["deploy/base", "deploy/device-plugin", "deploy/example"] {
        assert!(
            said.contains(&format!("ok   {folder}:")),
            "{folder} not checked:\n{said}"
        );
    }
    assert!(
        said.contains("deploy/components/servicemonitor"),
        "the ServiceMonitor component not checked:\n{said}"
    );
    assert!(said.contains("1.34, 1.35, 1.36, 1.37"), "{said}");
}

#[test]
fn the_shipped_limiter_needs_no_glibc_newer_than_2_17() {
    let built = run("bash", &["scripts/build-limiter.sh"]);
    fail_on_missing_tools("scripts/build-limiter.sh", &built);
    assert!(
        built.status.success(),
        "the glibc 2.17 build failed:\n{}",
        text(&built)
    );
    let stdout = String::from_utf8_lossy(&built.stdout);
    let library = stdout.lines().last().expect("the script prints the path");
    assert!(root().join(library).is_file(), "no {library}");
    let checked = run("python3", &["scripts/check-glibc.py", library]);
    fail_on_missing_tools("scripts/check-glibc.py", &checked);
    assert!(
        checked.status.success(),
        "the limiter needs a newer glibc than 2.17:\n{}",
        text(&checked)
    );
    // UBI 8 / Rocky 8 (2.28) and Ubuntu 20.04 (2.31) are above the baseline.
    let said = text(&checked);
    assert!(said.contains("needs GLIBC_2."), "{said}");
}

#[test]
fn the_glibc_check_refuses_a_library_newer_than_its_baseline() {
    // This test binary is linked against the build machine's glibc, whose
    // symbol versions go past 2.16 wherever Rust builds (its std needs 2.17).
    let me = std::env::current_exe().unwrap();
    let checked = run(
        "python3",
        &[
            "scripts/check-glibc.py",
            me.to_str().unwrap(),
            "--max",
            "2.16",
        ],
    );
    fail_on_missing_tools("scripts/check-glibc.py", &checked);
    assert_eq!(checked.status.code(), Some(1), "{}", text(&checked));
    assert!(text(&checked).contains("> 2.16"), "{}", text(&checked));
}

#[test]
fn the_image_tag_is_the_workspace_version() {
    let text = std::fs::read_to_string(root().join("deploy/base/kustomization.yaml")).unwrap();
    let kustomization: serde_json::Value = serde_yaml::from_str(&text).unwrap();
    let images = kustomization["images"].as_array().expect("images:");
    let ours = images
        .iter()
        .find(|i| i["name"] == "ghcr.io/gpushare/hypervisor")
        .expect("the hypervisor image is set by kustomize");
    assert_eq!(ours["newTag"], env!("CARGO_PKG_VERSION"));
}
