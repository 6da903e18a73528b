//! The workspace's shipped programs and libraries, built for the test run
//! that needs them: [`limiter()`] (`libcuda_limiter.so`) and [`hypervisor()`]
//! (the node daemon's binary).
//!
//! Cargo builds a package's cdylib and binaries for that package's own
//! tests only (`CARGO_BIN_EXE_*` exists only there); a test of another
//! package gets neither. So they are built here by a nested `cargo build`
//! (a no-op when fresh, so a changed source is never missed) into the
//! target folder and profile of the running test binary, which lives in
//! `<target>/<profile>/deps/`: the artifact is then
//! `<target>/<profile>/<file>`, as `cargo build` leaves it. The profile's
//! package settings apply as in any build (`[profile.dev.package.cuda-limiter]`
//! optimises the limiter in test runs too). Cargo releases its build lock
//! before it runs tests, so the nested build does not wait for the outer
//! one. A failed build fails the test; run by hand without `$CARGO`, an
//! existing build is used. `mps_fake::program()` builds the fake MPS
//! control program the same way.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The limiter as it ships (`cargo build -p cuda-limiter`), built once per
/// test process: `<target>/<profile>/libcuda_limiter.so`.
pub fn limiter() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| build("cuda-limiter", &["--lib"], "libcuda_limiter.so"))
}

/// The node daemon's binary (`cargo build -p hypervisor --bin hypervisor`),
/// built once per test process: `<target>/<profile>/hypervisor`.
pub fn hypervisor() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| build("hypervisor", &["--bin", "hypervisor"], "hypervisor"))
}

/// The running test binary's `<target>/<profile>` folder.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("the test binary lives in <target>/<profile>/deps")
        .to_path_buf()
}

/// The running test binary's target folder.
pub fn target_dir() -> PathBuf {
    profile_dir()
        .parent()
        .expect("<target>/<profile>")
        .to_path_buf()
}

/// Runs `cargo build -p PACKAGE TARGETS` for this test binary's target
/// folder and profile; returns `<target>/<profile>/FILE`.
fn build(package: &str, targets: &[&str], file: &str) -> PathBuf {
    let profile_dir = profile_dir();
    let artifact = profile_dir.join(file);
    let target = target_dir();
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev",
        Some(other) => other,
    };
    match std::env::var_os("CARGO") {
        Some(cargo) => {
            let mut command = Command::new(cargo);
            command
                .args(["build", "--quiet", "-p", package])
                .args(targets)
                .args(["--profile", profile])
                .env("CARGO_TARGET_DIR", &target);
            // Cargo describes the test's own package in the test's
            // environment; a build script that tracks those variables
            // (ring's tracks CARGO_MANIFEST_DIR) would otherwise run again,
            // with all that depends on it, at every switch between this
            // build and a plain `cargo build`.
            for (key, _) in std::env::vars_os() {
                if key.to_str().is_some_and(describes_package) {
                    command.env_remove(key);
                }
            }
            let status = command
                .status()
                .unwrap_or_else(|e| panic!("cannot run cargo to build {package}: {e}"));
            // A stale artifact would test other code than the source's.
            assert!(
                status.success(),
                "cargo build -p {package} failed: {status}"
            );
        }
        None if artifact.exists() => {}
        None => panic!("no {file}: run `cargo build -p {package}` first"),
    }
    assert!(
        artifact.exists(),
        "{} missing after the build",
        artifact.display()
    );
    artifact
}

/// Whether `key` is one of the variables cargo sets for a test or program
/// it runs that describe its package.
fn describes_package(key: &str) -> bool {
    key.starts_with("CARGO_PKG_")
        || matches!(
            key,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
        )
}
