//! The daemon under abuse, as the binary runs: half-open connections with few
//! descriptors, registrations sprayed with devices, unknown routes, and the
//! config checker's messages.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

use common::daemon::{Killed, bin, listening, serve};
use common::*;
use gpushare_utils::protocol::{Register, WorkerDevice};

/// Starts `hypervisor serve` on `config` with at most `files` descriptors;
/// returns it and its address.
fn serve_with_files(config: &ConfigFile, files: u64) -> (Killed, String) {
    let mut command = serve(config);
    // SAFETY: setrlimit is async-signal-safe; nothing else runs in the child.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: files,
                rlim_max: files,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    listening(command)
}

/// Raises this process's descriptor limit to what it needs, if it can.
fn allow_files(needed: u64) -> bool {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid out-pointer, then a valid rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 || limit.rlim_max < needed {
            return false;
        }
        limit.rlim_cur = limit.rlim_cur.max(needed);
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0
    }
}

/// The header timeout `half_open_connections_leave_healthz_answering`
/// configures: the time a half-open connection is kept.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long `/healthz` may take there: under half the header timeout, so a
/// `/healthz` that waits for half-open connections to time out fails it,
/// and seconds above what a loaded machine takes to answer (under 1 s with
/// every core busy beside the tests).
const HEALTHZ_LIMIT: Duration = Duration::from_secs(4);

/// Connections this network namespace's listeners dropped because their
/// accept queue was full (`TcpExt: ListenOverflows ListenDrops`), or `None`
/// where the kernel does not say.
fn listen_drops() -> Option<u64> {
    let netstat = std::fs::read_to_string("/proc/net/netstat").ok()?;
    let mut lines = netstat.lines().filter(|line| line.starts_with("TcpExt:"));
    let (names, values) = (lines.next()?, lines.next()?);
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .filter(|(name, _)| matches!(*name, "ListenOverflows" | "ListenDrops"))
        .map(|(_, value)| value.parse::<u64>().ok())
        .sum()
}

