//! Co-run GPUs end to end on the official control plane: the real agent, on
//! a token of the shipped ServiceAccount, publishes its slice with the first
//! of its two GPUs in co-run mode; claims pinned to a GPU by a CEL selector
//! on the device's `index` are allocated by the real scheduler, and the
//! kubelet double prepares them over the plugin's sockets before it reports
//! the pod running. A claim on a co-run GPU is provisioned as an MPS client
//! of the GPU's daemon. A claim or pod that would mix the co-run GPU with
//! another is allocated all the same (the scheduler does not know the rule)
//! and refused by the agent at prepare: the kubelet leaves the pod pending,
//! with a warning event that says why. The device plugin, on the same
//! cluster, is called by the device-plugin kubelet double. No MPS daemon
//! runs: these tests look at what the containers get.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpushare_utils::limits::PodLimits;
use gpushare_utils::shm::Trust;
use hypervisor_corun::{self as corun, CorunOptions};
use hypervisor_observer::{GpuObserver, SimulatedGpus};
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, DeleteParams};
use kube_fakes::cluster;
use kube_fakes::cluster_node::{self, ClusterNode};
use kube_fakes::device_kubelet::FakeDeviceKubelet;
use kube_fakes::kubelet::Version;
use kube_fakes::tenant::Tenant;
use serde_json::{Value, json};

use system_tests::scratch::Scratch;
use system_tests::wait::eventually_async;

use super::{DRIVER, device_plugin_kubelet, pod_status, runtime, spec_path, tenant};

const PIPE: &str = "/var/run/gpushare/mps";

/// Fields drop in order: the node, the device plugin's kubelet, the tenant
/// (its namespace and Node), then the scratch folder.
struct World {
    node: Option<ClusterNode>,
    /// The device plugin's kubelet, when the world runs the plugin.
    device_kubelet: Option<FakeDeviceKubelet>,
    tenant: Tenant,
    gpus: Arc<SimulatedGpus>,
    scratch: Scratch,
}

impl World {
    /// A node with two GPUs, the first in co-run mode (20% kept for latency
    /// pods); with `device_plugin`, the device plugin runs too, with the
    /// rights `deploy/device-plugin` adds.
    async fn start(tag: &str, device_plugin: bool) -> Self {
        let scratch = Scratch::with_limiter(&format!("corun-{tag}"));
        let dir = &scratch.dir;
        let tenant = tenant(&format!("corun-{tag}")).await;
        let gpus = Arc::new(SimulatedGpus::new(2));
        let mut options = tenant.options(dir, DRIVER, &scratch.limiter());
        options.check_identity = false;
        options.provision.corun = Some(CorunOptions {
            gpus: vec![gpus.gpus().unwrap()[0].uuid.clone()],
            dir: dir.join("mps"),
            host_dir: dir.join("host-mps"),
            latency_reserve: corun::DEFAULT_LATENCY_RESERVE,
            control: corun::DEFAULT_MPS_CONTROL.into(),
            // Pods are containers: each daemon's /dev/shm is its own.
            private_shm: true,
        });
        let mut device_kubelet = None;
        if device_plugin {
            let (config, double) = device_plugin_kubelet(&dir.join("kubelet-dp"), 4, false);
            device_kubelet = Some(double);
            options.device_plugin = Some(config);
        }
        let observer: Arc<dyn GpuObserver> = gpus.clone();
        let node = tenant.start_node(observer, options, None).await.unwrap();
        Self {
            node: Some(node),
            device_kubelet,
            tenant,
            gpus,
            scratch,
        }
    }

    fn node(&self) -> &ClusterNode {
        self.node.as_ref().unwrap()
    }

    fn dir(&self) -> &Path {
        &self.scratch.dir
    }

    fn uuid(&self, index: usize) -> String {
        self.gpus.gpus().unwrap()[index].uuid.clone()
    }

    fn spec_path(&self, claim_uid: &str) -> PathBuf {
        spec_path(self.dir(), claim_uid)
    }

    /// Creates claim `name` asking `count` GPUs with `memory`/`compute`
    /// each (on GPU `device` alone when given: a CEL selector on its index)
    /// and `parameters`; returns its UID.
    async fn create_claim(
        &self,
        name: &str,
        count: usize,
        (memory, compute): (&str, &str),
        device: Option<&str>,
        parameters: Option<Value>,
    ) -> String {
        let index = device.map(|d| d.trim_start_matches("gpu-").parse().unwrap());
        let object = cluster_node::claim(name, DRIVER, count, (memory, compute), index, parameters);
        let claim = self.tenant.create_claim(object).await.unwrap();
        claim.metadata.uid.unwrap()
    }

