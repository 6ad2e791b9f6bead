#![doc = include_str!("../../docs/canonical.md")]

use serde::ser::{self, Serialize};
use std::fmt::Display;

/// Maximum number of nested containers accepted by [`hash_canonical`].
pub(crate) const MAX_DEPTH: usize = 128;

/// Item tags of the canonical format (see the module documentation).
mod tag {
    pub(super) const UNIT: u8 = 0x00;
    pub(super) const FALSE: u8 = 0x01;
    pub(super) const TRUE: u8 = 0x02;
    pub(super) const UINT: u8 = 0x03;
    pub(super) const NINT: u8 = 0x04;
    pub(super) const FLOAT: u8 = 0x05;
    pub(super) const STR: u8 = 0x06;
    pub(super) const BYTES: u8 = 0x07;
    pub(super) const NONE: u8 = 0x08;
    pub(super) const SOME: u8 = 0x09;
    pub(super) const SEQ: u8 = 0x0A;
    pub(super) const MAP: u8 = 0x0B;
    pub(super) const VARIANT: u8 = 0x0C;
}

/// Why a value has no canonical encoding.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CanonicalError {
    /// A floating-point value was NaN, which has no canonical encoding.
    #[error("NaN has no canonical encoding")]
    NaN,
    /// The value nests more containers than the encoder accepts.
    #[error("value nests deeper than {limit} levels")]
    DepthLimitExceeded {
        /// The maximum accepted nesting depth.
        limit: usize,
    },
    /// A map (or struct) contains two keys with the same canonical encoding.
    #[error("map contains two keys with the same canonical encoding")]
    DuplicateMapKey,
    /// A sequence declared a length that differs from its element count.
    #[error("sequence declared {declared} elements but serialized at least {actual}")]
    LengthMismatch {
        /// The length announced to the serializer.
        declared: usize,
        /// The number of elements actually serialized (so far).
        actual: usize,
    },
    /// A map serialized a key without a value or a value without a key.
    #[error("map key and value calls are not paired")]
    UnpairedMapEntry,
    /// The value's `Serialize` implementation reported an error.
    #[error("{0}")]
    Custom(String),
}

impl ser::Error for CanonicalError {
    fn custom<T: Display>(msg: T) -> Self {
        Self::Custom(msg.to_string())
    }
}

/// Feeds a canonical, self-delimiting encoding of `value` into `hasher`.
///
/// The format is specified in the module documentation. On error the hasher
/// state is unspecified and must not be used.
pub(crate) fn hash_canonical<T: Serialize + ?Sized>(
    hasher: &mut blake3::Hasher,
    value: &T,
) -> Result<(), CanonicalError> {
    value.serialize(Canon {
        out: hasher,
        depth: 0,
    })
}

/// A byte destination: the hasher itself, or a buffer for map entries.
trait Sink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for blake3::Hasher {
    fn put(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Writes a length or count as `u64le`.
fn put_len<S: Sink>(out: &mut S, len: usize) {
    out.put(&(len as u64).to_le_bytes());
}

/// Writes `tag ‖ u64le(len) ‖ bytes`.
fn put_blob<S: Sink>(out: &mut S, tag: u8, bytes: &[u8]) {
    out.put(&[tag]);
    put_len(out, bytes.len());
    out.put(bytes);
}

/// Writes a non-negative integer item.
fn put_uint<S: Sink>(out: &mut S, v: u128) {
    out.put(&[tag::UINT]);
    out.put(&v.to_le_bytes());
}

/// Writes an integer item of any sign.
fn put_int<S: Sink>(out: &mut S, v: i128) {
    match u128::try_from(v) {
        Ok(u) => put_uint(out, u),
        Err(_) => {
            out.put(&[tag::NINT]);
            out.put(&v.to_le_bytes());
        }
    }
}

/// Writes the header of a variant item: tag and variant name.
fn put_variant<S: Sink>(out: &mut S, variant: &str) {
    put_blob(out, tag::VARIANT, variant.as_bytes());
}

/// Upper bound on capacity pre-allocated from (untrusted) length hints.
const MAX_PREALLOC: usize = 64;

/// The canonical serializer for one item at a given nesting depth.
struct Canon<'a, S: Sink> {
    /// Destination of the encoding.
    out: &'a mut S,
    /// Number of containers enclosing this item.
    depth: usize,
}

impl<S: Sink> Canon<'_, S> {
    /// Depth of this item's children, or an error if that is too deep.
    fn child_depth(&self) -> Result<usize, CanonicalError> {
        let depth = self.depth + 1;
        if depth > MAX_DEPTH {
            Err(CanonicalError::DepthLimitExceeded { limit: MAX_DEPTH })
        } else {
            Ok(depth)
        }
    }
}

