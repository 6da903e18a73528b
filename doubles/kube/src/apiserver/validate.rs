//! What the API server's validation refuses with 422, for the served
//! types: names (RFC 1123 subdomains, RFC 1123 labels for namespaces, RFC
//! 1035 labels for services), generateName prefixes, label and annotation
//! keys and values, finalizers, the required fields of pods, workloads,
//! config maps, secrets, services and resource slices, the immutable parts
//! of pods and resource claims; the DRA objects' own rules in [`dra_rules`].

use serde_json::Value;

use super::dra_rules;
use super::resources::{NameRule, Resource};
use super::status::Cause;
use crate::names::{label_ok, label_value, qualified_name, subdomain};

const LABEL: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const LABEL_1035: &str = "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')";
const LABEL_VALUE: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
const CONFIG_KEY: &str = "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')";

fn name(rule: NameRule, s: &str) -> Result<(), String> {
    match rule {
        NameRule::Any => Ok(()),
        NameRule::Subdomain => subdomain(s),
        NameRule::Label if s.len() > 63 => Err("must be no more than 63 characters".to_owned()),
        NameRule::Label if label_ok(s) => Ok(()),
        NameRule::Label => Err(LABEL.to_owned()),
        NameRule::Label1035 if s.len() > 63 => Err("must be no more than 63 characters".to_owned()),
        NameRule::Label1035 if label_ok(s) && s.as_bytes()[0].is_ascii_lowercase() => Ok(()),
        NameRule::Label1035 => Err(LABEL_1035.to_owned()),
    }
}

/// The causes that refuse `object`'s metadata on create (with the name it
/// will have).
pub(crate) fn create_metadata(r: &Resource, object: &Value, causes: &mut Vec<Cause>) {
    let meta = &object["metadata"];
    let generate = meta
        .get("generateName")
        .and_then(Value::as_str)
        .filter(|g| !g.is_empty());
    match meta.get("name").and_then(Value::as_str) {
        Some(n) if !n.is_empty() => {
            if let Err(why) = name(r.names, n) {
                causes.push(Cause::invalid("metadata.name", n, &why));
            }
        }
        _ => causes.push(Cause::required(
            "metadata.name",
            "name or generateName is required",
        )),
    }
    if let Some(prefix) = generate {
        let trimmed = prefix.strip_suffix('-').unwrap_or(prefix);
        if let Err(why) = name(r.names, trimmed) {
            causes.push(Cause::invalid("metadata.generateName", prefix, &why));
        }
    }
}

/// The causes that refuse `object`'s metadata on any write.
pub(crate) fn metadata(object: &Value, causes: &mut Vec<Cause>) {
    let meta = &object["metadata"];
    if let Some(labels) = meta.get("labels").and_then(Value::as_object) {
        for (k, v) in labels {
            if let Err(why) = qualified_name(k) {
                causes.push(Cause::invalid("metadata.labels", k, &why));
            }
            match v.as_str() {
                Some(s) if label_value(s) => {}
                _ => causes.push(Cause::invalid(
                    &format!("metadata.labels.{k}"),
                    v.as_str().unwrap_or_default(),
                    LABEL_VALUE,
                )),
            }
        }
    }
    if let Some(annotations) = meta.get("annotations").and_then(Value::as_object) {
        for (k, v) in annotations {
            if let Err(why) = qualified_name(k) {
                causes.push(Cause::invalid("metadata.annotations", k, &why));
            }
            if !v.is_string() {
                causes.push(Cause::invalid(
                    &format!("metadata.annotations.{k}"),
                    &v.to_string(),
                    "must be a string",
                ));
            }
        }
    }
    if let Some(finalizers) = meta.get("finalizers").and_then(Value::as_array) {
        for f in finalizers {
            let text = f.as_str().unwrap_or_default();
            if let Err(why) = qualified_name(text) {
                causes.push(Cause::invalid("metadata.finalizers", text, &why));
            }
        }
    }
}

fn containers(at: &str, spec: &Value, causes: &mut Vec<Cause>) {
    let list = spec
        .get("containers")
        .and_then(Value::as_array)
        .filter(|c| !c.is_empty());
    let Some(list) = list else {
        causes.push(Cause::required(&format!("{at}.containers"), ""));
        return;
    };
    let mut seen = Vec::new();
    for (i, c) in list.iter().enumerate() {
        let here = format!("{at}.containers[{i}]");
        match c.get("name").and_then(Value::as_str) {
            None | Some("") => causes.push(Cause::required(&format!("{here}.name"), "")),
            Some(n) => {
                if !label_ok(n) {
                    causes.push(Cause::invalid(&format!("{here}.name"), n, LABEL));
                }
                if seen.contains(&n) {
                    causes.push(Cause::duplicate(&format!("{here}.name"), n));
                }
                seen.push(n);
            }
        }
        if c.get("image")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            causes.push(Cause::required(&format!("{here}.image"), ""));
        }
    }
}

fn config_keys(object: &Value, causes: &mut Vec<Cause>) {
    for field in ["data", "binaryData", "stringData"] {
        for key in object
            .get(field)
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            .map(|(k, _)| k)
        {
            let good = !key.is_empty()
                && key.len() <= 253
                && key
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
            if !good {
                causes.push(Cause::invalid(&format!("{field}[{key}]"), key, CONFIG_KEY));
            }
        }
    }
}

