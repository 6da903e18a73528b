//! A ResourceClaim shared by several pods (one claim named by two pods'
//! `resourceClaimName`) against the fake API server and kubelet: the kubelet
//! prepares it once, so its pods share one quota identity; the second pod's
//! workers are accepted as that identity's, a pod that does not use the
//! claim is not, and the identity (spec, token, region) outlives the first
//! pod and goes with the last one.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hypervisor_observer::{GpuObserver, SimulatedGpus};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, Patch, PatchParams};
use kube_fakes::apiserver::FakeApiServer;
use kube_fakes::cluster;
use kube_fakes::kubelet::Version;
use kube_fakes::node::{self, TestNode};
use serde_json::{Value, json};

const DRIVER: &str = "gpu.gpushare.dev";
const NODE: &str = "node-a";

/// The test's folder, and the regions of the identities it names, removed
/// at the end.
struct Scratch {
    dir: PathBuf,
    identities: std::sync::Mutex<Vec<String>>,
}

impl Scratch {
    fn new(test: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("hv-shared-claim-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libcuda_limiter.so"), b"").unwrap();
        Self {
            dir,
            identities: std::sync::Mutex::new(Vec::new()),
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        for id in self.identities.lock().unwrap().iter() {
            let _ = std::fs::remove_file(format!("/dev/shm/gpushare-pod-{id}"));
            let _ = std::fs::remove_file(format!("/dev/shm/gpushare-limits-{id}"));
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

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..200 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting: {what}");
}

/// Writes `/proc/<host pid>` of a process that is pid 7 in pod `pod`.
fn process_of(proc_root: &std::path::Path, host_pid: u32, pod: &str) {
    let p = proc_root.join(host_pid.to_string());
    std::fs::create_dir_all(&p).unwrap();
    std::fs::write(
        p.join("status"),
        format!("Name:\tpython\nNSpid:\t{host_pid}\t7\n"),
    )
    .unwrap();
    std::fs::write(
        p.join("cgroup"),
        format!("0::/kubepods/burstable/pod{pod}/c1\n"),
    )
    .unwrap();
}

/// The registration of pid 7 as `identity` with `token`: the status.
async fn register(url: &str, identity: &str, token: &str) -> u16 {
    let (url, identity, token) = (url.to_owned(), identity.to_owned(), token.to_owned());
    tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .new_agent();
        let body = json!({"pod": identity, "pid": 7, "hostname": "x", "devices": []}).to_string();
        agent
            .post(&format!("{url}/api/v1/workers"))
            .header("authorization", &format!("Bearer {token}"))
            .header("content-type", "application/json")
            .send(body)
            .unwrap()
            .status()
            .as_u16()
    })
    .await
    .unwrap()
}

/// A client of `api`, the node in it, and the node's agent, hypervisor and
/// kubelet with their files under `d` (processes under `d/proc`).
async fn start_node(api: &FakeApiServer, d: &std::path::Path) -> (kube::Client, TestNode) {
    api.write_kubeconfig(&d.join("kubeconfig")).unwrap();
    let client = hypervisor_kubernetes::client(Some(&d.join("kubeconfig")))
        .await
        .unwrap();
    cluster::create_node(&client, NODE).await.unwrap();
    let mut options = node::options(d, NODE, DRIVER, &d.join("libcuda_limiter.so"));
    options.proc_root = d.join("proc");
    let gpus: Arc<dyn GpuObserver> = Arc::new(SimulatedGpus::new(1));
    let node = TestNode::start(api, gpus, options).await.unwrap();
    (client, node)
}

/// Writes `status` (a merge patch: the allocation, `reservedFor`) to claim
/// `shared`, has the kubelet prepare it, and returns its CDI spec's path and
/// the quota identity in it (its region removed at the end).
async fn reserve_and_prepare(
    client: &kube::Client,
    node: &TestNode,
    scratch: &Scratch,
    status: &Value,
    claim_uid: &str,
) -> (PathBuf, String) {
    Api::<ResourceClaim>::namespaced(client.clone(), "default")
        .patch_status("shared", &PatchParams::default(), &Patch::Merge(status))
        .await
        .unwrap();
    let prepared = node
        .kubelet
        .prepare(Version::V1, "default", "shared", claim_uid)
        .await
        .unwrap();
    assert_eq!(prepared.error, "");
    let spec_path = scratch
        .dir
        .join("cdi")
        .join(format!("gpushare.dev-gpu_{claim_uid}.json"));
    let identity = identity_in(&spec_path);
    scratch.identities.lock().unwrap().push(identity.clone());
    (spec_path, identity)
}

