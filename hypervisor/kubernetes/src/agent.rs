//! The node agent: reflectors, the ResourceSlice, the kubelet plugin and the
//! clean-up of pods that are gone, around one [`Provisioner`].

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::{Notify, watch};

use crate::consumers::{ClaimIdentity, consumers, consumers_from_api, prepared_claims};
use crate::deviceplugin::allocator;
use crate::dra::plugin;
use crate::dra::slice;
use crate::options::AgentOptions;
use crate::state::{Inner, NodeAgent};
use crate::{KubeError, KubernetesSource};
use hypervisor_config::MemoryCapacity;
use hypervisor_core::identity::CgroupIdentity;
use hypervisor_daemon::Hypervisor;
use hypervisor_daemon::source;
use hypervisor_observer::{GpuInfo, Unhealthy};
use hypervisor_provision::{PodRef, Provisioner};

impl NodeAgent {
    /// Connects, restores the checkpoint's pods into the hypervisor, publishes
    /// the slice, starts the reflectors and installs the cgroup identity check.
    pub async fn start(
        hv: Hypervisor,
        gpus: Vec<GpuInfo>,
        options: AgentOptions,
    ) -> Result<Self, KubeError> {
        let client = crate::client(options.kubeconfig.as_deref()).await?;
        let mut provisioner = Provisioner::open(options.provision.clone(), gpus.clone())?;
        // What a restarted agent starts from; the claims of pods gone
        // meanwhile are removed at its first clean-up.
        tracing::info!(
            claims = provisioner.claims().len(),
            pods = provisioner.pods().len(),
            "prepared claims restored from the checkpoint"
        );
        // The daemon's `[swap]` overcommit: what each GPU offers to quotas,
        // in the slice, the device plugin's capacity and the provisioner's count.
        let memory = hv.memory_capacity();
        provisioner.set_memory_capacity(memory.clone());
        if let Some(corun) = &options.provision.corun {
            hv.set_corun_gpus(corun);
        }
        let source = KubernetesSource {
            provisioner: Arc::new(Mutex::new(provisioner)),
        };
        source::sync(&hv, &source)?;
        let unhealthy = hv.unhealthy_gpus();
        let taints_dropped = Mutex::new(None);
        publish(
            &client,
            &options,
            &gpus,
            (&unhealthy, &memory),
            &taints_dropped,
        )
        .await?;
        let (pods, pod_writer) = reflector::store::<Pod>();
        let (claims, claim_writer) = reflector::store::<ResourceClaim>();
        let (gpu_health, _) = watch::channel(allocator::health(&gpus, &[], &unhealthy));
        let inner = Arc::new(Inner {
            hv,
            client: client.clone(),
            options,
            source,
            pods,
            claims,
            busy: tokio::sync::Mutex::new(()),
            changed: Notify::new(),
            gpu_health,
            allocated: Mutex::new(BTreeMap::new()),
            taints_dropped,
            refusals: Default::default(),
        });
        if inner.options.check_identity {
            inner.hv.set_worker_identity(Arc::new(ClaimIdentity {
                cgroup: CgroupIdentity::new(&inner.options.proc_root),
                agent: Arc::downgrade(&inner),
            }));
        }
        let on_node =
            watcher::Config::default().fields(&format!("spec.nodeName={}", inner.options.node));
        let weak = Arc::downgrade(&inner);
        let pod_events = reflector::reflector(
            pod_writer,
            watcher(Api::<Pod>::all(client.clone()), on_node),
        )
        .default_backoff();
        tokio::spawn(async move {
            futures::pin_mut!(pod_events);
            while let Some(event) = pod_events.next().await {
                let Some(inner) = weak.upgrade() else { break };
                match event {
                    Ok(_) => inner.changed.notify_one(),
                    Err(error) => tracing::warn!(%error, "pod watch"),
                }
            }
        });
        let weak = Arc::downgrade(&inner);
        let claim_events = reflector::reflector(
            claim_writer,
            watcher(
                Api::<ResourceClaim>::all(client),
                watcher::Config::default(),
            ),
        )
        .default_backoff();
        tokio::spawn(async move {
            futures::pin_mut!(claim_events);
            while let Some(event) = claim_events.next().await {
                if weak.strong_count() == 0 {
                    break;
                }
                if let Err(error) = event {
                    tracing::warn!(%error, "resourceclaim watch");
                }
            }
        });
        Ok(Self { inner })
    }

