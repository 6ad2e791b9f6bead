//! A completer on a store shared with another runtime (another namespace) that keeps requests
//! and finishes none of its own (issue 39, item 7): however many abandoned operations the
//! other runtime leaves, more than a pass's `batch` and idle longer, every pass lists this
//! runtime's own and finishes them. On memory, Redis and PostgreSQL.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::{Router, routing};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt as _, Full};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{CheckpointStore, Idempotency, SessionStore};
use idempotent_postgres::PostgresStore;
use idempotent_redis::RedisStore;
use idempotent_test_kit::backend::redis_url;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::Database;
use idempotent_tower::{Completer, IdempotencyLayer, Principal};
use tower::ServiceExt as _;

/// How long an operation waits for its client before a completer takes it.
const AFTER: Duration = Duration::from_millis(200);
/// How many operations a pass lists.
const BATCH: usize = 3;

/// A service whose orders fail (502, so the layer releases the claim and the operation is
/// abandoned) while `failing` is set.
#[derive(Default)]
struct Shop {
    failing: AtomicBool,
    runs: AtomicUsize,
}

async fn order(State(shop): State<Arc<Shop>>, body: Bytes) -> axum::response::Response {
    shop.runs.fetch_add(1, Ordering::SeqCst);
    if shop.failing.load(Ordering::SeqCst) {
        return (StatusCode::BAD_GATEWAY, "provider down").into_response();
    }
    (StatusCode::CREATED, body).into_response()
}

struct Service {
    shop: Arc<Shop>,
    layer: IdempotencyLayer,
    routes: Router,
}

impl Service {
    fn new(idempotency: Idempotency) -> Self {
        let shop = Arc::new(Shop::default());
        let routes = Router::new()
            .route("/orders", routing::post(order))
            .with_state(Arc::clone(&shop));
        let layer = IdempotencyLayer::http(idempotency).keep_requests("1.0.0".parse().unwrap());
        Service {
            shop,
            layer,
            routes,
        }
    }

    /// Sends an order under `key` and leaves it abandoned (answered 502, released).
    async fn abandon(&self, key: &str) {
        self.shop.failing.store(true, Ordering::SeqCst);
        let request = Request::post("/orders")
            .header("idempotency-key", key)
            .extension(Principal::new("client"))
            .body(Full::new(Bytes::from(format!("{{\"order\":\"{key}\"}}"))))
            .unwrap();
        let response = self
            .routes
            .clone()
            .layer(self.layer.clone())
            .oneshot(request)
            .await
            .unwrap();
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{body:?}");
        self.shop.failing.store(false, Ordering::SeqCst);
    }

    fn completer(&self) -> Completer<Router> {
        Completer::new(&self.layer, self.routes.clone())
            .after(AFTER)
            .batch(BATCH)
    }
}

/// Ours finished by our completer while theirs, more than a batch and abandoned earlier, wait.
async fn own_operations_are_finished_beside_anothers<S: SessionStore + CheckpointStore + Clone>(
    store: S,
) {
    let ours = Service::new(Idempotency::builder(store.clone()).build());
    let theirs = Service::new(
        Idempotency::builder(store)
            .namespace(unique("another service"))
            .build(),
    );
    for n in 0..2 * BATCH {
        theirs.abandon(&unique(&format!("theirs-{n}"))).await;
    }
    tokio::time::sleep(AFTER).await;
    let mine = [unique("mine-1"), unique("mine-2")];
    for key in &mine {
        ours.abandon(key).await;
    }
    tokio::time::sleep(2 * AFTER).await;
    let runs_before = ours.shop.runs.load(Ordering::SeqCst);

    let pass = ours.completer().pass().await.unwrap();
    assert_eq!(
        (pass.found, pass.completed, pass.skipped),
        (2, 2, 0),
        "this runtime's operations, listed and finished: {pass:?}"
    );
    assert_eq!(ours.shop.runs.load(Ordering::SeqCst), runs_before + 2);
    assert_eq!(
        theirs.shop.runs.load(Ordering::SeqCst),
        2 * BATCH,
        "none of theirs ran"
    );
    let pass = ours.completer().pass().await.unwrap();
    assert_eq!(pass.found, 0, "nothing of ours is left: {pass:?}");
    // Theirs are still theirs to finish.
    let pass = theirs.completer().pass().await.unwrap();
    assert_eq!((pass.found, pass.completed), (BATCH, BATCH), "{pass:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_completer_finishes_its_own_beside_another_runtimes_backlog() {
    own_operations_are_finished_beside_anothers(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_completer_finishes_its_own_beside_another_runtimes_backlog() {
    let Some(url) = redis_url() else { return };
    // A prefix of its own: the store's indexes hold only this test's records.
    let store = RedisStore::builder(url)
        .key_prefix(format!("{}:", unique("completer-shared")))
        .connect()
        .await
        .unwrap();
    own_operations_are_finished_beside_anothers(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_completer_finishes_its_own_beside_another_runtimes_backlog() {
    let name = format!("completer_shared_{}", std::process::id());
    let Some(database) = Database::create(&name).await else {
        return;
    };
    let store = PostgresStore::connect(&database.url).await.unwrap();
    store.migrate().await.unwrap();
    own_operations_are_finished_beside_anothers(store).await;
    database.drop_database().await;
}
