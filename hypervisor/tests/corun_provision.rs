//! Co-run GPUs end to end without a cluster: the real agent against the fake
//! API server, called by the fake kubelets (DRA and device plugin). A claim
//! on a co-run GPU is provisioned as an MPS client of the GPU's daemon; a
//! pod that would mix co-run and ordinary GPUs, or two co-run GPUs, is
//! refused. No MPS daemon runs: these tests look at what the containers get.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpushare_utils::limits::PodLimits;
use gpushare_utils::shm::Trust;
use hypervisor_corun::{self as corun, CorunOptions};
use hypervisor_kubernetes::deviceplugin::DevicePluginConfig;
use hypervisor_observer::{GpuObserver, SimulatedGpus};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube_fakes::apiserver::FakeApiServer;
use kube_fakes::cluster;
use kube_fakes::device_kubelet::FakeDeviceKubelet;
use kube_fakes::kubelet::Version;
use kube_fakes::node::{self, TestNode};
use serde_json::{Value, json};

const DRIVER: &str = "gpu.gpushare.dev";
const NODE: &str = "node-corun";
const PIPE: &str = "/var/run/gpushare/mps";

struct World {
    dir: PathBuf,
    pods: Vec<String>,
    /// Kept: the API server stops when dropped.
    _api: FakeApiServer,
    client: kube::Client,
    node: Option<TestNode>,
    gpus: Arc<SimulatedGpus>,
    /// The device plugin's kubelet, when the world runs the plugin.
    device_kubelet: Option<FakeDeviceKubelet>,
}

