//! The DRA path end to end on the official control plane: the real agent,
//! on a token of the shipped ServiceAccount, publishes its slice; claims
//! are allocated by the real scheduler (pinned to a GPU, where a test needs
//! one, by a CEL selector on the device's `index`, as a user would); the
//! kubelet double prepares them over the plugin's Unix sockets before it
//! reports the pod running.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hypervisor_observer::{GpuObserver, SimulatedGpus};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams};
use kube_fakes::cluster_node::{self, ClusterNode};
use kube_fakes::kubelet::Version;
use kube_fakes::tenant::Tenant;
use serde_json::{Value, json};

use system_tests::scratch::Scratch;
use system_tests::wait::eventually_async;

use super::{DRIVER, runtime, tenant};

/// Fields drop in order: the node, the tenant (its namespace and Node),
/// then the scratch folder.
struct World {
    node: Option<ClusterNode>,
    tenant: Tenant,
    gpus: Arc<SimulatedGpus>,
    scratch: Scratch,
}

impl World {
    async fn start(tag: &str) -> Self {
        let scratch = Scratch::with_limiter(&format!("k8s-{tag}"));
        let tenant = tenant(&format!("k8s-{tag}")).await;
        let gpus = Arc::new(SimulatedGpus::new(2));
        let mut world = Self {
            node: None,
            tenant,
            gpus,
            scratch,
        };
        world.restart().await;
        world.tenant.schedulable().await.unwrap();
        world
    }

    fn options(&self) -> hypervisor_kubernetes::AgentOptions {
        let d = &self.scratch.dir;
        let mut options = self.tenant.options(d, DRIVER, &self.scratch.limiter());
        // Workers' cgroups are looked up in a /proc the tests write.
        options.proc_root = d.join("proc");
        options
    }

    /// (Re)starts the node: the daemon and its agent, and the kubelet.
    async fn restart(&mut self) {
        if let Some(old) = self.node.take() {
            old.stop().await;
        }
        let observer: Arc<dyn GpuObserver> = self.gpus.clone();
        self.node = Some(
            self.tenant
                .start_node(observer, self.options(), None)
                .await
                .unwrap(),
        );
    }

    fn node(&self) -> &ClusterNode {
        self.node.as_ref().unwrap()
    }

    /// Creates claim `name` asking `count` GPUs with `memory`/`compute`
    /// each (on GPU `index` alone when given), weight 2; returns its UID.
    async fn create_claim(
        &self,
        name: &str,
        count: usize,
        (memory, compute): (&str, &str),
        index: Option<u32>,
    ) -> String {
        let object = cluster_node::claim(
            name,
            DRIVER,
            count,
            (memory, compute),
            index,
            Some(json!({"weight": 2})),
        );
        let claim = self.tenant.create_claim(object).await.unwrap();
        claim.metadata.uid.unwrap()
    }

    /// Creates pod `name` on the node whose container uses `claims`; the
    /// scheduler binds it. Returns its UID.
    async fn create_pod(&self, name: &str, claims: &[&str]) -> String {
        let pod = self.tenant.create_pod(name, claims).await.unwrap();
        let uid = pod.metadata.uid.unwrap();
        self.scratch.track_pod(&uid);
        uid
    }

    /// Waits until the kubelet started pod `uid` (its claims prepared).
    async fn started(&self, uid: &str) {
        let kubelet = &self.node().kubelet;
        eventually_async(&format!("pod {uid} started"), || kubelet.started(uid)).await;
    }

    /// A pod with a claim for `memory`/`compute` allocated by the scheduler
    /// on `device`, running; returns (pod uid, claim name, claim uid).
    async fn claim(
        &self,
        name: &str,
        memory: &str,
        compute: &str,
        device: &str,
    ) -> (String, String, String) {
        let index = device.trim_start_matches("gpu-").parse().unwrap();
        let claim = format!("{name}-gpu");
        let uid = self
            .create_claim(&claim, 1, (memory, compute), Some(index))
            .await;
        let pod = self.create_pod(name, &[&claim]).await;
        self.started(&pod).await;
        (pod, claim, uid)
    }

