//! `PATCH` of an object or its status: JSON, merge and strategic merge
//! patches (an update of the patched object), and server-side apply (a
//! create when there is no object yet).

use poem::Response;
use poem::http::StatusCode;
use serde_json::{Value, json};

use super::super::apply::{self, Conflict};
use super::super::resources::Resource;
use super::super::status::{ApiError, Result, json_response};
use super::super::{Params, State, Target, patch as patches};
use super::create::{commit_create, prepare_create};
use super::update::{Change, Managed, finish_update, save_update};
use super::{
    check_named, check_precondition, check_resource_version, current, dry_run, manager, now, scope,
    str_at, writer,
};

/// The patch types served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PatchType {
    Json,
    Merge,
    Strategic,
    Apply,
}

fn patch_type(content_type: &str) -> Result<PatchType> {
    let media = content_type.split(';').next().unwrap_or_default().trim();
    Ok(match media {
        "application/json-patch+json" => PatchType::Json,
        "application/merge-patch+json" => PatchType::Merge,
        "application/strategic-merge-patch+json" => PatchType::Strategic,
        "application/apply-patch+yaml" | "application/apply-patch+json" => PatchType::Apply,
        other => {
            return Err(ApiError::new(
                415,
                "UnsupportedMediaType",
                format!(
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json; got {other:?}"
                ),
            ));
        }
    })
}

/// The 409 of an apply whose fields other managers own.
fn apply_conflict(r: &Resource, name: &str, conflicts: &[Conflict]) -> ApiError {
    let count = conflicts.len();
    let listed = if count == 1 {
        format!(
            "conflict with {:?}: {}",
            conflicts[0].manager, conflicts[0].field
        )
    } else {
        let mut text = "conflicts with".to_owned();
        let mut managers: Vec<&str> = conflicts.iter().map(|c| c.manager.as_str()).collect();
        managers.dedup();
        for manager in managers {
            text.push_str(&format!("\n{manager:?}:"));
            for c in conflicts.iter().filter(|c| c.manager == manager) {
                text.push_str(&format!("\n- {}", c.field));
            }
        }
        text
    };
    let plural = if count == 1 { "" } else { "s" };
    let causes = conflicts
        .iter()
        .map(|c| {
            json!({
                "type": "FieldManagerConflict",
                "message": format!("conflict with {:?}", c.manager),
                "field": c.field,
            })
        })
        .collect();
    let message = format!("Apply failed with {count} conflict{plural}: {listed}");
    ApiError::about(r, name, 409, "Conflict", message).with_causes(r.plural, causes)
}

/// `PATCH` of an object or its status.
pub(crate) fn patch(
    state: &State,
    target: &Target,
    params: &Params,
    user_agent: &str,
    content_type: &str,
    body: Value,
) -> Result<Response> {
    let kind = patch_type(content_type)?;
    let dry = dry_run(params, None)?;
    let force = params.flag("force");
    if force && kind != PatchType::Apply {
        return Err(ApiError::bad_request(
            "force: Forbidden: may not be specified for non-apply patch",
        ));
    }
    if kind == PatchType::Apply {
        return server_side_apply(state, target, params, (dry, force), body);
    }
    let r = target.resource;
    let name = target.name.clone().unwrap_or_default();
    let mut store = state.store();
    let (_, found) = current(&store, target);
    let old = found.ok_or_else(|| ApiError::not_found(r, &name))?;
    let refused = |why: String| {
        ApiError::new(
            422,
            "Invalid",
            format!("the server rejected our request due to an error in our request: {why}"),
        )
    };
    let patched = match kind {
        PatchType::Json => patches::json(&old, &body).map_err(refused)?,
        PatchType::Merge => {
            if !body.is_object() {
                return Err(ApiError::bad_request("a merge patch must be a JSON object"));
            }
            let mut out = old.clone();
            patches::merge(&mut out, &body);
            out
        }
        PatchType::Strategic => patches::strategic(r.kind, &old, &body).map_err(refused)?,
        PatchType::Apply => unreachable!("served by server_side_apply"),
    };
    check_resource_version(r, &name, &patched, &old)?;
    if let (Some(theirs), Some(ours)) = (
        str_at(&patched, "/metadata/uid"),
        str_at(&old, "/metadata/uid"),
    ) {
        check_precondition(r, &name, "UID", theirs, ours)?;
    }
    let manager = manager(params, user_agent)?;
    finish_update(state, &mut store, target, &manager, dry, &old, patched)
}

/// A `PATCH` of type apply: `config` merged as its field manager's, a
/// create when there is no object (but not through `/status`); `dry` and
/// `force` as the query asks.
fn server_side_apply(
    state: &State,
    target: &Target,
    params: &Params,
    (dry, force): (bool, bool),
    mut config: Value,
) -> Result<Response> {
    let r = target.resource;
    let name = target.name.clone().unwrap_or_default();
    let Some(manager) = params.get("fieldManager").filter(|m| !m.is_empty()) else {
        return Err(ApiError::bad_request(
            "PATCH requests with apply patch type must have a fieldManager",
        ));
    };
    if !config.is_object() {
        return Err(ApiError::bad_request("an apply patch must be an object"));
    }
    if config.get("apiVersion").is_none() || config.get("kind").is_none() {
        return Err(ApiError::bad_request(
            "apiVersion and kind must be set in an apply configuration",
        ));
    }
    check_named(r, target, &name, &mut config)?;
    let scope = scope(r, target.status);
    let now = now();
    let mut store = state.store();
    let (_, found) = current(&store, target);
    let live = match &found {
        Some(object) => object.clone(),
        None if target.status => return Err(ApiError::not_found(r, &name)),
        None => json!({
            "apiVersion": r.api_version(), "kind": r.kind,
            "metadata": {"name": name, "namespace": target.namespace},
        }),
    };
    let api_version = r.api_version();
    let writer = writer(r, &api_version, scope, manager, &now);
    let merged =
        apply::apply(&writer, &live, &config, force).map_err(|c| apply_conflict(r, &name, &c))?;
    match found {
        None => {
            let ns = target.namespace.clone().unwrap_or_default();
            let object = prepare_create(&mut store, r, &ns, merged, None, &now)?;
            let stored = commit_create(state, &mut store, r, object, dry);
            Ok(json_response(&stored, StatusCode::CREATED))
        }
        Some(old) => {
            let change = Change {
                r,
                managed: Managed::Set,
                scope,
                dry,
                now: &now,
            };
            let stored = save_update(state, &mut store, change, &old, merged)?;
            Ok(json_response(&stored, StatusCode::OK))
        }
    }
}
