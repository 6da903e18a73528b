//! The CDI spec of a prepared claim (Container Device Interface 0.6.0): one
//! device named after the claim UID, whose container edits are everything
//! the limiter needs in the container.
//!
//! Written with our own serde types rather than the `container-device-interface`
//! crate's: that crate pulls a JSON-schema validator with an HTTP client and
//! a TLS stack into the daemon to write one small file. The tests validate
//! every spec we write with that crate.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::mps::{CONTAINER_MPS_PIPE_DIR, MpsClient};
use super::{
    CONTAINER_LIMITER, CONTAINER_POD_FILE, CONTAINER_PRELOAD, CONTAINER_SHM, CONTAINER_SOCKET_DIR,
    ClaimRequest, ProvisionConfig, ProvisionError,
};
use gpushare_utils::ledger::PodLedger;
use gpushare_utils::limits::PodLimits;
use hypervisor_observer::GpuInfo;

/// `cdiVersion` of the specs written: the version whose fields these
/// types carry.
pub const CDI_VERSION: &str = "0.6.0";

/// One prepared claim's CDI spec file, in `cdi_dir`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    /// Always [`CDI_VERSION`].
    pub cdi_version: String,
    /// `<vendor>/<class>` ([`ProvisionConfig::cdi_kind`]): a device's ID is
    /// `<kind>=<name>`.
    pub kind: String,
    /// The claim's one device.
    pub devices: Vec<Device>,
}

/// A CDI device: what the container runtime does to a container that
/// names it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    /// The claim's UID.
    pub name: String,
    /// What the container gets.
    pub container_edits: ContainerEdits,
}

/// What a claim gives a container: the CDI device's edits, and the device
/// plugin's `Allocate` answer (the device plugin's `container_response`).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `NAME=value` lines: the GPUs' UUIDs in `CUDA_VISIBLE_DEVICES` and
    /// `NVIDIA_VISIBLE_DEVICES`, and an MPS client's variables.
    pub env: Vec<String>,
    /// Each GPU's `/dev/nvidia<minor>` and the driver's `nvidiactl`,
    /// `nvidia-uvm` and `nvidia-uvm-tools`.
    pub device_nodes: Vec<DeviceNode>,
    /// The limiter, the preload file, the pod file, the pod's limits and
    /// region; where they apply, the hypervisor's socket folder and the
    /// MPS folders.
    pub mounts: Vec<Mount>,
}

/// A device node the container gets.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Its path in the container.
    pub path: String,
    /// Its path on the host: the same.
    pub host_path: String,
}

/// A bind mount into the container.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    /// The source, as the host (the container runtime) sees it.
    pub host_path: String,
    /// Where it appears in the container.
    pub container_path: String,
    /// Mount options: `ro` or `rw` first (the device plugin reads `ro` as
    /// read-only), with `nosuid`, `nodev` and `bind`; the read-write mounts
    /// and the socket folder also `noexec`.
    pub options: Vec<String>,
}

/// `<vendor>/<class>=<claim uid>`.
pub fn device_id(config: &ProvisionConfig, claim_uid: &str) -> String {
    format!("{}={claim_uid}", config.cdi_kind())
}

/// `<vendor>-<class>_<claim uid>.json`.
pub fn spec_file_name(config: &ProvisionConfig, claim_uid: &str) -> String {
    format!(
        "{}-{}_{claim_uid}.json",
        config.cdi_vendor, config.cdi_class
    )
}

