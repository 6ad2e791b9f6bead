//! Tests for the canonical encoding (`super::canonical`).
//!
//! (Longer than most files here, on purpose: one case per type of the serde data model, and
//! the property tests over all of them.)

use super::canonical::{CanonicalError, MAX_DEPTH, hash_canonical};
use proptest::prelude::*;
use serde::Serialize;
use serde::ser::{Error as _, SerializeMap, SerializeSeq, Serializer};
use serde_json::{Number, Value, json};
use std::collections::{BTreeMap, HashMap};

/// BLAKE3 digest of the canonical encoding of `value`.
fn digest<T: Serialize + ?Sized>(value: &T) -> Result<[u8; 32], CanonicalError> {
    let mut hasher = blake3::Hasher::new();
    hash_canonical(&mut hasher, value)?;
    Ok(*hasher.finalize().as_bytes())
}

/// Digest of a value that must encode successfully.
fn d<T: Serialize + ?Sized>(value: &T) -> [u8; 32] {
    digest(value).expect("value should have a canonical encoding")
}

/// Hex of the digest of a value that must encode successfully.
fn hex<T: Serialize + ?Sized>(value: &T) -> String {
    blake3::Hash::from(d(value)).to_hex().to_string()
}

/// Digest of raw bytes, for checking the encoding against the spec.
fn raw(bytes: &[u8]) -> [u8; 32] {
    *blake3::hash(bytes).as_bytes()
}

/// Serializes its contents with `serialize_bytes`.
struct Bytes<'a>(&'a [u8]);

impl Serialize for Bytes<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

/// Serializes a list of pairs as a map, duplicates included.
struct Pairs<K, V>(Vec<(K, V)>);

impl<K: Serialize, V: Serialize> Serialize for Pairs<K, V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

/// Serializes as a sequence whose length serde does not know up front.
struct Unsized<T>(Vec<T>);

impl<T: Serialize> Serialize for Unsized<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().filter(|_| true))
    }
}

#[derive(Serialize)]
enum Shape {
    Empty,
    Circle(u32),
    Square(u32),
    Rect(u32, u32),
    Named { w: u32, h: u32 },
}

#[derive(Serialize)]
struct Inner {
    id: u64,
    tags: Vec<String>,
}

#[derive(Serialize)]
struct Outer {
    name: String,
    inner: Inner,
    shape: Shape,
    maybe: Option<i32>,
}

fn sample_outer() -> Outer {
    Outer {
        name: "order-42".into(),
        inner: Inner {
            id: 7,
            tags: vec!["a".into(), "b".into()],
        },
        shape: Shape::Rect(3, 4),
        maybe: None,
    }
}

/// Frozen digests: if this fails, the encoding changed and fingerprints broke.
#[test]
fn golden_vectors() {
    let map = BTreeMap::from([("x", 1), ("y", -2)]);
    let cases: [(&str, String, &str); 14] = [
        (
            "0",
            hex(&0u8),
            "d1d6d153f1c2446582cfda0034271c375a6f56d9c66f114c1dfde9582800e83e",
        ),
        (
            "-1",
            hex(&-1i64),
            "8a0d1a02bb0bc7f40d774c8561b951b326c725cdbf8fcb0ba7b75bc3ff149a64",
        ),
        (
            "u128::MAX",
            hex(&u128::MAX),
            "402b7fbacec191cf198d48f6363587570389618c82f63488ea9841a073058133",
        ),
        (
            "1.5",
            hex(&1.5f64),
            "3e3a8bc7784d7454aae13af202f359315b8c80a85cba264517113627cbf038d2",
        ),
        (
            "str",
            hex("hello"),
            "275ff3931ea32736ca74f1d84261a67ae592068f566b7a8e65c92d377143006b",
        ),
        // BLAKE3 of the single byte 0x00.
        (
            "unit",
            hex(&()),
            "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213",
        ),
        (
            "None",
            hex(&None::<u8>),
            "2ef3e0dda5293bda965d0adcedfc7d387244ac736a6014a720c1d63fa0ede02f",
        ),
        (
            "Some(true)",
            hex(&Some(true)),
            "d2fc6cbe652a556899bfd97e676b4d12aa54c1a756440948d06f90ad32f39f1c",
        ),
        (
            "seq",
            hex(&vec![1u8, 2, 3]),
            "74d09784bdf0539aa615b7c4249a8f104d31ceccb350b0398a357126ec7a4a16",
        ),
        (
            "map",
            hex(&map),
            "3fb38aab8d529076cb50ade723633ba2768ed7e7fc0030e6bf4c2f2bc6acf8e7",
        ),
        (
            "Shape::Empty",
            hex(&Shape::Empty),
            "64928161c97ddb74418b1a245fee69211cfd83dffa713ac47a881511633dcf3e",
        ),
        (
            "Shape::Circle",
            hex(&Shape::Circle(2)),
            "4a609b1750161ae18aefdc2e0f62651fb3da98153a6e28defabc1ad1d31b2533",
        ),
        (
            "Shape::Named",
            hex(&Shape::Named { w: 1, h: 2 }),
            "d0eb0e9b17df8fc5bed232d2776e9dc3ad354a27d9f3b6a57de77cfc27b6170e",
        ),
        (
            "outer",
            hex(&sample_outer()),
            "8d21665103402290f3beed72720a5d1a749568d80b69f669450d25e955b1c0af",
        ),
    ];
    for (name, got, want) in cases {
        assert_eq!(
            got, want,
            "golden vector for {name} changed: the encoding is frozen"
        );
    }
}

