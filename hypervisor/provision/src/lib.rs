//! Provisioning: what a pod needs on the node before its containers start,
//! shared by the DRA kubelet plugin and the device plugin.
//!
//! 1. **Prepare** a claim ([`Provisioner::prepare`]): the GPUs and the part
//!    of each that the claim was given are checked against what the other
//!    prepared claims hold; the pod gets a token (one per pod) and a pod
//!    file (`state_dir/pods/<uid>/gpushare-pod.json`: the pod, the daemon's
//!    address, the token; see [`gpushare_utils::pod_file`]), and the claim a
//!    CDI spec in `cdi_dir` ([`cdi`]) whose edits give the container the GPU
//!    device nodes, the limiter library with an `/etc/ld.so.preload` naming
//!    it and the pod file beside it, the pod's region (all read-only but the
//!    ledger), and the variables. The claim is recorded in the
//!    checkpoint ([`checkpoint`]) before the answer, so a restarted agent
//!    keeps it.
//! 2. **Limits**: [`Provisioner::pod_specs`] turns the prepared claims into
//!    the hypervisor's [`PodSpec`]s; the caller applies them, which creates the
//!    region (`/dev/shm/gpushare-pod-<uid>` of the agent, a host directory
//!    mounted there) and writes the quotas.
//! 3. **Unprepare** a claim, or **forget** a deleted pod: specs, token and
//!    region go; the checkpoint follows.
//!
//! The device plugin's claims are made here, one per container, from the
//! pod's resource names (the device plugin's allocator); their answer is the
//! same edits ([`Provisioner::container_edits`]) as env, mounts and devices.

mod capacity;
pub mod cdi;
pub mod checkpoint;
mod config;
mod error;
mod files;
mod grant;
pub mod mps;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use gpushare_utils::ledger::PodLedger;
use gpushare_utils::pod::PodId;

pub use config::ProvisionConfig;
pub use error::ProvisionError;
pub use files::new_uid;
pub(crate) use files::{io, write_file};
pub use grant::{ClaimRequest, DeviceGrant, PodRef, SharingParams};

use files::{random_token, remove_if_there};

use checkpoint::{Checkpoint, PreparedClaim};
use hypervisor_config::MemoryCapacity;
use hypervisor_core::spec::{GpuSelector, GpuSpec, PodSpec, Token};
use hypervisor_observer::GpuInfo;

/// Where the limiter library appears inside a container (read-only).
pub const CONTAINER_LIMITER: &str = "/usr/local/gpushare/lib/libcuda_limiter.so";
/// The container's preload file: the node's, naming [`CONTAINER_LIMITER`],
/// mounted read-only so that every dynamically linked process loads the
/// limiter.
pub const CONTAINER_PRELOAD: &str = "/etc/ld.so.preload";
/// Where the pod file appears inside a container (read-only): beside the
/// library, where the limiter looks for it ([`gpushare_utils::pod_file`]).
pub const CONTAINER_POD_FILE: &str = "/usr/local/gpushare/lib/gpushare-pod.json";
/// The container's shared-memory folder: the pod's region (read-write) and
/// limits (read-only) are mounted as files in it.
pub const CONTAINER_SHM: &str = "/dev/shm";
/// Where the hypervisor's socket folder appears inside a container.
pub const CONTAINER_SOCKET_DIR: &str = "/var/run/gpushare/hypervisor";

/// The node's prepared claims, their files and the checkpoint.
pub struct Provisioner {
    config: ProvisionConfig,
    gpus: Vec<GpuInfo>,
    /// What each GPU offers to quotas, all claims together.
    memory: MemoryCapacity,
    checkpoint: Checkpoint,
}

impl Provisioner {
    /// Loads the checkpoint (a missing one is empty) and writes the preload
    /// file; `gpus` are the node's GPUs, none of them overcommitting until
    /// [`Provisioner::set_memory_capacity`] says otherwise.
    pub fn open(config: ProvisionConfig, gpus: Vec<GpuInfo>) -> Result<Self, ProvisionError> {
        for dir in [&config.state_dir, &config.cdi_dir] {
            std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
        }
        let checkpoint = Checkpoint::load(&config.state_dir)?;
        let preload = config.preload_file();
        write_file(&preload, format!("{CONTAINER_LIMITER}\n").as_bytes(), 0o644)?;
        Ok(Self {
            config,
            gpus,
            memory: MemoryCapacity::default(),
            checkpoint,
        })
    }

    /// The settings it was opened with (folders, CDI kind, co-run GPUs).
    pub fn config(&self) -> &ProvisionConfig {
        &self.config
    }

