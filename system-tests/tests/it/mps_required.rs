//! `CUDA_LIMITER_MPS=required` (a co-run GPU's pod): CUDA runs only as an MPS
//! client. The driver double is an MPS client when `CUDA_MPS_PIPE_DIRECTORY`
//! holds a `control` socket that accepts connections; without one the
//! driver runs alone, and the limiter refuses CUDA at `cuInit`.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::Output;
use std::sync::Arc;

use gpushare_utils::limits::PodLimits;
use gpushare_utils::shm::Trust;
use hypervisor_corun::CorunOptions;

use system_tests::pod::Pod;
use system_tests::probes::{probe, result_of};
use system_tests::{daemon, probes};

/// A pipe folder of its own, removed after the test.
struct PipeDir(PathBuf);

impl PipeDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("mps-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("pipe folder");
        Self(dir)
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("a UTF-8 temp path")
    }
}

impl Drop for PipeDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The probe under a 4 GiB quota with `CUDA_LIMITER_MPS=mps` and the pipe
/// folder `pipe` (`None`: unset), allocating 3 GiB then 2 GiB more.
fn run(pod: &Pod, mps: &str, pipe: Option<&str>) -> Output {
    let mut command = probe(
        "cudaprobe",
        pod,
        &[
            ("CUDA_LIMITER_MEMORY_LIMIT", "4g"),
            ("CUDA_LIMITER_MPS", mps),
        ],
        &["alloc", "mem", "3g", "alloc", "mem", "2g"],
    );
    match pipe {
        Some(dir) => command.env("CUDA_MPS_PIPE_DIRECTORY", dir),
        None => command.env_remove("CUDA_MPS_PIPE_DIRECTORY"),
    };
    command.output().expect("spawn probe")
}

/// The lines this library printed on stderr.
fn our_lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .filter(|line| line.starts_with("cuda-limiter:"))
        .map(str::to_owned)
        .collect()
}

/// The probe failed at `cuInit` with `CUDA_ERROR_NOT_INITIALIZED`, and the
/// limiter said why in one line containing `why`.
fn assert_refused(output: &Output, why: &str, what: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{what}: ran: {output:?}");
    assert!(stderr.contains("cuInit failed: 3"), "{what}: {stderr}");
    let ours = our_lines(output);
    assert_eq!(ours.len(), 1, "{what}: one line: {stderr}");
    assert!(ours[0].contains(why), "{what}: {ours:?}");
    assert!(ours[0].ends_with("cuInit refused"), "{what}: {ours:?}");
}

#[test]
fn without_an_mps_daemon_cuda_is_refused() {
    let pod = Pod::new("mps-none");
    let output = run(&pod, "required", None);
    assert_refused(
        &output,
        "CUDA_LIMITER_MPS=required but MPS is not in effect: device 0 runs without MPS",
        "no pipe folder",
    );

    // A pipe folder with nothing listening: a daemon that is down.
    let pipe = PipeDir::new("down");
    let output = run(&pod, "required", Some(pipe.path()));
    assert_refused(&output, "device 0 runs without MPS", "no listener");

    // A control socket left behind by a daemon that died: nobody accepts.
    let stale = UnixListener::bind(pipe.0.join("control")).expect("bind control");
    drop(stale);
    let output = run(&pod, "required", Some(pipe.path()));
    assert_refused(&output, "device 0 runs without MPS", "stale socket");
}

#[test]
fn with_the_daemon_up_cuda_runs_and_the_quota_holds() {
    let pod = Pod::new("mps-up");
    let pipe = PipeDir::new("up");
    // The daemon's control socket: connections queue in its backlog, which
    // is all the double's cuInit asks of it.
    let _control = UnixListener::bind(pipe.0.join("control")).expect("bind control");
    let output = run(&pod, "required", Some(pipe.path()));
    probes::check(&output);
    let lines = probes::stdout_lines(&output);
    assert_eq!(result_of(&lines[0]), 0, "3 GiB fit in 4: {lines:?}");
    assert_eq!(result_of(&lines[1]), 2, "2 GiB more do not: {lines:?}");
    assert!(our_lines(&output).is_empty(), "{output:?}");
}

