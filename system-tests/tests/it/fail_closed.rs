//! Fault injection on the driver double and loopback: no fault, neighbour or
//! exit turns a limit off or makes a report lie.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;

use gpushare_utils::ledger::{MAX_DEVICES, PodLedger, REGION_SIZE};
use gpushare_utils::limits::PodLimits;
use gpushare_utils::shm::Creation;
use system_tests::RunningNode;
use system_tests::daemon::double_gpus;
use system_tests::pod::Pod;
use system_tests::probes::{CONTEXT_BYTES, GIB, info, probe, run};
use system_tests::{daemon, probes};

const TOKEN: &str = "pod-token";

/// A hypervisor on loopback for `pod` (`gpus`: `[[pods.gpus]]` bodies).
fn start(pod: &Pod, gpus: &[&str], count: u8) -> RunningNode {
    let mut text = format!(
        "listen = \"127.0.0.1:0\"\n[[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n",
        pod.0
    );
    for gpu in gpus {
        text.push_str(&format!("[[pods.gpus]]\n{gpu}\n"));
    }
    daemon::hypervisor(pod, &text, Arc::new(double_gpus(count)))
}

/// A probe of `pod` under the hypervisor at `url` with `token`.
fn managed(pod: &Pod, url: &str, token: &str, env: &[(&str, &str)], args: &[&str]) -> Command {
    let mut command = probe("cudaprobe", pod, env, args);
    command
        .env("CUDA_LIMITER_HYPERVISOR", url)
        .env("CUDA_LIMITER_TOKEN", token)
        .env("CUDA_LIMITER_GRANT_TIMEOUT_MS", "500");
    probes::use_node_tables(&mut command, pod);
    command
}

/// The lines this library printed on stderr.
fn our_lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .filter(|line| line.starts_with("cuda-limiter:"))
        .map(str::to_owned)
        .collect()
}

/// A loopback port nothing listens on.
fn closed_port_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    format!("http://127.0.0.1:{port}")
}

