//! The probe programs print what the fake GPU should report, whichever way
//! they reach the driver: memory through every allocation API, devices,
//! malformed scripts, and where the crate says the double lives.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::Stdio;

use crate::common;

use common::{CTX, GIB, KIB, MIB, VARIANTS, assert_malformed, lines, run};
use gpushare_examples::{command, double_dir, program};

/// Runs `script` through every variant and checks the exact output.
fn expect_everywhere(script: &str, env: &[(&str, &str)], expected: &[String]) {
    for &(name, options) in VARIANTS {
        assert_eq!(
            lines(name, options, script, env),
            expected,
            "{name} {options:?}"
        );
    }
}

#[test]
fn probes_see_the_fake_gpu_the_same_way() {
    let total = 8 * GIB;
    let used = CTX + GIB + 2 * GIB + MIB + MIB;
    let expected = [
        "alloc mem 1g -> 0 0".to_owned(),
        format!("info 0 free={} total={total}", total - CTX - GIB),
        "alloc create 2g -> 0 1".to_owned(),
        "alloc array 1m -> 0 2".to_owned(),
        "alloc mipmap 1m -> 0 3".to_owned(),
        format!("nvml 0 free={} used={used} total={total}", total - used),
        format!("nvml_v2 0 free={} used={used} total={total}", total - used),
        format!("nvml_procs 0 count=1 used={used}"),
        "free 0 -> 0".to_owned(),
        "free 1 -> 0".to_owned(),
        "free 2 -> 0".to_owned(),
        "free 3 -> 0".to_owned(),
        format!("info 0 free={} total={total}", total - CTX),
        "fill 1g count=7 last=2".to_owned(),
        format!("info 0 free={} total={total}", total - CTX - 7 * GIB),
        "freeall 0".to_owned(),
        format!("nvml_procs 0 count=1 used={CTX}"),
    ];
    // The literal numbers, for whoever greps for them.
    assert_eq!(expected[1], "info 0 free=7201619968 total=8589934592");
    assert_eq!(
        expected[5],
        "nvml 0 free=5052039168 used=3537895424 total=8589934592"
    );
    expect_everywhere(
        "alloc mem 1g info alloc create 2g alloc array 1m alloc mipmap 1m nvml nvml_v2 \
         nvml_procs free 0 free 1 free 2 free 3 info fill 1g info freeall nvml_procs",
        &[("GPUSHARE_DOUBLE_TOTAL", "8g")],
        &expected,
    );
}

#[test]
fn every_allocation_api_charges_its_size_and_frees_it() {
    let total = 16 * GIB;
    let script = "alloc mem 4m alloc pitch 1000 alloc managed 4m alloc async 4m \
                  alloc async_ptsz 4m alloc pool 4m alloc pool_ptsz 4m alloc create 4m \
                  alloc array 4m alloc array3d 4m alloc mipmap 4m info \
                  free 0 free 1 free 2 free 3 free 4 free 5 free 6 free 7 free 8 free 9 free 10 \
                  info free 0 free 7 free 8 free 10";
    let apis = [
        ("mem", "4m"),
        ("pitch", "1000"),
        ("managed", "4m"),
        ("async", "4m"),
        ("async_ptsz", "4m"),
        ("pool", "4m"),
        ("pool_ptsz", "4m"),
        ("create", "4m"),
        ("array", "4m"),
        ("array3d", "4m"),
        ("mipmap", "4m"),
    ];
    let mut expected: Vec<String> = apis
        .iter()
        .enumerate()
        .map(|(id, (api, size))| format!("alloc {api} {size} -> 0 {id}"))
        .collect();
    // pitch 1000 is charged one 1024-byte row.
    let used = CTX + 10 * 4 * MIB + KIB;
    expected.push(format!("info 0 free={} total={total}", total - used));
    expected.extend((0..11).map(|id| format!("free {id} -> 0")));
    expected.push(format!("info 0 free={} total={total}", total - CTX));
    // Twice freed: an unknown pointer (1), an unknown array (400).
    expected.extend(
        [
            "free 0 -> 1",
            "free 7 -> 1",
            "free 8 -> 400",
            "free 10 -> 400",
        ]
        .map(String::from),
    );
    expect_everywhere(script, &[], &expected);
}

#[test]
fn allocations_that_do_not_fit_fail_and_take_nothing() {
    let total = GIB;
    let expected = [
        "alloc mem 1g -> 2 -".to_owned(),
        "alloc mem 0 -> 1 -".to_owned(),
        "alloc create 3m -> 1 -".to_owned(),
        format!("info 0 free={} total={total}", total - CTX),
        "alloc mem 724m -> 0 0".to_owned(),
        "alloc mem 1 -> 2 -".to_owned(),
        "alloc create 2m -> 2 -".to_owned(),
        format!("info 0 free=0 total={total}"),
        "free 0 -> 0".to_owned(),
        format!("info 0 free={} total={total}", total - CTX),
    ];
    expect_everywhere(
        "alloc mem 1g alloc mem 0 alloc create 3m info alloc mem 724m alloc mem 1 \
         alloc create 2m info free 0 info",
        &[("GPUSHARE_DOUBLE_TOTAL", "1g")],
        &expected,
    );
}