    /// Creates pod `name` on the node whose container uses `claims`; the
    /// scheduler allocates them and binds it. Returns its UID.
    async fn create_pod(&self, name: &str, claims: &[&str]) -> String {
        let pod = self.tenant.create_pod(name, claims).await.unwrap();
        let uid = pod.metadata.uid.unwrap();
        self.scratch.track_pod(&uid);
        uid
    }

    /// Pod `name` with a claim of its own for `memory`, compute 30 and
    /// `parameters`, allocated by the scheduler on `device`, running;
    /// returns (pod UID, claim UID).
    async fn claim(
        &self,
        name: &str,
        memory: &str,
        parameters: Value,
        device: &str,
    ) -> (String, String) {
        let claim = format!("{name}-gpu");
        let uid = self
            .create_claim(&claim, 1, (memory, "30"), Some(device), Some(parameters))
            .await;
        let pod = self.create_pod(name, &[&claim]).await;
        let kubelet = &self.node().kubelet;
        eventually_async(&format!("pod {name} started"), || kubelet.started(&pod)).await;
        (pod, uid)
    }

    /// The kubelet's `NodePrepareResources` for claim `name` (UID `uid`),
    /// again; its error text.
    async fn prepare(&self, name: &str, uid: &str) -> String {
        let node = &self.node().node;
        let prepared = node
            .kubelet
            .prepare(Version::V1, self.tenant.namespace(), name, uid)
            .await
            .unwrap();
        prepared.error
    }

    /// Deletes pod `name` as a user does, and waits until the kubelet
    /// unprepared `claims` (UIDs), as it does before it confirms.
    async fn delete_pod(&self, name: &str, claims: &[&str]) {
        self.tenant.delete_pod(name).await.unwrap();
        let kubelet = &self.node().kubelet;
        eventually_async(&format!("the claims of pod {name} unprepared"), || {
            let unprepared = kubelet.unprepared();
            claims.iter().all(|c| unprepared.iter().any(|u| u == c))
        })
        .await;
    }

