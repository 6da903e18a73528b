//! The DRA plugin's preparer: a claim the kubelet names is read, turned
//! into a request ([`super::claims`]) and provisioned; unprepared, its
//! files go and the hypervisor's pods follow.

use crate::NodeAgent;
use crate::dra::claims;
use crate::dra::{ClaimPreparer, ClaimRef, ClaimRefused, PreparedDevice};

impl ClaimPreparer for NodeAgent {
    async fn prepare(&self, claim: ClaimRef) -> Result<Vec<PreparedDevice>, ClaimRefused> {
        let _busy = self.inner.busy.lock().await;
        let devices = |request: &crate::provision::ClaimRequest, cdi: &[String]| {
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
        let object = self.claim(&claim).await?;
        claims::check_uid(&object, &claim.uid)?;
        let o = &self.inner.options;
        let request = {
            let provisioner = self.provisioner();
            claims::to_request(&object, &o.driver, &o.node, provisioner.gpus())?
        };
        let cdi = self.provision(&request)?;
        Ok(devices(&request, &cdi))
    }

    async fn unprepare(&self, claim: ClaimRef) -> Result<(), ClaimRefused> {
        let _busy = self.inner.busy.lock().await;
        let removed = self.provisioner().unprepare(&claim.uid)?;
        if removed {
            self.sync()?;
        }
        Ok(())
    }
}
