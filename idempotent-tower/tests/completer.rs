//! The completer: operations their clients abandoned, finished in the background from the
//! kept request and the operation's checkpoints.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::{Router, routing};
use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use idempotent_core::memory::MemoryStore;
use idempotent_core::{CallOptions, ClaimHandle, Idempotency};
use idempotent_tower::{
    CodeVersion, Completer, CompleterPass, Completing, IdempotencyLayer, KeptRequest,
    RecordedResponse, operation_failed_record,
};
use support::{post, send};

/// How long an operation waits for its client before a completer takes it.
const AFTER: Duration = Duration::from_millis(100);

#[derive(Default)]
struct Shop {
    runs: AtomicUsize,
    reserved: AtomicUsize,
    charged: AtomicUsize,
    /// While set, every run answers 500 after its first step.
    failing: AtomicBool,
    /// While set, every run panics after its first step.
    panicking: AtomicBool,
}

async fn order(
    State(shop): State<Arc<Shop>>,
    Extension(claim): Extension<ClaimHandle>,
    completing: Option<Extension<Completing>>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    shop.runs.fetch_add(1, Ordering::SeqCst);
    let reservation = claim
        .step("reserve", async {
            shop.reserved.fetch_add(1, Ordering::SeqCst);
            format!("res-{}", &claim.step_key("reserve").unwrap().as_str()[..8])
        })
        .await;
    let Ok(reservation) = reservation else {
        return (StatusCode::SERVICE_UNAVAILABLE, "claim lost").into_response();
    };
    assert!(!shop.panicking.load(Ordering::SeqCst), "the handler panics");
    if shop.failing.load(Ordering::SeqCst) {
        return (StatusCode::BAD_GATEWAY, "provider down").into_response();
    }
    let charge: usize = match claim
        .step("charge", async {
            shop.charged.fetch_add(1, Ordering::SeqCst)
        })
        .await
    {
        Ok(charge) => charge,
        Err(_) => return (StatusCode::SERVICE_UNAVAILABLE, "claim lost").into_response(),
    };
    let answer = serde_json::json!({
        "reservation": reservation,
        "charge": charge,
        "attempt": completing.map(|c| c.attempt()),
        "authorization": headers.contains_key("authorization"),
        "body": String::from_utf8_lossy(&body),
    });
    (StatusCode::CREATED, answer.to_string()).into_response()
}

struct Setup {
    shop: Arc<Shop>,
    layer: IdempotencyLayer,
    routes: Router,
    app: Router,
}

fn setup(layer: IdempotencyLayer) -> Setup {
    let shop = Arc::new(Shop::default());
    let routes = Router::new()
        .route("/orders", routing::post(order))
        .with_state(Arc::clone(&shop));
    let app = routes.clone().layer(layer.clone());
    Setup {
        shop,
        layer,
        routes,
        app,
    }
}

fn keeping(idempotency: Idempotency) -> IdempotencyLayer {
    keeping_as(idempotency, "1.0.0")
}

/// A layer keeping its requests as code version `version`.
fn keeping_as(idempotency: Idempotency, version: &str) -> IdempotencyLayer {
    IdempotencyLayer::http(idempotency).keep_requests(code(version))
}

fn code(version: &str) -> CodeVersion {
    CodeVersion::new(version).unwrap()
}

fn order_request(key: &str) -> http::Request<Full<Bytes>> {
    let mut request = post("/orders", Some(key), "{\"sku\":\"tea\"}");
    request
        .headers_mut()
        .insert("authorization", "Bearer secret".parse().unwrap());
    request
}

impl Setup {
    fn completer(&self) -> Completer<Router> {
        Completer::new(&self.layer, self.routes.clone()).after(AFTER)
    }

    fn count(&self) -> (usize, usize, usize) {
        (
            self.shop.runs.load(Ordering::SeqCst),
            self.shop.reserved.load(Ordering::SeqCst),
            self.shop.charged.load(Ordering::SeqCst),
        )
    }
}

