//! A thread's repeat launches of one kernel take its express door (see
//! `limiter/src/throttle/express.rs`) at a limit that does not bind, and
//! every one of them is still counted, charged at its measured price and
//! sampled at the cadence, on the driver double's simulated clock.

mod common;

use common::{Pod, check, probe, serial};

/// `key=value` out of `text`.
fn field(text: &str, key: &str) -> f64 {
    text.split_whitespace()
        .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {text:?}"))
}

#[test]
fn express_launches_are_counted_charged_and_sampled() {
    let _serial = serial();
    let pod = Pod::new("express");
    let node = format!("gpushare-node-test-{}", pod.0);
    // 20,000 launches of one function, 20,000 distinct grids of 1 to 10
    // waves of 1 µs, 20 µs of host work apart: the GPU is busy about a
    // fifth of the time, far from 50%.
    let launches = 20_000;
    let mut command = probe(
        "cudaprobe",
        &pod,
        &[
            ("CUDA_DEVICE_SM_LIMIT", "50"),
            ("CUDA_LIMITER_LOG", "info"),
            ("GPUSHARE_NODE_REGION", &node),
        ],
        &["shapes", "20000", "1", &launches.to_string(), "20"],
    );
    let output = command.output().expect("spawn probe");
    let _ignored = std::fs::remove_file(format!("/dev/shm/{node}"));
    check(&output);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let summary = stderr
        .lines()
        .find(|line| line.contains("compute summary"))
        .unwrap_or_else(|| panic!("no summary in {stderr}"));
    assert!(stdout.contains("-> 0 "), "launch failed: {stdout}");

    // Every launch reaches the pod's count (the warm-up one too), most of
    // them through the door.
    let counted = field(summary, "pod_launches");
    assert_eq!(counted, f64::from(launches + 1), "{summary}");
    let express = field(summary, "express_launches");
    assert!(
        express >= 0.5 * f64::from(launches),
        "{express} of {launches} launches took the door: {summary}"
    );
    // Charged what the double's GPU was busy with (busy_ns of the timed
    // launches; the warm-up and the settlement lag are in the margin).
    let charged_ns = field(summary, "pod_charged_ms") * 1e6;
    let busy_ns = field(&stdout, "busy_ns");
    let ratio = charged_ns / busy_ns;
    assert!(
        (0.9..=1.1).contains(&ratio),
        "charged {charged_ns} ns for {busy_ns} ns busy ({ratio:.3}): {summary}"
    );
    // Still measured at the relaxed cadence: about one sample in 16 ms.
    let wall_ms = field(summary, "wall_ms");
    let samples = field(summary, "samples");
    assert!(
        samples >= wall_ms / 16.0 / 2.0,
        "{samples} samples in {wall_ms} ms: {summary}"
    );
}
