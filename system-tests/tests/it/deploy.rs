//! Every object in deploy/ parses into its k8s-openapi type (unknown fields
//! refused), and the kustomizations render where kubectl is installed.

use std::path::{Path, PathBuf};

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate};
use serde::Deserialize;
use serde_json::Value;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Parses one object as the type its kind names; returns the kind.
fn check(object: Value, origin: &str) -> String {
    let kind = object["kind"].as_str().unwrap_or_default().to_owned();
    fn strict<T: serde::de::DeserializeOwned + serde::Serialize>(object: &Value, origin: &str) {
        let typed: T =
            serde_json::from_value(object.clone()).unwrap_or_else(|e| panic!("{origin}: {e}"));
        // Round trip: a field the type does not know would be lost.
        let back = serde_json::to_value(&typed).unwrap();
        assert_eq!(&back, object, "{origin}: fields lost in parsing");
    }
    match kind.as_str() {
        "Namespace" => strict::<Namespace>(&object, origin),
        "ServiceAccount" => strict::<ServiceAccount>(&object, origin),
        "Service" => strict::<Service>(&object, origin),
        "ClusterRole" => strict::<ClusterRole>(&object, origin),
        "ClusterRoleBinding" => strict::<ClusterRoleBinding>(&object, origin),
        "DaemonSet" => strict::<DaemonSet>(&object, origin),
        "DeviceClass" => strict::<DeviceClass>(&object, origin),
        "ResourceClaimTemplate" => strict::<ResourceClaimTemplate>(&object, origin),
        "Pod" => strict::<Pod>(&object, origin),
        "ValidatingAdmissionPolicy" => strict::<ValidatingAdmissionPolicy>(&object, origin),
        "ValidatingAdmissionPolicyBinding" => {
            strict::<ValidatingAdmissionPolicyBinding>(&object, origin);
        }
        other => panic!("{origin}: no check for kind {other:?}"),
    }
    kind
}

fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

#[test]
fn every_object_parses_into_its_type() {
    let mut kinds = Vec::new();
    for dir in ["base", "example", "device-plugin"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(deploy().join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .filter(|p| p.file_name().is_some_and(|n| n != "kustomization.yaml"))
            .collect();
        files.sort();
        for file in files {
            for object in documents(&std::fs::read_to_string(&file).unwrap()) {
                kinds.push(check(object, &file.display().to_string()));
            }
        }
    }
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "DaemonSet",
            "DeviceClass",
            "Namespace",
            "Pod",
            "ResourceClaimTemplate",
            "Service",
            "ServiceAccount",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicyBinding",
        ]
    );
}

#[test]
fn the_example_asks_for_4gib_and_30_percent_of_our_class() {
    let text =
        std::fs::read_to_string(deploy().join("example/resourceclaimtemplate.yaml")).unwrap();
    let template: ResourceClaimTemplate =
        serde_json::from_value(documents(&text).remove(0)).unwrap();
    let spec = template.spec.unwrap().spec.unwrap();
    let request = &spec.devices.unwrap().requests.unwrap()[0];
    let exactly = request.exactly.as_ref().unwrap();
    assert_eq!(exactly.device_class_name, hypervisor_kubernetes::DRIVER);
    let asked = exactly
        .capacity
        .as_ref()
        .unwrap()
        .requests
        .as_ref()
        .unwrap();
    assert_eq!(
        hypervisor_kubernetes::quantity::parse(&asked["memory"].0),
        Some(4 << 30)
    );
    assert_eq!(asked["compute"].0, "30");
}

#[test]
fn kustomizations_render_with_upstream_kubectl() {
    let kubectl = kube_fakes::clients::kubectl().unwrap_or_else(|e| panic!("{e}"));
    for dir in ["base", "example", "device-plugin"] {
        let out = std::process::Command::new(kubectl)
            .args(["kustomize"])
            .arg(deploy().join(dir))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let rendered = documents(&String::from_utf8(out.stdout).unwrap());
        assert!(!rendered.is_empty());
        for object in rendered {
            check(object, &format!("kubectl kustomize {dir}"));
        }
    }
}

#[test]
fn the_device_plugin_overlay_patches_the_base_daemonset() {
    let text = std::fs::read_to_string(deploy().join("device-plugin/kustomization.yaml")).unwrap();
    let kustomization = documents(&text).remove(0);
    assert_eq!(kustomization["resources"][0], "../base");
    let patch = kustomization["patches"][0]["patch"].as_str().unwrap();
    let ops: Vec<Value> = serde_yaml::from_str(patch).unwrap();
    // Applied to the base DaemonSet, the JSON patch gives a valid DaemonSet.
    let base = std::fs::read_to_string(deploy().join("base/daemonset.yaml")).unwrap();
    let mut daemonset = documents(&base).remove(0);
    for op in &ops {
        assert_eq!(op["op"], "add");
        let path = op["path"].as_str().unwrap().strip_suffix("/-").unwrap();
        daemonset
            .pointer_mut(path)
            .and_then(Value::as_array_mut)
            .unwrap_or_else(|| panic!("no list at {path}"))
            .push(op["value"].clone());
    }
    check(daemonset.clone(), "device-plugin overlay");
    let typed: DaemonSet = serde_json::from_value(daemonset).unwrap();
    let pod = typed.spec.template.spec.unwrap();
    let args = pod.containers[0].args.clone().unwrap();
    assert!(
        args.contains(&"--device-plugin".to_owned()) && args.contains(&"--kubernetes".to_owned())
    );
    let mounts = pod.containers[0].volume_mounts.clone().unwrap();
    assert!(
        mounts
            .iter()
            .any(|m| m.mount_path == "/var/lib/kubelet/device-plugins")
    );
    assert!(
        mounts
            .iter()
            .any(|m| m.mount_path == "/var/lib/kubelet/pod-resources")
    );
}
