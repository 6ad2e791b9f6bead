//! Steps in a consumer's handler: the `ClaimHandle` the runtime hands it is the operation's,
//! so a message retried after a transient failure resumes after the steps it saved.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use idempotent_consumer::{Consumer, Decode, Failure, Handler, Message};
use idempotent_core::ClaimHandle;
use support::probe::*;
use support::source::*;
use tokio::sync::oneshot;

/// Reserves, fails the first delivery of each message after the reservation, then charges.
#[derive(Default, Clone)]
struct Orders {
    reserved: Arc<Mutex<BTreeMap<String, usize>>>,
    charged: Arc<Mutex<BTreeMap<String, usize>>>,
    attempts: Arc<AtomicUsize>,
}

impl Decode for Orders {
    type Input = String;

    fn decode(&self, message: &Message) -> Result<String, Failure> {
        Ok(String::from_utf8_lossy(message.body()).into_owned())
    }
}

fn count(map: &Mutex<BTreeMap<String, usize>>, order: &str) -> usize {
    let mut map = map.lock().unwrap();
    let n = map.entry(order.to_owned()).or_default();
    *n += 1;
    *n
}

impl Handler for Orders {
    type Output = ();

    async fn handle(&self, order: &String, claim: &ClaimHandle) -> Result<(), Failure> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        let first: bool = claim
            .step("reserve", async {
                count(&self.reserved, order);
                true
            })
            .await
            .map_err(|e| Failure::Transient(e.to_string()))?;
        // The attempt that made the reservation fails; the redelivery resumes after it.
        if first && claim.lifetime() == claim.token() {
            return Err(Failure::Transient("provider timed out".into()));
        }
        claim
            .step("charge", async {
                count(&self.charged, order);
            })
            .await
            .map_err(|e| Failure::Transient(e.to_string()))?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redelivered_message_resumes_after_its_saved_steps() {
    let source = TestSource::new();
    for i in 0..50 {
        source.publish(&format!("order-{i}"), &format!("order {i}"));
    }
    let handler = Orders::default();
    let (stop, done) = oneshot::channel::<()>();
    let run = tokio::spawn(Consumer::new(source.clone()).concurrency(8).run(
        memory(),
        handler.clone(),
        async move {
            let _ = done.await;
        },
    ));
    source.settled().await;
    let _ = stop.send(());
    let report = run.await.unwrap();
    assert_eq!(report.applied, 50, "{report:?}");
    assert_eq!(report.retried, 50, "each message failed once: {report:?}");
    let reserved = handler.reserved.lock().unwrap().clone();
    let charged = handler.charged.lock().unwrap().clone();
    assert_eq!(reserved.len(), 50);
    assert_eq!(charged.len(), 50);
    assert!(
        reserved.values().all(|n| *n == 1),
        "reserved once each: {reserved:?}"
    );
    assert!(
        charged.values().all(|n| *n == 1),
        "charged once each: {charged:?}"
    );
    assert_eq!(handler.attempts.load(Ordering::SeqCst), 100);
}
