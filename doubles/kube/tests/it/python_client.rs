//! The official Python client (`pip install kubernetes`) against the fake
//! API server: list with selectors and pages, `watch.Watch().stream`,
//! create, strategic and server-side-apply patches, status, errors as
//! `ApiException`s with `Status` bodies, a 410 ending a watch, delete.

use crate::common;

use std::process::Command;

use common::Cluster;
use kube_fakes::apiserver::Options;

const SCRIPT: &str = r#"
import json, sys, threading, time
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

config.load_kube_config(config_file=sys.argv[1])
v1 = client.CoreV1Api()
ns = "default"

def cm(name, labels=None, data=None):
    return client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name, labels=labels), data=data)

def status_of(call):
    try:
        call()
    except ApiException as e:
        return e.status, json.loads(e.body)
    raise AssertionError("expected an ApiException")

# Create and list, with a selector and in pages.
for i in range(5):
    v1.create_namespaced_config_map(ns, cm(f"py-{i}", {"app": "py"}, {"i": str(i)}))
v1.create_namespaced_config_map(ns, cm("other"))
names = [c.metadata.name for c in
         v1.list_namespaced_config_map(ns, label_selector="app=py").items]
assert names == [f"py-{i}" for i in range(5)], names
seen, token = [], None
while True:
    page = v1.list_namespaced_config_map(ns, limit=2, _continue=token)
    seen += [c.metadata.name for c in page.items]
    token = page.metadata._continue
    if not token:
        break
assert seen == ["other"] + [f"py-{i}" for i in range(5)], seen

# Errors are ApiExceptions carrying Status objects.
code, body = status_of(lambda: v1.read_namespaced_config_map("nothere", ns))
assert (code, body["kind"], body["reason"]) == (404, "Status", "NotFound"), body
code, body = status_of(lambda: v1.create_namespaced_config_map(ns, cm("py-0")))
assert (code, body["reason"]) == (409, "AlreadyExists"), body
code, body = status_of(lambda: v1.create_namespaced_config_map(ns, cm("No_Good")))
assert (code, body["reason"]) == (422, "Invalid"), body
assert body["details"]["causes"][0]["field"] == "metadata.name", body
code, body = status_of(lambda: v1.list_namespaced_config_map(ns, label_selector="a in"))
assert (code, body["reason"]) == (400, "BadRequest"), body
stale = v1.read_namespaced_config_map("py-0", ns)
v1.patch_namespaced_config_map("py-0", ns, {"data": {"i": "zero"}})
stale.data = {"i": "lost"}
code, body = status_of(lambda: v1.replace_namespaced_config_map("py-0", ns, stale))
assert (code, body["reason"]) == (409, "Conflict"), body

# A dry run stores nothing.
v1.create_namespaced_config_map(ns, cm("dry"), dry_run="All")
assert status_of(lambda: v1.read_namespaced_config_map("dry", ns))[0] == 404

# Watch: the current objects, then what happens, until stopped.
def writer():
    time.sleep(0.5)
    v1.create_namespaced_config_map(ns, cm("py-new", {"app": "py"}))
    v1.patch_namespaced_config_map("py-new", ns, {"data": {"x": "1"}})
    v1.patch_namespaced_config_map("py-4", ns, {"metadata": {"labels": {"app": "gone"}}})
    v1.delete_namespaced_config_map("py-new", ns)
threading.Thread(target=writer).start()
events = []
w = watch.Watch()
for event in w.stream(v1.list_namespaced_config_map, ns, label_selector="app=py",
                      timeout_seconds=20):
    events.append((event["type"], event["object"].metadata.name))
    if events[-1] == ("DELETED", "py-new"):
        w.stop()
assert events == [("ADDED", f"py-{i}") for i in range(5)] + [
    ("ADDED", "py-new"), ("MODIFIED", "py-new"), ("DELETED", "py-4"),
    ("DELETED", "py-new")], events

# A pod: strategic merge by container name; status through its subresource.
pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {
    "containers": [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:1"}]}}
v1.create_namespaced_pod(ns, pod)
v1.patch_namespaced_pod("p", ns, {"spec": {"containers": [{"name": "b", "image": "b:2"}]}})
got = v1.read_namespaced_pod("p", ns)
assert [(c.name, c.image) for c in got.spec.containers] == [("a", "a:1"), ("b", "b:2")]
assert got.status.phase == "Pending"
v1.patch_namespaced_pod_status("p", ns, {"status": {"phase": "Running"}})
assert v1.read_namespaced_pod("p", ns).status.phase == "Running"

# Server-side apply from two managers.
apply = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"},
         "data": {"k": "a"}}
v1.patch_namespaced_config_map("ssa", ns, apply, field_manager="one",
                               _content_type="application/apply-patch+yaml")
apply["data"]["k"] = "b"
code, body = status_of(lambda: v1.patch_namespaced_config_map(
    "ssa", ns, apply, field_manager="two",
    _content_type="application/apply-patch+yaml"))
assert (code, body["reason"]) == (409, "Conflict"), body
assert body["details"]["causes"][0]["field"] == ".data.k", body
v1.patch_namespaced_config_map("ssa", ns, apply, field_manager="two", force=True,
                               _content_type="application/apply-patch+yaml")
assert v1.read_namespaced_config_map("ssa", ns).data == {"k": "b"}

# Delete: the pod goes; a collection by label.
v1.delete_namespaced_pod("p", ns)
assert status_of(lambda: v1.read_namespaced_pod("p", ns))[0] == 404
v1.delete_collection_namespaced_config_map(ns, label_selector="app=py")
assert v1.list_namespaced_config_map(ns, label_selector="app=py").items == []

# A watch from a compacted resourceVersion gets an ERROR 410 and ends.
rv = v1.list_namespaced_config_map(ns).metadata.resource_version
v1.create_namespaced_config_map(ns, cm("after"))
print("COMPACT", flush=True)
sys.stdin.readline()
resp = v1.list_namespaced_config_map(ns, watch=True, resource_version=rv,
                                     _preload_content=False)
lines = [json.loads(l) for l in resp.read().decode().splitlines() if l]
assert [l["type"] for l in lines] == ["ERROR"], lines
assert (lines[0]["object"]["code"], lines[0]["object"]["reason"]) == (410, "Expired"), lines
print("OK")
"#;

#[test]
fn the_official_python_client_works_against_the_fake() {
    use std::io::{BufRead, BufReader, Write};
    let python = common::python_client();
    let c = Cluster::start_with(
        "python-client",
        Options {
            bookmark_interval: std::time::Duration::from_millis(200),
            ..Options::default()
        },
    );
    let script = c.file("client.py", SCRIPT);
    let mut child = Command::new(python)
        .arg(&script)
        .arg(&c.kubeconfig)
        .env("HOME", &c.dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    if line.trim() == "COMPACT" {
        c.api.compact();
        writeln!(child.stdin.take().unwrap(), "go").unwrap();
        line.clear();
        stdout.read_line(&mut line).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success() && line.trim() == "OK",
        "the Python client's script failed ({}): {line}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
