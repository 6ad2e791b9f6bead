//! The outbox's HTTP sink against a local server: what it sends, and which answers deliver,
//! which are retried later and which dead-letter the message.
#![cfg(feature = "outbox")]

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::post;
use idempotent_postgres::outbox::{Relayed, Sink};
use idempotent_tower::client::{HttpSink, RetryPolicy};

/// What the server received: headers of interest and the body.
#[derive(Debug, Clone, PartialEq)]
struct Received {
    key: String,
    content_type: String,
    auth: String,
    body: String,
}

async fn server() -> (String, Arc<Mutex<Vec<Received>>>) {
    let received: Arc<Mutex<Vec<Received>>> = Arc::default();
    let handler = |State(received): State<Arc<Mutex<Vec<Received>>>>,
                   headers: http::HeaderMap,
                   body: String| async move {
        let header = |name: &str| {
            headers
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default()
        };
        received.lock().unwrap().push(Received {
            key: header("idempotency-key"),
            content_type: header("content-type"),
            auth: header("authorization"),
            body: body.clone(),
        });
        // The body names the status to answer.
        http::StatusCode::from_u16(body.parse().unwrap_or(201)).unwrap()
    };
    let app = axum::Router::new()
        .route("/notify", post(handler))
        .with_state(Arc::clone(&received));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/notify", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, received)
}

fn message(key: &str, body: &str) -> Relayed {
    let mut message = Relayed::default();
    message.id = 1;
    message.destination = "notifications".into();
    message.key = key.into();
    message.payload = body.to_owned().into();
    message.headers = vec![("content-type".into(), "text/plain".into())];
    message.attempt = 1;
    message
}

#[tokio::test]
async fn each_message_is_posted_with_its_key_and_judged_by_the_answer() {
    let (url, received) = server().await;
    let sink = HttpSink::new(&url)
        .unwrap()
        .header("authorization", "Bearer relay")
        .unwrap()
        .policy(RetryPolicy::new().max_attempts(1));
    assert!(sink.deliver(&message("order-7", "201")).await.is_ok());
    assert_eq!(
        received.lock().unwrap()[0],
        Received {
            key: "\"order-7\"".into(),
            content_type: "text/plain".into(),
            auth: "Bearer relay".into(),
            body: "201".into(),
        }
    );
    for status in ["200", "204"] {
        assert!(
            sink.deliver(&message("k", status)).await.is_ok(),
            "{status}"
        );
    }
    for status in ["408", "409", "425", "429", "500", "502", "503"] {
        let error = sink.deliver(&message("k", status)).await.unwrap_err();
        assert!(!error.is_permanent(), "{status}: {error}");
    }
    for status in ["400", "401", "404", "422", "301"] {
        let error = sink.deliver(&message("k", status)).await.unwrap_err();
        assert!(error.is_permanent(), "{status}: {error}");
        assert!(error.to_string().contains(status), "{error}");
    }
    // A key that is not a valid idempotency key cannot be sent: permanent.
    let error = sink.deliver(&message("bad\nkey", "201")).await.unwrap_err();
    assert!(error.is_permanent(), "{error}");
}

#[tokio::test]
async fn a_receiver_that_is_down_is_a_failure_to_retry() {
    // A port nobody listens on.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/notify", listener.local_addr().unwrap());
    drop(listener);
    let sink = HttpSink::new(&url)
        .unwrap()
        .policy(RetryPolicy::new().max_attempts(2));
    let error = sink.deliver(&message("k", "201")).await.unwrap_err();
    assert!(!error.is_permanent(), "{error}");
    assert!(
        HttpSink::new("https://example.com/x").is_err(),
        "TLS is not built in"
    );
    assert!(HttpSink::new("not a url").is_err());
    assert!(
        HttpSink::new(&url)
            .unwrap()
            .header("bad name", "x")
            .is_err()
    );
    assert!(
        HttpSink::new(&url)
            .unwrap()
            .header("Idempotency-Key", "same-for-all")
            .is_err(),
        "each message has its own key"
    );
}
