//! Co-run mode's daemon side against the fake `nvidia-cuda-mps-control`
//! (crate `mps-fake`): one control daemon per co-run GPU with the right
//! environment, `/readyz` waiting for it, restarts counted, a hung daemon
//! killed and restarted, `quit` on shutdown, a leftover daemon quit at
//! start; its log in the GPU's log folder, a server that fails to start
//! reported; a daemon for container clients with its own `/dev/shm`; and
//! the ResourceSlice's `corun` attribute, as the official control plane
//! stores it.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypervisor_corun::control::Control;
use hypervisor_corun::{
    CorunGpuStatus, CorunOptions, MpsState, MpsSupervisor, Timing, log_dir, pipe_dir, shm_dir,
};
use hypervisor_observer::{GpuObserver, SimulatedGpus};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams};
use kube_fakes::cluster_node::{self, Overlay};
use kube_fakes::node::TestNode;
use mps_fake::commands::FIRST_SERVER_PID;
use mps_fake::{LOG_FILE, PID_FILE, SOCKET, log};

use system_tests::scratch::Scratch;
use system_tests::wait::eventually_some;

/// The test's MPS folder, a [`Scratch`] with the control programs' `bin/`,
/// removed when dropped, also when the test fails. A leftover daemon the
/// test started is killed first.
struct MpsScratch {
    scratch: Scratch,
    leftover: Option<Child>,
}

impl MpsScratch {
    fn new() -> Self {
        let scratch = Scratch::new("corun");
        std::fs::create_dir_all(scratch.dir.join("bin")).unwrap();
        Self {
            scratch,
            leftover: None,
        }
    }

    fn dir(&self) -> &Path {
        &self.scratch.dir
    }

    /// A control program under the real name that starts `-f` after
    /// `delay` (the client mode at once): `/readyz` is seen waiting.
    fn slow_control(&self, delay: Duration) -> PathBuf {
        self.control_running_first(&format!(
            "[ \"$1\" = -f ] && sleep {}\n",
            delay.as_secs_f64()
        ))
    }

    /// A control program under the real name whose every server fails to
    /// start for `reason` (the fake's [`mps_fake::SERVER_FAILS`] hook).
    fn failing_control(&self, reason: &str) -> PathBuf {
        self.control_running_first(&format!("export {}='{reason}'\n", mps_fake::SERVER_FAILS))
    }

    /// A control program under the real name whose first `-f` hangs after
    /// `answers` answered commands (the fake's [`mps_fake::HANG_AFTER`]
    /// hook); a marker file makes every later start answer for good.
    fn hanging_control(&self, answers: u32) -> PathBuf {
        let marker = self.dir().join("bin").join("hung-once");
        self.control_running_first(&format!(
            "if [ \"$1\" = -f ] && [ ! -e '{marker}' ]; then\n  \
             : > '{marker}'\n  export {hook}={answers}\nfi\n",
            marker = marker.display(),
            hook = mps_fake::HANG_AFTER,
        ))
    }

