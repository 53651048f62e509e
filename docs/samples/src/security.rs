//! TLS, client certificates and the header key (security).

use lily::prelude::*;

/// A consumer configuration for a broker that requires client certificates, sealing Lily's
/// headers with a secret key.
pub fn config(
    ca_pem: String,
    chain_pem: String,
    key_pem: String,
    header_key: &[u8],
) -> ConsumerConfig {
    // ANCHOR: tls
    // With an amqps:// URL: a private CA, a client certificate, and a secret (at least 16
    // bytes, from your secret store) shared by every worker and the `lily` command.
    ConsumerConfig::new("orders")
        .tls_ca_pem(ca_pem)
        .tls_client_cert(ClientCertificate::from_pem(chain_pem, key_pem))
        .header_key(header_key)
    // ANCHOR_END: tls
}
