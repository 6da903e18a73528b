//! Where the daemon answers, as the DaemonSet runs it: the whole API on the
//! pods' Unix socket (`--socket`, what their CDI specs mount), and nothing
//! but `/metrics`, `/healthz` and `/readyz` on the metrics listener
//! (`--metrics-listen`, the one address that may face the cluster).

mod common;

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
