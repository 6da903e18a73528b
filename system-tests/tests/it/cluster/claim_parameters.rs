//! The admission policy of `deploy/base` and the node agent read a claim's
//! opaque parameters alike: each value below, at and past the bounds of
//! every field, is refused by the official API server exactly when the
//! agent refuses to prepare a claim with it; and the policy knows exactly
//! the agent's fields (`RawParameters`, read from its source), so a field
//! or range added to one and not the other fails here.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use hypervisor_kubernetes::dra::claims;
use hypervisor_observer::GpuInfo;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use super::{DRIVER, runtime, tenant};

/// The parameters tried, one or two fields each.
fn cases() -> Vec<Value> {
    let cases = json!([
        {},
        {"apiVersion": "gpu.gpushare.dev/v1alpha1", "kind": "GpuShareParameters"},
        {"apiVersion": 3, "kind": ["anything"]},
        {"colour": "red"},
        {"weight": 1}, {"weight": 4294967295u64}, {"weight": null},
        {"weight": 0}, {"weight": 4294967296u64}, {"weight": -1}, {"weight": "2"}, {"weight": 1.5},
        {"policy": "fixed"}, {"policy": " NONE "}, {"policy": "Elastic"},
        {"policy": "garbage"}, {"policy": 1},
        {"ceiling": 1}, {"ceiling": 100},
        {"ceiling": 0}, {"ceiling": 101}, {"ceiling": 500}, {"ceiling": "50"},
        {"priority": -2147483648i64}, {"priority": 2147483647},
        {"priority": 2147483648u64}, {"priority": -2147483649i64}, {"priority": "1"},
        {"class": "batch"}, {"class": " Latency"},
        {"class": "urgent"}, {"class": 0},
        {"oversubscribe": true}, {"oversubscribe": false},
        {"oversubscribe": "yes"}, {"oversubscribe": 1},
        {"spillLimit": 0}, {"spillLimit": 4096}, {"spillLimit": "16Gi"}, {"spillLimit": "1.5G"},
        {"spillLimit": "lots"}, {"spillLimit": -1}, {"spillLimit": "-1Gi"}, {"spillLimit": 1.5},
        {"spillLimit": true}, {"spillLimit": "20Ei"},
        {"oversubscribe": true, "spillLimit": "0"},
    ]);
    cases.as_array().unwrap().clone()
}

/// A claim of one request of our class, with `parameters`.
fn claim(name: &str, parameters: &Value) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DRIVER,
                "capacity": {"requests": {"memory": "1Gi", "compute": "30"}},
            }}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}],
        }},
    })
}

/// Whether the node agent prepares `claim` once the scheduler allocated it
/// (its parameters copied into the allocation, as the scheduler does).
fn agent_accepts(claim: &Value) -> bool {
    let mut allocated = claim.clone();
    allocated["metadata"] =
        json!({"name": "c", "namespace": "ns", "uid": "c1a1e000-0000-4000-8000-000000000001"});
    let config = claim["spec"]["devices"]["config"][0].clone();
    allocated["status"] = json!({
        "allocation": {"devices": {
            "results": [{
                "request": "gpu", "driver": DRIVER, "pool": "node", "device": "gpu-0",
                "consumedCapacity": {"memory": "1Gi", "compute": "30"},
            }],
            "config": [{"source": "FromClaim", "requests": config["requests"], "opaque": config["opaque"]}],
        }},
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "a0000000-0000-4000-8000-00000000000a"}],
    });
    let allocated: ResourceClaim = serde_json::from_value(allocated).unwrap();
    let gpu = GpuInfo {
        index: 0,
        uuid: "GPU-0".to_owned(),
        name: "NVIDIA H100 80GB HBM3".to_owned(),
        memory_total: 80 << 30,
        memory_used: 0,
    };
    claims::to_request(&allocated, DRIVER, "node", &[gpu]).is_ok()
}