    /// The kubelet's `NodePrepareResources` for claim `name`, again.
    async fn prepare(
        &self,
        version: Version,
        name: &str,
        uid: &str,
    ) -> kube_fakes::kubelet::Prepared {
        self.node()
            .node
            .kubelet
            .prepare(version, self.tenant.namespace(), name, uid)
            .await
            .unwrap()
    }

    /// Why the scheduler leaves pod `name` pending: its `PodScheduled`
    /// condition's message, once it says so.
    async fn unschedulable(&self, name: &str) -> String {
        let c = self.tenant.unschedulable(name).await.unwrap();
        assert_eq!(c.reason.as_deref(), Some("Unschedulable"), "{c:?}");
        c.message.unwrap_or_default()
    }

    /// Deletes pod `name` as a user does: gracefully, the kubelet
    /// unpreparing its claims before it confirms.
    async fn delete_pod(&self, name: &str) {
        self.tenant.delete_pod(name).await.unwrap();
    }

    fn spec_path(&self, claim_uid: &str) -> PathBuf {
        super::spec_path(&self.scratch.dir, claim_uid)
    }

    /// The pod file the agent wrote for pod `pod_uid`: its limiters' pod,
    /// daemon and token.
    fn pod_file_path(&self, pod_uid: &str) -> PathBuf {
        self.scratch
            .dir
            .join("state/pods")
            .join(pod_uid)
            .join(gpushare_utils::pod_file::FILE_NAME)
    }

    async fn stop(mut self) {
        if let Some(node) = self.node.take() {
            node.stop().await;
        }
    }
}

fn pod_status(world: &World, pod: &str) -> Option<Value> {
    super::pod_status(&world.node().node.hv, pod)
}

#[test]
fn slice_published_for_two_gpus() {
    runtime().block_on(async {
        let world = World::start("slice").await;
        let node = world.tenant.node();
        // The other tests' nodes publish theirs on the shared cluster.
        let this_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
        let slices = Api::<ResourceSlice>::all(world.tenant.client.clone())
            .list(&this_node)
            .await
            .unwrap()
            .items;
        assert_eq!(slices.len(), 1);
        let slice = slices[0].clone();
        assert_eq!(slice.spec.driver, DRIVER);
        assert_eq!(slice.spec.node_name.as_deref(), Some(node));
        assert_eq!(slice.spec.pool.name, node);
        assert_eq!(
            slice.metadata.owner_references.as_ref().unwrap()[0].kind,
            "Node"
        );
        let devices = slice.spec.devices.unwrap();
        assert_eq!(devices.len(), 2);
        let gpus = world.gpus.gpus().unwrap();
        for (device, gpu) in devices.iter().zip(&gpus) {
            assert_eq!(device.name, format!("gpu-{}", gpu.index));
            assert_eq!(device.allow_multiple_allocations, Some(true));
            let attrs = device.attributes.as_ref().unwrap();
            assert_eq!(attrs["uuid"].string.as_deref(), Some(gpu.uuid.as_str()));
            // No GPU is in co-run mode here.
            assert_eq!(attrs["corun"].bool, Some(false));
            let capacity = device.capacity.as_ref().unwrap();
            let memory: u64 = capacity["memory"].value.0.parse().unwrap();
            assert!(memory <= gpu.memory_total && gpu.memory_total - memory < 256 << 20);
            assert_eq!(capacity["compute"].value.0, "100");
            let range = capacity["compute"]
                .request_policy
                .as_ref()
                .unwrap()
                .valid_range
                .as_ref()
                .unwrap();
            assert_eq!(
                (range.min.0.as_str(), range.max.as_ref().unwrap().0.as_str()),
                ("1", "100")
            );
        }
        world.stop().await;
    });
}