#[test]
fn a_value_other_than_required_is_a_configuration_error() {
    let pod = Pod::new("mps-bogus");
    let pipe = PipeDir::new("bogus");
    let _control = UnixListener::bind(pipe.0.join("control")).expect("bind control");
    // Refused even with a daemon up: a typo must not pass for "not required".
    let output = run(&pod, "bogus", Some(pipe.path()));
    assert_refused(
        &output,
        "cuda-limiter: configuration error: CUDA_LIMITER_MPS=\"bogus\" is not required",
        "bogus",
    );
}

/// What the driver double's `cuInit` read as its MPS client's share of the
/// SMs (it says so on stderr).
fn share_the_driver_read(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr);
    stderr
        .lines()
        .find_map(|line| line.strip_prefix("driver double: MPS client, active thread percentage "))
        .unwrap_or_else(|| panic!("the double says no share: {stderr}"))
        .to_owned()
}

/// Runs pod `pod`'s probe (batch, its share provisioned at 80%) as an MPS
/// client under a hypervisor whose GPU 0 is in co-run mode and whose pods
/// are `pods` (`[[pods]]` bodies after id and token); returns what the
/// driver read.
fn share_under(pod: &Pod, others: &[&str]) -> String {
    let token = "mps-token";
    let mut config = format!(
        "listen = \"127.0.0.1:0\"\n[[pods]]\nid = \"{}\"\ntoken = \"{token}\"\n[[pods.gpus]]\nindex = 0\nmemory = \"4g\"\n",
        pod.0
    );
    for other in others {
        config.push_str(&format!(
            "[[pods]]\nid = \"{other}\"\ntoken = \"other\"\n[[pods.gpus]]\nindex = 0\nclass = \"latency\"\n"
        ));
    }
    let running = daemon::hypervisor(pod, &config, Arc::new(daemon::double_gpus(1)));
    running.hypervisor().set_corun_gpus(&CorunOptions {
        gpus: vec![gpushare_examples::uuid(0)],
        dir: std::env::temp_dir(),
        host_dir: std::env::temp_dir(),
        latency_reserve: 20,
        control: "/nonexistent/nvidia-cuda-mps-control".into(),
        private_shm: false,
    });
    // The scheduler's next tick writes the share into the pod's limits.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while PodLimits::open_read_only(&pod.0, &Trust::own_or_root(None))
        .ok()
        .and_then(|limits| limits.sm_percent())
        .is_none()
    {
        assert!(std::time::Instant::now() < deadline, "no share written");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let pipe = PipeDir::new(&format!("share-{}", others.len()));
    let _control = UnixListener::bind(pipe.0.join("control")).expect("bind control");
    let mut command = probe(
        "cudaprobe",
        pod,
        &[
            ("CUDA_LIMITER_MPS", "required"),
            ("CUDA_MPS_PIPE_DIRECTORY", pipe.path()),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "80"),
            ("CUDA_LIMITER_HYPERVISOR", &running.url()),
            ("CUDA_LIMITER_TOKEN", token),
        ],
        &["alloc", "mem", "3g", "alloc", "mem", "2g"],
    );
    probes::use_node_tables(&mut command, pod);
    let output = command.output().expect("spawn probe");
    probes::check(&output);
    let lines = probes::stdout_lines(&output);
    assert_eq!(result_of(&lines[0]), 0, "3 GiB fit in 4: {lines:?}");
    assert_eq!(result_of(&lines[1]), 2, "2 GiB more do not: {lines:?}");
    running.stop();
    share_the_driver_read(&output)
}

#[test]
fn a_batch_client_takes_the_share_its_pods_limits_give_when_it_starts() {
    // Alone on the co-run GPU: the whole of it, in place of the 80%
    // provisioned for a batch pod beside a latency pod.
    let pod = Pod::new("mps-alone");
    assert_eq!(share_under(&pod, &[]), "100");
    // Beside a latency pod: the provisioned 80%.
    let pod = Pod::new("mps-beside");
    let latency = Pod::new("mps-latency");
    assert_eq!(share_under(&pod, &[&latency.0]), "80");
}
