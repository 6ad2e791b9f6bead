//! The completed records a completer writes, as a tool beside it (an operator's) writes and
//! reads them: [`operation_failed_record`], [`RecordedResponse`].

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use idempotent_core::ProblemCode;
use idempotent_core::store::envelope::{self, Integrity, Stored};

use crate::server::problem::Problem;
use crate::server::stored;

/// The most bytes of the reason [`operation_failed_record`] keeps; a longer one is cut at a
/// character boundary.
const MAX_REASON: usize = 1024;

/// The stored response of `500 operation_failed` (`detail` and the end of the story), as the
/// layer's records hold responses: without the runtime's envelope.
pub(crate) fn operation_failed(detail: &str) -> Bytes {
    let problem = Problem::new(
        ProblemCode::OperationFailed,
        format!("{detail}; nothing more will run under this key"),
    );
    let (status, headers, body) = problem.http_parts();
    // Two headers and a body far below 4 GiB: the stored form always holds them.
    stored::encode(status, &headers, &body, None, |_| false)
        .expect("a problem's response is always storable")
}

/// The bytes to complete an operation with ([`Store::complete`] with the record's token) so
/// that its client's retry, through an [`IdempotencyLayer`](crate::IdempotencyLayer) over
/// that store, gets `500 operation_failed` (`application/problem+json`, code
/// `operation_failed`, with `why` in its detail), replayed like any recorded answer: what a
/// completer records when it gives an operation up, for an operator's tool that gives one up
/// by hand (a payment that must not be tried again, say).
///
/// They are the whole payload, in the runtime's envelope with its checksum: a caller
/// holding a raw claim token passes them to [`Store::complete`] as they are, on any store
/// (a store that keeps its records in the process reads them just as well). `why` ends up
/// in the detail after the first 1024 bytes: say why in a sentence, without secrets (the
/// client reads it).
///
/// ```
/// use idempotent_tower::{RecordedResponse, operation_failed_record};
///
/// let payload = operation_failed_record("an operator gave it up (ticket 1234)");
/// let recorded = RecordedResponse::decode(&payload).unwrap().expect("a response");
/// assert_eq!(recorded.status().as_u16(), 500);
/// assert!(String::from_utf8_lossy(recorded.body()).contains("ticket 1234"));
/// ```
///
/// [`Store::complete`]: idempotent_core::Store::complete
pub fn operation_failed_record(why: &str) -> Bytes {
    let mut end = why.len().min(MAX_REASON);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    let response = operation_failed(&why[..end]);
    // Checksummed: a store outside the process checks it, one inside ignores it.
    envelope::encode_value(&response, Integrity::Checksummed)
}

/// A completed record's answer, as the layer replays it: status, headers, body and trailers.
/// Read from the payload a store holds for a completed record (the runtime's envelope around
/// the layer's stored response) with [`decode`](Self::decode): for a tool that shows an
/// operator what an operation answered.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedResponse {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

/// Why a payload is not a recorded response: not an envelope, a damaged one, or an envelope
/// whose result is not a response the layer recorded (a record of another kind of call).
#[derive(Debug, thiserror::Error)]
#[error("the recorded payload cannot be read: {0}")]
pub struct RecordedResponseError(#[source] Box<dyn std::error::Error + Send + Sync>);

impl RecordedResponse {
    /// The answer `payload` records, from a store that keeps its records outside the process
    /// (every store but the in-memory one): the envelope's checksum is checked. `Ok(None)`:
    /// the operation completed, but its answer was too large to keep (a replay answers `410
    /// result_not_retained`). Never panics, whatever the bytes.
    pub fn decode(payload: &[u8]) -> Result<Option<Self>, RecordedResponseError> {
        Self::decode_with(payload, Integrity::Checksummed)
    }

    /// [`decode`](Self::decode), with the store's integrity: [`Integrity::InProcess`] for a
    /// store whose records never leave the process
    /// ([`Store::keeps_records_in_process`](idempotent_core::Store::keeps_records_in_process)),
    /// whose envelopes carry no checksum.
    pub fn decode_with(
        payload: &[u8],
        integrity: Integrity,
    ) -> Result<Option<Self>, RecordedResponseError> {
        let payload = Bytes::copy_from_slice(payload);
        match envelope::decode(&payload, integrity) {
            Ok(Stored::Value(response)) => match stored::decode(response) {
                Ok(response) => Ok(Some(RecordedResponse {
                    status: response.status,
                    headers: response.headers,
                    body: response.body,
                    trailers: response.trailers,
                })),
                Err(error) => Err(RecordedResponseError(Box::new(error))),
            },
            Ok(Stored::NotRetained) => Ok(None),
            Err(error) => Err(RecordedResponseError(Box::new(error))),
        }
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The headers, as replayed (those the layer leaves out of records are not there).
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The trailers, if the response had a trailers frame (gRPC's status is there).
    pub fn trailers(&self) -> Option<&HeaderMap> {
        self.trailers.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_reason_is_cut_at_a_character_boundary() {
        let why = "é".repeat(MAX_REASON);
        let recorded = RecordedResponse::decode(&operation_failed_record(&why))
            .unwrap()
            .unwrap();
        let problem: serde_json::Value = serde_json::from_slice(recorded.body()).unwrap();
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.starts_with(&"é".repeat(MAX_REASON / 2)), "{detail}");
        assert!(
            !detail.contains(&"é".repeat(MAX_REASON / 2 + 1)),
            "{detail}"
        );
        assert_eq!(problem["code"], "operation_failed");
    }

    #[test]
    fn not_retained_and_garbage() {
        let not_retained = envelope::encode_not_retained();
        assert!(RecordedResponse::decode(&not_retained).unwrap().is_none());
        for garbage in [&b""[..], b"ID", b"not an envelope at all"] {
            assert!(RecordedResponse::decode(garbage).is_err());
        }
        // An envelope around something that is not a stored response.
        let other = envelope::encode_value(b"{\"id\":1}", Integrity::Checksummed);
        let error = RecordedResponse::decode(&other).unwrap_err();
        assert!(error.to_string().contains("cannot be read"), "{error}");
        // A damaged byte of the body (the last one, before the trailers' count): the checksum
        // says so; without one, the damage is not seen.
        let mut damaged = operation_failed_record("why").to_vec();
        let last = damaged.len() - 3;
        damaged[last] ^= 1;
        assert!(RecordedResponse::decode(&damaged).is_err());
        assert!(RecordedResponse::decode_with(&damaged, Integrity::InProcess).is_ok());
    }

    proptest::proptest! {
        #[test]
        fn decoding_any_bytes_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..96)) {
            let _ = RecordedResponse::decode(&bytes);
            let mut enveloped = b"ID\x01\x00".to_vec();
            enveloped.extend_from_slice(&[0; 8]);
            enveloped.extend_from_slice(&bytes);
            let _ = RecordedResponse::decode_with(&enveloped, Integrity::InProcess);
        }
    }
}