#[test]
fn prepare_gives_a_valid_cdi_spec_with_4gib_and_30_percent_then_unprepare_cleans_up() {
    runtime().block_on(async {
        let world = World::start("prepare").await;
        let (pod, name, uid) = world.claim("train", "4Gi", "30", "gpu-1").await;
        let prepared = world.prepare(Version::V1, &name, &uid).await;
        assert_eq!(prepared.error, "");
        assert_eq!(
            prepared.devices,
            vec![("gpu-1".to_owned(), vec![format!("gpushare.dev/gpu={uid}")])]
        );

        // The spec, validated by the CDI crate, names exactly what the limiter needs.
        let path = world.spec_path(&uid);
        let mut spec = container_device_interface::spec::read_spec(&path, 0).unwrap();
        let devices = spec.validate().unwrap();
        assert_eq!(devices.keys().collect::<Vec<_>>(), vec![&uid]);
        let raw: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let edits = &raw["devices"][0]["containerEdits"];
        let env: Vec<&str> = edits["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let gpu1 = &world.gpus.gpus().unwrap()[1];
        // The pod, the daemon and the token are the pod file's: no variable.
        assert!(
            !env.iter().any(|e| e.starts_with("CUDA_LIMITER_")),
            "{env:?}"
        );
        assert!(env.contains(&format!("CUDA_VISIBLE_DEVICES={}", gpu1.uuid).as_str()));
        let mounts: Vec<(&str, &str)> = edits["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["hostPath"].as_str().unwrap(),
                    m["containerPath"].as_str().unwrap(),
                )
            })
            .collect();
        let token = world.pod_file_path(&pod);
        assert!(mounts.contains(&(
            token.to_str().unwrap(),
            "/usr/local/gpushare/lib/gpushare-pod.json"
        )));
        let pod_file = pod_file_of(&token);
        assert_eq!(pod_file.pod, pod);
        assert_eq!(pod_file.hypervisor, world.node().node.hv_url);
        assert!(mounts.iter().any(|(_, c)| *c == "/etc/ld.so.preload"));
        let region = format!("/dev/shm/gpushare-pod-{pod}");
        assert!(mounts.contains(&(region.as_str(), region.as_str())));
        assert!(
            edits["deviceNodes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|n| n["path"] == "/dev/nvidia1")
        );

        // The hypervisor holds the pod with 4 GiB and a 30% cap on GPU 1, its token the file's.
        let status = pod_status(&world, &pod).expect("pod in the hypervisor");
        let gpu = &status["gpus"][0];
        assert_eq!(gpu["memory_quota"], 4u64 << 30);
        assert_eq!(gpu["cap_percent"], 30);
        assert_eq!(gpu["weight"], 2);
        assert_eq!(gpu["uuid"], gpu1.uuid.as_str());
        assert!(Path::new(&region).exists());
        assert_eq!(pod_file.token.len(), 64);

        // Preparing again answers the same; the pod deleted, the kubelet
        // unprepares, which removes everything.
        assert_eq!(
            world.prepare(Version::V1beta1, &name, &uid).await.devices,
            prepared.devices
        );
        world.delete_pod("train").await;
        eventually_async("the claim unprepared", || {
            world.node().kubelet.unprepared().contains(&uid)
        })
        .await;
        assert!(!world.spec_path(&uid).exists());
        assert!(!token.exists());
        assert!(!Path::new(&region).exists());
        assert!(pod_status(&world, &pod).is_none());
        world.stop().await;
    });
}

