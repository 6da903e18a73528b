//! `CUDA_LIMITER_FAST_SWAP`: the limiter backs large allocations itself
//! with the driver's virtual memory management API. On the driver double
//! only such memory keeps its bytes, so a probe's `check` tells backed
//! memory (`differ=0`) from the driver's own; the quota charges a backed
//! allocation its size rounded up to the 2 MiB granule, and the pointer
//! queries answer with the size the program asked for.

use crate::common;

use common::{CONTEXT_BYTES, GIB, MIB, Pod, VIAS, info, number, probe, result_of, run};

const QUOTA: u64 = 4 * GIB;

/// The probe's lines for `script` under a 4 GiB quota, the setting on or
/// off, with `env` besides.
fn probe_lines(
    program: &str,
    via: &[&str],
    fast: bool,
    env: &[(&str, &str)],
    script: &[&str],
) -> Vec<String> {
    let pod = Pod::new("fast-swap");
    let mut vars = vec![("CUDA_DEVICE_MEMORY_LIMIT", "4g")];
    if fast {
        vars.push(("CUDA_LIMITER_FAST_SWAP", "1"));
    }
    vars.extend_from_slice(env);
    let args: Vec<&str> = via.iter().chain(script).copied().collect();
    run(probe(program, &pod, &vars, &args))
}

/// Three allocations of 3 MiB (linear, then pitched) and 1 MiB, their
/// contents written and read back, the first's pointer queried, the first
/// freed.
const SCRIPT: [&str; 26] = [
    "alloc", "mem", "3m", "alloc", "pitch", "3m", "alloc", "mem", "1m", "info", "write", "0", "5",
    "write", "1", "6", "write", "2", "7", "check", "0", "5", "check", "1", "6", "ptr",
];

fn script() -> Vec<&'static str> {
    let mut script = SCRIPT.to_vec();
    script.extend([
        "0", "check", "2", "7", "free", "0", "info", "alloc", "mem", "4g",
    ]);
    script
}

#[test]
fn large_allocations_are_backed_charged_rounded_and_answer_as_asked() {
    for (program, via) in [VIAS[0], VIAS[2]] {
        let lines = probe_lines(program, via, true, &[], &script());
        let context = CONTEXT_BYTES;
        for line in &lines[..3] {
            assert_eq!(result_of(line), 0, "{program}: {lines:?}");
        }
        // Two backed allocations charged 4 MiB each, the small one exactly.
        let held = 4 * MIB + 4 * MIB + MIB;
        assert_eq!(
            lines[3],
            info(0, QUOTA - context - held, QUOTA),
            "{program}: {lines:?}"
        );
        for line in &lines[4..7] {
            assert_eq!(result_of(line), 0, "{program}: {lines:?}");
        }
        assert_eq!(
            number(&lines[7], "differ"),
            0,
            "backed keeps its bytes: {lines:?}"
        );
        assert_eq!(
            number(&lines[8], "differ"),
            0,
            "a backed pitch too: {lines:?}"
        );
        assert_eq!(
            lines[9],
            format!("ptr 0 -> 0 type=2 size={} start=1", 3 * MIB),
            "device memory of the size asked for: {lines:?}"
        );
        let differ = number(&lines[10], "differ");
        assert_eq!(differ, MIB as i64, "1 MiB is the driver's: {lines:?}");
        assert_eq!(lines[11], "free 0 -> 0", "{lines:?}");
        assert_eq!(lines[12], info(0, QUOTA - context - held + 4 * MIB, QUOTA));
        assert_eq!(result_of(&lines[13]), 2, "past the quota: {lines:?}");
    }
}

#[test]
fn without_the_setting_the_driver_allocates_everything() {
    let (program, via) = VIAS[0];
    let lines = probe_lines(program, via, false, &[], &script());
    let held = 3 * MIB + 3 * MIB + MIB;
    assert_eq!(
        lines[3],
        info(0, QUOTA - CONTEXT_BYTES - held, QUOTA),
        "{lines:?}"
    );
    for (line, size) in [
        (&lines[7], 3 * MIB),
        (&lines[8], 3 * MIB),
        (&lines[10], MIB),
    ] {
        assert_eq!(
            number(line, "differ"),
            size as i64,
            "the driver's memory: {lines:?}"
        );
    }
    assert_eq!(
        lines[9],
        format!("ptr 0 -> 0 type=2 size={} start=1", 3 * MIB)
    );
}

#[test]
fn an_allocation_that_cannot_be_backed_is_the_drivers() {
    let (program, via) = VIAS[0];
    for failing in [
        "cuMemAddressReserve",
        "cuMemCreate",
        "cuMemMap",
        "cuMemSetAccess",
    ] {
        let env = [("GPUSHARE_DOUBLE_FAIL_VMM", failing)];
        let script = [
            "alloc",
            "mem",
            "3m",
            "info",
            "write",
            "0",
            "1",
            "check",
            "0",
            "1",
            "free",
            "0",
            "info",
            "nvml_procs",
        ];
        let lines = probe_lines(program, via, true, &env, &script);
        let free = QUOTA - CONTEXT_BYTES;
        assert_eq!(result_of(&lines[0]), 0, "{failing}: {lines:?}");
        assert_eq!(
            lines[1],
            info(0, free - 3 * MIB, QUOTA),
            "{failing}: charged exactly"
        );
        let differ = number(&lines[3], "differ");
        assert_eq!(differ, 3 * MIB as i64, "{failing}: the driver's: {lines:?}");
        assert_eq!(lines[4], "free 0 -> 0", "{failing}: {lines:?}");
        assert_eq!(
            lines[5],
            info(0, free, QUOTA),
            "{failing}: nothing left charged"
        );
        // What the GPU holds for the process: its context alone, nothing
        // of the attempt.
        let held = number(&lines[6], "used");
        assert_eq!(
            held, CONTEXT_BYTES as i64,
            "{failing}: nothing left behind: {lines:?}"
        );
    }
}
