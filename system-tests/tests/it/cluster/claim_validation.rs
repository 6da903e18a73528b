//! Claims are checked when they are written: the ValidatingAdmissionPolicy
//! of `deploy/base` (installed by `kubectl apply -k`, as an administrator
//! does) refuses, on the official API server, a claim or template of the
//! driver's class with a wrong capacity request or wrong opaque parameters,
//! naming every bad field with its range, and admits the rest (the
//! shipped example's template among them). `claim_parameters` checks the
//! opaque parameters against the node agent's, value by value.

use std::time::{Duration, Instant};

use kube_fakes::clients::Kubectl;

use super::{runtime, tenant};

/// What kubectl prints before a policy's own message when it refuses one
/// object of a file.
const DENIED: &str = "with binding 'gpushare-claims' denied request: ";

/// The claims of the report that made these checks: each as a user would
/// write it, refused with these words (the field and its range).
const BAD_CLAIMS: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: negative-memory}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpushare.dev
          capacity: {requests: {memory: -4Gi, compute: "30"}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: no-compute}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpushare.dev
          capacity: {requests: {memory: 4Gi, compute: "0"}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: too-much-compute}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpushare.dev
          capacity: {requests: {compute: "150"}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: more-than-a-gpu}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpushare.dev
          capacity: {requests: {memory: 300Gi}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: part-of-a-percent}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpushare.dev
          capacity: {requests: {memory: 4Gi, compute: "30.5"}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: bad-parameters}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpushare.dev
          capacity: {requests: {memory: 1Gi, compute: "30"}}
    config:
      - requests: [gpu]
        opaque:
          driver: gpu.gpushare.dev
          parameters: {weight: 0, policy: garbage}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: unknown-parameter}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpushare.dev
          capacity: {requests: {memory: 1Gi, compute: "30"}}
    config:
      - requests: [gpu]
        opaque:
          driver: gpu.gpushare.dev
          parameters: {ceiling: 500, colour: red}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: bad-template}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          firstAvailable:
            - {name: big, deviceClassName: gpu.gpushare.dev, capacity: {requests: {memory: 8Gi, compute: "101"}}}
            - {name: small, deviceClassName: gpu.gpushare.dev, capacity: {requests: {memroy: 2Gi}}}
"#;

/// Each bad object's name and what its refusal must say.
const REFUSALS: [(&str, &[&str]); 8] = [
    (
        "negative-memory",
        &[
            "spec.devices.requests[0].exactly.capacity.requests.memory: -4Gi is not a size from 1 byte to 288Gi",
        ],
    ),
    (
        "no-compute",
        &[
            "spec.devices.requests[0].exactly.capacity.requests.compute: 0 is not a whole number from 1 to 100",
        ],
    ),
    (
        "too-much-compute",
        &[
            "spec.devices.requests[0].exactly.capacity.requests.compute: 150 is not a whole number from 1 to 100",
        ],
    ),
    (
        "more-than-a-gpu",
        &[
            "spec.devices.requests[0].exactly.capacity.requests.memory: 300Gi is not a size from 1 byte to 288Gi",
        ],
    ),
    (
        "part-of-a-percent",
        &[
            "spec.devices.requests[0].exactly.capacity.requests.compute: 30.5 is not a whole number from 1 to 100",
        ],
    ),
    (
        "bad-parameters",
        &[
            "spec.devices.config[0].opaque.parameters.weight: 0 is not a whole number from 1 to 4294967295",
            "spec.devices.config[0].opaque.parameters.policy: garbage is not fixed, elastic or none",
        ],
    ),
    (
        "unknown-parameter",
        &[
            "spec.devices.config[0].opaque.parameters.colour: unknown field (the fields: ",
            "spec.devices.config[0].opaque.parameters.ceiling: 500 is not a whole number from 1 to 100",
        ],
    ),
    (
        "bad-template",
        &[
            "spec.spec.devices.requests[0].firstAvailable[0].capacity.requests.compute: 101 is not a whole number from 1 to 100",
            "spec.spec.devices.requests[0].firstAvailable[1].capacity.requests.memroy: not a capacity of gpu.gpushare.dev (memory, compute)",
        ],
    ),
];