/// Checks the implementation byte-for-byte against the documented tag table.
#[test]
fn encoding_matches_spec() {
    fn blob(tag: u8, b: &[u8]) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&(b.len() as u64).to_le_bytes());
        v.extend_from_slice(b);
        v
    }
    fn uint(n: u128) -> Vec<u8> {
        let mut v = vec![0x03];
        v.extend_from_slice(&n.to_le_bytes());
        v
    }
    assert_eq!(d(&()), raw(&[0x00]));
    assert_eq!(d(&false), raw(&[0x01]));
    assert_eq!(d(&true), raw(&[0x02]));
    assert_eq!(d(&5u8), raw(&uint(5)));
    let mut neg = vec![0x04];
    neg.extend_from_slice(&(-1i128).to_le_bytes());
    assert_eq!(d(&-1i8), raw(&neg));
    let mut f = vec![0x05];
    f.extend_from_slice(&1.5f64.to_bits().to_le_bytes());
    assert_eq!(d(&1.5f32), raw(&f));
    assert_eq!(d("ab"), raw(&blob(0x06, b"ab")));
    assert_eq!(d(&'é'), raw(&blob(0x06, "é".as_bytes())));
    assert_eq!(d(&Bytes(b"ab")), raw(&blob(0x07, b"ab")));
    assert_eq!(d(&None::<u8>), raw(&[0x08]));
    assert_eq!(d(&Some(true)), raw(&[0x09, 0x02]));

    let mut seq = vec![0x0A];
    seq.extend_from_slice(&2u64.to_le_bytes());
    seq.extend(uint(1));
    seq.extend(uint(2));
    assert_eq!(d(&vec![1u8, 2]), raw(&seq));
    assert_eq!(d(&(1u8, 2u64)), raw(&seq));
    assert_eq!(d(&[1i32, 2]), raw(&seq));
    assert_eq!(d(&Unsized(vec![1u8, 2])), raw(&seq));

    #[derive(Serialize)]
    struct S {
        b: u8,
        a: bool,
    }
    let mut map = vec![0x0B];
    map.extend_from_slice(&2u64.to_le_bytes());
    map.extend(blob(0x06, b"a"));
    map.push(0x02);
    map.extend(blob(0x06, b"b"));
    map.extend(uint(1));
    assert_eq!(d(&S { b: 1, a: true }), raw(&map));

    let mut unit_variant = blob(0x0C, b"Empty");
    unit_variant.push(0x00);
    assert_eq!(d(&Shape::Empty), raw(&unit_variant));
    let mut newtype_variant = blob(0x0C, b"Circle");
    newtype_variant.extend(uint(2));
    assert_eq!(d(&Shape::Circle(2)), raw(&newtype_variant));
    let mut tuple_variant = blob(0x0C, b"Rect");
    tuple_variant.push(0x0A);
    tuple_variant.extend_from_slice(&2u64.to_le_bytes());
    tuple_variant.extend(uint(3));
    tuple_variant.extend(uint(4));
    assert_eq!(d(&Shape::Rect(3, 4)), raw(&tuple_variant));
}

