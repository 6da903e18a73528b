//! The node agent survives its own restart and the API server's, on the
//! official control plane. The daemon and the agent run as their own
//! process (`hypervisor serve --kubernetes`, [`AgentProcess`]) beside the
//! kubelet double, with pods running on prepared claims:
//!
//! - a `kill -9` of it, then a start on the same state folder, keeps every
//!   running pod's limits (nothing provisioned again: the same ledger and
//!   limits objects, the same pod file; `hypervisor status` shows the same
//!   quota; a kubelet that prepares the claims again gets the same
//!   answers), leaves the ResourceSlice as it was, and removes, with one
//!   INFO line each, the claims of pods deleted while it was down (CDI
//!   spec, pod file, region and limits, checkpoint entry), as
//!   docs/kubernetes.md shows;
//! - a restart of the API server alone leaves it running with every pod's
//!   limits; a claim created after the restart is prepared, and its
//!   watches come back: a pod its cache held, deleted after the restart
//!   while the kubelet is away (so that nothing else unprepares it), is
//!   cleaned up.
//!
//! The test has a control plane of its own: it stops the API server, which
//! the binary's other tests share.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams};
use kube_fakes::cluster_node::{self, Overlay, gpu_labels};
use kube_fakes::kubelet::FakeKubelet;
use kube_fakes::node_kubelet::{NodeKubelet, PreparedClaim};
use serde_json::Value;

use system_tests::scratch::Scratch;
use system_tests::wait::{PATIENCE, eventually_async};

use super::agent_process::AgentProcess;
use super::{DRIVER, runtime, spec_path};

/// What the agent logs for each claim it removes because its pod is gone.
const REMOVED: &str = "pod gone: claim removed";
/// What it logs when its watch of the node's pods fails.
const WATCH_FAILED: &str = "WARN hypervisor_kubernetes::agent: pod watch";
/// What it logs for each claim it provisions.
const PREPARED: &str = "claim prepared";
/// What it logs once it has read its checkpoint.
const RESTORED: &str = "prepared claims restored from the checkpoint claims=3 pods=3";

/// A pod and its claim (of the same name), as the test made them.
struct Running {
    name: &'static str,
    pod_uid: String,
    claim_uid: String,
}

/// The cluster as the test sees it: an administrator's client in namespace
/// `default`, the node's folder, and the test's scratch.
struct Cluster<'a> {
    admin: kube::Client,
    node: &'a str,
    scratch: &'a Scratch,
}

impl Cluster<'_> {
    /// Creates claim `name` for `memory` and `compute` of GPU `gpu` and pod
    /// `name` using it, and waits until the kubelet started it.
    async fn run(
        &self,
        kubelet: &NodeKubelet,
        name: &'static str,
        (memory, compute): (&str, &str),
        gpu: u32,
    ) -> Running {
        let claim = cluster_node::claim(name, DRIVER, 1, (memory, compute), Some(gpu), None);
        let claim: ResourceClaim = serde_json::from_value(claim).unwrap();
        let claim = self.claims().create(&Default::default(), &claim).await;
        let claim_uid = claim.unwrap().metadata.uid.unwrap();
        let pod: Pod = serde_json::from_value(cluster_node::pod(name, self.node, &[name])).unwrap();
        let pod = self.pods().create(&Default::default(), &pod).await.unwrap();
        let pod_uid = pod.metadata.uid.unwrap();
        self.scratch.track_pod(&pod_uid);
        eventually_async(&format!("pod {name} started"), || kubelet.started(&pod_uid)).await;
        Running {
            name,
            pod_uid,
            claim_uid,
        }
    }

    /// Deletes `running`'s pod at once (no grace: nothing waits for its
    /// kubelet) and its claim, as an administrator does for a node that is
    /// down.
    async fn force_delete(&self, running: &Running) {
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        self.pods().delete(running.name, &now).await.unwrap();
        let claims = self.claims();
        claims.delete(running.name, &now).await.unwrap();
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), "default")
    }

    fn claims(&self) -> Api<ResourceClaim> {
        Api::namespaced(self.admin.clone(), "default")
    }

    /// The node's ResourceSlice: its UID and its pool's generation.
    async fn slice(&self) -> (String, i64) {
        let name = format!("{}-{DRIVER}", self.node);
        let slice = Api::<ResourceSlice>::all(self.admin.clone())
            .get(&name)
            .await
            .unwrap();
        (slice.metadata.uid.unwrap(), slice.spec.pool.generation)
    }
}