#[tokio::test]
async fn an_abandoned_operation_is_finished_from_its_checkpoints() {
    let s = setup(keeping(Idempotency::new(MemoryStore::new())));
    s.shop.failing.store(true, Ordering::SeqCst);
    let first = send(&s.app, order_request("o-1")).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "released, not kept");
    s.shop.failing.store(false, Ordering::SeqCst);
    let completer = s.completer();
    // Not abandoned long enough: its client may still retry.
    assert_eq!(completer.pass().await.unwrap(), CompleterPass::default());
    tokio::time::sleep(2 * AFTER).await;
    let pass = completer.pass().await.unwrap();
    assert_eq!((pass.found, pass.completed), (1, 1), "{pass:?}");
    assert_eq!(s.count(), (2, 1, 1), "runs, reservations, charges");
    // Finished: nothing more to do, and the client's retry replays the completer's answer.
    assert_eq!(completer.pass().await.unwrap().found, 0);
    let retry = send(&s.app, order_request("o-1")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    let answer: serde_json::Value = serde_json::from_slice(&retry.body).unwrap();
    assert_eq!(answer["attempt"], 1, "{answer}");
    assert_eq!(answer["authorization"], false, "credentials are never kept");
    assert_eq!(answer["body"], "{\"sku\":\"tea\"}");
    assert_eq!(s.count(), (2, 1, 1));
}

#[tokio::test]
async fn a_client_retry_first_leaves_the_completer_nothing() {
    let s = setup(keeping(Idempotency::new(MemoryStore::new())));
    s.shop.failing.store(true, Ordering::SeqCst);
    send(&s.app, order_request("o-2")).await;
    s.shop.failing.store(false, Ordering::SeqCst);
    let retry = send(&s.app, order_request("o-2")).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, false)
    );
    let answer: serde_json::Value = serde_json::from_slice(&retry.body).unwrap();
    assert_eq!(answer["attempt"], serde_json::Value::Null);
    assert_eq!(answer["authorization"], true);
    tokio::time::sleep(2 * AFTER).await;
    assert_eq!(s.completer().pass().await.unwrap().found, 0);
    assert_eq!(
        s.count(),
        (2, 1, 1),
        "the retry resumed from the reservation"
    );
}

#[tokio::test]
async fn without_kept_requests_there_is_nothing_to_finish() {
    let s = setup(IdempotencyLayer::http(Idempotency::new(MemoryStore::new())));
    s.shop.failing.store(true, Ordering::SeqCst);
    send(&s.app, order_request("o-3")).await;
    tokio::time::sleep(2 * AFTER).await;
    assert_eq!(
        s.completer().pass().await.unwrap(),
        CompleterPass::default()
    );
    assert_eq!(s.count(), (1, 1, 0));
}

#[tokio::test]
async fn the_last_attempt_is_recorded_as_the_operation_failed() {
    let s = setup(keeping(Idempotency::new(MemoryStore::new())));
    s.shop.failing.store(true, Ordering::SeqCst);
    send(&s.app, order_request("o-4")).await;
    let completer = s.completer().max_attempts(2);
    tokio::time::sleep(2 * AFTER).await;
    let pass = completer.pass().await.unwrap();
    assert_eq!((pass.found, pass.failed), (1, 1), "{pass:?}");
    tokio::time::sleep(2 * AFTER).await;
    let pass = completer.pass().await.unwrap();
    assert_eq!((pass.found, pass.given_up), (1, 1), "{pass:?}");
    tokio::time::sleep(2 * AFTER).await;
    assert_eq!(completer.pass().await.unwrap().found, 0, "recorded: done");
    // The client's retry gets the last answer, replayed; nothing runs again.
    let retry = send(&s.app, order_request("o-4")).await;
    assert_eq!(retry.status, StatusCode::BAD_GATEWAY);
    assert!(retry.replayed());
    assert_eq!(retry.text(), "provider down");
    assert_eq!(s.count(), (3, 1, 0), "the client's run and two attempts");
}

