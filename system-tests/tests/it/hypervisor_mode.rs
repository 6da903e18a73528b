//! The limiter under a real hypervisor on loopback: limits come from it,
//! suspend blocks launches, and a dead hypervisor leaves the last limits.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use system_tests::RunningNode;
use system_tests::daemon::double_gpus;
use system_tests::pod::Pod;
use system_tests::probes::{CONTEXT_BYTES, GIB, info, probe, run};
use system_tests::swapping::Running;
use system_tests::wait::eventually;
use system_tests::{artifacts, daemon, probes};

const TOKEN: &str = "pod-token";

fn start(pod: &Pod, gpu: &str) -> RunningNode {
    start_on(pod, gpu, "127.0.0.1:0")
}

/// A daemon for `pod` listening on `listen`, its one GPU given `gpu`.
fn start_on(pod: &Pod, gpu: &str, listen: &str) -> RunningNode {
    let text = format!(
        "listen = \"{listen}\"\nadmin_token = \"admin\"\n\n[[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n\n[[pods.gpus]]\nindex = 0\n{gpu}\n",
        pod.0
    );
    daemon::hypervisor(pod, &text, Arc::new(double_gpus(1)))
}

fn managed(pod: &Pod, url: &str, token: &str, args: &[&str]) -> std::process::Command {
    let mut command = probe(
        "cudaprobe",
        pod,
        &[
            ("CUDA_LIMITER_HYPERVISOR", url),
            ("CUDA_LIMITER_TOKEN", token),
        ],
        args,
    );
    probes::use_node_tables(&mut command, pod);
    command
}

#[test]
fn quota_and_share_come_from_the_hypervisor() {
    // Timed: the share it measures needs the CPUs to itself.
    let _serial = probes::serial();
    let pod = Pod::new("hv-limits");
    let hypervisor = start(&pod, "memory = \"1g\"\ncap = 40\npolicy = \"fixed\"");
    let mut command = managed(
        &pod,
        &hypervisor.url(),
        TOKEN,
        &[
            "info", "alloc", "mem", "2g", "run", "kernel", "1000", "1500",
        ],
    );
    let output = command
        .env("CUDA_LIMITER_LOG", "info")
        .output()
        .expect("probe");
    assert!(output.status.success(), "{output:?}");
    let lines = probes::stdout_lines(&output);
    assert_eq!(lines[0], info(0, GIB - CONTEXT_BYTES, GIB));
    assert!(lines[1].contains("-> 2 "), "{lines:?}");
    probes::assert_share(&lines[2], 400, 40);
    // What the hypervisor's share cost the process, at its exit.
    let stderr = String::from_utf8_lossy(&output.stderr);
    let charged_share = stderr
        .lines()
        .find(|line| line.contains("compute summary: device=0 pod_launches="))
        .and_then(|line| line.split(" charged_share=").nth(1)?.split(' ').next())
        .and_then(|share| share.parse::<f64>().ok());
    assert!(
        charged_share.is_some_and(|share| (0.3..=0.5).contains(&share)),
        "{stderr}"
    );
    // The worker registered, with the device it sees.
    let status = hypervisor.hypervisor().status();
    let status = serde_json::to_string(&status).expect("status json");
    assert!(status.contains(&pod.0), "{status}");
}

#[test]
fn the_pods_published_limits_apply_whatever_the_environment_says() {
    // Timed: the share it measures needs the CPUs to itself.
    let _serial = probes::serial();
    // The environment chooses the pod; where its limits are published, a
    // process that names no hypervisor, or one the hypervisor refused (a
    // wrong token), still runs on them, not on a local limit of its own.
    let pod = Pod::new("hv-env");
    let hypervisor = start(&pod, "memory = \"1g\"\ncap = 40\npolicy = \"fixed\"");
    let script = [
        "info", "alloc", "mem", "2g", "run", "kernel", "1000", "1500",
    ];
    let local = [("CUDA_DEVICE_MEMORY_LIMIT", "8g")];
    let mut without = probes::probe("cudaprobe", &pod, &local, &script);
    probes::use_node_tables(&mut without, &pod);
    let mut wrong_token = managed(&pod, &hypervisor.url(), "not-the-token", &script);
    wrong_token.env("CUDA_DEVICE_MEMORY_LIMIT", "8g");
    for (what, mut command) in [("no hypervisor", without), ("wrong token", wrong_token)] {
        let output = command.output().expect("probe");
        let lines = probes::stdout_lines(&output);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{what}: {output:?}");
        assert_eq!(
            lines[0],
            info(0, GIB - CONTEXT_BYTES, GIB),
            "{what}: {stderr}"
        );
        assert!(lines[1].contains("-> 2 "), "{what}: {lines:?}");
        probes::assert_share(&lines[2], 400, 40);
        assert!(
            stderr.contains(&format!(
                "the limits the node's hypervisor published for pod {} apply",
                pod.0
            )),
            "{what}: {stderr}"
        );
    }
}