#[test]
fn integer_width_independence() {
    let five = d(&5u8);
    for other in [
        d(&5u16),
        d(&5u32),
        d(&5u64),
        d(&5u128),
        d(&5i8),
        d(&5i16),
        d(&5i32),
        d(&5i64),
        d(&5i128),
        d(&5usize),
        d(&5isize),
    ] {
        assert_eq!(five, other);
    }
    let minus = d(&-3i8);
    for other in [d(&-3i16), d(&-3i32), d(&-3i64), d(&-3i128), d(&-3isize)] {
        assert_eq!(minus, other);
    }
    assert_eq!(d(&0u8), d(&0i64));
    assert_ne!(d(&5u8), d(&-5i8));
    assert_eq!(d(&u64::MAX), d(&u128::from(u64::MAX)));
    assert_eq!(d(&i64::MIN), d(&i128::from(i64::MIN)));
    assert_ne!(d(&u128::MAX), d(&-1i128));
}

#[test]
fn float_rules() {
    assert_eq!(d(&1.5f32), d(&1.5f64));
    assert_eq!(d(&0.1f32), d(&f64::from(0.1f32)));
    assert_ne!(d(&0.1f32), d(&0.1f64));
    assert_eq!(d(&-0.0f64), d(&0.0f64));
    assert_eq!(d(&-0.0f32), d(&0.0f64));
    assert_ne!(d(&1.0f64), d(&1u8));
    assert_ne!(d(&f64::INFINITY), d(&f64::NEG_INFINITY));
    assert_eq!(d(&f32::INFINITY), d(&f64::INFINITY));
    assert!(matches!(digest(&f64::NAN), Err(CanonicalError::NaN)));
    assert!(matches!(digest(&f32::NAN), Err(CanonicalError::NaN)));
    assert!(matches!(
        digest(&vec![Some(1.0), Some(-f64::NAN)]),
        Err(CanonicalError::NaN)
    ));
}

#[test]
fn map_order_independence() {
    let entries: Vec<(String, u32)> = (0..500).map(|i| (format!("key-{i}"), i * 7)).collect();
    let btree: BTreeMap<_, _> = entries.iter().cloned().collect();
    let forward: HashMap<_, _> = entries.iter().cloned().collect();
    let mut backward = HashMap::new();
    for (k, v) in entries.iter().rev() {
        backward.insert(k.clone(), *v);
    }
    let mut strided = HashMap::with_capacity(1);
    for start in 0..7 {
        for (k, v) in entries.iter().skip(start).step_by(7) {
            strided.insert(k.clone(), *v);
        }
    }
    let pairs = Pairs(entries.iter().rev().cloned().collect());
    let want = d(&btree);
    assert_eq!(d(&forward), want);
    assert_eq!(d(&backward), want);
    assert_eq!(d(&strided), want);
    assert_eq!(d(&pairs), want);

    let mut changed = btree.clone();
    changed.insert("key-3".into(), 0);
    assert_ne!(d(&changed), want);
    let mut fewer = btree;
    fewer.remove("key-499");
    assert_ne!(d(&fewer), want);
}

#[test]
fn duplicate_keys_are_rejected() {
    assert!(matches!(
        digest(&Pairs(vec![("a", 1), ("b", 2), ("a", 1)])),
        Err(CanonicalError::DuplicateMapKey)
    ));
    assert!(matches!(
        digest(&Pairs(vec![("a", 1), ("a", 2)])),
        Err(CanonicalError::DuplicateMapKey)
    ));
    // Distinct Rust keys that share one canonical encoding.
    #[derive(Serialize, PartialEq, Eq, PartialOrd, Ord)]
    #[serde(untagged)]
    enum Key {
        Small(u8),
        Big(u64),
    }
    let mut map = BTreeMap::new();
    map.insert(Key::Small(1), "x");
    map.insert(Key::Big(1), "y");
    assert!(matches!(digest(&map), Err(CanonicalError::DuplicateMapKey)));
    assert!(digest(&Pairs(vec![("a", 1), ("ab", 1)])).is_ok());
}

