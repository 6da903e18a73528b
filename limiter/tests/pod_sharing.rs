//! Processes of one pod share one quota; a killed process's usage comes back.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;

use common::{Pod, probe, run};

fn oom(line: &str) -> bool {
    line.contains("-> 2")
}

#[test]
fn two_processes_of_one_pod_share_the_quota_and_sigkill_gives_back() {
    let pod = Pod::new("shared");
    let limit = [("CUDA_DEVICE_MEMORY_LIMIT", "4g")];
    let mut holder = probe("cudaprobe", &pod, &limit, &["alloc", "mem", "3g", "wait"]);
    let mut holder = holder
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn holder");
    let mut lines = BufReader::new(holder.stdout.take().expect("stdout")).lines();
    let first = lines.next().expect("alloc line").expect("read");
    assert!(first.contains("-> 0"), "{first}");
    assert_eq!(lines.next().expect("ready").expect("read"), "ready");

    // 3 GiB + two contexts are taken: 1 GiB more does not fit.
    let other = run(probe("cudaprobe", &pod, &limit, &["alloc", "mem", "1g"]));
    assert!(oom(&other[0]), "{other:?}");
    // Another pod has its own quota.
    let elsewhere = Pod::new("elsewhere");
    let other = run(probe(
        "cudaprobe",
        &elsewhere,
        &limit,
        &["alloc", "mem", "3g"],
    ));
    assert!(other[0].contains("-> 0"), "{other:?}");

    // SIGKILL: no chance to clean up; the next allocation reclaims. An
    // allocation that does not fit is refused at once, never waited on, so
    // its success is the reclaim.
    holder.kill().expect("kill holder");
    holder.wait().expect("reap holder");
    let after = run(probe("cudaprobe", &pod, &limit, &["alloc", "mem", "3g"]));
    assert!(after[0].contains("-> 0"), "{after:?}");

    // A holder that exits normally gives back too.
    let mut holder = probe("cudaprobe", &pod, &limit, &["alloc", "mem", "3g", "wait"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn holder");
    let mut lines = BufReader::new(holder.stdout.take().expect("stdout")).lines();
    assert!(lines.next().expect("alloc").expect("read").contains("-> 0"));
    holder
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"\n")
        .expect("resume");
    holder.wait().expect("holder exit");
    let after = run(probe("cudaprobe", &pod, &limit, &["alloc", "mem", "3g"]));
    assert!(after[0].contains("-> 0"), "{after:?}");
}
