//! The DRA plugin's preparer: a claim the kubelet names is read, turned
//! into a request ([`super::claims`]) and provisioned; unprepared, its
//! files go and the hypervisor's pods follow.

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;

use crate::NodeAgent;
use crate::dra::claims;
use crate::dra::{ClaimPreparer, ClaimRef, ClaimRefused, PreparedDevice};

impl ClaimPreparer for NodeAgent {
    async fn prepare(&self, claim: ClaimRef) -> Result<Vec<PreparedDevice>, ClaimRefused> {
        let prepared = self.prepare_claim(&claim).await;
        match &prepared {
            Ok(_) => self.inner.refusals.clear(&claim.uid),
            Err(refused) => self.report_refusal(&claim, refused).await,
        }
        prepared
    }

    async fn unprepare(&self, claim: ClaimRef) -> Result<(), ClaimRefused> {
        let _busy = self.inner.busy.lock().await;
        self.inner.refusals.clear(&claim.uid);
        let removed = self.provisioner().unprepare(&claim.uid)?;
        if removed {
            self.sync()?;
        }
        Ok(())
    }
}

impl NodeAgent {
    /// Prepares `claim`, once: a claim prepared before gets its devices
    /// again. Nothing of a claim refused is left on the node.
    async fn prepare_claim(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, ClaimRefused> {
        let _busy = self.inner.busy.lock().await;
        let devices = |request: &hypervisor_provision::ClaimRequest, cdi: &[String]| {
            request
                .devices
                .iter()
                .map(|d| PreparedDevice {
                    request_names: d.requests.clone(),
                    pool_name: d.pool.clone(),
                    device_name: d.device.clone(),
                    cdi_device_ids: cdi.to_vec(),
                })
                .collect::<Vec<_>>()
        };
        if let Some(done) = self.provisioner().claims().get(&claim.uid) {
            return Ok(devices(&done.request, &done.cdi_devices));
        }
        let object = self.claim(claim).await?;
        claims::check_uid(&object, &claim.uid)?;
        let o = &self.inner.options;
        let request = {
            let provisioner = self.provisioner();
            claims::to_request(&object, &o.driver, &o.node, provisioner.gpus())?
        };
        let cdi = self.provision(&request)?;
        Ok(devices(&request, &cdi))
    }

    /// The claim the kubelet names: the reflector's copy when it is this
    /// UID, allocated and reserved; else the API server's.
    async fn claim(&self, claim: &ClaimRef) -> Result<ResourceClaim, ClaimRefused> {
        let key = ObjectRef::new(&claim.name).within(&claim.namespace);
        if let Some(cached) = self.inner.claims.get(&key)
            && cached.metadata.uid.as_deref() == Some(&claim.uid)
            && cached
                .status
                .as_ref()
                .is_some_and(|s| s.allocation.is_some() && s.reserved_for.is_some())
        {
            return Ok((*cached).clone());
        }
        let api: Api<ResourceClaim> = Api::namespaced(self.inner.client.clone(), &claim.namespace);
        api.get(&claim.name)
            .await
            .map_err(|source| ClaimRefused::Read {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                source,
            })
    }
}