#[test]
fn two_claims_share_one_gpu_and_one_too_many_is_refused() {
    runtime().block_on(async {
        let world = World::start("share").await;
        let (a, a_name, a_uid) = world.claim("a", "4Gi", "30", "gpu-0").await;
        let (b, b_name, b_uid) = world.claim("b", "8Gi", "60", "gpu-0").await;
        assert_eq!(world.prepare(Version::V1, &a_name, &a_uid).await.error, "");
        assert_eq!(world.prepare(Version::V1, &b_name, &b_uid).await.error, "");
        let uuid = world.gpus.gpus().unwrap()[0].uuid.clone();
        for (pod, memory, cap) in [(&a, 4u64 << 30, 30), (&b, 8u64 << 30, 60)] {
            let gpu = &pod_status(&world, pod).unwrap()["gpus"][0];
            assert_eq!(
                (
                    gpu["uuid"].as_str(),
                    gpu["memory_quota"].as_u64(),
                    gpu["cap_percent"].as_u64()
                ),
                (Some(uuid.as_str()), Some(memory), Some(cap))
            );
        }
        // 30 + 60 + 20 > 100: the scheduler counts the same capacity and
        // leaves the third pending; nothing of it reaches the node. (The
        // agent's own refusal, for a scheduler whose count differs, is
        // `hypervisor-provision`'s unit test.)
        let c_uid = world.create_claim("c-gpu", 1, ("1Gi", "20"), Some(0)).await;
        let c = world.create_pod("c", &["c-gpu"]).await;
        let message = world.unschedulable("c").await;
        assert!(message.contains("cannot allocate all claims"), "{message}");
        assert!(!world.spec_path(&c_uid).exists());
        assert!(pod_status(&world, &c).is_none());
        // More memory than the GPU has, within what a GPU can have (the
        // admission policy refuses more): the API server takes the claim,
        // the scheduler finds no device for it.
        world
            .create_claim("d-gpu", 1, ("200Gi", "5"), Some(1))
            .await;
        world.create_pod("d", &["d-gpu"]).await;
        let message = world.unschedulable("d").await;
        assert!(message.contains("cannot allocate all claims"), "{message}");
        world.stop().await;
    });
}

/// The CDI spec of claim `uid`: (CUDA_VISIBLE_DEVICES, device node paths).
fn spec_gpus(world: &World, uid: &str) -> (String, Vec<String>) {
    let raw: Value = serde_json::from_slice(&std::fs::read(world.spec_path(uid)).unwrap()).unwrap();
    let edits = &raw["devices"][0]["containerEdits"];
    let visible = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|v| v.as_str()?.strip_prefix("CUDA_VISIBLE_DEVICES="))
        .unwrap()
        .to_owned();
    let nodes = edits["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap().to_owned())
        .filter(|p| p.trim_start_matches("/dev/nvidia").parse::<u32>().is_ok())
        .collect();
    (visible, nodes)
}

#[test]
fn a_claim_of_two_gpus_gives_the_container_both_with_a_quota_on_each() {
    runtime().block_on(async {
        let world = World::start("two-gpus").await;
        let uid = world
            .create_claim("wide-gpus", 2, ("4Gi", "30"), None)
            .await;
        let pod = world.create_pod("wide", &["wide-gpus"]).await;
        world.started(&pod).await;
        let prepared = world.prepare(Version::V1, "wide-gpus", &uid).await;
        assert_eq!(prepared.error, "");
        let cdi = vec![format!("gpushare.dev/gpu={uid}")];
        assert_eq!(
            prepared.devices,
            vec![("gpu-0".to_owned(), cdi.clone()), ("gpu-1".to_owned(), cdi)]
        );
        let gpus = world.gpus.gpus().unwrap();
        assert_eq!(
            spec_gpus(&world, &uid),
            (
                format!("{},{}", gpus[0].uuid, gpus[1].uuid),
                vec!["/dev/nvidia0".to_owned(), "/dev/nvidia1".to_owned()]
            )
        );
        // One pod, a quota on each of its two GPUs, in CUDA's order.
        let status = pod_status(&world, &pod).expect("pod in the hypervisor");
        let held: Vec<(String, u64, u64)> = status["gpus"]
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
        assert_eq!(
            held,
            vec![
                (gpus[0].uuid.clone(), 4 << 30, 30),
                (gpus[1].uuid.clone(), 4 << 30, 30)
            ]
        );
        world.stop().await;
    });
}

