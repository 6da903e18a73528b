//! Running the double's probe programs with the built limiter preloaded.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const GIB: u64 = 1 << 30;
/// What the double's first context charges as the driver's own memory.
pub(crate) const CONTEXT_BYTES: u64 = 300 * MIB;

/// The limiter built for this test run (cargo builds the cdylib into `deps/`).
pub(crate) fn limiter() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps directory");
    let library = deps.join("libcuda_limiter.so");
    assert!(library.exists(), "{} not built", library.display());
    library
}

/// A provisioned container's library folder, emulated: the limiter under
/// the name the CDI spec mounts it at (a link: the limiter looks beside the
/// name it was loaded by), and the pod file beside it as the read-only bind
/// mount shows it (root's file, mode 0444). Removed when dropped.
pub(crate) struct ContainerLib {
    dir: PathBuf,
}

impl ContainerLib {
    /// The folder with the pod file whose text is `pod_file`.
    pub(crate) fn with_text(pod_file: &str) -> Self {
        use std::os::unix::fs::PermissionsExt;
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "limiter-container-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let lib = Self { dir };
        std::os::unix::fs::symlink(limiter(), lib.library()).unwrap();
        let file = lib.pod_file();
        std::fs::write(&file, pod_file).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o444)).unwrap();
        lib
    }

    /// The folder with a copy of the pod file the daemon wrote at `host_path`.
    pub(crate) fn mounting(host_path: &std::path::Path) -> Self {
        Self::with_text(&std::fs::read_to_string(host_path).unwrap())
    }

    /// What `/etc/ld.so.preload` names in the container.
    pub(crate) fn library(&self) -> PathBuf {
        self.dir.join("libcuda_limiter.so")
    }

    /// The pod file beside it.
    pub(crate) fn pod_file(&self) -> PathBuf {
        gpushare_utils::pod_file::PodFile::beside(&self.library())
    }
}

