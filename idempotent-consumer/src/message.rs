//! A message as a source received it ([`Message`]), and [`Fields`], for flat records that
//! arrive as Redis Streams fields or as a JSON object.

use std::fmt;

use bytes::Bytes;

use super::failure::Failure;
use idempotent_core::{Fingerprint, Key};

/// The most headers a NATS or AMQP [`Message`] keeps, and the most fields a dead letter
/// copies from a Redis Streams entry.
pub const MAX_FIELDS: usize = 64;

/// One message as a source received it: its content, the publisher's id, and how many times
/// the broker has delivered it.
#[derive(Clone, PartialEq, Eq)]
pub struct Message {
    pub(super) position: String,
    pub(super) id: Option<String>,
    pub(super) key: Option<Bytes>,
    pub(super) body: Bytes,
    pub(super) fields: Vec<(String, Bytes)>,
    pub(super) deliveries: u64,
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("position", &self.position)
            .field("id", &self.id)
            .field("key_len", &self.key.as_ref().map(Bytes::len))
            .field("body_len", &self.body.len())
            .field("fields", &self.fields.len())
            .field("deliveries", &self.deliveries)
            .finish()
    }
}

impl Message {
    /// A message at `position` (the broker's own name for it: a stream entry id, a stream
    /// sequence, a delivery tag) with `body`, first delivered.
    pub fn new(position: impl Into<String>, body: impl Into<Bytes>) -> Self {
        Message {
            position: position.into(),
            id: None,
            key: None,
            body: body.into(),
            fields: Vec::new(),
            deliveries: 1,
        }
    }

    /// With the publisher's message id.
    #[must_use]
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// With the broker's own message key (a Kafka record's key).
    #[must_use]
    pub fn with_key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// With one more field (a Redis Streams entry's field, a NATS or AMQP header).
    #[must_use]
    pub fn with_field(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.fields.push((name.into(), value.into()));
        self
    }

    /// Delivered this many times, this delivery included (at least 1).
    #[must_use]
    pub fn with_deliveries(mut self, deliveries: u64) -> Self {
        self.deliveries = deliveries.max(1);
        self
    }

    /// The broker's name for this message: a Redis Streams entry id, a JetStream stream
    /// sequence, a RabbitMQ delivery tag, a Kafka record's `PARTITION@OFFSET`. For logs; not a key (a publisher's retry is a new
    /// position).
    pub fn position(&self) -> &str {
        &self.position
    }

    /// The publisher's message id, the default idempotency key: a Redis Streams entry's `id`
    /// field, NATS's `Nats-Msg-Id` header, AMQP's `message-id` property, a Kafka record's
    /// `idempotency-key` header.
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// The broker's own message key: a Kafka record's key (what the producer partitions by),
    /// `None` on the other brokers and for a Kafka record without one. Not the idempotency
    /// key: many messages share it. The default [ordering key](crate::Decode::ordering_key).
    pub fn key(&self) -> Option<&Bytes> {
        self.key.as_ref()
    }

    /// The body (empty for a Redis Streams entry, whose content is its fields).
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The fields: a Redis Streams entry's fields in order (all of them), the headers of a
    /// NATS or AMQP message (those whose value is text or bytes, at most [`MAX_FIELDS`]), or
    /// a Kafka record's headers in order (all of them; a header without a value has an empty
    /// one).
    pub fn fields(&self) -> &[(String, Bytes)] {
        &self.fields
    }

    /// The value of the field `name`, when it occurs exactly once.
    pub fn field(&self, name: &str) -> Option<&Bytes> {
        let mut values = self.fields.iter().filter(|(k, _)| k == name);
        let (_, value) = values.next()?;
        values.next().is_none().then_some(value)
    }

    /// How many times the broker has delivered this message, this delivery included.
    pub fn deliveries(&self) -> u64 {
        self.deliveries
    }

    /// A key derived from the content (`content-` and the hex digest of its
    /// [fingerprint](Self::content_fingerprint)): for messages whose publishers give no id,
    /// where the same content twice means the same message. Return it from [`Decode::key`](crate::Decode::key).
    pub fn content_key(&self) -> Key {
        let mut text = String::with_capacity(8 + 64);
        text.push_str("content-");
        for byte in self.content_fingerprint().as_bytes() {
            text.push_str(&format!("{byte:02x}"));
        }
        Key::new(text).expect("a hex digest with a prefix is a valid key")
    }

    /// A fingerprint of the content: the body and, for a Redis Streams entry, its fields in
    /// order. The default [`Decode::fingerprint`](crate::Decode::fingerprint).
    pub fn content_fingerprint(&self) -> Fingerprint {
        let mut builder = Fingerprint::builder().field(&self.body);
        if !self.body.is_empty() {
            return builder.finish();
        }
        for (name, value) in &self.fields {
            builder.push_field(name.as_bytes());
            builder.push_field(value);
        }
        builder.finish()
    }
}

/// A message read as a flat record of named text values, whichever broker carried it: a
/// Redis Streams entry's fields, or a body holding a JSON object whose values are strings.
/// For applications whose publishers send the same record to several kinds of broker.
#[derive(Debug)]
pub struct Fields<'a> {
    message: &'a Message,
    object: Option<serde_json::Map<String, serde_json::Value>>,
}

impl<'a> Fields<'a> {
    /// The record `message` holds: its JSON object body, or (with an empty body) its fields,
    /// at most [`MAX_FIELDS`]. Malformed: a body that is not a JSON object, more fields than
    /// that.
    pub fn of(message: &'a Message) -> Result<Fields<'a>, Failure> {
        if message.body().is_empty() {
            if message.fields().len() > MAX_FIELDS {
                return Err(Failure::Malformed(format!(
                    "the entry has {} fields, more than {MAX_FIELDS}",
                    message.fields().len()
                )));
            }
            return Ok(Fields {
                message,
                object: None,
            });
        }
        match serde_json::from_slice(message.body()) {
            Ok(object) => Ok(Fields {
                message,
                object: Some(object),
            }),
            Err(_) => Err(Failure::Malformed("the body is not a JSON object".into())),
        }
    }

    /// The value of `name` parsed as a `T` (an integer, say); else why the message is
    /// malformed.
    pub fn parse<T: std::str::FromStr>(&self, name: &str) -> Result<T, Failure> {
        let value = self.text(name)?;
        value.parse().map_err(|_| {
            Failure::Malformed(format!(
                "field `{name}` is not a valid {}: {value:?}",
                std::any::type_name::<T>()
            ))
        })
    }

    /// The value of `name`: present once, text, not empty; else why the message is malformed.
    pub fn text(&self, name: &str) -> Result<&str, Failure> {
        let malformed = |what: &str| Failure::Malformed(format!("field `{name}` {what}"));
        let value = match &self.object {
            None => match self.message.field(name) {
                Some(value) => std::str::from_utf8(value).map_err(|_| malformed("is not UTF-8"))?,
                None if self.message.fields().iter().any(|(k, _)| k == name) => {
                    return Err(malformed("is repeated"));
                }
                None => return Err(Failure::Malformed(format!("missing field `{name}`"))),
            },
            Some(object) => match object.get(name) {
                Some(serde_json::Value::String(value)) => value.as_str(),
                Some(_) => return Err(malformed("is not a string")),
                None => return Err(Failure::Malformed(format!("missing field `{name}`"))),
            },
        };
        match value.is_empty() {
            true => Err(malformed("is empty")),
            false => Ok(value),
        }
    }
}
