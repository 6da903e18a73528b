//! Test harness: a hypervisor on an ephemeral loopback port with simulated
//! GPUs and a config file of its own, fake workers (the limiter's side of the
//! protocol), a raw HTTP client, and cleanup of the test's regions and
//! folders.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpu_fakes::FakeGpus;
use gpushare_utils::bucket::{Bucket, BucketLimits};
use gpushare_utils::ledger::PodLedger;
use gpushare_utils::limits::PodLimits;
use gpushare_utils::protocol::{Command, CommandResult, Register, Registered, WorkerDevice};
use gpushare_utils::shm::{self, Trust};
use http_bidir_comm::{Client, ClientOptions, LoopHandle, Task};
use hypervisor_config as config;
use hypervisor_core::node_tables::NodeTableNames;
use hypervisor_daemon::Options;
use system_tests::RunningNode;
use system_tests::scratch::Scratch;

pub(crate) mod daemon;

pub(crate) const ADMIN: &str = "admin-secret";

/// A name no other test (or earlier run) uses: `hvt-<tag>-<pid>-<n>`.
pub(crate) fn unique(tag: &str) -> String {
    system_tests::unique::name(&format!("hvt-{tag}"))
}

pub(crate) fn token_of(pod: &str) -> String {
    format!("tok-{pod}")
}

/// The UUID of simulated GPU `i`.
pub(crate) fn gpu(i: u32) -> String {
    FakeGpus::uuid(i)
}

/// Removes the regions of `pods` when dropped (after the hypervisor stopped).
pub(crate) struct Regions(pub Vec<String>);

impl Drop for Regions {
    fn drop(&mut self) {
        for name in self.0.iter().flat_map(|pod| Scratch::region_names(pod)) {
            let _ = shm::unlink(&name);
        }
    }
}

/// A config file in a folder of its own, removed when dropped.
pub(crate) struct ConfigFile {
    pub dir: PathBuf,
    pub path: PathBuf,
}

impl ConfigFile {
    pub(crate) fn new(text: &str) -> Self {
        let dir = std::env::temp_dir().join(unique("cfg"));
        std::fs::create_dir_all(&dir).expect("config dir");
        let path = dir.join("hypervisor.toml");
        std::fs::write(&path, text).expect("write config");
        Self { dir, path }
    }

    /// Rewrites the file and moves its mtime forward, so the poll sees it
    /// even within the file system's timestamp granularity.
    pub(crate) fn rewrite(&self, text: &str) {
        std::fs::write(&self.path, text).expect("rewrite config");
        let file = std::fs::File::options()
            .write(true)
            .open(&self.path)
            .expect("open config");
        file.set_modified(std::time::SystemTime::now() + Duration::from_secs(2))
            .expect("mtime");
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let tables = node_tables(&self.path);
        let _ = shm::unlink(&tables.activity);
        let _ = shm::unlink(&tables.priority);
    }
}

/// Has the hypervisor binary `command` runs make the node tables of
/// [`node_tables`]`(path)`.
pub(crate) fn use_node_tables(command: &mut std::process::Command, path: &Path) {
    let tables = node_tables(path);
    command
        .env("GPUSHARE_NODE_REGION", tables.activity)
        .env("GPUSHARE_PRIORITY_REGION", tables.priority);
}

/// Node tables of their own for the hypervisor configured by `path` (a
/// [`ConfigFile`]'s, whose folder is unique; removed with it).
pub(crate) fn node_tables(path: &Path) -> NodeTableNames {
    kube_fakes::node::node_tables(path.parent().unwrap_or(path))
}

/// A running hypervisor with its config file; regions removed at the end.
pub(crate) struct Harness {
    pub hv: RunningNode,
    pub sim: Arc<FakeGpus>,
    pub config: ConfigFile,
    // Dropped last: after the hypervisor gave its slots back.
    pub regions: Regions,
}

impl Harness {
    /// The status of pod `pod`'s first GPU.
    pub(crate) fn first_gpu_status(&self, pod: &str) -> hypervisor_core::scheduler::GpuStatus {
        let status = self.hv.hypervisor().status();
        let pod = status.pods.into_iter().find(|p| p.id == pod);
        pod.and_then(|p| p.gpus.into_iter().next())
            .expect("the pod's GPU")
    }

    /// Starts with `text` (a config without `listen`; 127.0.0.1:0 is used)
    /// and `gpus` simulated GPUs; `pods` are removed from /dev/shm at the end.
    pub(crate) fn start(text: &str, gpus: u32, pods: &[&str]) -> Self {
        let config = ConfigFile::new(text);
        Self::start_with(config, gpus, pods)
    }

