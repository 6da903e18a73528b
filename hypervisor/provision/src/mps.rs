//! Claims on co-run GPUs ([`hypervisor_corun`]): their containers run as clients
//! of the GPU's MPS control daemon.
//!
//! Such a container gets, besides the limiter's edits, the GPU's pipe folder
//! (read-write: clients make their own pipes there) at
//! [`CONTAINER_MPS_PIPE_DIR`], where the daemon has a `/dev/shm` of its own
//! that folder on the container's `/dev/shm` ([`hypervisor_corun::shm`]), and
//! the variables of an MPS client:
//! `CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (what a
//! client of the pod's class takes beside pods of the other class,
//! [`corun::active_thread_percentage`], narrowed to its fixed compute
//! share: on a co-run GPU that share is of the SMs, not of the time; the
//! limiter replaces it, before the driver starts, by what the pod's limits
//! give a client that starts now),
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (the pod's quota, a second fence behind
//! the limiter's), `CUDA_MPS_CLIENT_PRIORITY` (batch below normal) and
//! `CUDA_LIMITER_MPS=required`, so that a process the driver ran without MPS
//! (daemon down, client refused) is refused CUDA instead of taking the whole
//! GPU's SMs.
//!
//! A process is the client of one MPS server, which sees only its own GPU:
//! a pod is refused that would get a co-run GPU with any other GPU
//! ([`CorunConflict`]).

use std::path::PathBuf;

use gpushare_utils::pod::PodClass;

use super::grant::Totals;
use super::{ClaimRequest, DeviceGrant, ProvisionError};
use hypervisor_corun::{self as corun, CorunOptions};
use hypervisor_observer::GpuInfo;

/// Where a co-run GPU's pipe folder appears inside a container. Fixed, not
/// the host's path: the variable is then the same on every node whatever
/// the operator's folder, and MPS clients name no host path (NVIDIA's device
/// plugin mounts its pipe folder elsewhere in the container too).
pub const CONTAINER_MPS_PIPE_DIR: &str = "/var/run/gpushare/mps";

/// The variable that makes the limiter refuse CUDA unless MPS is in effect.
pub const LIMITER_MPS_VARIABLE: &str = "CUDA_LIMITER_MPS";

/// `CUDA_MPS_CLIENT_PRIORITY` levels, from NVIDIA's MPS documentation:
/// 0 is normal, 1 below normal.
const PRIORITY_NORMAL: u8 = 0;
const PRIORITY_BELOW_NORMAL: u8 = 1;

/// Why a set of GPUs cannot go to one pod as an MPS client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CorunConflict {
    /// A co-run GPU and an ordinary one.
    #[error(
        "co-run GPU {corun} and ordinary GPU {ordinary} cannot go to one pod: its processes are MPS clients of the co-run GPU's daemon, whose server sees no other GPU"
    )]
    Mixed {
        /// The co-run GPU's UUID.
        corun: String,
        /// The ordinary GPU's UUID.
        ordinary: String,
    },
    /// Two co-run GPUs, each with its own MPS control daemon.
    #[error(
        "co-run GPUs {first} and {second} cannot go to one pod: a process is the client of one MPS control daemon (one CUDA_MPS_PIPE_DIRECTORY), and each co-run GPU has its own"
    )]
    Several {
        /// One co-run GPU's UUID.
        first: String,
        /// The other's.
        second: String,
    },
}

/// The co-run GPU among `uuids` (a pod's or a claim's GPUs, repeats
/// allowed), if any; an error where they mix co-run and ordinary GPUs or
/// name two co-run GPUs.
pub fn corun_gpu<'a>(
    corun: Option<&CorunOptions>,
    uuids: impl IntoIterator<Item = &'a str>,
) -> Result<Option<&'a str>, CorunConflict> {
    let Some(corun) = corun else {
        return Ok(None);
    };
    let (mut shared, mut ordinary): (Option<&str>, Option<&str>) = (None, None);
    for uuid in uuids {
        if corun.covers(uuid) {
            match shared {
                Some(first) if !first.eq_ignore_ascii_case(uuid) => {
                    return Err(CorunConflict::Several {
                        first: first.to_owned(),
                        second: uuid.to_owned(),
                    });
                }
                Some(_) => {}
                None => shared = Some(uuid),
            }
        } else {
            ordinary.get_or_insert(uuid);
        }
        if let (Some(corun), Some(ordinary)) = (shared, ordinary) {
            return Err(CorunConflict::Mixed {
                corun: corun.to_owned(),
                ordinary: ordinary.to_owned(),
            });
        }
    }
    Ok(shared)
}