    /// The message of pod `name`'s `FailedPrepareDynamicResources`
    /// warning, once the kubelet reported its refusal; checks that it left
    /// the pod pending.
    async fn refused(&self, name: &str) -> String {
        let events = Api::<Event>::default_namespaced(self.tenant.client.clone());
        let pods = Api::<Pod>::default_namespaced(self.tenant.client.clone());
        let kubelet = &self.node().kubelet;
        let event_name = format!("{name}.failedpreparedynamicresources");
        let mut found = None;
        for _ in 0..900 {
            found = events.get_opt(&event_name).await.unwrap();
            if found.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if found.is_none() {
            let pod = pods.get(name).await.unwrap();
            let error = kubelet.last_error();
            panic!(
                "no refusal reported for pod {name}: {pod:?}; the kubelet's last error: {error:?}"
            );
        }
        // Refused again on its later passes: the one event says so, and the
        // kubelet's passes go on without an error of their own.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let event = events.get(&event_name).await.unwrap();
        let pod = pods.get(name).await.unwrap();
        let uid = pod.metadata.uid.unwrap();
        assert_eq!(kubelet.refused(&uid), event.message, "{event:?}");
        assert_eq!(kubelet.last_error(), None);
        assert!(!kubelet.started(&uid), "pod {name} started");
        let phase = pod.status.and_then(|s| s.phase);
        assert_eq!(phase.as_deref(), Some("Pending"), "pod {name}");
        assert_eq!(event.type_.as_deref(), Some("Warning"), "{event:?}");
        assert_eq!(event.involved_object.uid, Some(uid), "{event:?}");
        event.message.unwrap_or_default()
    }

    /// Deletes refused pod `name` and waits until it is gone (the kubelet
    /// unprepares the claims it prepared for it). Left there, it
    /// is retried at each of the kubelet's syncs, and while its refusal
    /// cannot be reported (see [`World::refused`]) that sync stops at it,
    /// before the pods listed after it.
    async fn delete_refused(&self, name: &str) {
        let pods = Api::<Pod>::default_namespaced(self.tenant.client.clone());
        pods.delete(name, &DeleteParams::default()).await.unwrap();
        for _ in 0..900 {
            if pods.get_opt(name).await.unwrap().is_none() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("pod {name} not deleted");
    }

    async fn stop(mut self) {
        if let Some(node) = self.node.take() {
            node.stop().await;
        }
    }
}

/// A mount of a CDI spec: host path, container path, options.
type Mount = (String, String, Vec<String>);

/// The env and the mounts of a CDI spec.
fn edits(path: &Path) -> (Vec<String>, Vec<Mount>) {
    let raw: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let edits = &raw["devices"][0]["containerEdits"];
    let env = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    let mounts = edits["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let options = m["options"].as_array().unwrap().iter();
            (
                m["hostPath"].as_str().unwrap().to_owned(),
                m["containerPath"].as_str().unwrap().to_owned(),
                options.map(|o| o.as_str().unwrap().to_owned()).collect(),
            )
        })
        .collect();
    (env, mounts)
}

fn mps_variables(env: &[String]) -> Vec<&str> {
    env.iter()
        .map(String::as_str)
        .filter(|e| e.starts_with("CUDA_MPS_") || e.starts_with("CUDA_LIMITER_MPS"))
        .collect()
}

#[test]
fn a_claim_on_a_corun_gpu_makes_an_mps_client_and_one_elsewhere_does_not() {
    runtime().block_on(async {
        let world = World::start("client", false).await;
        let gpu0 = world.uuid(0);
        let pipe = world.dir().join("host-mps").join(&gpu0).join("pipe");
        let shm = world.dir().join("host-mps").join(&gpu0).join("shm");
        let cases = [
            // (pod, memory, parameters, device, the MPS variables)
            (
                "latency",
                "4Gi",
                json!({"class": "latency"}),
                "gpu-0",
                vec![
                    format!("CUDA_MPS_PIPE_DIRECTORY={PIPE}"),
                    // The claim's fixed compute share, of the SMs here.
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30".to_owned(),
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M".to_owned(),
                    "CUDA_MPS_CLIENT_PRIORITY=0".to_owned(),
                    "CUDA_LIMITER_MPS=required".to_owned(),
                ],
            ),
            (
                "batch",
                "2Gi",
                // An elastic share stays a time share (weights): the SMs
                // are the class's part.
                json!({"weight": 2, "policy": "elastic"}),
                "gpu-0",
                vec![
                    format!("CUDA_MPS_PIPE_DIRECTORY={PIPE}"),
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=80".to_owned(),
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M".to_owned(),
                    "CUDA_MPS_CLIENT_PRIORITY=1".to_owned(),
                    "CUDA_LIMITER_MPS=required".to_owned(),
                ],
            ),
            ("plain", "2Gi", json!({}), "gpu-1", vec![]),
        ];
        for (name, memory, parameters, device, want) in cases {
            let (pod, uid) = world.claim(name, memory, parameters, device).await;
            assert_eq!(
                world.prepare(&format!("{name}-gpu"), &uid).await,
                "",
                "{name}"
            );
            // The spec stays valid CDI.
            let path = world.spec_path(&uid);
            let mut spec = container_device_interface::spec::read_spec(&path, 0).unwrap();
            spec.validate().unwrap();
            let (env, mounts) = edits(&path);
            assert_eq!(mps_variables(&env), want, "{name}");
            // The pod file says the pod, and that it runs as an MPS client
            // where a GPU of its is in co-run mode.
            let pod_file = mounts
                .iter()
                .find(|m| m.1 == "/usr/local/gpushare/lib/gpushare-pod.json")
                .map(|m| {
                    let text = std::fs::read(&m.0).unwrap();
                    serde_json::from_slice::<gpushare_utils::pod_file::PodFile>(&text).unwrap()
                })
                .expect("the pod file is mounted");
            assert_eq!(pod_file.pod, pod, "{name}");
            assert_eq!(pod_file.mps_required, !want.is_empty(), "{name}");
            // The hypervisor's time cap: none where the fixed share went to
            // the SMs (co-run), the elastic share's ceiling (a time share
            // still), the fixed share itself on the ordinary GPU.
            let cap = pod_status(&world.node().node.hv, &pod)
                .map(|p| p["gpus"][0]["cap_percent"].clone());
            let want_cap = match name {
                "latency" => json!(null),
                "batch" => json!(100),
                _ => json!(30),
            };
            assert_eq!(cap, Some(want_cap), "{name}");
            let pipe_mount = mounts.iter().find(|m| m.1 == PIPE);
            let shm_mount = mounts.iter().find(|m| m.1 == "/dev/shm");
            if want.is_empty() {
                assert!(pipe_mount.is_none(), "{name}: {mounts:?}");
                assert!(shm_mount.is_none(), "{name}: {mounts:?}");
            } else {
                let (host, _, options) = pipe_mount.expect("the pipe folder is mounted");
                assert_eq!(Path::new(host), pipe, "{name}");
                assert!(options.contains(&"rw".to_owned()), "{name}: {options:?}");
                let (host, _, options) = shm_mount.expect("the daemon's /dev/shm is mounted");
                assert_eq!(Path::new(host), shm, "{name}");
                assert!(options.contains(&"rw".to_owned()), "{name}: {options:?}");
            }
        }
        world.stop().await;
    });
}

#[test]
fn unprepare_removes_the_mount_points_a_runtime_left_in_the_gpus_folder() {
    runtime().block_on(async {
        let world = World::start("mount-points", false).await;
        let gpu0 = world.uuid(0);
        let (_, uid) = world.claim("batch", "2Gi", json!({}), "gpu-0").await;
        assert_eq!(world.prepare("batch-gpu", &uid).await, "");
        // What a container runtime leaves in the GPU's folder (the
        // container's /dev/shm): an empty file for each file mounted under
        // it, the pod's region and limits.
        let folder = world.dir().join("mps").join(&gpu0).join("shm");
        std::fs::create_dir_all(&folder).unwrap();
        let (_, mounts) = edits(&world.spec_path(&uid));
        let points: Vec<PathBuf> = mounts
            .iter()
            .filter_map(|(_, inside, _)| inside.strip_prefix("/dev/shm/"))
            .map(|name| folder.join(name))
            .collect();
        assert_eq!(points.len(), 2, "{mounts:?}");
        for point in &points {
            std::fs::write(point, b"").unwrap();
        }
        // Another pod's, and an MPS client's own shared memory, stay.
        let others = [
            folder.join("gpushare-pod-another"),
            folder.join("cuda.shm.0"),
        ];
        for other in &others {
            std::fs::write(other, b"").unwrap();
        }
        // The pod deleted, the kubelet unprepares its claim.
        world.delete_pod("batch", &[&uid]).await;
        for point in &points {
            assert!(!point.exists(), "{} left", point.display());
        }
        for other in &others {
            assert!(other.exists(), "{} removed", other.display());
        }
        world.stop().await;
    });
}

/// The share of the SMs pod `pod`'s limits give its next MPS client, once
/// the scheduler's ticks have written `want` (`None`: none given).
fn sm_percent_becomes(pod: &str, want: Option<u8>) -> Option<u8> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let limits = PodLimits::open_read_only(pod, &Trust::own_or_root(None)).unwrap();
        let seen = limits.sm_percent();
        if seen == want || std::time::Instant::now() > deadline {
            return seen;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The `sm_percent` the status shows for pod `pod`'s first GPU.
fn sm_percent_shown(world: &World, pod: &str) -> Value {
    pod_status(&world.node().node.hv, pod)
        .map(|p| p["gpus"][0]["sm_percent"].clone())
        .unwrap_or_else(|| panic!("no pod {pod}"))
}

#[test]
fn a_pods_next_client_takes_the_whole_gpu_until_a_pod_of_the_other_class_shares_it() {
    runtime().block_on(async {
        let world = World::start("share", false).await;
        // An elastic batch pod: a time share, so no fixed share of the SMs.
        let (batch, batch_uid) = world
            .claim("batch", "2Gi", json!({"policy": "elastic"}), "gpu-0")
            .await;
        assert_eq!(world.prepare("batch-gpu", &batch_uid).await, "");
        // Alone on the co-run GPU: all of it.
        assert_eq!(sm_percent_becomes(&batch, Some(100)), Some(100));
        // A latency pod (its fixed compute share of 30, of the SMs here)
        // comes: a batch client that starts now leaves the reserve.
        let (latency, latency_uid) = world
            .claim("latency", "2Gi", json!({"class": "latency"}), "gpu-0")
            .await;
        assert_eq!(world.prepare("latency-gpu", &latency_uid).await, "");
        assert_eq!(sm_percent_becomes(&batch, Some(80)), Some(80));
        assert_eq!(sm_percent_becomes(&latency, Some(30)), Some(30));
        // The status says so.
        assert_eq!(sm_percent_shown(&world, &batch), json!(80));
        assert_eq!(sm_percent_shown(&world, &latency), json!(30));
        // A pod on the ordinary GPU is given none.
        let (plain, plain_uid) = world.claim("plain", "2Gi", json!({}), "gpu-1").await;
        assert_eq!(world.prepare("plain-gpu", &plain_uid).await, "");
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(sm_percent_becomes(&plain, None), None);
        assert_eq!(sm_percent_shown(&world, &plain), json!(null));
        // A latency pod with no fixed share (elastic: a time share) keeps
        // to the reserve beside the batch pod.
        let (elastic, elastic_uid) = world
            .claim(
                "elastic",
                "2Gi",
                json!({"class": "latency", "policy": "elastic"}),
                "gpu-0",
            )
            .await;
        assert_eq!(world.prepare("elastic-gpu", &elastic_uid).await, "");
        assert_eq!(sm_percent_becomes(&elastic, Some(20)), Some(20));
        // The latency pods gone (their claims unprepared by the kubelet),
        // the whole GPU again.
        world.delete_pod("latency", &[&latency_uid]).await;
        world.delete_pod("elastic", &[&elastic_uid]).await;
        assert_eq!(sm_percent_becomes(&batch, Some(100)), Some(100));
        world.stop().await;
    });
}

#[test]
fn a_claim_or_pod_mixing_a_corun_gpu_with_another_is_refused() {
    runtime().block_on(async {
        let world = World::start("mix", false).await;
        let (gpu0, gpu1) = (world.uuid(0), world.uuid(1));
        // One claim of two GPUs: the scheduler gives it both (it does not
        // know the rule), the agent refuses it at prepare and the pod stays
        // pending.
        let uid = world
            .create_claim("wide-gpus", 2, ("1Gi", "10"), None, None)
            .await;
        world.create_pod("wide", &["wide-gpus"]).await;
        let mixed = format!("co-run GPU {gpu0} and ordinary GPU {gpu1} cannot go to one pod");
        let reported = world.refused("wide").await;
        assert!(reported.contains(&mixed), "{reported}");
        // The kubelet asking again gets the same refusal.
        let error = world.prepare("wide-gpus", &uid).await;
        assert!(error.contains(&format!("claim {uid}")), "{error}");
        assert!(error.contains(&mixed), "{error}");
        assert!(!world.spec_path(&uid).exists());
        world.delete_refused("wide").await;

        // Two claims of one pod, one on each GPU: the kubelet prepares the
        // first, the second is refused; the first stays an MPS client of
        // its GPU alone.
        let a = world
            .create_claim("pair-a", 1, ("1Gi", "10"), Some("gpu-0"), None)
            .await;
        let b = world
            .create_claim("pair-b", 1, ("1Gi", "10"), Some("gpu-1"), None)
            .await;
        world.create_pod("pair", &["pair-a", "pair-b"]).await;
        let reported = world.refused("pair").await;
        assert!(reported.contains("(with its other claims)"), "{reported}");
        assert!(reported.contains("cannot go to one pod"), "{reported}");
        let prepared = world.node().kubelet.prepared();
        assert!(prepared.iter().any(|c| c.uid == a), "{prepared:?}");
        assert!(!prepared.iter().any(|c| c.uid == b), "{prepared:?}");
        assert_eq!(world.prepare("pair-a", &a).await, "");
        let error = world.prepare("pair-b", &b).await;
        assert!(error.contains("(with its other claims)"), "{error}");
        assert!(error.contains("cannot go to one pod"), "{error}");
        assert!(!world.spec_path(&b).exists());
        let (env, _) = edits(&world.spec_path(&a));
        assert!(
            env.contains(&format!("CUDA_VISIBLE_DEVICES={gpu0}")),
            "{env:?}"
        );
        assert!(env.contains(&"CUDA_LIMITER_MPS=required".to_owned()));
        world.delete_refused("pair").await;

        // The other order: ordinary first, then the co-run GPU.
        let a = world
            .create_claim("rev-a", 1, ("1Gi", "10"), Some("gpu-1"), None)
            .await;
        let b = world
            .create_claim("rev-b", 1, ("1Gi", "10"), Some("gpu-0"), None)
            .await;
        world.create_pod("rev", &["rev-a", "rev-b"]).await;
        let reported = world.refused("rev").await;
        assert!(reported.contains("cannot go to one pod"), "{reported}");
        let prepared = world.node().kubelet.prepared();
        assert!(prepared.iter().any(|c| c.uid == a), "{prepared:?}");
        assert!(!prepared.iter().any(|c| c.uid == b), "{prepared:?}");
        assert_eq!(world.prepare("rev-a", &a).await, "");
        let error = world.prepare("rev-b", &b).await;
        assert!(error.contains("cannot go to one pod"), "{error}");
        assert!(!world.spec_path(&b).exists());
        world.stop().await;
    });
}
#[test]
fn the_device_plugin_answers_a_corun_gpus_container_as_an_mps_client() {
    runtime().block_on(async {
        let world = World::start("dp", true).await;
        let gpu0 = world.uuid(0);
        let ns = world.tenant.namespace();
        let kubelet = world.device_kubelet.as_ref().unwrap();
        let plugin = kubelet
            .plugin("nvidia.com/gpu", Duration::from_secs(10))
            .await
            .unwrap();
        // Each pod is bound by name, as HAMi's scheduler binds: the kubelet
        // double advertises no nvidia.com/gpu, so the default scheduler
        // would find no room for it.
        let pod = cluster::create_gpu_pod(
            &world.tenant.client,
            ns,
            "hami",
            world.tenant.node(),
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3072", "nvidia.com/gpucores": "30"}),
            json!({}),
        )
        .await
        .unwrap();
        kubelet.admit(ns, "hami", &["main"]);
        world.scratch.track_pod(&pod.metadata.uid.unwrap());
        // Binpack puts the first pod on GPU 0, the co-run one.
        let answer = plugin
            .start_container((ns, "hami", "main"), vec![format!("{gpu0}::0")])
            .await
            .unwrap();
        let env = &answer.envs;
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], gpu0);
        assert_eq!(env["CUDA_MPS_PIPE_DIRECTORY"], PIPE);
        // nvidia.com/gpucores 30: a share of the SMs on a co-run GPU.
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "30");
        assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=3072M");
        assert_eq!(env["CUDA_MPS_CLIENT_PRIORITY"], "1");
        assert_eq!(env["CUDA_LIMITER_MPS"], "required");
        let pipe = world.dir().join("host-mps").join(&gpu0).join("pipe");
        let mount = answer
            .mounts
            .iter()
            .find(|m| m.container_path == PIPE)
            .expect("the pipe folder is mounted");
        assert_eq!(Path::new(&mount.host_path), pipe);
        assert!(!mount.read_only);
        let shm = answer
            .mounts
            .iter()
            .find(|m| m.container_path == "/dev/shm")
            .expect("the daemon's /dev/shm is mounted");
        assert_eq!(
            Path::new(&shm.host_path),
            world.dir().join("host-mps").join(&gpu0).join("shm")
        );
        assert!(!shm.read_only);

        // A pod that wants no co-run GPU gets the ordinary one, no MPS.
        let gpu1 = world.uuid(1);
        let pod = cluster::create_gpu_pod(
            &world.tenant.client,
            ns,
            "solo",
            world.tenant.node(),
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3072"}),
            json!({"gpushare.dev/corun": "false"}),
        )
        .await
        .unwrap();
        kubelet.admit(ns, "solo", &["main"]);
        world.scratch.track_pod(&pod.metadata.uid.unwrap());
        let answer = plugin
            .start_container((ns, "solo", "main"), vec![format!("{gpu0}::1")])
            .await
            .unwrap();
        assert_eq!(answer.envs["CUDA_VISIBLE_DEVICES"], gpu1);
        assert!(!answer.envs.contains_key("CUDA_MPS_PIPE_DIRECTORY"));

        // Two GPUs for one container: never the co-run one, so none here.
        let pod = cluster::create_gpu_pod(
            &world.tenant.client,
            ns,
            "pair",
            world.tenant.node(),
            json!({"nvidia.com/gpu": "2", "nvidia.com/gpumem": "1024"}),
            json!({}),
        )
        .await
        .unwrap();
        kubelet.admit(ns, "pair", &["main"]);
        world.scratch.track_pod(&pod.metadata.uid.unwrap());
        let refused = plugin
            .start_container(
                (ns, "pair", "main"),
                vec![format!("{gpu0}::2"), format!("{gpu1}::2")],
            )
            .await
            .unwrap_err();
        assert!(
            refused.to_string().contains("an MPS client sees one GPU alone"),
            "{refused}"
        );
        world.stop().await;
    });
}