    pub(crate) fn start_with(config: ConfigFile, gpus: u32, pods: &[&str]) -> Self {
        let regions = Regions(pods.iter().map(|p| (*p).to_owned()).collect());
        let sim = Arc::new(FakeGpus::new(gpus));
        let hv = start_hypervisor(&config.path, Arc::clone(&sim));
        Self {
            hv,
            sim,
            config,
            regions,
        }
    }

    pub(crate) fn url(&self) -> String {
        self.hv.url()
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.hv.addr()
    }
}

pub(crate) fn start_hypervisor(path: &Path, sim: Arc<FakeGpus>) -> RunningNode {
    let config = config::load(path).expect("valid config");
    RunningNode::daemon(Options {
        config,
        config_path: Some(path.to_owned()),
        listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        observer: sim,
        handle_sighup: false,
        node_tables: node_tables(path),
    })
    .expect("hypervisor starts")
}

/// A pod's config section: `[[pods]]` with one GPU table per `gpus` entry
/// (each a few `key = value` lines).
pub(crate) fn pod_toml(pod: &str, gpus: &[&str]) -> String {
    let mut text = format!("[[pods]]\nid = \"{pod}\"\ntoken = \"{}\"\n", token_of(pod));
    for g in gpus {
        text.push_str("[[pods.gpus]]\n");
        text.push_str(g);
        text.push('\n');
    }
    text
}

/// Two pods on GPU 0 with the admin token: `a` with 1 GiB and a 40% cap,
/// `b` with 2 GiB and 60%; `extra` goes between the token and the pods.
pub(crate) fn two_pods(a: &str, b: &str, extra: &str) -> String {
    format!(
        "admin_token = \"{ADMIN}\"\n{extra}\n{}{}",
        pod_toml(a, &["index = 0\nmemory = \"1g\"\ncap = 40"]),
        pod_toml(b, &["index = 0\nmemory = \"2g\"\ncap = 60"]),
    )
}

pub(crate) fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .new_agent()
}

/// `(status, body)` of a request with an optional bearer token and JSON body.
pub(crate) fn call(
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    let agent = agent();
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut response = match (method, body) {
        ("GET", _) => {
            let mut req = agent.get(url);
            if let Some(a) = &auth {
                req = req.header("Authorization", a);
            }
            req.call()
        }
        (m, body) => {
            let mut req = match m {
                "POST" => agent.post(url),
                "PUT" => agent.put(url),
                other => panic!("method {other}"),
            };
            if let Some(a) = &auth {
                req = req.header("Authorization", a);
            }
            req.header("Content-Type", "application/json")
                .send(body.unwrap_or("").as_bytes())
        }
    }
    .expect("request");
    let status = response.status().as_u16();
    let text = response.body_mut().read_to_string().unwrap_or_default();
    (status, text)
}

pub(crate) fn register(base: &str, pod: &str, token: &str, pid: u32) -> (u16, String) {
    let body = serde_json::to_string(&Register {
        pod: pod.to_owned(),
        pid,
        hostname: "test".into(),
        devices: Vec::new(),
        fast_swap: false,
    })
    .expect("encode");
    call(
        "POST",
        &format!("{base}/api/v1/workers"),
        Some(token),
        Some(&body),
    )
}

pub(crate) fn register_ok(base: &str, pod: &str) -> Registered {
    let (status, body) = register(base, pod, &token_of(pod), std::process::id());
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("Registered")
}

pub(crate) fn register_with_devices(
    base: &str,
    pod: &str,
    devices: Vec<WorkerDevice>,
) -> Registered {
    let body = serde_json::to_string(&Register {
        pod: pod.to_owned(),
        pid: std::process::id(),
        hostname: String::new(),
        devices,
        fast_swap: false,
    })
    .expect("encode");
    let (status, text) = call(
        "POST",
        &format!("{base}/api/v1/workers"),
        Some(&token_of(pod)),
        Some(&body),
    );
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).expect("Registered")
}

/// A worker's command loop, as the limiter runs it; the commands it got
/// arrive on `commands`.
pub(crate) struct FakeWorker {
    pub id: String,
    pub commands: mpsc::Receiver<Command>,
    handle: Option<LoopHandle>,
}