/// The spec of `request`, whose pod's pod file is `pod_file` (agent's
/// view) and which gives the container `gpus` (NVML index order), as a
/// client of their MPS daemon where `mps` says (a co-run GPU,
/// [`super::mps`]). The pod, the daemon and the token reach the limiter
/// only through the pod file: variables are the tenant's to change.
pub fn claim_spec(
    config: &ProvisionConfig,
    request: &ClaimRequest,
    gpus: &[GpuInfo],
    pod_file: &Path,
    mps: Option<&MpsClient>,
) -> Result<Spec, ProvisionError> {
    let host_pod_file = host_view(pod_file, &config.state_dir, &config.host_state_dir);
    let region = PodLedger::name_of(&request.pod.uid);
    let limits = PodLimits::name_of(&request.pod.uid);
    let visible: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
    let mut env = vec![
        format!("CUDA_VISIBLE_DEVICES={}", visible.join(",")),
        format!("NVIDIA_VISIBLE_DEVICES={}", visible.join(",")),
    ];
    let mut device_nodes = Vec::new();
    for gpu in gpus {
        let minor = device_minor(&config.host_root, gpu);
        device_nodes.push(node(&format!("/dev/nvidia{minor}")));
    }
    for control in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] {
        device_nodes.push(node(control));
    }
    let ro = || ["ro", "nosuid", "nodev", "bind"].map(String::from).to_vec();
    let rw = || {
        ["rw", "nosuid", "nodev", "noexec", "bind"]
            .map(String::from)
            .to_vec()
    };
    let mut mounts = vec![
        Mount {
            host_path: path_text(&config.host_limiter),
            container_path: CONTAINER_LIMITER.to_owned(),
            options: ro(),
        },
        Mount {
            host_path: path_text(&config.host_state_dir.join("ld.so.preload")),
            container_path: CONTAINER_PRELOAD.to_owned(),
            options: ro(),
        },
        Mount {
            host_path: path_text(&host_pod_file),
            container_path: CONTAINER_POD_FILE.to_owned(),
            options: ro(),
        },
        // The limits the hypervisor writes: the limiter reads them, never writes.
        Mount {
            host_path: path_text(&config.host_region_dir.join(&limits)),
            container_path: format!("{CONTAINER_SHM}/{limits}"),
            options: ro(),
        },
        // Read-write: the pod's processes keep their usage and budget in it.
        Mount {
            host_path: path_text(&config.host_region_dir.join(&region)),
            container_path: format!("{CONTAINER_SHM}/{region}"),
            options: rw(),
        },
    ];
    // The hypervisor's socket: its folder, not the socket file, so that a
    // daemon restarted (a new socket inode) is reached again. Read-only
    // still lets a process connect, and no pod can put a socket of its own there.
    if let Some(dir) = &config.host_socket_dir {
        mounts.push(Mount {
            host_path: path_text(dir),
            container_path: CONTAINER_SOCKET_DIR.to_owned(),
            options: ["ro", "nosuid", "nodev", "noexec", "bind"]
                .map(String::from)
                .to_vec(),
        });
    }
    // An MPS client: read-write, as clients make their pipes in the folder
    // and their shared memory in the daemon's /dev/shm. That folder goes on
    // /dev/shm first, so that the region and limits above are mounted on it,
    // not hidden under it (CDI also sorts a parent before its children).
    if let Some(client) = mps {
        env.extend(client.env.iter().cloned());
        mounts.push(Mount {
            host_path: path_text(&client.host_pipe_dir),
            container_path: CONTAINER_MPS_PIPE_DIR.to_owned(),
            options: rw(),
        });
        if let Some(shm) = &client.host_shm_dir {
            mounts.insert(
                0,
                Mount {
                    host_path: path_text(shm),
                    container_path: CONTAINER_SHM.to_owned(),
                    options: rw(),
                },
            );
        }
    }
    Ok(Spec {
        cdi_version: CDI_VERSION.to_owned(),
        kind: config.cdi_kind(),
        devices: vec![Device {
            name: request.claim_uid.clone(),
            container_edits: ContainerEdits {
                env,
                device_nodes,
                mounts,
            },
        }],
    })
}

fn node(path: &str) -> DeviceNode {
    DeviceNode {
        path: path.to_owned(),
        host_path: path.to_owned(),
    }
}

