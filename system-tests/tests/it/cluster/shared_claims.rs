//! A ResourceClaim shared by several pods (one claim named by two pods'
//! `resourceClaimName`): the kubelet prepares it once, so its pods share one
//! quota identity; the second pod's workers are accepted as that
//! identity's, a pod that does not use the claim is not, and the identity
//! (spec, token, region) outlives the first pod and goes with the last one.
//! On the official control plane, the real scheduler allocating and
//! reserving the claim; and, where the agent's caches must lag the API
//! (which only the fake API server can hold back), the real scheduler's
//! objects served by the fake.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hypervisor_observer::{GpuObserver, SimulatedGpus};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, DeleteParams};
use kube_fakes::apiserver::FakeApiServer;
use kube_fakes::cluster_node;
use kube_fakes::kubelet::Version;
use kube_fakes::node::{self, TestNode};
use kube_fakes::tenant::Tenant;
use serde_json::{Value, json};

use system_tests::scratch::Scratch;
use system_tests::wait::eventually_async;

use super::{DRIVER, runtime, spec_path, tenant};

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

/// The options of node `node`: its files under `d`, processes under
/// `d/proc`.
fn options(d: &std::path::Path, node: &str) -> hypervisor_kubernetes::AgentOptions {
    let mut options = node::options(d, node, DRIVER, &d.join("libcuda_limiter.so"));
    options.proc_root = d.join("proc");
    options
}

/// Claim `shared` (4Gi, 30) and pods `sa` and `sb` on the tenant's Node
/// naming it; the scheduler allocates it and reserves it for both.
async fn claim_and_two_pods(tenant: &Tenant) -> (ResourceClaim, Pod, Pod) {
    let claim = cluster_node::claim("shared", DRIVER, 1, ("4Gi", "30"), None, None);
    let claim = tenant.create_claim(claim).await.unwrap();
    let a = tenant.create_pod("sa", &["shared"]).await.unwrap();
    let b = tenant.create_pod("sb", &["shared"]).await.unwrap();
    (claim, a, b)
}