impl World {
    /// A node with two GPUs, the first in co-run mode (20% kept for latency
    /// pods); with `device_plugin`, the device plugin runs too.
    async fn start(tag: &str, device_plugin: bool) -> Self {
        let dir = std::env::temp_dir().join(format!("hv-corun-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let limiter = dir.join("libcuda_limiter.so");
        std::fs::write(&limiter, b"").unwrap();
        let gpus = Arc::new(SimulatedGpus::new(2));
        let mut options = node::options(&dir, NODE, DRIVER, &limiter);
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
            let mut config = DevicePluginConfig::under(&dir.join("kubelet-dp"), 4);
            config.pod_resources = dir.join("no-pod-resources.sock");
            std::fs::create_dir_all(&config.dir).unwrap();
            device_kubelet = Some(FakeDeviceKubelet::start(&config.dir, None).unwrap());
            options.device_plugin = Some(config);
        }
        let api = FakeApiServer::start().await.unwrap();
        api.write_kubeconfig(&dir.join("kubeconfig")).unwrap();
        let client = hypervisor_kubernetes::client(Some(&dir.join("kubeconfig")))
            .await
            .unwrap();
        cluster::create_node(&client, NODE).await.unwrap();
        let observer: Arc<dyn GpuObserver> = gpus.clone();
        let node = TestNode::start(&api, observer, options).await.unwrap();
        Self {
            dir,
            pods: Vec::new(),
            _api: api,
            client,
            node: Some(node),
            gpus,
            device_kubelet,
        }
    }

    fn uuid(&self, index: usize) -> String {
        self.gpus.gpus().unwrap()[index].uuid.clone()
    }

    fn spec_path(&self, claim_uid: &str) -> PathBuf {
        self.dir
            .join("cdi")
            .join(format!("gpushare.dev-gpu_{claim_uid}.json"))
    }

    /// Pod `name` with a claim of its own for `memory`/`compute` and
    /// `parameters`, allocated on `device`; returns (pod UID, claim UID).
    async fn claim(
        &mut self,
        name: &str,
        memory: &str,
        parameters: Value,
        device: &str,
    ) -> (String, String) {
        let claim_name = format!("{name}-gpu");
        let claim = cluster::create_claim(
            &self.client,
            "default",
            &claim_name,
            DRIVER,
            memory,
            "30",
            Some(parameters),
        )
        .await
        .unwrap();
        let pod = cluster::create_pod(&self.client, "default", name, NODE, &claim_name)
            .await
            .unwrap();
        let claim = cluster::allocate(&self.client, &claim, &pod, DRIVER, NODE, device)
            .await
            .unwrap();
        let pod = pod.metadata.uid.unwrap();
        self.pods.push(pod.clone());
        (pod, claim.metadata.uid.unwrap())
    }

    /// Prepares claim `name` (UID `uid`); returns the kubelet's error text.
    async fn prepare(&self, name: &str, uid: &str) -> String {
        let node = self.node.as_ref().unwrap();
        let prepared = node
            .kubelet
            .prepare(Version::V1, "default", name, uid)
            .await
            .unwrap();
        prepared.error
    }

    /// Unprepares claim `name` (UID `uid`); the error the kubelet got.
    async fn unprepare(&self, name: &str, uid: &str) -> String {
        let node = self.node.as_ref().unwrap();
        node.kubelet
            .unprepare(Version::V1, "default", name, uid)
            .await
            .unwrap()
    }

    async fn stop(mut self) {
        if let Some(node) = self.node.take() {
            node.stop().await;
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        for pod in &self.pods {
            for prefix in ["gpushare-pod-", "gpushare-limits-"] {
                let _ = std::fs::remove_file(format!("/dev/shm/{prefix}{pod}"));
            }
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
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
        let mut world = World::start("client", false).await;
        let gpu0 = world.uuid(0);
        let pipe = world.dir.join("host-mps").join(&gpu0).join("pipe");
        let shm = world.dir.join("host-mps").join(&gpu0).join("shm");
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
            let status = serde_json::to_value(world.node.as_ref().unwrap().hv.status()).unwrap();
            let cap = status["pods"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["id"] == pod.as_str())
                .map(|p| p["gpus"][0]["cap_percent"].clone());
            let want_cap = match name {
                "latency" => json!(null),
                "batch" => json!(100),
                _ => json!(30),
            };
            assert_eq!(cap, Some(want_cap), "{name}: {status}");
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
        let mut world = World::start("mount-points", false).await;
        let gpu0 = world.uuid(0);
        let (_, uid) = world.claim("batch", "2Gi", json!({}), "gpu-0").await;
        assert_eq!(world.prepare("batch-gpu", &uid).await, "");
        // What a container runtime leaves in the GPU's folder (the
        // container's /dev/shm): an empty file for each file mounted under
        // it, the pod's region and limits.
        let folder = world.dir.join("mps").join(&gpu0).join("shm");
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
        assert_eq!(world.unprepare("batch-gpu", &uid).await, "");
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
    let status = serde_json::to_value(world.node.as_ref().unwrap().hv.status()).unwrap();
    status["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == pod)
        .map(|p| p["gpus"][0]["sm_percent"].clone())
        .unwrap_or_else(|| panic!("no pod {pod}: {status}"))
}

#[test]
fn a_pods_next_client_takes_the_whole_gpu_until_a_pod_of_the_other_class_shares_it() {
    runtime().block_on(async {
        let mut world = World::start("share", false).await;
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
        // The latency pods gone, the whole GPU again.
        assert_eq!(world.unprepare("latency-gpu", &latency_uid).await, "");
        assert_eq!(world.unprepare("elastic-gpu", &elastic_uid).await, "");
        assert_eq!(sm_percent_becomes(&batch, Some(100)), Some(100));
        world.stop().await;
    });
}

/// Creates claim `name` asking one device per entry of `devices`, allocated
/// there for pod (`pod`, `pod_uid`); returns its UID.
async fn claim_on(world: &World, name: &str, devices: &[&str], pod: (&str, &str)) -> String {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": DRIVER,
            "allocationMode": "ExactCount",
            "count": devices.len(),
            "capacity": {"requests": {"memory": "1Gi", "compute": "10"}},
        }}]}},
    }))
    .unwrap();
    let claims = Api::<ResourceClaim>::namespaced(world.client.clone(), "default");
    let claim = claims.create(&PostParams::default(), &claim).await.unwrap();
    let uid = claim.metadata.uid.unwrap();
    let results: Vec<Value> = devices
        .iter()
        .enumerate()
        .map(|(i, device)| {
            json!({
                "request": "gpus", "driver": DRIVER, "pool": NODE, "device": device,
                "consumedCapacity": {"memory": "1Gi", "compute": "10"},
                "shareID": format!("00000000-0000-4000-8000-{:0>12}", format!("{}{i}", &uid[uid.len() - 7..])),
            })
        })
        .collect();
    let status = json!({"status": {
        "allocation": {"devices": {"results": results}},
        "reservedFor": [{"resource": "pods", "name": pod.0, "uid": pod.1}],
    }});
    claims
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    uid
}

/// Pod `name` whose container uses `claims`; returns its UID.
async fn pod_with_claims(world: &mut World, name: &str, claims: &[&str]) -> String {
    let refs: Vec<Value> = claims.iter().map(|c| json!({"name": c})).collect();
    let sources: Vec<Value> = claims
        .iter()
        .map(|c| json!({"name": c, "resourceClaimName": c}))
        .collect();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": "main", "image": "cuda", "resources": {"claims": refs}}],
            "resourceClaims": sources,
        },
    }))
    .unwrap();
    let pod = Api::<Pod>::namespaced(world.client.clone(), "default")
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    let uid = pod.metadata.uid.unwrap();
    world.pods.push(uid.clone());
    uid
}

