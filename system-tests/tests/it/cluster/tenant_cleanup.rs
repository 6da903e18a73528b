//! A test's part of the shared control plane goes when the test ends: its
//! Node, its namespace and the cluster-scoped objects it made.

use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::api::{Api, PostParams};
use serde_json::json;

use super::{runtime, tenant};

#[test]
fn a_tenants_node_namespace_and_cluster_objects_go_when_it_ends() {
    runtime().block_on(async {
        let tenant = tenant("tenant").await;
        let (admin, name) = (tenant.client.clone(), tenant.name.clone());
        tenant.register_node().await.unwrap();
        let roles = Api::<ClusterRole>::all(admin.clone());
        let role: ClusterRole =
            serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        roles.create(&PostParams::default(), &role).await.unwrap();
        tenant.delete_at_end::<ClusterRole>(None, &name);
        let (nodes, namespaces) = (
            Api::<Node>::all(admin.clone()),
            Api::<Namespace>::all(admin),
        );
        assert!(nodes.get_opt(&name).await.unwrap().is_some());
        assert!(namespaces.get_opt(&name).await.unwrap().is_some());

        drop(tenant);
        assert!(
            nodes.get_opt(&name).await.unwrap().is_none(),
            "Node {name} left"
        );
        assert!(
            roles.get_opt(&name).await.unwrap().is_none(),
            "ClusterRole {name} left"
        );
        // The namespace controller empties it before it goes.
        let namespace = namespaces.get_opt(&name).await.unwrap();
        assert!(
            namespace.is_none_or(|n| n.metadata.deletion_timestamp.is_some()),
            "namespace {name} left"
        );
    });
}