/// Claims that are admitted: every parameter at its bounds, memory the
/// scheduler rounds up to its step (documented, not refused), a whole GPU,
/// and another driver's class and parameters, which are not ours to check.
const GOOD_CLAIMS: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: every-parameter}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpushare.dev
          capacity: {requests: {memory: 288Gi, compute: "100"}}
    config:
      - requests: [gpu]
        opaque:
          driver: gpu.gpushare.dev
          parameters:
            apiVersion: gpu.gpushare.dev/v1alpha1
            kind: GpuShareParameters
            weight: 4294967295
            policy: " Elastic "
            ceiling: 1
            priority: -2147483648
            class: LATENCY
            oversubscribe: false
            spillLimit: 16Gi
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: rounded-memory}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpushare.dev
          capacity: {requests: {memory: 100Mi, compute: "1"}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: whole-gpu}
spec:
  devices:
    requests:
      - name: gpu
        exactly: {deviceClassName: gpu.gpushare.dev}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: other-driver}
spec:
  devices:
    requests:
      - name: nic
        exactly:
          deviceClassName: nic.example.com
          capacity: {requests: {bandwidth: "-1"}}
    config:
      - opaque: {driver: nic.example.com, parameters: {colour: red}}
"#;

/// The shipped example's template.
fn example_template() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/example/resourceclaimtemplate.yaml"
    );
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn kubectl_apply_refuses_each_bad_claim_naming_its_fields_and_admits_the_rest() {
    runtime().block_on(async {
        let tenant = tenant("claim-check").await;
        let kubectl = tenant.kubectl.clone();
        let namespace = tenant.name.clone();
        tokio::task::spawn_blocking(move || {
            let one = BAD_CLAIMS.split("---").next().unwrap();
            let refused = refused_once_enforced(&kubectl, &namespace, one);
            // One object: kubectl prints the API server's answer as is.
            assert_eq!(
                refused.trim(),
                format!(
                    "The resourceclaims \"negative-memory\" is invalid: : \
                     ValidatingAdmissionPolicy 'gpushare-claims' {DENIED}{}",
                    REFUSALS[0].1[0]
                )
            );

            let all = [BAD_CLAIMS, GOOD_CLAIMS, &example_template()].join("\n---\n");
            let out = kubectl
                .run(&["apply", "-n", &namespace, "-f", "-"], Some(&all))
                .unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            assert!(!out.status.success(), "{stdout}");
            let mut refused = 0;
            for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
                let (name, said) = REFUSALS
                    .iter()
                    .find(|(name, _)| line.contains(&format!("\"{name}\" is forbidden")))
                    .unwrap_or_else(|| panic!("refused unexpectedly: {line}"));
                let message = line.split(DENIED).nth(1).unwrap_or_default();
                for words in *said {
                    assert!(message.contains(words), "{name}: {line}");
                }
                // Nothing but the named problems, joined by "; ".
                assert_eq!(message.split("; ").count(), said.len(), "{line}");
                refused += 1;
            }
            assert_eq!(refused, REFUSALS.len(), "{stderr}");
            for name in [
                "resourceclaim.resource.k8s.io/every-parameter",
                "resourceclaim.resource.k8s.io/rounded-memory",
                "resourceclaim.resource.k8s.io/whole-gpu",
                "resourceclaim.resource.k8s.io/other-driver",
                "resourceclaimtemplate.resource.k8s.io/gpu-4gi-30",
            ] {
                assert!(stdout.contains(&format!("{name} created")), "{stdout}");
            }
        })
        .await
        .unwrap();
    });
}

/// Applies `claim` (one bad object) until the API server enforces the
/// policy (a policy is loaded some time after it is written), up to a
/// minute; what kubectl printed then.
pub(super) fn refused_once_enforced(kubectl: &Kubectl, namespace: &str, claim: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = kubectl
            .run(
                &["apply", "--dry-run=server", "-n", namespace, "-f", "-"],
                Some(claim),
            )
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() && said.contains("denied request") {
            return said.replace(" (server dry run)", "");
        }
        assert!(
            Instant::now() < deadline,
            "not refused within a minute: {said}{}",
            String::from_utf8_lossy(&out.stdout)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}
