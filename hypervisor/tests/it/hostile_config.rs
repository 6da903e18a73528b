//! A hostile config and hostile requests, as the binary meets them: token
//! files that are a FIFO or `/dev/zero` (refused at once by `check-config`,
//! at start and at reload, with the API answering throughout), values of
//! 131,000 characters (cut in the error line), and requests hyper cannot
//! parse (answered in JSON like every other error).

use crate::common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::daemon::{Killed, bin, listening, serve};
use common::*;

/// How long refusing a file may take: it is refused without waiting, in
/// well under a millisecond; a FIFO read as before waits forever.
const AT_ONCE: Duration = Duration::from_secs(5);

/// Waits at most `limit` for `child` to exit.
fn exit_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs the binary with `args` (and node tables of `config`'s); its exit
/// status and what it wrote on stderr, within [`AT_ONCE`].
fn run(config: &ConfigFile, args: &[&str]) -> (ExitStatus, String) {
    let mut command = Command::new(bin());
    command
        .args(args)
        .arg("--config")
        .arg(&config.path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    use_node_tables(&mut command, &config.path);
    let mut child = Killed(command.spawn().expect("spawn hypervisor"));
    // Read meanwhile: a long line would fill the pipe and hold the child.
    let mut pipe = child.0.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut stderr = String::new();
        let _ = pipe.read_to_string(&mut stderr);
        stderr
    });
    let status = exit_within(&mut child.0, AT_ONCE)
        .unwrap_or_else(|| panic!("`hypervisor {}` still running after {AT_ONCE:?}", args[0]));
    let stderr = reader.join().expect("stderr reader");
    (status, stderr)
}

/// Makes a FIFO at `path`.
fn mkfifo(path: &Path) {
    let name = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: a valid path string.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// The two token files of these tests: a FIFO no one writes (in the
/// config's folder, removed with it) and `/dev/zero`, each with the reason
/// it is refused.
fn hostile_token_files(config: &ConfigFile) -> [(PathBuf, &'static str); 2] {
    let fifo = config.dir.join("token.fifo");
    mkfifo(&fifo);
    [
        (fifo, "a FIFO, not a regular file"),
        (
            PathBuf::from("/dev/zero"),
            "a character device, not a regular file",
        ),
    ]
}

fn pod_with_token_file(pod: &str, file: &Path) -> String {
    format!(
        "[[pods]]\nid = \"{pod}\"\ntoken_file = \"{}\"\n[[pods.gpus]]\nindex = 0\nmemory = \"1g\"\n",
        file.display()
    )
}

#[test]
fn check_config_and_serve_refuse_a_fifo_or_dev_zero_token_file_at_once() {
    let pod = unique("tokfile");
    let config = ConfigFile::new("");
    let _regions = Regions(vec![pod.clone()]);
    for (file, why) in hostile_token_files(&config) {
        config.rewrite(&format!(
            "listen = \"127.0.0.1:0\"\n{}",
            pod_with_token_file(&pod, &file)
        ));
        let want = format!(
            "hypervisor: pod \"{pod}\": cannot read token file {}: {why}",
            file.display()
        );
        for args in [&["check-config"][..], &["serve", "--simulate-gpus", "1"]] {
            let (status, stderr) = run(&config, args);
            assert!(!status.success(), "{args:?}: {stderr}");
            assert_eq!(stderr.trim_end(), want, "{args:?}");
        }
    }
}

#[test]
fn a_value_of_131000_characters_is_cut_in_the_error_line() {
    let long = "x".repeat(131_000);
    for text in [
        format!("listen = \"{long}\"\n"),
        format!("[[pods]]\nid = \"{long}\"\ntoken = \"t\"\n"),
        format!("{long} = 1\n"),
    ] {
        let config = ConfigFile::new(&text);
        let (status, stderr) = run(&config, &["check-config"]);
        assert!(!status.success());
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains("… (130800 more characters)"), "{stderr}");
        assert!(!stderr.contains(&"x".repeat(201)), "{stderr}");
    }
}

/// `GET /healthz` on a fresh connection answers 200 within a second.
fn healthz_answers(addr: &str) {
    let took = healthz(addr);
    assert!(took < Duration::from_secs(1), "/healthz after {took:?}");
}

#[test]
fn a_reload_onto_a_fifo_or_dev_zero_token_file_is_refused_and_the_daemon_keeps_serving() {
    let (a, b) = (unique("keep"), unique("hostile"));
    let good = format!(
        "listen = \"127.0.0.1:0\"\nadmin_token = \"{ADMIN}\"\n{}",
        pod_toml(&a, &["index = 0\nmemory = \"1g\"\ncap = 40"])
    );
    let config = ConfigFile::new(&good);
    let _regions = Regions(vec![a.clone(), b.clone()]);
    let mut serve = serve(&config);
    serve.stderr(Stdio::null());
    let (mut daemon, addr) = listening(serve);
    let region = RegionView::open(&a);
    assert_eq!(region.quota(0), 1 << 30);
    // Serving, and (a moment later) listening for SIGHUP, whose default
    // action would end it.
    healthz_answers(&addr);
    std::thread::sleep(Duration::from_millis(500));

    for (file, why) in hostile_token_files(&config) {
        // The new file would raise a's quota, if it were taken; its change
        // also has the daemon's poll reload it, besides the signal.
        config.rewrite(&format!(
            "{}{}",
            good.replace("\"1g\"", "\"2g\""),
            pod_with_token_file(&b, &file)
        ));
        // SAFETY: signalling our own child.
        unsafe { libc::kill(daemon.0.id() as i32, libc::SIGHUP) };
        let watched = Instant::now();
        while watched.elapsed() < Duration::from_millis(1500) {
            healthz_answers(&addr);
            std::thread::sleep(Duration::from_millis(100));
        }
        let started = Instant::now();
        let (status, body) = call(
            "POST",
            &format!("http://{addr}/api/v1/reload"),
            Some(ADMIN),
            None,
        );
        assert!(started.elapsed() < AT_ONCE);
        assert_eq!(status, 400, "{body}");
        let error: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        let error = error["error"].as_str().expect("an error");
        assert!(
            error.contains(&format!("cannot read token file {}: {why}", file.display())),
            "{error}"
        );
        assert_eq!(region.quota(0), 1 << 30, "the old config stays");
        let (_, status) = call("GET", &format!("http://{addr}/api/v1/status"), None, None);
        assert!(status.contains(&a) && !status.contains(&b), "{status}");
    }

    // SAFETY: signalling our own child.
    unsafe { libc::kill(daemon.0.id() as i32, libc::SIGTERM) };
    let exit = exit_within(&mut daemon.0, AT_ONCE).expect("SIGTERM stops the daemon");
    assert!(exit.success(), "{exit:?}");
}

/// What the daemon answers `request` on a connection of its own, read to
/// the end (the daemon closes it): status, content type and body.
fn answer(addr: SocketAddr, request: &[u8]) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    // The daemon may answer and close before it has read all of it.
    let _ = stream.write_all(request);
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 4096];
    while let Ok(n @ 1..) = stream.read(&mut chunk) {
        bytes.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer: {text:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("status line of {head:?}"));
    let content_type = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-type")
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default();
    (status, content_type, body.to_owned())
}

