//! Co-run mode on a node of two GPUs, against the driver double: GPU 1 in
//! co-run mode, GPU 0 time-sliced, pods from the hypervisor's config file
//! (local mode), their processes started as an operator starts them.
//!
//! The MPS control daemon of GPU 1 is what the hypervisor's supervisor
//! leaves in its folders: the GPU named beside the pipe folder
//! (`hypervisor_corun::control::name_served_gpu`), the fake control
//! daemon's socket and the file in which the fake (`mps-fake`, started with
//! `CUDA_VISIBLE_DEVICES=<GPU 1>`) names the GPUs it serves, so that the
//! double's MPS clients enumerate GPU 1 alone, as the real driver's do.
//! The supervisor writing those is tested in `hypervisor/tests/it/corun.rs`.
//! The double's NVML shows both GPUs, as NVML on the node does.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::Output;
use std::sync::Arc;

use gpushare_utils::limits::PodLimits;
use gpushare_utils::shm::Trust;
use hypervisor_corun::{CorunOptions, control, log_dir, pipe_dir};

use system_tests::RunningNode;
use system_tests::pod::Pod;
use system_tests::probes::{probe, result_of};
use system_tests::{daemon, probes};

/// The name under which the fake control daemon names the GPUs it serves
/// (`mps_fake::SERVED_DEVICES_FILE`; the driver double reads it).
const SERVED_DEVICES_FILE: &str = "fake-served-devices";

const TOKEN: &str = "corun-gpus-token";

/// GPU 1's MPS folders under a folder of this test's own, removed after it.
struct Mps {
    root: PathBuf,
    uuid: String,
    _control: UnixListener,
}