#[tokio::test]
async fn unreadable_requests_and_other_runtimes_requests_are_left_alone() {
    let store = MemoryStore::new();
    let ours = Idempotency::new(store.clone());
    let theirs = Idempotency::builder(store)
        .namespace("another service")
        .build();
    let s = setup(keeping(ours.clone()));
    // A record whose kept request is garbage, as a damaged store could hold.
    let garbage = idempotent_core::Call::new("garbage".parse().unwrap());
    ours.run_with(
        &garbage,
        async {
            let claim = ClaimHandle::current().unwrap();
            claim
                .save_request(Bytes::from_static(b"not a request"))
                .await
                .unwrap();
        },
        |()| idempotent_core::Retain::Release,
    )
    .await
    .unwrap();
    // Another service's abandoned order on the same store.
    let other = setup(keeping(theirs));
    other.shop.failing.store(true, Ordering::SeqCst);
    send(&other.app, order_request("theirs")).await;
    other.shop.failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(2 * AFTER).await;
    // The store lists only this runtime's kept requests: neither the other service's nor
    // the garbage (which names no runtime).
    let pass = s.completer().pass().await.unwrap();
    assert_eq!((pass.found, pass.skipped), (0, 0), "{pass:?}");
    assert_eq!(s.count(), (0, 0, 0), "nothing ran here");
    // Neither was recorded: the garbage is still abandoned, and the other service's
    // completer finishes its own order.
    let pass = other.completer().pass().await.unwrap();
    assert_eq!(
        (pass.found, pass.completed, pass.skipped),
        (1, 1, 0),
        "{pass:?}"
    );
    assert_eq!(other.count(), (2, 1, 1));
    let garbage = ours.abandoned(Duration::ZERO, 10, None).await.unwrap();
    assert_eq!(garbage.len(), 1, "the garbage is still there");
}

#[tokio::test]
async fn an_operation_whose_last_run_gave_nothing_is_recorded_as_operation_failed() {
    let s = setup(keeping(Idempotency::new(MemoryStore::new())));
    s.shop.failing.store(true, Ordering::SeqCst);
    send(&s.app, order_request("o-7")).await;
    s.shop.panicking.store(true, Ordering::SeqCst);
    let completer = s.completer().max_attempts(1);
    tokio::time::sleep(2 * AFTER).await;
    // The one attempt panics: counted, nothing to keep.
    let pass = completer.pass().await.unwrap();
    assert_eq!((pass.found, pass.failed), (1, 1), "{pass:?}");
    tokio::time::sleep(2 * AFTER).await;
    let pass = completer.pass().await.unwrap();
    assert_eq!((pass.found, pass.given_up), (1, 1), "{pass:?}");
    let retry = send(&s.app, order_request("o-7")).await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(retry.replayed());
    let problem: serde_json::Value = serde_json::from_slice(&retry.body).unwrap();
    assert_eq!(problem["code"], "operation_failed", "{problem}");
    assert_eq!(s.count(), (2, 1, 0), "the client's run and the one attempt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_completers_finish_each_of_a_hundred_operations_once() {
    let s = setup(keeping(Idempotency::new(MemoryStore::new())));
    s.shop.failing.store(true, Ordering::SeqCst);
    let keys: Vec<String> = (0..100).map(|i| format!("bulk-{i}")).collect();
    for key in &keys {
        let answer = send(&s.app, order_request(key)).await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
    }
    s.shop.failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(2 * AFTER).await;
    let one = s.completer().concurrency(8).batch(200);
    let two = s.completer().concurrency(8).batch(200);
    let mut completed = 0;
    for _ in 0..20 {
        let (a, b) = tokio::join!(one.pass(), two.pass());
        completed += a.unwrap().completed + b.unwrap().completed;
        if completed == 100 {
            break;
        }
    }
    assert_eq!(completed, 100);
    let (runs, reserved, charged) = s.count();
    assert_eq!((reserved, charged), (100, 100), "each step once per order");
    assert_eq!(runs, 200, "one client run and one completer run per order");
    for key in &keys {
        let retry = send(&s.app, order_request(key)).await;
        assert_eq!(
            (retry.status, retry.replayed()),
            (StatusCode::CREATED, true)
        );
    }
}

#[tokio::test]
async fn a_spawned_completer_finishes_in_the_background_until_stopped() {
    let idempotency = Idempotency::builder(MemoryStore::new())
        .defaults(idempotent_core::Defaults::new())
        .build();
    let layer = IdempotencyLayer::http(idempotency)
        .keep_requests("1.0.0".parse().unwrap())
        .call_options(CallOptions::new().lease(Duration::from_secs(5)));
    let s = setup(layer);
    let handle = s.completer().spawn();
    s.shop.failing.store(true, Ordering::SeqCst);
    send(&s.app, order_request("o-5")).await;
    s.shop.failing.store(false, Ordering::SeqCst);
    let mut finished = false;
    for _ in 0..200 {
        tokio::time::sleep(AFTER / 4).await;
        if s.count().2 == 1 {
            finished = true;
            break;
        }
    }
    assert!(finished, "the spawned completer finished the order");
    handle.stop().await;
    // Stopped: another abandoned operation stays abandoned.
    s.shop.failing.store(true, Ordering::SeqCst);
    send(&s.app, order_request("o-6")).await;
    s.shop.failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(4 * AFTER).await;
    assert_eq!(s.count(), (3, 2, 1));
    let retry = send(&s.app, order_request("o-5")).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, true)
    );
}