#[test]
fn a_throttled_loop_asks_the_hypervisor_only_until_it_counts_the_pod() {
    // Timed: the share it measures needs the CPUs to itself.
    let _serial = probes::serial();
    let pod = Pod::new("hv-asks");
    let hypervisor = start(&pod, "cap = 40\npolicy = \"fixed\"");
    let asked = || hypervisor.hypervisor().status().admission.count;
    let before = asked();
    let lines = run(managed(
        &pod,
        &hypervisor.url(),
        TOKEN,
        &["run", "kernel", "100", "1000"],
    ));
    let asks = asked() - before;
    let launches = probes::number(&lines[0], "launches");
    probes::assert_share(&lines[0], 400, 40);
    // A thread that finds the bucket empty asks only while the hypervisor
    // does not count the pod as wanting the GPU (before its first tick saw
    // the pod launch, or after 200 ms without a launch or a wait); the few
    // hundred other waits of this run end on the local refill.
    assert!(
        asks <= 2,
        "{asks} admission requests for {launches} launches"
    );
}

#[test]
fn suspended_pods_wait_and_resume_without_losing_work() {
    let pod = Pod::new("hv-suspend");
    let hypervisor = start(&pod, "cap = 50\npolicy = \"fixed\"");
    let child = managed(
        &pod,
        &hypervisor.url(),
        TOKEN,
        &["run", "kernel", "1000", "2500", "series", "250"],
    )
    .stdout(std::process::Stdio::piped())
    .spawn()
    .expect("spawn");
    std::thread::sleep(Duration::from_millis(750));
    hypervisor.hypervisor().suspend(&pod.0).expect("suspend");
    std::thread::sleep(Duration::from_millis(200));
    let asked = || hypervisor.hypervisor().status().admission.count;
    let before = asked();
    std::thread::sleep(Duration::from_millis(800));
    // The trapped thread asks for admission, is granted nothing (each ask
    // waits up to 50 ms in the hypervisor), and backs off: a few asks, not
    // one after every answer (about 16 in this time).
    let asks = asked() - before;
    hypervisor.hypervisor().resume(&pod.0).expect("resume");
    let output = child.wait_with_output().expect("probe");
    assert!(asks <= 6, "{asks} admission requests while suspended");
    probes::check(&output);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].contains("-> 0 "), "{lines:?}");
    let series: Vec<i64> = lines[1]
        .split("pm=")
        .nth(1)
        .expect("series")
        .split(',')
        .filter_map(|value| value.parse().ok())
        .collect();
    // Windows of 250 ms: running at 50%, then stopped, then 50% again;
    // running windows below 50% by at most the time the thread waited for
    // a CPU (at worst all of it in one window). Where the stop falls among
    // the probe's windows depends on how long the probe took to start: the
    // second of suspension covers three whole windows wherever it falls.
    let window_delay = probes::number(lines[0], "delay_ns") * 1000 / 250_000_000;
    let running = |window: i64| window <= 560 && window >= 440 - window_delay;
    let stopped = series.iter().position(|&w| w <= 30);
    let Some(stopped) = stopped.filter(|&at| at > 0) else {
        panic!("not running, then suspended: {series:?}");
    };
    // The window the suspension began in ran part of its time.
    assert!(series[..stopped].iter().any(|&w| running(w)), "{series:?}");
    let stretch = series[stopped..].iter().take_while(|&&w| w <= 30).count();
    assert!(stretch >= 3, "not suspended for a second: {series:?}");
    // So does the window it ended in; the next ones run.
    let after = &series[stopped + stretch..];
    assert!(
        after.iter().skip(1).any(|&w| running(w)),
        "not resumed: {series:?}"
    );
}

