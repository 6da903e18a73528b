//! Processes of one pod share one quota; a killed process's usage comes back.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::Stdio;

use common::{CONTEXT_BYTES, GIB, MIB, Pod, probe, run};
use gpushare_utils::ledger::PodLedger;

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

#[test]
fn processes_racing_for_a_quota_with_their_contexts_cannot_pass_it() {
    // A 1 GiB pod; each process's context takes CONTEXT_BYTES (the
    // driver's, through no allocation call) and it allocates 64 MiB. All
    // start at once: contexts are reserved before the driver creates them,
    // so those that do not fit are refused, never created past the quota.
    let pod = Pod::new("ctx-race");
    let limit = [("CUDA_DEVICE_MEMORY_LIMIT", "1g")];
    let mut children: Vec<_> = (0..5)
        .map(|_| {
            probe("cudaprobe", &pod, &limit, &["alloc", "mem", "64m", "wait"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn")
        })
        .collect();
    // Each either holds its memory (ready) or ended, refused its context.
    let mut footprint = 0;
    let mut holding = 0;
    for child in &mut children {
        let lines: Vec<String> = BufReader::new(child.stdout.as_mut().expect("stdout"))
            .lines()
            .map_while(Result::ok)
            .take_while(|line| line != "ready")
            .collect();
        match lines.first() {
            Some(alloc) => {
                holding += 1;
                footprint += CONTEXT_BYTES + if oom(alloc) { 0 } else { 64 * MIB };
            }
            None => {
                let mut stderr = String::new();
                let _ = child
                    .stderr
                    .take()
                    .expect("stderr")
                    .read_to_string(&mut stderr);
                assert!(
                    stderr.contains("cuDevicePrimaryCtxRetain failed: 2"),
                    "{stderr}"
                );
            }
        }
    }
    assert!(holding >= 1, "no process got a context");
    assert!(
        footprint <= GIB,
        "{holding} processes hold {footprint} bytes under a 1 GiB quota"
    );
    let ledger = PodLedger::open(&pod.0).expect("the pod's ledger");
    let used = ledger.usage(0).expect("usage").used;
    assert!(used <= GIB, "ledger: {used}");
    for mut child in children {
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(b"\n");
        }
        let _ = child.wait();
    }
}
