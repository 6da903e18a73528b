//! The kubelet of a node in a real cluster, as far as the API and the DRA
//! plugin see it: it registers its Node (Ready, with room for pods) and
//! renews the node's lease; it runs the pods the scheduler binds to it as a
//! kubelet does with DRA: every claim of a pod prepared by the plugin
//! (`NodePrepareResources`, over the plugin's socket) before the pod starts,
//! a failure reported as an event and retried; the pod's status written
//! (Running, then Succeeded or Failed when a test ends its container); on a
//! graceful deletion, or once the pod has finished, each claim no other pod
//! of the node uses is unprepared, and then the deletion is confirmed. No
//! container runs: a test starts a pod's processes from its CDI spec.
//!
//! It acts through the API with the node's own credentials
//! (`system:node:<name>`), so the Node authorizer and the NodeRestriction
//! admission plugin confine it as they confine a kubelet.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Event, ObjectReference, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::kubelet::{FakeKubelet, Version};

mod pod_status;
mod registration;

use pod_status::{containers, now_seconds};
pub use registration::register;
use registration::report_ready;

/// How often the kubelet looks at its pods.
const SYNC: Duration = Duration::from_millis(200);
/// How often it renews its lease (a kubelet's default).
const LEASE_RENEW: Duration = Duration::from_secs(10);

/// A claim the plugin prepared for pods of this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedClaim {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The claim's UID.
    pub uid: String,
    /// Each device's name and the CDI device IDs the plugin gave it.
    pub devices: Vec<(String, Vec<String>)>,
    /// The UIDs of the node's pods using it now.
    pub pods: BTreeSet<String>,
}

/// What the kubelet did and saw, for tests to read.
#[derive(Debug, Default)]
struct Record {
    /// Prepared claims, by UID.
    prepared: BTreeMap<String, PreparedClaim>,
    /// Started pods (UID) and the claims (UIDs) they use.
    started: BTreeMap<String, Vec<String>>,
    /// Pods (UID) a test asked to end, with their exit code.
    finish: BTreeMap<String, i32>,
    /// Claims (UID) unprepared, in order.
    unprepared: Vec<String>,
    /// Errors of the last sync, if it failed.
    last_error: Option<String>,
    /// Pods (UID) whose claims could not be prepared, with the last reason.
    refused: BTreeMap<String, String>,
    /// How many times each pod's (UID) claims could not be prepared.
    refusals: BTreeMap<String, usize>,
    /// The step a pass is at and since when; `None` between passes.
    doing: Option<(String, std::time::Instant)>,
}

/// A running kubelet; stops when dropped.
pub struct NodeKubelet {
    record: Arc<Mutex<Record>>,
    plugin: Arc<Mutex<FakeKubelet>>,
    task: JoinHandle<()>,
}

impl NodeKubelet {
    /// Registers node `node` with `client` (the node's credentials), with
    /// `labels`, and starts running its pods with `plugin` (registered).
    pub async fn start(
        client: kube::Client,
        node: &str,
        labels: BTreeMap<String, String>,
        plugin: FakeKubelet,
    ) -> Result<Self, kube::Error> {
        register(&client, node, labels).await?;
        let record = Arc::new(Mutex::new(Record::default()));
        let plugin = Arc::new(Mutex::new(plugin));
        let sync = Sync {
            client,
            node: node.to_owned(),
            plugin: plugin.clone(),
            record: record.clone(),
        };
        let task = tokio::spawn(sync.run());
        Ok(Self {
            record,
            plugin,
            task,
        })
    }

    /// Calls `plugin` from now on: the plugin registered again, as a
    /// restarted agent's does, which a kubelet's plugin watcher sees as a
    /// new registration socket. What was prepared stays prepared.
    pub fn registered_again(&self, plugin: FakeKubelet) {
        *lock(&self.plugin) = plugin;
    }

    fn record(&self) -> std::sync::MutexGuard<'_, Record> {
        lock(&self.record)
    }

    /// The claims the plugin prepared and that are not unprepared yet.
    pub fn prepared(&self) -> Vec<PreparedClaim> {
        self.record().prepared.values().cloned().collect()
    }

    /// The claims unprepared so far (UIDs), in order.
    pub fn unprepared(&self) -> Vec<String> {
        self.record().unprepared.clone()
    }

    /// Whether pod `uid` was started.
    pub fn started(&self, uid: &str) -> bool {
        self.record().started.contains_key(uid)
    }

    /// The error of the last sync, if it failed.
    pub fn last_error(&self) -> Option<String> {
        self.record().last_error.clone()
    }

    /// Why pod `uid`'s claims could not be prepared the last time it was
    /// tried, if they could not (cleared once the pod starts).
    pub fn refused(&self, uid: &str) -> Option<String> {
        self.record().refused.get(uid).cloned()
    }

    /// How many times pod `uid`'s claims could not be prepared.
    pub fn refusals(&self, uid: &str) -> usize {
        self.record().refusals.get(uid).copied().unwrap_or(0)
    }

    /// The step the kubelet's pass is at and how long it has been at it;
    /// `None` between passes. A pass stuck on a call shows here.
    pub fn doing(&self) -> Option<(String, Duration)> {
        let record = self.record();
        let (what, since) = record.doing.as_ref()?;
        Some((what.clone(), since.elapsed()))
    }

    /// Ends pod `uid`'s containers with `code` (0: Succeeded, else Failed).
    pub fn finish(&self, uid: &str, code: i32) {
        self.record().finish.insert(uid.to_owned(), code);
    }
}

