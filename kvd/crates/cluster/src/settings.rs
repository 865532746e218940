//! How to reach etcd: the flags `kvd serve` and `kvd control` share, the files they name
//! (a password, TLS material), and the resolved settings of a node's registration.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use crate::{Error, Result};

/// How to reach etcd: one flag group for `kvd serve` and `kvd control` (the same names, the
/// same checks). `kvd serve`'s config file has the same keys.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct EtcdArgs {
    /// Cluster mode: etcd endpoints, comma-separated (`http://10.0.0.9:2379,...`). `kvd serve`
    /// registers the node there under a TTL lease and takes its peers from what is registered
    /// (needs --cluster-secret-file; without --etcd the node is on its own, peers only from
    /// --peer); `kvd control` follows the nodes' registrations as worker events and keeps its
    /// snapshot there (`<prefix>/control/snapshot`), from which a restarted one resumes.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// The key prefix of this cluster in etcd [default: /kvd].
    #[arg(long)]
    pub etcd_prefix: Option<String>,
    /// etcd user, when etcd has authentication on (with --etcd-password-file).
    #[arg(long)]
    pub etcd_user: Option<String>,
    /// A file holding the etcd user's password (readable by its owner only).
    #[arg(long)]
    pub etcd_password_file: Option<PathBuf>,
    /// TLS to etcd: the CA certificate (PEM) that signs etcd's (use https:// endpoints).
    #[arg(long)]
    pub etcd_ca_file: Option<PathBuf>,
    /// TLS to etcd: this node's client certificate (PEM), when etcd asks for one.
    #[arg(long)]
    pub etcd_cert_file: Option<PathBuf>,
    /// TLS to etcd: the client certificate's key (PEM, readable by its owner only).
    #[arg(long)]
    pub etcd_key_file: Option<PathBuf>,
}

impl EtcdArgs {
    /// Whether cluster mode is on (endpoints given).
    pub fn is_on(&self) -> bool {
        !self.etcd.is_empty()
    }

    /// The cluster's key prefix, without a trailing slash.
    pub fn prefix(&self) -> String {
        self.etcd_prefix
            .as_deref()
            .unwrap_or("/kvd")
            .trim_end_matches('/')
            .to_string()
    }

    /// Authentication and TLS from the files named: a user goes with a password file, a
    /// certificate with its key, and a client certificate only with a CA; with a CA every
    /// endpoint must be `https://`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an incomplete pair, an unreadable file, a password or key
    /// file readable by others, or a plain endpoint with TLS.
    pub fn security(&self) -> Result<EtcdSecurity> {
        let auth = match (&self.etcd_user, &self.etcd_password_file) {
            (Some(u), Some(p)) => {
                let pw = String::from_utf8_lossy(&owner_only(p, "etcd password file")?)
                    .trim_end_matches(['\n', '\r'])
                    .to_string();
                Some((u.clone(), pw))
            }
            (None, None) => None,
            _ => {
                return Err(Error::InvalidArgument(
                    "--etcd-user and --etcd-password-file go together".into(),
                ));
            }
        };
        Ok(EtcdSecurity {
            auth,
            tls: self.tls()?,
        })
    }

    fn tls(&self) -> Result<Option<EtcdTls>> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|e| Error::InvalidArgument(format!("{}: {e}", p.display())))
        };
        let ca = match (
            &self.etcd_ca_file,
            &self.etcd_cert_file,
            &self.etcd_key_file,
        ) {
            (None, None, None) => return Ok(None),
            (Some(ca), _, _) => ca,
            _ => {
                return Err(Error::InvalidArgument(
                    "a client certificate for etcd needs --etcd-ca-file too".into(),
                ));
            }
        };
        let identity_pem = match (&self.etcd_cert_file, &self.etcd_key_file) {
            (Some(c), Some(k)) => Some((read(c)?, owner_only(k, "etcd client key")?)),
            (None, None) => None,
            _ => {
                return Err(Error::InvalidArgument(
                    "--etcd-cert-file and --etcd-key-file go together".into(),
                ));
            }
        };
        if self.etcd.iter().any(|u| !u.starts_with("https://")) {
            return Err(Error::InvalidArgument(
                "with --etcd-ca-file every --etcd endpoint is https://".into(),
            ));
        }
        Ok(Some(EtcdTls {
            ca_pem: read(ca)?,
            identity_pem,
        }))
    }
}

/// A file that must be readable by its owner only (a password, a key); its bytes.
fn owner_only(p: &Path, what: &str) -> Result<Vec<u8>> {
    use std::os::unix::fs::PermissionsExt;
    let shown = p.display();
    let meta =
        std::fs::metadata(p).map_err(|e| Error::InvalidArgument(format!("{what} {shown}: {e}")))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what} {shown} is readable by others; `chmod 600 {shown}`"
        )));
    }
    std::fs::read(p).map_err(|e| Error::InvalidArgument(format!("{what} {shown}: {e}")))
}

