//! The postings every row publishes and consumes, like the `ledger` example's: their forms on
//! the wire and back, and a row's backlog with its duplicates.

use idempotent_consumer::{Failure, Fields, Message};

/// Distinct accounts the postings go to: few enough to be a real table, enough that 16
/// transactions at once rarely wait on one another's row.
pub(crate) const ACCOUNTS: usize = 1000;
/// A duplicate is published at least this many messages after its original, as a publisher's
/// retry or a redelivery would come: not while the original is still in hand.
const DUPLICATE_GAP: usize = 1000;

/// One posting, as published.
#[derive(Debug, Clone)]
pub(crate) struct Posting {
    pub(crate) id: String,
    pub(crate) account: String,
    pub(crate) amount: i64,
    /// With `--paced`: when it was published, in microseconds since the Unix epoch.
    pub(crate) sent: Option<u64>,
}

impl Posting {
    /// The body NATS and RabbitMQ carry: a JSON object of three strings, as in `ledger`.
    pub(crate) fn body(&self) -> Vec<u8> {
        let mut body = serde_json::json!({
            "id": self.id,
            "account": self.account,
            "amount": self.amount.to_string(),
        });
        if let Some(sent) = self.sent {
            body["sent"] = sent.to_string().into();
        }
        serde_json::to_vec(&body).unwrap()
    }

    /// The posting a message carries, as the `ledger` example reads it (the runtime rows).
    pub(crate) fn of_message(message: &Message) -> Result<Posting, Failure> {
        let fields = Fields::of(message)?;
        let amount = fields.text("amount")?;
        Ok(Posting {
            id: fields.text("id")?.to_owned(),
            account: fields.text("account")?.to_owned(),
            amount: amount
                .parse()
                .map_err(|_| Failure::Malformed(format!("amount {amount:?}")))?,
            sent: fields.text("sent").ok().and_then(|s| s.parse().ok()),
        })
    }

    /// The posting of a [`body`](Posting::body), as the bare loops decode it (typed, no
    /// runtime).
    pub(crate) fn of_body(body: &[u8]) -> Posting {
        let body: Body = serde_json::from_slice(body).expect("a posting");
        Posting {
            id: body.id,
            account: body.account,
            amount: body.amount.parse().expect("an amount"),
            sent: body.sent.and_then(|s| s.parse().ok()),
        }
    }
}

/// The message-body form of a posting.
#[derive(serde::Deserialize)]
struct Body {
    id: String,
    account: String,
    amount: String,
    sent: Option<String>,
}

/// Microseconds since the Unix epoch: a paced message's send time, compared on receipt.
pub(crate) fn now_micros() -> u64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
}

/// A row's backlog: `messages` distinct postings and `duplicates` copies of earlier ones,
/// spread evenly after the first [`DUPLICATE_GAP`], each at least that far behind its
/// original. Also the sum of the distinct amounts, what the accounts must add up to.
pub(crate) fn backlog(tag: &str, messages: usize, duplicates: usize) -> (Vec<Posting>, i64) {
    let gap = DUPLICATE_GAP.min(messages / 2);
    let originals: Vec<Posting> = (0..messages)
        .map(|n| Posting {
            id: format!("{tag}-{n}"),
            account: format!("acct-{}", n % ACCOUNTS),
            amount: (n % 97) as i64 + 1,
            sent: None,
        })
        .collect();
    let sum = originals.iter().map(|p| p.amount).sum();
    let mut out = Vec::with_capacity(messages + duplicates);
    let mut random: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut placed = 0;
    for (n, posting) in originals.iter().enumerate() {
        out.push(posting.clone());
        // Duplicates go after originals gap..messages, evenly.
        while placed < duplicates && n >= gap && gap + placed * (messages - gap) / duplicates <= n {
            random = random
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let of = (random >> 33) as usize % (n + 1 - gap);
            out.push(originals[of].clone());
            placed += 1;
        }
    }
    (out, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backlogs_hold_each_posting_once_and_late_copies() {
        let (postings, sum) = backlog("t", 20_000, 2_000);
        assert_eq!(postings.len(), 22_000);
        let mut first = std::collections::HashMap::new();
        let mut copies = 0;
        for (position, posting) in postings.iter().enumerate() {
            match first.get(&posting.id) {
                None => {
                    first.insert(posting.id.clone(), (position, posting.amount));
                }
                Some(&(original, amount)) => {
                    copies += 1;
                    assert_eq!(amount, posting.amount, "a copy has its original's content");
                    assert!(position - original >= DUPLICATE_GAP, "copy too close");
                }
            }
        }
        assert_eq!((first.len(), copies), (20_000, 2_000));
        assert_eq!(first.values().map(|(_, amount)| amount).sum::<i64>(), sum);
        assert_eq!(backlog("t", 10, 0).0.len(), 10);
    }

    #[test]
    fn bodies_and_messages_carry_the_posting() {
        let posting = Posting {
            sent: Some(42),
            ..backlog("t", 1, 0).0.remove(0)
        };
        let decoded = Posting::of_body(&posting.body());
        assert_eq!(
            (decoded.id.as_str(), decoded.account.as_str()),
            ("t-0", "acct-0")
        );
        assert_eq!((decoded.amount, decoded.sent), (1, Some(42)));
        let message = Message::new("1", posting.body());
        let decoded = Posting::of_message(&message).unwrap();
        assert_eq!((decoded.amount, decoded.sent), (1, Some(42)));
    }
}
