//! The NATS JetStream source (feature `nats`): a durable pull consumer of one stream.
//!
//! [`JetStream::builder`]`(url, STREAM, DURABLE)` connects with an `async-nats` client, which
//! reconnects by itself, without bound, whenever the server goes away. Connecting fails when
//! the server cannot be reached or has no JetStream; once connected, no restart of the server
//! makes the source unusable: operations fail with a [`SourceError`] while it is away, and
//! after a fetch that failed or went unanswered (the server drops a fetch for a missing
//! consumer without a word) the next [`receive`](Source::receive) sets the stream and the
//! consumer up again, as below.
//!
//! - **Stream** `STREAM`, subjects `STREAM.entries` (the messages) and `STREAM.dead` (the dead
//!   letters), file storage: created if missing, used as it is when it exists (a publisher may
//!   have created it with its name, subjects and storage alone; without `STREAM.dead` among
//!   its subjects every dead letter fails). Dead letters rely on its duplicate window, which
//!   every stream has (two minutes by default).
//! - **Consumer** `DURABLE`: durable, pull, explicit ack, filter subject `STREAM.entries`, the
//!   [ack wait](JetStreamBuilder::ack_wait); created if missing, used as it is when it exists.
//!   Leave its `max_deliver` unlimited: the runtime dead-letters after
//!   [`max_deliveries`](super::Consumer::max_deliveries), the server would only stop
//!   delivering.
//! - **Receive**: one fetch of up to `max` messages, which waits about a second when there are
//!   none. A [`Message`] has the stream sequence (decimal) as its
//!   [position](Message::position), the `Nats-Msg-Id` header as its [id](Message::id), the
//!   payload as its body, the headers as its [fields](Message::fields) (sorted by name, at
//!   most [`MAX_FIELDS`]: a header map has no order, and an empty body's fingerprint is its
//!   fields), and `info.delivered` from the reply subject as its deliveries (1 when the reply
//!   subject has no delivery info; a message without a reply subject cannot be answered and is
//!   skipped).
//! - **Answers**: [`ack`](Source::ack) is `+ACK`, [`retry`](Source::retry) `-NAK` with the
//!   delay, [`keep_alive`](Source::keep_alive) `+WPI` (the ack wait starts over), sent every
//!   third of the consumer's ack wait. They are published without waiting for the server: one
//!   that is lost leaves the message to be delivered again after the ack wait.
//! - **Dead letters**: the body unchanged on `STREAM.dead`, published through JetStream and
//!   stored before the entry is terminated (`+TERM`), with the entry's headers except the
//!   server's `Nats-*` directives (`Nats-Expected-*`, `Nats-Rollup`, `Nats-TTL`, … would act
//!   on the copy), plus `original-id` (the entry's `Nats-Msg-Id`), `reason` (one line, at most
//!   [`MAX_REASON`] bytes), `deliveries`, and `Nats-Msg-Id: dead-STREAM-SEQ` (`SEQ` the
//!   entry's stream sequence): a dead letter repeated within the duplicate window (after a
//!   crash between the copy and the `+TERM`) is dropped by the stream and answers
//!   [`DeadLettered::Already`].
//! - **Dead letters larger than the server's `max_payload`** (the extras added to an entry
//!   that was close to it) are still dead letters, never redelivered for that: the reason is
//!   cut to fit (down to [`MIN_FITTED_REASON`] bytes); if that is not enough, the entry's own
//!   headers are left out (the extras kept, the reason cut to fit); if the body alone is too
//!   large, the dead letter carries the extras without the body, and
//!   [`BODY_TOO_LARGE`]`: N` (the body's size in bytes). A stream whose own
//!   `max_msg_size` is smaller than the server's `max_payload` refuses such a dead letter: the
//!   entry is then delivered again (`idempotency.source.errors`, operation `dead_letter`).

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::stream::{self, StorageType};
use async_nats::jetstream::{self, AckKind};
use async_nats::{HeaderMap, Subject, header};
use bytes::Bytes;
use futures_util::StreamExt;

use super::{DeadLettered, MAX_FIELDS, Message, Received, Source, SourceError};

/// The default [ack wait](JetStreamBuilder::ack_wait): 30 seconds.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);

/// The longest a dead letter's `reason` header is, in bytes; a longer reason is cut.
pub const MAX_REASON: usize = 1024;
/// The shortest a dead letter's reason is cut to, to fit the server's `max_payload`, before
/// the entry's own headers are left out instead.
pub const MIN_FITTED_REASON: usize = 64;
/// The header of a dead letter sent without its body, which did not fit the server's
/// `max_payload`: the body's size in bytes.
pub const BODY_TOO_LARGE: &str = "body-too-large";