    /// The node's GPUs.
    pub fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    /// Replaces the node's GPU list (seen again by the observer).
    pub fn set_gpus(&mut self, gpus: Vec<GpuInfo>) {
        self.gpus = gpus;
    }

    /// What each GPU offers to quotas from now on (the daemon's `[swap]`
    /// overcommit). Claims already prepared stay, even past a lower figure.
    pub fn set_memory_capacity(&mut self, memory: MemoryCapacity) {
        self.memory = memory;
    }

    /// The memory `gpu` offers to quotas, all claims together: its own, or
    /// more where it overcommits.
    pub fn memory_capacity(&self, gpu: &GpuInfo) -> u64 {
        self.memory.of(gpu.index, gpu.memory_total)
    }

    /// Prepares `request` (again: the same answer); returns the CDI device IDs.
    pub fn prepare(&mut self, request: ClaimRequest) -> Result<Vec<String>, ProvisionError> {
        if let Some(done) = self.checkpoint.claims.get(&request.claim_uid) {
            if done.request.pod.uid != request.pod.uid {
                return Err(ProvisionError::OtherPod {
                    claim: request.claim_uid.clone(),
                    prepared: done.request.pod.uid.clone(),
                    asked: request.pod.uid.clone(),
                });
            }
            return Ok(done.cdi_devices.clone());
        }
        request.validate()?;
        self.check_capacity(&request)?;
        let others = self
            .checkpoint
            .claims
            .values()
            .filter(|c| c.request.pod.uid == request.pod.uid)
            .flat_map(|c| &c.request.devices);
        mps::check_request(self.config.corun.as_ref(), &request, others)?;
        let token = match self.checkpoint.tokens.get(&request.pod.uid) {
            Some(token) => token.clone(),
            None => random_token()?,
        };
        let cdi_devices = vec![cdi::device_id(&self.config, &request.claim_uid)];
        let pod = request.pod.uid.clone();
        self.checkpoint.tokens.insert(pod.clone(), token);
        self.checkpoint.claims.insert(
            request.claim_uid.clone(),
            PreparedClaim {
                request: request.clone(),
                cdi_devices: cdi_devices.clone(),
            },
        );
        if let Err(error) = self
            .write_specs(&pod)
            .and_then(|()| self.checkpoint.save(&self.config.state_dir))
        {
            self.checkpoint.claims.remove(&request.claim_uid);
            let _ = remove_if_there(&self.spec_path(&request.claim_uid));
            // The pod's other claims name this one's GPUs by now: not any more.
            let _ = self.write_specs(&pod);
            return Err(error);
        }
        tracing::info!(claim = %request.claim_uid, pod = %request.pod, "claim prepared");
        Ok(cdi_devices)
    }

    /// Unprepares claim `uid` (unknown: nothing to do, `Ok(false)`). The
    /// pod's token and region go with its last claim.
    pub fn unprepare(&mut self, uid: &str) -> Result<bool, ProvisionError> {
        let Some(prepared) = self.checkpoint.claims.remove(uid) else {
            return Ok(false);
        };
        let pod = prepared.request.pod.uid.clone();
        let last = !self
            .checkpoint
            .claims
            .values()
            .any(|c| c.request.pod.uid == pod);
        if last {
            self.checkpoint.tokens.remove(&pod);
        }
        self.checkpoint.save(&self.config.state_dir)?;
        remove_if_there(&self.spec_path(uid))?;
        if last {
            self.remove_pod_files(&pod)?;
        } else {
            self.write_specs(&pod)?;
        }
        tracing::info!(claim = uid, pod, "claim unprepared");
        Ok(true)
    }

    /// Unprepares every claim of pod `uid` (deleted); returns what they
    /// were.
    pub fn forget_pod(&mut self, uid: &str) -> Result<Vec<ClaimRequest>, ProvisionError> {
        let claims: Vec<ClaimRequest> = self
            .checkpoint
            .claims
            .values()
            .filter(|c| c.request.pod.uid == uid)
            .map(|c| c.request.clone())
            .collect();
        for claim in &claims {
            self.unprepare(&claim.claim_uid)?;
        }
        Ok(claims)
    }

    /// The pods with prepared claims, by UID.
    pub fn pods(&self) -> BTreeSet<String> {
        self.checkpoint
            .claims
            .values()
            .map(|c| c.request.pod.uid.clone())
            .collect()
    }

    /// Prepared claims, by claim UID.
    pub fn claims(&self) -> &BTreeMap<String, PreparedClaim> {
        &self.checkpoint.claims
    }