/// One slot, eight abandoned operations: one pass runs each of them in turn, dropping none.
#[tokio::test]
async fn a_pass_with_one_slot_runs_every_operation_it_lists() {
    let s = setup(keeping(Idempotency::new(MemoryStore::new())));
    s.shop.failing.store(true, Ordering::SeqCst);
    for i in 0..8 {
        send(&s.app, order_request(&format!("one-slot-{i}"))).await;
    }
    s.shop.failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(2 * AFTER).await;
    let pass = s.completer().concurrency(1).pass().await.unwrap();
    assert_eq!((pass.found, pass.completed), (8, 8), "{pass:?}");
    assert_eq!(s.count(), (16, 8, 8));
}

/// The completer's metrics: its runs, the operations it finished and those it gave up.
#[tokio::test]
async fn the_completer_counts_its_attempts_completions_and_give_ups() {
    let s = setup(keeping(Idempotency::new(MemoryStore::new())));
    let (completer, recorded) =
        idempotent_core::metrics::Recorded::capture(|| s.completer().max_attempts(2));
    s.shop.failing.store(true, Ordering::SeqCst);
    send(&s.app, order_request("m-given-up")).await;
    send(&s.app, order_request("m-done")).await;
    tokio::time::sleep(2 * AFTER).await;
    // Both runs fail: two attempts.
    completer.pass().await.unwrap();
    // `m-done` now succeeds; `m-given-up` fails its last attempt, which is recorded.
    s.shop.failing.store(false, Ordering::SeqCst);
    send(&s.app, order_request("m-done")).await;
    s.shop.failing.store(true, Ordering::SeqCst);
    tokio::time::sleep(2 * AFTER).await;
    let pass = completer.pass().await.unwrap();
    assert_eq!((pass.found, pass.given_up), (1, 1), "{pass:?}");
    let counter = |name: &str| recorded.counter(name, &[]);
    assert_eq!(counter("idempotency.completer.attempts"), 3);
    assert_eq!(counter("idempotency.completer.given_up"), 1);
    assert_eq!(counter("idempotency.completer.completed"), 0);
    // A third operation the completer finishes.
    send(&s.app, order_request("m-finished")).await;
    s.shop.failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(2 * AFTER).await;
    let pass = completer.pass().await.unwrap();
    assert_eq!((pass.found, pass.completed), (1, 1), "{pass:?}");
    assert_eq!(counter("idempotency.completer.completed"), 1);
    assert_eq!(counter("idempotency.completer.attempts"), 4);
}

