//! The kubelet's side of a DRA plugin, as the real one does it: find the
//! registration socket in the plugin registry folder, `GetInfo`, check the
//! type and versions, `NotifyRegistrationStatus`, then call `DRAPlugin` on
//! the endpoint the plugin named.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hypervisor_kubernetes::dra::pb::registration::registration_client::RegistrationClient;
use hypervisor_kubernetes::dra::pb::registration::{InfoRequest, PluginInfo, RegistrationStatus};
use hypervisor_kubernetes::dra::{PLUGIN_TYPE, pb, socket};

/// Why the fake kubelet gave up.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    /// No plugin of the driver registered in time.
    #[error("no registration socket for {driver} in {} after {waited:?}", dir.display())]
    NoPlugin {
        /// The DRA driver waited for.
        driver: String,
        /// The plugin registry folder watched.
        dir: PathBuf,
        /// How long it waited.
        waited: Duration,
    },
    /// A socket the plugin named could not be dialled.
    #[error("cannot connect to {}: {source}", path.display())]
    Connect {
        /// The socket.
        path: PathBuf,
        /// Why the connection failed.
        #[source]
        source: tonic::transport::Error,
    },
    /// A call failed at the gRPC level.
    #[error("gRPC: {0}")]
    Rpc(#[from] tonic::Status),
    /// The plugin answered the registration with an error.
    #[error("plugin refused: {0}")]
    Refused(String),
    /// The plugin did not answer a call in [`CALL_TIMEOUT`].
    #[error("{call} did not answer in {CALL_TIMEOUT:?}")]
    TimedOut {
        /// The call.
        call: &'static str,
    },
}

/// How long a call to the plugin may take: the kubelet's default, after
/// which it gives up and tries again on its next pass.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// Which `DRAPlugin` service to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// `v1.DRAPlugin` (kubelets of 1.34 and later).
    V1,
    /// `v1beta1.DRAPlugin` (kubelets of 1.32 and 1.33, and later ones too).
    V1beta1,
}

/// A registered plugin.
#[derive(Clone)]
pub struct FakeKubelet {
    /// What the plugin said of itself at registration.
    pub info: PluginInfo,
    channel: tonic::transport::Channel,
}

/// One claim's answer: CDI device IDs per device, or the error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    /// Each device's name and the CDI device IDs it got.
    pub devices: Vec<(String, Vec<String>)>,
    /// The plugin's error for the claim; empty when prepared.
    pub error: String,
}

/// The plugin's answer for one claim (`(namespace, name, uid)`) to
/// `$method` with a `$request` of it, on the `DRAPlugin` service of
/// version `$v`: a macro, as each version's types are generated apart.
macro_rules! one_claim {
    ($kubelet:ident, $v:ident, $method:ident, $request:ident, $claim:expr) => {{
        let (namespace, name, uid) = $claim;
        let mut client = pb::$v::dra_plugin_client::DraPluginClient::new($kubelet.channel.clone());
        let request = pb::$v::$request {
            claims: vec![pb::$v::Claim {
                namespace: namespace.into(),
                uid: uid.into(),
                name: name.into(),
            }],
        };
        let call = tokio::time::timeout(CALL_TIMEOUT, client.$method(request));
        let Ok(answer) = call.await else {
            return Err(KubeletError::TimedOut {
                call: stringify!($method),
            });
        };
        let mut answer = answer?.into_inner();
        answer
            .claims
            .remove(uid)
            .ok_or_else(|| KubeletError::Refused(format!("no answer for claim {uid}")))?
    }};
}

impl FakeKubelet {
    /// Waits (up to `wait`) for a socket in `registry_dir` whose plugin says
    /// it is `driver`, registers it, and connects to its endpoint.
    pub async fn register(
        registry_dir: &Path,
        driver: &str,
        wait: Duration,
    ) -> Result<Self, KubeletError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            for path in sockets(registry_dir) {
                let Ok(channel) = socket::connect(&path).await else {
                    continue;
                };
                let mut client = RegistrationClient::new(channel);
                let Ok(info) = client
                    .get_info(InfoRequest {})
                    .await
                    .map(tonic::Response::into_inner)
                else {
                    continue;
                };
                if info.name != driver {
                    continue;
                }
                let problem = if info.r#type != PLUGIN_TYPE {
                    Some(format!("type {:?} is not {PLUGIN_TYPE}", info.r#type))
                } else if !info
                    .supported_versions
                    .iter()
                    .any(|v| v == "v1.DRAPlugin" || v == "v1beta1.DRAPlugin")
                {
                    Some(format!(
                        "no supported version in {:?}",
                        info.supported_versions
                    ))
                } else {
                    None
                };
                client
                    .notify_registration_status(RegistrationStatus {
                        plugin_registered: problem.is_none(),
                        error: problem.clone().unwrap_or_default(),
                    })
                    .await?;
                if let Some(problem) = problem {
                    return Err(KubeletError::Refused(problem));
                }
                let endpoint = PathBuf::from(&info.endpoint);
                let channel =
                    socket::connect(&endpoint)
                        .await
                        .map_err(|source| KubeletError::Connect {
                            path: endpoint,
                            source,
                        })?;
                return Ok(Self { info, channel });
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(KubeletError::NoPlugin {
                    driver: driver.to_owned(),
                    dir: registry_dir.to_owned(),
                    waited: wait,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `NodePrepareResources` for one claim.
    pub async fn prepare(
        &self,
        version: Version,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<Prepared, KubeletError> {
        let claim = (namespace, name, uid);
        macro_rules! prepared {
            ($v:ident) => {{
                let one = one_claim!(
                    self,
                    $v,
                    node_prepare_resources,
                    NodePrepareResourcesRequest,
                    claim
                );
                let devices = one.devices.into_iter();
                Prepared {
                    devices: devices.map(|d| (d.device_name, d.cdi_device_ids)).collect(),
                    error: one.error,
                }
            }};
        }
        Ok(match version {
            Version::V1 => prepared!(v1),
            Version::V1beta1 => prepared!(v1beta1),
        })
    }

    /// `NodeUnprepareResources` for one claim; returns its error ("" when none).
    pub async fn unprepare(
        &self,
        version: Version,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<String, KubeletError> {
        let claim = (namespace, name, uid);
        Ok(match version {
            Version::V1 => {
                one_claim!(
                    self,
                    v1,
                    node_unprepare_resources,
                    NodeUnprepareResourcesRequest,
                    claim
                )
                .error
            }
            Version::V1beta1 => {
                one_claim!(
                    self,
                    v1beta1,
                    node_unprepare_resources,
                    NodeUnprepareResourcesRequest,
                    claim
                )
                .error
            }
        })
    }
}

fn sockets(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "sock"))
        .collect();
    found.sort();
    found
}
