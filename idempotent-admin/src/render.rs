//! What the tool prints: a record as JSON, and JSON or a table.

use std::time::Duration;

use idempotent_any::AnyStore;
use idempotent_core::StorageKey;
use idempotent_core::Store as _;
use idempotent_core::inspect::{KeyLabel, RecordInfo};
use idempotent_core::store::Integrity;
use idempotent_tower::{KeptRequest, RecordedResponse};
use serde_json::{Value, json};

use crate::args::Format;

/// Seconds, to the millisecond.
pub(crate) fn seconds(duration: Duration) -> f64 {
    (duration.as_millis() as f64) / 1000.0
}

/// A key with no live record.
pub(crate) fn absent(key: &str, storage_key: &StorageKey) -> Value {
    json!({
        "state": "absent",
        "abandoned": false,
        "key": key,
        "storage_key": storage_key.to_hex(),
    })
}

/// A record: `key` is the key asked for (`None` for a listing, which shows what the record
/// kept of its key).
pub(crate) fn record(
    info: &RecordInfo,
    key: Option<&str>,
    show_result: bool,
    store: &AnyStore,
) -> Value {
    let label = info.label.as_ref();
    let kept_key = label.and_then(KeyLabel::key);
    let mut out = json!({
        "state": info.state.as_str(),
        "abandoned": info.abandoned(),
        "key": key.or(kept_key),
        "key_truncated": key.is_none() && label.is_some_and(KeyLabel::truncated),
        "scope_parts": label.map(KeyLabel::scope_parts),
        "storage_key": info.key.to_hex(),
        "token": info.token.get(),
        "expires_in_s": seconds(info.expires_in),
        "lease_left_s": seconds(info.lease_left),
        "age_s": seconds(info.age),
        "attempts": info.attempts,
        "steps": match info.step_names() {
            Ok(names) => json!(names),
            Err(error) => json!({ "unreadable": error.to_string() }),
        },
        "kept_request": Value::Null,
    });
    if let Some(request) = &info.request {
        out["kept_request"] = match KeptRequest::decode(request) {
            Ok(kept) => json!({
                "method": kept.method().as_str(),
                "uri": kept.uri().to_string(),
                "version": kept.version().map(|v| v.as_str()),
            }),
            Err(error) => json!({ "unreadable": error.to_string() }),
        };
    }
    if let Some(payload) = &info.payload {
        let integrity = if store.keeps_records_in_process() {
            Integrity::InProcess
        } else {
            Integrity::Checksummed
        };
        out["size"] = json!(payload.len());
        match RecordedResponse::decode_with(payload, integrity) {
            Ok(Some(response)) => {
                out["status"] = json!(response.status().as_u16());
                out["body_size"] = json!(response.body().len());
                if show_result {
                    out["result"] = match std::str::from_utf8(response.body()) {
                        Ok(text) => json!(text),
                        Err(_) => json!({ "bytes": response.body().len(), "utf8": false }),
                    };
                }
            }
            Ok(None) => {
                out["status"] = Value::Null;
                out["result_retained"] = json!(false);
            }
            // Not a response the tower layer recorded (a plain `Idempotency::run` result, a
            // consumer's): its size is all that is shown, and its bytes with --show-result.
            Err(_) => {
                out["status"] = Value::Null;
                if show_result {
                    out["result"] = match std::str::from_utf8(payload) {
                        Ok(text) => json!(text),
                        Err(_) => json!({ "bytes": payload.len(), "utf8": false }),
                    };
                }
            }
        }
    }
    out
}

/// The answers, as JSON lines or a table.
pub(crate) fn print(format: Format, answers: &[Value]) {
    match format {
        Format::Json => {
            for answer in answers {
                println!("{answer}");
            }
        }
        Format::Table => print!("{}", table(answers)),
    }
}

/// The columns a table begins with, when its answers have them; the others follow by name.
const FIRST_COLUMNS: [&str; 8] = [
    "state",
    "abandoned",
    "key",
    "session",
    "repair",
    "done",
    "age_s",
    "lease_left_s",
];

/// Columns: every field of the answers ([`FIRST_COLUMNS`] first); nested values as JSON.
fn table(answers: &[Value]) -> String {
    let mut columns: Vec<String> = Vec::new();
    for answer in answers {
        if let Value::Object(fields) = answer {
            for name in fields.keys() {
                if !columns.contains(name) {
                    columns.push(name.clone());
                }
            }
        }
    }
    columns.sort_by_key(|name| {
        (
            FIRST_COLUMNS
                .iter()
                .position(|first| first == name)
                .unwrap_or(FIRST_COLUMNS.len()),
            name.clone(),
        )
    });
    let cell = |answer: &Value, column: &str| match answer.get(column) {
        None | Some(Value::Null) => "-".to_owned(),
        Some(Value::String(text)) => text.clone(),
        Some(other) => other.to_string(),
    };
    let rows: Vec<Vec<String>> = answers
        .iter()
        .map(|answer| columns.iter().map(|c| cell(answer, c)).collect())
        .collect();
    let widths: Vec<usize> = columns
        .iter()
        .enumerate()
        .map(|(i, c)| {
            rows.iter()
                .map(|row| row[i].chars().count())
                .chain([c.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[String]| {
        let mut out = String::new();
        for (i, text) in cells.iter().enumerate() {
            if i > 0 {
                out.push_str("  ");
            }
            out.push_str(text);
            if i + 1 < cells.len() {
                out.push_str(&" ".repeat(widths[i].saturating_sub(text.chars().count())));
            }
        }
        out.push('\n');
        out
    };
    let mut out = line(&columns);
    for row in &rows {
        out.push_str(&line(row));
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn a_table_has_a_column_per_field_and_a_row_per_answer() {
        let text = super::table(&[
            json!({"state": "completed", "key": "order-1", "attempts": 1}),
            json!({"state": "in_flight", "key": "order-22", "steps": ["charge"]}),
        ]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("state  "), "{}", lines[0]);
        assert!(lines[0].find("key") < lines[0].find("attempts"));
        assert!(lines[0].contains("attempts") && lines[0].contains("steps"));
        assert!(lines[2].contains("[\"charge\"]"));
        assert!(lines[1].contains("completed") && lines[1].contains("order-1"));
    }
}