/// A completer runs only the versions it is told it can run: an operation kept by version A
/// is not even listed for a completer of version B (the store lists by version), nothing of
/// it runs, and it stays abandoned until a completer that runs A finishes it.
#[tokio::test]
async fn a_completer_of_another_version_leaves_an_operation_alone() {
    let runtime = Idempotency::new(MemoryStore::new());
    let a = setup(keeping_as(runtime.clone(), "A"));
    s_fail_once(&a, "versioned").await;
    let b = setup(keeping_as(runtime.clone(), "B"));
    tokio::time::sleep(2 * AFTER).await;
    let pass = b.completer().pass().await.unwrap();
    assert_eq!(pass, CompleterPass::default(), "B lists none of A's");
    assert_eq!(b.count(), (0, 0, 0));
    assert_eq!(a.count(), (1, 1, 0), "only the client's run");
    // Still A's, abandoned, with its version on its kept request.
    let a_owner = KeptRequest::owner_for(&runtime, Some(&code("A")));
    let kept = runtime.abandoned(AFTER, 10, Some(&a_owner)).await.unwrap();
    assert_eq!(kept.len(), 1);
    let request = KeptRequest::decode(&kept[0].request).unwrap();
    assert_eq!(request.version().map(CodeVersion::as_str), Some("A"));
    assert_eq!(request.owner(), a_owner);
    assert_eq!(
        (request.method(), request.uri().path()),
        (&http::Method::POST, "/orders")
    );
    assert!(request.headers().get("authorization").is_none());
    // B told it can run A's too: finished, from its checkpoints.
    let pass = b
        .completer()
        .versions([code("B"), code("A")])
        .pass()
        .await
        .unwrap();
    assert_eq!((pass.found, pass.completed), (1, 1), "{pass:?}");
    assert_eq!(
        b.count(),
        (1, 0, 1),
        "reserve not run again, charge run once"
    );
    let retry = send(&a.app, order_request("versioned")).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, true)
    );
}

/// Sends an order that fails (502, released): abandoned.
async fn s_fail_once(s: &Setup, key: &str) {
    s.shop.failing.store(true, Ordering::SeqCst);
    let first = send(&s.app, order_request(key)).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    s.shop.failing.store(false, Ordering::SeqCst);
}

/// Each version is listed by itself and each pass starts with the next one: a backlog of one
/// version larger than the batch does not keep another's operation waiting.
#[tokio::test]
async fn one_versions_backlog_does_not_starve_another() {
    let runtime = Idempotency::new(MemoryStore::new());
    let a = setup(keeping_as(runtime.clone(), "A"));
    let b = setup(keeping_as(runtime.clone(), "B"));
    for i in 0..3 {
        s_fail_once(&a, &format!("a-{i}")).await;
    }
    s_fail_once(&b, "b-0").await;
    tokio::time::sleep(2 * AFTER).await;
    let completer = b.completer().versions([code("A"), code("B")]).batch(1);
    for _ in 0..2 {
        let pass = completer.pass().await.unwrap();
        assert_eq!((pass.found, pass.completed), (1, 1), "{pass:?}");
    }
    assert_eq!(
        b.count().2,
        2,
        "B's operation finished in the first two passes"
    );
}

/// Requests kept before versions (format `IRQ1`) are run only by a completer told to
/// run them.
#[tokio::test]
async fn requests_kept_before_versions_run_only_when_told() {
    let runtime = Idempotency::new(MemoryStore::new());
    let s = setup(keeping(runtime.clone()));
    // A record as a layer of the release before versions left it: a released claim holding
    // a kept request without a version.
    let owner = KeptRequest::owner_for(&runtime, None);
    let mut kept = owner.as_bytes().to_vec();
    for field in [&b"POST"[..], b"/orders"] {
        kept.extend_from_slice(&u32::try_from(field.len()).unwrap().to_be_bytes());
        kept.extend_from_slice(field);
    }
    kept.extend_from_slice(&0_u32.to_be_bytes());
    kept.extend_from_slice(&2_u32.to_be_bytes());
    kept.extend_from_slice(b"{}");
    let legacy = idempotent_core::Call::new("legacy".parse().unwrap());
    runtime
        .run_with(
            &legacy,
            async {
                let claim = ClaimHandle::current().unwrap();
                claim.save_request(Bytes::from(kept)).await.unwrap();
            },
            |()| idempotent_core::Retain::Release,
        )
        .await
        .unwrap();
    tokio::time::sleep(2 * AFTER).await;
    assert_eq!(
        s.completer().pass().await.unwrap(),
        CompleterPass::default()
    );
    assert_eq!(s.count(), (0, 0, 0));
    let pass = s.completer().unversioned(true).pass().await.unwrap();
    assert_eq!((pass.found, pass.completed), (1, 1), "{pass:?}");
    assert_eq!(s.count(), (1, 1, 1));
}

