//! The control plane as a cluster's users meet it: its version, its
//! authentication and authorization, and the DRA validation our tests rely
//! on the real server for.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::api::resource::v1::DeviceClass;
use kube::api::{Api, ListParams, PostParams};
use kube_control_plane::{ControlPlane, Credentials, VERSION};

fn status_code(error: &kube::Error) -> Option<u16> {
    match error {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_control_plane_authenticates_authorizes_and_validates() {
    let plane = ControlPlane::start().await.expect("control plane");
    let admin = plane.admin().await.expect("admin client");

    let version = admin.apiserver_version().await.expect("version");
    assert_eq!(version.git_version, VERSION);

    // Served DRA: the v1 API lists.
    let classes = Api::<DeviceClass>::all(admin.clone());
    classes
        .list(&ListParams::default())
        .await
        .expect("resource.k8s.io/v1");

    // A DeviceClass whose CEL selector does not compile is refused.
    let broken: DeviceClass = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "broken.example.com"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == "}}]},
    }))
    .unwrap();
    let refused = classes
        .create(&PostParams::default(), &broken)
        .await
        .expect_err("a broken CEL expression is invalid");
    assert_eq!(status_code(&refused), Some(422), "{refused}");

    // No credentials worth anything: a bogus token is not authenticated.
    let bogus = plane.dir().join("bogus.kubeconfig");
    plane
        .write_kubeconfig(
            &bogus,
            "bogus",
            Credentials::Token("not-a-token"),
            "default",
        )
        .unwrap();
    let bogus = kube_control_plane::client(&bogus).await.unwrap();
    let error = Api::<Namespace>::all(bogus)
        .list(&ListParams::default())
        .await
        .expect_err("a bogus token lists nothing");
    assert_eq!(status_code(&error), Some(401), "{error}");

    // A kubelet's identity reads no secrets it has no pod for.
    let node = plane.node_kubeconfig("node-a").unwrap();
    let node = kube_control_plane::client(&node).await.unwrap();
    let error = Api::<Secret>::namespaced(node, "kube-system")
        .list(&ListParams::default())
        .await
        .expect_err("the Node authorizer confines a kubelet");
    assert_eq!(status_code(&error), Some(403), "{error}");
}

/// Set in the child process of the test below.
const CHILD: &str = "KUBE_CONTROL_PLANE_SHARED_CHILD";

/// The shared control plane is used by a child process (this test again,
/// as libtest runs it there) that then exits as a test binary does: its
/// folder is gone and its API server no longer answers.
#[test]
fn the_shared_control_plane_is_stopped_and_its_folder_removed_when_the_process_exits() {
    if std::env::var_os(CHILD).is_some() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let plane = ControlPlane::shared().await.expect("control plane");
            // Shared: the same one again.
            assert!(std::ptr::eq(plane, ControlPlane::shared().await.unwrap()));
            let admin = plane.admin().await.unwrap();
            assert_eq!(
                admin.apiserver_version().await.unwrap().git_version,
                VERSION
            );
            println!("folder={}", plane.dir().display());
            println!("server={}", plane.server());
        });
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "the_shared_control_plane_is_stopped_and_its_folder_removed_when_the_process_exits",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.split_once(&format!("{key}=")).map(|(_, value)| value))
            .unwrap_or_else(|| panic!("no {key} in {stdout}"))
            .to_owned()
    };
    let folder = std::path::PathBuf::from(said("folder"));
    assert!(!folder.exists(), "{} left", folder.display());
    let server = said("server");
    let address = server.trim_start_matches("https://");
    assert!(
        std::net::TcpStream::connect(address).is_err(),
        "the API server at {address} still answers"
    );
}
