//! The resources the fake serves, with what discovery says of them, and the
//! discovery documents built from that one table: `/version`, `/api`,
//! `/api/v1`, `/apis`, `/apis/<group>`, `/apis/<group>/<version>`, and an
//! OpenAPI v3 index whose PATCH operations declare `fieldValidation` and
//! `dryRun` (kubectl asks before it sends `fieldValidation=Strict`; it
//! builds client-side apply patches from its own types when a schema is
//! missing, as here).

use serde_json::{Value, json};

/// How a resource's names are checked on create.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NameRule {
    /// RFC 1123 subdomain: most resources.
    Subdomain,
    /// RFC 1123 label: namespaces.
    Label,
    /// RFC 1035 label (starts with a letter): services.
    Label1035,
    /// Only present: core/v1 events, unchecked upstream for compatibility.
    Any,
}

/// What a create does to the status of a resource that has a `/status`
/// subresource (the main resource never writes it afterwards).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InitialStatus {
    /// Kept as sent (nodes: the kubelet registers with one).
    Keep,
    /// Dropped.
    Clear,
    /// `{"phase": "Pending"}`.
    PodPending,
    /// `{"phase": "Active"}`.
    NamespaceActive,
}

/// One served resource.
#[derive(Debug)]
pub(crate) struct Resource {
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub singular: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    pub short_names: &'static [&'static str],
    pub categories: &'static [&'static str],
    /// `Some` when `/status` is a subresource of its own.
    pub status: Option<InitialStatus>,
    pub names: NameRule,
    /// Field selector labels beyond `metadata.name` and `metadata.namespace`.
    pub fields: &'static [&'static str],
    /// Whether `metadata.generation` is kept (and raised on spec changes).
    pub generation: bool,
    /// Whether a delete answers with the object (else a success `Status`),
    /// as that resource's registry does: the OpenAPI (and the clients made
    /// from it) name the object as the answer of its `DELETE`.
    pub returns_deleted: bool,
}

impl Resource {
    /// `v1` or `group/version`.
    pub(crate) fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Whether `label` may be used in a field selector.
    pub(crate) fn selectable(&self, label: &str) -> bool {
        label == "metadata.name"
            || (label == "metadata.namespace" && self.namespaced)
            || self.fields.contains(&label)
    }
}

const POD_FIELDS: &[&str] = &[
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
];

const EVENT_FIELDS: &[&str] = &[
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
];

const fn resource(
    group: &'static str,
    plural: &'static str,
    singular: &'static str,
    kind: &'static str,
    namespaced: bool,
) -> Resource {
    Resource {
        group,
        version: "v1",
        plural,
        singular,
        kind,
        namespaced,
        short_names: &[],
        categories: &[],
        status: None,
        names: NameRule::Subdomain,
        fields: &[],
        generation: false,
        returns_deleted: false,
    }
}

/// Every served resource. Plurals are unique, so a plural alone names a
/// resource in the store.
pub(crate) static RESOURCES: &[Resource] = &[
    Resource {
        short_names: &["ns"],
        status: Some(InitialStatus::NamespaceActive),
        names: NameRule::Label,
        fields: &["status.phase"],
        ..resource("", "namespaces", "namespace", "Namespace", false)
    },
    Resource {
        short_names: &["no"],
        status: Some(InitialStatus::Keep),
        fields: &["spec.unschedulable"],
        ..resource("", "nodes", "node", "Node", false)
    },
    Resource {
        short_names: &["po"],
        categories: &["all"],
        status: Some(InitialStatus::PodPending),
        fields: POD_FIELDS,
        generation: true,
        returns_deleted: true,
        ..resource("", "pods", "pod", "Pod", true)
    },
    Resource {
        short_names: &["cm"],
        ..resource("", "configmaps", "configmap", "ConfigMap", true)
    },
    Resource {
        fields: &["type"],
        ..resource("", "secrets", "secret", "Secret", true)
    },
    Resource {
        short_names: &["svc"],
        categories: &["all"],
        status: Some(InitialStatus::Clear),
        names: NameRule::Label1035,
        returns_deleted: true,
        ..resource("", "services", "service", "Service", true)
    },
    Resource {
        short_names: &["sa"],
        returns_deleted: true,
        ..resource(
            "",
            "serviceaccounts",
            "serviceaccount",
            "ServiceAccount",
            true,
        )
    },
    Resource {
        short_names: &["ev"],
        names: NameRule::Any,
        fields: EVENT_FIELDS,
        ..resource("", "events", "event", "Event", true)
    },
    Resource {
        short_names: &["deploy"],
        categories: &["all"],
        status: Some(InitialStatus::Clear),
        generation: true,
        ..resource("apps", "deployments", "deployment", "Deployment", true)
    },
    Resource {
        short_names: &["ds"],
        categories: &["all"],
        status: Some(InitialStatus::Clear),
        generation: true,
        ..resource("apps", "daemonsets", "daemonset", "DaemonSet", true)
    },
    Resource {
        generation: true,
        returns_deleted: true,
        ..resource(
            "resource.k8s.io",
            "deviceclasses",
            "deviceclass",
            "DeviceClass",
            false,
        )
    },
    Resource {
        status: Some(InitialStatus::Clear),
        generation: true,
        returns_deleted: true,
        ..resource(
            "resource.k8s.io",
            "resourceclaims",
            "resourceclaim",
            "ResourceClaim",
            true,
        )
    },
    Resource {
        generation: true,
        returns_deleted: true,
        ..resource(
            "resource.k8s.io",
            "resourceclaimtemplates",
            "resourceclaimtemplate",
            "ResourceClaimTemplate",
            true,
        )
    },
    Resource {
        fields: &["spec.nodeName", "spec.driver"],
        generation: true,
        returns_deleted: true,
        ..resource(
            "resource.k8s.io",
            "resourceslices",
            "resourceslice",
            "ResourceSlice",
            false,
        )
    },
];