impl Mps {
    fn new(tag: &str) -> Self {
        let root = std::env::temp_dir().join(format!("corun-gpus-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let uuid = gpushare_examples::uuid(1);
        let pipe = pipe_dir(&root, &uuid);
        control::prepare_folders(&pipe, &log_dir(&root, &uuid), None).expect("folders");
        control::name_served_gpu(&root, &uuid).expect("served GPU");
        std::fs::write(pipe.join(SERVED_DEVICES_FILE), format!("{uuid}\n")).expect("served");
        // The daemon's control socket: connections queue in its backlog,
        // which is all the double's cuInit asks of it.
        let control = UnixListener::bind(pipe.join("control")).expect("bind control");
        Self {
            root,
            uuid,
            _control: control,
        }
    }

    fn pipe(&self) -> PathBuf {
        pipe_dir(&self.root, &self.uuid)
    }

    fn options(&self) -> CorunOptions {
        CorunOptions {
            gpus: vec![self.uuid.clone()],
            dir: self.root.clone(),
            host_dir: self.root.clone(),
            latency_reserve: 20,
            control: "/nonexistent/nvidia-cuda-mps-control".into(),
            private_shm: false,
        }
    }
}

impl Drop for Mps {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// A hypervisor over the double's two GPUs, GPU 1 in co-run mode, running
/// `pod` on the GPUs of `indices` (4 GiB each, batch).
fn node(pod: &Pod, indices: &[u32], mps: &Mps) -> RunningNode {
    let mut config = format!(
        "listen = \"127.0.0.1:0\"\n[[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n",
        pod.0
    );
    for index in indices {
        config.push_str(&format!(
            "[[pods.gpus]]\nindex = {index}\nmemory = \"4g\"\n"
        ));
    }
    let running = daemon::hypervisor(pod, &config, Arc::new(daemon::double_gpus(2)));
    running.hypervisor().set_corun_gpus(&mps.options());
    running
}

/// Waits until the hypervisor published `pod`'s limits on every GPU of
/// `indices` (a co-run GPU's with its share of the SMs).
fn wait_published(pod: &Pod, indices: &[u32], corun: bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let limits = PodLimits::open_read_only(&pod.0, &Trust::own_or_root(None)).ok();
        let placed = limits.as_ref().is_some_and(|limits| {
            indices
                .iter()
                .all(|i| limits.find(&gpushare_examples::uuid(*i as u8)).is_some())
        });
        let shared = !corun || limits.and_then(|l| l.sm_percent()).is_some();
        if placed && shared {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "limits not published");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The probe of `pod` under `running`, on two GPUs, with `env` (a `None`
/// value removes the variable): lists its GPUs, then takes 3 GiB and asks
/// 2 GiB more.
fn run(pod: &Pod, running: &RunningNode, env: &[(&str, Option<&str>)]) -> Output {
    let mut command = probe(
        "cudaprobe",
        pod,
        &[
            ("GPUSHARE_DOUBLE_DEVICES", "2"),
            ("CUDA_LIMITER_HYPERVISOR", &running.url()),
            ("CUDA_LIMITER_TOKEN", TOKEN),
        ],
        &["gpus", "alloc", "mem", "3g", "alloc", "mem", "2g"],
    );
    command
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("CUDA_MPS_PIPE_DIRECTORY");
    for (name, value) in env {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    probes::use_node_tables(&mut command, pod);
    command.output().expect("spawn probe")
}

/// The variables of an MPS client of `mps`'s GPU, as the operator gives
/// them in local mode (provisioning's, without `CUDA_VISIBLE_DEVICES`).
fn client_env(mps: &Mps) -> Vec<(&'static str, Option<String>)> {
    vec![
        ("CUDA_LIMITER_MPS", Some("required".into())),
        (
            "CUDA_MPS_PIPE_DIRECTORY",
            Some(mps.pipe().to_str().expect("UTF-8 path").into()),
        ),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", Some("80".into())),
    ]
}

fn borrowed<'a>(env: &'a [(&'static str, Option<String>)]) -> Vec<(&'static str, Option<&'a str>)> {
    env.iter().map(|(k, v)| (*k, v.as_deref())).collect()
}

/// The probe's `gpus` line: (CUDA's UUIDs, NVML's, CUDA_VISIBLE_DEVICES).
fn gpus(output: &Output) -> (Vec<String>, Vec<String>, String) {
    let lines = probes::stdout_lines(output);
    let line = lines
        .iter()
        .find(|l| l.starts_with("gpus "))
        .unwrap_or_else(|| panic!("no gpus line: {lines:?}"));
    let field = |name: &str| -> String {
        line.split(' ')
            .find_map(|part| part.strip_prefix(name))
            .unwrap_or_else(|| panic!("{name} in {line}"))
            .to_owned()
    };
    let list = |text: String| -> Vec<String> {
        text.split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    };
    assert!(line.starts_with("gpus 0 "), "{line}");
    assert!(line.contains(" nvml 0="), "{line}");
    (list(field("cuda=")), list(field("0=")), field("visible="))
}

/// The GPUs NVML shows the program through `visible`, as PyTorch counts
/// them: UUIDs (or prefixes) and NVML indices.
fn nvml_through(visible: &str, nvml: &[String]) -> Vec<String> {
    if visible == "unset" {
        return nvml.to_vec();
    }
    visible
        .split(',')
        .map_while(|entry| match entry.parse::<usize>() {
            Ok(index) => nvml.get(index).cloned(),
            Err(_) => nvml.iter().find(|u| u.starts_with(entry)).cloned(),
        })
        .collect()
}

/// Whether the double made the process an MPS client.
fn mps_client(output: &Output) -> bool {
    String::from_utf8_lossy(&output.stderr).contains("driver double: MPS client")
}

/// The lines this library printed on stderr.
fn our_lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .filter(|line| line.starts_with("cuda-limiter:"))
        .map(str::to_owned)
        .collect()
}

fn assert_quota_holds(output: &Output) {
    probes::check(output);
    let lines = probes::stdout_lines(output);
    assert_eq!(result_of(&lines[1]), 0, "3 GiB fit in 4: {lines:?}");
    assert_eq!(result_of(&lines[2]), 2, "2 GiB more do not: {lines:?}");
}

/// The probe failed at `cuInit` with `CUDA_ERROR_NOT_INITIALIZED`, and the
/// limiter said why in one line containing each of `why`.
fn assert_refused(output: &Output, why: &[&str]) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "ran: {output:?}");
    assert!(stderr.contains("cuInit failed: 3"), "{stderr}");
    let ours = our_lines(output);
    assert_eq!(ours.len(), 1, "one line: {stderr}");
    for part in why {
        assert!(ours[0].contains(part), "{part:?} in {ours:?}");
    }
    assert!(ours[0].ends_with("cuInit refused"), "{ours:?}");
}

#[test]
fn a_client_of_gpu_1_sees_gpu_1_alone_through_cuda_and_nvml() {
    let (gpu0, gpu1) = (gpushare_examples::uuid(0), gpushare_examples::uuid(1));
    let mps = Mps::new("client");
    let pod = Pod::new("corun-gpu1");
    let running = node(&pod, &[1], &mps);
    wait_published(&pod, &[1], true);
    let env = client_env(&mps);

    // As an operator starts it: the limiter names the server's GPU.
    let output = run(&pod, &running, &borrowed(&env));
    assert_quota_holds(&output);
    assert!(mps_client(&output), "{output:?}");
    let (cuda, nvml, visible) = gpus(&output);
    assert_eq!(cuda, [gpu1.as_str()], "one CUDA device, GPU 1");
    assert_eq!(nvml, [gpu0.clone(), gpu1.clone()], "NVML sees the node");
    assert_eq!(visible, gpu1, "pinned at load");
    assert_eq!(nvml_through(&visible, &nvml), cuda, "NVML counts agree");

    // As provisioning gives it (the CDI spec, the device plugin): named
    // by UUID already, kept as it is.
    let mut provisioned = env.clone();
    provisioned.push(("CUDA_VISIBLE_DEVICES", Some(gpu1.clone())));
    let output = run(&pod, &running, &borrowed(&provisioned));
    assert_quota_holds(&output);
    let (cuda, _, visible) = gpus(&output);
    assert_eq!((cuda, visible), (vec![gpu1.clone()], gpu1.clone()));

    // Where nobody names the GPU (no file beside the pipe folder), NVML
    // would show the process both GPUs while its server serves one, which
    // PyTorch fails on: refused, saying what to set.
    std::fs::remove_file(mps.root.join(&gpu1).join("gpu")).expect("remove");
    let output = run(&pod, &running, &borrowed(&env));
    assert_refused(
        &output,
        &[
            &format!("NVML shows it GPUs {gpu0},{gpu1} (CUDA_VISIBLE_DEVICES unset)"),
            &format!("set CUDA_VISIBLE_DEVICES={gpu1}"),
        ],
    );
    // Named by the node's index, which the MPS server renumbers: NVML's
    // GPU 0 is not the client's device 0.
    let mut by_index = env.clone();
    by_index.push(("CUDA_VISIBLE_DEVICES", Some("0".into())));
    let output = run(&pod, &running, &borrowed(&by_index));
    assert_refused(&output, &[&format!("NVML shows it GPUs {gpu0} ")]);
    running.stop();
}

#[test]
fn a_pod_on_the_time_sliced_gpu_is_no_mps_client() {
    let gpu0 = gpushare_examples::uuid(0);
    let mps = Mps::new("sliced");
    let pod = Pod::new("corun-gpu0");
    let running = node(&pod, &[0], &mps);
    wait_published(&pod, &[0], false);
    let output = run(
        &pod,
        &running,
        &[("CUDA_VISIBLE_DEVICES", Some(gpu0.as_str()))],
    );
    assert_quota_holds(&output);
    assert!(!mps_client(&output), "{output:?}");
    let (cuda, nvml, visible) = gpus(&output);
    assert_eq!(cuda, [gpu0.as_str()]);
    assert_eq!(nvml_through(&visible, &nvml), cuda);
    // Its limits carry no share of the SMs: it is not a co-run pod.
    let limits = PodLimits::open_read_only(&pod.0, &Trust::own_or_root(None)).expect("limits");
    assert_eq!(limits.sm_percent(), None);
    running.stop();
}

#[test]
fn a_pod_given_the_corun_gpu_and_an_ordinary_one_is_refused() {
    let (gpu0, gpu1) = (gpushare_examples::uuid(0), gpushare_examples::uuid(1));
    let mps = Mps::new("mixed");
    let pod = Pod::new("corun-mixed");
    let running = node(&pod, &[0, 1], &mps);
    wait_published(&pod, &[0, 1], true);
    // As an MPS client it reaches GPU 1 alone; its pod is given both.
    let output = run(&pod, &running, &borrowed(&client_env(&mps)));
    assert_refused(
        &output,
        &[
            &format!("its pod is given GPUs {gpu0},{gpu1} but its MPS server serves {gpu1}"),
            "one MPS server serves one co-run GPU",
        ],
    );
    running.stop();
}