impl<'a, S: Sink> ser::Serializer for Canon<'a, S> {
    type Ok = ();
    type Error = CanonicalError;
    type SerializeSeq = SeqState<'a, S>;
    type SerializeTuple = SeqState<'a, S>;
    type SerializeTupleStruct = SeqState<'a, S>;
    type SerializeTupleVariant = SeqState<'a, S>;
    type SerializeMap = MapState<'a, S>;
    type SerializeStruct = MapState<'a, S>;
    type SerializeStructVariant = MapState<'a, S>;

    fn serialize_bool(self, v: bool) -> Result<(), CanonicalError> {
        self.out.put(&[if v { tag::TRUE } else { tag::FALSE }]);
        Ok(())
    }

    fn serialize_i8(self, v: i8) -> Result<(), CanonicalError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i16(self, v: i16) -> Result<(), CanonicalError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i32(self, v: i32) -> Result<(), CanonicalError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i64(self, v: i64) -> Result<(), CanonicalError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i128(self, v: i128) -> Result<(), CanonicalError> {
        put_int(self.out, v);
        Ok(())
    }

    fn serialize_u8(self, v: u8) -> Result<(), CanonicalError> {
        self.serialize_u128(v.into())
    }

    fn serialize_u16(self, v: u16) -> Result<(), CanonicalError> {
        self.serialize_u128(v.into())
    }

    fn serialize_u32(self, v: u32) -> Result<(), CanonicalError> {
        self.serialize_u128(v.into())
    }

    fn serialize_u64(self, v: u64) -> Result<(), CanonicalError> {
        self.serialize_u128(v.into())
    }

    fn serialize_u128(self, v: u128) -> Result<(), CanonicalError> {
        put_uint(self.out, v);
        Ok(())
    }

    fn serialize_f32(self, v: f32) -> Result<(), CanonicalError> {
        self.serialize_f64(v.into())
    }

    fn serialize_f64(self, v: f64) -> Result<(), CanonicalError> {
        if v.is_nan() {
            return Err(CanonicalError::NaN);
        }
        // `-0.0 == 0.0`, so this maps both zeros to `+0.0`.
        let v = if v == 0.0 { 0.0 } else { v };
        self.out.put(&[tag::FLOAT]);
        self.out.put(&v.to_bits().to_le_bytes());
        Ok(())
    }

    fn serialize_char(self, v: char) -> Result<(), CanonicalError> {
        let mut buf = [0u8; 4];
        self.serialize_str(v.encode_utf8(&mut buf))
    }

    fn serialize_str(self, v: &str) -> Result<(), CanonicalError> {
        put_blob(self.out, tag::STR, v.as_bytes());
        Ok(())
    }

    fn serialize_bytes(self, v: &[u8]) -> Result<(), CanonicalError> {
        put_blob(self.out, tag::BYTES, v);
        Ok(())
    }

    fn serialize_none(self) -> Result<(), CanonicalError> {
        self.out.put(&[tag::NONE]);
        Ok(())
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), CanonicalError> {
        let depth = self.child_depth()?;
        self.out.put(&[tag::SOME]);
        value.serialize(Canon {
            out: self.out,
            depth,
        })
    }