/// The resource `plural` of `group`/`version`.
pub(crate) fn find(group: &str, version: &str, plural: &str) -> Option<&'static Resource> {
    RESOURCES
        .iter()
        .find(|r| r.group == group && r.version == version && r.plural == plural)
}

/// The resource stored under `plural`.
pub(crate) fn by_plural(plural: &str) -> Option<&'static Resource> {
    RESOURCES.iter().find(|r| r.plural == plural)
}

/// The served groups other than the core one, in table order.
fn groups() -> Vec<&'static str> {
    let mut groups: Vec<&str> = Vec::new();
    for r in RESOURCES {
        if !r.group.is_empty() && !groups.contains(&r.group) {
            groups.push(r.group);
        }
    }
    groups
}

/// The Kubernetes version the fake says it is.
pub(crate) fn version() -> Value {
    json!({
        "major": "1", "minor": "37", "emulationMajor": "1", "emulationMinor": "37",
        "minCompatibilityMajor": "1", "minCompatibilityMinor": "36",
        "gitVersion": "v1.37.0", "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.25.0", "compiler": "gc", "platform": "linux/amd64",
    })
}

/// `/api`.
pub(crate) fn core_versions(server: &str) -> Value {
    json!({
        "kind": "APIVersions", "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server}],
    })
}

fn group_doc(group: &str) -> Value {
    let gv = json!({"groupVersion": format!("{group}/v1"), "version": "v1"});
    json!({"name": group, "versions": [gv.clone()], "preferredVersion": gv})
}

/// `/apis`.
pub(crate) fn group_list() -> Value {
    let groups: Vec<Value> = groups().into_iter().map(group_doc).collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `/apis/<group>`, if served.
pub(crate) fn group(group: &str) -> Option<Value> {
    groups().contains(&group).then(|| {
        let mut doc = group_doc(group);
        doc["kind"] = json!("APIGroup");
        doc["apiVersion"] = json!("v1");
        doc
    })
}

/// `/api/v1` or `/apis/<group>/<version>`, if served.
pub(crate) fn resource_list(group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for r in RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        resources.push(json!({
            "name": r.plural, "singularName": r.singular, "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
            "shortNames": r.short_names, "categories": r.categories,
        }));
        if r.status.is_some() {
            resources.push(json!({
                "name": format!("{}/status", r.plural), "singularName": "",
                "namespaced": r.namespaced, "kind": r.kind, "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if resources.is_empty() {
        return None;
    }
    let group_version = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    Some(json!({
        "kind": "APIResourceList", "apiVersion": "v1",
        "groupVersion": group_version, "resources": resources,
    }))
}

/// `/openapi/v3`: one document per served group version.
pub(crate) fn openapi_index() -> Value {
    let mut paths = serde_json::Map::new();
    paths.insert(
        "api/v1".to_owned(),
        json!({"serverRelativeURL": "/openapi/v3/api/v1?hash=fake"}),
    );
    for group in groups() {
        paths.insert(
            format!("apis/{group}/v1"),
            json!({"serverRelativeURL": format!("/openapi/v3/apis/{group}/v1?hash=fake")}),
        );
    }
    json!({"paths": paths})
}

/// `/openapi/v3/<path>`: the write operations of each resource and the query
/// parameters they take; no schemas.
pub(crate) fn openapi(path: &str) -> Option<Value> {
    let (group, version) = match path.split('/').collect::<Vec<_>>().as_slice() {
        ["api", version] => ("", (*version).to_owned()),
        ["apis", group, version] => (*group, (*version).to_owned()),
        _ => return None,
    };
    let param = |name: &str| json!({"name": name, "in": "query", "schema": {"type": "string"}});
    let mut paths = serde_json::Map::new();
    for r in RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        let gvk = json!({"group": r.group, "version": r.version, "kind": r.kind});
        let op = |action: &str| {
            json!({
                "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": gvk,
                "parameters": [param("dryRun"), param("fieldManager"), param("fieldValidation"), param("force")],
                "responses": {"200": {"description": "OK"}},
            })
        };
        let base = if r.group.is_empty() {
            "/api/v1".to_owned()
        } else {
            format!("/apis/{}/{}", r.group, r.version)
        };
        let scope = if r.namespaced {
            "/namespaces/{namespace}"
        } else {
            ""
        };
        paths.insert(
            format!("{base}{scope}/{}", r.plural),
            json!({"post": op("post")}),
        );
        paths.insert(
            format!("{base}{scope}/{}/{{name}}", r.plural),
            json!({"put": op("put"), "patch": op("patch"), "delete": op("delete")}),
        );
    }
    if paths.is_empty() {
        return None;
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.37.0"},
        "paths": paths,
        "components": {"schemas": {}},
    }))
}