impl FakeWorker {
    pub(crate) fn start(base: &str, pod: &str, worker_id: &str) -> Self {
        let options = ClientOptions {
            token: Some(token_of(pod)),
            long_poll_wait: Duration::from_millis(500),
            backoff_min: Duration::from_millis(20),
            backoff_max: Duration::from_millis(200),
            ..ClientOptions::default()
        };
        let client = Client::new(&format!("{base}/api/v1/channel"), worker_id, options)
            .expect("channel client");
        let (tx, commands) = mpsc::channel();
        let tx = Mutex::new(tx);
        let handle = client
            .spawn_loop(move |task: Task<Command>| {
                let _ = tx.lock().expect("sender").send(task.task);
                CommandResult {
                    ok: true,
                    message: "done".into(),
                    swap: None,
                    shared: false,
                    fast_swap: false,
                    managed_bytes: 0,
                }
            })
            .expect("loop");
        Self {
            id: worker_id.to_owned(),
            commands,
            handle: Some(handle),
        }
    }

    /// The next command other than `Health`, within `limit`.
    pub(crate) fn next_command(&self, limit: Duration) -> Option<Command> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.commands.recv_timeout(left) {
                Ok(Command::Health) => continue,
                Ok(command) => return Some(command),
                Err(_) => return None,
            }
        }
    }
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            let _ = handle.stop();
        }
    }
}

#[allow(
    unused_imports,
    reason = "the admission bench includes this module and polls nothing"
)]
pub(crate) use system_tests::wait::wait_for;

/// The test process's own view of a pod's ledger and limits, by simulated
/// GPU index (`FakeGpus::uuid`).
pub(crate) struct RegionView(pub PodLedger, pub PodLimits);

impl RegionView {
    pub(crate) fn open(pod: &str) -> Self {
        let limits =
            PodLimits::open_read_only(pod, &Trust::own_or_root(None)).expect("open limits");
        Self(PodLedger::open(pod).expect("open region"), limits)
    }

    /// The ledger entry of simulated GPU `dev`.
    pub(crate) fn entry(&self, dev: usize) -> usize {
        self.0
            .device_for(&FakeGpus::uuid(dev as u32))
            .expect("ledger entry")
    }

    pub(crate) fn bucket(&self, dev: usize) -> Bucket<'_> {
        let state = self.0.compute_state(self.entry(dev)).expect("bucket");
        Bucket::new(state, self.limits(dev))
    }

    /// The limits of GPU `dev`; all zero (unlimited) when the pod has none there.
    pub(crate) fn limits(&self, dev: usize) -> &BucketLimits {
        static NONE: BucketLimits = BucketLimits {
            rate_ppm: std::sync::atomic::AtomicU32::new(0),
            ceiling_ppm: std::sync::atomic::AtomicU32::new(0),
            suspended: std::sync::atomic::AtomicU32::new(0),
            managed: std::sync::atomic::AtomicU32::new(0),
        };
        self.1
            .find(&FakeGpus::uuid(dev as u32))
            .map_or(&NONE, |gpu| &gpu.compute)
    }

    pub(crate) fn rate(&self, dev: usize) -> u32 {
        self.limits(dev).rate_ppm.load(Ordering::Acquire)
    }

    pub(crate) fn quota(&self, dev: usize) -> u64 {
        self.1
            .find(&FakeGpus::uuid(dev as u32))
            .map_or(0, |gpu| gpu.quota.load(Ordering::Acquire))
    }

    /// Pod usage of GPU `dev`.
    pub(crate) fn used(&self, dev: usize) -> u64 {
        self.0.usage(self.entry(dev)).expect("usage").used
    }

    /// Makes the pod look busy (a launch waiting) or idle on `dev`.
    pub(crate) fn set_waiting(&self, dev: usize, waiting: bool) {
        self.bucket(dev)
            .waiting
            .store(u32::from(waiting), Ordering::Release);
    }
}

/// A minimal HTTP/1.1 client on one keep-alive connection: what the latency
/// test measures is the server, not a client library.
pub(crate) struct RawClient {
    stream: BufReader<TcpStream>,
    message: Vec<u8>,
}

impl RawClient {
    pub(crate) fn new(addr: SocketAddr) -> Self {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_nodelay(true).expect("nodelay");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        Self {
            stream: BufReader::new(s),
            message: Vec::with_capacity(1024),
        }
    }