/// etcd's user and password and the TLS material, read from the files [`EtcdArgs`] names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdSecurity {
    /// etcd user and password, if etcd has authentication on.
    pub auth: Option<(String, String)>,
    /// TLS to etcd.
    pub tls: Option<EtcdTls>,
}

impl EtcdSecurity {
    /// etcd's connection options: these credentials, and `timeout` for connecting and for
    /// every call.
    pub(crate) fn connect_options(&self, timeout: Duration) -> etcd_client::ConnectOptions {
        let mut opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        if let Some((user, password)) = &self.auth {
            opts = opts.with_user(user.clone(), password.clone());
        }
        if let Some(t) = &self.tls {
            let mut tls = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(&t.ca_pem));
            if let Some((cert, key)) = &t.identity_pem {
                tls = tls.identity(etcd_client::Identity::from_pem(cert, key));
            }
            opts = opts.with_tls(tls);
        }
        opts
    }
}

/// TLS material for etcd (read at start; the endpoints are then `https://`).
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA certificate(s) that sign etcd's certificate, PEM.
    pub ca_pem: Vec<u8>,
    /// This node's client certificate and key, PEM.
    pub identity_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("client_certificate", &self.identity_pem.is_some())
            .finish_non_exhaustive()
    }
}

/// A node's cluster-mode settings, resolved: where etcd is, how long its lease lives, and the
/// cluster's key prefix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClusterConfig {
    /// etcd endpoints (`http://HOST:PORT`).
    pub etcd: Vec<String>,
    /// The registration lease's TTL, ms.
    pub lease_ttl_ms: u64,
    /// The key prefix (one cluster per prefix).
    pub prefix: String,
    /// Credentials and TLS.
    #[serde(skip)]
    pub security: EtcdSecurity,
}

impl ClusterConfig {
    /// The settings `args` give, with a lease of `lease_ttl_ms` (the files named are read now).
    ///
    /// # Errors
    /// As [`EtcdArgs::security`].
    pub fn from_args(args: &EtcdArgs, lease_ttl_ms: u64) -> Result<ClusterConfig> {
        Ok(ClusterConfig {
            etcd: args.etcd.clone(),
            lease_ttl_ms,
            prefix: args.prefix(),
            security: args.security()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn file(dir: &Path, name: &str, body: &str, mode: u32) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn the_prefix_defaults_to_kvd_and_loses_a_trailing_slash() {
        let mut a = EtcdArgs::default();
        assert_eq!(a.prefix(), "/kvd");
        a.etcd_prefix = Some("/team-a/".into());
        assert_eq!(a.prefix(), "/team-a");
        assert!(!a.is_on());
    }

    #[test]
    fn a_password_file_readable_by_others_is_refused_with_the_fix() {
        let d = tempfile::tempdir().unwrap();
        let a = EtcdArgs {
            etcd: vec!["http://127.0.0.1:2379".into()],
            etcd_user: Some("kvd".into()),
            etcd_password_file: Some(file(d.path(), "pw", "s3cret\n", 0o644)),
            ..EtcdArgs::default()
        };
        let e = a.security().unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        let ok = EtcdArgs {
            etcd_password_file: Some(file(d.path(), "pw2", "s3cret\n", 0o600)),
            ..a
        };
        assert_eq!(
            ok.security().unwrap().auth,
            Some(("kvd".into(), "s3cret".into()))
        );
    }

    #[test]
    fn half_pairs_and_plain_endpoints_with_tls_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let ca = file(d.path(), "ca.pem", "ca", 0o644);
        let key = file(d.path(), "key.pem", "key", 0o600);
        let cases = [
            EtcdArgs {
                etcd_user: Some("u".into()),
                ..EtcdArgs::default()
            },
            EtcdArgs {
                etcd_cert_file: Some(ca.clone()),
                etcd_key_file: Some(key.clone()),
                ..EtcdArgs::default()
            },
            EtcdArgs {
                etcd: vec!["https://a:2379".into()],
                etcd_ca_file: Some(ca.clone()),
                etcd_key_file: Some(key.clone()),
                ..EtcdArgs::default()
            },
            EtcdArgs {
                etcd: vec!["http://a:2379".into()],
                etcd_ca_file: Some(ca.clone()),
                ..EtcdArgs::default()
            },
        ];
        for a in cases {
            assert!(
                matches!(a.security(), Err(Error::InvalidArgument(_))),
                "{a:?}"
            );
        }
        let tls = EtcdArgs {
            etcd: vec!["https://a:2379".into()],
            etcd_ca_file: Some(ca),
            ..EtcdArgs::default()
        }
        .security()
        .unwrap()
        .tls
        .unwrap();
        assert_eq!(tls.ca_pem, b"ca");
        assert!(tls.identity_pem.is_none());
    }
}