/// Claim `shared` (4Gi, 30) and pods `sa` and `sb` on the node naming it.
async fn claim_and_two_pods(
    client: &kube::Client,
) -> (
    ResourceClaim,
    k8s_openapi::api::core::v1::Pod,
    k8s_openapi::api::core::v1::Pod,
) {
    let claim = cluster::create_claim(client, "default", "shared", DRIVER, "4Gi", "30", None)
        .await
        .unwrap();
    let a = cluster::create_pod(client, "default", "sa", NODE, "shared")
        .await
        .unwrap();
    let b = cluster::create_pod(client, "default", "sb", NODE, "shared")
        .await
        .unwrap();
    (claim, a, b)
}

/// The quota identity the CDI spec at `spec_path` gives: its pod file's pod.
fn identity_in(spec_path: &std::path::Path) -> String {
    let spec: Value = serde_json::from_slice(&std::fs::read(spec_path).unwrap()).unwrap();
    let pod_file = spec["devices"][0]["containerEdits"]["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["containerPath"] == "/usr/local/gpushare/lib/gpushare-pod.json")
        .and_then(|m| m["hostPath"].as_str())
        .expect("the pod file is mounted");
    let pod_file: gpushare_utils::pod_file::PodFile =
        serde_json::from_slice(&std::fs::read(pod_file).unwrap()).unwrap();
    pod_file.pod
}

#[test]
fn a_claim_shared_by_two_pods_is_one_quota_kept_until_its_last_pod_ends() {
    let scratch = Scratch::new("two-pods");
    runtime().block_on(async {
        let d = &scratch.dir;
        let api = FakeApiServer::start().await.unwrap();
        let (client, node) = start_node(&api, d).await;

        let (claim, a, b) = claim_and_two_pods(&client).await;
        let stranger = cluster::create_pod(&client, "default", "sc", NODE, "other")
            .await
            .unwrap();
        let uid = |p: &k8s_openapi::api::core::v1::Pod| p.metadata.uid.clone().unwrap();
        let (a_uid, b_uid, c_uid) = (uid(&a), uid(&b), uid(&stranger));
        cluster::allocate(&client, &claim, &a, DRIVER, NODE, "gpu-0")
            .await
            .unwrap();
        // The scheduler reserves the claim for its second pod too.
        let reserved = json!({"status": {"reservedFor": [
            {"resource": "pods", "name": "sa", "uid": a_uid},
            {"resource": "pods", "name": "sb", "uid": b_uid},
        ]}});
        let claim_uid = claim.metadata.uid.clone().unwrap();
        // The kubelet prepares the claim once, for whichever pod starts first.
        let (spec_path, identity) =
            reserve_and_prepare(&client, &node, &scratch, &reserved, &claim_uid).await;
        // With both pods reserved when prepared, the claim's own identity;
        // had the kubelet's first prepare seen the first pod alone, that pod's
        // (both are correct: the rest of the test holds for either).
        assert!(
            identity == claim_uid || identity == a_uid,
            "{identity} is neither the claim nor its first pod"
        );
        let token_path = d
            .join("state/pods")
            .join(&identity)
            .join(gpushare_utils::pod_file::FILE_NAME);
        let token = token_in(&token_path);
        let url = node.hv_url.clone();

        // A process of the second pod registers as the claim's identity...
        let proc_root = d.join("proc");
        process_of(&proc_root, 5001, &b_uid);
        let mut status = 0;
        for _ in 0..100 {
            status = register(&url, &identity, &token).await;
            if status == 200 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(status, 200, "pod B's worker refused as the claim's");
        // ...a process of a pod that does not use the claim does not.
        std::fs::remove_dir_all(proc_root.join("5001")).unwrap();
        process_of(&proc_root, 5002, &c_uid);
        assert_eq!(register(&url, &identity, &token).await, 403);

        // The first pod ends: the second still uses the claim, which stays.
        let region = PathBuf::from(format!("/dev/shm/gpushare-pod-{identity}"));
        assert!(region.exists());
        api.delete("pods", "default", "sa");
        node.agent.collect_garbage().await.unwrap();
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert!(
            spec_path.exists() && token_path.exists() && region.exists(),
            "the claim's spec, token and region went with its first pod"
        );

        // The last pod ends: everything goes.
        api.delete("pods", "default", "sb");
        eventually("the claim cleaned up with its last pod", || {
            !spec_path.exists() && !token_path.exists() && !region.exists()
        })
        .await;
        node.stop().await;
    });
}

/// The agent's caches may not have seen a pod or a claim's reservation at
/// all (reflectors still listing, or re-listing after a watch broke): the
/// claim's consumers are then read from the API before its identity is
/// forgotten or a worker of another pod is refused as its, and a consumer
/// the pod cache does not know is looked up there.
/// The fake server holds back every pod and claim event from before the
/// agent starts, so its caches know neither pod nor the claim.
#[test]
fn consumers_the_agents_caches_have_not_seen_keep_the_shared_claim() {
    let scratch = Scratch::new("unseen");
    runtime().block_on(async {
        let d = &scratch.dir;
        let api = FakeApiServer::start().await.unwrap();
        let held = [
            api.hold_watch_events("pods"),
            api.hold_watch_events("resourceclaims"),
        ];
        let (client, node) = start_node(&api, d).await;

        let (claim, a, b) = claim_and_two_pods(&client).await;
        let b_uid = b.metadata.uid.clone().unwrap();
        // Allocated and reserved for both pods in one write, so the claim is
        // prepared as its own quota identity.
        let mut status = cluster::allocation(
            &serde_json::to_value(&claim).unwrap(),
            &serde_json::to_value(&a).unwrap(),
            DRIVER,
            NODE,
            "gpu-0",
        );
        status["status"]["reservedFor"]
            .as_array_mut()
            .unwrap()
            .push(json!({"resource": "pods", "name": "sb", "uid": b_uid}));
        let claim_uid = claim.metadata.uid.clone().unwrap();
        let (spec_path, identity) =
            reserve_and_prepare(&client, &node, &scratch, &status, &claim_uid).await;
        assert_eq!(identity, claim_uid, "not the claim's own identity");
        let token_path = d
            .join("state/pods")
            .join(&identity)
            .join(gpushare_utils::pod_file::FILE_NAME);
        let region = PathBuf::from(format!("/dev/shm/gpushare-pod-{identity}"));
        let kept = || spec_path.exists() && token_path.exists() && region.exists();

        // Just prepared, used by two pods neither cache knows: kept, and a
        // worker of the second pod is accepted as the claim's at once.
        let gone = node.agent.collect_garbage().await.unwrap();
        assert!(
            gone.is_empty() && kept(),
            "collected {gone:?} just prepared"
        );
        process_of(&d.join("proc"), 5001, &b_uid);
        let token = token_in(&token_path);
        assert_eq!(register(&node.hv_url, &identity, &token).await, 200);
        // The first pod ends; the second still runs: kept.
        api.delete("pods", "default", "sa");
        let gone = node.agent.collect_garbage().await.unwrap();
        assert!(
            gone.is_empty() && kept(),
            "collected {gone:?} while pod B runs"
        );

        // The caches catch up, the last pod ends: everything goes.
        drop(held);
        api.delete("pods", "default", "sb");
        eventually("the claim cleaned up with its last pod", || {
            !spec_path.exists() && !token_path.exists() && !region.exists()
        })
        .await;
        node.stop().await;
    });
}

/// The token in the pod file at `path`.
fn token_in(path: &std::path::Path) -> String {
    let pod_file: gpushare_utils::pod_file::PodFile =
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    pod_file.token
}