#[test]
fn injectivity() {
    assert_ne!(d(&("ab", "c")), d(&("a", "bc")));
    assert_ne!(d(&vec![vec![1], vec![]]), d(&vec![vec![], vec![1]]));
    assert_ne!(d(&None::<()>), d(&Some(())));
    assert_ne!(d(&Some(())), d(&()));
    assert_ne!(d(&None::<()>), d(&()));
    assert_ne!(d(&Some(None::<u8>)), d(&None::<Option<u8>>));
    assert_ne!(d("1"), d(&1));
    assert_ne!(d("a"), d(&'b'));
    assert_eq!(d("a"), d(&'a'));
    assert_ne!(d("ab"), d(&Bytes(b"ab")));
    assert_ne!(d(&vec![1u8, 2]), d(&Bytes(&[1, 2])));
    assert_ne!(d(&Shape::Circle(3)), d(&Shape::Square(3)));
    assert_ne!(d(&Shape::Empty), d("Empty"));
    assert_ne!(
        d(&Shape::Named { w: 1, h: 2 }),
        d(&Shape::Named { w: 2, h: 1 })
    );
    assert_ne!(d(&true), d(&1u8));
    assert_ne!(d(&false), d(&()));
    assert_ne!(d(&Vec::<u8>::new()), d(&BTreeMap::<u8, u8>::new()));
    assert_ne!(d(&vec![(1, 2)]), d(&BTreeMap::from([(1, 2)])));
    assert_ne!(d(&vec![""]), d(&Vec::<&str>::new()));
}

#[test]
fn names_and_field_order() {
    #[derive(Serialize)]
    struct A {
        x: u8,
        y: String,
    }
    #[derive(Serialize)]
    struct Reordered {
        y: String,
        x: u8,
    }
    #[derive(Serialize)]
    struct Renamed {
        x: u8,
        z: String,
    }
    #[derive(Serialize)]
    struct WithSkip {
        x: u8,
        #[serde(skip_serializing_if = "Option::is_none")]
        extra: Option<u8>,
        y: String,
    }
    #[derive(Serialize)]
    struct Unit;
    #[derive(Serialize)]
    struct Wrapper(u8);
    #[derive(Serialize)]
    struct Pair(u8, u8);

    let a = d(&A {
        x: 1,
        y: "v".into(),
    });
    assert_eq!(
        a,
        d(&Reordered {
            y: "v".into(),
            x: 1
        })
    );
    assert_ne!(
        a,
        d(&Renamed {
            x: 1,
            z: "v".into()
        })
    );
    let skipped = WithSkip {
        x: 1,
        extra: None,
        y: "v".into(),
    };
    assert_eq!(a, d(&skipped));
    assert_ne!(
        a,
        d(&WithSkip {
            extra: Some(0),
            ..skipped
        })
    );
    assert_eq!(a, d(&json!({"x": 1, "y": "v"})));
    assert_eq!(d(&Unit), d(&()));
    assert_eq!(d(&Wrapper(9)), d(&9u8));
    assert_eq!(d(&Pair(1, 2)), d(&(1, 2)));
}

#[test]
fn serde_contract_violations_are_errors() {
    struct Custom;
    impl Serialize for Custom {
        fn serialize<S: Serializer>(&self, _s: S) -> Result<S::Ok, S::Error> {
            Err(S::Error::custom("boom"))
        }
    }
    match digest(&vec![Custom]) {
        Err(CanonicalError::Custom(msg)) => assert_eq!(msg, "boom"),
        other => panic!("unexpected {other:?}"),
    }

    struct Liar(usize, usize);
    impl Serialize for Liar {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut seq = s.serialize_seq(Some(self.0))?;
            for _ in 0..self.1 {
                seq.serialize_element(&0u8)?;
            }
            seq.end()
        }
    }
    assert!(matches!(
        digest(&Liar(3, 2)),
        Err(CanonicalError::LengthMismatch {
            declared: 3,
            actual: 2
        })
    ));
    assert!(matches!(
        digest(&Liar(1, 2)),
        Err(CanonicalError::LengthMismatch {
            declared: 1,
            actual: 2
        })
    ));
    assert_eq!(d(&Liar(2, 2)), d(&[0u8, 0]));

    struct LoneKey;
    impl Serialize for LoneKey {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut map = s.serialize_map(None)?;
            map.serialize_key("k")?;
            map.end()
        }
    }
    assert!(matches!(
        digest(&LoneKey),
        Err(CanonicalError::UnpairedMapEntry)
    ));

    struct LoneValue;
    impl Serialize for LoneValue {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut map = s.serialize_map(None)?;
            map.serialize_value("v")?;
            map.end()
        }
    }
    assert!(matches!(
        digest(&LoneValue),
        Err(CanonicalError::UnpairedMapEntry)
    ));
}