#[test]
fn half_open_connections_leave_healthz_answering() {
    const HALF_OPEN: usize = 3000;
    if !allow_files(HALF_OPEN as u64 + 256) {
        eprintln!("skipped: this process may not open {HALF_OPEN} descriptors");
        return;
    }
    let config = ConfigFile::new(&format!(
        "listen = \"127.0.0.1:0\"\nheader_timeout_ms = {}\n",
        HEADER_TIMEOUT.as_millis()
    ));
    // 1,024 descriptors: fewer than the half-open connections.
    let (_daemon, addr) = serve_with_files(&config, 1024);
    let drops_before = listen_drops();
    let mut held = Vec::with_capacity(HALF_OPEN);
    for _ in 0..HALF_OPEN {
        let mut stream = TcpStream::connect(&addr).expect("connect");
        // Headers begun, never finished.
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: hv\r\n")
            .expect("partial request");
        held.push(stream);
    }
    // With too few descriptors for all of them, the daemon can answer only
    // because it closes the oldest half-open connection as each new one
    // comes (its connection cap sits below the descriptor limit). The
    // failures this guards against are /healthz waiting for the header
    // timeout to free descriptors (caught by the time it takes, 10 s against
    // a 4 s limit), and its handshake dropped by a full accept queue and
    // tried again a second later (caught by the kernel's count of dropped
    // connections: the daemon's queue holds the whole flood).
    for _ in 0..3 {
        let took = healthz(&addr);
        println!("/healthz with {HALF_OPEN} half-open connections: {took:?}");
        assert!(took < HEALTHZ_LIMIT, "/healthz took {took:?}");
    }
    if let (Some(before), Some(after)) = (drops_before, listen_drops()) {
        assert_eq!(after, before, "an accept queue dropped connections");
    }
    // The header timeout closes what is left of them.
    let last = held.last_mut().expect("a connection");
    last.set_read_timeout(Some(HEADER_TIMEOUT + Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    let closed = matches!(last.read(&mut buf), Ok(0) | Err(_));
    assert!(closed, "a half-open connection outlived the header timeout");
    let took = healthz(&addr);
    println!("/healthz after the header timeout: {took:?}");
    assert!(took < HEALTHZ_LIMIT, "/healthz took {took:?}");
}

/// Resident memory of `pid` in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .expect("VmRSS")
        * 1024
}

#[test]
fn registrations_sprayed_with_devices_leave_memory_bounded() {
    let pod = unique("spray");
    let _regions = Regions(vec![pod.clone()]);
    let config = ConfigFile::new(&format!(
        "listen = \"127.0.0.1:0\"\n{}",
        pod_toml(&pod, &["index = 0\nmemory = \"1g\""])
    ));
    let (daemon, addr) = serve_with_files(&config, 4096);
    let pid = daemon.0.id();
    let mut client = RawClient::new(addr.parse().expect("addr"));
    let body = |n: u32| {
        serde_json::to_string(&Register {
            pod: pod.clone(),
            pid: 1_000_000 + n,
            hostname: String::new(),
            devices: (0..900)
                .map(|index| WorkerDevice {
                    index,
                    uuid: format!("GPU-{n:08x}-0000-4000-8000-{index:012x}"),
                })
                .collect(),
            fast_swap: false,
        })
        .expect("encode")
    };
    // Warm up the allocator and the connection, then measure.
    client.request("POST", "/api/v1/workers", &token_of(&pod), &body(0));
    let start = rss(pid);
    for n in 1..=1000 {
        let (status, text) = client.request("POST", "/api/v1/workers", &token_of(&pod), &body(n));
        assert!(status == 200 || status == 400, "{status}: {text}");
    }
    let end = rss(pid);
    assert!(
        end <= start + 20 * 1024 * 1024,
        "RSS grew from {} MiB to {} MiB",
        start >> 20,
        end >> 20
    );
}

#[test]
fn every_route_answers_errors_in_json() {
    let config = ConfigFile::new("listen = \"127.0.0.1:0\"\n");
    let (_daemon, addr) = serve_with_files(&config, 4096);
    let base = format!("http://{addr}");
    for (method, path, want) in [
        ("GET", "/nope", 404),
        ("GET", "/api/v1/nope", 404),
        ("GET", "/api/v1/workers", 405),
        ("PUT", "/healthz", 405),
        ("GET", "/api/v1/reload", 405),
    ] {
        let (status, body) = call(method, &format!("{base}{path}"), None, None);
        assert_eq!(status, want, "{method} {path}: {body}");
        let json: serde_json::Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {body:?}"));
        assert!(json["error"].is_string(), "{method} {path}: {body}");
    }
}

#[test]
fn check_config_says_each_cause_once_and_warns_of_risks() {
    let missing = ConfigFile::new("[[pods]]\nid = \"a\"\ntoken_file = \"no-such-token\"\n");
    let output = Command::new(bin())
        .args(["check-config", "--config"])
        .arg(&missing.path)
        .output()
        .expect("check-config");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert_eq!(
        stderr.matches("No such file or directory").count(),
        1,
        "cause repeated: {stderr}"
    );

    let risky = ConfigFile::new(&format!(
        "listen = \"0.0.0.0:7070\"\n\
         [[pods]]\nid = \"a\"\ntoken = \"same\"\n\
         [[pods.gpus]]\nindex = 0\nshare = 60\n\
         [[pods.gpus]]\nuuid = \"{}\"\n\
         [[pods]]\nid = \"b\"\ntoken = \"same\"\n\
         [[pods.gpus]]\nindex = 0\nshare = 60\n",
        gpu(0)
    ));
    let output = Command::new(bin())
        .args(["check-config", "--config"])
        .arg(&risky.path)
        .output()
        .expect("check-config");
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    for want in [
        "not a loopback address",
        "pods a and b share one token",
        "both by index and by UUID",
        "guaranteed shares add up to 120%",
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("warning: ") && l.contains(want)),
            "no warning {want:?}: {stdout}"
        );
    }
}

#[test]
fn registrations_with_oversized_strings_are_refused() {
    // A registration's strings are kept for the life of the worker: a body
    // of up to 64 KiB a worker, times the workers of a pod, would otherwise
    // be what a pod can make the daemon hold.
    let pod = unique("long");
    let _regions = Regions(vec![pod.clone()]);
    let config = ConfigFile::new(&format!(
        "listen = \"127.0.0.1:0\"\n{}",
        pod_toml(&pod, &["index = 0\nmemory = \"1g\""])
    ));
    let (_daemon, addr) = serve_with_files(&config, 4096);
    let mut client = RawClient::new(addr.parse().expect("addr"));
    let register = |client: &mut RawClient, hostname: String, uuid: String| {
        let body = serde_json::to_string(&Register {
            pod: pod.clone(),
            pid: std::process::id(),
            hostname,
            devices: vec![WorkerDevice { index: 0, uuid }],
            fast_swap: false,
        })
        .expect("encode");
        client.request("POST", "/api/v1/workers", &token_of(&pod), &body)
    };
    let (status, body) = register(&mut client, "h".repeat(60_000), gpu(0));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("hostname longer than 253 bytes"), "{body}");
    let (status, body) = register(&mut client, "node-1".to_owned(), "GPU-".repeat(15_000));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("device UUID longer than 96 bytes"), "{body}");
    let (status, body) = register(&mut client, "h".repeat(253), gpu(0));
    assert_eq!(status, 200, "{body}");
}
