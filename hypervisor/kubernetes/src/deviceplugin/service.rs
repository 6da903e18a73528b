//! `DevicePlugin` for one resource: the shares, streamed whenever a GPU's
//! health changes, and `Allocate`/`PreStartContainer` handed to an
//! [`Allocator`], whose container edits become env, mounts and device specs.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::pb::v1beta1::device_plugin_server::DevicePlugin;
use super::pb::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, DevicePluginOptions, DeviceSpec,
    Empty, ListAndWatchResponse, Mount, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse,
};
use super::{Allocator, GpuHealth, devices};
use gpushare_utils::logging::one_line;
use hypervisor_provision::cdi::ContainerEdits;

/// The service for `resource`.
pub struct DevicePluginService<A> {
    resource: String,
    shares: u32,
    allocator: Arc<A>,
    gpus: watch::Receiver<Vec<GpuHealth>>,
}

impl<A> DevicePluginService<A> {
    /// Advertises `shares` devices per GPU of `gpus` (the agent's list,
    /// streamed again on every change) and hands `Allocate` and
    /// `PreStartContainer` to `allocator`.
    pub fn new(
        resource: &str,
        shares: u32,
        allocator: Arc<A>,
        gpus: watch::Receiver<Vec<GpuHealth>>,
    ) -> Self {
        Self {
            resource: resource.to_owned(),
            shares,
            allocator,
            gpus,
        }
    }
}

/// The options this plugin registers with.
pub fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: true,
        get_preferred_allocation_available: false,
    }
}

/// `edits` as the kubelet's container answer: the region mount read-write,
/// every other mount read-only; device nodes `rw`.
pub fn container_response(edits: &ContainerEdits) -> ContainerAllocateResponse {
    ContainerAllocateResponse {
        envs: edits
            .env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        mounts: edits
            .mounts
            .iter()
            .map(|m| Mount {
                container_path: m.container_path.clone(),
                host_path: m.host_path.clone(),
                read_only: m.options.iter().any(|o| o == "ro"),
            })
            .collect(),
        devices: edits
            .device_nodes
            .iter()
            .map(|d| DeviceSpec {
                container_path: d.path.clone(),
                host_path: d.host_path.clone(),
                permissions: "rw".to_owned(),
            })
            .collect(),
        annotations: Default::default(),
        cdi_devices: Vec::new(),
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl<A: Allocator> DevicePlugin for DevicePluginService<A> {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let shares = self.shares;
        let mut gpus = self.gpus.clone();
        gpus.mark_changed();
        // Each change of the GPUs' health, the current list first; ends
        // when the sender (the agent) is gone.
        let stream = futures::stream::unfold(gpus, move |mut gpus| async move {
            gpus.changed().await.ok()?;
            let list = devices(&gpus.borrow_and_update(), shares);
            Some((Ok(ListAndWatchResponse { devices: list }), gpus))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented(
            "no preferred allocation: GPUs are chosen at Allocate",
        ))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for container in request.into_inner().container_requests {
            let edits = self
                .allocator
                .allocate(&self.resource, container.devices_ids)
                .await
                .map_err(|refused| {
                    let error = one_line(&refused);
                    tracing::warn!(resource = self.resource, error, "allocate refused");
                    Status::failed_precondition(error)
                })?;
            container_responses.push(container_response(&edits));
        }
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        self.allocator
            .pre_start(&self.resource, request.into_inner().devices_ids)
            .await
            .map_err(|refused| Status::failed_precondition(one_line(&refused)))?;
        Ok(Response::new(PreStartContainerResponse {}))
    }
}
