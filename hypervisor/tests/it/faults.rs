//! Faults: workers that die, a hypervisor that restarts, and the binary's
//! own life (SIGHUP, status, SIGTERM).

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Command as Process, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::daemon::{Killed, bin, listening, serve};
use common::*;
use gpu_fakes::FakeGpus;
use gpushare_utils::ledger::PodLedger;
use gpushare_utils::protocol::Command;

/// Not a test of its own: the child process of
/// `a_dead_worker_is_removed_and_its_memory_given_back`, which reserves
/// memory in its pod's region and then waits to be killed.
#[test]
fn child_helper() {
    let Ok(pod) = std::env::var("HV_TEST_CHILD_POD") else {
        return;
    };
    let ledger = PodLedger::open(&pod).expect("open region");
    ledger.try_reserve(0, 1 << 30).expect("reserve");
    println!("ready");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn spawn_child(pod: &str) -> Killed {
    let mut child = Process::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "faults::child_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("HV_TEST_CHILD_POD", pod)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn child");
    let stdout = child.stdout.take().expect("stdout");
    let child = Killed(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        // libtest may print "test child_helper ... " on the same line.
        let ready = lines.any(|line| line.is_ok_and(|l| l.trim_end().ends_with("ready")));
        let _ = tx.send(ready);
        // Keep reading, so the child never blocks on a full pipe.
        for _ in lines {}
    });
    let ready = rx.recv_timeout(Duration::from_secs(30));
    assert_eq!(ready, Ok(true), "child did not get ready");
    child
}

#[test]
fn a_dead_worker_is_removed_and_its_memory_given_back() {
    let a = unique("dead");
    let config = format!(
        "check_pids = true\n{}",
        pod_toml(&a, &["index = 0\nmemory = \"4g\"\ncap = 50"])
    );
    let h = Harness::start(&config, 1, &[&a]);
    let mut child = spawn_child(&a);
    let pid = child.0.id();
    let (status, body) = register(&h.url(), &a, &token_of(&a), pid);
    assert_eq!(status, 200, "{body}");
    let region = RegionView::open(&a);
    assert_eq!(region.used(0), 1 << 30);

    child.0.kill().expect("kill");
    child.0.wait().expect("reap");
    let gone = wait_for(Duration::from_secs(5), || {
        h.hv.hypervisor().status().workers.is_empty() && region.used(0) == 0
    });
    assert!(
        gone,
        "worker or memory still there: {:?} {:?}",
        h.hv.hypervisor().status().workers,
        region.0.usage(0)
    );
}

#[test]
fn a_silent_worker_expires() {
    let a = unique("ttl");
    let config = format!(
        "worker_ttl_ms = 300\n{}",
        pod_toml(&a, &["index = 0\ncap = 50"])
    );
    let h = Harness::start(&config, 1, &[&a]);
    let silent = register_ok(&h.url(), &a).worker_id;
    let talking = register_ok(&h.url(), &a).worker_id;
    let _worker = FakeWorker::start(&h.url(), &a, &talking);
    let expired = wait_for(Duration::from_secs(5), || {
        let workers = h.hv.hypervisor().status().workers;
        !workers.iter().any(|w| w.id == silent) && workers.iter().any(|w| w.id == talking)
    });
    assert!(expired, "{:?}", h.hv.hypervisor().status().workers);
    // The one that long-polls stays.
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        h.hv.hypervisor()
            .status()
            .workers
            .iter()
            .any(|w| w.id == talking)
    );
}

