//! Protobuf request bodies, read into JSON for the few types kubectl's
//! typed clients send that way (`kubectl create namespace | configmap |
//! secret | serviceaccount`): the `k8s\0` envelope (`runtime.Unknown`
//! with its TypeMeta and raw bytes) and the objects' fields by their
//! numbers in upstream's `generated.proto`. Other types are refused (415).

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Map, Value, json};

/// How one field is encoded.
#[derive(Clone, Copy)]
enum Ty {
    Str,
    Bool,
    Int,
    Time,
    Message(&'static [Field]),
    MapStr,
    MapBytes,
}

/// One field: number, JSON name, type, whether repeated.
type Field = (u64, &'static str, Ty, bool);

const OWNER_REFERENCE: &[Field] = &[
    (1, "kind", Ty::Str, false),
    (3, "name", Ty::Str, false),
    (4, "uid", Ty::Str, false),
    (5, "apiVersion", Ty::Str, false),
    (6, "controller", Ty::Bool, false),
    (7, "blockOwnerDeletion", Ty::Bool, false),
];

const OBJECT_META: &[Field] = &[
    (1, "name", Ty::Str, false),
    (2, "generateName", Ty::Str, false),
    (3, "namespace", Ty::Str, false),
    (5, "uid", Ty::Str, false),
    (6, "resourceVersion", Ty::Str, false),
    (7, "generation", Ty::Int, false),
    (8, "creationTimestamp", Ty::Time, false),
    (9, "deletionTimestamp", Ty::Time, false),
    (10, "deletionGracePeriodSeconds", Ty::Int, false),
    (11, "labels", Ty::MapStr, false),
    (12, "annotations", Ty::MapStr, false),
    (13, "ownerReferences", Ty::Message(OWNER_REFERENCE), true),
    (14, "finalizers", Ty::Str, true),
];

const NAME_REF: &[Field] = &[(1, "name", Ty::Str, false)];

const OBJECT_REFERENCE: &[Field] = &[
    (1, "kind", Ty::Str, false),
    (2, "namespace", Ty::Str, false),
    (3, "name", Ty::Str, false),
    (4, "uid", Ty::Str, false),
    (5, "apiVersion", Ty::Str, false),
];

const CONFIG_MAP: &[Field] = &[
    (1, "metadata", Ty::Message(OBJECT_META), false),
    (2, "data", Ty::MapStr, false),
    (3, "binaryData", Ty::MapBytes, false),
    (4, "immutable", Ty::Bool, false),
];

const SECRET: &[Field] = &[
    (1, "metadata", Ty::Message(OBJECT_META), false),
    (2, "data", Ty::MapBytes, false),
    (3, "type", Ty::Str, false),
    (4, "stringData", Ty::MapStr, false),
    (5, "immutable", Ty::Bool, false),
];

const NAMESPACE: &[Field] = &[
    (1, "metadata", Ty::Message(OBJECT_META), false),
    (
        2,
        "spec",
        Ty::Message(&[(1, "finalizers", Ty::Str, true)]),
        false,
    ),
];

const SERVICE_ACCOUNT: &[Field] = &[
    (1, "metadata", Ty::Message(OBJECT_META), false),
    (2, "secrets", Ty::Message(OBJECT_REFERENCE), true),
    (3, "imagePullSecrets", Ty::Message(NAME_REF), true),
    (4, "automountServiceAccountToken", Ty::Bool, false),
];

fn schema(api_version: &str, kind: &str) -> Option<&'static [Field]> {
    match (api_version, kind) {
        ("v1", "ConfigMap") => Some(CONFIG_MAP),
        ("v1", "Secret") => Some(SECRET),
        ("v1", "Namespace") => Some(NAMESPACE),
        ("v1", "ServiceAccount") => Some(SERVICE_ACCOUNT),
        _ => None,
    }
}

/// One wire field: number and payload.
enum Wire<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, String> {
        let mut out = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = self.0.split_first().ok_or("truncated varint")?;
            self.0 = rest;
            out |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(out);
            }
        }
        Err("varint too long".to_owned())
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated field".to_owned());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn next(&mut self) -> Result<Option<(u64, Wire<'a>)>, String> {
        if self.0.is_empty() {
            return Ok(None);
        }
        let tag = self.varint()?;
        let wire = match tag & 7 {
            0 => Wire::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Wire::Fixed
            }
            2 => {
                let n = usize::try_from(self.varint()?).map_err(|e| e.to_string())?;
                Wire::Bytes(self.take(n)?)
            }
            5 => {
                self.take(4)?;
                Wire::Fixed
            }
            other => return Err(format!("unsupported wire type {other}")),
        };
        Ok(Some((tag >> 3, wire)))
    }
}

fn text(bytes: &[u8]) -> Result<String, String> {
    String::from_utf8(bytes.to_vec()).map_err(|e| e.to_string())
}

