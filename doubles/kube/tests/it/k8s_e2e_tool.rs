//! The `k8s-e2e` tool's plumbing on simulated GPUs: it prepares a claim for
//! 4 GiB / 30%, writes the env and mounts of the CDI spec, serves until told
//! to stop, and cleans up; the same through the device plugin, and with the
//! GPU in co-run mode (the fake MPS control daemon supervised).

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

#[test]
fn k8s_e2e_writes_the_cdi_env_and_cleans_up() {
    let tool = Tool::start(
        "tool",
        &["--simulate-gpus", "2", "--memory", "4Gi", "--compute", "30"],
    );
    let (out, limiter, pod) = (&tool.out, &tool.limiter, tool.pod.clone());
    let env = std::fs::read_to_string(out.join("env")).unwrap();
    // The pod, the daemon and the token are the pod file's: no variable.
    assert!(!env.contains("CUDA_LIMITER_"), "{env}");
    let mounts = std::fs::read_to_string(out.join("mounts")).unwrap();
    let limiter_line = format!(
        "{} /usr/local/gpushare/lib/libcuda_limiter.so ro,",
        limiter.canonicalize().unwrap().display()
    );
    assert!(
        mounts.lines().any(|l| l.starts_with(&limiter_line)),
        "{mounts}"
    );
    let pod_file = pod_file_in(&mounts);
    assert_eq!(pod_file.pod, pod);
    assert!(pod_file.hypervisor.starts_with("http://127.0.0.1:"));
    assert_eq!(pod_file.token.len(), 64);
    assert!(PathBuf::from(format!("/dev/shm/gpushare-pod-{pod}")).exists());

    let hv = tool.stop();
    let gpu = &hv["pods"][0]["gpus"][0];
    assert_eq!(
        (
            hv["pods"][0]["id"].as_str(),
            gpu["memory_quota"].as_u64(),
            gpu["cap_percent"].as_u64()
        ),
        (Some(pod.as_str()), Some(4 << 30), Some(30))
    );
    assert!(!PathBuf::from(format!("/dev/shm/gpushare-pod-{pod}")).exists());
}

#[test]
fn k8s_e2e_prepares_a_claim_for_two_gpus_each_with_its_quota() {
    let tool = Tool::start(
        "two",
        &[
            "--simulate-gpus",
            "2",
            "--device",
            "gpu-0,gpu-1",
            "--memory",
            "4Gi",
            "--compute",
            "30",
        ],
    );
    let env = std::fs::read_to_string(tool.out.join("env")).unwrap();
    let hv = tool.stop();
    assert_each_visible_gpu_has(&env, &hv, 2, (4 << 30, 30));
}

