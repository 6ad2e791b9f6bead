//! The fingerprint of a protected request: what makes a retry "the same request".

use http::HeaderName;
use http::request::Parts;
use idempotent_core::Fingerprint;

/// The fingerprint of an HTTP request: method, path, query pairs in sorted order, the
/// configured headers and the body. Each part is a delimited field.
pub(crate) fn fingerprint(parts: &Parts, body: &[u8], headers: &[HeaderName]) -> Fingerprint {
    let mut f = Fingerprint::builder();
    f.push_field(parts.method.as_str().as_bytes());
    f.push_field(parts.uri.path().as_bytes());
    let mut pairs: Vec<&str> = parts
        .uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|pair| !pair.is_empty())
        .collect();
    pairs.sort_unstable();
    f.push_field(&(pairs.len() as u64).to_le_bytes());
    for pair in pairs {
        f.push_field(pair.as_bytes());
    }
    for name in headers {
        f.push_field(name.as_str().as_bytes());
        let values: Vec<_> = parts.headers.get_all(name).iter().collect();
        f.push_field(&(values.len() as u64).to_le_bytes());
        for value in values {
            f.push_field(value.as_bytes());
        }
    }
    f.push_field(body);
    f.finish()
}