fn path_text(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// `path` (under `agent_dir`) as the host sees it (under `host_dir`).
fn host_view(path: &Path, agent_dir: &Path, host_dir: &Path) -> PathBuf {
    path.strip_prefix(agent_dir)
        .map_or_else(|_| path.to_owned(), |rel| host_dir.join(rel))
}

/// The minor number of `gpu`'s device node, from the driver's
/// `/proc/driver/nvidia/gpus/*/information` ("GPU UUID" and "Device Minor");
/// without it (simulated GPUs), the NVML index.
pub fn device_minor(host_root: &Path, gpu: &GpuInfo) -> u32 {
    let dir = host_root.join("proc/driver/nvidia/gpus");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return gpu.index;
    };
    for entry in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path().join("information")) else {
            continue;
        };
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.trim_start().strip_prefix(':'))
                .map(str::trim)
        };
        if field("GPU UUID").is_some_and(|u| u.eq_ignore_ascii_case(&gpu.uuid))
            && let Some(minor) = field("Device Minor").and_then(|m| m.parse().ok())
        {
            return minor;
        }
    }
    gpu.index
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DeviceGrant, PodRef, SharingParams};

    fn request() -> ClaimRequest {
        ClaimRequest {
            claim_uid: "0b7c8a52-3f1e-4a7e-9c4e-2f6f1d2c3b4a".into(),
            namespace: "default".into(),
            name: "gpu".into(),
            pod: PodRef {
                uid: "1c8d9b63-4f2e-4b8f-8d5f-3a7e2e3d4c5b".into(),
                namespace: "default".into(),
                name: "trainer".into(),
            },
            devices: vec![DeviceGrant::example(30, SharingParams::default())],
        }
    }

    fn gpus() -> Vec<GpuInfo> {
        vec![GpuInfo {
            index: 0,
            uuid: "GPU-0".into(),
            name: "test".into(),
            memory_total: 8 << 30,
            memory_used: 0,
        }]
    }

    #[test]
    fn the_pod_file_is_mounted_read_only_beside_the_library_and_no_variable_says_it() {
        assert_eq!(
            Path::new(CONTAINER_POD_FILE),
            gpushare_utils::pod_file::PodFile::beside(Path::new(CONTAINER_LIMITER))
        );
        let mut config = ProvisionConfig::daemonset("http://10.0.0.1:7070");
        config.state_dir = PathBuf::from("/agent/state");
        config.host_state_dir = PathBuf::from("/host/state");
        let pod_file = Path::new("/agent/state/pods/p/gpushare-pod.json");
        let spec = claim_spec(&config, &request(), &gpus(), pod_file, None).unwrap();
        let edits = &spec.devices[0].container_edits;
        let mount = edits
            .mounts
            .iter()
            .find(|m| m.container_path == CONTAINER_POD_FILE)
            .expect("the pod file is mounted");
        assert_eq!(mount.host_path, "/host/state/pods/p/gpushare-pod.json");
        assert_eq!(mount.options, ["ro", "nosuid", "nodev", "bind"]);
        // The pod, the daemon and the token are the pod file's to say: a
        // variable would be the tenant's to unset.
        assert!(
            !edits.env.iter().any(|e| e.starts_with("CUDA_LIMITER_")),
            "{:?}",
            edits.env
        );
    }

    #[test]
    fn pods_reach_the_hypervisor_through_its_socket_folder() {
        let config =
            ProvisionConfig::daemonset_socket(Path::new("/var/lib/gpushare/run/hypervisor.sock"))
                .unwrap();
        assert_eq!(
            config.hypervisor_url,
            "http+unix://%2Fvar%2Frun%2Fgpushare%2Fhypervisor%2Fhypervisor.sock"
        );
        let spec = claim_spec(&config, &request(), &gpus(), Path::new("/t"), None).unwrap();
        let edits = &spec.devices[0].container_edits;
        let mount = edits
            .mounts
            .iter()
            .find(|m| m.container_path == CONTAINER_SOCKET_DIR)
            .expect("the socket's folder is mounted");
        assert_eq!(mount.host_path, "/var/lib/gpushare/run");
        assert!(mount.options.contains(&"ro".to_owned()));
        // The URL the limiter gets names the socket as the container sees it.
        let (socket, _) = http_bidir_comm::split_unix_url(&config.hypervisor_url).unwrap();
        assert_eq!(
            socket,
            Path::new(CONTAINER_SOCKET_DIR).join("hypervisor.sock")
        );
    }

    #[test]
    fn a_tcp_address_mounts_no_socket_folder() {
        let config = ProvisionConfig::daemonset("http://10.0.0.1:7070");
        let spec = claim_spec(&config, &request(), &gpus(), Path::new("/t"), None).unwrap();
        let edits = &spec.devices[0].container_edits;
        assert!(
            !edits
                .mounts
                .iter()
                .any(|m| m.container_path == CONTAINER_SOCKET_DIR)
        );
        assert!(ProvisionConfig::daemonset_socket(Path::new("hypervisor.sock")).is_err());
    }

    #[test]
    fn an_mps_client_gets_its_pipe_folder_read_write_and_its_variables() {
        let config = ProvisionConfig::daemonset("http://10.0.0.1:7070");
        let mut client = MpsClient {
            host_pipe_dir: PathBuf::from("/var/lib/gpushare/mps/GPU-0/pipe"),
            host_shm_dir: None,
            env: vec!["CUDA_LIMITER_MPS=required".into()],
        };
        let spec =
            claim_spec(&config, &request(), &gpus(), Path::new("/t"), Some(&client)).unwrap();
        let edits = &spec.devices[0].container_edits;
        assert!(edits.env.contains(&"CUDA_LIMITER_MPS=required".to_owned()));
        assert!(edits.env.contains(&"CUDA_VISIBLE_DEVICES=GPU-0".to_owned()));
        let mount = edits
            .mounts
            .iter()
            .find(|m| m.container_path == CONTAINER_MPS_PIPE_DIR)
            .expect("the pipe folder is mounted");
        assert_eq!(mount.host_path, "/var/lib/gpushare/mps/GPU-0/pipe");
        assert_eq!(mount.options, ["rw", "nosuid", "nodev", "noexec", "bind"]);
        // The host's /dev/shm is the daemon's: the container keeps its own.
        assert!(
            !edits
                .mounts
                .iter()
                .any(|m| m.container_path == CONTAINER_SHM)
        );
        // A daemon with a /dev/shm of its own: that folder on the
        // container's, before the region and limits mounted in it.
        client.host_shm_dir = Some(PathBuf::from("/var/lib/gpushare/mps/GPU-0/shm"));
        let spec =
            claim_spec(&config, &request(), &gpus(), Path::new("/t"), Some(&client)).unwrap();
        let mounts = &spec.devices[0].container_edits.mounts;
        let at = |path: &str| {
            mounts
                .iter()
                .position(|m| m.container_path.starts_with(path))
        };
        let shm = at(CONTAINER_SHM).unwrap();
        assert_eq!(mounts[shm].container_path, CONTAINER_SHM);
        assert_eq!(mounts[shm].host_path, "/var/lib/gpushare/mps/GPU-0/shm");
        assert_eq!(
            mounts[shm].options,
            ["rw", "nosuid", "nodev", "noexec", "bind"]
        );
        assert!(shm < at("/dev/shm/gpushare-pod-").unwrap());
        assert!(shm < at("/dev/shm/gpushare-limits-").unwrap());
        // Without a client: no pipe folder, no MPS variable.
        let spec = claim_spec(&config, &request(), &gpus(), Path::new("/t"), None).unwrap();
        let edits = &spec.devices[0].container_edits;
        assert!(
            !edits
                .mounts
                .iter()
                .any(|m| m.container_path == CONTAINER_MPS_PIPE_DIR)
        );
        assert!(!edits.env.iter().any(|e| e.contains("MPS")));
    }
}