/// An operator's tool gives an abandoned operation up by hand: it takes the operation over
/// in the store, completes it with `operation_failed_record`, and the client's retry through
/// the layer replays `500 operation_failed`; `RecordedResponse` reads the record back.
#[tokio::test]
async fn an_operation_given_up_through_the_store_replays_operation_failed() {
    use idempotent_core::{CheckpointStore, Claim, Store};

    let store = MemoryStore::new();
    let runtime = Idempotency::new(store.clone());
    let s = setup(keeping(runtime.clone()));
    s_fail_once(&s, "given-up").await;
    let owner = KeptRequest::owner_for(&runtime, Some(&code("1.0.0")));
    let abandoned = runtime
        .abandoned(Duration::ZERO, 10, Some(&owner))
        .await
        .unwrap()
        .remove(0);
    let lease = Duration::from_secs(5);
    let ttl = Duration::from_secs(60);
    let Some(Claim::TakenOver { token, .. }) = store
        .resume(&abandoned.key, &abandoned.fingerprint, lease, ttl)
        .await
        .unwrap()
    else {
        panic!("an abandoned operation is taken over");
    };
    let payload = operation_failed_record("an operator gave it up (ticket 7)");
    store
        .complete(&abandoned.key, token, payload.clone(), ttl)
        .await
        .unwrap();

    let retry = send(&s.app, order_request("given-up")).await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(retry.replayed());
    assert_eq!(retry.headers["content-type"], "application/problem+json");
    let problem: serde_json::Value = serde_json::from_slice(&retry.body).unwrap();
    assert_eq!(problem["code"], "operation_failed", "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("ticket 7"),
        "{problem}"
    );
    assert_eq!(s.count(), (1, 1, 0), "nothing ran again");

    // Read back from the store: what was written, and the response the client got.
    let Claim::Completed {
        payload: stored, ..
    } = store
        .claim(&abandoned.key, &abandoned.fingerprint, lease, ttl)
        .await
        .unwrap()
    else {
        panic!("completed");
    };
    assert_eq!(stored, payload);
    let recorded = RecordedResponse::decode(&stored).unwrap().unwrap();
    assert_eq!(recorded.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(recorded.body(), &retry.body);
    assert_eq!(
        recorded.headers()["content-type"],
        "application/problem+json"
    );
}

/// `RecordedResponse` reads what the layer itself recorded, on a store that keeps its
/// records in the process (no checksum) with its integrity.
#[tokio::test]
async fn a_recorded_response_reads_the_layers_own_record() {
    use idempotent_core::store::Integrity;
    use idempotent_core::{Claim, Store};

    let store = MemoryStore::new();
    let runtime = Idempotency::new(store.clone());
    let s = setup(keeping(runtime.clone()));
    let first = send(&s.app, order_request("read-back")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let call = idempotent_core::Call::new("read-back".parse().unwrap())
        .scope(idempotent_tower::scope_by_principal(&order_parts()).unwrap());
    let key = runtime.storage_key(&call);
    let Claim::Completed { payload, .. } = store
        .claim(
            &key,
            &idempotent_core::Fingerprint::empty(),
            Duration::from_secs(1),
            Duration::from_secs(1),
        )
        .await
        .unwrap()
    else {
        panic!("completed");
    };
    let recorded = RecordedResponse::decode_with(&payload, Integrity::InProcess)
        .unwrap()
        .unwrap();
    assert_eq!(recorded.status(), StatusCode::CREATED);
    assert_eq!(recorded.body(), &first.body);
}

fn order_parts() -> http::request::Parts {
    let (parts, _) = order_request("read-back").into_parts();
    parts
}