/// The API server's answer to `claim` (a dry run): `Ok`, or the policy's
/// message.
async fn admitted(api: &Api<ResourceClaim>, claim: &Value) -> Result<(), String> {
    let claim: ResourceClaim = serde_json::from_value(claim.clone()).unwrap();
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    match api.create(&dry_run, &claim).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.message.contains("denied request: ") => {
            Err(status.message)
        }
        Err(other) => panic!("{claim:?}: {other}"),
    }
}

/// The fields of the agent's `RawParameters`, as they are spelled in a
/// claim (serde's camelCase, or the field's own `rename`).
fn agent_fields() -> BTreeSet<String> {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../hypervisor/kubernetes/src/dra"
    );
    let source = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| std::fs::read_to_string(entry.unwrap().path()).unwrap())
        .find(|text| text.contains("struct RawParameters {"))
        .expect("no struct RawParameters in the agent's dra module");
    let body = source.split("struct RawParameters {").nth(1).unwrap();
    let body = &body[..body.find("\n}").unwrap()];
    let mut fields = BTreeSet::new();
    let mut rename = None;
    for line in body.lines().map(str::trim) {
        if line.starts_with("#[") {
            rename = line
                .split("rename = \"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .map(str::to_owned);
        } else if let Some((name, _)) = line.split_once(':') {
            let camel = name.split('_').enumerate().map(|(i, part)| {
                let mut chars = part.chars();
                match (i, chars.next()) {
                    (0, _) | (_, None) => part.to_owned(),
                    (_, Some(first)) => first.to_uppercase().chain(chars).collect(),
                }
            });
            fields.insert(rename.take().unwrap_or_else(|| camel.collect()));
        }
    }
    fields
}

#[test]
fn the_policy_refuses_exactly_the_parameters_the_agent_refuses() {
    runtime().block_on(async {
        let tenant = tenant("claim-params").await;
        let api = Api::<ResourceClaim>::namespaced(tenant.client.clone(), &tenant.name);
        // A policy is enforced some time after it is written.
        let unknown = claim("unknown", &json!({"colour": "red"}));
        let deadline = Instant::now() + Duration::from_secs(60);
        let refusal = loop {
            match admitted(&api, &unknown).await {
                Err(message) => break message,
                Ok(()) => assert!(Instant::now() < deadline, "the policy never enforced"),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };

        let known: BTreeSet<String> = refusal
            .split("(the fields: ")
            .nth(1)
            .and_then(|rest| rest.split(')').next())
            .unwrap_or_else(|| panic!("no list of the fields in {refusal:?}"))
            .split(", ")
            .map(str::to_owned)
            .collect();
        let fields = agent_fields();
        assert_eq!(known, fields, "the policy's fields, and the agent's");
        let cases = cases();
        for field in &fields {
            assert!(
                cases.iter().any(|case| case.get(field).is_some()),
                "no case tries {field}"
            );
        }

        let mut refused = 0;
        for (i, parameters) in cases.iter().enumerate() {
            let claim = claim(&format!("case-{i}"), parameters);
            let policy = admitted(&api, &claim).await;
            assert_eq!(
                policy.is_ok(),
                agent_accepts(&claim),
                "{parameters}: the policy says {policy:?}"
            );
            if let Err(message) = policy {
                // The message names each bad field of the case.
                for field in parameters.as_object().unwrap().keys() {
                    assert!(
                        message.contains(&format!(".opaque.parameters.{field}: "))
                            || agent_accepts(&claim_with(field, parameters)),
                        "{parameters}: {message}"
                    );
                }
                refused += 1;
            }
        }
        // Both verdicts occur: the table is no list of one kind.
        assert!(refused > 0 && refused < cases.len());
    });
}

/// A claim whose parameters are `field` of `parameters` alone.
fn claim_with(field: &str, parameters: &Value) -> Value {
    claim("one", &json!({field: parameters[field]}))
}