/// `n` nested single-element sequences, without any heap structure.
struct Deep(usize);

impl Serialize for Deep {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 == 0 {
            return s.serialize_unit();
        }
        let mut seq = s.serialize_seq(Some(1))?;
        seq.serialize_element(&Deep(self.0 - 1))?;
        seq.end()
    }
}

/// A recursive vector type with an iterative `Drop` (deep values stay droppable).
#[derive(Serialize, Default)]
struct Nest(Vec<Nest>);

impl Drop for Nest {
    fn drop(&mut self) {
        let mut stack = std::mem::take(&mut self.0);
        while let Some(mut node) = stack.pop() {
            stack.append(&mut node.0);
        }
    }
}

#[test]
fn depth_limit() {
    let too_deep = |r: Result<[u8; 32], CanonicalError>| matches!(r, Err(CanonicalError::DepthLimitExceeded { limit }) if limit == MAX_DEPTH);
    assert!(digest(&Deep(MAX_DEPTH)).is_ok());
    assert!(too_deep(digest(&Deep(MAX_DEPTH + 1))));
    assert!(too_deep(digest(&Deep(10_000))));
    assert!(too_deep(digest(&Deep(10_000_000))));

    let mut nest = Nest::default();
    for _ in 0..10_000 {
        nest = Nest(vec![nest]);
    }
    assert!(too_deep(digest(&nest)));

    let mut value = Value::Null;
    for _ in 0..10_000 {
        value = Value::Array(vec![value]);
    }
    assert!(too_deep(digest(&value)));
    // Tear down iteratively: serde_json's recursive drop could overflow.
    while let Value::Array(mut items) = value {
        value = items.pop().unwrap_or(Value::Null);
    }

    let mut opt: Box<dyn erased::Erased> = Box::new(());
    for _ in 0..200 {
        opt = Box::new(Some(opt));
    }
    assert!(too_deep(digest(&erased::Wrap(&*opt))));
}

/// Minimal type erasure so a 200-deep `Option` chain can be built in a loop.
mod erased {
    use serde::{Serialize, Serializer};

    /// Something that serializes as `()` or `Some(inner)`.
    pub(super) trait Erased {
        /// The inner value, if any.
        fn inner(&self) -> Option<&dyn Erased>;
    }
    impl Erased for () {
        fn inner(&self) -> Option<&dyn Erased> {
            None
        }
    }
    impl Erased for Option<Box<dyn Erased>> {
        fn inner(&self) -> Option<&dyn Erased> {
            self.as_deref()
        }
    }
    /// Serializes an [`Erased`] chain.
    pub(super) struct Wrap<'a>(pub(super) &'a dyn Erased);
    impl Serialize for Wrap<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            match self.0.inner() {
                None => s.serialize_unit(),
                Some(inner) => s.serialize_some(&Wrap(inner)),
            }
        }
    }
}

/// A JSON value re-expressed with `HashMap` objects and unsized sequences.
enum Mirror {
    Null,
    Bool(bool),
    Num(Number),
    Str(String),
    Arr(Vec<Mirror>),
    Obj(HashMap<String, Mirror>),
}

impl Mirror {
    fn from_json(v: &Value) -> Self {
        match v {
            Value::Null => Self::Null,
            Value::Bool(b) => Self::Bool(*b),
            Value::Number(n) => Self::Num(n.clone()),
            Value::String(s) => Self::Str(s.clone()),
            Value::Array(a) => Self::Arr(a.iter().map(Self::from_json).collect()),
            Value::Object(o) => {
                // Insert in reverse order on purpose.
                let mut map = HashMap::new();
                for (k, v) in o.iter().rev() {
                    map.insert(k.clone(), Self::from_json(v));
                }
                Self::Obj(map)
            }
        }
    }
}