#[test]
fn hypervisor_faults_apply_the_published_or_the_local_limit_or_refuse_cuda() {
    let known = Pod::new("fault-known");
    let live = start(&known, &["index = 0\nmemory = \"4g\""], 1);
    let down = closed_port_url();
    let url = live.url();
    // (what, url, token, pod known to the hypervisor?)
    let faults = [
        ("hypervisor down", down.as_str(), TOKEN, false),
        ("not a URL", "not a url", TOKEN, false),
        ("empty token", url.as_str(), "", true),
        ("wrong token", url.as_str(), "nope", true),
        ("unknown pod", url.as_str(), TOKEN, false),
    ]
    .map(|(what, url, token, known_pod)| (what, url.to_owned(), token, known_pod));
    for (what, url, token, known_pod) in &faults {
        let stranger = Pod::new("fault-stranger");
        let pod = if *known_pod { &known } else { &stranger };
        // With a local limit: it applies, unless the hypervisor published
        // limits for the pod the environment names (then those apply).
        let output = managed(
            pod,
            url,
            token,
            &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")],
            &["info", "alloc", "mem", "5g", "alloc", "mem", "512m"],
        )
        .output()
        .expect("probe");
        let lines = probes::stdout_lines(&output);
        assert!(output.status.success(), "{what}: {output:?}");
        let (quota, said) = if *known_pod {
            (
                4 * GIB,
                "the limits the node's hypervisor published for pod",
            )
        } else {
            (GIB, "the local limits apply")
        };
        assert_eq!(lines[0], info(0, quota - CONTEXT_BYTES, quota), "{what}");
        assert!(
            lines[1].starts_with("alloc mem 5g -> 2 "),
            "{what}: {lines:?}"
        );
        assert!(
            lines[2].starts_with("alloc mem 512m -> 0 "),
            "{what}: {lines:?}"
        );
        let ours = our_lines(&output);
        assert_eq!(ours.len(), 1, "{what}: one line: {ours:?}");
        assert!(ours[0].contains(said), "{what}: {ours:?}");

        // Without: CUDA refuses to initialise, with one line.
        let output = managed(pod, url, token, &[], &["alloc", "mem", "2g"])
            .output()
            .expect("probe");
        assert!(!output.status.success(), "{what}: ran: {output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("cuInit failed: 3"), "{what}: {stderr}");
        let ours = our_lines(&output);
        assert_eq!(ours.len(), 1, "{what}: one line: {stderr}");
        assert!(
            ours[0].contains("CUDA refuses to initialise"),
            "{what}: {stderr}"
        );
    }
}

#[test]
fn a_pod_cannot_raise_its_own_limits_through_its_region() {
    let pod = Pod::new("raise");
    let hypervisor = start(&pod, &["index = 0\nmemory = \"1g\""], 1);
    // The pod's own process writes everything it can write: its region.
    let region = PodLedger::open(&pod.0).expect("the pod's region");
    for entry in 0..MAX_DEVICES {
        region.set_quota(entry, 0).expect("quota word");
        let bucket = region.compute(entry).expect("bucket");
        bucket
            .limits()
            .rate_ppm
            .store(0, std::sync::atomic::Ordering::Release);
    }
    let lines = run(managed(
        &pod,
        &hypervisor.url(),
        TOKEN,
        &[],
        &["info", "alloc", "mem", "2g", "alloc", "mem", "512m"],
    ));
    assert_eq!(lines[0], info(0, GIB - CONTEXT_BYTES, GIB));
    assert!(lines[1].starts_with("alloc mem 2g -> 2 "), "{lines:?}");
    assert!(lines[2].starts_with("alloc mem 512m -> 0 "), "{lines:?}");
    // And the limits themselves: another user cannot open them to write.
    match nobody() {
        Some(uid) => {
            let path = format!("/dev/shm/gpushare-limits-{}", pod.0);
            let status = Command::new("sh")
                .args(["-c", &format!("printf x >> {path}")])
                .uid(uid)
                .gid(uid)
                .stderr(Stdio::null())
                .status()
                .expect("sh");
            assert!(!status.success(), "uid {uid} wrote the pod's limits");
        }
        None => eprintln!("skipped: the limits' write check needs root to act as another user"),
    }
}

/// A uid to play another user with, when this process may (root).
fn nobody() -> Option<u32> {
    // SAFETY: geteuid has no preconditions.
    (unsafe { libc::geteuid() } == 0).then_some(65534)
}

#[test]
fn a_region_squatted_by_another_user_is_replaced() {
    let Some(uid) = nobody() else {
        eprintln!("skipped: squatting needs root to act as another user (uid 65534)");
        return;
    };
    let pod = Pod::new("squat");
    let path = format!("/dev/shm/gpushare-pod-{}", pod.0);
    // Another user creates the pod's region first, in the layout a limiter
    // expects (all zero is a valid empty ledger), writable by all, and
    // keeps it open.
    let status = Command::new("sh")
        .args([
            "-c",
            &format!("head -c {REGION_SIZE} /dev/zero > {path} && chmod 666 {path}"),
        ])
        .uid(uid)
        .gid(uid)
        .status()
        .expect("sh");
    assert!(status.success(), "could not plant the region as uid {uid}");
    let mut planted = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("squatted region");
    let hypervisor = start(&pod, &["index = 0\nmemory = \"1g\""], 1);
    // The hypervisor replaces it: the pod is served from a region of its own.
    let status = serde_json::to_string(&hypervisor.hypervisor().status()).expect("json");
    assert!(
        status.contains(&format!("\"id\":\"{}\"", pod.0)),
        "{status}"
    );
    let meta = std::fs::metadata(&path).expect("region");
    assert_eq!(
        (meta.uid(), meta.mode() & 0o777),
        (gpushare_utils::shm::effective_uid(), 0o600)
    );
    // What the squatter writes lands in its own, unlinked object.
    planted.write_all(&[0xffu8; 64]).expect("write");
    let output = managed(
        &pod,
        &hypervisor.url(),
        TOKEN,
        &[("CUDA_DEVICE_MEMORY_LIMIT", "8g")],
        &["alloc", "mem", "2g", "alloc", "mem", "512m"],
    )
    .output()
    .expect("probe");
    let lines = probes::stdout_lines(&output);
    assert!(lines[0].starts_with("alloc mem 2g -> 2 "), "{output:?}");
    assert!(lines[1].starts_with("alloc mem 512m -> 0 "), "{output:?}");
}

#[test]
fn containers_with_different_visible_gpus_each_get_their_quota() {
    let pod = Pod::new("visible");
    let hypervisor = start(
        &pod,
        &[
            &format!("uuid = \"{}\"\nmemory = \"1g\"", gpushare_examples::uuid(0)),
            &format!("uuid = \"{}\"\nmemory = \"2g\"", gpushare_examples::uuid(1)),
        ],
        2,
    );
    let container = |visible: &str| {
        let mut command = managed(
            &pod,
            &hypervisor.url(),
            TOKEN,
            &[
                ("GPUSHARE_DOUBLE_DEVICES", "2"),
                ("CUDA_VISIBLE_DEVICES", visible),
            ],
            &["wait", "info", "alloc", "mem", "3g"],
        );
        command.stdin(Stdio::piped()).stdout(Stdio::piped());
        command.spawn().expect("spawn container")
    };
    // Both registered before either reports: the last registration must not win.
    let mut first = container("1");
    let mut second = container("0");
    let ready = |child: &mut std::process::Child| {
        use std::io::BufRead;
        let out = child.stdout.as_mut().expect("stdout");
        let mut line = String::new();
        std::io::BufReader::new(out)
            .read_line(&mut line)
            .expect("ready");
        assert_eq!(line.trim(), "ready");
    };
    ready(&mut first);
    ready(&mut second);
    let finish = |mut child: std::process::Child| {
        drop(child.stdin.take());
        let output = child.wait_with_output().expect("container");
        probes::check(&output);
        probes::stdout_lines(&output)
    };
    let (first, second) = (finish(first), finish(second));
    assert_eq!(
        first[1],
        info(0, 2 * GIB - CONTEXT_BYTES, 2 * GIB),
        "{first:?}"
    );
    assert!(first[2].starts_with("alloc mem 3g -> 2 "), "{first:?}");
    assert_eq!(second[1], info(0, GIB - CONTEXT_BYTES, GIB), "{second:?}");
    assert!(second[2].starts_with("alloc mem 3g -> 2 "), "{second:?}");
}

/// Reports right after a process holding 3 GiB ended, normally or killed.
#[test]
fn reports_are_right_at_once_after_a_process_exits() {
    for killed in [false, true] {
        let pod = Pod::new(if killed { "killed" } else { "exited" });
        let env = [("CUDA_DEVICE_MEMORY_LIMIT", "4g")];
        let mut holder = probe("cudaprobe", &pod, &env, &["alloc", "mem", "3g", "wait"]);
        holder.stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut holder = holder.spawn().expect("holder");
        {
            use std::io::BufRead;
            let out = holder.stdout.as_mut().expect("stdout");
            let mut reader = std::io::BufReader::new(out);
            let mut line = String::new();
            reader.read_line(&mut line).expect("alloc line");
            assert!(line.starts_with("alloc mem 3g -> 0 "), "{line}");
            line.clear();
            reader.read_line(&mut line).expect("ready");
        }
        if killed {
            holder.kill().expect("SIGKILL");
        } else {
            drop(holder.stdin.take());
        }
        holder.wait().expect("holder ends");
        let lines = run(probe("cudaprobe", &pod, &env, &["info", "nvml"]));
        let free = 4 * GIB - CONTEXT_BYTES;
        assert_eq!(lines[0], info(0, free, 4 * GIB), "killed={killed}");
        assert_eq!(
            lines[1],
            format!("nvml 0 free={free} used={CONTEXT_BYTES} total={}", 4 * GIB),
            "killed={killed}"
        );
    }
}

#[test]
fn a_free_the_driver_refuses_keeps_its_charge() {
    let pod = Pod::new("free-fails");
    let lines = run(probe(
        "cudaprobe",
        &pod,
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("GPUSHARE_DOUBLE_FAIL_FREES", "1"),
        ],
        &[
            "alloc", "mem", "3g", "free", "0", "alloc", "mem", "2g", "free", "0", "alloc", "mem",
            "2g",
        ],
    ));
    assert_eq!(lines[1], "free 0 -> 700");
    // The memory is still allocated, so still charged.
    assert!(lines[2].starts_with("alloc mem 2g -> 2 "), "{lines:?}");
    assert_eq!(lines[3], "free 0 -> 0");
    assert!(lines[4].starts_with("alloc mem 2g -> 0 "), "{lines:?}");
}