    fn serialize_unit(self) -> Result<(), CanonicalError> {
        self.out.put(&[tag::UNIT]);
        Ok(())
    }

    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), CanonicalError> {
        self.serialize_unit()
    }

    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _variant_index: u32,
        variant: &'static str,
    ) -> Result<(), CanonicalError> {
        put_variant(self.out, variant);
        self.out.put(&[tag::UNIT]);
        Ok(())
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), CanonicalError> {
        let depth = self.child_depth()?;
        value.serialize(Canon {
            out: self.out,
            depth,
        })
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _variant_index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), CanonicalError> {
        let depth = self.child_depth()?;
        put_variant(self.out, variant);
        value.serialize(Canon {
            out: self.out,
            depth,
        })
    }

    fn serialize_seq(self, len: Option<usize>) -> Result<SeqState<'a, S>, CanonicalError> {
        let depth = self.child_depth()?;
        Ok(SeqState::new(self.out, depth, len))
    }

    fn serialize_tuple(self, len: usize) -> Result<SeqState<'a, S>, CanonicalError> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        len: usize,
    ) -> Result<SeqState<'a, S>, CanonicalError> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _variant_index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<SeqState<'a, S>, CanonicalError> {
        let depth = self.child_depth()?;
        put_variant(self.out, variant);
        Ok(SeqState::new(self.out, depth, Some(len)))
    }

    fn serialize_map(self, len: Option<usize>) -> Result<MapState<'a, S>, CanonicalError> {
        let depth = self.child_depth()?;
        Ok(MapState::new(self.out, depth, len.unwrap_or(0)))
    }

    fn serialize_struct(
        self,
        _name: &'static str,
        len: usize,
    ) -> Result<MapState<'a, S>, CanonicalError> {
        self.serialize_map(Some(len))
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _variant_index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<MapState<'a, S>, CanonicalError> {
        let depth = self.child_depth()?;
        put_variant(self.out, variant);
        Ok(MapState::new(self.out, depth, len))
    }

    fn is_human_readable(&self) -> bool {
        true
    }
}

/// In-progress sequence, tuple, tuple struct or tuple-variant payload.
struct SeqState<'a, S: Sink> {
    /// Destination of the finished item.
    out: &'a mut S,
    /// Depth of the elements.
    depth: usize,
    /// Length announced by serde; `None` means elements go to `buf`.
    declared: Option<usize>,
    /// Elements serialized so far.
    count: usize,
    /// Buffered elements when the length was not announced.
    buf: Vec<u8>,
}

impl<'a, S: Sink> SeqState<'a, S> {
    /// Starts a sequence item; with a known length the header is written now.
    fn new(out: &'a mut S, depth: usize, declared: Option<usize>) -> Self {
        if let Some(len) = declared {
            out.put(&[tag::SEQ]);
            put_len(out, len);
        }
        Self {
            out,
            depth,
            declared,
            count: 0,
            buf: Vec::new(),
        }
    }

    /// Encodes one element.
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CanonicalError> {
        let depth = self.depth;
        match self.declared {
            Some(declared) if self.count >= declared => {
                return Err(CanonicalError::LengthMismatch {
                    declared,
                    actual: self.count + 1,
                });
            }
            Some(_) => value.serialize(Canon {
                out: &mut *self.out,
                depth,
            })?,
            None => value.serialize(Canon {
                out: &mut self.buf,
                depth,
            })?,
        }
        self.count += 1;
        Ok(())
    }

    /// Finishes the item (writing header and buffer if the length was unknown).
    fn finish(self) -> Result<(), CanonicalError> {
        match self.declared {
            Some(declared) if declared != self.count => Err(CanonicalError::LengthMismatch {
                declared,
                actual: self.count,
            }),
            Some(_) => Ok(()),
            None => {
                self.out.put(&[tag::SEQ]);
                put_len(self.out, self.count);
                self.out.put(&self.buf);
                Ok(())
            }
        }
    }
}

impl<S: Sink> ser::SerializeSeq for SeqState<'_, S> {
    type Ok = ();
    type Error = CanonicalError;

    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Self::Error> {
        self.element(value)
    }

    fn end(self) -> Result<(), CanonicalError> {
        self.finish()
    }
}

impl<S: Sink> ser::SerializeTuple for SeqState<'_, S> {
    type Ok = ();
    type Error = CanonicalError;

    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Self::Error> {
        self.element(value)
    }

    fn end(self) -> Result<(), CanonicalError> {
        self.finish()
    }
}

impl<S: Sink> ser::SerializeTupleStruct for SeqState<'_, S> {
    type Ok = ();
    type Error = CanonicalError;

    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Self::Error> {
        self.element(value)
    }

    fn end(self) -> Result<(), CanonicalError> {
        self.finish()
    }
}