impl Drop for ContainerLib {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A pod identity of its own for each test; its ledger, limits and test node
/// table are removed after, whatever the test's outcome.
pub(crate) struct Pod(pub String);

impl Pod {
    pub(crate) fn new(test: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let id = format!(
            "t{}-{}-{}",
            std::process::id(),
            test,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        Self(id)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        for prefix in [
            "gpushare-pod-",
            "gpushare-limits-",
            "gpushare-node-test-",
            "gpushare-priority-test-",
        ] {
            let _ignored = std::fs::remove_file(format!("/dev/shm/{prefix}{}", self.0));
        }
    }
}

/// The driver double's first `.0` GPUs, as NVML would show them to a
/// hypervisor.
pub(crate) struct DoubleGpus(pub u8);

impl hypervisor_observer::GpuObserver for DoubleGpus {
    fn gpus(
        &self,
    ) -> Result<Vec<hypervisor_observer::GpuInfo>, hypervisor_observer::ObserverError> {
        Ok((0..self.0)
            .map(|index| hypervisor_observer::GpuInfo {
                index: u32::from(index),
                uuid: gpushare_examples::uuid(index),
                name: "driver double".to_owned(),
                memory_total: 16 * GIB,
                memory_used: 0,
            })
            .collect())
    }
}

/// A hypervisor on loopback running `config` (its TOML) for `pod`'s test,
/// seeing GPUs through `observer`, with the test's node tables.
pub(crate) fn hypervisor(
    pod: &Pod,
    config: &str,
    observer: std::sync::Arc<dyn hypervisor_observer::GpuObserver>,
) -> system_tests::RunningNode {
    let config = hypervisor_core::config::parse(
        config,
        std::path::Path::new("test.toml"),
        std::path::Path::new("."),
    )
    .expect("config");
    system_tests::RunningNode::daemon(hypervisor_daemon::Options {
        config,
        config_path: None,
        listen: None,
        observer,
        handle_sighup: false,
        node_tables: node_tables(pod),
    })
    .expect("hypervisor starts")
}

/// The node tables a hypervisor of `pod`'s test makes (removed with the pod).
pub(crate) fn node_tables(pod: &Pod) -> hypervisor_core::node_tables::NodeTableNames {
    hypervisor_core::node_tables::NodeTableNames {
        activity: format!("gpushare-node-test-{}", pod.0),
        priority: format!("gpushare-priority-test-{}", pod.0),
    }
}

/// The uid the pods run as, in the tests whose hypervisor has it as
/// `region_uid` ([`pods_uid_hypervisor`]).
pub(crate) const PODS_UID: u32 = 65534;

/// A hypervisor for `pod`'s test that makes the pods' objects and the node
/// tables for uid [`PODS_UID`] (`region_uid`, `region_gid`; mode 0600, the
/// default `region_mode`), with the test's node tables: `pod`, of `token`,
/// has 1 GiB on GPU 0 and no compute limit.
pub(crate) fn pods_uid_hypervisor(pod: &Pod, token: &str) -> system_tests::RunningNode {
    let text = format!(
        "listen = \"127.0.0.1:0\"\nregion_uid = {PODS_UID}\nregion_gid = {PODS_UID}\n\n\
         [[pods]]\nid = \"{}\"\ntoken = \"{token}\"\n\n[[pods.gpus]]\nindex = 0\nmemory = \"1g\"\n",
        pod.0
    );
    hypervisor(pod, &text, std::sync::Arc::new(DoubleGpus(1)))
}

/// `command` run as `uid` (its group too, no supplementary groups), with
/// the same environment.
pub(crate) fn as_uid(command: &Command, uid: u32) -> Command {
    let mut wrapped = Command::new("setpriv");
    wrapped
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .arg("--")
        .arg(command.get_program())
        .args(command.get_args());
    for (key, value) in command.get_envs() {
        match value {
            Some(value) => wrapped.env(key, value),
            None => wrapped.env_remove(key),
        };
    }
    wrapped
}

/// `GET /metrics` on the hypervisor at `url`: the whole answer, its status
/// line first.
pub(crate) fn metrics(url: &str) -> String {
    use std::io::{Read, Write};
    let address = url.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address).expect("daemon listens");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .expect("timeout");
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

/// Points `command`'s limiter at the node tables of [`node_tables`].
pub(crate) fn use_node_tables(command: &mut Command, pod: &Pod) {
    let tables = node_tables(pod);
    command
        .env("GPUSHARE_NODE_REGION", tables.activity)
        .env("GPUSHARE_PRIORITY_REGION", tables.priority);
}

/// `program` (a probe of the double) under the limiter, for `pod`, with the
/// fake GPU's size and extra environment.
pub(crate) fn probe(program: &str, pod: &Pod, env: &[(&str, &str)], args: &[&str]) -> Command {
    let mut command = gpushare_examples::command(program);
    command
        .env("LD_PRELOAD", limiter())
        .env("CUDA_LIMITER_POD", &pod.0)
        .env("GPUSHARE_DOUBLE_TOTAL", "16g")
        .env_remove("CUDA_LIMITER_LOG")
        .args(args);
    for (key, value) in env {
        command.env(key, value);
    }
    command
}

/// Runs and returns stdout lines, failing the test with stderr on a non-zero exit.
pub(crate) fn run(mut command: Command) -> Vec<String> {
    let output = command.output().expect("spawn probe");
    check(&output);
    stdout_lines(&output)
}

/// A finished probe's stdout, a string a line.
pub(crate) fn stdout_lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

pub(crate) fn check(output: &Output) {
    assert!(
        output.status.success(),
        "probe failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `info RESULT free=F total=T` for the given numbers.
pub(crate) fn info(result: u32, free: u64, total: u64) -> String {
    format!("info {result} free={free} total={total}")
}

/// The `CUresult` of an `alloc`/`free`/`ptr` line (`... -> RESULT ...`).
pub(crate) fn result_of(line: &str) -> u32 {
    let after = line
        .split("-> ")
        .nth(1)
        .unwrap_or_else(|| panic!("no result in {line:?}"));
    after
        .split_whitespace()
        .next()
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("bad result in {line:?}"))
}

/// The probe programs and how each reaches the driver: linked, `dlsym`,
/// `cuGetProcAddress`.
pub(crate) const VIAS: [(&str, &[&str]); 3] = [
    ("cudaprobe_linked", &[]),
    ("cudaprobe", &["--via", "dlsym"]),
    ("cudaprobe", &["--via", "getproc"]),
];

/// Timed tests of one binary take turns: each needs the CPUs of a small CI
/// machine to itself to keep its timing.
pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `key=value` of a probe line as a number.
pub(crate) fn number(line: &str, key: &str) -> i64 {
    gpushare_examples::probe_field(line, key)
        .and_then(|value| i64::try_from(value).ok())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

/// `key=value` of the limiter's exit summary (`compute summary: …`), whose
/// figures may have decimals.
pub(crate) fn summary_number(summary: &str, key: &str) -> f64 {
    summary
        .split_whitespace()
        .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {summary}"))
}

/// How much of a `run`/`spin` line's wall time its launching thread spent
/// runnable but waiting for a CPU, in per mille.
pub(crate) fn delay_pm(line: &str) -> i64 {
    let wall = number(line, "wall_ns").max(1);
    number(line, "delay_ns") * 1000 / wall
}

/// Asserts that a `run`/`spin` line's busy share is `want` per mille within
/// `tolerance`, less the launching thread's run delay (see [`assert_share_of`]).
pub(crate) fn assert_share(line: &str, want: i64, tolerance: i64) {
    assert_share_of(
        number(line, "share_pm"),
        delay_pm(line),
        want,
        tolerance,
        line,
    );
}

/// Asserts that a busy share of `got` per mille is `want` within `tolerance`
/// above it, and within `tolerance` plus `delay` (the launching thread's run
/// delay, per mille of the run) below it. A limit caps the share however the
/// machine is loaded; it cannot run a thread the kernel does not schedule,
/// and a thread that waits for a CPU for some time idles the GPU for at most
/// that time. So on a busy CI machine the share can only fall short, by no
/// more than the delay the probe measured: a shortfall beyond it, or any
/// excess, is the limiter's.
pub(crate) fn assert_share_of(got: i64, delay: i64, want: i64, tolerance: i64, context: &str) {
    assert!(
        got <= want + tolerance && got >= want - tolerance - delay,
        "share {got}‰, want {want}‰ ± {tolerance}‰ (less the {delay}‰ the thread waited for a CPU): {context}"
    );
}

/// The `key=value` of the first line starting with `prefix` that has `key`.
pub(crate) fn line_field<'a>(lines: &'a [String], prefix: &str, key: &str) -> &'a str {
    lines
        .iter()
        .filter(|line| line.starts_with(prefix))
        .find_map(|line| {
            line.split_whitespace()
                .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
        })
        .unwrap_or_else(|| panic!("no {prefix}… {key}= in {lines:?}"))
}

/// The N of each `COMMAND ns=N` line (`clock`, `settled`), in order.
pub(crate) fn times(lines: &[String], command: &str) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|line| line.strip_prefix(command)?.strip_prefix(" ns="))
        .map(|rest| rest.split_whitespace().next().unwrap_or(rest))
        .map(|n| n.parse().expect("ns"))
        .collect()
}

