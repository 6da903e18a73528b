//! Failures as the API server words them: a `Status` object (kind Status,
//! apiVersion v1, status Failure) with the HTTP code, a reason clients
//! match on, a message, and details (name, group, kind, causes).

use poem::Response;
use poem::http::StatusCode;
use serde_json::{Value, json};

use super::resources::Resource;

/// One failed request.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
}

/// One reason a field is invalid, as `details.causes` lists it.
#[derive(Debug, Clone)]
pub(crate) struct Cause {
    /// `FieldValueInvalid`, `FieldValueRequired`, `FieldValueForbidden`, ...
    pub reason: &'static str,
    pub field: String,
    pub message: String,
}

impl Cause {
    pub(super) fn invalid(field: &str, value: &str, why: &str) -> Self {
        Self {
            reason: "FieldValueInvalid",
            field: field.to_owned(),
            message: format!("Invalid value: {value:?}: {why}"),
        }
    }

    pub(super) fn required(field: &str, why: &str) -> Self {
        let message = if why.is_empty() {
            "Required value".to_owned()
        } else {
            format!("Required value: {why}")
        };
        Self {
            reason: "FieldValueRequired",
            field: field.to_owned(),
            message,
        }
    }

    pub(super) fn forbidden(field: &str, why: &str) -> Self {
        Self {
            reason: "FieldValueForbidden",
            field: field.to_owned(),
            message: format!("Forbidden: {why}"),
        }
    }

    pub(super) fn too_many(field: &str, count: usize, most: usize) -> Self {
        Self {
            reason: "FieldValueTooMany",
            field: field.to_owned(),
            message: format!("Too many: {count}: must have at most {most} items"),
        }
    }

    pub(super) fn not_supported(field: &str, value: &str, supported: &[&str]) -> Self {
        let supported: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
        Self {
            reason: "FieldValueNotSupported",
            field: field.to_owned(),
            message: format!(
                "Unsupported value: {value:?}: supported values: {}",
                supported.join(", ")
            ),
        }
    }

    pub(super) fn duplicate(field: &str, value: &str) -> Self {
        Self {
            reason: "FieldValueDuplicate",
            field: field.to_owned(),
            message: format!("Duplicate value: {value:?}"),
        }
    }
}

fn details(r: &Resource, name: &str) -> Value {
    let mut d = json!({"name": name, "kind": r.plural});
    if !r.group.is_empty() {
        d["group"] = json!(r.group);
    }
    d
}

fn qualified(r: &Resource) -> String {
    if r.group.is_empty() {
        r.plural.to_owned()
    } else {
        format!("{}.{}", r.plural, r.group)
    }
}

impl ApiError {
    pub(super) fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    pub(super) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub(super) fn path_not_found() -> Self {
        Self::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
    }

    /// A failure about `r`'s object `name`, which its details name.
    pub(super) fn about(
        r: &Resource,
        name: &str,
        code: u16,
        reason: &'static str,
        message: String,
    ) -> Self {
        Self {
            details: Some(details(r, name)),
            ..Self::new(code, reason, message)
        }
    }

    /// `self` with `causes` in its details, which name the object's type
    /// by `kind` (its kind or its plural, as the server words each failure).
    pub(super) fn with_causes(mut self, kind: &str, causes: Vec<Value>) -> Self {
        if let Some(details) = &mut self.details {
            details["kind"] = json!(kind);
            details["causes"] = Value::Array(causes);
        }
        self
    }

    pub(super) fn not_found(r: &Resource, name: &str) -> Self {
        let message = format!("{} {name:?} not found", qualified(r));
        Self::about(r, name, 404, "NotFound", message)
    }

    pub(super) fn already_exists(r: &Resource, name: &str) -> Self {
        let message = format!("{} {name:?} already exists", qualified(r));
        Self::about(r, name, 409, "AlreadyExists", message)
    }

    /// An optimistic-concurrency failure.
    pub(super) fn conflict(r: &Resource, name: &str, why: &str) -> Self {
        let message = format!(
            "Operation cannot be fulfilled on {} {name:?}: {why}",
            qualified(r)
        );
        Self::about(r, name, 409, "Conflict", message)
    }

    pub(super) fn modified(r: &Resource, name: &str) -> Self {
        Self::conflict(
            r,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 422 with one cause a field.
    pub(super) fn invalid(r: &Resource, name: &str, causes: Vec<Cause>) -> Self {
        let listed: Vec<String> = causes
            .iter()
            .map(|c| format!("{}: {}", c.field, c.message))
            .collect();
        let what = if listed.len() == 1 {
            listed[0].clone()
        } else {
            format!("[{}]", listed.join(", "))
        };
        let causes = causes
            .iter()
            .map(|c| json!({"reason": c.reason, "message": c.message, "field": c.field}))
            .collect();
        let message = format!("{} {name:?} is invalid: {what}", r.kind);
        Self::about(r, name, 422, "Invalid", message).with_causes(r.kind, causes)
    }

    pub(super) fn expired(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    /// The `Status` object.
    pub(super) fn status(&self) -> Value {
        let mut status = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": self.message, "reason": self.reason,
            "code": self.code,
        });
        if let Some(details) = &self.details {
            status["details"] = details.clone();
        }
        status
    }

    pub(super) fn response(&self) -> Response {
        json_response(
            &self.status(),
            StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        )
    }
}

/// `value` as a JSON response with `code`.
pub(crate) fn json_response(value: &Value, code: StatusCode) -> Response {
    Response::builder()
        .status(code)
        .content_type("application/json")
        .body(value.to_string())
}

/// The success `Status` a delete answers with for most resources.
pub(crate) fn deleted(r: &Resource, name: &str, uid: &Value) -> Value {
    let mut d = details(r, name);
    d["uid"] = uid.clone();
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": d})
}

pub(crate) type Result<T> = std::result::Result<T, ApiError>;