#[test]
fn a_container_with_two_claims_sees_both_gpus_whichever_spec_comes_last() {
    runtime().block_on(async {
        let world = World::start("two-claims").await;
        let a = world
            .create_claim("pair-a", 1, ("2Gi", "20"), Some(0))
            .await;
        let b = world
            .create_claim("pair-b", 1, ("6Gi", "40"), Some(1))
            .await;
        let pod = world.create_pod("pair", &["pair-a", "pair-b"]).await;
        // The kubelet prepares the pod's claims in its order, a then b.
        world.started(&pod).await;
        let gpus = world.gpus.gpus().unwrap();
        // Each spec's variables replace the other's: both name both GPUs.
        let both = (
            format!("{},{}", gpus[0].uuid, gpus[1].uuid),
            vec!["/dev/nvidia0".to_owned(), "/dev/nvidia1".to_owned()],
        );
        assert_eq!(spec_gpus(&world, &a), both);
        assert_eq!(spec_gpus(&world, &b), both);
        let status = pod_status(&world, &pod).unwrap();
        let quotas: Vec<u64> = status["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["memory_quota"].as_u64().unwrap())
            .collect();
        assert_eq!(quotas, vec![2 << 30, 6 << 30]);
        // One claim unprepared: the other names its own GPU alone again.
        let error = world
            .node()
            .node
            .kubelet
            .unprepare(Version::V1, world.tenant.namespace(), "pair-b", &b)
            .await
            .unwrap();
        assert_eq!(error, "");
        assert!(!world.spec_path(&b).exists());
        assert_eq!(
            spec_gpus(&world, &a),
            (gpus[0].uuid.clone(), vec!["/dev/nvidia0".to_owned()])
        );
        world.stop().await;
    });
}

#[test]
fn two_requests_of_one_claim_on_one_gpu_are_counted_together() {
    runtime().block_on(async {
        let world = World::start("same-gpu").await;
        // 2 x 60% of one GPU: each fits alone, not together. The scheduler
        // counts both shares and leaves the pod pending. (The agent's own
        // count, for a scheduler whose differs, is `hypervisor-provision`'s
        // unit test.)
        let uid = world
            .create_claim("twice-gpus", 2, ("1Gi", "60"), Some(0))
            .await;
        let pod = world.create_pod("twice", &["twice-gpus"]).await;
        let message = world.unschedulable("twice").await;
        assert!(message.contains("cannot allocate all claims"), "{message}");
        assert!(!world.spec_path(&uid).exists());
        assert!(pod_status(&world, &pod).is_none());
        world.stop().await;
    });
}

#[test]
fn restart_keeps_prepared_claims_and_deleted_pods_are_cleaned_up() {
    runtime().block_on(async {
        let mut world = World::start("restart").await;
        let (pod, name, uid) = world.claim("keep", "4Gi", "30", "gpu-0").await;
        let before = world.prepare(Version::V1, &name, &uid).await;
        assert_eq!(before.error, "");
        world.restart().await;
        // The new hypervisor has the pod from the checkpoint alone.
        let gpu = &pod_status(&world, &pod).expect("pod restored")["gpus"][0];
        assert_eq!(gpu["memory_quota"], 4u64 << 30);
        // And the kubelet's repeated prepare gets the same devices, even with
        // the claim being deleted (its reservation keeps it until the pod goes).
        Api::<ResourceClaim>::default_namespaced(world.tenant.client.clone())
            .delete(&name, &DeleteParams::default())
            .await
            .unwrap();
        assert_eq!(
            world.prepare(Version::V1, &name, &uid).await.devices,
            before.devices
        );

        // The pod is deleted: its claim, pod file and region go.
        let token = world.pod_file_path(&pod);
        let region = PathBuf::from(format!("/dev/shm/gpushare-pod-{pod}"));
        assert!(token.exists() && region.exists());
        world.delete_pod("keep").await;
        eventually_async("pod cleaned up", || {
            !token.exists() && !region.exists() && !world.spec_path(&uid).exists()
        })
        .await;
        assert!(pod_status(&world, &pod).is_none());
        world.stop().await;
    });
}

#[test]
fn a_worker_whose_cgroup_is_another_pods_is_refused() {
    use hypervisor_core::identity::{CgroupIdentity, WorkerIdentity};
    let scratch = Scratch::with_limiter("k8s-identity");
    let proc_root = scratch.dir.join("proc");
    let pod_a = "0b7c8a52-3f1e-4a7e-9c4e-2f6f1d2c3b4a";
    let pod_b = "1c8d9b63-4a2f-4b8f-8d5f-3a7a2e3d4c5b";
    // Host pid 4242 is pid 7 inside pod A's container.
    let p = proc_root.join("4242");
    std::fs::create_dir_all(&p).unwrap();
    std::fs::write(p.join("status"), "Name:\tpython\nNSpid:\t4242\t7\n").unwrap();
    std::fs::write(
        p.join("cgroup"),
        format!(
            "0::/kubepods.slice/kubepods-pod{}.slice/cri-containerd-1.scope\n",
            pod_a.replace('-', "_")
        ),
    )
    .unwrap();
    let identity = CgroupIdentity::new(&proc_root);
    let id = |s: &str| gpushare_utils::pod::PodId::new(s).unwrap();
    assert_eq!(identity.verify(&id(pod_a), 7), Ok(4242));
    assert!(identity.verify(&id(pod_b), 7).is_err());
    assert!(identity.verify(&id(pod_a), 8).is_err());

    // Through the registration endpoint of a hypervisor that checks identities.
    runtime().block_on(async {
        let world = World::start("identity-hv").await;
        let (a, a_name, a_uid) = world.claim("ida", "1Gi", "10", "gpu-0").await;
        let (b, b_name, b_uid) = world.claim("idb", "1Gi", "10", "gpu-0").await;
        for (name, uid) in [(&a_name, &a_uid), (&b_name, &b_uid)] {
            assert_eq!(world.prepare(Version::V1, name, uid).await.error, "");
        }
        let p = world.scratch.dir.join("proc/4242");
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("status"), "Name:\tpython\nNSpid:\t4242\t7\n").unwrap();
        std::fs::write(
            p.join("cgroup"),
            format!("0::/kubepods/burstable/pod{a}/c1\n"),
        )
        .unwrap();
        let register = |pod: String, token: String, url: String| {
            tokio::task::spawn_blocking(move || {
                let agent = ureq::Agent::config_builder()
                    .http_status_as_error(false)
                    .build()
                    .new_agent();
                let body =
                    json!({"pod": pod, "pid": 7, "hostname": "x", "devices": []}).to_string();
                agent
                    .post(&format!("{url}/api/v1/workers"))
                    .header("authorization", &format!("Bearer {token}"))
                    .header("content-type", "application/json")
                    .send(body)
                    .unwrap()
                    .status()
                    .as_u16()
            })
        };
        let token = |pod: &str| pod_file_of(&world.pod_file_path(pod)).token;
        let url = world.node().node.hv_url.clone();
        // Pod A's process with pod A's token: in.
        assert_eq!(
            register(a.clone(), token(&a), url.clone()).await.unwrap(),
            200
        );
        // The same process (pod A's cgroup) with pod B's token: refused.
        assert_eq!(
            register(b.clone(), token(&b), url.clone()).await.unwrap(),
            403
        );
        // A wrong token stays a 401.
        assert_eq!(register(a.clone(), "nope".into(), url).await.unwrap(), 401);
        world.stop().await;
    });
    drop(scratch);
}

/// The pod file at `path`, as the agent wrote it.
fn pod_file_of(path: &Path) -> gpushare_utils::pod_file::PodFile {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}