impl<S: Sink> ser::SerializeTupleVariant for SeqState<'_, S> {
    type Ok = ();
    type Error = CanonicalError;

    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Self::Error> {
        self.element(value)
    }

    fn end(self) -> Result<(), CanonicalError> {
        self.finish()
    }
}

/// In-progress map, struct or struct-variant payload.
struct MapState<'a, S: Sink> {
    /// Destination of the finished item.
    out: &'a mut S,
    /// Depth of keys and values.
    depth: usize,
    /// Encoded entries (`item(key) ‖ item(value)`) and the key's byte length.
    entries: Vec<(Vec<u8>, usize)>,
    /// Encoded key awaiting its value.
    pending_key: Option<Vec<u8>>,
}

impl<'a, S: Sink> MapState<'a, S> {
    /// Starts a map item; nothing is written until [`MapState::finish`].
    fn new(out: &'a mut S, depth: usize, len_hint: usize) -> Self {
        Self {
            out,
            depth,
            entries: Vec::with_capacity(len_hint.min(MAX_PREALLOC)),
            pending_key: None,
        }
    }

    /// Encodes a value after the already-encoded key in `entry` and stores it.
    fn push_entry<T: Serialize + ?Sized>(
        &mut self,
        mut entry: Vec<u8>,
        value: &T,
    ) -> Result<(), CanonicalError> {
        let key_len = entry.len();
        value.serialize(Canon {
            out: &mut entry,
            depth: self.depth,
        })?;
        self.entries.push((entry, key_len));
        Ok(())
    }

    /// Sorts the entries, rejects duplicate keys and writes the item.
    fn finish(mut self) -> Result<(), CanonicalError> {
        if self.pending_key.is_some() {
            return Err(CanonicalError::UnpairedMapEntry);
        }
        self.entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        // Items are prefix-free, so entries sharing a key encoding are
        // contiguous after sorting: checking neighbours finds every duplicate.
        for pair in self.entries.windows(2) {
            if let [(a, a_key), (b, b_key)] = pair
                && a.get(..*a_key) == b.get(..*b_key)
            {
                return Err(CanonicalError::DuplicateMapKey);
            }
        }
        self.out.put(&[tag::MAP]);
        put_len(self.out, self.entries.len());
        for (entry, _) in &self.entries {
            self.out.put(entry);
        }
        Ok(())
    }
}

impl<S: Sink> ser::SerializeMap for MapState<'_, S> {
    type Ok = ();
    type Error = CanonicalError;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Self::Error> {
        if self.pending_key.is_some() {
            return Err(CanonicalError::UnpairedMapEntry);
        }
        let mut entry = Vec::new();
        key.serialize(Canon {
            out: &mut entry,
            depth: self.depth,
        })?;
        self.pending_key = Some(entry);
        Ok(())
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Self::Error> {
        let entry = self
            .pending_key
            .take()
            .ok_or(CanonicalError::UnpairedMapEntry)?;
        self.push_entry(entry, value)
    }

    fn end(self) -> Result<(), CanonicalError> {
        self.finish()
    }
}

/// Starts an entry whose key is the field name `key` as a string item.
fn field_key(key: &str) -> Vec<u8> {
    let mut entry = Vec::with_capacity(1 + 8 + key.len());
    put_blob(&mut entry, tag::STR, key.as_bytes());
    entry
}

impl<S: Sink> ser::SerializeStruct for MapState<'_, S> {
    type Ok = ();
    type Error = CanonicalError;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Self::Error> {
        self.push_entry(field_key(key), value)
    }

    fn skip_field(&mut self, _key: &'static str) -> Result<(), Self::Error> {
        Ok(())
    }

    fn end(self) -> Result<(), CanonicalError> {
        self.finish()
    }
}

impl<S: Sink> ser::SerializeStructVariant for MapState<'_, S> {
    type Ok = ();
    type Error = CanonicalError;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Self::Error> {
        self.push_entry(field_key(key), value)
    }

    fn skip_field(&mut self, _key: &'static str) -> Result<(), Self::Error> {
        Ok(())
    }

    fn end(self) -> Result<(), CanonicalError> {
        self.finish()
    }
}