/// The idle stretches of an `idle STEP at=a-b,…` line.
pub(crate) fn idle_spans(lines: &[String]) -> Vec<(u64, u64)> {
    line_field(lines, "idle ", "at")
        .split(',')
        .filter(|span| !span.is_empty())
        .map(|span| {
            let (a, b) = span.split_once('-').expect("a-b");
            (a.parse().expect("a"), b.parse().expect("b"))
        })
        .collect()
}

/// The probe as one pod of priority class `class`, on its own node and
/// priority tables, its output piped.
pub(crate) fn class_probe(
    pod: &Pod,
    node: &str,
    priority: &str,
    class: &str,
    args: &[&str],
) -> Command {
    let mut command = probe(
        "cudaprobe",
        pod,
        &[
            ("CUDA_LIMITER_CLASS", class),
            ("GPUSHARE_NODE_REGION", node),
            ("GPUSHARE_PRIORITY_REGION", priority),
        ],
        args,
    );
    command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    command
}

/// A finished child's stdout lines, failing the test on a non-zero exit.
pub(crate) fn output_lines(child: std::process::Child) -> Vec<String> {
    let output = child.wait_with_output().expect("probe");
    check(&output);
    stdout_lines(&output)
}

/// One burst of [`Bursts`]: its start, when the latency pod went idle, and
/// the stretch of the batch pod's timeline that covers it (`None`: the
/// batch pod was not held), CLOCK_MONOTONIC ns.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hold {
    pub start: u64,
    pub idle_at: u64,
    pub gap: Option<(u64, u64)>,
}

/// A latency pod's bursts next to a saturating batch pod, as each saw them
/// (the pods' objects are removed when this drops).
pub(crate) struct Bursts {
    pub latency: Pod,
    pub batch: Pod,
    /// The priority table's name.
    pub priority: String,
    pub latency_lines: Vec<String>,
    pub batch_lines: Vec<String>,
}

impl Bursts {
    /// The batch pod saturates its GPU with 100 µs kernels for 1.1 s. The
    /// latency pod launches once (it is then on the GPU), and 300 ms later
    /// queues 50 ms of work in one burst, three times, 150 ms apart. Each
    /// burst is timed from a clock read before it to the end of its work on
    /// the latency pod's timeline: a clock read after the synchronize would
    /// add however long the process took to run again.
    pub(crate) fn run() -> Self {
        Self::run_with(&[], &[])
    }