impl Serialize for Mirror {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Null => s.serialize_unit(),
            Self::Bool(b) => s.serialize_bool(*b),
            Self::Num(n) => n.serialize(s),
            Self::Str(v) => s.serialize_str(v),
            Self::Arr(a) => s.collect_seq(a.iter().filter(|_| true)),
            Self::Obj(o) => {
                let mut map = s.serialize_map(None)?;
                for (k, v) in o {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-3i64..3).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter_map("finite", |f| Number::from_f64(f).map(Value::Number)),
        prop::sample::select(vec![0.0, -0.0, 1.0, -1.0, 0.5]).prop_map(Value::from),
        "[ab]{0,3}".prop_map(Value::String),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[ab]{0,2}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// An arbitrary serde data-model tree, including NaNs and duplicate map keys.
#[derive(Serialize, Debug, Clone)]
enum Wild {
    U(u128),
    I(i128),
    F(f64),
    G(f32),
    C(char),
    S(String),
    B(#[serde(serialize_with = "as_bytes")] Vec<u8>),
    O(Option<Box<Wild>>),
    L(Vec<Wild>),
    M(#[serde(serialize_with = "as_pairs")] Vec<(Wild, Wild)>),
    T(Box<Wild>, Box<Wild>),
    Unit,
    St { a: Box<Wild>, b: Option<u8> },
}

fn as_bytes<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(v)
}

fn as_pairs<S: Serializer>(v: &[(Wild, Wild)], s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(v.iter().map(|(k, v)| (k, v)))
}

fn arb_wild() -> impl Strategy<Value = Wild> {
    let leaf = prop_oneof![
        any::<u128>().prop_map(Wild::U),
        any::<i128>().prop_map(Wild::I),
        any::<u64>().prop_map(|b| Wild::F(f64::from_bits(b))),
        any::<u32>().prop_map(|b| Wild::G(f32::from_bits(b))),
        any::<char>().prop_map(Wild::C),
        "[xy]{0,2}".prop_map(Wild::S),
        prop::collection::vec(any::<u8>(), 0..4).prop_map(Wild::B),
        Just(Wild::Unit),
        Just(Wild::O(None)),
    ];
    leaf.prop_recursive(6, 64, 5, |inner| {
        prop_oneof![
            inner.clone().prop_map(|w| Wild::O(Some(Box::new(w)))),
            prop::collection::vec(inner.clone(), 0..5).prop_map(Wild::L),
            prop::collection::vec((inner.clone(), inner.clone()), 0..4).prop_map(Wild::M),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| Wild::T(Box::new(a), Box::new(b))),
            (inner, any::<Option<u8>>()).prop_map(|(a, b)| Wild::St { a: Box::new(a), b }),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn json_equal_iff_same_digest(a in arb_json(), b in arb_json()) {
        let da = d(&a);
        prop_assert_eq!(da, d(&a.clone()));
        prop_assert_eq!(da, d(&Mirror::from_json(&a)));
        prop_assert_eq!(a == b, da == d(&b), "a = {}, b = {}", a, b);
    }

    #[test]
    fn json_small_mutation_changes_digest(a in arb_json(), key in "[ab]{0,2}", extra in arb_json()) {
        let wrapped = json!({ key.clone(): a.clone() });
        let mut grown = wrapped.clone();
        grown[format!("{key}!")] = extra;
        prop_assert_ne!(d(&wrapped), d(&grown));
        prop_assert_ne!(d(&a), d(&json!([a.clone()])));
    }

    #[test]
    fn never_panics_and_is_deterministic(w in arb_wild()) {
        let first = digest(&w);
        let second = digest(&w.clone());
        match (&first, &second) {
            (Ok(x), Ok(y)) => prop_assert_eq!(x, y),
            (Err(CanonicalError::NaN), Err(CanonicalError::NaN))
            | (Err(CanonicalError::DuplicateMapKey), Err(CanonicalError::DuplicateMapKey)) => {}
            _ => prop_assert!(false, "unexpected results {:?} / {:?}", first, second),
        }
    }
}
