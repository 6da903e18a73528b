//! Support for the tests of swap and move under a real daemon and the
//! driver double's checkpoint API: the folder of the double's control
//! blocks, a probe run in steps, what a control block says (and what the
//! double's processes hold on each GPU, as NVML would list them), the
//! admin commands of the CLI, and a pod's own requests to the daemon.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use gpushare_utils::ledger::PodLedger;
use gpushare_utils::protocol::RoomAnswer;

use crate::RunningNode;
use crate::artifacts;
use crate::pod::Pod;
use crate::probes::{self, probe};
use crate::wait::eventually;

/// The token of the pods these tests configure.
pub const TOKEN: &str = "pod-token";
/// The daemon's admin token in these tests.
pub const ADMIN: &str = "admin";

/// The folder where the double's processes keep their checkpoint control
/// blocks, one per test process.
pub fn checkpoint_dir() -> PathBuf {
    std::env::temp_dir().join(format!("gpushare-swap-tests-{}", std::process::id()))
}

/// Names [`checkpoint_dir`] in this process's environment and removes it
/// at exit. The double's caller side, loaded in-process by the daemon,
/// reads the variable, as do the probes, which inherit it. A process that
/// inherited the variable (this test binary run again as a child by a
/// test, which may be killed before it could remove a folder of its own)
/// keeps its parent's folder.
///
/// # Safety
/// Call from a constructor (`#[ctor::ctor]`), while the process has one
/// thread: it changes the environment.
pub unsafe fn name_the_checkpoint_folder() {
    if std::env::var_os(gpushare_examples::CHECKPOINT_DIR_VAR).is_some() {
        return;
    }
    extern "C" fn remove_the_checkpoint_folder() {
        let _ = std::fs::remove_dir_all(checkpoint_dir());
    }
    let dir = checkpoint_dir();
    let _ = std::fs::create_dir_all(&dir);
    // SAFETY: the caller runs this while the process has one thread.
    unsafe { std::env::set_var(gpushare_examples::CHECKPOINT_DIR_VAR, &dir) };
    // SAFETY: registers a plain function with no arguments to run at exit.
    unsafe { libc::atexit(remove_the_checkpoint_folder) };
}

/// A probe of a pod under a daemon, its script run up to each `wait` and
/// resumed by [`Running::resume`].
pub struct Running {
    /// The probe's process.
    pub child: Child,
    /// Its input, until [`Running::finish`] closes it.
    stdin: Option<ChildStdin>,
    lines: std::io::Lines<BufReader<ChildStdout>>,
}

/// A probe its test left running (the test failed, or never finished it)
/// is killed: a probe whose pod was left away by a stopped daemon would
/// wait for it forever, holding the test runner's output open.
impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Running {
    /// `cudaprobe` of `pod` under the daemon at `url` with [`TOKEN`],
    /// `env` added, running `script`.
    pub fn start(pod: &Pod, url: &str, env: &[(&str, &str)], script: &[&str]) -> Self {
        let mut command = probe(
            "cudaprobe",
            pod,
            &[
                ("CUDA_LIMITER_HYPERVISOR", url),
                ("CUDA_LIMITER_TOKEN", TOKEN),
            ],
            script,
        );
        probes::use_node_tables(&mut command, pod);
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("probe starts");
        let stdin = child.stdin.take().expect("stdin");
        let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        Self {
            child,
            stdin: Some(stdin),
            lines,
        }
    }

    /// The probe's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Output lines up to and including the next `ready` (or the end).
    pub fn until_ready(&mut self) -> Vec<String> {
        let mut seen = Vec::new();
        for line in self.lines.by_ref() {
            let line = line.expect("probe output");
            let ready = line == "ready";
            seen.push(line);
            if ready {
                break;
            }
        }
        seen
    }

    /// Lets the script go on past its `wait`.
    pub fn resume(&mut self) {
        let stdin = self.stdin.as_mut().expect("the probe's input is open");
        writeln!(stdin).expect("resume the probe");
    }

    /// The rest of the output, and the exit status.
    pub fn finish(mut self) -> (Vec<String>, std::process::ExitStatus) {
        drop(self.stdin.take());
        let rest: Vec<String> = self
            .lines
            .by_ref()
            .map(|l| l.expect("probe output"))
            .collect();
        let status = self.child.wait().expect("probe exits");
        (rest, status)
    }
}

/// What the double's control block of a process says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlBlock {
    /// Its `CUprocessState` (0 running, 1 locked, 2 checkpointed).
    pub state: u32,
    /// Bytes it keeps in host memory.
    pub host_bytes: u64,
    /// Bytes it holds on its CUDA device 0.
    pub device_bytes: u64,
    /// The double's GPU its CUDA device 0 runs on.
    pub gpu: u32,
}

/// The control block of process `pid`.
pub fn control_block(pid: u32) -> ControlBlock {
    let bytes = std::fs::read(checkpoint_dir().join(pid.to_string())).expect("control block");
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    ControlBlock {
        state: u32_at(12),
        host_bytes: u64_at(16),
        device_bytes: u64_at(24),
        gpu: u32_at(152),
    }
}

