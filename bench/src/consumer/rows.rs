//! The rows of the consumer benchmark: a broker and what consumes its messages.

/// The broker a row consumes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Broker {
    Redis,
    Nats,
    RabbitMq,
    Kafka,
}

impl Broker {
    /// Also the order of the servers' CPU times (`progress::SERVICE_NAMES`).
    pub(crate) const ALL: [Broker; 4] =
        [Broker::Redis, Broker::Nats, Broker::RabbitMq, Broker::Kafka];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Broker::Redis => "redis",
            Broker::Nats => "nats",
            Broker::RabbitMq => "rabbitmq",
            Broker::Kafka => "kafka",
        }
    }
}

/// What consumes a row's messages, and with which effect (see `src/bin/consumer.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Mode {
    Bare,
    BareTasks,
    Runtime,
    RuntimeDup,
    BarePg,
    RuntimePg,
    RuntimePgDup,
}

impl Mode {
    pub(crate) const ALL: [Mode; 7] = [
        Mode::Bare,
        Mode::BareTasks,
        Mode::Runtime,
        Mode::RuntimeDup,
        Mode::BarePg,
        Mode::RuntimePg,
        Mode::RuntimePgDup,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Bare => "bare",
            Mode::BareTasks => "bare-tasks",
            Mode::Runtime => "runtime",
            Mode::RuntimeDup => "runtime-dup",
            Mode::BarePg => "bare-pg",
            Mode::RuntimePg => "runtime-pg",
            Mode::RuntimePgDup => "runtime-pg-dup",
        }
    }

    /// Whether the runtime consumes the row (otherwise a bare loop).
    pub(crate) fn runtime(self) -> bool {
        matches!(
            self,
            Mode::Runtime | Mode::RuntimeDup | Mode::RuntimePg | Mode::RuntimePgDup
        )
    }

    /// Whether the row's backlog has duplicates mixed in.
    pub(crate) fn duplicates(self) -> bool {
        matches!(self, Mode::RuntimeDup | Mode::RuntimePgDup)
    }

    /// Whether the row's effect is the PostgreSQL `INSERT` (otherwise nothing).
    pub(crate) fn postgres(self) -> bool {
        matches!(self, Mode::BarePg | Mode::RuntimePg | Mode::RuntimePgDup)
    }
}