    /// [`Bursts::run`] with `latency_env` set for the latency pod and
    /// `batch_env` for the batch pod.
    pub(crate) fn run_with(latency_env: &[(&str, &str)], batch_env: &[(&str, &str)]) -> Self {
        let (latency, batch) = (Pod::new("latency"), Pod::new("batch"));
        let node = format!("gpushare-node-test-{}", latency.0);
        let priority = format!("gpushare-priority-test-{}", latency.0);
        let batch_child = class_probe(
            &batch,
            &node,
            &priority,
            "batch",
            &["run", "kernel", "100", "1100", "idle", "50"],
        )
        .envs(batch_env.iter().copied())
        .spawn()
        .expect("batch");
        let burst = [
            "clock", "spin", "kernel", "100", "500", "settled", "sleep", "150",
        ];
        let mut script = vec!["spin", "kernel", "100", "1", "sleep", "300"];
        for _ in 0..3 {
            script.extend(burst);
        }
        let latency_child = class_probe(&latency, &node, &priority, "latency", &script)
            .envs(latency_env.iter().copied())
            .spawn()
            .expect("latency");
        let latency_lines = output_lines(latency_child);
        let batch_lines = output_lines(batch_child);
        Self {
            latency,
            batch,
            priority,
            latency_lines,
            batch_lines,
        }
    }

    /// The priority table the pods shared.
    pub(crate) fn table(&self) -> gpushare_utils::priority::NodePriority {
        let access = gpushare_utils::node_table::TableAccess::managed(None);
        gpushare_utils::priority::NodePriority::open_named(&self.priority, &access)
            .expect("priority table")
    }

    /// Per burst, how the batch pod was held over it. The batch pod stops
    /// within its one launch in flight (2 ms) of the latency pod's first
    /// launch, which comes after the burst's clock read by however long
    /// the latency pod then waited for a CPU (its burst's `delay_ns`); the
    /// stretch is known to the 50 µs step of `idle`.
    pub(crate) fn holds(&self) -> Vec<Hold> {
        const STEP_NS: u64 = 50_000;
        const MS: u64 = 1_000_000;
        let gaps = idle_spans(&self.batch_lines);
        let starts = times(&self.latency_lines, "clock");
        let ends = times(&self.latency_lines, "settled");
        // Each burst's spin line follows its clock line.
        let delays = self
            .latency_lines
            .windows(2)
            .filter(|pair| pair[0].starts_with("clock "))
            .map(|pair| number(&pair[1], "delay_ns") as u64);
        starts
            .iter()
            .zip(&ends)
            .zip(delays)
            .map(|((&start, &idle_at), delay)| {
                let gap = gaps
                    .iter()
                    .find(|(a, b)| *a <= start + 2 * MS + delay && *b + STEP_NS >= idle_at)
                    .copied();
                Hold {
                    start,
                    idle_at,
                    gap,
                }
            })
            .collect()
    }
}

/// A periodic latency pod next to a saturating batch pod, both running (the
/// pods' objects are removed when this drops).
pub(crate) struct Periodic {
    pub latency: Pod,
    pub batch: Pod,
    /// The priority table's name.
    pub priority: String,
    pub latency_child: std::process::Child,
    pub batch_child: std::process::Child,
}

impl Periodic {
    /// Starts the batch pod's `batch_script` (its launches of 200 µs kernels
    /// back to back) on a shallow launch queue, then the latency pod: one
    /// launch makes the table, and 250 ms later 120 requests (two 100 µs
    /// kernels, then a synchronize) are due every 2 ms, prediction `predict`.
    pub(crate) fn start(predict: &str, batch_script: &[&str]) -> Self {
        let (latency, batch) = (Pod::new("periodic-latency"), Pod::new("periodic-batch"));
        let node = format!("gpushare-node-test-{}", latency.0);
        let priority = format!("gpushare-priority-test-{}", latency.0);
        let mut batch_command = class_probe(&batch, &node, &priority, "batch", batch_script);
        // A shallow launch queue: what the batch pod queued before it found
        // the table (up to 1024 kernels by default) would otherwise run for
        // 200 ms whatever the classes say.
        batch_command.env("GPUSHARE_DOUBLE_QUEUE_DEPTH", "4");
        let batch_child = batch_command.spawn().expect("batch");
        let script = [
            "spin", "kernel", "100", "1", "sleep", "250", "periodic", "2", "100", "2000", "120",
        ];
        let mut latency_command = class_probe(&latency, &node, &priority, "latency", &script);
        latency_command.env("CUDA_LIMITER_PRIORITY_PREDICT", predict);
        let latency_child = latency_command.spawn().expect("latency");
        Self {
            latency,
            batch,
            priority,
            latency_child,
            batch_child,
        }
    }
}
