//! Where the daemon answers, as the DaemonSet runs it: the whole API on the
//! pods' Unix socket (`--socket`, what their CDI specs mount), and nothing
//! but `/metrics`, `/healthz` and `/readyz` on the metrics listener
//! (`--metrics-listen`, the one address that may face the cluster).

use crate::common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::process::{Child, Command, Stdio};

use common::*;
use gpushare_utils::protocol::{Register, Registered};
use http_bidir_comm::{ClientOptions, Requester, unix_socket_url};

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_api_is_on_the_socket_and_only_metrics_and_probes_are_on_the_metrics_address() {
    let pod = unique("sock");
    let _regions = Regions(vec![pod.clone()]);
    let config = ConfigFile::new(&pod_toml(&pod, &["index = 0\nmemory = \"1g\""]));
    let socket = config.dir.join("run/hypervisor.sock");
    let mut command = Command::new(env!("CARGO_BIN_EXE_hypervisor"));
    command
        .args(["serve", "--simulate-gpus", "1", "--listen", "127.0.0.1:0"])
        .arg("--config")
        .arg(&config.path)
        .arg("--socket")
        .arg(&socket)
        .args(["--metrics-listen", "127.0.0.1:0"])
        .stdout(Stdio::piped());
    use_node_tables(&mut command, &config.path);
    let mut daemon = Daemon(command.spawn().expect("spawn hypervisor"));
    let mut lines = BufReader::new(daemon.0.stdout.take().unwrap()).lines();
    let mut next = || lines.next().expect("a line").expect("stdout");
    let tcp = next();
    assert!(
        tcp.starts_with("hypervisor listening on 127.0.0.1:"),
        "{tcp}"
    );
    assert_eq!(
        next(),
        format!("hypervisor listening on {}", socket.display())
    );
    let metrics = next()
        .strip_prefix("hypervisor metrics on ")
        .expect("the metrics address")
        .to_owned();

    // Anyone on the node may connect (the token and, in Kubernetes, the
    // cgroup decide what they may do).
    let meta = std::fs::symlink_metadata(&socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o666);

    // A worker registers over the socket, as the limiter does with
    // CUDA_LIMITER_HYPERVISOR=http+unix://...
    let options = ClientOptions {
        token: Some(token_of(&pod)),
        ..ClientOptions::default()
    };
    let requests = Requester::new(&unix_socket_url(&socket), options).unwrap();
    let registered: Registered = requests
        .post_json(
            "/api/v1/workers",
            &Register {
                pod: pod.clone(),
                pid: std::process::id(),
                hostname: "test".into(),
                devices: Vec::new(),
                fast_swap: false,
            },
            None,
        )
        .expect("registered over the socket");
    assert_eq!(registered.pod, pod);
    let wrong = Requester::new(
        &unix_socket_url(&socket),
        ClientOptions {
            token: Some("wrong".into()),
            ..ClientOptions::default()
        },
    )
    .unwrap()
    .post_json::<_, Registered>(
        "/api/v1/workers",
        &Register {
            pod: pod.clone(),
            pid: std::process::id(),
            hostname: "test".into(),
            devices: Vec::new(),
            fast_swap: false,
        },
        None,
    )
    .unwrap_err();
    assert_eq!(wrong.status(), Some(401), "{wrong}");

    // The metrics address: probes and metrics, nothing else.
    let base = format!("http://{metrics}");
    for (path, want) in [("/healthz", 200), ("/readyz", 200), ("/metrics", 200)] {
        let (status, body) = call("GET", &format!("{base}{path}"), None, None);
        assert_eq!(status, want, "{path}: {body}");
    }
    let (_, metrics_text) = call("GET", &format!("{base}/metrics"), None, None);
    assert!(metrics_text.contains(&pod), "{metrics_text}");
    for path in ["/api/v1/status", "/api/v1/reload", "/api/v1/workers"] {
        let (status, body) = call("GET", &format!("{base}{path}"), None, None);
        assert_eq!(status, 404, "{path} on the metrics address: {body}");
    }
    let (status, _) = register(&base, &pod, &token_of(&pod), std::process::id());
    assert_eq!(status, 404, "no registration on the metrics address");
}