#[test]
fn nvml_not_knowing_a_process_figure_keeps_the_context_estimate() {
    let pod = Pod::new("nvml-na");
    let lines = run(probe(
        "cudaprobe",
        &pod,
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("GPUSHARE_DOUBLE_NVML_UNAVAILABLE", "1"),
        ],
        &["info", "alloc", "mem", "1g", "info"],
    ));
    // No driver overhead could be measured: the context stays charged at
    // what it was reserved at before it was created, nothing more (all ones
    // would have saturated the pod's usage), and allocations still fit.
    let context = 512 << 20;
    assert_eq!(lines[0], info(0, 4 * GIB - context, 4 * GIB));
    assert!(lines[1].starts_with("alloc mem 1g -> 0 "), "{lines:?}");
    assert_eq!(lines[2], info(0, 3 * GIB - context, 4 * GIB));
}

#[test]
fn limits_a_pod_publishes_for_itself_are_not_trusted() {
    let Some(uid) = nobody() else {
        eprintln!("skipped: forging limits needs root to act as another user (uid 65534)");
        return;
    };
    // An unprivileged pod creates its limits object before the daemon does,
    // well formed and published, with 64 GiB for its GPU, then runs a process
    // with a local 1 GiB limit and a daemon it cannot reach.
    let pod = Pod::new("forged");
    let forged = PodLimits::create_or_adopt(
        &pod.0,
        &Creation {
            uid: Some(uid),
            gid: Some(uid),
            mode: 0o644,
        },
    )
    .expect("forged limits");
    forged
        .set(&gpushare_examples::uuid(0), 64 * GIB)
        .expect("forged quota");
    forged.publish();
    let output = managed(
        &pod,
        "http://127.0.0.1:9",
        TOKEN,
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDA_LIMITER_GRANT_TIMEOUT_MS", "300"),
        ],
        &["info", "alloc", "mem", "2g", "alloc", "mem", "512m"],
    )
    .uid(uid)
    .gid(uid)
    .output()
    .expect("probe");
    let lines = probes::stdout_lines(&output);
    assert!(output.status.success(), "{output:?}");
    // The local limit holds, and the line says why the limits were refused.
    assert_eq!(lines[0], info(0, GIB - CONTEXT_BYTES, GIB), "{output:?}");
    assert!(lines[1].starts_with("alloc mem 2g -> 2 "), "{output:?}");
    assert!(lines[2].starts_with("alloc mem 512m -> 0 "), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("owned by uid {uid}, which is not trusted")),
        "{stderr}"
    );
}