/// Refuses `request` when its own GPUs, or with `others` (the GPUs of its
/// pod's other prepared claims) its pod's, conflict.
pub(super) fn check_request<'a>(
    corun: Option<&CorunOptions>,
    request: &ClaimRequest,
    others: impl IntoIterator<Item = &'a DeviceGrant>,
) -> Result<(), ProvisionError> {
    let own = request.devices.iter().map(|d| d.gpu_uuid.as_str());
    corun_gpu(corun, own.clone()).map_err(|conflict| ProvisionError::Corun {
        subject: format!("claim {}", request.claim_uid),
        conflict,
    })?;
    let pod = others.into_iter().map(|d| d.gpu_uuid.as_str()).chain(own);
    corun_gpu(corun, pod).map_err(|conflict| ProvisionError::Corun {
        subject: format!("pod {} (with its other claims)", request.pod),
        conflict,
    })?;
    Ok(())
}

/// What a container of a co-run GPU's pod gets besides the limiter's edits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsClient {
    /// The GPU's pipe folder as the host sees it, mounted read-write at
    /// [`CONTAINER_MPS_PIPE_DIR`].
    pub host_pipe_dir: PathBuf,
    /// The `/dev/shm` the GPU's daemon shares with its clients, as the host
    /// sees it, mounted read-write on the container's `/dev/shm`; `None`
    /// where daemon and clients share the host's.
    pub host_shm_dir: Option<PathBuf>,
    /// `NAME=value` lines.
    pub env: Vec<String>,
}

/// The MPS client edits of a container that sees `gpus` (NVML index order:
/// its CUDA ordinals) of a pod whose grants are `pod_devices`; `None` when
/// none of `gpus` is a co-run GPU.
pub fn client<'a>(
    corun: Option<&CorunOptions>,
    gpus: &[GpuInfo],
    pod_devices: impl IntoIterator<Item = &'a DeviceGrant>,
) -> Result<Option<MpsClient>, CorunConflict> {
    let Some(options) = corun else {
        return Ok(None);
    };
    let Some(uuid) = corun_gpu(corun, gpus.iter().map(|g| g.uuid.as_str()))? else {
        return Ok(None);
    };
    let mut totals = Totals::default();
    pod_devices
        .into_iter()
        .filter(|d| d.gpu_uuid.eq_ignore_ascii_case(uuid))
        .for_each(|d| totals.add(d));
    let priority = match totals.class {
        PodClass::Latency => PRIORITY_NORMAL,
        PodClass::Batch => PRIORITY_BELOW_NORMAL,
    };
    // What a client takes beside pods of the other class: where the limiter
    // cannot read what the hypervisor gives a client that starts now (the
    // pod's limits), a batch client keeps off the reserve and a latency
    // client to it.
    let percentage = corun::active_thread_percentage(
        totals.class,
        options.latency_reserve,
        totals.sm_share(),
        true,
    );
    // Mixing is refused, so the co-run GPU is the container's only one:
    // its CUDA ordinal is the position in `gpus`, 0.
    let ordinal = gpus
        .iter()
        .position(|g| g.uuid.eq_ignore_ascii_case(uuid))
        .unwrap_or_default();
    Ok(Some(MpsClient {
        host_pipe_dir: corun::pipe_dir(&options.host_dir, uuid),
        host_shm_dir: options
            .private_shm
            .then(|| corun::shm_dir(&options.host_dir, uuid)),
        env: vec![
            format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_MPS_PIPE_DIR}"),
            format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percentage}"),
            format!(
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={ordinal}={}M",
                mebibytes_up(totals.memory_bytes)
            ),
            format!("CUDA_MPS_CLIENT_PRIORITY={priority}"),
            format!("{LIMITER_MPS_VARIABLE}=required"),
        ],
    }))
}

