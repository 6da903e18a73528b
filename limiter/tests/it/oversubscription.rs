//! Oversubscription against the driver double: allocations past the quota
//! served from pinned mapped host memory, the pod-wide spill cap, frees in
//! any order, truthful pointer attributes, and reports that keep showing the
//! device alone.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use common::{CONTEXT_BYTES, GIB, Pod, VIAS, info, probe, result_of, run};

const QUOTA: u64 = 4 * GIB;
const LIMIT: (&str, &str) = ("CUDA_DEVICE_MEMORY_LIMIT", "4g");
/// The quota, oversubscription on, a 3 GiB spill cap.
const CAPPED: [(&str, &str); 3] = [
    LIMIT,
    ("CUDA_OVERSUBSCRIBE", "true"),
    ("CUDA_LIMITER_SPILL_LIMIT", "3g"),
];
/// `CU_MEMORYTYPE_HOST`, `CU_MEMORYTYPE_DEVICE`.
const HOST: u32 = 1;
const DEVICE: u32 = 2;

/// `ptr ID -> 0 type=T size=S start=1`.
fn ptr_line(id: u32, memory_type: u32, size: u64) -> String {
    format!("ptr {id} -> 0 type={memory_type} size={size} start=1")
}

/// `nvml RESULT free=F used=U total=T` → U.
fn nvml_used(line: &str) -> u64 {
    line.split_whitespace()
        .find_map(|field| field.strip_prefix("used="))
        .and_then(|used| used.parse().ok())
        .unwrap_or_else(|| panic!("no used= in {line:?}"))
}

/// The output of `cudaprobe` running `script` with `env` in a pod of its own.
fn run_alone(test: &str, env: &[(&str, &str)], script: &[&str]) -> Vec<String> {
    let pod = Pod::new(test);
    run(probe("cudaprobe", &pod, env, script))
}

#[test]
fn past_the_quota_allocations_spill_to_host_memory_and_free_in_any_order() {
    for (program, via) in VIAS {
        for free_order in [["1", "0"], ["0", "1"]] {
            let pod = Pod::new("spill");
            #[rustfmt::skip]
            let script = [
                "alloc", "mem", "3g", "alloc", "mem", "2g", "ptr", "0", "ptr", "1",
                "info", "nvml",
                "free", free_order[0], "info", "free", free_order[1], "info",
            ];
            let args: Vec<&str> = via.iter().chain(script.iter()).copied().collect();
            let env = [LIMIT, ("CUDA_OVERSUBSCRIBE", "true")];
            let lines = run(probe(program, &pod, &env, &args));
            let what = format!("{program} {via:?} {free_order:?}: {lines:?}");
            assert_eq!(result_of(&lines[0]), 0, "{what}");
            assert_eq!(
                result_of(&lines[1]),
                0,
                "the 2 GiB past the quota spill: {what}"
            );
            assert_eq!(lines[2], ptr_line(0, DEVICE, 3 * GIB), "{what}");
            assert_eq!(lines[3], ptr_line(1, HOST, 2 * GIB), "{what}");
            // Reports show the device alone: total = quota, free = what is left there.
            let left = QUOTA - CONTEXT_BYTES - 3 * GIB;
            assert_eq!(lines[4], info(0, left, QUOTA), "{what}");
            assert!(nvml_used(&lines[5]) <= QUOTA, "real footprint: {what}");
            assert_eq!(lines[6], format!("free {} -> 0", free_order[0]), "{what}");
            let after_first = if free_order[0] == "0" {
                left + 3 * GIB
            } else {
                left
            };
            assert_eq!(lines[7], info(0, after_first, QUOTA), "{what}");
            assert_eq!(lines[8], format!("free {} -> 0", free_order[1]), "{what}");
            assert_eq!(lines[9], info(0, QUOTA - CONTEXT_BYTES, QUOTA), "{what}");
        }
    }
}

#[test]
fn without_the_switch_past_the_quota_is_out_of_memory() {
    for env in [
        vec![LIMIT],
        vec![LIMIT, ("CUDA_OVERSUBSCRIBE", "false")],
        vec![LIMIT, ("CUDA_MEM_OVERSOLD_1", "true")],
        vec![
            LIMIT,
            ("CUDA_OVERSUBSCRIBE", "true"),
            ("CUDA_LIMITER_OVERSUBSCRIBE_0", "off"),
        ],
        vec![
            LIMIT,
            ("CUDA_OVERSUBSCRIBE", "true"),
            ("CUDA_LIMITER_SPILL_LIMIT", "0"),
        ],
    ] {
        let script = ["alloc", "mem", "3g", "alloc", "mem", "2g"];
        let lines = run_alone("nospill", &env, &script);
        assert_eq!(result_of(&lines[0]), 0, "{env:?}: {lines:?}");
        assert_eq!(result_of(&lines[1]), 2, "{env:?}: {lines:?}");
    }
}

