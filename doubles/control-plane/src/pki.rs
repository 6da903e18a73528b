//! The cluster's certificates, made fresh for each control plane: one CA,
//! the API server's serving certificate (loopback names), a client
//! certificate per identity (the user in its common name, the groups in its
//! organisations, as the API server reads them), and the key that signs
//! service-account tokens.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

use crate::Error;

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// The certificate.
    pub cert: PathBuf,
    /// Its private key (PKCS#8).
    pub key: PathBuf,
}

/// The CA that issues every certificate of one cluster.
pub(crate) struct Authority {
    issuer: Issuer<'static, KeyPair>,
    /// The CA's certificate file (the API server's `--client-ca-file`, and
    /// what clients trust).
    pub cert: PathBuf,
    dir: PathBuf,
}

impl Authority {
    /// A new CA, its certificate written under `dir`.
    pub(crate) fn new(dir: &Path) -> Result<Self, Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = name("gpushare-test-ca", None);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key)?;
        let path = dir.join("ca.crt");
        write(&path, cert.pem())?;
        Ok(Self {
            issuer: Issuer::new(params, key),
            cert: path,
            dir: dir.to_owned(),
        })
    }

    /// The serving certificate `name` for the loopback names.
    pub(crate) fn server(&self, name: &str) -> Result<CertFiles, Error> {
        let mut params =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
        params.distinguished_name = self::name(name, None);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue(name, params)
    }

    /// A client certificate for user `user`, in `group` if given.
    pub(crate) fn client(
        &self,
        file: &str,
        user: &str,
        group: Option<&str>,
    ) -> Result<CertFiles, Error> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = name(user, group);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(file, params)
    }

    fn issue(&self, file: &str, mut params: CertificateParams) -> Result<CertFiles, Error> {
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let files = CertFiles {
            cert: self.dir.join(format!("{file}.crt")),
            key: self.dir.join(format!("{file}.key")),
        };
        write(&files.cert, cert.pem())?;
        write(&files.key, key.serialize_pem())?;
        Ok(files)
    }
}

/// A new key that signs service-account tokens, written to `<dir>/<file>.key`,
/// and its public half, which verifies them, to `<dir>/<file>.pub`.
pub(crate) fn signing_key(dir: &Path, file: &str) -> Result<CertFiles, Error> {
    let key = KeyPair::generate()?;
    let files = CertFiles {
        cert: dir.join(format!("{file}.pub")),
        key: dir.join(format!("{file}.key")),
    };
    write(&files.key, key.serialize_pem())?;
    write(&files.cert, key.public_key_pem())?;
    Ok(files)
}

/// A subject: the API server reads the user from its common name and the
/// group from its organisation.
fn name(common: &str, organisation: Option<&str>) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common);
    if let Some(organisation) = organisation {
        name.push(DnType::OrganizationName, organisation);
    }
    name
}

fn write(path: &Path, text: String) -> Result<(), Error> {
    std::fs::write(path, text).map_err(|source| Error::Io {
        what: format!("write {}", path.display()),
        source,
    })
}
