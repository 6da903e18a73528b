//! Kubeconfig files for the cluster's identities: a client certificate
//! (administrator, scheduler, controller manager, a node's kubelet) or a
//! bearer token (a ServiceAccount's).

use std::path::Path;

use crate::Error;
use crate::pki::CertFiles;

/// How a kubeconfig's user proves who it is.
pub enum Credentials<'a> {
    /// A client certificate and its key.
    Certificate(&'a CertFiles),
    /// A bearer token.
    Token(&'a str),
}

/// Writes a kubeconfig at `path` for `server`, trusting `ca`, as `user`
/// with `credentials`, in namespace `namespace`.
pub(crate) fn write(
    path: &Path,
    server: &str,
    ca: &Path,
    user: &str,
    credentials: Credentials<'_>,
    namespace: &str,
) -> Result<(), Error> {
    let user_entry = match credentials {
        Credentials::Certificate(files) => serde_json::json!({
            "client-certificate": files.cert,
            "client-key": files.key,
        }),
        Credentials::Token(token) => serde_json::json!({"token": token}),
    };
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": user, "user": user_entry}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user, "namespace": namespace}}],
        "current-context": "test",
    });
    // JSON is YAML: every client reads it.
    let text = serde_json::to_string_pretty(&config).map_err(|e| Error::Io {
        what: format!("encode {}", path.display()),
        source: e.into(),
    })?;
    std::fs::write(path, text).map_err(|source| Error::Io {
        what: format!("write {}", path.display()),
        source,
    })
}
