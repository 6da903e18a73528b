//! Where the hypervisor learns its pods: a [`PodSource`] says which pods
//! should exist now; [`sync`] makes the hypervisor's pods exactly those.
//! The config file is read by the daemon itself (and on reload); the
//! Kubernetes agent's prepared claims are a source of this kind.

use hypervisor_core::scheduler::ApplyReport;
use hypervisor_core::spec::PodSpec;

use crate::Hypervisor;

/// The pods that should exist now.
pub trait PodSource: Send + Sync {
    /// Why the source could not say.
    type Error: std::error::Error;

    /// Every pod that should exist now.
    fn pods(&self) -> Result<Vec<PodSpec>, Self::Error>;
}

/// Applies what `source` says; on an error nothing changes.
pub fn sync<S: PodSource>(hv: &Hypervisor, source: &S) -> Result<ApplyReport, S::Error> {
    Ok(hv.apply(source.pods()?))
}