    /// Serves the kubelet plugin and keeps the node tidy until `shutdown`.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), KubeError> {
        let agent = self.clone();
        let tidy = tokio::spawn(async move {
            if agent.inner.pods.wait_until_ready().await.is_err() {
                return;
            }
            loop {
                if let Err(error) = agent.collect_garbage().await {
                    tracing::warn!(%error, "clean-up of pods that are gone");
                }
                if let Err(error) = agent.republish().await {
                    tracing::warn!(%error, "resourceslice not published");
                }
                let _ = tokio::time::timeout(
                    agent.inner.options.resync,
                    agent.inner.changed.notified(),
                )
                .await;
            }
        });
        // A GPU's health changed: publish at once, not at the next resync.
        let health = self.inner.hv.gpu_health_changes().map(|mut changes| {
            let weak = Arc::downgrade(&self.inner);
            tokio::spawn(async move {
                while changes.changed().await.is_ok() {
                    let Some(inner) = weak.upgrade() else { break };
                    inner.changed.notify_one();
                }
            })
        });
        let options = &self.inner.options;
        let (stop, stopped) = watch::channel(false);
        let devices = options.device_plugin.clone().map(|config| {
            let agent = Arc::new(self.clone());
            let gpus = self.inner.gpu_health.subscribe();
            let mut stopped = stopped.clone();
            tokio::spawn(crate::deviceplugin::kubelet::serve(
                config,
                agent,
                gpus,
                async move {
                    let _ = stopped.wait_for(|s| *s).await;
                },
            ))
        });
        let result = plugin::serve(
            &options.driver,
            &options.sockets,
            Arc::new(self.clone()),
            async move {
                shutdown.await;
                let _ = stop.send(true);
            },
        )
        .await
        .map_err(KubeError::Plugin);
        tidy.abort();
        if let Some(health) = health {
            health.abort();
        }
        if let Some(devices) = devices {
            match devices.await {
                Ok(Err(error)) => tracing::error!(%error, "device plugin"),
                Err(error) => tracing::error!(%error, "device plugin task"),
                Ok(Ok(())) => {}
            }
        }
        drop(stopped);
        result
    }

    /// Publishes the slice again with the GPUs the hypervisor sees now and
    /// their health; the device plugin's list too.
    pub async fn republish(&self) -> Result<(), KubeError> {
        let gpus = self.inner.hv.status().gpus;
        let unhealthy = self.inner.hv.unhealthy_gpus();
        let memory = self.inner.hv.memory_capacity();
        {
            let mut provisioner = self.provisioner();
            provisioner.set_gpus(gpus.clone());
            provisioner.set_memory_capacity(memory.clone());
        }
        let o = &self.inner.options;
        if o.device_plugin.is_some() {
            self.inner.gpu_health.send_if_modified(|health| {
                let new = allocator::health(&gpus, health, &unhealthy);
                let changed = *health != new;
                *health = new;
                changed
            });
            // Not fatal to the slice: retried at the next resync.
            if let Err(error) = allocator::advertise_capacity(
                &self.inner.client,
                &o.node,
                &gpus,
                &unhealthy,
                &memory,
            )
            .await
            {
                tracing::warn!(%error, "node capacity for the device plugin not advertised");
            }
        }
        publish(
            &self.inner.client,
            o,
            &gpus,
            (&unhealthy, &memory),
            &self.inner.taints_dropped,
        )
        .await
    }

    /// Unprepares the claims of pods that no longer exist or have finished;
    /// returns the pods cleaned up.
    pub async fn collect_garbage(&self) -> Result<Vec<String>, KubeError> {
        let _busy = self.inner.busy.lock().await;
        // Each quota identity, and whether it is a shared claim's own.
        let prepared: BTreeMap<String, (PodRef, bool)> = self
            .provisioner()
            .claims()
            .values()
            .map(|c| {
                let own = c.request.pod.uid == c.request.claim_uid;
                (c.request.pod.uid.clone(), (c.request.pod.clone(), own))
            })
            .collect();
        let mut gone = Vec::new();
        for (uid, (pod, claims_own)) in prepared {
            // The identity's own pod first: what keeps most, from the cache.
            if !claims_own && self.pod_runs(&uid, &pod).await? {
                continue;
            }
            // Another pod that uses the identity's claims keeps it: the
            // quota is the claims', kept until their last consumer ends.
            // The reflectors may lag a claim's reservation or a pod: before
            // forgetting, the claims are read again from the API, and
            // `pod_runs` asks it for any pod the cache does not know.
            let claims = prepared_claims(&self.inner, &uid);
            if self
                .others_run(&uid, &pod, consumers(&self.inner, &claims))
                .await?
                || self
                    .others_run(&uid, &pod, consumers_from_api(&self.inner, &claims).await?)
                    .await?
            {
                continue;
            }
            // One line a claim, for the operator: after a restart, these
            // are the claims of the pods deleted while the agent was down.
            for claim in self.provisioner().forget_pod(&uid)? {
                tracing::info!(
                    claim = %format_args!("{}/{} ({})", claim.namespace, claim.name, claim.claim_uid),
                    pod = %pod,
                    "pod gone: claim removed (its CDI spec and checkpoint entry; the pod's file, token, region and limits)"
                );
            }
            gone.push(uid);
        }
        if !gone.is_empty() {
            self.sync()?;
        }
        Ok(gone)
    }

    /// Whether a pod of `consumers` other than `identity` (of `pod`'s
    /// namespace) runs.
    async fn others_run(
        &self,
        identity: &str,
        pod: &PodRef,
        consumers: BTreeMap<String, String>,
    ) -> Result<bool, KubeError> {
        for (other, name) in consumers {
            if other == identity {
                continue;
            }
            let other_pod = PodRef {
                uid: other.clone(),
                namespace: pod.namespace.clone(),
                name,
            };
            if self.pod_runs(&other, &other_pod).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Whether pod `uid` still exists and has not finished.
    async fn pod_runs(&self, uid: &str, pod: &PodRef) -> Result<bool, KubeError> {
        let cached = self
            .inner
            .pods
            .find(|p| p.metadata.uid.as_deref() == Some(uid));
        if cached.as_deref().is_some_and(|p| !finished(p)) {
            return Ok(true);
        }
        // The reflector may lag behind a pod just created: ask.
        let api: Api<Pod> = Api::namespaced(self.inner.client.clone(), &pod.namespace);
        let live = api
            .get_opt(&pod.name)
            .await
            .map_err(KubeError::api("get pod"))?;
        Ok(live.is_some_and(|p| p.metadata.uid.as_deref() == Some(uid) && !finished(&p)))
    }
}

/// Publishes the slice with `unhealthy` tainted, unless the API server
/// dropped the taints of these same unhealthy GPUs before (then it would
/// only raise the generation again for nothing), and each GPU's memory
/// capacity as `memory` says; warns once when it drops the taints.
async fn publish(
    client: &kube::Client,
    o: &AgentOptions,
    gpus: &[GpuInfo],
    (unhealthy, memory): (&BTreeMap<String, Unhealthy>, &MemoryCapacity),
    taints_dropped: &Mutex<Option<BTreeMap<String, Unhealthy>>>,
) -> Result<(), KubeError> {
    let untainted = BTreeMap::new();
    let dropped_before = taints_dropped
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        == Some(unhealthy);
    let taints = if dropped_before {
        &untainted
    } else {
        unhealthy
    };
    let offer = slice::Offer {
        unhealthy: taints,
        corun: o.provision.corun.as_ref(),
        memory,
    };
    let stored = slice::publish(client, &o.node, &o.driver, gpus, offer).await?;
    let dropped = !taints.is_empty() && !slice::has_taints(&stored);
    if dropped {
        let reasons: Vec<String> = unhealthy
            .iter()
            .map(|(uuid, u)| format!("{uuid}: {}", u.fault.reason()))
            .collect();
        tracing::warn!(
            unhealthy = ?reasons,
            "the API server dropped the ResourceSlice's device taints (feature gate \
             DRADeviceTaints off): unhealthy GPUs stay allocatable through DRA"
        );
    }
    if !dropped_before {
        *taints_dropped
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = dropped.then(|| unhealthy.clone());
    }
    Ok(())
}

fn finished(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_none()
        || matches!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        )
}
