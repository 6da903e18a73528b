//! A tenant attacking the node's shared state, as an unprivileged uid
//! (`setpriv`): the pods' own uid, which may write every pod's ledger and
//! the node tables, and another uid, which may write none of them. The
//! daemon and the other processes survive, and no pod gets memory past its
//! quota.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use gpushare_utils::ledger::PodLedger;
use gpushare_utils::limits::PodLimits;
use system_tests::daemon::{PODS_UID, pods_uid_hypervisor};
use system_tests::pod::{Pod, node_tables};
use system_tests::probes::as_uid;
use system_tests::{daemon, probes};

/// A local user who is not a pod.
const STRANGER_UID: u32 = 65533;
const TOKEN: &str = "pod-token";

/// Runs the shell `script` as `uid`; whether it succeeded.
fn shell_as(uid: u32, script: &str) -> bool {
    let mut shell = Command::new("sh");
    shell.args(["-c", script]);
    as_uid(&shell, uid)
        .stderr(Stdio::null())
        .status()
        .expect("setpriv runs")
        .success()
}

/// `GET /metrics` on the daemon: its status line.
fn metrics_status(url: &str) -> String {
    daemon::metrics(url)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn shrinking_or_replacing_shared_objects_kills_nobody_and_frees_no_memory() {
    let pod = Pod::new("attack");
    let hypervisor = pods_uid_hypervisor(&pod, TOKEN);
    let tables = node_tables(&pod);
    let ledger = PodLedger::name_of(&pod.0);
    let limits = PodLimits::name_of(&pod.0);

    // A process of the pod, as the pods' uid: it allocates and launches,
    // waits while the objects are attacked, then launches and allocates.
    let mut victim = probes::probe(
        "cudaprobe",
        &pod,
        &[
            ("CUDA_LIMITER_HYPERVISOR", &hypervisor.url()),
            ("CUDA_LIMITER_TOKEN", TOKEN),
        ],
        &[
            "alloc", "mem", "64m", "run", "kernel", "100", "100", "wait", "run", "kernel", "100",
            "100", "alloc", "mem", "64m", "info",
        ],
    );
    probes::use_node_tables(&mut victim, &pod);
    let mut victim = as_uid(&victim, PODS_UID)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("victim starts");
    let mut stdout = BufReader::new(victim.stdout.take().expect("stdout"));
    let mut before = Vec::new();
    loop {
        let mut line = String::new();
        if stdout.read_line(&mut line).expect("victim output") == 0 {
            panic!("the victim ended before it waited: {before:?}");
        }
        if line.trim_end().ends_with("ready") {
            break;
        }
        before.push(line.trim_end().to_owned());
    }
    assert!(before[0].contains("-> 0 "), "{before:?}");

    // Another local user can neither shrink, remove nor replace any object.
    for name in [&ledger, &limits, &tables.activity, &tables.priority] {
        let path = format!("/dev/shm/{name}");
        for attack in [
            format!("truncate -s 0 {path}"),
            format!("rm -f {path}"),
            format!("ln -sf /dev/null {path}"),
        ] {
            assert!(
                !shell_as(STRANGER_UID, &attack),
                "uid {STRANGER_UID}: {attack}"
            );
        }
        assert!(Path::new(&path).exists(), "{path}");
    }
    // The pods' uid may not touch the limits (the hypervisor's), but may
    // shrink every object it can write: the node tables and the ledger.
    assert!(!shell_as(
        PODS_UID,
        &format!("truncate -s 0 /dev/shm/{limits}")
    ));
    for name in [&tables.activity, &tables.priority, &ledger] {
        assert!(
            shell_as(PODS_UID, &format!("truncate -s 0 /dev/shm/{name}")),
            "uid {PODS_UID} may write {name}"
        );
    }
    // The daemon reads the shrunk ledger and priority table for its metrics,
    // and says what happened.
    assert_eq!(metrics_status(&hypervisor.url()), "HTTP/1.1 200 OK");
    let status = hypervisor.hypervisor().status();
    let pod_status = status
        .pods
        .iter()
        .find(|status| status.id == pod.0)
        .expect("pod status");
    assert!(pod_status.ledger_shrunk, "{pod_status:?}");

    victim
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"\n")
        .expect("resume the victim");
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).expect("victim output");
    let mut stderr = String::new();
    let _ = victim
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr);
    let status = victim.wait().expect("victim ends");
    assert!(status.success(), "{status:?}: {rest}\n{stderr}");
    let after: Vec<&str> = rest.lines().collect();
    let line = |prefix: &str| {
        after
            .iter()
            .find(|line| line.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} line: {after:?}"))
    };
    assert!(line("run kernel").contains("-> 0 "), "{after:?}");
    // Its ledger lost its counts: allocations are refused, not unlimited.
    assert!(line("alloc mem").contains("-> 2 "), "{after:?}\n{stderr}");
    assert!(stderr.contains("was shrunk"), "{stderr}");
    assert_eq!(metrics_status(&hypervisor.url()), "HTTP/1.1 200 OK");
}
