//! The memory mode: resident bytes per retained record of a `MemoryStore` filled through the
//! real `IdempotencyLayer`, each count measured in a process of its own.

use std::convert::Infallible;
use std::process::Command;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotent_core::Idempotency;
use idempotent_core::memory::{MemoryStore, RECORD_OVERHEAD};
use idempotent_tower::IdempotencyLayer;
use tower::{Layer, ServiceExt};

use crate::fixture::{BODY_BYTES, payment_request, stand_in};
use crate::report::MemoryRecord;

/// Records created, and kept, before the baseline is read: the runtime, the layer's code paths
/// and the allocator's first arenas are then not charged to the measured records.
const WARM_RECORDS: u64 = 1_000;

/// Measures each count in a child process (`memory-child`), so that memory freed by one
/// measurement is not reused by the next.
pub(crate) fn run(counts: &[u64]) -> Result<Vec<MemoryRecord>, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    counts
        .iter()
        .map(|records| {
            eprintln!("memory: filling a MemoryStore with {records} records");
            let output = Command::new(&exe)
                .args(["memory-child", "--records", &records.to_string()])
                .output()
                .map_err(|e| format!("cannot run {}: {e}", exe.display()))?;
            if !output.status.success() {
                return Err(format!(
                    "memory-child --records {records} failed ({}): {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr)
                ));
            }
            serde_json::from_slice(&output.stdout)
                .map_err(|e| format!("memory-child printed no record: {e}"))
        })
        .collect()
}

/// Fills a store with `records` records through the layer and reports the resident growth.
pub(crate) fn child(records: u64) -> Result<MemoryRecord, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    runtime.block_on(async {
        let handler = stand_in();
        let store = |records: u64| {
            let records = usize::try_from(records).unwrap_or(usize::MAX);
            // Bounded to what is measured: every record fits, the sweep is off.
            MemoryStore::builder()
                .max_entries(records)
                .max_bytes(records.saturating_mul(RECORD_OVERHEAD + 1024))
                .sweep_interval(None)
                .build()
        };

        let warm = store(WARM_RECORDS);
        // Requests carry no principal: one shared scope.
        let warm_service = IdempotencyLayer::http(Idempotency::new(warm.clone()))
            .allow_anonymous(true)
            .layer(handler.clone());
        fill(&warm_service, "w", WARM_RECORDS).await?;

        let before = rss_bytes()?;
        let measured = store(records);
        let service = IdempotencyLayer::http(Idempotency::new(measured.clone()))
            .allow_anonymous(true)
            .layer(handler);
        fill(&service, "m", records).await?;
        let after = rss_bytes()?;

        let stats = measured.stats();
        if stats.records as u64 != records {
            return Err(format!(
                "the store holds {} records, not {records}",
                stats.records
            ));
        }
        let charged = stats.bytes as u64 / records.max(1);
        drop((warm_service, service));
        Ok(MemoryRecord {
            implementation: "idempotent-tower".into(),
            store: "memory".into(),
            records,
            body_bytes: BODY_BYTES as u64,
            payload_bytes: charged.saturating_sub(RECORD_OVERHEAD as u64),
            rss_before: before,
            rss_after: after,
            bytes_per_record: after.saturating_sub(before) / records.max(1),
            charged_bytes_per_record: charged,
        })
    })
}

async fn fill<S>(service: &S, prefix: &str, records: u64) -> Result<(), String>
where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = Response<idempotent_tower::ResponseBody<Full<Bytes>>>,
            Error = Infallible,
        > + Clone,
{
    for i in 0..records {
        let Ok(response) = service
            .clone()
            .oneshot(payment_request(format!("{prefix}{i}")))
            .await;
        if response.status() != StatusCode::CREATED {
            return Err(format!(
                "record {i}: the layer answered {}",
                response.status()
            ));
        }
        let _ = response.into_body().collect().await;
    }
    Ok(())
}

/// This process's resident set: `/proc/self/statm`'s second field, in pages.
fn rss_bytes() -> Result<u64, String> {
    let statm = std::fs::read_to_string("/proc/self/statm")
        .map_err(|e| format!("cannot read /proc/self/statm: {e}"))?;
    let pages = parse_statm_resident(&statm).ok_or_else(|| format!("bad statm: {statm:?}"))?;
    Ok(pages * page_size())
}

fn parse_statm_resident(statm: &str) -> Option<u64> {
    statm.split_whitespace().nth(1)?.parse().ok()
}

/// The page size from the auxiliary vector (`AT_PAGESZ`), 4096 if it cannot be read.
fn page_size() -> u64 {
    std::fs::read("/proc/self/auxv")
        .ok()
        .and_then(|auxv| auxv_value(&auxv, 6))
        .unwrap_or(4096)
}

/// The value of entry `key` in an auxiliary vector of native-endian `u64` pairs.
fn auxv_value(auxv: &[u8], key: u64) -> Option<u64> {
    auxv.chunks_exact(16).find_map(|pair| {
        let word = |bytes: &[u8]| u64::from_ne_bytes(bytes.try_into().expect("8 bytes"));
        (word(&pair[..8]) == key).then(|| word(&pair[8..]))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statm_and_auxv() {
        assert_eq!(parse_statm_resident("1000 250 30 1 0 100 0\n"), Some(250));
        assert_eq!(parse_statm_resident("1000"), None);
        let mut auxv = Vec::new();
        for (k, v) in [(3u64, 64u64), (6, 16384), (0, 0)] {
            auxv.extend_from_slice(&k.to_ne_bytes());
            auxv.extend_from_slice(&v.to_ne_bytes());
        }
        assert_eq!(auxv_value(&auxv, 6), Some(16384));
        assert_eq!(auxv_value(&auxv, 7), None);
        assert!(rss_bytes().unwrap() > 0);
        assert!(page_size().is_power_of_two());
    }
}
