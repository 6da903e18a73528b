//! The fake API server against the official one (kube-apiserver 1.37 of
//! `kube-control-plane`), on the same requests: every object of the kinds
//! our driver and our tests write that the real server refuses, the fake
//! refuses too, with the same code; what the real server takes, the fake
//! takes. The fake stays only for what the real server cannot do on demand
//! (hold watch events, compact history), and must not let a test pass with
//! an object a cluster would refuse.

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube_control_plane::ControlPlane;
use kube_fakes::apiserver::FakeApiServer;
use serde_json::{Value, json};

/// A device of a slice: `name`, shareable, with memory and compute.
fn device(name: &str) -> Value {
    json!({
        "name": name,
        "allowMultipleAllocations": true,
        "attributes": {"index": {"int": 0}},
        "capacity": {
            "memory": {"value": "16Gi", "requestPolicy": {"default": "16Gi",
                "validRange": {"min": "256Mi", "max": "16Gi", "step": "256Mi"}}},
            "compute": {"value": "100", "requestPolicy": {"default": "100",
                "validRange": {"min": "1", "max": "100", "step": "1"}}},
        },
    })
}

fn slice(name: &str, devices: Vec<Value>) -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {"driver": "gpu.gpushare.dev", "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": devices}})
}

fn claim(name: &str, exactly: Value) -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}})
}

/// (what, resource plural, object): the requests both servers get, in order.
fn cases() -> Vec<(&'static str, &'static str, Value)> {
    let mut high_default = device("gpu-0");
    high_default["capacity"]["compute"]["requestPolicy"]["default"] = json!("200");
    let mut bad_taint = device("gpu-0");
    bad_taint["taints"] = json!([{"key": "gpu.gpushare.dev/unhealthy", "value": "xid-79",
        "effect": "Sometimes"}]);
    let mut good_taint = device("gpu-0");
    good_taint["taints"] = json!([{"key": "gpu.gpushare.dev/unhealthy", "value": "xid-79",
        "effect": "NoExecute"}]);
    let many: Vec<Value> = (0..200).map(|i| device(&format!("gpu-{i}"))).collect();
    let capacity = json!({"requests": {"memory": "4Gi", "compute": "30"}});
    vec![
        (
            "a valid slice",
            "resourceslices",
            slice("ok", vec![device("gpu-0"), device("gpu-1")]),
        ),
        (
            "a tainted device",
            "resourceslices",
            slice("tainted", vec![good_taint]),
        ),
        (
            "an invalid device name",
            "resourceslices",
            slice("bad-name", vec![device("GPU_0")]),
        ),
        (
            "duplicate devices",
            "resourceslices",
            slice("dup", vec![device("gpu-0"), device("gpu-0")]),
        ),
        (
            "a request policy default above its max",
            "resourceslices",
            slice("high", vec![high_default]),
        ),
        (
            "a bogus taint effect",
            "resourceslices",
            slice("taint", vec![bad_taint]),
        ),
        ("200 devices", "resourceslices", slice("many", many)),
        ("a slice without a driver", "resourceslices", {
            let mut s = slice("no-driver", vec![device("gpu-0")]);
            s["spec"].as_object_mut().unwrap().remove("driver");
            s
        }),
        (
            "a valid claim",
            "resourceclaims",
            claim(
                "ok",
                json!({
            "deviceClassName": "gpu.gpushare.dev", "capacity": capacity}),
            ),
        ),
        (
            "a claim without deviceClassName",
            "resourceclaims",
            claim(
                "no-class",
                json!({
            "capacity": capacity}),
            ),
        ),
        (
            "a claim with a broken selector",
            "resourceclaims",
            claim(
                "bad-cel",
                json!({
            "deviceClassName": "gpu.gpushare.dev",
            "selectors": [{"cel": {"expression": "device.driver == "}}]}),
            ),
        ),
        (
            "a valid DeviceClass",
            "deviceclasses",
            json!({"apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass", "metadata": {"name": "gpu.gpushare.dev"},
            "spec": {"selectors": [{"cel": {"expression": "device.driver == \"gpu.gpushare.dev\""}}]}}),
        ),
        (
            "a DeviceClass with a broken selector",
            "deviceclasses",
            json!({"apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass", "metadata": {"name": "broken.gpushare.dev"},
            "spec": {"selectors": [{"cel": {"expression": "device.driver == "}}]}}),
        ),
        (
            "a pod without containers",
            "pods",
            json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "empty", "namespace": "default"}, "spec": {"containers": []}}),
        ),
    ]
}

/// The HTTP code of creating `object` (of `resource`) through `client`.
async fn create(client: &kube::Client, resource: &str, object: &Value) -> (u16, String) {
    let (group, version) = match object["apiVersion"].as_str().unwrap().split_once('/') {
        Some((group, version)) => (group, version),
        None => ("", object["apiVersion"].as_str().unwrap()),
    };
    let kind = object["kind"].as_str().unwrap();
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let ar = ApiResource::from_gvk_with_plural(&gvk, resource);
    let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let object: DynamicObject = serde_json::from_value(object.clone()).unwrap();
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => (201, String::new()),
        Err(kube::Error::Api(status)) => (status.code, status.message),
        Err(error) => panic!("{error}"),
    }
}

#[test]
fn the_fake_refuses_what_the_real_server_refuses_for_the_objects_we_write() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let real = ControlPlane::start().await.unwrap_or_else(|e| panic!("{e}"));
        let real_client = real.admin().await.unwrap();
        let fake = FakeApiServer::start().await.unwrap();
        let kubeconfig = real.dir().join("fake.kubeconfig");
        fake.write_kubeconfig(&kubeconfig).unwrap();
        let fake_client = kube_control_plane::client(&kubeconfig).await.unwrap();
        let mut differ = Vec::new();
        for (what, resource, object) in cases() {
            let (real_code, real_why) = create(&real_client, resource, &object).await;
            let (fake_code, fake_why) = create(&fake_client, resource, &object).await;
            if real_code != fake_code {
                differ.push(format!(
                    "{what}: the real server {real_code} {real_why:?}, the fake {fake_code} {fake_why:?}"
                ));
            }
        }
        assert!(differ.is_empty(), "{}", differ.join("\n"));
    });
}
