//! Why [`MongoScope::connect`](crate::MongoScope::connect) failed, with what Lily can tell
//! about a refused client certificate.
//!
//! mongod refuses a missing, foreign or expired client certificate by closing the connection
//! during the TLS handshake, without an alert: the driver can only say that the connection was
//! closed. Lily reads the certificate the URL names (`tlsCertificateKeyFile`) and the CA it
//! trusts (`tlsCAFile`) and says what is wrong with it, when something is.

use std::fmt;

/// Why the scope could not start: the driver's error and, when mongod closed a TLS connection
/// during its handshake, what is wrong with the client certificate.
#[derive(Debug)]
pub struct ConnectError {
    hint: Option<String>,
    source: mongodb::error::Error,
}

impl ConnectError {
    pub(crate) fn new(url: &str, source: mongodb::error::Error) -> Self {
        let hint = closed_during_tls(&source).then(|| tls_hint(url));
        Self { hint, source }
    }

    /// What Lily found wrong with the TLS client certificate, when mongod closed the handshake.
    pub fn tls_hint(&self) -> Option<&str> {
        self.hint.as_deref()
    }

    /// The driver's error.
    pub fn driver(&self) -> &mongodb::error::Error {
        &self.source
    }
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.hint {
            Some(hint) => write!(f, "MongoDB closed the TLS connection: {hint}"),
            None => write!(f, "cannot open the MongoDB scope: {}", self.source),
        }
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// Whether no server could be selected because mongod closed the TLS handshake.
fn closed_during_tls(err: &mongodb::error::Error) -> bool {
    matches!(*err.kind, mongodb::error::ErrorKind::ServerSelection { .. })
        && err.to_string().contains("TLS close_notify")
}

/// What the URL's client certificate has wrong, or where to look.
fn tls_hint(url: &str) -> String {
    const LOG: &str = "mongod's log says why";
    let Some(file) = option(url, "tlsCertificateKeyFile") else {
        return format!("no client certificate was presented (tlsCertificateKeyFile); {LOG}");
    };
    let Ok(pem) = std::fs::read(&file) else {
        return format!("the client certificate file {file} cannot be read");
    };
    let Some(cert) = first_certificate(&pem) else {
        return format!("{file} holds no PEM certificate");
    };
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(&cert) else {
        return format!("the certificate in {file} does not parse");
    };
    let validity = cert.validity();
    if !validity.is_valid() {
        return format!(
            "the client certificate in {file} is valid from {} to {}, not now",
            validity.not_before, validity.not_after
        );
    }
    if let Some(ca_file) = option(url, "tlsCAFile") {
        let issuers: Vec<String> = std::fs::read(&ca_file)
            .ok()
            .map(|pem| certificates(&pem))
            .unwrap_or_default()
            .iter()
            .filter_map(|der| x509_parser::parse_x509_certificate(der).ok())
            .map(|(_, ca)| ca.subject().to_string())
            .collect();
        let issuer = cert.issuer().to_string();
        if !issuers.is_empty() && !issuers.contains(&issuer) {
            return format!(
                "the client certificate in {file} was issued by {issuer}, not by the CA in \
                 {ca_file}; mongod refuses a certificate no CA it trusts signed ({LOG})"
            );
        }
    }
    format!("it refused the client certificate in {file}, or requires another one; {LOG}")
}

/// The value of `key` in the URL's query, percent-decoded.
fn option(url: &str, key: &str) -> Option<String> {
    let query = url.split_once('?')?.1;
    let value = query
        .split('&')
        .find_map(|pair| {
            pair.split_once('=')
                .filter(|(k, _)| k.eq_ignore_ascii_case(key))
        })?
        .1;
    Some(percent_decode(value))
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The DER of every certificate in a PEM file, keys and other blocks skipped.
fn certificates(pem: &[u8]) -> Vec<Vec<u8>> {
    x509_parser::pem::Pem::iter_from_buffer(pem)
        .filter_map(Result::ok)
        .filter(|block| block.label == "CERTIFICATE")
        .map(|block| block.contents)
        .collect()
}

fn first_certificate(pem: &[u8]) -> Option<Vec<u8>> {
    certificates(pem).into_iter().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_options_are_found_and_decoded() {
        let url = "mongodb://u:p@h/?tls=true&tlsCAFile=%2Ftmp%2Fca.pem&TLSCERTIFICATEKEYFILE=/a b";
        assert_eq!(option(url, "tlsCAFile").as_deref(), Some("/tmp/ca.pem"));
        assert_eq!(
            option(url, "tlsCertificateKeyFile").as_deref(),
            Some("/a b")
        );
        assert_eq!(option(url, "replicaSet"), None);
        assert_eq!(option("mongodb://h", "tls"), None);
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }

    #[test]
    fn without_a_certificate_file_the_hint_says_none_was_presented() {
        let hint = tls_hint("mongodb://h/?tls=true");
        assert!(
            hint.contains("no client certificate was presented"),
            "{hint}"
        );
        let hint = tls_hint("mongodb://h/?tls=true&tlsCertificateKeyFile=/nonexistent/c.pem");
        assert!(hint.contains("cannot be read"), "{hint}");
    }
}
