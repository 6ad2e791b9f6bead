//! Which offset of a partition may be committed: [`Offsets`].

use std::collections::BTreeMap;

/// The offsets of one partition received and not yet answered, and the offset a commit may
/// name: the lowest one whose message is not answered yet, or (all answered) the one after the
/// highest. Messages are answered in any order (handlers run concurrently); the commit only
/// ever moves past a prefix of answered offsets, so a crash after it never skips a message
/// whose effect is not recorded.
#[derive(Debug, Default)]
pub(crate) struct Offsets {
    /// Received offsets from the lowest unanswered one on, each with whether it is answered.
    pending: BTreeMap<i64, bool>,
    /// The offset to commit: every offset below it was answered (or never received, between
    /// two received ones: a gap in the log). `None` until the first answer.
    next: Option<i64>,
}

impl Offsets {
    /// `offset` was received (in the order the partition holds them).
    pub(crate) fn received(&mut self, offset: i64) {
        self.pending.entry(offset).or_insert(false);
    }

    /// `offset` was answered (applied, a duplicate, dead-lettered). Whether the commit
    /// position moved.
    pub(crate) fn answered(&mut self, offset: i64) -> bool {
        match self.pending.get_mut(&offset) {
            Some(done) => *done = true,
            None => return false,
        }
        let mut moved = false;
        while let Some(entry) = self.pending.first_entry() {
            if !*entry.get() {
                break;
            }
            let (offset, _) = entry.remove_entry();
            self.next = Some(offset.saturating_add(1));
            moved = true;
        }
        moved
    }

    /// The offset a commit names (the next to consume), once anything was answered.
    pub(crate) fn position(&self) -> Option<i64> {
        self.next
    }

    /// Received offsets not answered yet.
    #[cfg(test)]
    pub(crate) fn unanswered(&self) -> usize {
        self.pending.values().filter(|done| !**done).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The commit position is the lowest unanswered offset, whatever order answers come in.
    #[test]
    fn the_position_stops_at_the_lowest_unanswered_offset() {
        let mut offsets = Offsets::default();
        for offset in 10..15 {
            offsets.received(offset);
        }
        assert_eq!(offsets.position(), None);
        assert!(!offsets.answered(12));
        assert!(!offsets.answered(11));
        assert_eq!(offsets.position(), None, "10 is not answered yet");
        assert!(offsets.answered(10));
        assert_eq!(offsets.position(), Some(13), "10, 11 and 12 are answered");
        assert!(!offsets.answered(99), "never received");
        assert!(offsets.answered(13));
        assert!(offsets.answered(14));
        assert_eq!(offsets.position(), Some(15));
        assert_eq!(offsets.unanswered(), 0);
        // A gap in the log (compacted records, transaction markers) is no obstacle.
        offsets.received(20);
        assert!(offsets.answered(20));
        assert_eq!(offsets.position(), Some(21));
    }

    /// Many tasks answer a partition's offsets at once, in random order: the position never
    /// passes an unanswered offset, and ends after the last.
    #[test]
    fn concurrent_answers_never_commit_past_an_unanswered_offset() {
        use std::sync::{Arc, Mutex};
        const N: i64 = 2_000;
        let offsets = Arc::new(Mutex::new(Offsets::default()));
        let answered: Arc<Vec<std::sync::atomic::AtomicBool>> = Arc::new(
            (0..N)
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
        );
        for offset in 0..N {
            offsets.lock().unwrap().received(offset);
        }
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let offsets = Arc::clone(&offsets);
                let answered = Arc::clone(&answered);
                std::thread::spawn(move || {
                    // Each thread answers its own offsets, in a scrambled order.
                    let mut mine: Vec<i64> = (0..N).filter(|o| o % 8 == t).collect();
                    let mut seed = 0x9e37_79b9_7f4a_7c15_u64 ^ t as u64;
                    for i in (1..mine.len()).rev() {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        mine.swap(i, (seed % (i as u64 + 1)) as usize);
                    }
                    for offset in mine {
                        let mut offsets = offsets.lock().unwrap();
                        answered[offset as usize].store(true, std::sync::atomic::Ordering::SeqCst);
                        offsets.answered(offset);
                        if let Some(position) = offsets.position() {
                            // Everything below the position is answered.
                            for below in 0..position {
                                assert!(
                                    answered[below as usize]
                                        .load(std::sync::atomic::Ordering::SeqCst),
                                    "position {position} passed unanswered offset {below}"
                                );
                            }
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let offsets = offsets.lock().unwrap();
        assert_eq!(offsets.position(), Some(N));
        assert_eq!(offsets.unanswered(), 0);
    }
}