    /// The pod file of pod `uid` as the agent sees it: what its containers'
    /// limiters are told (pod, daemon, token), mounted read-only.
    pub fn pod_file(&self, uid: &str) -> PathBuf {
        self.config
            .state_dir
            .join("pods")
            .join(uid)
            .join(gpushare_utils::pod_file::FILE_NAME)
    }

    /// The region of pod `uid` as the agent sees it.
    pub fn region_file(&self, uid: &str) -> PathBuf {
        self.config.region_dir.join(PodLedger::name_of(uid))
    }

    /// The hypervisor's pods: one per pod with prepared claims, its GPUs in
    /// NVML index order (the CUDA ordinals its containers see), the parts
    /// of several claims on one GPU added up.
    pub fn pod_specs(&self) -> Result<Vec<PodSpec>, ProvisionError> {
        let mut specs = Vec::new();
        for pod in self.pods() {
            let mut per_gpu: BTreeMap<u32, (String, grant::Totals)> = BTreeMap::new();
            for claim in self.checkpoint.claims.values() {
                if claim.request.pod.uid != pod {
                    continue;
                }
                for device in &claim.request.devices {
                    per_gpu
                        .entry(device.gpu_index)
                        .or_insert_with(|| (device.gpu_uuid.clone(), grant::Totals::default()))
                        .1
                        .add(device);
                }
            }
            let spec_err = |source| ProvisionError::Spec {
                pod: pod.clone(),
                source,
            };
            let mut gpus = Vec::with_capacity(per_gpu.len());
            for (uuid, totals) in per_gpu.values() {
                let corun = self.config.corun.as_ref().is_some_and(|c| c.covers(uuid));
                let (cap, share, policy) = if corun {
                    totals.compute_on_corun()
                } else {
                    totals.compute()
                };
                let gpu = GpuSpec::new(
                    GpuSelector::uuid(uuid).map_err(spec_err)?,
                    totals.memory_bytes,
                    totals.weight.max(1),
                    cap,
                    share,
                    Some(policy),
                )
                .map_err(spec_err)?
                .with_class(totals.class)
                .with_spill(totals.spill_bytes)
                .with_sm_share(totals.sm_share().filter(|_| corun));
                gpus.push(gpu);
            }
            let token = self.token_of(&pod)?;
            let id = PodId::new(pod.clone()).map_err(|e| spec_err(e.into()))?;
            let token = Token::new(token).map_err(spec_err)?;
            specs.push(PodSpec::new(id, token, gpus).map_err(spec_err)?);
        }
        Ok(specs)
    }

    fn gpu(&self, uuid: &str) -> Result<&GpuInfo, ProvisionError> {
        self.gpus
            .iter()
            .find(|g| g.uuid == uuid)
            .ok_or_else(|| ProvisionError::NoSuchGpu(uuid.to_owned()))
    }

    /// What prepared claim `uid` gives a container (its CDI spec's edits):
    /// the device plugin answers the kubelet with these.
    pub fn container_edits(&self, uid: &str) -> Result<cdi::ContainerEdits, ProvisionError> {
        let not_prepared = || ProvisionError::Invalid {
            claim: uid.to_owned(),
            message: "not prepared".to_owned(),
        };
        let claim = self.checkpoint.claims.get(uid).ok_or_else(not_prepared)?;
        let spec = self.claim_spec(&claim.request, false)?;
        spec.devices
            .into_iter()
            .next()
            .map(|d| d.container_edits)
            .ok_or_else(not_prepared)
    }