    /// A control program under the real name: a shell script that runs
    /// `prelude`, then the fake with the same arguments.
    fn control_running_first(&self, prelude: &str) -> PathBuf {
        let path = self.dir().join("bin").join("nvidia-cuda-mps-control");
        let script = format!(
            "#!/bin/sh\n{prelude}exec '{}' \"$@\"\n",
            mps_fake::program().display()
        );
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    fn options(&self, gpus: &[String], control: &Path) -> CorunOptions {
        CorunOptions {
            gpus: gpus.to_vec(),
            dir: self.dir().join("mps"),
            host_dir: self.dir().join("mps"),
            latency_reserve: 20,
            control: control.to_owned(),
            private_shm: false,
        }
    }
}

impl Drop for MpsScratch {
    fn drop(&mut self) {
        // Before the fields drop: the daemon goes before its folder.
        if let Some(mut child) = self.leftover.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Short backoffs, so a restart is seen quickly; the rest as the daemon.
fn quick() -> Timing {
    Timing {
        first_backoff: Duration::from_millis(100),
        poll: Duration::from_millis(20),
        ..Timing::default()
    }
}

fn entry(board: &[CorunGpuStatus], gpu: &str) -> CorunGpuStatus {
    board.iter().find(|g| g.gpu == gpu).unwrap().clone()
}

fn up_pid(supervisor: &MpsSupervisor, gpu: &str) -> Option<u32> {
    let g = entry(&supervisor.board().snapshot(), gpu);
    g.is_up().then_some(g.pid).flatten()
}

fn read_log(options: &CorunOptions, gpu: &str) -> String {
    std::fs::read_to_string(log_dir(&options.dir, gpu).join(LOG_FILE)).unwrap_or_default()
}

fn alive(pid: u32) -> bool {
    !gpushare_utils::process::process_is_gone(pid as i32, 0)
}

#[test]
fn one_daemon_per_gpu_ready_restarted_and_quit_on_shutdown() {
    let scratch = MpsScratch::new();
    let harness = common::Harness::start("", 2, &[]);
    let gpus = [common::gpu(0), common::gpu(1)];
    let control = scratch.slow_control(Duration::from_millis(300));
    let options = scratch.options(&gpus, &control);
    let supervisor = MpsSupervisor::with_timing(&options, quick()).unwrap();
    harness.hv.hypervisor().set_corun_board(supervisor.board());

    // Not ready while the daemons start, naming each GPU.
    let (code, body) = common::call("GET", &format!("{}/readyz", harness.url()), None, None);
    assert_eq!(code, 503, "{body}");
    for gpu in &gpus {
        assert!(body.contains(&format!("MPS of GPU {gpu}")), "{body}");
    }
    let pids: Vec<u32> = gpus
        .iter()
        .map(|gpu| eventually_some("MPS up", || up_pid(&supervisor, gpu)))
        .collect();
    assert_ne!(pids[0], pids[1]);
    eventually_some("ready", || {
        let (code, _) = common::call("GET", &format!("{}/readyz", harness.url()), None, None);
        (code == 200).then_some(())
    });

    // Each daemon serves its GPU alone, in its own folders.
    for gpu in &gpus {
        let (pipe, logs) = (pipe_dir(&options.dir, gpu), log_dir(&options.dir, gpu));
        let text = read_log(&options, gpu);
        assert_eq!(
            log::started_env(&text, "CUDA_VISIBLE_DEVICES"),
            Some(gpu.as_str())
        );
        assert_eq!(
            log::started_env(&text, "CUDA_MPS_PIPE_DIRECTORY").map(PathBuf::from),
            Some(pipe.clone())
        );
        assert_eq!(
            log::started_env(&text, "CUDA_MPS_LOG_DIRECTORY").map(PathBuf::from),
            Some(logs.clone())
        );
        assert!(log::commands(&text).contains(&"get_server_list"), "{text}");
        // The GPU is named beside the pipe folder for clients whose
        // CUDA_VISIBLE_DEVICES does not say it; the fake's servers serve it
        // alone (what the driver double's clients then see).
        let trust = gpushare_utils::shm::Trust::own_or_root(None);
        assert_eq!(
            gpushare_utils::served_gpu::read_beside(&pipe, &trust).unwrap(),
            *gpu
        );
        assert_eq!(
            std::fs::read_to_string(pipe.join(mps_fake::SERVED_DEVICES_FILE)).unwrap(),
            format!("{gpu}\n")
        );
        for dir in [&pipe, &logs] {
            let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o777, "{}", dir.display());
        }
    }

    // The status and the metrics say so.
    let status = harness.hv.hypervisor().status();
    assert_eq!(status.corun.len(), 2);
    assert!(status.corun.iter().all(|g| g.is_up() && g.restarts == 0));
    let (_, metrics) = common::call("GET", &format!("{}/metrics", harness.url()), None, None);
    assert!(metrics.contains(&format!("gpushare_mps_up{{gpu=\"{}\"}} 1", gpus[0])));
    assert!(metrics.contains(&format!(
        "gpushare_mps_restarts_total{{gpu=\"{}\"}} 0",
        gpus[0]
    )));

    // Killed: down, then started again, the restart counted; the other
    // GPU's daemon untouched.
    // SAFETY: signals the daemon the supervisor started for this test.
    assert_eq!(unsafe { libc::kill(pids[0] as i32, libc::SIGKILL) }, 0);
    let restarted = eventually_some("restarted", || {
        let g = entry(&supervisor.board().snapshot(), &gpus[0]);
        (g.is_up() && g.restarts == 1 && g.pid != Some(pids[0])).then_some(g)
    });
    assert!(restarted.pid.is_some_and(alive));
    assert_eq!(up_pid(&supervisor, &gpus[1]), Some(pids[1]));
    let (_, metrics) = common::call("GET", &format!("{}/metrics", harness.url()), None, None);
    assert!(metrics.contains(&format!(
        "gpushare_mps_restarts_total{{gpu=\"{}\"}} 1",
        gpus[0]
    )));
    let (_, json) = common::call(
        "GET",
        &format!("{}/api/v1/status", harness.url()),
        None,
        None,
    );
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(json["corun"][0]["state"], "up");
    assert_eq!(json["corun"][0]["restarts"], 1);

    // Shutdown: `quit` to each, the daemons gone, their socket and pid file too.
    let board = supervisor.board();
    let last = [restarted.pid.unwrap(), pids[1]];
    supervisor.shutdown();
    for (gpu, pid) in gpus.iter().zip(last) {
        assert_eq!(
            log::commands(&read_log(&options, gpu)).last(),
            Some(&"quit")
        );
        let pipe = pipe_dir(&options.dir, gpu);
        assert!(!pipe.join(SOCKET).exists() && !pipe.join(PID_FILE).exists());
        assert!(!alive(pid));
        assert_eq!(entry(&board.snapshot(), gpu).state, MpsState::Stopped);
    }
}

#[test]
fn a_daemon_that_cannot_start_is_down_with_its_reason_and_retried() {
    let scratch = MpsScratch::new();
    let harness = common::Harness::start("", 1, &[]);
    let gpu = common::gpu(0);
    let missing = scratch.dir().join("bin").join("no-such-control");
    let options = scratch.options(std::slice::from_ref(&gpu), &missing);
    let supervisor = MpsSupervisor::with_timing(&options, quick()).unwrap();
    harness.hv.hypervisor().set_corun_board(supervisor.board());
    let down = eventually_some("retried", || {
        let g = entry(&supervisor.board().snapshot(), &gpu);
        (g.restarts >= 2 && matches!(g.state, MpsState::Down { .. })).then_some(g)
    });
    let MpsState::Down { reason, .. } = down.state else {
        unreachable!()
    };
    assert!(reason.contains("no-such-control"), "{reason}");
    let (code, body) = common::call("GET", &format!("{}/readyz", harness.url()), None, None);
    assert_eq!(code, 503);
    assert!(
        body.contains(&format!("MPS of GPU {gpu} is down")),
        "{body}"
    );
    let (_, metrics) = common::call("GET", &format!("{}/metrics", harness.url()), None, None);
    assert!(metrics.contains(&format!("gpushare_mps_up{{gpu=\"{gpu}\"}} 0")));
    // Stopping does not wait out the backoff.
    let asked = Instant::now();
    supervisor.shutdown();
    assert!(asked.elapsed() < Duration::from_secs(2));
}

/// A server that fails to start refuses its clients CUDA: the daemon's log
/// (in the GPU's log folder) says so, and the node daemon counts it and
/// names its reason in the status, the metrics and its own log; the
/// control daemon stays up.
#[test]
fn a_server_that_fails_to_start_is_reported_with_its_reason() {
    let scratch = MpsScratch::new();
    let harness = common::Harness::start("", 1, &[]);
    let gpu = common::gpu(0);
    let control = scratch.failing_control("invalid argument");
    let options = scratch.options(std::slice::from_ref(&gpu), &control);
    let supervisor = MpsSupervisor::with_timing(&options, quick()).unwrap();
    harness.hv.hypervisor().set_corun_board(supervisor.board());
    let pid = eventually_some("MPS up", || up_pid(&supervisor, &gpu));
    let client = Control {
        program: control.clone(),
        pipe: pipe_dir(&options.dir, &gpu),
    };
    // What a client's first connection asks of the daemon, twice.
    for _ in 0..2 {
        client
            .send("start_server -uid 0", Duration::from_secs(5))
            .unwrap();
    }
    let failed = eventually_some("the failures reported", || {
        let g = entry(&supervisor.board().snapshot(), &gpu);
        (g.server_failures == 2).then_some(g)
    });
    let last = failed.last_server_failure.clone().unwrap();
    assert_eq!(last.failure.server, FIRST_SERVER_PID + 1);
    assert_eq!(last.failure.status, 1);
    assert_eq!(
        last.failure.reason.as_deref(),
        Some(format!("{} invalid argument", log::FAILED_TO_START).as_str())
    );
    assert_eq!((failed.is_up(), failed.pid), (true, Some(pid)));
    let (_, metrics) = common::call("GET", &format!("{}/metrics", harness.url()), None, None);
    assert!(
        metrics.contains(&format!(
            "gpushare_mps_server_failures_total{{gpu=\"{gpu}\"}} 2"
        )),
        "{metrics}"
    );
    let text = hypervisor::status_table::render_table(&harness.hv.hypervisor().status());
    assert!(
        text.contains("exited with status 1: Failed to start : invalid argument"),
        "{text}"
    );
    // The daemon's own lines and its servers' went to the log folder.
    let log_text = read_log(&options, &gpu);
    assert!(
        log_text.contains("Server encountered a fatal exception"),
        "{log_text}"
    );
    let asked: Vec<_> = log::commands_of(&log_text, pid)
        .into_iter()
        .filter(|c| *c != "get_server_list")
        .collect();
    assert_eq!(asked, ["start_server -uid 0", "start_server -uid 0"]);
    supervisor.shutdown();
}

/// Where pods are containers, each daemon runs in a mount namespace of its
/// own whose `/dev/shm` is its GPU's folder (what its clients get), not the
/// host's. That takes CAP_SYS_ADMIN: where this test cannot make a mount
/// namespace itself, the daemon must be down, saying so, never up without
/// its folder.
#[test]
fn a_daemon_for_container_clients_has_its_gpus_folder_as_dev_shm() {
    use std::os::unix::fs::MetadataExt;
    let scratch = MpsScratch::new();
    let gpu = common::gpu(0);
    let options = CorunOptions {
        private_shm: true,
        ..scratch.options(std::slice::from_ref(&gpu), mps_fake::program())
    };
    let folder = shm_dir(&options.dir, &gpu);
    let can_unshare = Command::new("unshare")
        .args(["--mount", "true"])
        .status()
        .is_ok_and(|s| s.success());
    let supervisor = MpsSupervisor::with_timing(&options, quick()).unwrap();
    let mode = std::fs::metadata(&folder).unwrap().mode() & 0o7777;
    assert_eq!(mode, 0o1777);
    if can_unshare {
        let pid = eventually_some("MPS up", || up_pid(&supervisor, &gpu));
        let seen = std::fs::metadata(format!("/proc/{pid}/root/dev/shm")).unwrap();
        let own = std::fs::metadata(&folder).unwrap();
        assert_eq!((seen.dev(), seen.ino()), (own.dev(), own.ino()));
        let host = std::fs::metadata("/dev/shm").unwrap();
        assert_ne!((host.dev(), host.ino()), (own.dev(), own.ino()));
    } else {
        let reason = eventually_some("down", || {
            match entry(&supervisor.board().snapshot(), &gpu).state {
                MpsState::Down { reason, .. } => Some(reason),
                _ => None,
            }
        });
        assert!(reason.contains("CAP_SYS_ADMIN"), "{reason}");
    }
    supervisor.shutdown();
}

#[test]
fn a_hung_daemon_is_seen_down_killed_and_restarted() {
    let scratch = MpsScratch::new();
    let gpu = common::gpu(0);
    // Answers readiness, then hangs, alive.
    let control = scratch.hanging_control(1);
    let options = scratch.options(std::slice::from_ref(&gpu), &control);
    let timing = Timing {
        // Long enough for the down state to be seen between kill and restart.
        first_backoff: Duration::from_millis(500),
        liveness_interval: Duration::from_millis(100),
        liveness_failures: 3,
        command_timeout: Duration::from_millis(200),
        ..quick()
    };
    let supervisor = MpsSupervisor::with_timing(&options, timing).unwrap();
    let hung = eventually_some("MPS up", || up_pid(&supervisor, &gpu));
    let up_at = Instant::now();

    let down = eventually_some("seen down", || {
        let g = entry(&supervisor.board().snapshot(), &gpu);
        matches!(g.state, MpsState::Down { .. }).then_some(g)
    });
    // 3 checks, each up to an interval plus the command timeout, then the kill;
    // the rest is slack for a loaded machine.
    assert!(
        up_at.elapsed() < Duration::from_secs(5),
        "{:?}",
        up_at.elapsed()
    );
    let MpsState::Down { reason, .. } = &down.state else {
        unreachable!()
    };
    assert!(reason.contains("does not answer"), "{reason}");
    assert_eq!((down.restarts, down.pid), (0, None));
    // Killed, not left running beside the next one.
    assert!(!alive(hung));
    let waiting = supervisor.board().waiting();
    assert_eq!(waiting.len(), 1);
    assert!(waiting[0].contains("does not answer"), "{waiting:?}");

    // Started again (the marker keeps the new one answering), counted, up.
    let restarted = eventually_some("restarted", || {
        let g = entry(&supervisor.board().snapshot(), &gpu);
        (g.is_up() && g.restarts == 1).then_some(g)
    });
    assert!(restarted.pid.is_some_and(|pid| pid != hung && alive(pid)));
    // It keeps passing the checks: several intervals later still up, once restarted.
    std::thread::sleep(Duration::from_millis(600));
    let later = entry(&supervisor.board().snapshot(), &gpu);
    assert!(later.is_up() && later.restarts == 1, "{later:?}");
    let text = read_log(&options, &gpu);
    let checks = log::commands(&text)
        .iter()
        .filter(|c| **c == "get_server_list")
        .count();
    assert!(checks >= 4, "{text}");
    supervisor.shutdown();
}

#[test]
fn a_daemon_left_by_an_earlier_run_is_quit_first() {
    let mut scratch = MpsScratch::new();
    let gpu = common::gpu(0);
    let options = scratch.options(std::slice::from_ref(&gpu), mps_fake::program());
    let pipe = pipe_dir(&options.dir, &gpu);
    let logs = log_dir(&options.dir, &gpu);
    std::fs::create_dir_all(&pipe).unwrap();
    std::fs::create_dir_all(&logs).unwrap();
    // Its log where an earlier supervisor put it.
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(logs.join(LOG_FILE))
        .unwrap();
    let leftover = Command::new(mps_fake::program())
        .arg("-f")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", &logs)
        .env("CUDA_VISIBLE_DEVICES", "earlier-run")
        .stdout(log_file)
        .spawn()
        .unwrap();
    let old = leftover.id();
    scratch.leftover = Some(leftover);
    eventually_some("the leftover answers", || {
        std::os::unix::net::UnixStream::connect(pipe.join(SOCKET))
            .ok()
            .map(drop)
    });
    // Its pid file, written just after the socket, names it.
    eventually_some("the leftover's pid file", || {
        let text = std::fs::read_to_string(pipe.join(PID_FILE)).ok()?;
        (text.trim() == old.to_string()).then_some(())
    });

    let supervisor = MpsSupervisor::with_timing(&options, quick()).unwrap();
    let new = eventually_some("MPS up", || up_pid(&supervisor, &gpu));
    assert_ne!(new, old);
    let status = scratch
        .leftover
        .as_mut()
        .unwrap()
        .try_wait()
        .unwrap()
        .expect("the leftover was quit before ours started");
    assert!(status.success(), "quit, not killed: {status}");
    let text = read_log(&options, &gpu);
    assert_eq!(log::commands_of(&text, old), ["quit"], "{text}");
    let quit = text.find(&format!("{} quit", log::COMMAND));
    let started = text.rfind(log::STARTED);
    assert!(quit.is_some() && started > quit, "{text}");
    assert_eq!(
        log::started_env(&text, "CUDA_VISIBLE_DEVICES"),
        Some(gpu.as_str())
    );
    supervisor.shutdown();
}

#[test]
fn co_run_gpus_carry_the_slice_attribute() {
    const NODE: &str = "node-c";
    let scratch = MpsScratch::new();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let sim = Arc::new(SimulatedGpus::new(2));
        let gpus = sim.gpus().unwrap();
        // The official control plane, `deploy/base` applied, the agent on a
        // token of the shipped ServiceAccount.
        let kubeconfig = scratch.dir().join("agent.kubeconfig");
        let plane =
            cluster_node::installed(Overlay::Base, &scratch.dir().join("home"), &kubeconfig)
                .await
                .unwrap();
        // The kubelet registers the Node with the node's credentials; no
        // kubelet double runs: no pod runs here.
        cluster_node::register_node(&plane, NODE).await.unwrap();
        let limiter = scratch.dir().join("libcuda_limiter.so");
        std::fs::write(&limiter, b"").unwrap();
        let mut options =
            kube_fakes::node::options(scratch.dir(), NODE, "gpu.gpushare.dev", &limiter);
        options.kubeconfig = Some(kubeconfig);
        options.provision.corun =
            Some(scratch.options(std::slice::from_ref(&gpus[1].uuid), mps_fake::program()));
        let observer: Arc<dyn GpuObserver> = sim.clone();
        let node = TestNode::start_written(observer, options, None)
            .await
            .unwrap();
        // The slice as the real API server stored it.
        let slices = Api::<ResourceSlice>::all(plane.admin().await.unwrap())
            .list(&ListParams::default())
            .await
            .unwrap()
            .items;
        assert_eq!(slices.len(), 1, "{slices:?}");
        let corun: Vec<_> = slices[0]
            .spec
            .devices
            .iter()
            .flatten()
            .map(|d| {
                let corun = d.attributes.as_ref().and_then(|a| a.get("corun"));
                (d.name.as_str(), corun.and_then(|a| a.bool))
            })
            .collect();
        assert_eq!(corun, [("gpu-0", Some(false)), ("gpu-1", Some(true))]);
        node.stop().await;
    });
}
