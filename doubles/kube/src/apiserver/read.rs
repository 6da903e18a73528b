//! Get and list: selectors checked as the server checks them, list
//! resourceVersion semantics, and `limit`/`continue` pagination over one
//! snapshot (the continue token carries its resourceVersion and the key to
//! start after, in the API server's own format).

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use poem::Response;
use poem::http::StatusCode;
use serde_json::{Value, json};

use super::resources::Resource;
use super::status::{ApiError, Result, json_response};
use super::{Params, State, Target};
use crate::selector::Selector;

/// The label and field selectors of a list or watch, and its namespace.
pub(crate) struct Filter {
    pub namespace: Option<String>,
    pub labels: Selector,
    pub fields: Selector,
}

impl Filter {
    /// From the request; 400 for a selector the server would refuse.
    pub(super) fn new(target: &Target, params: &Params) -> Result<Self> {
        let labels = Selector::labels(params.get("labelSelector").unwrap_or_default())
            .map_err(ApiError::bad_request)?;
        let mut text = params.get("fieldSelector").unwrap_or_default().to_owned();
        if let Some(name) = &target.name {
            // A watch of one object (`/watch/.../<name>`) is a watch of that name.
            if !text.is_empty() {
                text.push(',');
            }
            text.push_str(&format!("metadata.name={name}"));
        }
        let fields = Selector::fields(&text).map_err(ApiError::bad_request)?;
        if let Some(bad) = fields.keys().find(|k| !target.resource.selectable(k)) {
            return Err(ApiError::bad_request(format!(
                "field label not supported: {bad}"
            )));
        }
        Ok(Self {
            namespace: target.namespace.clone(),
            labels,
            fields,
        })
    }

    /// Whether `object` (stored in `namespace`) is selected.
    pub(super) fn matches(&self, namespace: &str, object: &Value) -> bool {
        self.namespace.as_deref().is_none_or(|ns| ns == namespace)
            && self.labels.matches_labels(object)
            && self.fields.matches_fields(object)
    }
}

/// `GET` of one object (or its status).
pub(crate) fn get(state: &State, target: &Target) -> Result<Response> {
    let name = target.name.clone().unwrap_or_default();
    let key = (
        target.resource.plural.to_owned(),
        target.namespace.clone().unwrap_or_default(),
        name.clone(),
    );
    match state.store().objects.get(&key) {
        Some(object) => Ok(json_response(object, StatusCode::OK)),
        None => Err(ApiError::not_found(target.resource, &name)),
    }
}

fn parse_rv(text: &str) -> Result<u64> {
    text.parse()
        .map_err(|_| ApiError::bad_request(format!("invalid resource version: {text:?}")))
}

/// A continue token: the list's resourceVersion and the key to start after.
fn encode_continue(rv: u64, namespace: &str, name: &str) -> String {
    let start = if namespace.is_empty() {
        format!("{name}\u{0}")
    } else {
        format!("{namespace}/{name}\u{0}")
    };
    URL_SAFE_NO_PAD.encode(json!({"v": "meta.k8s.io/v1", "rv": rv, "start": start}).to_string())
}

fn decode_continue(token: &str) -> Result<(u64, String)> {
    let bad = || {
        ApiError::bad_request(
            "continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)",
        )
    };
    let bytes = URL_SAFE_NO_PAD
        .decode(token.trim_end_matches('='))
        .map_err(|_| bad())?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|_| bad())?;
    let rv = value.get("rv").and_then(Value::as_u64).ok_or_else(bad)?;
    let start = value.get("start").and_then(Value::as_str).ok_or_else(bad)?;
    Ok((rv, start.to_owned()))
}

/// The namespace and name a continue token's start names (the list goes on
/// after them).
fn start_after(start: &str) -> (String, String) {
    let start = start.strip_suffix('\u{0}').unwrap_or(start);
    match start.split_once('/') {
        Some((ns, name)) => (ns.to_owned(), name.to_owned()),
        None => (String::new(), start.to_owned()),
    }
}

/// `GET` of a collection.
pub(crate) fn list(state: &State, target: &Target, params: &Params) -> Result<Response> {
    let r: &Resource = target.resource;
    let filter = Filter::new(target, params)?;
    let limit = match params.get("limit") {
        None | Some("") => None,
        Some(text) => {
            let n: i64 = text
                .parse()
                .map_err(|_| ApiError::bad_request(format!("invalid limit: {text:?}")))?;
            (n > 0).then_some(n as usize)
        }
    };
    let rv_param = params.get("resourceVersion").filter(|s| !s.is_empty());
    let exact = match params.get("resourceVersionMatch") {
        None | Some("") | Some("NotOlderThan") => false,
        Some("Exact") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "resourceVersionMatch: Unsupported value: {other:?}: supported values: \"Exact\", \"NotOlderThan\""
            )));
        }
    };
    let store = state.store();
    let (snapshot_rv, after) = match params.get("continue").filter(|s| !s.is_empty()) {
        Some(token) => {
            if rv_param.is_some_and(|v| v != "0") {
                return Err(ApiError::bad_request(
                    "specifying resource version is not allowed when using continue",
                ));
            }
            let (rv, start) = decode_continue(token)?;
            (rv, Some(start_after(&start)))
        }
        None if exact => {
            let Some(text) = rv_param else {
                return Err(ApiError::bad_request(
                    "resourceVersionMatch is forbidden unless resourceVersion is provided",
                ));
            };
            (parse_rv(text)?, None)
        }
        None => {
            if let Some(text) = rv_param {
                parse_rv(text)?;
            }
            (store.rv, None)
        }
    };
    let objects = store.snapshot(r.plural, snapshot_rv).ok_or_else(|| {
        ApiError::expired(if after.is_some() {
            "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.".to_owned()
        } else {
            format!("too old resource version: {snapshot_rv} ({})", store.compacted)
        })
    })?;
    drop(store);
    let selected: Vec<(&(String, String, String), &Value)> = objects
        .iter()
        .filter(|((_, ns, name), object)| {
            filter.matches(ns, object)
                && after
                    .as_ref()
                    .is_none_or(|(a_ns, a_name)| (ns, name) > (a_ns, a_name))
        })
        .collect();
    let total = selected.len();
    let page = limit.unwrap_or(total).min(total);
    let items: Vec<Value> = selected[..page].iter().map(|(_, v)| (*v).clone()).collect();
    let mut metadata = json!({"resourceVersion": snapshot_rv.to_string()});
    if page < total
        && let Some(((_, ns, name), _)) = selected.get(page - 1)
    {
        metadata["continue"] = json!(encode_continue(snapshot_rv, ns, name));
        if filter.labels.is_empty() && filter.fields.is_empty() {
            metadata["remainingItemCount"] = json!(total - page);
        }
    }
    Ok(json_response(
        &json!({
            "apiVersion": r.api_version(), "kind": format!("{}List", r.kind),
            "metadata": metadata, "items": items,
        }),
        StatusCode::OK,
    ))
}
