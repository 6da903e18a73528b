//! The fake API server's protocol, spoken raw over HTTP where the clients'
//! tests do not reach: discovery documents, watch resumption, bookmarks,
//! `sendInitialEvents`, compaction (410 for old watches and continue
//! tokens, automatically past the history limit), reading history with
//! `resourceVersionMatch=Exact`, `/status` on `PUT`, finalizers and
//! delete preconditions, watch events held back and released.

use crate::common;

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use common::Cluster;
use kube_fakes::apiserver::Options;
use serde_json::{Value, json};

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

/// One request; its status and JSON body.
fn call(c: &Cluster, method: &str, path: &str, body: Option<(&str, Value)>) -> (u16, Value) {
    let url = format!("{}{path}", c.api.url());
    let agent = agent();
    let response = match (method, body) {
        ("GET", _) => agent.get(&url).call(),
        ("DELETE", None) => agent.delete(&url).call(),
        ("DELETE", Some((kind, body))) => agent
            .delete(&url)
            .header("content-type", kind)
            .force_send_body()
            .send(body.to_string()),
        ("POST", Some((kind, body))) => agent
            .post(&url)
            .header("content-type", kind)
            .send(body.to_string()),
        ("PUT", Some((kind, body))) => agent
            .put(&url)
            .header("content-type", kind)
            .send(body.to_string()),
        ("PATCH", Some((kind, body))) => agent
            .patch(&url)
            .header("content-type", kind)
            .send(body.to_string()),
        other => panic!("no such call: {other:?}"),
    }
    .unwrap();
    let code = response.status().as_u16();
    let text = response.into_body().read_to_string().unwrap();
    (
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

const JSON: &str = "application/json";

fn create_cm(c: &Cluster, name: &str, labels: Value) -> Value {
    let (code, body) = call(
        c,
        "POST",
        "/api/v1/namespaces/default/configmaps",
        Some((JSON, json!({"metadata": {"name": name, "labels": labels}}))),
    );
    assert_eq!(code, 201, "{body}");
    body
}

/// Reads a watch until it ends or `wanted` events came; (type, name) each.
fn watch(c: &Cluster, path: &str, wanted: usize) -> (Vec<(String, String, Value)>, bool) {
    let url = format!("{}{path}", c.api.url());
    let response = agent().get(&url).call().unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let mut lines = BufReader::new(response.into_body().into_reader()).lines();
    let mut events = Vec::new();
    while events.len() < wanted {
        let Some(Ok(line)) = lines.next() else {
            return (events, true);
        };
        let event: Value = serde_json::from_str(&line).unwrap();
        events.push((
            event["type"].as_str().unwrap().to_owned(),
            event["object"]["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            event["object"].clone(),
        ));
    }
    (events, false)
}

fn kinds(events: &[(String, String, Value)]) -> Vec<(&str, &str)> {
    events
        .iter()
        .map(|(t, n, _)| (t.as_str(), n.as_str()))
        .collect()
}

#[test]
fn discovery_documents() {
    let c = Cluster::start("raw-discovery");
    let (_, core) = call(&c, "GET", "/api/v1", None);
    let pods = core["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "pods")
        .unwrap();
    assert_eq!(
        (&pods["kind"], &pods["namespaced"], &pods["shortNames"]),
        (&json!("Pod"), &json!(true), &json!(["po"]))
    );
    assert!(pods["verbs"].as_array().unwrap().contains(&json!("watch")));
    assert!(
        core["resources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["name"] == "pods/status")
    );
    let (_, groups) = call(&c, "GET", "/apis", None);
    assert!(
        groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["name"] == "resource.k8s.io"
                && g["preferredVersion"]["groupVersion"] == "resource.k8s.io/v1")
    );
    let (_, dra) = call(&c, "GET", "/apis/resource.k8s.io/v1", None);
    let names: Vec<&str> = dra["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "deviceclasses",
            "resourceclaims",
            "resourceclaims/status",
            "resourceclaimtemplates",
            "resourceslices"
        ]
    );
    let (code, missing) = call(&c, "GET", "/apis/nothing.example.com/v1/things", None);
    assert_eq!((code, &missing["kind"]), (404, &json!("Status")));
    // A cluster-scoped resource has no namespaced path.
    let (code, _) = call(&c, "GET", "/api/v1/namespaces/default/nodes", None);
    assert_eq!(code, 404);
}

#[test]
fn watches_resume_bookmark_and_send_initial_events() {
    let c = Cluster::start_with(
        "raw-watch",
        Options {
            bookmark_interval: Duration::from_millis(100),
            ..Options::default()
        },
    );
    let start = c.api.resource_version();
    create_cm(&c, "a", json!({}));
    create_cm(&c, "b", json!({}));
    call(
        &c,
        "DELETE",
        "/api/v1/namespaces/default/configmaps/b",
        None,
    );
    // No resourceVersion: the current objects only.
    let (events, _) = watch(
        &c,
        "/api/v1/namespaces/default/configmaps?watch=true&timeoutSeconds=1",
        10,
    );
    assert_eq!(kinds(&events), [("ADDED", "a")]);
    // From a resourceVersion: the history after it, on the `/watch/` path too.
    let (events, _) = watch(
        &c,
        &format!("/api/v1/watch/configmaps?resourceVersion={start}&timeoutSeconds=1"),
        3,
    );
    assert_eq!(
        kinds(&events),
        [("ADDED", "a"), ("ADDED", "b"), ("DELETED", "b")]
    );
    // Bookmarks, and the end of the stream at the timeout.
    let began = Instant::now();
    let (events, ended) = watch(
        &c,
        "/api/v1/watch/namespaces/default/configmaps/a?allowWatchBookmarks=true&timeoutSeconds=1",
        100,
    );
    assert!(ended && began.elapsed() < Duration::from_secs(5));
    assert_eq!(kinds(&events)[0], ("ADDED", "a"));
    let bookmark = &events.iter().find(|e| e.0 == "BOOKMARK").unwrap().2;
    assert_eq!(bookmark["kind"], "ConfigMap");
    assert_eq!(
        bookmark["metadata"]["resourceVersion"],
        c.api.resource_version().to_string()
    );
    // sendInitialEvents: the state, then a bookmark marking its end.
    let (events, _) = watch(
        &c,
        "/api/v1/configmaps?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true",
        2,
    );
    assert_eq!(events[0].1, "a");
    assert_eq!(
        events[1].2["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
    let (code, refused) = call(
        &c,
        "GET",
        "/api/v1/configmaps?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
        None,
    );
    assert_eq!((code, &refused["reason"]), (422, &json!("Invalid")));
}

/// Events held back (a lagging watch cache, for clients' tests) reach a
/// watch only when released, in order; lists see the store meanwhile.
#[test]
fn held_watch_events_arrive_in_order_when_released() {
    let c = Cluster::start("raw-held");
    let start = c.api.resource_version();
    let hold = c.api.hold_watch_events("configmaps");
    std::thread::scope(|s| {
        let (sent, received) = std::sync::mpsc::channel();
        let c = &c;
        s.spawn(move || {
            let path = format!("/api/v1/watch/configmaps?resourceVersion={start}&timeoutSeconds=5");
            let _ = sent.send(watch(c, &path, 2).0);
        });
        create_cm(c, "a", json!({}));
        create_cm(c, "b", json!({}));
        let (code, list) = call(c, "GET", "/api/v1/namespaces/default/configmaps", None);
        assert_eq!(
            (code, list["items"].as_array().map(Vec::len)),
            (200, Some(2))
        );
        assert!(
            received.recv_timeout(Duration::from_millis(500)).is_err(),
            "a held event was sent"
        );
        drop(hold);
        let events = received.recv_timeout(Duration::from_secs(4)).unwrap();
        assert_eq!(kinds(&events), [("ADDED", "a"), ("ADDED", "b")]);
    });
}

#[test]
fn compaction_expires_old_watches_and_continue_tokens() {
    let c = Cluster::start("raw-compaction");
    for name in ["a", "b", "c"] {
        create_cm(&c, name, json!({}));
    }
    let deleted_at = c.api.resource_version();
    call(
        &c,
        "DELETE",
        "/api/v1/namespaces/default/configmaps/b",
        None,
    );
    // History: the list as it was, before the deletion.
    let (_, then) = call(
        &c,
        "GET",
        &format!("/api/v1/configmaps?resourceVersion={deleted_at}&resourceVersionMatch=Exact"),
        None,
    );
    assert_eq!(then["items"].as_array().unwrap().len(), 3);
    // Pages read one snapshot, whatever happens between them.
    let (_, first) = call(&c, "GET", "/api/v1/configmaps?limit=1", None);
    assert_eq!(first["metadata"]["remainingItemCount"], 1);
    let token = first["metadata"]["continue"].as_str().unwrap().to_owned();
    create_cm(&c, "aa", json!({}));
    let (_, second) = call(
        &c,
        "GET",
        &format!("/api/v1/configmaps?limit=5&continue={token}"),
        None,
    );
    let names: Vec<&str> = second["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["c"]);
    assert_eq!(
        second["metadata"]["resourceVersion"],
        first["metadata"]["resourceVersion"]
    );
    c.api.compact();
    let (events, ended) = watch(
        &c,
        &format!("/api/v1/configmaps?watch=true&resourceVersion={deleted_at}"),
        2,
    );
    assert!(ended, "the watch ends after its ERROR");
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0, "ERROR");
    assert_eq!(
        (&events[0].2["code"], &events[0].2["reason"]),
        (&json!(410), &json!("Expired"))
    );
    let (code, expired) = call(
        &c,
        "GET",
        &format!("/api/v1/configmaps?limit=5&continue={token}"),
        None,
    );
    assert_eq!((code, &expired["reason"]), (410, &json!("Expired")));
    // Past the history limit, the oldest half goes by itself.
    let small = Cluster::start_with(
        "raw-history-limit",
        Options {
            history_limit: 4,
            ..Options::default()
        },
    );
    let from = small.api.resource_version();
    for n in 0..6 {
        create_cm(&small, &format!("h{n}"), json!({}));
    }
    let (events, ended) = watch(
        &small,
        &format!("/api/v1/configmaps?watch=true&resourceVersion={from}"),
        2,
    );
    assert!(ended && events[0].0 == "ERROR");
}

#[test]
fn status_is_a_subresource_of_its_own() {
    let c = Cluster::start("raw-status");
    let (code, pod) = call(
        &c,
        "POST",
        "/api/v1/namespaces/default/pods",
        Some((
            JSON,
            json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]},
                "status": {"phase": "Running"}}),
        )),
    );
    assert_eq!((code, &pod["status"]), (201, &json!({"phase": "Pending"})));
    let mut both = pod.clone();
    both["status"]["phase"] = json!("Failed");
    both["metadata"]["labels"] = json!({"x": "y"});
    let (_, main) = call(
        &c,
        "PUT",
        "/api/v1/namespaces/default/pods/p",
        Some((JSON, both.clone())),
    );
    assert_eq!(
        (&main["status"]["phase"], &main["metadata"]["labels"]["x"]),
        (&json!("Pending"), &json!("y"))
    );
    let mut status = main.clone();
    status["status"]["phase"] = json!("Running");
    status["metadata"]["labels"] = json!({});
    let (_, after) = call(
        &c,
        "PUT",
        "/api/v1/namespaces/default/pods/p/status",
        Some((JSON, status.clone())),
    );
    assert_eq!(
        (&after["status"]["phase"], &after["metadata"]["labels"]["x"]),
        (&json!("Running"), &json!("y"))
    );
    // The same write again, on an old resourceVersion: 409.
    let (code, conflict) = call(
        &c,
        "PUT",
        "/api/v1/namespaces/default/pods/p/status",
        Some((JSON, status)),
    );
    assert_eq!((code, &conflict["reason"]), (409, &json!("Conflict")));
    // Nodes have status too; config maps have none.
    let (code, _) = call(
        &c,
        "GET",
        "/api/v1/namespaces/default/configmaps/x/status",
        None,
    );
    assert_eq!(code, 404);
}

#[test]
fn deletes_honour_preconditions_and_finalizers() {
    let c = Cluster::start("raw-delete");
    let (_, object) = call(
        &c,
        "POST",
        "/api/v1/namespaces/default/configmaps",
        Some((
            JSON,
            json!({"metadata": {"generateName": "held-", "finalizers": ["example.com/x"]}}),
        )),
    );
    let name = object["metadata"]["name"].as_str().unwrap().to_owned();
    assert!(name.starts_with("held-") && name.len() == 10, "{name}");
    let path = format!("/api/v1/namespaces/default/configmaps/{name}");
    let (code, refused) = call(
        &c,
        "DELETE",
        &path,
        Some((JSON, json!({"preconditions": {"uid": "not-it"}}))),
    );
    assert_eq!((code, &refused["reason"]), (409, &json!("Conflict")));
    let (code, held) = call(&c, "DELETE", &path, None);
    assert_eq!(code, 202);
    assert!(held["metadata"]["deletionTimestamp"].is_string());
    let (code, gone) = call(
        &c,
        "PATCH",
        &path,
        Some((
            "application/merge-patch+json",
            json!({"metadata": {"finalizers": null}}),
        )),
    );
    assert_eq!(code, 200, "{gone}");
    assert!(c.api.get("configmaps", "default", &name).is_none());
    // A namespace takes what is in it.
    let (code, _) = call(
        &c,
        "POST",
        "/api/v1/namespaces",
        Some((JSON, json!({"metadata": {"name": "team"}}))),
    );
    assert_eq!(code, 201);
    let (code, _) = call(
        &c,
        "POST",
        "/api/v1/namespaces/team/configmaps",
        Some((JSON, json!({"metadata": {"name": "in"}}))),
    );
    assert_eq!(code, 201);
    let (code, missing) = call(
        &c,
        "POST",
        "/api/v1/namespaces/nowhere/configmaps",
        Some((JSON, json!({"metadata": {"name": "in"}}))),
    );
    assert_eq!(
        (code, &missing["message"]),
        (404, &json!("namespaces \"nowhere\" not found"))
    );
    call(&c, "DELETE", "/api/v1/namespaces/team", None);
    assert!(c.api.get("configmaps", "team", "in").is_none());
}
