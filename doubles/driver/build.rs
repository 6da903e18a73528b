//! Builds the test double of the driver and the probe programs with the C
//! compiler the `cc` crate picks (honours `CC`, `CFLAGS`, cross settings):
//!
//! - `$OUT_DIR/double/libcuda.so.1` (+ `libcuda.so`) and
//!   `$OUT_DIR/double/libnvidia-ml.so.1` (+ `libnvidia-ml.so`), from `double/`;
//! - `$OUT_DIR/double/libfail_limiter_threads.so`, a fixture that refuses
//!   the limiter's threads;
//! - `$OUT_DIR/bin/cudaprobe` and `$OUT_DIR/bin/cudaprobe_linked`, from
//!   `programs/`;
//! - `$OUT_DIR/bin/ckptprobe`, the checkpoint tests' process, linked with
//!   the double.
//!
//! The paths reach the crate as `GPUSHARE_DOUBLE_DIR` and
//! `GPUSHARE_PROGRAMS_DIR`. The stubs are x86_64 assembly, so on any other
//! target nothing is built and the crate exports nothing (a warning says so).

use std::env;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What the build reads besides `CUDA_SOURCES` and `PROBE_SOURCES`.
const SOURCES: &[&str] = &[
    "double/cuda_min.h",
    "double/double_common.h",
    "double/double_internal.h",
    "double/cuda_entries.def",
    "double/libcuda.map",
    "double/nvml_entry.S",
    "double/nvml.c",
    "double/libnvidia-ml.map",
    "double/fail_limiter_threads.c",
    "programs/probe.h",
    "programs/ckptprobe.c",
];

/// The files of `libcuda.so.1`, in `double/` (with `double_internal.h`):
/// one per concern, the model described in `cuda.c`.
const CUDA_SOURCES: &[&str] = &[
    "cuda.c",
    "contexts.c",
    "memory.c",
    "pools.c",
    "copies.c",
    "launch.c",
    "streams.c",
    "events.c",
    "graphs.c",
    "images.c",
    "modules.c",
    "lookup.c",
    "host_memory.c",
    "vmm.c",
    "checkpoint.c",
    "node.c",
    "cuda_entry.S",
];

/// The probe's C files, in `programs/` (with `probe.h`), linked into both
/// `cudaprobe` and `cudaprobe_linked`.
const PROBE_SOURCES: &[&str] = &[
    "cudaprobe.c",
    "probe_script.c",
    "probe_memory.c",
    "probe_launch.c",
    "probe_held.c",
    "probe_sharing.c",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for source in SOURCES {
        println!("cargo:rerun-if-changed={source}");
    }
    for source in CUDA_SOURCES {
        println!("cargo:rerun-if-changed=double/{source}");
    }
    for source in PROBE_SOURCES {
        println!("cargo:rerun-if-changed=programs/{source}");
    }

    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if arch != "x86_64" || os != "linux" {
        println!(
            "cargo:warning=gpushare-examples: the driver double has x86_64 Linux stubs only; \
             nothing built for {arch}-{os}"
        );
        return;
    }

    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets it"));
    let double_src = manifest.join("double");
    let programs_src = manifest.join("programs");
    let double_dir = out.join("double");
    let bin_dir = out.join("bin");
    fs::create_dir_all(&double_dir).expect("create $OUT_DIR/double");
    fs::create_dir_all(&bin_dir).expect("create $OUT_DIR/bin");

    let compiler = cc::Build::new().cargo_metadata(false).get_compiler();
    let cc = |args: &[&dyn AsRef<std::ffi::OsStr>]| {
        let mut command = compiler.to_command();
        command.args(["-Wall", "-Wextra", "-std=gnu11"]);
        command.arg("-I").arg(&double_src);
        for arg in args {
            command.arg(arg);
        }
        command.args(["-pthread", "-ldl"]);
        run(command);
    };

    for (soname, sources, map) in [
        ("libcuda.so.1", CUDA_SOURCES, "libcuda.map"),
        (
            "libnvidia-ml.so.1",
            &["nvml.c", "nvml_entry.S"][..],
            "libnvidia-ml.map",
        ),
    ] {
        let soname_flag = format!("-Wl,-soname,{soname}");
        let map_flag = format!("-Wl,--version-script={}", double_src.join(map).display());
        let output = double_dir.join(soname);
        let sources: Vec<PathBuf> = sources.iter().map(|s| double_src.join(s)).collect();
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
            &"-shared",
            &"-fPIC",
            &"-fvisibility=hidden",
            &soname_flag,
            &map_flag,
            &"-Wl,-z,noexecstack",
            &"-o",
            &output,
        ];
        args.extend(sources.iter().map(|s| s as &dyn AsRef<std::ffi::OsStr>));
        cc(&args);
        let link_name = soname.trim_end_matches(".1");
        symlink(soname, &double_dir.join(link_name)).expect("symlink the development name");
    }

    let fixture = double_dir.join("libfail_limiter_threads.so");
    let fixture_source = double_src.join("fail_limiter_threads.c");
    cc(&[&"-shared", &"-fPIC", &"-o", &fixture, &fixture_source]);

    let probe: Vec<PathBuf> = PROBE_SOURCES.iter().map(|s| programs_src.join(s)).collect();
    let probe_args = || probe.iter().map(|s| s as &dyn AsRef<std::ffi::OsStr>);
    let probe_bin = bin_dir.join("cudaprobe");
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&"-I", &programs_src, &"-o", &probe_bin];
    args.extend(probe_args());
    cc(&args);
    let search = format!("-L{}", double_dir.display());
    let linked_bin = bin_dir.join("cudaprobe_linked");
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
        &"-DCUDAPROBE_LINKED",
        &"-I",
        &programs_src,
        &"-o",
        &linked_bin,
    ];
    args.extend(probe_args());
    args.extend([
        &search as &dyn AsRef<std::ffi::OsStr>,
        &"-Wl,-rpath,$ORIGIN/../double",
        &"-lcuda",
        &"-lnvidia-ml",
    ]);
    cc(&args);
    let ckpt_bin = bin_dir.join("ckptprobe");
    let ckpt_source = programs_src.join("ckptprobe.c");
    cc(&[
        &"-o",
        &ckpt_bin,
        &ckpt_source,
        &search,
        &"-Wl,-rpath,$ORIGIN/../double",
        &"-lcuda",
    ]);

    println!(
        "cargo:rustc-env=GPUSHARE_DOUBLE_DIR={}",
        double_dir.display()
    );
    println!(
        "cargo:rustc-env=GPUSHARE_PROGRAMS_DIR={}",
        bin_dir.display()
    );
}

/// Runs one compiler command; its diagnostics become cargo warnings, a
/// failure stops the build with the full output.
fn run(mut command: Command) {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        panic!("{command:?} failed ({}):\n{stderr}", output.status);
    }
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        println!("cargo:warning={line}");
    }
}

/// `link` → `target`, replacing whatever a previous build left there.
fn symlink(target: &str, link: &Path) -> io::Result<()> {
    match fs::remove_file(link) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::os::unix::fs::symlink(target, link)
}