#[test]
fn a_claim_or_pod_mixing_a_corun_gpu_with_another_is_refused() {
    runtime().block_on(async {
        let mut world = World::start("mix", false).await;
        let (gpu0, gpu1) = (world.uuid(0), world.uuid(1));
        // One claim on both GPUs.
        let pod = pod_with_claims(&mut world, "wide", &["wide-gpus"]).await;
        let uid = claim_on(&world, "wide-gpus", &["gpu-0", "gpu-1"], ("wide", &pod)).await;
        let error = world.prepare("wide-gpus", &uid).await;
        assert!(error.contains(&format!("claim {uid}")), "{error}");
        assert!(
            error.contains(&format!(
                "co-run GPU {gpu0} and ordinary GPU {gpu1} cannot go to one pod"
            )),
            "{error}"
        );
        assert!(!world.spec_path(&uid).exists());

        // Two claims of one pod, one on each GPU: the second is refused, the
        // first stays an MPS client of its GPU alone.
        let pod = pod_with_claims(&mut world, "pair", &["pair-a", "pair-b"]).await;
        let a = claim_on(&world, "pair-a", &["gpu-0"], ("pair", &pod)).await;
        let b = claim_on(&world, "pair-b", &["gpu-1"], ("pair", &pod)).await;
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

        // The other order: ordinary first, then the co-run GPU.
        let pod = pod_with_claims(&mut world, "rev", &["rev-a", "rev-b"]).await;
        let a = claim_on(&world, "rev-a", &["gpu-1"], ("rev", &pod)).await;
        let b = claim_on(&world, "rev-b", &["gpu-0"], ("rev", &pod)).await;
        assert_eq!(world.prepare("rev-a", &a).await, "");
        let error = world.prepare("rev-b", &b).await;
        assert!(error.contains("cannot go to one pod"), "{error}");
        world.stop().await;
    });
}

#[test]
fn the_device_plugin_answers_a_corun_gpus_container_as_an_mps_client() {
    runtime().block_on(async {
        let mut world = World::start("dp", true).await;
        let gpu0 = world.uuid(0);
        let kubelet = world.device_kubelet.as_ref().unwrap();
        let plugin = kubelet
            .plugin("nvidia.com/gpu", Duration::from_secs(10))
            .await
            .unwrap();
        let pod = cluster::create_gpu_pod(
            &world.client,
            "default",
            "hami",
            NODE,
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3072", "nvidia.com/gpucores": "30"}),
            json!({}),
        )
        .await
        .unwrap();
        kubelet.admit("default", "hami", &["main"]);
        world.pods.push(pod.metadata.uid.unwrap());
        // Binpack puts the first pod on GPU 0, the co-run one.
        let answer = plugin
            .start_container(("default", "hami", "main"), vec![format!("{gpu0}::0")])
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
        let pipe = world.dir.join("host-mps").join(&gpu0).join("pipe");
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
            world.dir.join("host-mps").join(&gpu0).join("shm")
        );
        assert!(!shm.read_only);

        // A pod that wants no co-run GPU gets the ordinary one, no MPS.
        let gpu1 = world.uuid(1);
        let pod = cluster::create_gpu_pod(
            &world.client,
            "default",
            "solo",
            NODE,
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3072"}),
            json!({"gpushare.dev/corun": "false"}),
        )
        .await
        .unwrap();
        kubelet.admit("default", "solo", &["main"]);
        world.pods.push(pod.metadata.uid.unwrap());
        let answer = plugin
            .start_container(("default", "solo", "main"), vec![format!("{gpu0}::1")])
            .await
            .unwrap();
        assert_eq!(answer.envs["CUDA_VISIBLE_DEVICES"], gpu1);
        assert!(!answer.envs.contains_key("CUDA_MPS_PIPE_DIRECTORY"));

        // Two GPUs for one container: never the co-run one, so none here.
        let pod = cluster::create_gpu_pod(
            &world.client,
            "default",
            "pair",
            NODE,
            json!({"nvidia.com/gpu": "2", "nvidia.com/gpumem": "1024"}),
            json!({}),
        )
        .await
        .unwrap();
        kubelet.admit("default", "pair", &["main"]);
        world.pods.push(pod.metadata.uid.unwrap());
        let refused = plugin
            .start_container(
                ("default", "pair", "main"),
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