/// What the node holds for a running pod: what a restart must not change.
#[derive(Debug, PartialEq)]
struct Held {
    /// Its limits as `hypervisor status` shows them, GPU by GPU.
    limits: Vec<(Value, Value, Value)>,
    /// Its pod file's bytes (its token).
    pod_file: Vec<u8>,
    /// The inodes of its ledger and its limits object: the same objects.
    objects: [u64; 2],
}

impl Held {
    fn of(agent: &AgentProcess, dir: &Path, pod: &Running) -> Self {
        let status = agent
            .pod(&pod.pod_uid)
            .expect("the pod in hypervisor status");
        let limits = status["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                let limit = |key: &str| g[key].clone();
                (limit("uuid"), limit("memory_quota"), limit("cap_percent"))
            })
            .collect();
        Self {
            limits,
            pod_file: std::fs::read(pod_file(dir, &pod.pod_uid)).unwrap(),
            objects: Scratch::pod_files(&pod.pod_uid).map(|p| std::fs::metadata(p).unwrap().ino()),
        }
    }
}

/// Pod `uid`'s pod file, which the agent under `dir` writes.
fn pod_file(dir: &Path, uid: &str) -> PathBuf {
    dir.join("state/pods")
        .join(uid)
        .join(gpushare_utils::pod_file::FILE_NAME)
}