fn entry(bytes: &[u8], value_bytes: bool) -> Result<(String, Value), String> {
    let (mut key, mut value) = (String::new(), json!(""));
    let mut r = Reader(bytes);
    while let Some((n, wire)) = r.next()? {
        match (n, wire) {
            (1, Wire::Bytes(b)) => key = text(b)?,
            (2, Wire::Bytes(b)) if value_bytes => value = json!(STANDARD.encode(b)),
            (2, Wire::Bytes(b)) => value = json!(text(b)?),
            _ => {}
        }
    }
    Ok((key, value))
}

fn time(bytes: &[u8]) -> Result<Value, String> {
    let mut seconds = 0i64;
    let mut r = Reader(bytes);
    while let Some((n, wire)) = r.next()? {
        if let (1, Wire::Varint(v)) = (n, wire) {
            seconds = v as i64;
        }
    }
    if seconds == 0 {
        return Ok(Value::Null);
    }
    let at = k8s_openapi::jiff::Timestamp::from_second(seconds).map_err(|e| e.to_string())?;
    Ok(json!(at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()))
}

fn message(bytes: &[u8], fields: &[Field]) -> Result<Value, String> {
    let mut out = Map::new();
    let mut r = Reader(bytes);
    while let Some((n, wire)) = r.next()? {
        let Some(&(_, name, ty, repeated)) = fields.iter().find(|f| f.0 == n) else {
            continue;
        };
        let value = match (ty, wire) {
            (Ty::Str, Wire::Bytes(b)) => json!(text(b)?),
            (Ty::Bool, Wire::Varint(v)) => json!(v != 0),
            (Ty::Int, Wire::Varint(v)) => json!(v as i64),
            (Ty::Time, Wire::Bytes(b)) => time(b)?,
            (Ty::Message(inner), Wire::Bytes(b)) => message(b, inner)?,
            (Ty::MapStr | Ty::MapBytes, Wire::Bytes(b)) => {
                let (k, v) = entry(b, matches!(ty, Ty::MapBytes))?;
                let map = out.entry(name).or_insert_with(|| json!({}));
                map[k] = v;
                continue;
            }
            _ => return Err(format!("field {name} has an unexpected wire type")),
        };
        // Go writes empty strings and zero numbers that its JSON omits.
        if !repeated && (value.is_null() || value == json!("") || value == json!(0)) {
            continue;
        }
        if repeated {
            match out.entry(name).or_insert_with(|| json!([])) {
                Value::Array(items) => items.push(value),
                _ => return Err(format!("field {name} repeated and not")),
            }
        } else {
            out.insert(name.to_owned(), value);
        }
    }
    Ok(Value::Object(out))
}

/// The JSON object of a protobuf body; `Err` when it is not one of the
/// types read here.
pub(crate) fn decode(body: &[u8]) -> Result<Value, String> {
    let inner = body
        .strip_prefix(b"k8s\0")
        .ok_or("no protobuf envelope (k8s\\0)")?;
    let (mut api_version, mut kind, mut raw) = (String::new(), String::new(), &[][..]);
    let mut r = Reader(inner);
    while let Some((n, wire)) = r.next()? {
        match (n, wire) {
            (1, Wire::Bytes(type_meta)) => {
                let mut t = Reader(type_meta);
                while let Some((n, wire)) = t.next()? {
                    match (n, wire) {
                        (1, Wire::Bytes(b)) => api_version = text(b)?,
                        (2, Wire::Bytes(b)) => kind = text(b)?,
                        _ => {}
                    }
                }
            }
            (2, Wire::Bytes(b)) => raw = b,
            _ => {}
        }
    }
    let fields = schema(&api_version, &kind)
        .ok_or_else(|| format!("protobuf bodies of {api_version} {kind} are not read here"))?;
    let mut object = message(raw, fields)?;
    object["apiVersion"] = json!(api_version);
    object["kind"] = json!(kind);
    Ok(object)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(n: u64, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![(n << 3 | 2) as u8, payload.len() as u8];
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn a_config_map_in_its_envelope() {
        let meta = [
            field(1, b"c"),
            field(11, &[field(1, b"app"), field(2, b"x")].concat()),
        ]
        .concat();
        let object = [
            field(1, &meta),
            field(2, &[field(1, b"k"), field(2, b"v")].concat()),
            field(3, &[field(1, b"b"), field(2, b"\x00\x01")].concat()),
        ]
        .concat();
        let type_meta = [field(1, b"v1"), field(2, b"ConfigMap")].concat();
        let body = [b"k8s\0".to_vec(), field(1, &type_meta), field(2, &object)].concat();
        assert_eq!(
            decode(&body).unwrap(),
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "c", "labels": {"app": "x"}},
                "data": {"k": "v"}, "binaryData": {"b": "AAE="}})
        );
        assert!(decode(b"{}").is_err());
    }
}