/// Claim `name` once the scheduler has reserved it for `pods` pods.
async fn reserved_for(client: &kube::Client, name: &str, pods: usize) -> ResourceClaim {
    let claims = Api::<ResourceClaim>::default_namespaced(client.clone());
    for _ in 0..900 {
        let claim = claims.get(name).await.unwrap();
        let status = claim.status.clone().unwrap_or_default();
        if status.allocation.is_some() && status.reserved_for.iter().flatten().count() == pods {
            return claim;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("claim {name} never reserved for {pods} pods");
}

/// The CDI spec of claim `claim_uid` and the quota identity in it (its
/// region removed at the end).
fn spec_and_identity(scratch: &Scratch, claim_uid: &str) -> (PathBuf, String) {
    let spec_path = spec_path(&scratch.dir, claim_uid);
    let identity = identity_in(&spec_path);
    scratch.track_pod(&identity);
    (spec_path, identity)
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
    let scratch = Scratch::with_limiter("shared-claim-two-pods");
    runtime().block_on(async {
        let d = &scratch.dir;
        let tenant = tenant("shared-claim-two-pods").await;
        let client = tenant.client.clone();
        let mut options = options(d, tenant.node());
        options.kubeconfig = Some(tenant.agent_kubeconfig().to_owned());
        let gpus: Arc<dyn GpuObserver> = Arc::new(SimulatedGpus::new(1));
        let node = tenant.start_node(gpus, options, None).await.unwrap();

        let (claim, a, b) = claim_and_two_pods(&tenant).await;
        // A pod that does not use the claim (its own claim never made).
        let stranger = tenant.create_pod("sc", &["other"]).await.unwrap();
        let uid = |p: &Pod| p.metadata.uid.clone().unwrap();
        let (a_uid, b_uid, c_uid) = (uid(&a), uid(&b), uid(&stranger));
        let claim_uid = claim.metadata.uid.clone().unwrap();
        reserved_for(&client, "shared", 2).await;
        // The kubelet prepares the claim once, for whichever pod starts
        // first, and starts both.
        eventually_async("both pods started", || {
            node.kubelet.started(&a_uid) && node.kubelet.started(&b_uid)
        })
        .await;
        let prepared: Vec<_> = node
            .kubelet
            .prepared()
            .into_iter()
            .filter(|p| p.uid == claim_uid)
            .collect();
        assert_eq!(prepared.len(), 1, "{prepared:?}");
        let (spec_path, identity) = spec_and_identity(&scratch, &claim_uid);
        // With both pods reserved when prepared, the claim's own identity;
        // had the first prepare seen one pod alone, that pod's (both are
        // correct: the rest of the test holds for either).
        let (first, second) = if identity == b_uid {
            (("sb", &b_uid), ("sa", &a_uid))
        } else {
            assert!(
                identity == claim_uid || identity == a_uid,
                "{identity} is neither the claim nor one of its pods"
            );
            (("sa", &a_uid), ("sb", &b_uid))
        };
        let token_path = d
            .join("state/pods")
            .join(&identity)
            .join(gpushare_utils::pod_file::FILE_NAME);
        let token = token_in(&token_path);
        let url = node.node.hv_url.clone();

        // A process of the other pod registers as the claim's identity...
        let proc_root = d.join("proc");
        process_of(&proc_root, 5001, second.1);
        let mut status = 0;
        for _ in 0..100 {
            status = register(&url, &identity, &token).await;
            if status == 200 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(status, 200, "the other pod's worker refused as the claim's");
        // ...a process of a pod that does not use the claim does not.
        std::fs::remove_dir_all(proc_root.join("5001")).unwrap();
        process_of(&proc_root, 5002, &c_uid);
        assert_eq!(register(&url, &identity, &token).await, 403);

        // The first pod ends: the second still uses the claim, which stays.
        let region = PathBuf::from(format!("/dev/shm/gpushare-pod-{identity}"));
        assert!(region.exists());
        let pods = Api::<Pod>::default_namespaced(client.clone());
        pods.delete(first.0, &DeleteParams::default())
            .await
            .unwrap();
        let mut gone = false;
        for _ in 0..900 {
            gone = pods.get_opt(first.0).await.unwrap().is_none();
            if gone {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(gone, "pod {} not deleted", first.0);
        node.node.agent.collect_garbage().await.unwrap();
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert!(
            spec_path.exists() && token_path.exists() && region.exists(),
            "the claim's spec, token and region went with its first pod"
        );
        assert!(!node.kubelet.unprepared().contains(&claim_uid));

        // The last pod ends: everything goes.
        pods.delete(second.0, &DeleteParams::default())
            .await
            .unwrap();
        eventually_async("the claim cleaned up with its last pod", || {
            !spec_path.exists() && !token_path.exists() && !region.exists()
        })
        .await;
        node.stop().await;
    });
}

/// The objects of claim `shared` and pods `sa` and `sb` as the official
/// control plane made them: the claim allocated and reserved for both by
/// the real scheduler, the pods bound. The node's agent runs only to
/// publish its slice (its Node registered as its kubelet does); nothing
/// prepares the claim. Server-kept fields (resource versions, managed
/// fields) are dropped, so that another server can store them. With the
/// objects: their namespace, and their node's name.
async fn scheduled_by_the_real_scheduler(
    d: &std::path::Path,
) -> (Vec<(&'static str, Value)>, String, String) {
    let tenant = tenant("shared-claim-unseen").await;
    let client = tenant.client.clone();
    tenant.register_node().await.unwrap();
    let mut options = options(&d.join("real"), tenant.node());
    options.kubeconfig = Some(tenant.agent_kubeconfig().to_owned());
    let gpus: Arc<dyn GpuObserver> = Arc::new(SimulatedGpus::new(1));
    let node = TestNode::start_written(gpus, options, None).await.unwrap();
    claim_and_two_pods(&tenant).await;
    let claim = reserved_for(&client, "shared", 2).await;
    let pods = Api::<Pod>::default_namespaced(client.clone());
    let mut objects = vec![("resourceclaims", serde_json::to_value(&claim).unwrap())];
    for name in ["sa", "sb"] {
        objects.push((
            "pods",
            serde_json::to_value(pods.get(name).await.unwrap()).unwrap(),
        ));
    }
    node.stop().await;
    for (_, object) in &mut objects {
        let metadata = object["metadata"].as_object_mut().unwrap();
        metadata.remove("resourceVersion");
        metadata.remove("managedFields");
    }
    (
        objects,
        tenant.namespace().to_owned(),
        tenant.node().to_owned(),
    )
}

/// The agent's caches may not have seen a pod or a claim's reservation at
/// all (reflectors still listing, or re-listing after a watch broke): the
/// claim's consumers are then read from the API before its identity is
/// forgotten or a worker of another pod is refused as its, and a consumer
/// the pod cache does not know is looked up there.
/// Only the fake API server can hold back watch events: it holds every pod
/// and claim event, so the agent's caches know neither pod nor the claim,
/// and serves the objects the official control plane made (the real
/// scheduler's allocation and reservation).
#[test]
fn consumers_the_agents_caches_have_not_seen_keep_the_shared_claim() {
    let scratch = Scratch::with_limiter("shared-claim-unseen");
    runtime().block_on(async {
        let d = &scratch.dir;
        let (objects, ns, node_name) = scheduled_by_the_real_scheduler(d).await;
        let api = FakeApiServer::start().await.unwrap();
        let held = [
            api.hold_watch_events("pods"),
            api.hold_watch_events("resourceclaims"),
        ];
        api.write_kubeconfig(&d.join("kubeconfig")).unwrap();
        let gpus: Arc<dyn GpuObserver> = Arc::new(SimulatedGpus::new(1));
        let node = TestNode::start(&api, gpus, options(d, &node_name))
            .await
            .unwrap();
        for (resource, object) in objects {
            api.put(resource, object);
        }
        let claim = api.get("resourceclaims", &ns, "shared").unwrap();
        let claim_uid = claim["metadata"]["uid"].as_str().unwrap().to_owned();
        let b_uid = api.get("pods", &ns, "sb").unwrap()["metadata"]["uid"]
            .as_str()
            .unwrap()
            .to_owned();
        // Reserved for both pods when prepared: the claim's own identity.
        let prepared = node
            .kubelet
            .prepare(Version::V1, &ns, "shared", &claim_uid)
            .await
            .unwrap();
        assert_eq!(prepared.error, "");
        let (spec_path, identity) = spec_and_identity(&scratch, &claim_uid);
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
        api.delete("pods", &ns, "sa");
        let gone = node.agent.collect_garbage().await.unwrap();
        assert!(
            gone.is_empty() && kept(),
            "collected {gone:?} while pod B runs"
        );

        // The caches catch up, the last pod ends: everything goes.
        drop(held);
        api.delete("pods", &ns, "sb");
        eventually_async("the claim cleaned up with its last pod", || {
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