/// The claims (UIDs) in the checkpoint of the agent under `dir`.
fn checkpointed(dir: &Path) -> Vec<String> {
    let text = std::fs::read(dir.join("state/checkpoint.json")).unwrap();
    let checkpoint: Value = serde_json::from_slice(&text).unwrap();
    checkpoint["claims"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect()
}

/// Whether nothing of `gone` is left on the node under `dir`: its CDI
/// spec, its pod's file, ledger and limits, its checkpoint entry.
fn removed(dir: &Path, gone: &Running) -> bool {
    let files = Scratch::pod_files(&gone.pod_uid);
    !spec_path(dir, &gone.claim_uid).exists()
        && !pod_file(dir, &gone.pod_uid).exists()
        && files.iter().all(|f| !f.exists())
        && !checkpointed(dir).contains(&gone.claim_uid)
}

#[test]
fn the_agent_keeps_its_pods_through_a_kill_and_an_api_server_restart() {
    let scratch = Scratch::with_limiter("agent-restart");
    runtime().block_on(async {
        let dir = &scratch.dir;
        let agent_kubeconfig = dir.join("agent.kubeconfig");
        let plane = cluster_node::installed(Overlay::Base, &dir.join("kubectl"), &agent_kubeconfig)
            .await
            .unwrap();
        let node = "gpu-node";
        let as_kubelet = cluster_node::register_node(&plane, node).await.unwrap();
        let mut agent =
            AgentProcess::start(dir, node, 2, &agent_kubeconfig, &scratch.limiter()).await;
        for table in [&agent.tables().activity, &agent.tables().priority] {
            scratch.track_shm(table);
        }
        let plugin = FakeKubelet::register(&agent.registry(), DRIVER, PATIENCE).await;
        let kubelet = NodeKubelet::start(as_kubelet.clone(), node, gpu_labels(), plugin.unwrap())
            .await
            .unwrap();
        let cluster = Cluster {
            admin: plane.admin().await.unwrap(),
            node,
            scratch: &scratch,
        };
        cluster_node::schedulable(&cluster.admin, node)
            .await
            .unwrap();
        let keep = cluster.run(&kubelet, "keep", ("4Gi", "30"), 0).await;
        let gone = cluster.run(&kubelet, "gone", ("1Gi", "20"), 1).await;
        let doomed = cluster.run(&kubelet, "doomed", ("1Gi", "20"), 1).await;
        let held = Held::of(&agent, dir, &keep);
        assert_eq!(held.limits[0].1, 4u64 << 30, "{held:?}");
        assert_eq!(held.limits[0].2, 30, "{held:?}");
        let slice = cluster.slice().await;

        // kill -9, and a pod deleted while the agent is down.
        agent.kill();
        cluster.force_delete(&gone).await;
        agent.restart().await;
        let plugin = FakeKubelet::register(&agent.registry(), DRIVER, PATIENCE).await;
        let plugin = plugin.unwrap();
        kubelet.registered_again(plugin.clone());

        // The running pods keep what they held: nothing provisioned anew.
        assert_eq!(Held::of(&agent, dir, &keep), held);
        assert!(agent.pod(&doomed.pod_uid).is_some());
        assert!(agent.log().contains(RESTORED), "{}", agent.log());

        // The deleted pod's claim removed, and said once.
        eventually_async("the deleted pod's claim removed", || removed(dir, &gone)).await;
        assert!(agent.pod(&gone.pod_uid).is_none());
        let said = |log: &str, claim: &Running| {
            log.lines()
                .filter(|l| l.contains(REMOVED) && l.contains(&claim.claim_uid))
                .count()
        };
        assert_eq!(said(&agent.log(), &gone), 1, "{}", agent.log());
        assert_documented(&agent.log(), &[RESTORED, REMOVED]);

        // The API server restarted: the agent runs on, its pods with it.
        plane.stop_api_server();
        eventually_async("the agent's pod watch broken", || {
            agent.log().contains(WATCH_FAILED)
        })
        .await;
        assert!(agent.running());
        assert_eq!(Held::of(&agent, dir, &keep), held);
        plane.start_api_server().await.unwrap();
        // A claim created after the restart is prepared.
        let late = cluster.run(&kubelet, "late", ("2Gi", "40"), 0).await;
        let held_late = Held::of(&agent, dir, &late);
        assert_eq!(held_late.limits[0].1, 2u64 << 30, "{held_late:?}");
        // Its pod watch is back: a pod its cache held, deleted now, goes.
        // The kubelet is away meanwhile: the agent alone can see it go.
        let prepared = kubelet.prepared();
        drop(kubelet);
        cluster.force_delete(&doomed).await;
        eventually_async("the pod deleted after the restart removed", || {
            removed(dir, &doomed)
        })
        .await;
        assert_eq!(said(&agent.log(), &doomed), 1, "{}", agent.log());

        // The kubelet back, it prepares the running pods' claims again: the
        // same answers, and nothing provisioned but the late claim since
        // the kill.
        let kubelet = NodeKubelet::start(as_kubelet, node, gpu_labels(), plugin)
            .await
            .unwrap();
        for pod in [&keep, &late] {
            eventually_async("the running pod started again", || {
                kubelet.started(&pod.pod_uid)
            })
            .await;
        }
        let devices = |prepared: Vec<PreparedClaim>| {
            let running = [&keep.claim_uid, &late.claim_uid];
            let mut devices: Vec<_> = prepared
                .into_iter()
                .filter(|c| running.contains(&&c.uid))
                .map(|c| (c.uid, c.devices))
                .collect();
            devices.sort();
            devices
        };
        assert_eq!(devices(kubelet.prepared()), devices(prepared));
        let log = agent.log();
        let provisioned: Vec<&str> = log.lines().filter(|l| l.contains(PREPARED)).collect();
        assert!(
            matches!(&provisioned[..], [line] if line.contains(&late.claim_uid)),
            "{log}"
        );
        assert_eq!(Held::of(&agent, dir, &keep), held);
        assert_eq!(Held::of(&agent, dir, &late), held_late);
        assert!(agent.running(), "{}", agent.log());

        // The slice, published again by each run at start and each pass
        // since, was never rewritten: its GPUs did not change.
        assert_eq!(cluster.slice().await, slice);
        drop(kubelet);
        drop(agent);
    });
}

/// Asserts that docs/kubernetes.md shows the message of the first line of
/// `log` that says each of `said`, as the agent wrote it.
fn assert_documented(log: &str, said: &[&str]) {
    let docs = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kubernetes.md");
    let docs = std::fs::read_to_string(docs).unwrap();
    for what in said {
        let line = log.lines().find(|l| l.contains(what)).unwrap();
        // The message: after the target, before the first field.
        let (_, line) = line.split_once("hypervisor_kubernetes::agent: ").unwrap();
        let fields = line.find('=').and_then(|eq| line[..eq].rfind(' ')).unwrap();
        let message = &line[..fields];
        assert!(
            docs.contains(message),
            "docs/kubernetes.md lacks {message:?}"
        );
    }
}