/// How long a fetch waits for a first message.
const FETCH_WAIT: Duration = Duration::from_secs(1);
/// How much longer than [`FETCH_WAIT`] a fetch may take before it is given up (the server's
/// answer that ends it was lost, with the connection say).
const FETCH_GRACE: Duration = Duration::from_secs(1);
/// How long an ack, a nak, a progress or a term may wait for room in the client's outgoing
/// queue (full while the server is away).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// The shortest and the longest ack wait the builder accepts.
const ACK_WAIT_BOUNDS: (Duration, Duration) = (
    Duration::from_millis(100),
    Duration::from_secs(24 * 60 * 60),
);
/// The longest retry delay sent with a `-NAK` (the server reads it as an `i64` of nanoseconds).
const MAX_NAK_DELAY: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// Configures a [`JetStream`] source. Created by [`JetStream::builder`].
#[derive(Clone)]
#[must_use]
pub struct JetStreamBuilder {
    url: String,
    stream: String,
    durable: String,
    ack_wait: Duration,
}

impl fmt::Debug for JetStreamBuilder {
    /// Leaves the URL out: it may hold credentials.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamBuilder")
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("ack_wait", &self.ack_wait)
            .finish_non_exhaustive()
    }
}

impl JetStreamBuilder {
    /// How long the server waits for an answer to a delivered message before it delivers it
    /// again (default [`DEFAULT_ACK_WAIT`]; between 100 ms and a day), set on the consumer
    /// when this source creates it. A message in hand is kept alive every third of the
    /// consumer's actual ack wait.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait.clamp(ACK_WAIT_BOUNDS.0, ACK_WAIT_BOUNDS.1);
        self
    }

    /// Connects, then creates the stream and the consumer if they are missing. Fails when a
    /// name is not a subject token (empty, or holding whitespace, `.`, `*` or `>`), when the
    /// server cannot be reached or has no JetStream, or when it refuses the stream or the
    /// consumer (a push consumer under the durable name, say).
    pub async fn connect(self) -> Result<JetStream, SourceError> {
        for (what, name) in [("stream", &self.stream), ("durable", &self.durable)] {
            // Subject tokens: the API's subjects carry both names.
            let valid = !name.is_empty()
                && !name.contains(|c: char| c.is_whitespace() || matches!(c, '.' | '*' | '>'));
            if !valid {
                return Err(SourceError::new(
                    format!("the {what} name {name:?}"),
                    "empty, or holding whitespace, '.', '*' or '>'",
                ));
            }
        }
        let client = async_nats::ConnectOptions::new()
            .name("idempotent")
            .connect(self.url.as_str())
            .await
            .map_err(|e| SourceError::new("connecting to the NATS server", e))?;
        let context = jetstream::new(client.clone());
        let source = JetStream {
            client: Box::new(client),
            context: Box::new(context),
            entries: format!("{}.entries", self.stream),
            dead: format!("{}.dead", self.stream),
            stream: self.stream,
            durable: self.durable,
            ack_wait: self.ack_wait,
            state: Mutex::new(State {
                consumer: None,
                ack_wait: self.ack_wait,
            }),
        };
        source.consumer().await?;
        Ok(source)
    }
}

/// A durable pull consumer of a JetStream stream's `STREAM.entries`, dead letters on
/// `STREAM.dead`. See the [module documentation](self).
pub struct JetStream {
    // Boxed: a source is small enough to sit in an enum beside others.
    client: Box<async_nats::Client>,
    context: Box<jetstream::Context>,
    stream: String,
    durable: String,
    entries: String,
    dead: String,
    ack_wait: Duration,
    state: Mutex<State>,
}

struct State {
    /// The consumer's handle; `None` after a receive failed, until the next one sets the
    /// stream and the consumer up again.
    consumer: Option<Arc<PullConsumer>>,
    /// The consumer's ack wait, as the server last told it.
    ack_wait: Duration,
}

impl fmt::Debug for JetStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStream")
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("ack_wait", &self.ack_wait())
            .finish_non_exhaustive()
    }
}

/// [`JetStream`]'s handle on one delivered message: its ack subject, stream sequence and
/// headers.
#[derive(Debug)]
pub struct Delivery {
    reply: Subject,
    sequence: Option<u64>,
    headers: Option<HeaderMap>,
}

impl Delivery {
    /// The stream sequence of the message, when the server said it.
    pub fn sequence(&self) -> Option<u64> {
        self.sequence
    }
}