/// `bytes` in MiB, rounded up: the MPS fence is never below the quota the
/// limiter enforces, so the limiter's refusal (with its report) comes first.
fn mebibytes_up(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SharingParams;
    use hypervisor_core::spec::Policy;

    fn options() -> CorunOptions {
        CorunOptions {
            gpus: vec!["GPU-a".into()],
            dir: "/run/gpushare/mps".into(),
            host_dir: "/var/lib/gpushare/mps".into(),
            latency_reserve: 25,
            control: corun::DEFAULT_MPS_CONTROL.into(),
            private_shm: false,
        }
    }

    fn gpu(index: u32, uuid: &str) -> GpuInfo {
        GpuInfo {
            index,
            uuid: uuid.into(),
            name: "test".into(),
            memory_total: 80 << 30,
            memory_used: 0,
        }
    }

    /// A grant of memory alone (no compute limit).
    fn grant(uuid: &str, memory_bytes: u64, class: PodClass) -> DeviceGrant {
        let params = SharingParams {
            class,
            policy: Policy::None,
            ..SharingParams::default()
        };
        DeviceGrant {
            gpu_uuid: uuid.into(),
            memory_bytes,
            ..DeviceGrant::example(0, params)
        }
    }

    /// The same with a compute share under `policy`.
    fn share(uuid: &str, compute: u8, policy: Policy, class: PodClass) -> DeviceGrant {
        let mut g = grant(uuid, 1 << 30, class);
        g.compute_percent = compute;
        g.params.policy = policy;
        g
    }

    #[test]
    fn a_pod_gets_one_corun_gpu_alone_or_only_ordinary_ones() {
        let o = options();
        let check = |uuids: &[&'static str]| corun_gpu(Some(&o), uuids.iter().copied());
        assert_eq!(check(&["GPU-a"]), Ok(Some("GPU-a")));
        assert_eq!(check(&["GPU-a", "gpu-A"]), Ok(Some("GPU-a")));
        assert_eq!(check(&["GPU-b", "GPU-c"]), Ok(None));
        assert_eq!(check(&[]), Ok(None));
        for mixed in [["GPU-a", "GPU-b"], ["GPU-b", "GPU-a"]] {
            let error = check(&mixed).unwrap_err();
            assert_eq!(
                error,
                CorunConflict::Mixed {
                    corun: "GPU-a".into(),
                    ordinary: "GPU-b".into()
                }
            );
            assert!(
                error.to_string().contains("cannot go to one pod"),
                "{error}"
            );
        }
        let two = CorunOptions {
            gpus: vec!["GPU-a".into(), "GPU-b".into()],
            ..options()
        };
        let error = corun_gpu(Some(&two), ["GPU-a", "GPU-b"]).unwrap_err();
        assert!(matches!(error, CorunConflict::Several { .. }));
        assert!(
            error.to_string().contains("one CUDA_MPS_PIPE_DIRECTORY"),
            "{error}"
        );
        // No co-run GPU on the node: anything goes.
        assert_eq!(corun_gpu(None, ["GPU-a", "GPU-b"]), Ok(None));
    }

    #[test]
    fn the_client_edits_follow_the_pods_class_and_quota() {
        let o = options();
        let gpus = [gpu(3, "GPU-a")];
        // Two claims of the pod on the GPU add up; a grant elsewhere does not count.
        let batch = [
            grant("GPU-a", 3 << 30, PodClass::Batch),
            grant("GPU-a", (1 << 30) + 1, PodClass::Batch),
            grant("GPU-z", 7 << 30, PodClass::Batch),
        ];
        let edits = client(Some(&o), &gpus, &batch).unwrap().unwrap();
        assert_eq!(
            edits.host_pipe_dir,
            PathBuf::from("/var/lib/gpushare/mps/GPU-a/pipe")
        );
        // Daemon and clients share the host's /dev/shm...
        assert_eq!(edits.host_shm_dir, None);
        // ...unless the clients are containers: the GPU's folder then.
        let containers = CorunOptions {
            private_shm: true,
            ..options()
        };
        let edits_in_containers = client(Some(&containers), &gpus, &batch).unwrap().unwrap();
        assert_eq!(
            edits_in_containers.host_shm_dir,
            Some(PathBuf::from("/var/lib/gpushare/mps/GPU-a/shm"))
        );
        assert_eq!(
            edits.env,
            [
                "CUDA_MPS_PIPE_DIRECTORY=/var/run/gpushare/mps",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4097M",
                "CUDA_MPS_CLIENT_PRIORITY=1",
                "CUDA_LIMITER_MPS=required",
            ]
        );
        // Latency when any claim is: the reserve, normal priority.
        let latency = [
            grant("GPU-a", 2 << 30, PodClass::Batch),
            grant("GPU-a", 2 << 30, PodClass::Latency),
        ];
        let env = client(Some(&o), &gpus, &latency).unwrap().unwrap().env;
        assert!(env.contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25".to_owned()));
        assert!(env.contains(&"CUDA_MPS_CLIENT_PRIORITY=0".to_owned()));
        assert!(env.contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M".to_owned()));
        // A fixed compute share is a share of the SMs: the class's part
        // narrowed to it, two claims' shares added up.
        let percentage = |grants: &[DeviceGrant]| -> String {
            let env = client(Some(&o), &gpus, grants).unwrap().unwrap().env;
            env[1].clone()
        };
        let fixed = |compute, class| share("GPU-a", compute, Policy::Fixed, class);
        assert_eq!(
            percentage(&[fixed(30, PodClass::Latency)]),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30"
        );
        assert_eq!(
            percentage(&[fixed(30, PodClass::Batch), fixed(20, PodClass::Batch)]),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"
        );
        // A batch pod never gets the reserve, whatever its share.
        assert_eq!(
            percentage(&[fixed(90, PodClass::Batch)]),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75"
        );
        // An elastic share stays a time share: the class's part.
        let elastic = share("GPU-a", 30, Policy::Elastic, PodClass::Batch);
        assert_eq!(
            percentage(&[elastic]),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75"
        );
        // An ordinary GPU, or no co-run GPU on the node: nothing.
        assert_eq!(client(Some(&o), &[gpu(0, "GPU-b")], &batch), Ok(None));
        assert_eq!(client(None, &gpus, &batch), Ok(None));
        assert!(client(Some(&o), &[gpu(0, "GPU-a"), gpu(1, "GPU-b")], &batch).is_err());
    }

    /// A provisioner under a folder of its own, with GPUs `GPU-a` (co-run)
    /// and `GPU-b`, `GPU-c` (ordinary; `GPU-c` co-run too with `two`).
    fn provisioner(tag: &str, two: bool) -> (crate::Provisioner, PathBuf) {
        let dir = std::env::temp_dir().join(format!("mps-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut config = crate::ProvisionConfig::daemonset("http://127.0.0.1:1");
        config.state_dir = dir.join("state");
        config.host_state_dir = dir.join("state");
        config.cdi_dir = dir.join("cdi");
        config.host_root = dir.clone();
        let mut corun = options();
        if two {
            corun.gpus.push("GPU-c".into());
        }
        config.corun = Some(corun);
        let gpus = vec![gpu(0, "GPU-a"), gpu(1, "GPU-b"), gpu(2, "GPU-c")];
        let provisioner = crate::Provisioner::open(config, gpus).unwrap();
        (provisioner, dir)
    }

    fn claim(n: u8, uuids: &[&str]) -> ClaimRequest {
        ClaimRequest {
            claim_uid: format!("0b7c8a52-3f1e-4a7e-9c4e-2f6f1d2c3b4{n}"),
            namespace: "default".into(),
            name: format!("claim-{n}"),
            pod: crate::PodRef {
                uid: "1c8d9b63-4f2e-4b8f-8d5f-3a7e2e3d4c5b".into(),
                namespace: "default".into(),
                name: "pod".into(),
            },
            devices: uuids
                .iter()
                .map(|u| grant(u, 1 << 30, PodClass::Batch))
                .collect(),
        }
    }

    #[test]
    fn prepare_refuses_a_claim_or_pod_that_mixes_and_edits_a_client() {
        let (mut p, dir) = provisioner("mix", false);
        let refused = p.prepare(claim(1, &["GPU-a", "GPU-b"])).unwrap_err();
        assert!(
            matches!(&refused, ProvisionError::Corun { subject, conflict: CorunConflict::Mixed { .. } } if subject.starts_with("claim ")),
            "{refused}"
        );
        assert!(p.claims().is_empty());
        // One claim on the co-run GPU: an MPS client.
        p.prepare(claim(2, &["GPU-a"])).unwrap();
        let uid = claim(2, &[]).claim_uid;
        let edits = p.container_edits(&uid).unwrap();
        assert!(edits.env.contains(&"CUDA_LIMITER_MPS=required".to_owned()));
        assert!(
            edits
                .env
                .contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M".to_owned())
        );
        // A second claim of the pod on an ordinary GPU: refused, nothing kept.
        let refused = p.prepare(claim(3, &["GPU-b"])).unwrap_err();
        assert!(
            refused.to_string().contains("with its other claims"),
            "{refused}"
        );
        assert!(
            refused.to_string().contains("ordinary GPU GPU-b"),
            "{refused}"
        );
        assert_eq!(p.claims().len(), 1);
        // Another claim on the same co-run GPU adds to the fence.
        p.prepare(claim(4, &["GPU-a"])).unwrap();
        let edits = p.container_edits(&uid).unwrap();
        assert!(
            edits
                .env
                .contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M".to_owned()),
            "{:?}",
            edits.env
        );
        let _ = std::fs::remove_dir_all(dir);

        let (mut p, dir) = provisioner("two", true);
        p.prepare(claim(1, &["GPU-a"])).unwrap();
        let refused = p.prepare(claim(2, &["GPU-c"])).unwrap_err();
        assert!(
            matches!(
                refused,
                ProvisionError::Corun {
                    conflict: CorunConflict::Several { .. },
                    ..
                }
            ),
            "{refused}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
