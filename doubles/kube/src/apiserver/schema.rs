//! How the lists of the served types merge, from their Go types' markers:
//! the strategic-merge-patch strategy (`patchStrategy`, `patchMergeKey`)
//! and the server-side-apply list type (`listType`, `listMapKey`). A list
//! not named here is atomic for both (replaced whole), as a list without
//! markers is upstream. Paths are field names joined by dots, list
//! positions left out (`spec.containers.env`).

/// How server-side apply treats a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ListType {
    /// Items identified by these keys, merged item by item.
    Map(&'static [&'static str]),
    /// Scalars, each owned on its own.
    Set,
    /// Replaced whole.
    Atomic,
}

/// How a strategic merge patch treats a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    /// Items merged by this key.
    MergeKey(&'static str),
    /// Scalars merged as a set.
    MergeSet,
    /// Replaced whole.
    Replace,
}

/// A list's two behaviours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ListMeta {
    pub apply: ListType,
    pub patch: Strategy,
}

const ATOMIC: ListMeta = ListMeta {
    apply: ListType::Atomic,
    patch: Strategy::Replace,
};

const fn keyed(keys: &'static [&'static str], merge: Option<&'static str>) -> ListMeta {
    ListMeta {
        apply: ListType::Map(keys),
        patch: match merge {
            Some(key) => Strategy::MergeKey(key),
            None => Strategy::Replace,
        },
    }
}

const NAME: &[&str] = &["name"];
const TYPE: &[&str] = &["type"];

/// Lists of a pod spec, relative to it.
fn pod_spec(path: &str) -> Option<ListMeta> {
    let container = |rest: &str| match rest {
        "ports" => Some(keyed(&["containerPort", "protocol"], Some("containerPort"))),
        "env" => Some(keyed(NAME, Some("name"))),
        "volumeMounts" => Some(keyed(&["mountPath"], Some("mountPath"))),
        "volumeDevices" => Some(keyed(&["devicePath"], Some("devicePath"))),
        "resources.claims" => Some(keyed(NAME, None)),
        _ => None,
    };
    for list in ["containers.", "initContainers.", "ephemeralContainers."] {
        if let Some(rest) = path.strip_prefix(list) {
            return container(rest);
        }
    }
    Some(match path {
        "containers" | "initContainers" | "ephemeralContainers" => keyed(NAME, Some("name")),
        "volumes" | "imagePullSecrets" | "resourceClaims" | "schedulingGates" => {
            keyed(NAME, Some("name"))
        }
        "hostAliases" => keyed(&["ip"], Some("ip")),
        "topologySpreadConstraints" => {
            keyed(&["topologyKey", "whenUnsatisfiable"], Some("topologyKey"))
        }
        _ => return None,
    })
}

/// The list at `path` of an object of `kind`.
pub(crate) fn list(kind: &str, path: &str) -> ListMeta {
    lookup(kind, path).unwrap_or(ATOMIC)
}

fn lookup(kind: &str, path: &str) -> Option<ListMeta> {
    match path {
        "metadata.finalizers" => {
            return Some(ListMeta {
                apply: ListType::Set,
                patch: Strategy::MergeSet,
            });
        }
        "metadata.ownerReferences" => return Some(keyed(&["uid"], Some("uid"))),
        _ => {}
    }
    let template = match kind {
        "Pod" => path.strip_prefix("spec."),
        "Deployment" | "DaemonSet" => path.strip_prefix("spec.template.spec."),
        _ => None,
    };
    if let Some(meta) = template.and_then(pod_spec) {
        return Some(meta);
    }
    Some(match (kind, path) {
        ("Pod", "status.conditions") => keyed(TYPE, Some("type")),
        ("Pod", "status.podIPs") | ("Pod", "status.hostIPs") => keyed(&["ip"], Some("ip")),
        ("Pod", "status.resourceClaimStatuses") => keyed(NAME, Some("name")),
        ("Node", "status.conditions") => keyed(TYPE, Some("type")),
        ("Node", "status.addresses") => ListMeta {
            apply: ListType::Atomic,
            patch: Strategy::MergeKey("type"),
        },
        ("Deployment" | "DaemonSet", "status.conditions") => keyed(TYPE, Some("type")),
        ("Service", "spec.ports") => keyed(&["port", "protocol"], Some("port")),
        ("ResourceClaim", "status.reservedFor") => keyed(&["uid"], Some("uid")),
        ("ResourceClaim", "status.devices") => {
            keyed(&["driver", "device", "pool", "shareID"], None)
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        assert_eq!(
            list("Pod", "spec.containers").patch,
            Strategy::MergeKey("name")
        );
        assert_eq!(
            list("Deployment", "spec.template.spec.containers.env").apply,
            ListType::Map(&["name"])
        );
        assert_eq!(list("Pod", "spec.tolerations"), ATOMIC);
        assert_eq!(
            list("ConfigMap", "metadata.finalizers").apply,
            ListType::Set
        );
        assert_eq!(list("Pod", "spec.containers.args"), ATOMIC);
    }
}