impl Drop for NodeKubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What `mutex` holds, even if a holder panicked.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

struct Sync {
    client: kube::Client,
    node: String,
    /// The plugin as last registered.
    plugin: Arc<Mutex<FakeKubelet>>,
    record: Arc<Mutex<Record>>,
}

impl Sync {
    async fn run(self) {
        let mut renewed: Option<tokio::time::Instant> = None;
        loop {
            if renewed.is_none_or(|at| at.elapsed() >= LEASE_RENEW) {
                self.step("renewing the node's lease".to_owned());
                if self.renew().await.is_ok() {
                    renewed = Some(tokio::time::Instant::now());
                }
            }
            let outcome = self.sync().await;
            {
                let mut record = self.record();
                record.last_error = outcome.err().map(|e| e.to_string());
                record.doing = None;
            }
            tokio::time::sleep(SYNC).await;
        }
    }

    fn record(&self) -> std::sync::MutexGuard<'_, Record> {
        lock(&self.record)
    }

    /// The plugin as last registered.
    fn plugin(&self) -> FakeKubelet {
        lock(&self.plugin).clone()
    }

    /// Notes the step the pass is at.
    fn step(&self, what: String) {
        self.record().doing = Some((what, std::time::Instant::now()));
    }

    /// Renews the node's lease and its Ready heartbeat.
    async fn renew(&self) -> Result<(), kube::Error> {
        let leases = Api::<Lease>::namespaced(self.client.clone(), "kube-node-lease");
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.node.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.node.clone()),
                lease_duration_seconds: Some(40),
                renew_time: Some(MicroTime(Timestamp::now())),
                ..LeaseSpec::default()
            }),
        };
        let params = PatchParams::apply("kubelet").force();
        leases
            .patch(&self.node, &params, &Patch::Apply(&lease))
            .await?;
        report_ready(&Api::all(self.client.clone()), &self.node).await
    }

    /// One pass over the node's pods; a pod whose step fails does not hold
    /// up the others (the errors are joined).
    async fn sync(&self) -> Result<(), kube::Error> {
        let all = Api::<Pod>::all(self.client.clone());
        let on_node = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        let mut errors = Vec::new();
        self.step("listing the node's pods".to_owned());
        for pod in all.list(&on_node).await? {
            let name = pod.metadata.name.clone().unwrap_or_default();
            self.step(format!("pod {name}"));
            if let Err(error) = self.sync_pod(&pod).await {
                errors.push(format!("pod {name}: {error}"));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(kube::Error::Service(errors.join("; ").into()))
        }
    }

    async fn sync_pod(&self, pod: &Pod) -> Result<(), kube::Error> {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        let done = phase == "Succeeded" || phase == "Failed";
        let (finish, started) = {
            let record = self.record();
            (
                record.finish.get(&uid).copied(),
                record.started.contains_key(&uid),
            )
        };
        if pod.metadata.deletion_timestamp.is_some() {
            self.clean_up(&uid).await?;
            self.confirm_deletion(pod).await
        } else if done {
            self.clean_up(&uid).await
        } else if let Some(code) = finish {
            self.end(pod, code).await?;
            self.clean_up(&uid).await
        } else if !started {
            self.start(pod).await
        } else {
            Ok(())
        }
    }

    /// Prepares the pod's claims, then reports it running; an unprepared
    /// claim (not allocated or reserved yet, or refused) leaves it pending.
    async fn start(&self, pod: &Pod) -> Result<(), kube::Error> {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let mut claims = Vec::new();
        for name in claim_names(pod) {
            let Some(name) = name else { return Ok(()) };
            let Some(claim) = Api::<ResourceClaim>::namespaced(self.client.clone(), &ns)
                .get_opt(&name)
                .await?
            else {
                return Ok(());
            };
            let status = claim.status.clone().unwrap_or_default();
            let reserved = status.reserved_for.iter().flatten().any(|r| r.uid == uid);
            if status.allocation.is_none() || !reserved {
                return Ok(());
            }
            let claim_uid = claim.metadata.uid.clone().unwrap_or_default();
            // Prepared before (for another pod, or an earlier try): this
            // pod holds it too.
            let prepared = self
                .record()
                .prepared
                .get_mut(&claim_uid)
                .map(|claim| claim.pods.insert(uid.clone()))
                .is_some();
            if !prepared {
                let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
                self.step(format!("pod {pod_name}: preparing claim {name}"));
                let answer = self
                    .plugin()
                    .prepare(Version::V1, &ns, &name, &claim_uid)
                    .await;
                let answer = match answer {
                    Ok(answer) if answer.error.is_empty() => answer,
                    Ok(answer) => return self.failed(pod, &answer.error).await,
                    Err(error) => return self.failed(pod, &error.to_string()).await,
                };
                self.record().prepared.insert(
                    claim_uid.clone(),
                    PreparedClaim {
                        namespace: ns.clone(),
                        name: name.clone(),
                        uid: claim_uid.clone(),
                        devices: answer.devices,
                        pods: BTreeSet::from([uid.clone()]),
                    },
                );
            }
            claims.push(claim_uid);
        }
        {
            let mut record = self.record();
            record.refused.remove(&uid);
            record.started.insert(uid.clone(), claims);
        }
        let now = now_seconds();
        let containers: Vec<_> = containers(pod)
            .map(|(name, image)| {
                json!({"name": name, "image": image, "imageID": "", "ready": true,
                "restartCount": 0, "started": true, "state": {"running": {"startedAt": now}}})
            })
            .collect();
        let condition =
            |kind: &str| json!({"type": kind, "status": "True", "lastTransitionTime": now});
        let status = json!({"status": {
            "phase": "Running", "startTime": now, "hostIP": "127.0.0.1", "podIP": "127.0.0.1",
            "conditions": [condition("Initialized"), condition("ContainersReady"), condition("Ready")],
            "containerStatuses": containers,
        }});
        self.patch_status(pod, &status).await
    }

    /// Reports why the pod's claims could not be prepared, as the kubelet's
    /// event `FailedPrepareDynamicResources` (the one event of the pod's,
    /// its message and time updated on a later failure); the pod stays
    /// pending.
    async fn failed(&self, pod: &Pod, message: &str) -> Result<(), kube::Error> {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        {
            let mut record = self.record();
            *record.refusals.entry(uid.clone()).or_default() += 1;
            record.refused.insert(uid, message.to_owned());
        }
        let events = Api::<Event>::namespaced(self.client.clone(), &ns);
        let reason = "FailedPrepareDynamicResources";
        let event_name = format!("{name}.{reason}").to_lowercase();
        let now = Time(Timestamp::now());
        let event = Event {
            metadata: ObjectMeta {
                name: Some(event_name),
                namespace: Some(ns.clone()),
                ..ObjectMeta::default()
            },
            involved_object: ObjectReference {
                kind: Some("Pod".to_owned()),
                api_version: Some("v1".to_owned()),
                namespace: Some(ns),
                name: Some(name),
                uid: pod.metadata.uid.clone(),
                ..ObjectReference::default()
            },
            reason: Some(reason.to_owned()),
            message: Some(message.to_owned()),
            type_: Some("Warning".to_owned()),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            count: Some(1),
            source: Some(k8s_openapi::api::core::v1::EventSource {
                component: Some("kubelet".to_owned()),
                host: Some(self.node.clone()),
            }),
            ..Event::default()
        };
        match events.create(&PostParams::default(), &event).await {
            Err(kube::Error::Api(status)) if status.code == 409 => {
                let name = event.metadata.name.clone().unwrap_or_default();
                let again = json!({"message": message, "lastTimestamp": event.last_timestamp});
                events
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&again))
                    .await
                    .map(drop)
            }
            created => created.map(drop),
        }
    }

    /// Unprepares the claims prepared for pod `uid` (whether it started or
    /// not) that no other pod of the node uses, once.
    async fn clean_up(&self, uid: &str) -> Result<(), kube::Error> {
        let claims: Vec<String> = self
            .record()
            .prepared
            .values()
            .filter(|p| p.pods.contains(uid))
            .map(|p| p.uid.clone())
            .collect();
        for claim in claims {
            // Another pod still uses it: this one lets go, nothing else.
            let unused = {
                let mut record = self.record();
                let Some(prepared) = record.prepared.get_mut(&claim) else {
                    continue;
                };
                if prepared.pods.len() > 1 {
                    prepared.pods.remove(uid);
                    None
                } else {
                    Some(prepared.clone())
                }
            };
            let Some(prepared) = unused else { continue };
            let error = self
                .plugin()
                .unprepare(
                    Version::V1,
                    &prepared.namespace,
                    &prepared.name,
                    &prepared.uid,
                )
                .await
                .map_err(|e| kube::Error::Service(e.to_string().into()))?;
            if !error.is_empty() {
                return Err(kube::Error::Service(
                    format!("unprepare {}: {error}", prepared.name).into(),
                ));
            }
            let mut record = self.record();
            record.prepared.remove(&claim);
            record.unprepared.push(claim);
        }
        self.record().started.remove(uid);
        Ok(())
    }
}

/// The name of each claim of `pod`: `None` where the controller has not
/// yet made the one its template asks for.
fn claim_names(pod: &Pod) -> Vec<Option<String>> {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.clone())
        .unwrap_or_default();
    pod.spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .map(|claim| {
            claim.resource_claim_name.clone().or_else(|| {
                statuses
                    .iter()
                    .find(|s| s.name == claim.name)
                    .and_then(|s| s.resource_claim_name.clone())
            })
        })
        .collect()
}