/// What the double's live processes hold on its GPU `gpu` (NVML's index),
/// by pid, as NVML lists a GPU's compute processes: each process with a
/// control block, by the device memory its CUDA devices on that GPU hold
/// (nothing while it is checkpointed).
pub fn processes_on(gpu: u32) -> Vec<(u32, u64)> {
    let Ok(entries) = std::fs::read_dir(checkpoint_dir()) else {
        return Vec::new();
    };
    let mut held = Vec::new();
    for entry in entries.flatten() {
        let Ok(bytes) = std::fs::read(entry.path()) else {
            continue;
        };
        if bytes.len() < 364 || &bytes[..8] != b"GSDCKPT1" {
            continue;
        }
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let pid = u32_at(216);
        let alive = i32::try_from(pid)
            .is_ok_and(|pid| !gpushare_utils::process::process_is_gone(pid, u64_at(224)));
        let on_gpu: u64 = (0..u32_at(360).min(16) as usize)
            .filter(|&ordinal| u32_at(152 + 4 * ordinal) == gpu)
            .map(|ordinal| u64_at(24 + 8 * ordinal))
            .sum();
        if alive && on_gpu > 0 {
            held.push((pid, on_gpu));
        }
    }
    held
}

/// Writes `pid` into a free process slot of `pod`'s ledger, as any process
/// of the pod may (the ledger is the pod's to write): the daemon then finds
/// it among the pids the pod names. The slot says it is of this process's
/// pid namespace, and started when `pid` did, so nothing reclaims it.
pub fn name_in_ledger(pod: &Pod, pid: u32) {
    let ledger = PodLedger::open(&pod.0).expect("the pod's ledger");
    let start_time = gpushare_utils::process::read_proc_stat(&format!("/proc/{pid}/stat"))
        .map_or(0, |stat| stat.start_time);
    let pid = i32::try_from(pid).expect("a pid");
    let slot = ledger
        .region()
        .processes
        .iter()
        .find(|slot| {
            slot.pid
                .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })
        .expect("a free slot");
    slot.pid_ns
        .store(gpushare_utils::process::own_pid_ns(), Ordering::Release);
    slot.start_time.store(start_time, Ordering::Release);
}

/// Writes `bytes` as what `pod`'s processes hold on the GPU `uuid` in its
/// ledger, as any process of the pod may.
pub fn write_ledger_usage(pod: &Pod, uuid: &str, bytes: u64) {
    let ledger = PodLedger::open(&pod.0).expect("the pod's ledger");
    let entry = ledger.device_for(uuid).expect("the GPU's entry");
    ledger.region().devices[entry]
        .used
        .store(bytes, Ordering::Release);
}

/// `hypervisor ARGS --addr <node>` with the admin token: its exit status
/// and output.
pub fn admin_cli(node: &RunningNode, args: &[&str]) -> (bool, String) {
    let output = Command::new(artifacts::hypervisor())
        .args(args)
        .args(["--addr", &node.addr().to_string()])
        .env("GPUSHARE_ADMIN_TOKEN", ADMIN)
        .output()
        .expect("hypervisor runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// `POST /api/v1{path}` with `token` and the JSON `body` to the daemon of
/// `node`: the answer's status code and body.
pub fn post(node: &RunningNode, path: &str, token: &str, body: &str) -> (u16, String) {
    let address = node.addr();
    let mut stream = TcpStream::connect(address).expect("daemon listens");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    write!(
        stream,
        "POST {}{path} HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        gpushare_utils::protocol::API_PREFIX,
        body.len()
    )
    .expect("request");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map_or("", |(_, body)| body)
        .to_owned();
    (status, body)
}

/// `pod`'s request for room for `bytes` on the GPU `uuid`, as one of its
/// workers (registered by a probe of the pod) with [`TOKEN`]: the daemon's
/// answer (the bytes it freed, whether the GPU has the room).
pub fn ask_room(node: &RunningNode, pod: &Pod, uuid: &str, bytes: u64) -> RoomAnswer {
    ask_room_saying(node, pod, uuid, bytes, None)
}

/// [`ask_room`], the worker saying its driver had `driver_free` bytes free.
pub fn ask_room_saying(
    node: &RunningNode,
    pod: &Pod,
    uuid: &str,
    bytes: u64,
    driver_free: Option<u64>,
) -> RoomAnswer {
    let mut workers = Vec::new();
    eventually("a worker of the pod is registered", || {
        workers = node.hypervisor().workers_of(&pod.0);
        !workers.is_empty()
    });
    let body = serde_json::json!({
        "worker_id": workers[0].to_string(),
        "uuid": uuid,
        "bytes": bytes,
        "driver_free": driver_free,
    })
    .to_string();
    let (status, answer) = post(node, "/room", TOKEN, &body);
    assert_eq!(status, 200, "{answer}");
    serde_json::from_str(&answer).expect("a room answer")
}