    /// The GPUs of `devices`, each once, in NVML index order.
    fn gpus_of<'a>(
        &self,
        devices: impl IntoIterator<Item = &'a DeviceGrant>,
    ) -> Result<Vec<GpuInfo>, ProvisionError> {
        let mut gpus = Vec::new();
        for device in devices {
            let gpu = self.gpu(&device.gpu_uuid)?;
            if !gpus.iter().any(|g: &GpuInfo| g.uuid == gpu.uuid) {
                gpus.push(gpu.clone());
            }
        }
        gpus.sort_by_key(|g| g.index);
        Ok(gpus)
    }

    /// The CDI spec of prepared claim `request`. With `pod_wide`, the GPUs
    /// of every claim of its pod: a container that uses two claims gets both
    /// specs' variables, the later replacing the earlier, so each spec must
    /// name all of them (the DRA kubelet prepares all the claims of a pod
    /// before its containers start). The device plugin's claims are one per
    /// container and give only their own.
    fn claim_spec(
        &self,
        request: &ClaimRequest,
        pod_wide: bool,
    ) -> Result<cdi::Spec, ProvisionError> {
        let pod = &request.pod.uid;
        let gpus = if pod_wide {
            self.gpus_of(
                self.checkpoint
                    .claims
                    .values()
                    .filter(|c| c.request.pod.uid == *pod)
                    .flat_map(|c| &c.request.devices)
                    .chain(&request.devices),
            )?
        } else {
            self.gpus_of(&request.devices)?
        };
        // The pod's grants (this claim's once, prepared or not) set its
        // MPS client's class and memory fence on a co-run GPU.
        let pod_devices = self
            .checkpoint
            .claims
            .values()
            .filter(|c| c.request.pod.uid == *pod && c.request.claim_uid != request.claim_uid)
            .flat_map(|c| &c.request.devices)
            .chain(&request.devices);
        let client =
            mps::client(self.config.corun.as_ref(), &gpus, pod_devices).map_err(|conflict| {
                ProvisionError::Corun {
                    subject: format!("pod {}", request.pod),
                    conflict,
                }
            })?;
        let pod_file = self.pod_file(pod);
        cdi::claim_spec(&self.config, request, &gpus, &pod_file, client.as_ref())
    }

    /// (Re)writes the pod file and the CDI specs of every prepared claim of
    /// pod `pod`.
    fn write_specs(&self, pod: &str) -> Result<(), ProvisionError> {
        self.write_pod_file(pod)?;
        for claim in self.checkpoint.claims.values() {
            if claim.request.pod.uid != pod {
                continue;
            }
            let spec = self.claim_spec(&claim.request, true)?;
            let json = serde_json::to_vec_pretty(&spec).map_err(|e| ProvisionError::Invalid {
                claim: claim.request.claim_uid.clone(),
                message: e.to_string(),
            })?;
            write_file(&self.spec_path(&claim.request.claim_uid), &json, 0o644)?;
        }
        Ok(())
    }

    fn spec_path(&self, claim_uid: &str) -> PathBuf {
        self.config
            .cdi_dir
            .join(cdi::spec_file_name(&self.config, claim_uid))
    }

    /// The token of pod `pod`, which has prepared claims.
    fn token_of(&self, pod: &str) -> Result<&String, ProvisionError> {
        self.checkpoint
            .tokens
            .get(pod)
            .ok_or_else(|| ProvisionError::Checkpoint {
                path: self.config.state_dir.clone(),
                message: format!("pod {pod} has claims but no token"),
            })
    }

    /// Writes what pod `pod`'s limiters are told: its id, the daemon's
    /// address, its token, who owns its limits, and whether it runs as an MPS
    /// client (any of its GPUs in co-run mode).
    fn write_pod_file(&self, pod: &str) -> Result<(), ProvisionError> {
        let token = self.token_of(pod)?;
        let mps_required = self.config.corun.as_ref().is_some_and(|corun| {
            self.checkpoint
                .claims
                .values()
                .filter(|c| c.request.pod.uid == pod)
                .flat_map(|c| &c.request.devices)
                .any(|device| corun.covers(&device.gpu_uuid))
        });
        let file = gpushare_utils::pod_file::PodFile {
            version: gpushare_utils::pod_file::VERSION,
            pod: pod.to_owned(),
            hypervisor: self.config.hypervisor_url.clone(),
            token: token.clone(),
            // The limits objects are this daemon's: root's, or its own uid's.
            limits_owner: Some(gpushare_utils::shm::effective_uid()).filter(|&uid| uid != 0),
            mps_required,
            node_tables: self.config.node_tables.clone(),
        };
        let path = self.pod_file(pod);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
        }
        // Read-only to everyone: the pod's processes run as any user and see
        // it through a read-only mount; no other pod mounts it. The limiter
        // trusts it only as root's (the daemon's) file.
        write_file(&path, file.to_json().as_bytes(), 0o444)
    }

    fn remove_pod_files(&self, pod: &str) -> Result<(), ProvisionError> {
        let dir = self.config.state_dir.join("pods").join(pod);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io("cannot remove", &dir))?;
        }
        remove_if_there(&self.region_file(pod))?;
        if let Some(corun) = self.config.corun.as_ref().filter(|c| c.private_shm) {
            files::remove_mount_points(corun, pod)?;
        }
        // The limits object the hypervisor published for the pod (in the
        // agent's shared memory, which a DaemonSet mounts as `region_dir`).
        let limits = gpushare_utils::limits::PodLimits::name_of(pod);
        match gpushare_utils::shm::unlink(&limits) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(io(
                "cannot remove",
                &PathBuf::from(format!("/dev/shm/{limits}")),
            )(error)),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
