//! The official Kubernetes control plane, 1.37, for the tests: etcd,
//! kube-apiserver, kube-scheduler and kube-controller-manager, built from
//! their Go modules (`go/`, by `scripts/build-control-plane.sh`) and run
//! on loopback in a temporary folder with certificates made for the run.
//! The API server runs as clusters do: client certificates and
//! service-account tokens, `Node,RBAC` authorization, the default admission
//! chain plus `NodeRestriction`, the DRA APIs of its release (consumable
//! capacity and device taints are on by default in 1.37). The scheduler and
//! the controller manager run with their own identities and every default
//! controller, each controller with its own ServiceAccount.
//!
//! A dev-only crate: nothing shipped links it.

mod kubeconfig;
mod pki;
mod process;
pub mod program;
mod shared;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};

pub use kubeconfig::Credentials;
pub use pki::CertFiles;
pub use process::dies_with_parent;

use pki::Authority;
use process::Component;

/// The version of every component.
pub const VERSION: &str = "v1.37.2";

/// Why the control plane could not be started or used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The program is missing or was built from other sources.
    #[error(
        "the control plane at {} is not usable ({why}): run scripts/build-control-plane.sh (the README's test command runs it)",
        path.display()
    )]
    NotBuilt {
        /// Where it was looked for.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A certificate could not be made.
    #[error("certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    /// A component exited.
    #[error("{component} exited ({status}); its log ends with:\n{log}")]
    Exited {
        /// Which.
        component: &'static str,
        /// How.
        status: String,
        /// The end of its log.
        log: String,
    },
    /// Something did not become ready in time.
    #[error("{what} not ready after {waited:?}")]
    NotReady {
        /// What was waited for.
        what: String,
        /// How long.
        waited: Duration,
    },
    /// A kubeconfig could not be read.
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    /// An API call failed.
    #[error("API: {0}")]
    Api(#[from] kube::Error),
}

/// A running control plane; dropping it stops every component (the
/// controller manager and the scheduler first, etcd last) and removes its
/// folder. [`ControlPlane::shared`] is the one every test of a process
/// may share.
pub struct ControlPlane {
    /// Started components, in start order; emptied when stopped.
    components: Mutex<Vec<Component>>,
    authority: Authority,
    /// `https://127.0.0.1:<port>`.
    server: String,
    admin: PathBuf,
    /// The administrator's certificate.
    admin_cert: CertFiles,
    /// The program and the API server's flags, to start it again alone
    /// ([`ControlPlane::start_api_server`]).
    api_server: (PathBuf, Vec<String>),
    // Last: removed once every component stopped.
    dir: tempfile::TempDir,
}

/// How long the API server and the controllers may take to come up, on a
/// slow, busy machine.
const START_WAIT: Duration = Duration::from_secs(180);

/// The API server's component name.
const API_SERVER: &str = "kube-apiserver";

/// How many more starts when a port found free was taken before it was
/// bound (the ports are picked by binding port 0, then released).
const PORT_TRIES: u32 = 5;

impl ControlPlane {
    /// Starts etcd, the API server, the scheduler and the controller
    /// manager, and returns once the API server is ready and the controller
    /// manager made the `default` namespace's ServiceAccount.
    ///
    /// Start it from the test's own thread (or a runtime that lives as long
    /// as the control plane): the components are killed when the thread
    /// that started them ends. Tests that can share one take
    /// [`ControlPlane::shared`] instead.
    pub async fn start() -> Result<Self, Error> {
        let mut tries = 0;
        loop {
            match Self::start_on_free_ports().await {
                // A port found free was taken by another process before the
                // component bound it: again, on other ports.
                Err(Error::Exited { ref log, .. })
                    if log.contains("address already in use") && tries < PORT_TRIES =>
                {
                    tries += 1;
                }
                started => return started,
            }
        }
    }

    async fn start_on_free_ports() -> Result<Self, Error> {
        let program = program::find()?;
        shared::remove_abandoned_folders();
        let dir = tempfile::Builder::new()
            .prefix(&shared::folder_prefix())
            .tempdir()
            .map_err(|source| Error::Io {
                what: "make the cluster folder".to_owned(),
                source,
            })?;
        let path = dir.path().to_owned();
        let authority = Authority::new(&path)?;
        let serving = authority.server(API_SERVER)?;
        let signing = pki::signing_key(&path, "service-account")?;
        let (etcd_client, etcd_peer, secure) = (free_port()?, free_port()?, free_port()?);
        let server = format!("https://127.0.0.1:{secure}");
        let admin_cert = authority.client("admin", "kubernetes-admin", Some("system:masters"))?;
        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");
        let ca = authority.cert.display().to_string();
        let key = signing.key.display().to_string();
        let public = signing.cert.display().to_string();
        let api_server_args = vec![
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".to_owned(),
            format!("--secure-port={secure}"),
            format!("--cert-dir={}", path.join("apiserver").display()),
            format!("--tls-cert-file={}", serving.cert.display()),
            format!("--tls-private-key-file={}", serving.key.display()),
            format!("--client-ca-file={ca}"),
            format!("--service-account-key-file={public}"),
            format!("--service-account-signing-key-file={key}"),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_owned(),
            "--service-cluster-ip-range=10.96.0.0/16".to_owned(),
            "--authorization-mode=Node,RBAC".to_owned(),
            "--enable-admission-plugins=NodeRestriction".to_owned(),
            // The node daemon's container is privileged.
            "--allow-privileged=true".to_owned(),
            // Loopback is no address for the `kubernetes` Service's
            // endpoints, and nothing here reaches the API through it.
            "--endpoint-reconciler-type=none".to_owned(),
            "--profiling=false".to_owned(),
        ];
        let plane = Self {
            components: Mutex::new(Vec::new()),
            admin: path.join("admin.kubeconfig"),
            admin_cert,
            authority,
            server,
            api_server: (program.clone(), api_server_args),
            dir,
        };
        plane.write_admin_kubeconfig(&plane.admin, "default")?;

        plane.spawn(
            &program,
            "etcd",
            vec![
                "--name=test".to_owned(),
                format!("--data-dir={}", path.join("etcd").display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=test={peer_url}"),
                "--log-level=warn".to_owned(),
                // A test cluster: losing it on a power cut costs nothing.
                "--unsafe-no-fsync=true".to_owned(),
            ],
        )?;
        plane.spawn(&program, API_SERVER, plane.api_server.1.clone())?;
        plane.wait_api_server().await?;

        for (component, user) in [
            ("kube-scheduler", "system:kube-scheduler"),
            ("kube-controller-manager", "system:kube-controller-manager"),
        ] {
            let files = plane.authority.client(component, user, None)?;
            let kubeconfig = path.join(format!("{component}.kubeconfig"));
            plane.write_kubeconfig(
                &kubeconfig,
                user,
                Credentials::Certificate(&files),
                "default",
            )?;
            let mut args = vec![
                format!("--kubeconfig={}", kubeconfig.display()),
                "--leader-elect=false".to_owned(),
                // No HTTPS endpoint of their own: nothing here scrapes them.
                "--secure-port=0".to_owned(),
            ];
            if component == "kube-controller-manager" {
                args.extend([
                    "--use-service-account-credentials=true".to_owned(),
                    format!("--root-ca-file={ca}"),
                    format!("--service-account-private-key-file={key}"),
                ]);
            }
            plane.spawn(&program, component, args)?;
        }
        plane
            .wait(
                "the controller manager (ServiceAccount default/default)",
                async |client| {
                    let accounts = Api::<ServiceAccount>::namespaced(client, "default");
                    Ok(accounts.get_opt("default").await?.is_some())
                },
            )
            .await?;
        Ok(plane)
    }

    /// The API server's URL.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The cluster's folder (certificates, kubeconfigs, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA certificate every client trusts.
    pub fn ca(&self) -> &Path {
        &self.authority.cert
    }

    /// The administrator's kubeconfig (`system:masters`).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin
    }

    /// Writes a kubeconfig at `path` for the administrator, in namespace
    /// `namespace`.
    pub fn write_admin_kubeconfig(&self, path: &Path, namespace: &str) -> Result<(), Error> {
        let admin = Credentials::Certificate(&self.admin_cert);
        self.write_kubeconfig(path, "kubernetes-admin", admin, namespace)
    }

    /// A client as the administrator.
    pub async fn admin(&self) -> Result<kube::Client, Error> {
        client(&self.admin).await
    }

    /// Writes a kubeconfig for this cluster at `path`.
    pub fn write_kubeconfig(
        &self,
        path: &Path,
        user: &str,
        credentials: Credentials<'_>,
        namespace: &str,
    ) -> Result<(), Error> {
        kubeconfig::write(path, &self.server, self.ca(), user, credentials, namespace)
    }

    /// A kubeconfig (in the cluster's folder) for node `node`'s kubelet:
    /// `system:node:<node>` in `system:nodes`, which the Node authorizer and
    /// the NodeRestriction admission plugin confine to its own node and pods.
    pub fn node_kubeconfig(&self, node: &str) -> Result<PathBuf, Error> {
        let file = format!("kubelet-{node}");
        let user = format!("system:node:{node}");
        let files = self.authority.client(&file, &user, Some("system:nodes"))?;
        let path = self.dir().join(format!("{file}.kubeconfig"));
        self.write_kubeconfig(&path, &user, Credentials::Certificate(&files), "default")?;
        Ok(path)
    }

    /// A kubeconfig at `path` with a token of ServiceAccount
    /// `namespace/name`, from the TokenRequest API as a kubelet gets one
    /// for a pod.
    pub async fn service_account_kubeconfig(
        &self,
        namespace: &str,
        name: &str,
        path: &Path,
    ) -> Result<(), Error> {
        let accounts = Api::<ServiceAccount>::namespaced(self.admin().await?, namespace);
        let request = serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600},
        });
        let issued: TokenRequest = accounts
            .create_subresource("token", name, &PostParams::default(), &request)
            .await?;
        let token = issued.status.and_then(|s| s.token).unwrap_or_default();
        let user = format!("system:serviceaccount:{namespace}:{name}");
        self.write_kubeconfig(path, &user, Credentials::Token(&token), namespace)
    }

    /// Fails if a component has exited.
    pub fn check(&self) -> Result<(), Error> {
        self.components().iter_mut().try_for_each(Component::check)
    }

    /// Kills the API server alone, as a crash does: its connections reset,
    /// its watches end without a word. (Asked to stop, it drains its
    /// requests for as long again as the rest of a test takes.) etcd keeps
    /// the cluster's data, and the scheduler, the controller manager and
    /// every client keep running, failing their requests until
    /// [`ControlPlane::start_api_server`].
    pub fn stop_api_server(&self) {
        let mut components = self.components();
        if let Some(at) = components.iter().position(|c| c.name == API_SERVER) {
            components.remove(at).stop(Duration::ZERO);
        }
    }

    /// Starts the API server again, with the flags it first ran with (the
    /// same port, certificates and etcd), after
    /// [`ControlPlane::stop_api_server`]; returns once it is ready. Start it
    /// from the thread that started the plane (see [`ControlPlane::start`]).
    pub async fn start_api_server(&self) -> Result<(), Error> {
        let (program, args) = &self.api_server;
        let component = Component::start(program, API_SERVER, args, self.dir.path())?;
        {
            // Back in its place, after etcd: stopped before it, as at first.
            let mut components = self.components();
            let at = components
                .iter()
                .position(|c| c.name == "etcd")
                .map_or(0, |etcd| etcd + 1);
            components.insert(at, component);
        }
        self.wait_api_server().await
    }

    /// Waits until the API server says it is ready.
    async fn wait_api_server(&self) -> Result<(), Error> {
        self.wait("the API server's /readyz", async |client| {
            let request = http::Request::get("/readyz?verbose")
                .body(Vec::new())
                .map_err(|e| kube::Error::Service(e.into()))?;
            client.request_text(request).await.map(|_| true)
        })
        .await
    }

    /// The end of every component's log, for a failing test to print.
    pub fn logs(&self) -> String {
        self.components()
            .iter()
            .map(|c| format!("--- {} ---\n{}\n", c.name, c.log_tail()))
            .collect()
    }

    /// Stops every component (the controller manager and the scheduler
    /// first, etcd last) and removes the cluster's folder.
    fn stop(&self) {
        let mut components = self.components();
        while let Some(mut component) = components.pop() {
            component.stop(Duration::from_secs(10));
        }
        // Gone already is what is wanted; anything else cannot be helped
        // while stopping.
        let _ = std::fs::remove_dir_all(self.dir.path());
    }

    /// The components, even if a holder panicked.
    fn components(&self) -> MutexGuard<'_, Vec<Component>> {
        self.components
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn spawn(&self, program: &Path, name: &'static str, args: Vec<String>) -> Result<(), Error> {
        let component = Component::start(program, name, &args, self.dir.path())?;
        self.components().push(component);
        Ok(())
    }

    /// Polls `ready` with an administrator's client until it says true,
    /// failing at once if a component exits.
    async fn wait(
        &self,
        what: &str,
        ready: impl AsyncFn(kube::Client) -> Result<bool, kube::Error>,
    ) -> Result<(), Error> {
        let started = Instant::now();
        let client = client(&self.admin).await?;
        loop {
            self.check()?;
            if let Ok(true) = ready(client.clone()).await {
                return Ok(());
            }
            if started.elapsed() > START_WAIT {
                return Err(Error::NotReady {
                    what: format!("{what}; logs:\n{}", self.logs()),
                    waited: START_WAIT,
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A client from the kubeconfig at `path`.
pub async fn client(path: &Path) -> Result<kube::Client, Error> {
    // ring, as the agent's client: a test binary that also links aws-lc
    // (through another dependency) cannot have rustls pick one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    Ok(kube::Client::try_from(config)?)
}

/// A loopback port free now.
fn free_port() -> Result<u16, Error> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|source| Error::Io {
        what: "find a free port".to_owned(),
        source,
    })?;
    let port = listener.local_addr().map_err(|source| Error::Io {
        what: "find a free port".to_owned(),
        source,
    })?;
    Ok(port.port())
}
