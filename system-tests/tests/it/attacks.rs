//! A tenant attacking the node's shared state, as an unprivileged uid
//! (`setpriv`): the pods' own uid, which may write every pod's ledger and
//! the node tables, and another uid, which may write none of them. The
//! daemon and the other processes survive, and no pod gets memory past its
//! quota.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use gpushare_utils::ledger::{PodLedger, REGION_SIZE};
use gpushare_utils::limits::PodLimits;
use hypervisor_observer::{GpuObserver, ProcessMemory};
use system_tests::daemon::{PODS_UID, pods_uid_hypervisor};
use system_tests::pod::{Pod, node_tables};
use system_tests::probes::as_uid;
use system_tests::wait::wait_for;
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

/// How long the daemon may take to see a spoiled ledger: its maintenance
/// runs every second.
const REPAIR_WITHIN: Duration = Duration::from_secs(5);

/// The inode of a regular file of a ledger's size at `path`, if that is
/// what stands there.
fn ledger_at(path: &str) -> Option<u64> {
    let meta = std::fs::symlink_metadata(path).ok()?;
    (meta.file_type().is_file() && meta.len() == REGION_SIZE as u64).then(|| meta.ino())
}

/// A new process of `pod` under `hypervisor`, as the pods' uid, running
/// `script`: its output lines.
fn pod_process(pod: &Pod, hypervisor: &system_tests::RunningNode, script: &[&str]) -> Vec<String> {
    let mut command = probes::probe(
        "cudaprobe",
        pod,
        &[
            ("CUDA_LIMITER_HYPERVISOR", &hypervisor.url()),
            ("CUDA_LIMITER_TOKEN", TOKEN),
        ],
        script,
    );
    probes::use_node_tables(&mut command, pod);
    probes::run(as_uid(&command, PODS_UID))
}

#[test]
fn a_ledger_replaced_under_the_daemon_is_made_again_and_new_processes_keep_their_quota() {
    let pod = Pod::new("replaced");
    // 1 GiB on GPU 0; the double's context takes 300 MiB of it.
    let hypervisor = pods_uid_hypervisor(&pod, TOKEN);
    let path = format!("/dev/shm/{}", PodLedger::name_of(&pod.0));
    for (kind, spoil) in [
        ("a directory", format!("rm -f {path} && mkdir {path}")),
        ("a link", format!("rm -f {path} && ln -s /dev/null {path}")),
        ("a FIFO", format!("rm -f {path} && mkfifo {path}")),
        ("an empty file", format!("rm -f {path} && touch {path}")),
        ("a huge file", format!("truncate -s 1T {path}")),
        ("mode 000", format!("chmod 000 {path}")),
    ] {
        let before = ledger_at(&path).expect("the daemon's ledger");
        assert!(shell_as(PODS_UID, &spoil), "uid {PODS_UID}: {spoil}");
        assert!(
            wait_for(REPAIR_WITHIN, || {
                ledger_at(&path).is_some_and(|inode| inode != before || kind == "mode 000")
                    && std::fs::symlink_metadata(&path)
                        .is_ok_and(|meta| meta.mode() & 0o777 == 0o600)
            }),
            "{kind}: the daemon did not make the ledger again"
        );
        let lines = pod_process(
            &pod,
            &hypervisor,
            &["alloc", "mem", "512m", "alloc", "mem", "512m"],
        );
        assert_eq!(probes::result_of(&lines[0]), 0, "{kind}: {lines:?}");
        assert_eq!(
            probes::result_of(&lines[1]),
            2,
            "{kind}: over the quota: {lines:?}"
        );
    }
}

#[test]
fn a_pod_that_removes_its_ledger_is_charged_what_its_processes_hold() {
    const MIB: u64 = 1 << 20;
    let pod = Pod::new("unledgered");
    let seen = Arc::new(daemon::double_gpus(1));
    let text = format!(
        "listen = \"127.0.0.1:0\"\nregion_uid = {PODS_UID}\nregion_gid = {PODS_UID}\n\n\
         [[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n\n[[pods.gpus]]\nindex = 0\nmemory = \"2g\"\n",
        pod.0
    );
    let hypervisor = daemon::hypervisor(&pod, &text, Arc::clone(&seen) as Arc<dyn GpuObserver>);
    // A process of the pod holds 1 GiB (and its context), then waits.
    let mut holder = probes::probe(
        "cudaprobe",
        &pod,
        &[
            ("CUDA_LIMITER_HYPERVISOR", &hypervisor.url()),
            ("CUDA_LIMITER_TOKEN", TOKEN),
        ],
        &["alloc", "mem", "1g", "pid", "wait"],
    );
    probes::use_node_tables(&mut holder, &pod);
    let mut holder = as_uid(&holder, PODS_UID)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("holder starts");
    let mut stdout = BufReader::new(holder.stdout.take().expect("stdout"));
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        assert!(
            stdout.read_line(&mut line).expect("output") > 0,
            "{lines:?}"
        );
        if line.starts_with("ready") {
            break;
        }
        lines.push(line.trim().to_owned());
    }
    assert_eq!(probes::result_of(&lines[0]), 0, "{lines:?}");
    let pid: u32 = lines[1]
        .strip_prefix("pid ")
        .and_then(|pid| pid.parse().ok())
        .expect("pid line");
    // What the driver says it holds: its gigabyte and its context.
    let held = 1024 * MIB + 300 * MIB;
    seen.set_process_memory(0, vec![ProcessMemory { pid, bytes: held }]);

    // The pod removes its ledger: its next process would make a fresh one
    // that counts nothing the first holds.
    let ledger = PodLedger::name_of(&pod.0);
    assert!(shell_as(PODS_UID, &format!("rm -f /dev/shm/{ledger}")));
    let status = || hypervisor.hypervisor().status().pods[0].gpus[0].clone();
    let charged = wait_for(REPAIR_WITHIN, || {
        status().memory_unaccounted >= held - 64 * MIB
    });
    // A second process: the driver's count of the first leaves it less
    // than 1 GiB of the 2 GiB quota.
    let lines = pod_process(&pod, &hypervisor, &["alloc", "mem", "1g", "info"]);
    holder
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"\n")
        .expect("resume the holder");
    let _ = holder.wait();
    assert!(
        charged,
        "the daemon never charged what NVML sees: {:?}",
        status()
    );
    assert_eq!(
        probes::result_of(&lines[0]),
        2,
        "past the quota as the driver sees it: {lines:?}"
    );
}
