//! The kubelet's side of a device plugin, as the real one does it: it serves
//! `Registration` on `kubelet.sock` in its device-plugins folder, connects to
//! the endpoint a plugin registers, reads `ListAndWatch`, and starts
//! containers with `Allocate` then `PreStartContainer`; it serves the
//! pod-resources `List`, recording a container's devices after `Allocate`
//! answered, as the kubelet does.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use hypervisor_kubernetes::deviceplugin::pb::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use hypervisor_kubernetes::deviceplugin::pb::podresources::{
    ContainerDevices, ContainerResources, ListPodResourcesRequest, ListPodResourcesResponse,
    PodResources,
};
use hypervisor_kubernetes::deviceplugin::pb::v1beta1::device_plugin_client::DevicePluginClient;
use hypervisor_kubernetes::deviceplugin::pb::v1beta1::registration_server::{
    Registration, RegistrationServer,
};
use hypervisor_kubernetes::deviceplugin::pb::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse, Device, Empty,
    PreStartContainerRequest, RegisterRequest,
};
use hypervisor_kubernetes::deviceplugin::{API_VERSION, kubelet::KUBELET_SOCKET};
use hypervisor_kubernetes::dra::socket;

use super::kubelet::KubeletError;

#[derive(Default)]
struct Shared {
    registered: Vec<RegisterRequest>,
    pods: Vec<PodResources>,
}

#[derive(Clone, Default)]
struct State(Arc<Mutex<Shared>>);

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[tonic::async_trait]
impl Registration for State {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        if request.version != API_VERSION {
            return Err(Status::invalid_argument(format!(
                "version {} is not {API_VERSION}",
                request.version
            )));
        }
        self.lock().registered.push(request);
        Ok(Response::new(Empty {}))
    }
}

#[tonic::async_trait]
impl PodResourcesLister for State {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        Ok(Response::new(ListPodResourcesResponse {
            pod_resources: self.lock().pods.clone(),
        }))
    }
}

/// The fake kubelet; its servers stop when it is dropped.
pub struct FakeDeviceKubelet {
    dir: PathBuf,
    state: State,
    stop: Option<tokio::sync::watch::Sender<bool>>,
}

impl FakeDeviceKubelet {
    /// Serves `Registration` in `dir` and, when `pod_resources` is given,
    /// the pod-resources `List` there.
    pub fn start(dir: &Path, pod_resources: Option<&Path>) -> std::io::Result<Self> {
        let state = State::default();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let until = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let listener = socket::bind(&dir.join(KUBELET_SOCKET))?;
        tokio::spawn(
            Server::builder()
                .add_service(RegistrationServer::new(state.clone()))
                .serve_with_incoming_shutdown(
                    UnixListenerStream::new(listener),
                    until(stopped.clone()),
                ),
        );
        if let Some(path) = pod_resources {
            let listener = socket::bind(path)?;
            tokio::spawn(
                Server::builder()
                    .add_service(PodResourcesListerServer::new(state.clone()))
                    .serve_with_incoming_shutdown(
                        UnixListenerStream::new(listener),
                        until(stopped),
                    ),
            );
        }
        Ok(Self {
            dir: dir.to_owned(),
            state,
            stop: Some(stop),
        })
    }

    /// Waits (up to `wait`) for a plugin to register `resource`, and
    /// connects to its endpoint.
    pub async fn plugin(
        &self,
        resource: &str,
        wait: Duration,
    ) -> Result<PluginClient, KubeletError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let found = self
                .state
                .lock()
                .registered
                .iter()
                .rev()
                .find(|r| r.resource_name == resource)
                .cloned();
            if let Some(registered) = found {
                let path = self.dir.join(&registered.endpoint);
                let channel = socket::connect(&path)
                    .await
                    .map_err(|source| KubeletError::Connect { path, source })?;
                return Ok(PluginClient {
                    registered,
                    client: DevicePluginClient::new(channel),
                    state: self.state.clone(),
                });
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(KubeletError::NoPlugin {
                    driver: resource.to_owned(),
                    dir: self.dir.clone(),
                    waited: wait,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Makes pod `namespace/name` with `containers` known to pod-resources
    /// (admitted, no devices yet).
    pub fn admit(&self, namespace: &str, name: &str, containers: &[&str]) {
        self.state.lock().pods.push(PodResources {
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            containers: containers
                .iter()
                .map(|c| ContainerResources {
                    name: (*c).to_owned(),
                    devices: Vec::new(),
                })
                .collect(),
        });
    }
}

impl Drop for FakeDeviceKubelet {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
    }
}

/// A registered plugin, called as the kubelet calls it.
pub struct PluginClient {
    /// What the plugin registered with: its resource, endpoint and options.
    pub registered: RegisterRequest,
    client: DevicePluginClient<tonic::transport::Channel>,
    state: State,
}

impl PluginClient {
    /// The first `ListAndWatch` answer.
    pub async fn devices(&self) -> Result<Vec<Device>, KubeletError> {
        let mut stream = self
            .client
            .clone()
            .list_and_watch(Empty {})
            .await?
            .into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| KubeletError::Refused("ListAndWatch ended".into()))?;
        Ok(first.devices)
    }

    /// Starts container `container` of pod `namespace/name` with `devices`:
    /// `Allocate`, the devices recorded, then `PreStartContainer`.
    pub async fn start_container(
        &self,
        (namespace, name, container): (&str, &str, &str),
        devices: Vec<String>,
    ) -> Result<ContainerAllocateResponse, KubeletError> {
        let mut client = self.client.clone();
        let mut answer = client
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: devices.clone(),
                }],
            })
            .await?
            .into_inner();
        let response = answer
            .container_responses
            .pop()
            .ok_or_else(|| KubeletError::Refused("no container answer".into()))?;
        {
            let mut state = self.state.lock();
            let pod = state
                .pods
                .iter_mut()
                .find(|p| p.namespace == namespace && p.name == name);
            if let Some(c) = pod.and_then(|p| p.containers.iter_mut().find(|c| c.name == container))
            {
                c.devices.push(ContainerDevices {
                    resource_name: self.registered.resource_name.clone(),
                    device_ids: devices.clone(),
                });
            }
        }
        client
            .pre_start_container(PreStartContainerRequest {
                devices_ids: devices,
            })
            .await?;
        Ok(response)
    }
}