#[test]
fn total_memory_through_both_generations() {
    expect_everywhere(
        "totalmem totalmem_v1 info_v1",
        &[("GPUSHARE_DOUBLE_TOTAL", "8g")],
        &[
            "totalmem 0 8589934592".to_owned(),
            "totalmem_v1 0 4294967295".to_owned(),
            "info_v1 0 free=4294967295 total=4294967295".to_owned(),
        ],
    );
    expect_everywhere(
        "totalmem totalmem_v1 info_v1",
        &[("GPUSHARE_DOUBLE_TOTAL", "1g")],
        &[
            "totalmem 0 1073741824".to_owned(),
            "totalmem_v1 0 1073741824".to_owned(),
            format!("info_v1 0 free={} total=1073741824", GIB - CTX),
        ],
    );
}

#[test]
fn hammer_from_four_threads() {
    expect_everywhere(
        "hammer 4 2000 1m info",
        &[("GPUSHARE_DOUBLE_TOTAL", "8g")],
        &[
            "hammer ok=8000 oom=0 other=0".to_owned(),
            format!("info 0 free={} total={}", 8 * GIB - CTX, 8 * GIB),
        ],
    );

    // Room for two 1 MiB blocks among four threads: some allocations fail,
    // none wrongly, and everything comes back.
    let env = [
        ("GPUSHARE_DOUBLE_TOTAL", "2m"),
        ("GPUSHARE_DOUBLE_CONTEXT_BYTES", "0"),
    ];
    for &(name, options) in VARIANTS {
        let out = lines(name, options, "hammer 4 5000 1m info", &env);
        let counts: Vec<u64> = out[0]
            .strip_prefix("hammer ")
            .unwrap()
            .split(' ')
            .map(|kv| kv.split_once('=').unwrap().1.parse().unwrap())
            .collect();
        assert_eq!(counts[0] + counts[1], 20_000, "{out:?}");
        assert_eq!(counts[2], 0, "{out:?}");
        assert!(counts[0] > 0, "{out:?}");
        assert_eq!(out[1], "info 0 free=2097152 total=2097152");
    }
}

#[test]
fn devices_are_separate() {
    let env = [
        ("GPUSHARE_DOUBLE_DEVICES", "2"),
        ("GPUSHARE_DOUBLE_TOTAL", "4g"),
    ];
    let used = CTX + GIB;
    for &(name, options) in VARIANTS {
        let mut args = options.to_vec();
        args.extend(["--device", "1"]);
        assert_eq!(
            lines(
                name,
                &args,
                "alloc mem 1g alloc create 2m info nvml nvml_procs",
                &env
            ),
            [
                "alloc mem 1g -> 0 0".to_owned(),
                "alloc create 2m -> 0 1".to_owned(),
                format!("info 0 free={} total={}", 4 * GIB - used - 2 * MIB, 4 * GIB),
                format!(
                    "nvml 0 free={} used={} total={}",
                    4 * GIB - used - 2 * MIB,
                    used + 2 * MIB,
                    4 * GIB
                ),
                format!("nvml_procs 0 count=1 used={}", used + 2 * MIB),
            ],
            "{name} {options:?}"
        );
    }

    let output = run("cudaprobe", &["--device", "1"], "info", &[]);
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        "cudaprobe: cuDeviceGet failed: 101\n"
    );
}

#[test]
fn context_bytes_come_from_the_environment() {
    expect_everywhere(
        "info nvml",
        &[
            ("GPUSHARE_DOUBLE_TOTAL", "1g"),
            ("GPUSHARE_DOUBLE_CONTEXT_BYTES", "0"),
        ],
        &[
            "info 0 free=1073741824 total=1073741824".to_owned(),
            "nvml 0 free=1073741824 used=0 total=1073741824".to_owned(),
        ],
    );
}

#[test]
fn malformed_scripts_exit_2_before_doing_anything() {
    for script in [
        "info alloc bogus 1m",
        "info alloc mem",
        "info alloc mem 1x",
        "info frobnicate",
        "info hammer 0 1 1m",
        "info sleep",
    ] {
        assert_malformed(script);
    }
    // An unknown ID shows only when it runs.
    let output = run("cudaprobe_linked", &[], "info free 3", &[]);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(output.stdout.split(|&b| b == b'\n').count(), 2);
}

#[test]
fn wait_blocks_until_a_line_arrives() {
    let mut child = command("cudaprobe")
        .args(["pid", "sleep", "5", "wait", "pid"])
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the probe");
    let pid = format!("pid {}", child.id());
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut next = || {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        line.trim_end().to_owned()
    };
    assert_eq!(next(), pid);
    assert_eq!(next(), "sleep 5");
    assert_eq!(next(), "ready");
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    assert_eq!(next(), "resumed");
    assert_eq!(next(), pid);
    assert!(child.wait().unwrap().success());
}

#[test]
fn the_double_lives_where_the_crate_says() {
    for file in [
        "libcuda.so.1",
        "libcuda.so",
        "libnvidia-ml.so.1",
        "libnvidia-ml.so",
    ] {
        assert!(double_dir().join(file).exists(), "{file}");
    }
    for name in ["cudaprobe", "cudaprobe_linked"] {
        assert!(Path::new(&program(name)).is_file(), "{name}");
    }
}
