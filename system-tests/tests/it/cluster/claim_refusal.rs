//! A claim the node refuses to prepare, on the official control plane: the
//! real scheduler allocates it, the agent refuses it when the kubelet asks,
//! and says so where the claim's user looks, `kubectl describe
//! resourceclaim`: one Warning event `PrepareFailed` that names every
//! problem at once, written once however often the kubelet asks again
//! (the agent's state that decides it also keeps its WARN line to one per
//! reason: `state::tests` of hypervisor-kubernetes). The claim holds nothing on the node: its pod is left
//! pending without a share in the hypervisor, and once the pod goes, the
//! whole GPU is free for another claim.
//!
//! The bad parameters are a DeviceClass's configuration, of the test's own
//! class: the admission policy of `deploy/base` refuses them in a claim or
//! claim template when it is written, while a class's configuration reaches
//! only the node, which must refuse it itself.

use std::sync::Arc;

use hypervisor_kubernetes::dra::refusal::{COMPONENT, REASON};
use hypervisor_observer::{GpuObserver, SimulatedGpus};
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::api::resource::v1::DeviceClass;
use kube::api::{Api, ListParams, PostParams};
use kube_fakes::cluster_node;
use serde_json::json;

use system_tests::scratch::Scratch;
use system_tests::wait::{eventually_async, eventually_some_async};

use super::{DRIVER, pod_status, runtime, spec_path, tenant};

/// Each problem of the class's parameters, as the node says it.
const PROBLEMS: [&str; 4] = [
    "opaque parameters: weight 0 is not a whole number from 1 to 4294967295",
    "opaque parameters: policy \"garbage\" is not fixed, elastic or none",
    "opaque parameters: unknown field colour",
    "opaque parameters: ceiling 500 is not a whole number from 1 to 100",
];

#[test]
fn a_claim_refused_at_prepare_says_every_problem_once_and_holds_nothing() {
    let scratch = Scratch::with_limiter("claim-refusal");
    runtime().block_on(async {
        let dir = &scratch.dir;
        let tenant = tenant("claim-refusal").await;
        let options = tenant.options(dir, DRIVER, &scratch.limiter());
        let gpus: Arc<dyn GpuObserver> = Arc::new(SimulatedGpus::new(1));
        let node = tenant.start_node(gpus, options, None).await.unwrap();

        // A class of the driver's GPUs whose two configurations are wrong.
        let class: DeviceClass = serde_json::from_value(json!({
            "metadata": {"name": tenant.name},
            "spec": {
                "selectors": [{"cel": {"expression": format!("device.driver == \"{DRIVER}\"")}}],
                "config": [
                    {"opaque": {"driver": DRIVER, "parameters": {"weight": 0, "policy": "garbage"}}},
                    {"opaque": {"driver": DRIVER, "parameters": {"ceiling": 500, "colour": "red"}}},
                ],
            },
        }))
        .unwrap();
        Api::<DeviceClass>::all(tenant.client.clone())
            .create(&PostParams::default(), &class)
            .await
            .unwrap();
        tenant.delete_at_end::<DeviceClass>(None, &tenant.name);
        let claim = cluster_node::claim("bad", &tenant.name, 1, ("1Gi", "30"), None, None);
        let claim = tenant.create_claim(claim).await.unwrap();
        let claim_uid = claim.metadata.uid.unwrap();
        let pod = tenant.create_pod("refused", &["bad"]).await.unwrap();
        let pod_uid = pod.metadata.uid.unwrap();
        scratch.track_pod(&pod_uid);

        // Allocated by the scheduler, refused by the node, every problem
        // told to the kubelet.
        let kubelet = &node.kubelet;
        let told = eventually_some_async("the kubelet told of the refusal", || {
            std::future::ready(kubelet.refused(&pod_uid))
        })
        .await;
        for problem in PROBLEMS {
            assert!(told.contains(problem), "{problem:?} not in {told:?}");
        }
        // The kubelet asks again and again.
        eventually_async("the kubelet asked three times more", || {
            kubelet.refusals(&pod_uid) >= 4
        })
        .await;

        // One event on the claim says it all, however often it was refused.
        let events = Api::<Event>::default_namespaced(tenant.client.clone());
        let on_claim = ListParams::default().fields(&format!("involvedObject.uid={claim_uid}"));
        let events = events.list(&on_claim).await.unwrap().items;
        assert_eq!(events.len(), 1, "{events:#?}");
        let event = &events[0];
        assert_eq!(event.reason.as_deref(), Some(REASON));
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        assert_eq!(event.involved_object.kind.as_deref(), Some("ResourceClaim"));
        // `kubectl describe resourceclaim`, as docs/kubernetes.md says to
        // run, shows it: every problem, in the driver's words.
        let kubectl = tenant.kubectl.clone();
        let described = tokio::task::spawn_blocking(move || {
            kubectl.ok(&["describe", "resourceclaim", "bad"], None)
        })
        .await
        .unwrap()
        .unwrap();
        assert!(
            described.contains(&format!("Warning  {REASON}"))
                && described.contains(COMPONENT),
            "{described}"
        );
        for problem in PROBLEMS {
            assert!(described.contains(problem), "{problem:?} not in:\n{described}");
        }
        assert!(!described.contains("expected"), "a parser's words:\n{described}");
        // docs/kubernetes.md shows this message.
        let line = described.lines().find(|l| l.contains(REASON)).unwrap();
        let message = line.split(COMPONENT).nth(1).unwrap().trim();
        let docs = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kubernetes.md");
        let docs = std::fs::read_to_string(docs).unwrap();
        assert!(docs.contains(message), "docs/kubernetes.md lacks {message:?}");

        // Nothing of it on the node: no share in the hypervisor, no CDI spec.
        assert!(!kubelet.started(&pod_uid));
        assert_eq!(pod_status(&node.node.hv, &pod_uid), None);
        assert!(node.node.agent.provisioner().claims().is_empty());
        assert!(!spec_path(dir, &claim_uid).exists());

        // Its pod gone, the whole GPU goes to another claim.
        tenant.delete_pod("refused").await.unwrap();
        let whole = cluster_node::claim("whole", DRIVER, 1, ("1Gi", "100"), None, None);
        tenant.create_claim(whole).await.unwrap();
        let after = tenant.create_pod("after", &["whole"]).await.unwrap();
        let after_uid = after.metadata.uid.unwrap();
        scratch.track_pod(&after_uid);
        eventually_async("the whole GPU's pod started", || kubelet.started(&after_uid)).await;
        let limits = pod_status(&node.node.hv, &after_uid).expect("the pod's share");
        assert_eq!(limits["gpus"][0]["cap_percent"], 100, "{limits}");
        node.stop().await;
    });
}
