//! TLS with the broker: the client certificate, and reading the broker's verdict on it.

use std::time::Duration;

use lapin::tcp::{AsyncTcpStream, OwnedIdentity};

/// A client certificate for mutual TLS (`amqps://` to a broker with `fail_if_no_peer_cert`):
/// the PEM certificate chain, leaf first, and its PEM private key (PKCS#8, PKCS#1 or SEC1).
///
/// `Debug` shows neither: only the size of the chain, never the key.
#[derive(Clone)]
pub struct ClientCertificate {
    chain_pem: String,
    key_pem: String,
}

impl ClientCertificate {
    /// The certificate chain and key, both PEM, as read from `tls.crt` and `tls.key`.
    pub fn from_pem(chain_pem: impl Into<String>, key_pem: impl Into<String>) -> Self {
        Self {
            chain_pem: chain_pem.into(),
            key_pem: key_pem.into(),
        }
    }

    /// Why the chain or the key cannot be used, without quoting either.
    pub(crate) fn problem(&self) -> Option<&'static str> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let mut certificates = CertificateDer::pem_slice_iter(self.chain_pem.as_bytes());
        match certificates.next() {
            Some(Ok(_)) if certificates.all(|c| c.is_ok()) => {}
            _ => return Some("has a certificate chain that is not PEM certificates"),
        }
        match PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()) {
            Ok(_) => None,
            Err(_) => Some("has a key that is not a PEM private key"),
        }
    }

    pub(super) fn identity(&self) -> OwnedIdentity {
        OwnedIdentity::PKCS8 {
            pem: self.chain_pem.clone().into_bytes(),
            key: self.key_pem.clone().into_bytes(),
        }
    }
}

impl std::fmt::Debug for ClientCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientCertificate")
            .field("chain_pem_bytes", &self.chain_pem.len())
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// How `amqps://` connections check the broker and present themselves.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tls {
    /// PEM certificates to trust besides the system roots.
    pub(crate) ca_pem: Option<String>,
    /// The client certificate, for mutual TLS.
    pub(crate) client: Option<ClientCertificate>,
}

/// How many times a node is dialed again at once when a connection that presented a client
/// certificate was reset or closed: the broker refusing the certificate may have reset the
/// connection before its alert was read, and the next attempt usually reads it.
pub(super) const CERTIFICATE_REDIALS: usize = 2;

/// Whether `err` is the connection reset, aborted or closed under the client.
pub(super) fn reset(err: &lapin::Error) -> bool {
    use std::io::ErrorKind;
    let lapin::ErrorKind::IOError(io) = err.kind() else {
        return false;
    };
    matches!(
        io.kind(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::UnexpectedEof
    )
}

/// How long a connection that presents a client certificate listens for the broker's verdict
/// on it before speaking AMQP (see [`await_verdict`]): four times as long as the handshake took,
/// since a busy broker takes longer to judge the certificate, and within 250 ms to 2 s.
pub(super) fn verdict_wait(handshake: Duration) -> Duration {
    (handshake * 4).clamp(Duration::from_millis(250), Duration::from_secs(2))
}

/// Waits up to `wait` for the broker to refuse the client certificate. Over TLS 1.3 the
/// broker judges it after the handshake is complete on this side, and answers a refused one
/// with an alert. Writing the AMQP header at once would race that alert: the broker, closed
/// by then, resets the connection, which can discard the alert unread, and a refused
/// certificate would look like a dropped connection. A broker that accepts says nothing before
/// the header, so the wait ends by its timeout, having read nothing.
pub(super) async fn await_verdict<S>(
    stream: &mut AsyncTcpStream<S>,
    wait: Duration,
) -> std::io::Result<()>
where
    S: futures_io::AsyncRead + futures_io::AsyncWrite + Send + Unpin + 'static,
{
    use futures_io::AsyncRead;
    let mut byte = [0u8; 1];
    let read = std::future::poll_fn(|cx| std::pin::Pin::new(&mut *stream).poll_read(cx, &mut byte));
    match tokio::time::timeout(wait, read).await {
        Err(_) => Ok(()),
        Ok(Err(err)) => Err(err),
        Ok(Ok(0)) => Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "the broker closed the connection after the TLS handshake",
        )),
        Ok(Ok(_)) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the broker spoke before the AMQP protocol header",
        )),
    }
}

/// What a TLS handshake's error says, when it is final: the broker refused the client
/// certificate (its alert), or the broker's certificate is not trusted. Retrying with the same
/// certificates cannot help. `None` for anything else (a reset, a timeout). The alert or the
/// certificate problem itself is in `err`, the error's source.
pub(crate) fn tls_refusal(err: &lapin::Error) -> Option<&'static str> {
    use rustls::AlertDescription as Alert;
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(current) = source {
        let tls = current.downcast_ref::<rustls::Error>().or_else(|| {
            current
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        match tls {
            Some(rustls::Error::AlertReceived(alert)) => {
                return Some(match alert {
                    Alert::CertificateRequired => {
                        "the broker refused the client certificate: none was presented and the broker requires one"
                    }
                    Alert::CertificateExpired => {
                        "the broker refused the client certificate: it has expired or is not valid yet"
                    }
                    Alert::UnknownCA => {
                        "the broker refused the client certificate: it is not signed by a CA the broker trusts"
                    }
                    Alert::CertificateRevoked => {
                        "the broker refused the client certificate: it was revoked"
                    }
                    Alert::BadCertificate
                    | Alert::UnsupportedCertificate
                    | Alert::CertificateUnknown
                    | Alert::AccessDenied => "the broker refused the client certificate",
                    _ => "the broker ended the TLS handshake with an alert",
                });
            }
            Some(rustls::Error::InvalidCertificate(_)) => {
                return Some("the broker's certificate is not trusted");
            }
            _ => source = current.source(),
        }
    }
    None
}
