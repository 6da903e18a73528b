//! How the limiter loads: no driver symbols exported, nothing loaded into
//! processes that never use CUDA, `dlopen` semantics kept for its callers.

use crate::common;

use std::process::Command;

use common::limiter;
use system_tests::scratch::Scratch;

#[test]
fn exports_no_driver_or_nvml_symbol_and_no_way_to_switch_limits_off() {
    let output = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(limiter())
        .output()
        .expect("run nm");
    assert!(output.status.success());
    let symbols = String::from_utf8_lossy(&output.stdout);
    let names: Vec<&str> = symbols
        .lines()
        .filter_map(|line| line.split_whitespace().nth(2))
        .collect();
    assert!(names.contains(&"dlopen"), "{names:?}");
    let driver: Vec<&&str> = names
        .iter()
        .filter(|name| name.starts_with("cu") || name.starts_with("nvml"))
        .collect();
    assert!(driver.is_empty(), "exports {driver:?}");
    // The benchmarks' switch that turns admission off (feature `launch-ab`)
    // is not in a default build: a program could lift its own limit.
    assert!(
        !names.contains(&"gpushare_launch_ab_bypass"),
        "the launch A/B switch is exported"
    );
}

#[test]
fn a_process_that_never_uses_cuda_does_not_load_it() {
    let output = Command::new("cat")
        .arg("/proc/self/maps")
        .env("LD_PRELOAD", limiter())
        .env("CUDA_DEVICE_MEMORY_LIMIT", "4g")
        .env("LD_LIBRARY_PATH", gpushare_examples::double_dir())
        .output()
        .expect("run cat");
    assert!(output.status.success());
    let maps = String::from_utf8_lossy(&output.stdout);
    assert!(maps.contains("libcuda_limiter.so"), "not preloaded");
    assert!(!maps.contains("libcuda.so"), "libcuda loaded:\n{maps}");
    assert!(!maps.contains("libnvidia-ml"), "NVML loaded:\n{maps}");
}

/// A program whose RUNPATH alone finds a library it `dlopen`s by bare name
/// keeps finding it with the limiter's `dlopen` in between.
#[test]
fn dlopen_searches_the_callers_runpath() {
    let scratch = Scratch::new("limiter-runpath");
    let work = &scratch.dir;
    let libs = work.join("libs");
    std::fs::create_dir_all(&libs).expect("mkdir");
    let library_source = work.join("plugin.c");
    std::fs::write(&library_source, "int plugin_answer(void) { return 42; }\n").expect("write");
    let program_source = work.join("main.c");
    std::fs::write(
        &program_source,
        r#"#include <dlfcn.h>
#include <stdio.h>
int main(void) {
    void *h = dlopen("libplugin_for_test.so", RTLD_NOW);
    if (!h) { printf("dlopen failed: %s\n", dlerror()); return 1; }
    int (*answer)(void) = (int (*)(void))dlsym(h, "plugin_answer");
    printf("answer %d\n", answer());
    return 0;
}
"#,
    )
    .expect("write");
    let compile = |args: &[&std::ffi::OsStr]| {
        let status = Command::new("cc").args(args).status().expect("run cc");
        assert!(status.success(), "cc {args:?}");
    };
    compile(&[
        "-shared".as_ref(),
        "-fPIC".as_ref(),
        "-o".as_ref(),
        libs.join("libplugin_for_test.so").as_os_str(),
        library_source.as_os_str(),
    ]);
    let program = work.join("main");
    compile(&[
        "-o".as_ref(),
        program.as_os_str(),
        program_source.as_os_str(),
        "-ldl".as_ref(),
        "-Wl,--enable-new-dtags,-rpath,$ORIGIN/libs".as_ref(),
    ]);
    for preload in [None, Some(limiter())] {
        let mut command = Command::new(&program);
        command.env("CUDA_DEVICE_MEMORY_LIMIT", "4g");
        if let Some(preload) = &preload {
            command.env("LD_PRELOAD", preload);
        }
        let output = command.output().expect("run program");
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            "answer 42\n",
            "preload {preload:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