#[test]
fn a_restart_keeps_regions_and_takes_workers_back() {
    let a = unique("restart");
    let config = ConfigFile::new(&format!(
        "admin_token = \"{ADMIN}\"\n{}",
        pod_toml(&a, &["index = 0\nmemory = \"3g\"\ncap = 30"])
    ));
    let regions = Regions(vec![a.clone()]);
    let sim = Arc::new(FakeGpus::new(1));
    let first = start_hypervisor(&config.path, Arc::clone(&sim));
    let old_worker = register_ok(&first.url(), &a).worker_id;
    assert_eq!(
        call(
            "POST",
            &format!("{}/api/v1/pods/{a}/suspend", first.url()),
            Some(ADMIN),
            None
        )
        .0,
        200
    );
    first.stop();

    // Meanwhile the pod keeps its last limits.
    let region = RegionView::open(&a);
    assert_eq!(region.quota(0), 3 << 30);
    assert_eq!(region.rate(0), 300_000);
    let bucket = region.bucket(0);
    assert_eq!(bucket.limits().managed.load(Ordering::Acquire), 1);
    assert_eq!(bucket.limits().suspended.load(Ordering::Acquire), 1);

    let second = start_hypervisor(&config.path, sim);
    assert_eq!(region.quota(0), 3 << 30);
    assert_eq!(region.rate(0), 300_000);
    let status = second.hypervisor().status();
    assert!(status.pods[0].suspended, "suspension survives the restart");

    // The worker of the first run is taken back on its next request...
    let worker = FakeWorker::start(&second.url(), &a, &old_worker);
    assert!(wait_for(Duration::from_secs(5), || {
        second
            .hypervisor()
            .status()
            .workers
            .iter()
            .any(|w| w.id == old_worker && w.adopted)
    }));
    let (code, body) = call(
        "POST",
        &format!("{}/api/v1/pods/{a}/resume", second.url()),
        Some(ADMIN),
        None,
    );
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(&old_worker), "old worker adopted: {body}");
    assert_eq!(
        worker.next_command(Duration::from_secs(5)),
        Some(Command::Resume)
    );
    assert_eq!(bucket.limits().suspended.load(Ordering::Acquire), 0);
    // ...and registering again works too.
    let again = register_ok(&second.url(), &a);
    assert_ne!(again.worker_id, old_worker);
    drop(worker);
    second.stop();
    drop(regions);
}

#[test]
fn the_binary_reloads_on_sighup_prints_status_and_stops_on_sigterm() {
    let a = unique("bin");
    let text = |memory: &str| {
        format!(
            "listen = \"127.0.0.1:0\"\n{}",
            pod_toml(
                &a,
                &[&format!("index = 0\nmemory = \"{memory}\"\ncap = 40")]
            )
        )
    };
    let config = ConfigFile::new(&text("1g"));
    let _regions = Regions(vec![a.clone()]);
    let (mut daemon, addr) = listening(serve(&config));
    let region = RegionView::open(&a);
    assert_eq!(region.quota(0), 1 << 30);

    // Same length and the old mtime: only SIGHUP can make it notice.
    let before = std::fs::metadata(&config.path)
        .and_then(|m| m.modified())
        .expect("mtime");
    std::fs::write(&config.path, text("2g")).expect("rewrite");
    std::fs::File::options()
        .write(true)
        .open(&config.path)
        .and_then(|f| f.set_modified(before))
        .expect("restore mtime");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(region.quota(0), 1 << 30, "reloaded without a signal");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(daemon.0.id() as i32, libc::SIGHUP) };
    assert!(
        wait_for(Duration::from_secs(5), || region.quota(0) == 2 << 30),
        "SIGHUP did not reload"
    );

    let status = Process::new(bin())
        .args(["status", "--addr", &addr])
        .output()
        .expect("status");
    let table = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{table} {:?}", status.stderr);
    assert!(table.contains(&a) && table.contains("40.0%"), "{table}");
    println!("{table}");

    let check = Process::new(bin())
        .args(["check-config", "--config"])
        .arg(&config.path)
        .output()
        .expect("check-config");
    assert!(check.status.success());
    let bad = ConfigFile::new("[[pods]]\nid = \"x\"\n");
    let check = Process::new(bin())
        .args(["check-config", "--config"])
        .arg(&bad.path)
        .output()
        .expect("check-config");
    assert!(!check.status.success());
    let message = String::from_utf8_lossy(&check.stderr);
    assert!(
        message.contains("exactly one of token") && message.lines().count() == 1,
        "{message}"
    );

    // SAFETY: signalling our own child.
    unsafe { libc::kill(daemon.0.id() as i32, libc::SIGTERM) };
    let exit = daemon.0.wait().expect("wait");
    assert!(exit.success(), "{exit:?}");
    assert_eq!(region.quota(0), 2 << 30, "the region outlives the daemon");
}