#[test]
fn readyz_names_what_the_daemon_still_waits_for() {
    let harness = Harness::start("", 1, &[]);
    let hv = harness.hv.hypervisor();
    let url = format!("{}/readyz", harness.url());
    assert_eq!(call("GET", &url, None, None).0, 200);
    hv.not_ready("the Kubernetes agent is starting");
    let (status, body) = call("GET", &url, None, None);
    assert_eq!(status, 503);
    assert!(body.contains("the Kubernetes agent is starting"), "{body}");
    // Alive all the while.
    assert_eq!(
        call("GET", &format!("{}/healthz", harness.url()), None, None).0,
        200
    );
    hv.ready("the Kubernetes agent is starting");
    assert_eq!(call("GET", &url, None, None).0, 200);
}

/// `(status, body)` of `GET path` over the Unix socket at `socket`, with an
/// optional bearer token (HTTP/1.1, the connection closed after it).
fn get_on_socket(socket: &std::path::Path, path: &str, token: Option<&str>) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).expect("connect");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: hypervisor\r\n{auth}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_owned())
}

#[test]
fn on_the_pods_socket_a_pod_sees_its_own_status_and_only_the_admin_sees_all() {
    let (a, b) = (unique("own-a"), unique("own-b"));
    let _regions = Regions(vec![a.clone(), b.clone()]);
    let config = ConfigFile::new(&two_pods(&a, &b, ""));
    let socket = config.dir.join("run/hypervisor.sock");
    let mut command = Command::new(env!("CARGO_BIN_EXE_hypervisor"));
    command
        .args(["serve", "--simulate-gpus", "1", "--listen", "127.0.0.1:0"])
        .arg("--config")
        .arg(&config.path)
        .arg("--socket")
        .arg(&socket)
        .stdout(Stdio::piped());
    use_node_tables(&mut command, &config.path);
    let mut daemon = Daemon(command.spawn().expect("spawn hypervisor"));
    let mut lines = BufReader::new(daemon.0.stdout.take().unwrap()).lines();
    let tcp = lines.next().expect("a line").expect("stdout");
    let tcp = tcp
        .strip_prefix("hypervisor listening on ")
        .expect("the TCP address")
        .to_owned();
    let _ = lines.next();

    let pods = |body: &str| -> Vec<String> {
        let status: serde_json::Value = serde_json::from_str(body).expect(body);
        let mut ids: Vec<String> = status["pods"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    };
    let mut both = vec![a.clone(), b.clone()];
    both.sort();
    // No token: nothing; a wrong one: nothing.
    for token in [None, Some("wrong")] {
        let (status, body) = get_on_socket(&socket, "/api/v1/status", token);
        assert_eq!(status, 401, "{body}");
        let (status, _) = get_on_socket(&socket, "/metrics", token);
        assert_eq!(status, 401);
    }
    // A pod's token: that pod alone.
    let (status, body) = get_on_socket(&socket, "/api/v1/status", Some(&token_of(&a)));
    assert_eq!(status, 200, "{body}");
    assert_eq!(pods(&body), vec![a.clone()]);
    assert!(!body.contains(&b), "{body}");
    let (status, _) = get_on_socket(&socket, "/metrics", Some(&token_of(&a)));
    assert_eq!(status, 401, "metrics name every pod: the admin's");
    // The admin token: everything.
    let (status, body) = get_on_socket(&socket, "/api/v1/status", Some(ADMIN));
    assert_eq!(status, 200, "{body}");
    assert_eq!(pods(&body), both);
    let (status, text) = get_on_socket(&socket, "/metrics", Some(ADMIN));
    assert_eq!(status, 200);
    assert!(text.contains(&a) && text.contains(&b));
    // The node's TCP address answers the whole status, as `hypervisor status` reads it.
    let (status, body) = call("GET", &format!("http://{tcp}/api/v1/status"), None, None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(pods(&body), both);
}
