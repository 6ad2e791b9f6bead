//! What the example servers do on SIGTERM (or Ctrl-C): shut the idempotency runtime down
//! gracefully before the server stops.

use std::time::Duration;

use idempotent_core::Idempotency;

/// How long requests in flight get to finish and record their responses after SIGTERM.
/// Shutdown takes up to this plus 5 s, and a response still being recorded then up to a third
/// of the lease more (10 s with the default lease): 25 s in all, below the orchestrator's kill
/// timeout (Kubernetes: `terminationGracePeriodSeconds`, 30 s by default).
pub(crate) const GRACE: Duration = Duration::from_secs(10);

/// Resolves on SIGTERM or Ctrl-C.
pub(crate) async fn terminated() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(terminate) => terminate,
                Err(error) => {
                    eprintln!("cannot listen for SIGTERM: {error}");
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}

/// The server's graceful-shutdown signal: on SIGTERM, refuses new protected requests
/// (`503 shutting_down`) and waits up to [`GRACE`] for those in flight to finish and record
/// their responses; handlers still running then are stopped and their keys released. The
/// server then stops.
pub(crate) async fn drain(idempotency: Idempotency, name: &str) {
    terminated().await;
    eprintln!("{name}: shutting down, draining requests in flight");
    let drained = idempotency.shutdown(GRACE).await;
    if drained.is_clean() {
        eprintln!("{name}: every request in flight finished");
    } else {
        eprintln!(
            "{name}: {} request(s) stopped at the deadline, {} outcome(s) not recorded",
            drained.stopped, drained.remaining
        );
    }
}
