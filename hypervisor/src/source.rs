//! Where the hypervisor learns its pods: a [`PodSource`] says which pods
//! should exist now; [`sync`] makes the hypervisor's pods exactly those.
//! The TOML config file ([`TomlSource`], the standalone backend) and the
//! Kubernetes agent's prepared claims
//! ([`crate::kubernetes::KubernetesSource`]) are the two.

use std::path::PathBuf;

use crate::daemon::Hypervisor;
use crate::scheduler::ApplyReport;
use crate::spec::PodSpec;

/// Why a source could not say.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Provision(#[from] crate::provision::ProvisionError),
}

/// The pods that should exist now.
pub trait PodSource: Send + Sync {
    fn pods(&self) -> Result<Vec<PodSpec>, SourceError>;
}

/// The `[[pods]]` of a config file.
#[derive(Debug, Clone)]
pub struct TomlSource {
    pub path: PathBuf,
}

impl PodSource for TomlSource {
    fn pods(&self) -> Result<Vec<PodSpec>, SourceError> {
        Ok(crate::config::load(&self.path)?.pods)
    }
}

/// Applies what `source` says; on an error nothing changes.
pub fn sync(hv: &Hypervisor, source: &dyn PodSource) -> Result<ApplyReport, SourceError> {
    Ok(hv.apply(source.pods()?))
}