/// Every GPU in `env`'s `CUDA_VISIBLE_DEVICES` (`count` of them) is one of
/// the pod's GPUs in the status `hv`, with `quota` bytes and `cap` percent,
/// and the pod has no other.
fn assert_each_visible_gpu_has(
    env: &str,
    hv: &serde_json::Value,
    count: usize,
    (quota, cap): (u64, u64),
) {
    let visible = env
        .lines()
        .find_map(|l| l.strip_prefix("CUDA_VISIBLE_DEVICES="))
        .unwrap_or_else(|| panic!("{env}"));
    let mut want: Vec<(String, u64, u64)> = visible
        .split(',')
        .map(|uuid| (uuid.to_owned(), quota, cap))
        .collect();
    want.sort();
    assert_eq!(want.len(), count, "{env}");
    let mut seen: Vec<(String, u64, u64)> = hv["pods"][0]["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["uuid"].as_str().unwrap().to_owned(),
                g["memory_quota"].as_u64().unwrap(),
                g["cap_percent"].as_u64().unwrap(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(seen, want, "{hv}");
}

#[test]
fn k8s_e2e_device_plugin_mode_writes_the_allocate_env_and_cleans_up() {
    let tool = Tool::start(
        "dp",
        &[
            "--simulate-gpus",
            "2",
            "--device-plugin",
            "--gpumem",
            "4096",
            "--gpucores",
            "30",
            "--skip-identity",
        ],
    );
    let (out, pod) = (&tool.out, tool.pod.as_str());
    let mounts = std::fs::read_to_string(out.join("mounts")).unwrap();
    assert_eq!(pod_file_in(&mounts).pod, pod);
    let region = format!("/dev/shm/gpushare-pod-{pod}");
    assert!(
        mounts
            .lines()
            .any(|l| l.starts_with(&format!("{region} {region} rw,"))),
        "{mounts}"
    );
    assert!(
        mounts
            .lines()
            .any(|l| l.contains(" /etc/ld.so.preload ro,")),
        "{mounts}"
    );
    let hv = tool.stop();
    let gpu = &hv["pods"][0]["gpus"][0];
    assert_eq!(
        (gpu["memory_quota"].as_u64(), gpu["cap_percent"].as_u64()),
        (Some(4 << 30), Some(30))
    );
    assert!(!std::path::Path::new(&region).exists());
}

#[test]
fn k8s_e2e_device_plugin_mode_gives_a_container_two_gpus_each_with_its_quota() {
    let tool = Tool::start(
        "dp-two",
        &[
            "--simulate-gpus",
            "2",
            "--device-plugin",
            "--gpus",
            "2",
            "--gpumem",
            "4096",
            "--gpucores",
            "30",
            "--skip-identity",
        ],
    );
    let env = std::fs::read_to_string(tool.out.join("env")).unwrap();
    let hv = tool.stop();
    assert_each_visible_gpu_has(&env, &hv, 2, (4 << 30, 30));
}

#[test]
fn k8s_e2e_corun_mode_supervises_mps_and_gives_the_container_its_shm() {
    let tool = Tool::start(
        "corun",
        &[
            "--simulate-gpus",
            "2",
            "--memory",
            "4Gi",
            "--compute",
            "30",
            "--corun",
            "--mps-control",
            mps_fake::program().to_str().unwrap(),
        ],
    );
    let out = &tool.out;
    let mps = std::fs::read_to_string(out.join("mps")).unwrap();
    let fields: Vec<&str> = mps.split_whitespace().collect();
    let [gpu, pid, shm] = fields[..] else {
        panic!("{mps}")
    };
    assert!(gpu.starts_with("GPU-"), "{mps}");
    assert_eq!(
        PathBuf::from(shm),
        out.join("node/mps").join(gpu).join("shm")
    );
    let env = std::fs::read_to_string(out.join("env")).unwrap();
    for wanted in [
        "CUDA_MPS_PIPE_DIRECTORY=/var/run/gpushare/mps",
        // The claim's fixed 30%, of the SMs on a co-run GPU.
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
        "CUDA_LIMITER_MPS=required",
    ] {
        assert!(env.lines().any(|l| l == wanted), "{wanted}: {env}");
    }
    // The daemon's /dev/shm is the container's, mounted before the region.
    let mounts = std::fs::read_to_string(out.join("mounts")).unwrap();
    assert!(
        mounts
            .lines()
            .next()
            .unwrap()
            .starts_with(&format!("{shm} /dev/shm rw,")),
        "{mounts}"
    );
    // Where this test may make a mount namespace, the daemon runs in one
    // with that folder as its /dev/shm.
    if Command::new("unshare")
        .args(["--mount", "true"])
        .status()
        .is_ok_and(|s| s.success())
    {
        use std::os::unix::fs::MetadataExt;
        let seen = std::fs::metadata(format!("/proc/{pid}/root/dev/shm")).unwrap();
        let own = std::fs::metadata(shm).unwrap();
        assert_eq!((seen.dev(), seen.ino()), (own.dev(), own.ino()));
    }
    let hv = tool.stop();
    assert_eq!(hv["corun"][0]["gpu"].as_str(), Some(gpu), "{hv}");
    // Quit on shutdown.
    assert!(!PathBuf::from(format!("/proc/{pid}")).exists());
}

/// How long a tool may take to get ready.
const READY_WITHIN: Duration = Duration::from_secs(180);

/// A `k8s-e2e` run in a scratch directory (removed on drop), ready.
struct Tool {
    dir: PathBuf,
    out: PathBuf,
    limiter: PathBuf,
    child: Child,
    /// The pod it prepared (`OUT/ready`).
    pod: String,
}

impl Tool {
    /// Starts `k8s-e2e` with `args` and waits until it is ready.
    fn start(name: &str, args: &[&str]) -> Self {
        let dir = std::env::temp_dir().join(format!("hv-k8s-e2e-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let limiter = dir.join("libcuda_limiter.so");
        std::fs::write(&limiter, b"").unwrap();
        let out = dir.join("out");
        let mut child = Command::new(env!("CARGO_BIN_EXE_k8s-e2e"))
            .args(args)
            .args(["--max-seconds", "300"])
            .arg("--out")
            .arg(&out)
            .arg("--limiter")
            .arg(&limiter)
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !out.join("ready").exists() {
            let failed = match child.try_wait().unwrap() {
                Some(status) => Some(format!("k8s-e2e exited early: {status}")),
                // Its control plane's start and the pod's (the tool gives
                // that 120 s) take minutes on a loaded machine.
                None if start.elapsed() > READY_WITHIN => {
                    Some(format!("k8s-e2e not ready in {READY_WITHIN:?}"))
                }
                None => None,
            };
            if let Some(failed) = failed {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(&dir);
                panic!("{failed}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let pod = std::fs::read_to_string(out.join("ready"))
            .unwrap()
            .trim()
            .to_owned();
        Self {
            dir,
            out,
            limiter,
            child,
            pod,
        }
    }

    /// Tells it to stop; asserts it exited 0 and left nothing behind;
    /// returns the hypervisor status it wrote.
    fn stop(mut self) -> serde_json::Value {
        std::fs::write(self.out.join("stop"), b"").unwrap();
        assert!(self.child.wait().unwrap().success());
        assert_eq!(
            std::fs::read_to_string(self.out.join("unprepared")).unwrap(),
            "clean\n"
        );
        serde_json::from_slice(&std::fs::read(self.out.join("status.json")).unwrap()).unwrap()
    }
}

impl Drop for Tool {
    /// After a failed assertion: asks the tool to stop as `stop` does, so
    /// that it unprepares and quits an MPS daemon it runs; kills it if it
    /// has not within 15 s.
    fn drop(&mut self) {
        let _ = std::fs::write(self.out.join("stop"), b"");
        let deadline = Instant::now() + Duration::from_secs(15);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The pod file mounted beside the limiter, from the `mounts` the tool wrote.
fn pod_file_in(mounts: &str) -> gpushare_utils::pod_file::PodFile {
    let host = mounts
        .lines()
        .find_map(|l| {
            l.split_once(" /usr/local/gpushare/lib/gpushare-pod.json ro,")
                .map(|(h, _)| PathBuf::from(h))
        })
        .unwrap_or_else(|| panic!("no pod file mounted: {mounts}"));
    serde_json::from_slice(&std::fs::read(host).unwrap()).unwrap()
}