#[test]
fn every_switch_name_turns_it_on() {
    for switch in [
        ("CUDA_OVERSUBSCRIBE", "true"),
        ("CUDA_MEM_OVERSOLD_0", "true"),
        ("CUDA_LIMITER_OVERSUBSCRIBE", "1"),
        ("CUDA_LIMITER_OVERSUBSCRIBE_0", "on"),
    ] {
        let script = ["alloc", "mem", "3g", "alloc", "mem", "1g", "ptr", "1"];
        let lines = run_alone("switch", &[LIMIT, switch], &script);
        // The default cap, a quarter of the node's memory, holds 1 GiB.
        assert_eq!(lines[2], ptr_line(1, HOST, GIB), "{switch:?}: {lines:?}");
    }
}

#[test]
fn the_spill_cap_holds_and_frees_make_room_again() {
    let pod = Pod::new("cap");
    let env = CAPPED;
    #[rustfmt::skip]
    let script = [
        "alloc", "mem", "3g", "alloc", "mem", "2g", "alloc", "mem", "2g", "alloc", "mem", "1g",
        "free", "1", "alloc", "mem", "2g", "ptr", "3",
    ];
    let lines = run(probe("cudaprobe", &pod, &env, &script));
    let results: Vec<u32> = lines[..6].iter().map(|line| result_of(line)).collect();
    // device, spill, over the cap, spill up to it, free, room again.
    assert_eq!(results, [0, 0, 2, 0, 0, 0], "{lines:?}");
    assert_eq!(lines[6], ptr_line(3, HOST, 2 * GIB), "{lines:?}");
}

#[test]
fn linear_apis_spill_and_the_others_refuse() {
    let spilled = ["async", "async_ptsz", "pool", "pool_ptsz", "pitch"];
    let refused = ["managed", "create", "array", "array3d", "mipmap"];
    for (api, spills) in spilled
        .iter()
        .map(|api| (api, true))
        .chain(refused.iter().map(|api| (api, false)))
    {
        let env = [LIMIT, ("CUDA_OVERSUBSCRIBE", "true")];
        let script = [
            "alloc", api, "2g", "alloc", api, "2g", "info", "freeall", "info",
        ];
        let lines = run_alone("apis", &env, &script);
        let want = if spills { 0 } else { 2 };
        assert_eq!(result_of(&lines[0]), 0, "{api}: {lines:?}");
        assert_eq!(result_of(&lines[1]), want, "{api}: {lines:?}");
        // The device shows the first 2 GiB alone, then nothing once all is freed.
        let reports = [
            info(0, QUOTA - CONTEXT_BYTES - 2 * GIB, QUOTA),
            "freeall 0".to_owned(),
            info(0, QUOTA - CONTEXT_BYTES, QUOTA),
        ];
        assert_eq!(lines[2..5], reports, "{api}: {lines:?}");
    }
}

#[test]
fn the_cap_is_pod_wide_across_processes_and_a_dead_one_gives_back() {
    let pod = Pod::new("podcap");
    let env = CAPPED;
    // The holder fills its share of the quota and spills 2 GiB of the 3.
    let mut holder = probe(
        "cudaprobe",
        &pod,
        &env,
        &["alloc", "mem", "3g", "alloc", "mem", "2g", "wait"],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .spawn()
    .expect("spawn holder");
    let mut lines = BufReader::new(holder.stdout.take().expect("stdout")).lines();
    for _ in 0..2 {
        let line = lines.next().expect("alloc line").expect("read");
        assert_eq!(result_of(&line), 0, "{line}");
    }
    assert_eq!(lines.next().expect("ready").expect("read"), "ready");

    let other = run(probe(
        "cudaprobe",
        &pod,
        &env,
        &["alloc", "mem", "2g", "alloc", "mem", "1g"],
    ));
    assert_eq!(
        result_of(&other[0]),
        2,
        "2 GiB more passes the cap: {other:?}"
    );
    assert_eq!(result_of(&other[1]), 0, "1 GiB fits under it: {other:?}");

    holder.kill().expect("kill holder");
    holder.wait().expect("reap holder");
    let after = run(probe(
        "cudaprobe",
        &pod,
        &env,
        &["alloc", "mem", "3g", "alloc", "mem", "3g", "ptr", "1"],
    ));
    assert_eq!(
        after[2],
        ptr_line(1, HOST, 3 * GIB),
        "the dead holder's spill is back: {after:?}"
    );
}

#[test]
fn a_malformed_switch_refuses_cuda() {
    let pod = Pod::new("badswitch");
    let output = probe(
        "cudaprobe",
        &pod,
        &[LIMIT, ("CUDA_OVERSUBSCRIBE", "maybe")],
        &["info"],
    )
    .output()
    .expect("spawn probe");
    assert!(!output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("CUDA_OVERSUBSCRIBE=\"maybe\" is not a switch (expected true or false)"),
        "{stderr}"
    );
    assert!(stderr.contains("cuInit failed: 3"), "{stderr}");
}