#[test]
fn a_dead_hypervisor_leaves_the_last_limits_in_force() {
    // Timed: the share it measures needs the CPUs to itself.
    let _serial = probes::serial();
    let pod = Pod::new("hv-dead");
    let hypervisor = start(&pod, "memory = \"1g\"\ncap = 30\npolicy = \"fixed\"");
    let url = hypervisor.url();
    drop(hypervisor);
    let lines = run(managed(
        &pod,
        &url,
        TOKEN,
        &["info", "run", "kernel", "1000", "1000"],
    ));
    assert_eq!(lines[0], info(0, GIB - CONTEXT_BYTES, GIB));
    probes::assert_share(&lines[1], 300, 40);
}

#[test]
fn a_worker_tries_a_lost_hypervisor_every_second_and_is_taken_back_on_its_return() {
    let pod = Pod::new("hv-back");
    let gpu = "cap = 40\npolicy = \"fixed\"";
    let first = start(&pod, gpu);
    let mut running = Running::start(&pod, &first.url(), &[], &["info", "wait"]);
    running.until_ready();
    let worker_listed = |node: &RunningNode| {
        let workers = node.hypervisor().status().workers;
        workers.iter().find(|w| w.pod == pod.0).map(|w| w.adopted)
    };
    eventually("the probe's worker is listed", || {
        worker_listed(&first).is_some()
    });
    let addr = first.addr();
    first.stop();

    // Six seconds away, its tries are counted where the daemon listened: a
    // backoff that kept doubling would leave seconds between the last ones.
    let away = std::net::TcpListener::bind(addr).expect("the daemon's address");
    away.set_nonblocking(true).expect("nonblocking");
    let gone = Instant::now();
    let mut tries = vec![gone];
    while gone.elapsed() < Duration::from_secs(6) {
        match away.accept() {
            Ok(_) => tries.push(Instant::now()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
    tries.push(Instant::now());
    let gaps: Vec<Duration> = tries.windows(2).map(|w| w[1] - w[0]).collect();
    let longest = gaps.iter().max().copied().unwrap_or_default();
    assert!(
        longest < Duration::from_millis(1500),
        "{} tries in 6 s, the longest gap {longest:?}: {gaps:?}",
        tries.len() - 2
    );
    drop(away);

    // Back on the same address, the daemon takes the worker of its earlier
    // run back on its next request.
    let again = start_on(&pod, gpu, &addr.to_string());
    eventually("the worker is taken back", || {
        worker_listed(&again) == Some(true)
    });
    running.resume();
    let (_, status) = running.finish();
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_wrong_token_is_refused_and_cuda_with_it() {
    let pod = Pod::new("hv-token");
    let hypervisor = start(&pod, "memory = \"1g\"");
    let output = managed(
        &pod,
        &hypervisor.url(),
        "not-the-token",
        &["info", "sleep", "300"],
    )
    .env("CUDA_LIMITER_GRANT_TIMEOUT_MS", "2000")
    .output()
    .expect("probe");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cuInit failed: 3"), "{stderr}");
    let ours: Vec<&str> = stderr
        .lines()
        .filter(|line| line.starts_with("cuda-limiter:"))
        .collect();
    assert_eq!(ours.len(), 1, "one line: {stderr}");
    assert!(ours[0].contains("registration refused (401"), "{stderr}");
    // Refused at once: the line says how long it really waited, not the
    // 2000 ms it would have.
    let waited: u64 = ours[0]
        .split(" after ")
        .nth(1)
        .and_then(|rest| rest.split(" ms").next())
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("no wait said: {stderr}"));
    assert!(waited < 1500, "{stderr}");
    let status = serde_json::to_string(&hypervisor.hypervisor().status()).expect("json");
    assert!(
        !status.contains(&format!("\"{}-", pod.0)),
        "registered: {status}"
    );
}

/// Runs `command` to its end, or kills it after `limit` and fails the test.
fn output_within(mut command: std::process::Command, limit: Duration) -> std::process::Output {
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let started = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > limit {
            let _ignored = child.kill();
            let output = child.wait_with_output().expect("reap");
            panic!("still running after {limit:?}: {output:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// A directory of the test's own, removed after.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(test: &str) -> Self {
        let path = std::env::temp_dir().join(format!("gpushare-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&path).expect("temp dir");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ignored = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_token_file_that_is_not_a_small_regular_file_is_refused_at_once() {
    // The token file is read when the library loads, in every process of the
    // container: one that blocks (a FIFO with no writer) or never ends
    // (/dev/zero) must not hang or exhaust the process. Each is refused with
    // one line, CUDA refused with it; a process that never uses CUDA runs.
    let dir = TempDir::new("token-file");
    let fifo = dir.0.join("fifo");
    let path = std::ffi::CString::new(fifo.to_str().expect("utf-8")).expect("path");
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0, "mkfifo");
    let large = dir.0.join("large");
    std::fs::File::create(&large)
        .and_then(|file| file.set_len(100 << 20))
        .expect("a sparse 100 MB file");
    let cases = [
        (fifo.as_path(), "not a regular file"),
        (Path::new("/dev/zero"), "not a regular file"),
        (dir.0.as_path(), "not a regular file"),
        (large.as_path(), "more than 4096 bytes"),
    ];
    for (file, reason) in cases {
        let pod = Pod::new("token-file");
        let mut command = probe(
            "cudaprobe",
            &pod,
            &[
                ("CUDA_LIMITER_HYPERVISOR", "http://127.0.0.1:9"),
                ("CUDA_LIMITER_TOKEN_FILE", file.to_str().expect("utf-8")),
            ],
            &["info"],
        );
        command.env_remove("CUDA_LIMITER_TOKEN");
        let output = output_within(command, Duration::from_secs(20));
        assert!(!output.status.success(), "{file:?}: {output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let ours: Vec<&str> = stderr
            .lines()
            .filter(|line| line.starts_with("cuda-limiter:"))
            .collect();
        assert_eq!(ours.len(), 1, "{file:?}: one line: {stderr}");
        assert!(
            ours[0].contains("refusing token file") && ours[0].contains(reason),
            "{file:?}: {stderr}"
        );
        assert!(stderr.contains("cuInit failed"), "{file:?}: {stderr}");

        let mut plain = std::process::Command::new("true");
        plain
            .env("LD_PRELOAD", artifacts::limiter())
            .env("CUDA_LIMITER_POD", &pod.0)
            .env("CUDA_LIMITER_HYPERVISOR", "http://127.0.0.1:9")
            .env("CUDA_LIMITER_TOKEN_FILE", file)
            .env_remove("CUDA_LIMITER_TOKEN");
        let output = output_within(plain, Duration::from_secs(20));
        assert!(output.status.success(), "{file:?}: {output:?}");
        assert!(output.stderr.is_empty(), "{file:?}: {output:?}");
    }
}

#[test]
fn a_token_from_a_regular_file_registers() {
    let pod = Pod::new("hv-token-file");
    let hypervisor = start(&pod, "memory = \"1g\"");
    let dir = TempDir::new("token-file-ok");
    let token = dir.0.join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).expect("token file");
    let mut command = managed(&pod, &hypervisor.url(), TOKEN, &["info"]);
    command
        .env_remove("CUDA_LIMITER_TOKEN")
        .env("CUDA_LIMITER_TOKEN_FILE", &token);
    let lines = run(command);
    assert_eq!(lines[0], info(0, GIB - CONTEXT_BYTES, GIB), "{lines:?}");
}

#[test]
fn a_gpu_the_hypervisor_gave_the_pod_no_limits_for_is_refused() {
    // The node's hypervisor knows GPU 0; the process also sees a second GPU
    // (another pod's, made visible, or a UUID the configuration does not
    // name). Nothing runs there: its context is refused (out of memory), so
    // neither allocations nor launches can be made on it.
    let pod = Pod::new("hv-unlisted");
    let hypervisor = start(&pod, "memory = \"1g\"");
    let script = [
        "alloc", "mem", "64m", "alloc", "mem", "5g", "run", "kernel", "100", "20",
    ];
    let command = |visible: &str| {
        let mut command = managed(&pod, &hypervisor.url(), TOKEN, &script);
        command
            .env("GPUSHARE_DOUBLE_DEVICES", "2")
            .env("CUDA_VISIBLE_DEVICES", visible);
        command
    };
    let lines = run(command("0"));
    assert!(lines[0].contains("-> 0 "), "{lines:?}");
    assert!(lines[1].contains("-> 2 "), "{lines:?}");
    assert!(
        lines[2].starts_with("run kernel") && lines[2].contains("-> 0 "),
        "{lines:?}"
    );
    let output = command("1").output().expect("probe");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{output:?}");
    assert!(
        stderr.contains("cudaprobe: cuDevicePrimaryCtxRetain failed: 2"),
        "{stderr}"
    );
    assert!(probes::stdout_lines(&output).is_empty(), "{output:?}");
}