impl JetStream {
    /// Configures a source on `url` (`nats://HOST:PORT`, several comma-separated for a
    /// cluster) that consumes the stream `stream` through the durable consumer `durable`.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), idempotent_consumer::SourceError> {
    /// use idempotent_consumer::nats::JetStream;
    /// use std::time::Duration;
    ///
    /// let source = JetStream::builder("nats://127.0.0.1:4222", "ORDERS", "billing")
    ///     .ack_wait(Duration::from_secs(60))
    ///     .connect()
    ///     .await?;
    /// assert_eq!(source.entries_subject(), "ORDERS.entries");
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(
        url: impl Into<String>,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> JetStreamBuilder {
        JetStreamBuilder {
            url: url.into(),
            stream: stream.into(),
            durable: durable.into(),
            ack_wait: DEFAULT_ACK_WAIT,
        }
    }

    /// The stream's name.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The durable consumer's name.
    pub fn durable(&self) -> &str {
        &self.durable
    }

    /// The subject of the messages: `STREAM.entries`.
    pub fn entries_subject(&self) -> &str {
        &self.entries
    }

    /// The subject of the dead letters: `STREAM.dead`.
    pub fn dead_subject(&self) -> &str {
        &self.dead
    }

    /// The consumer's ack wait, as the server told it (an existing consumer keeps its own).
    pub fn ack_wait(&self) -> Duration {
        self.lock().ack_wait
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The consumer's handle, setting the stream and the consumer up first when there is none.
    async fn consumer(&self) -> Result<Arc<PullConsumer>, SourceError> {
        if let Some(consumer) = &self.lock().consumer {
            return Ok(Arc::clone(consumer));
        }
        let config = stream::Config {
            name: self.stream.clone(),
            subjects: vec![self.entries.clone(), self.dead.clone()],
            storage: StorageType::File,
            ..Default::default()
        };
        let stream = self
            .context
            .get_or_create_stream(config)
            .await
            .map_err(|e| SourceError::new(format!("setting up the stream {}", self.stream), e))?;
        let config = pull::Config {
            durable_name: Some(self.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            filter_subject: self.entries.clone(),
            ..Default::default()
        };
        let consumer: PullConsumer = stream
            .get_or_create_consumer(&self.durable, config)
            .await
            .map_err(|e| {
                SourceError::new(
                    format!(
                        "setting up the consumer {} of {}",
                        self.durable, self.stream
                    ),
                    e,
                )
            })?;
        let wait = consumer.cached_info().config.ack_wait;
        let consumer = Arc::new(consumer);
        let mut state = self.lock();
        state.consumer = Some(Arc::clone(&consumer));
        // Zero: the server's default.
        state.ack_wait = if wait.is_zero() {
            DEFAULT_ACK_WAIT
        } else {
            wait
        };
        Ok(consumer)
    }

    /// Forgets the consumer's handle: the next receive sets the stream and the consumer up.
    fn forget(&self) {
        self.lock().consumer = None;
    }

    fn connected(&self, context: &str) -> Result<(), SourceError> {
        match self.client.connection_state() {
            async_nats::connection::State::Connected => Ok(()),
            state => Err(SourceError::new(
                context,
                format!("not connected to the NATS server ({state})"),
            )),
        }
    }

    /// A fetched message as the runtime sees it; `None` for one without a reply subject,
    /// which cannot be answered (not a JetStream delivery).
    fn received(&self, message: jetstream::Message) -> Option<Received<Delivery>> {
        let (sequence, delivered) = match message.info() {
            Ok(info) => (Some(info.stream_sequence), info.delivered),
            Err(error) => {
                tracing::warn!(source = "nats", stream = %self.stream, %error, "a message's reply subject has no delivery info");
                (None, 1)
            }
        };
        let message = message.message;
        let Some(reply) = message.reply else {
            tracing::warn!(source = "nats", stream = %self.stream, subject = %message.subject, "a fetched message has no reply subject; skipped");
            return None;
        };
        let position = sequence.map_or_else(|| reply.to_string(), |s| s.to_string());
        let mut out = Message::new(position, message.payload)
            .with_deliveries(u64::try_from(delivered).unwrap_or(1));
        if let Some(headers) = &message.headers {
            if let Some(id) = headers.get(header::NATS_MESSAGE_ID) {
                out = out.with_id(id.as_str());
            }
            let mut fields: Vec<(&str, &str)> = headers
                .iter()
                .flat_map(|(name, values)| {
                    let name: &str = name.as_ref();
                    values.iter().map(move |value| (name, value.as_str()))
                })
                .collect();
            // Stable: a name's values keep their order.
            fields.sort_by(|a, b| a.0.cmp(b.0));
            for (name, value) in fields.into_iter().take(MAX_FIELDS) {
                out = out.with_field(name, Bytes::copy_from_slice(value.as_bytes()));
            }
        }
        Some(Received {
            message: out,
            delivery: Delivery {
                reply,
                sequence,
                headers: message.headers,
            },
        })
    }

    /// Publishes `kind` to the message's ack subject, without waiting for the server.
    async fn answer(
        &self,
        delivery: &Delivery,
        kind: AckKind,
        context: &str,
    ) -> Result<(), SourceError> {
        let publish = self.client.publish(delivery.reply.clone(), kind.into());
        match tokio::time::timeout(ANSWER_TIMEOUT, publish).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(SourceError::new(context, e)),
            Err(_) => Err(SourceError::new(
                context,
                format!("not sent within {ANSWER_TIMEOUT:?}: the NATS server is away"),
            )),
        }
    }

    /// The dead letter's headers: the entry's but the server's directives, and ours.
    /// The dead letter's headers and body, within the server's `max_payload` (`max`; 0: no
    /// limit) where it can be: the whole entry with the extras; else with the reason cut to
    /// fit (keeping at least [`MIN_FITTED_REASON`] bytes of it); else without the entry's own
    /// headers, the reason cut to fit; else, as a last resort, without the body, its size in
    /// [`BODY_TOO_LARGE`].
    fn fitted_dead_letter(
        &self,
        message: &Message,
        delivery: &Delivery,
        reason: &str,
        sequence: u64,
        max: usize,
    ) -> (HeaderMap, Bytes) {
        let reason = one_line(reason);
        let body = message.body().clone();
        let full = self.dead_headers(message, Some(delivery), &reason, sequence);
        if max == 0 || headers_len(&full) + body.len() <= max {
            return (full, body);
        }
        // The room left for the reason's value beside `headers` (whose reason is empty) and
        // a body of `body` bytes.
        let room = |headers: &HeaderMap, body: usize| max.checked_sub(headers_len(headers) + body);
        let unreasoned = self.dead_headers(message, Some(delivery), "", sequence);
        if let Some(room) = room(&unreasoned, body.len())
            && room >= MIN_FITTED_REASON.min(reason.len())
        {
            let headers = self.dead_headers(message, Some(delivery), cut(&reason, room), sequence);
            return (headers, body);
        }
        let extras = self.dead_headers(message, None, "", sequence);
        if let Some(room) = room(&extras, body.len()) {
            let headers = self.dead_headers(message, None, cut(&reason, room), sequence);
            return (headers, body);
        }
        let mut extras = extras;
        extras.insert(BODY_TOO_LARGE, body.len().to_string());
        let room = room(&extras, 0).unwrap_or(0);
        let mut headers = self.dead_headers(message, None, cut(&reason, room), sequence);
        headers.insert(BODY_TOO_LARGE, body.len().to_string());
        (headers, Bytes::new())
    }

    /// The dead letter's headers: `delivery`'s own (when given) but the server's directives,
    /// and the extras.
    fn dead_headers(
        &self,
        message: &Message,
        delivery: Option<&Delivery>,
        reason: &str,
        sequence: u64,
    ) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(original) = delivery.and_then(|d| d.headers.as_ref()) {
            for (name, values) in original.iter() {
                let text: &str = name.as_ref();
                if text
                    .get(..5)
                    .is_some_and(|prefix| prefix.eq_ignore_ascii_case("nats-"))
                {
                    continue;
                }
                for value in values {
                    headers.append(name.clone(), value.clone());
                }
            }
        }
        if let Some(id) = message.id() {
            headers.insert("original-id", id);
        }
        headers.insert("reason", reason);
        headers.insert("deliveries", message.deliveries().to_string());
        headers.insert(
            header::NATS_MESSAGE_ID,
            format!("dead-{}-{sequence}", self.stream),
        );
        headers
    }
}

/// The longest prefix of `text` of at most `max` bytes, on a character boundary.
fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `reason` on one line (line breaks and tabs become spaces, other control characters are
/// dropped), at most [`MAX_REASON`] bytes.
fn one_line(reason: &str) -> String {
    let mut line = String::with_capacity(reason.len().min(MAX_REASON));
    for c in reason.chars() {
        let c = match c {
            '\r' | '\n' | '\t' => ' ',
            c if c.is_control() => continue,
            c => c,
        };
        if line.len() + c.len_utf8() > MAX_REASON {
            break;
        }
        line.push(c);
    }
    line
}

/// About the size of `headers` on the wire (`max_payload` bounds headers and body together).
fn headers_len(headers: &HeaderMap) -> usize {
    let fields: usize = headers
        .iter()
        .map(|(name, values)| {
            let name: &str = name.as_ref();
            values
                .iter()
                .map(|v| name.len() + v.as_str().len() + 4)
                .sum::<usize>()
        })
        .sum();
    fields + 12
}

impl Source for JetStream {
    type Delivery = Delivery;

    fn name(&self) -> &'static str {
        "nats"
    }

    async fn receive(&self, max: usize) -> Result<Vec<Received<Delivery>>, SourceError> {
        const CONTEXT: &str = "fetching messages";
        let started = tokio::time::Instant::now();
        self.connected(CONTEXT)?;
        let consumer = self.consumer().await?;
        let deadline = started + FETCH_WAIT + FETCH_GRACE;
        let unanswered = || {
            SourceError::new(
                CONTEXT,
                format!(
                    "no answer from the server within {:?} (the consumer is set up again)",
                    FETCH_WAIT + FETCH_GRACE
                ),
            )
        };
        let fetch = consumer
            .fetch()
            .max_messages(max.max(1))
            .expires(FETCH_WAIT)
            .messages();
        // Bounded: the client's outgoing queue fills while the server is away.
        let mut batch = match tokio::time::timeout_at(deadline, fetch).await {
            Ok(Ok(batch)) => batch,
            Ok(Err(e)) => {
                self.forget();
                return Err(SourceError::new(CONTEXT, e));
            }
            Err(_) => {
                self.forget();
                return Err(unanswered());
            }
        };
        let mut deadline = std::pin::pin!(tokio::time::sleep_until(deadline));
        let mut received = Vec::new();
        loop {
            tokio::select! {
                next = batch.next() => match next {
                    // The server ended the fetch: all asked for, no more messages, expired.
                    None => break,
                    Some(Ok(message)) => received.extend(self.received(message)),
                    // A status that ends the fetch (the consumer deleted, a leader change):
                    // the consumer is set up again on the next receive.
                    Some(Err(e)) => {
                        self.forget();
                        if received.is_empty() {
                            return Err(SourceError::new(CONTEXT, e));
                        }
                        break;
                    }
                },
                // No answer: the server went away meanwhile, or the consumer is gone (a fetch
                // for a missing consumer is dropped without a word). Set up again next time.
                () = &mut deadline => {
                    self.forget();
                    if received.is_empty() {
                        return Err(unanswered());
                    }
                    break;
                }
            }
        }
        if received.is_empty() {
            // A fetch the server ended at once (other requests waiting): no busy loop.
            tokio::time::sleep_until(started + FETCH_WAIT).await;
        }
        Ok(received)
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        self.answer(delivery, AckKind::Ack, "acknowledging a message")
            .await
    }

    async fn retry(&self, delivery: &Delivery, delay: Duration) -> Result<(), SourceError> {
        let kind = AckKind::Nak(Some(delay.min(MAX_NAK_DELAY)));
        self.answer(delivery, kind, "asking for a message again")
            .await
    }

    async fn dead_letter(
        &self,
        message: &Message,
        delivery: &Delivery,
        reason: &str,
    ) -> Result<DeadLettered, SourceError> {
        const CONTEXT: &str = "dead-lettering a message";
        let Some(sequence) = delivery.sequence else {
            return Err(SourceError::new(
                CONTEXT,
                "the message's stream sequence is unknown (no JetStream delivery info)",
            ));
        };
        let max = self.client.server_info().max_payload;
        let (headers, body) = self.fitted_dead_letter(message, delivery, reason, sequence, max);
        let size = headers_len(&headers) + body.len();
        if max > 0 && size > max {
            // Not even the extras alone fit (a max_payload of a few dozen bytes).
            return Err(SourceError::new(
                CONTEXT,
                format!("the dead letter ({size} bytes) exceeds the server's max_payload ({max})"),
            ));
        }
        let ack = self
            .context
            .publish_with_headers(self.dead.clone(), headers, body)
            .await
            .map_err(|e| SourceError::new(CONTEXT, e))?
            .await
            .map_err(|e| SourceError::new(CONTEXT, e))?;
        self.answer(delivery, AckKind::Term, CONTEXT).await?;
        Ok(if ack.duplicate {
            DeadLettered::Already
        } else {
            DeadLettered::Now
        })
    }

    async fn keep_alive(&self, delivery: &Delivery) -> Result<(), SourceError> {
        self.answer(delivery, AckKind::Progress, "keeping a message alive")
            .await
    }

    fn keep_alive_every(&self) -> Option<Duration> {
        Some(self.ack_wait() / 3)
    }
}