    /// `(status, body)`.
    pub(crate) fn request(
        &mut self,
        method: &str,
        path: &str,
        token: &str,
        body: &str,
    ) -> (u16, String) {
        self.message.clear();
        write!(
            self.message,
            "{method} {path} HTTP/1.1\r\nHost: hv\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("format");
        self.stream
            .get_mut()
            .write_all(&self.message)
            .expect("write");
        read_response(&mut self.stream).expect("response")
    }
}

/// Reads one response (Content-Length bodies only).
pub(crate) fn read_response(reader: &mut BufReader<TcpStream>) -> std::io::Result<(u16, String)> {
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {status_line:?}")))?;
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// One `GET /healthz` on a fresh connection to `addr`, which must answer
/// 200 `ok`; how long it took.
pub(crate) fn healthz(addr: &str) -> Duration {
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: hv\r\nConnection: close\r\n\r\n")
        .expect("request");
    let mut reader = BufReader::new(stream);
    let (status, body) = read_response(&mut reader).expect("healthz answers");
    assert_eq!((status, body.as_str()), (200, "ok"));
    started.elapsed()
}

/// 100 registered workers of 4 pods (weights 1 to 4, fixed, 1 GiB each) on
/// one simulated GPU, whose admission requests are traps as the limiter
/// makes them: the pod's bucket emptied just before each.
pub(crate) struct Traps {
    pub h: Harness,
    /// Each worker's id and its pod's place in `pods`.
    workers: Vec<(String, usize)>,
    regions: Vec<RegionView>,
    tokens: Vec<String>,
    bodies: Vec<String>,
}

impl Traps {
    pub(crate) const PODS: usize = 4;
    pub(crate) const WORKERS: usize = 100;

    pub(crate) fn start() -> Self {
        let pods: Vec<String> = (0..Self::PODS)
            .map(|i| unique(&format!("lat{i}")))
            .collect();
        let config: String = pods
            .iter()
            .enumerate()
            .map(|(i, p)| {
                pod_toml(
                    p,
                    &[&format!(
                        "index = 0\nweight = {}\npolicy = \"fixed\"\nmemory = \"1g\"",
                        i + 1
                    )],
                )
            })
            .collect();
        let names: Vec<&str> = pods.iter().map(String::as_str).collect();
        let h = Harness::start(&config, 1, &names);
        let workers: Vec<(String, usize)> = (0..Self::WORKERS)
            .map(|i| {
                let pod = i % Self::PODS;
                (register_ok(&h.url(), &pods[pod]).worker_id, pod)
            })
            .collect();
        let uuid = gpu(0);
        let bodies = workers
            .iter()
            .map(|(w, _)| {
                format!("{{\"worker_id\":\"{w}\",\"uuid\":\"{uuid}\",\"cost_ns\":20000}}")
            })
            .collect();
        Self {
            regions: pods.iter().map(|p| RegionView::open(p)).collect(),
            tokens: pods.iter().map(|p| token_of(p)).collect(),
            h,
            workers,
            bodies,
        }
    }

    /// Request `n`: worker `n % 100` traps; its status and reply.
    pub(crate) fn trap(&self, client: &mut RawClient, n: usize) -> (u16, String) {
        let k = n % Self::WORKERS;
        let pod = self.workers[k].1;
        let bucket = self.regions[pod].bucket(0);
        // The trap: the launch found the bucket empty.
        bucket.tokens_ns.store(0, Ordering::Release);
        bucket
            .refilled_at_ns
            .store(gpushare_utils::bucket::monotonic_ns(), Ordering::Release);
        client.request(
            "POST",
            "/api/v1/admission",
            &self.tokens[pod],
            &self.bodies[k],
        )
    }
}

/// One pod with `clients` workers, each asking for admission `requests`
/// times on its own connection, the bucket emptied before each ask. Returns
/// the harness (to read the daemon's figures) and every answer with how
/// long it took, the asks of each client in order.
pub(crate) fn concurrent_traps(
    clients: usize,
    requests: usize,
    before: impl FnOnce(&Harness),
) -> (Harness, Vec<(u16, String, Duration)>) {
    let pod = unique("conc");
    let h = Harness::start(
        &pod_toml(&pod, &["index = 0\npolicy = \"fixed\"\nweight = 1"]),
        1,
        &[&pod],
    );
    let token = token_of(&pod);
    let region = RegionView::open(&pod);
    let workers: Vec<String> = (0..clients)
        .map(|_| register_ok(&h.url(), &pod).worker_id)
        .collect();
    before(&h);
    let answers = std::thread::scope(|s| {
        let handles: Vec<_> = workers
            .iter()
            .map(|w| {
                let (token, region, addr) = (&token, &region, h.addr());
                s.spawn(move || {
                    let mut client = RawClient::new(addr);
                    let body = format!(
                        "{{\"worker_id\":\"{w}\",\"uuid\":\"{}\",\"cost_ns\":1000}}",
                        gpu(0)
                    );
                    (0..requests)
                        .map(|_| {
                            region.bucket(0).tokens_ns.store(0, Ordering::Release);
                            let start = Instant::now();
                            let (status, reply) =
                                client.request("POST", "/api/v1/admission", token, &body);
                            (status, reply, start.elapsed())
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("client"))
            .collect()
    });
    (h, answers)
}
