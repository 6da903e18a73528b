//! `pluginregistration.Registration`: the kubelet's plugin watcher finds our
//! socket in its registry folder, asks `GetInfo` and tells us the outcome.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tonic::{Request, Response, Status};

use super::pb::registration::registration_server::Registration;
use super::pb::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use super::{PLUGIN_TYPE, SUPPORTED_VERSIONS};

/// What we answer, and what the kubelet said last.
#[derive(Debug, Clone)]
pub struct RegistrationService {
    driver: String,
    endpoint: PathBuf,
    status: Arc<Mutex<Option<RegistrationStatus>>>,
}

impl RegistrationService {
    /// For `driver`, whose `DRAPlugin` service is on socket `endpoint` (the
    /// path as the kubelet sees it).
    pub fn new(driver: &str, endpoint: PathBuf) -> Self {
        Self {
            driver: driver.to_owned(),
            endpoint,
            status: Arc::new(Mutex::new(None)),
        }
    }

    /// Whether the kubelet accepted the plugin; `None` before it said.
    pub fn registered(&self) -> Option<bool> {
        self.status
            .lock()
            .ok()?
            .as_ref()
            .map(|s| s.plugin_registered)
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.to_owned(),
            name: self.driver.clone(),
            endpoint: self.endpoint.to_string_lossy().into_owned(),
            supported_versions: SUPPORTED_VERSIONS.map(String::from).to_vec(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = self.driver, "registered with the kubelet");
        } else {
            tracing::error!(
                driver = self.driver,
                error = status.error,
                "the kubelet refused the plugin"
            );
        }
        if let Ok(mut last) = self.status.lock() {
            *last = Some(status);
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