fn workload(object: &Value, causes: &mut Vec<Cause>) {
    let selector = object.pointer("/spec/selector");
    if selector.is_none_or(Value::is_null) {
        causes.push(Cause::required("spec.selector", ""));
    }
    let labels = object.pointer("/spec/template/metadata/labels");
    if let Some(Value::Object(wanted)) = selector.and_then(|s| s.get("matchLabels")) {
        let matches = wanted
            .iter()
            .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v));
        if !matches {
            causes.push(Cause::invalid(
                "spec.template.metadata.labels",
                &labels.map(Value::to_string).unwrap_or_default(),
                "`selector` does not match template `labels`",
            ));
        }
    }
    containers(
        "spec.template.spec",
        object
            .pointer("/spec/template/spec")
            .unwrap_or(&Value::Null),
        causes,
    );
}

fn slice(object: &Value, causes: &mut Vec<Cause>) {
    let spec = &object["spec"];
    match spec.get("driver").and_then(Value::as_str) {
        None | Some("") => causes.push(Cause::required("spec.driver", "")),
        Some(d) => {
            if let Err(why) = subdomain(d) {
                causes.push(Cause::invalid("spec.driver", d, &why));
            }
        }
    }
    if spec
        .pointer("/pool/name")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        causes.push(Cause::required("spec.pool.name", ""));
    }
    if spec
        .pointer("/pool/resourceSliceCount")
        .and_then(Value::as_i64)
        .is_none_or(|n| n < 1)
    {
        causes.push(Cause::required(
            "spec.pool.resourceSliceCount",
            "must be greater than zero",
        ));
    }
    let placed = [
        "nodeName",
        "nodeSelector",
        "allNodes",
        "perDeviceNodeSelection",
    ]
    .iter()
    .filter(|k| spec.get(**k).is_some_and(|v| !v.is_null() && *v != false))
    .count();
    if placed != 1 {
        causes.push(Cause::required(
            "spec",
            "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required",
        ));
    }
}

/// The causes that refuse `object`'s content (create and update).
pub(crate) fn content(r: &Resource, object: &Value, causes: &mut Vec<Cause>) {
    match r.kind {
        "Pod" => containers("spec", object.get("spec").unwrap_or(&Value::Null), causes),
        "Deployment" | "DaemonSet" => workload(object, causes),
        "ConfigMap" | "Secret" => config_keys(object, causes),
        "ResourceSlice" => {
            slice(object, causes);
            dra_rules::slice_devices(&object["spec"], causes);
        }
        "ResourceClaim" => dra_rules::claim_spec("spec", &object["spec"], causes),
        "ResourceClaimTemplate" => {
            dra_rules::claim_spec("spec.spec", &object["spec"]["spec"], causes);
        }
        "DeviceClass" => dra_rules::device_class(object, causes),
        "Service" => {
            let spec = &object["spec"];
            let headless = spec.get("clusterIP").and_then(Value::as_str) == Some("None");
            let external = spec.get("type").and_then(Value::as_str) == Some("ExternalName");
            let ports = spec
                .get("ports")
                .and_then(Value::as_array)
                .is_some_and(|p| !p.is_empty());
            if !ports && !headless && !external {
                causes.push(Cause::required("spec.ports", ""));
            }
        }
        _ => {}
    }
}

/// The pod spec fields an update may change.
const POD_MUTABLE: &str = "pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)";

/// The causes that refuse an update of `old` to `new`.
pub(crate) fn update(r: &Resource, old: &Value, new: &Value, causes: &mut Vec<Cause>) {
    match r.kind {
        "Pod" => {
            let mut allowed = old.get("spec").cloned().unwrap_or(Value::Null);
            let wanted = new.get("spec").cloned().unwrap_or(Value::Null);
            for list in ["containers", "initContainers"] {
                let (Some(mine), Some(theirs)) = (
                    allowed.get_mut(list).and_then(Value::as_array_mut),
                    wanted.get(list).and_then(Value::as_array),
                ) else {
                    continue;
                };
                if mine.len() == theirs.len() {
                    for (m, t) in mine.iter_mut().zip(theirs) {
                        if let Some(image) = t.get("image") {
                            m["image"] = image.clone();
                        }
                    }
                }
            }
            for field in [
                "activeDeadlineSeconds",
                "tolerations",
                "terminationGracePeriodSeconds",
                "schedulingGates",
            ] {
                match wanted.get(field) {
                    Some(v) => allowed[field] = v.clone(),
                    None => {
                        if let Some(m) = allowed.as_object_mut() {
                            m.remove(field);
                        }
                    }
                }
            }
            if allowed != wanted {
                causes.push(Cause::forbidden("spec", POD_MUTABLE));
            }
        }
        "ResourceClaim" if old.get("spec") != new.get("spec") => {
            causes.push(Cause::invalid("spec", "", "field is immutable"));
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(name(NameRule::Subdomain, "a.b-c").is_ok());
        assert!(name(NameRule::Subdomain, "a_b").is_err());
        assert!(name(NameRule::Label, "a.b").is_err());
        assert!(name(NameRule::Label1035, "1abc").is_err());
        assert!(name(NameRule::Label1035, "abc-1").is_ok());
    }
}