#[test]
fn requests_hyper_cannot_parse_are_answered_in_json() {
    let h = Harness::start("", 1, &[]);
    let header = |bytes: usize| {
        format!(
            "GET /healthz HTTP/1.1\r\nHost: hv\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
            "x".repeat(bytes)
        )
    };
    let many_fields: String = (0..200).map(|n| format!("X-{n}: a\r\n")).collect();
    let cases = [
        ("a 70 KiB header", header(70 * 1024), 431),
        (
            "a 70 KiB target",
            format!(
                "GET /{} HTTP/1.1\r\nHost: hv\r\n\r\n",
                "a".repeat(70 * 1024)
            ),
            431,
        ),
        (
            "200 header fields",
            format!("GET /healthz HTTP/1.1\r\nHost: hv\r\n{many_fields}\r\n"),
            431,
        ),
        ("a garbage request line", "GARBAGE\r\n\r\n".to_owned(), 400),
        (
            "a garbage header",
            "GET /healthz HTTP/1.1\r\nHost: hv\r\nBad Header: x\r\n\r\n".to_owned(),
            400,
        ),
    ];
    for (what, request, want) in cases {
        let (status, content_type, body) = answer(h.addr(), request.as_bytes());
        assert_eq!(status, want, "{what}: {body}");
        assert_eq!(content_type, "application/json", "{what}");
        let json: serde_json::Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{what}: {e}: {body:?}"));
        assert!(json["error"].is_string(), "{what}: {body}");
    }
    // Below the bound, the same header is served.
    let (status, _, body) = answer(h.addr(), header(60 * 1024).as_bytes());
    assert_eq!((status, body.as_str()), (200, "ok"));
}
