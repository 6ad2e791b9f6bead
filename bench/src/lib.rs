//! What the benchmark binaries share: the consumer benchmark (`src/bin/consumer.rs` runs
//! it), the CPU time and machine load every benchmark reads from `/proc`, and how the tables
//! print numbers. The HTTP benchmark (`src/main.rs`) and the outbox benchmark
//! (`src/bin/outbox.rs`) keep their own modules.

pub mod consumer;
pub mod cpu;
pub mod machine;
pub mod table;
