//! Table names as the PostgreSQL store and its companions accept them: a lowercase
//! identifier, optionally schema-qualified, quoted when put into SQL.

/// The longest table name part accepted, so that the derived index and sequence names fit
/// PostgreSQL's 63-byte identifiers.
pub(super) const MAX_TABLE_NAME: usize = 48;

/// A table name that is not a lowercase identifier, optionally schema-qualified.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid table name {name:?}: expected a lowercase identifier ([a-z_][a-z0-9_]*, at most \
     48 bytes), optionally qualified by a schema, e.g. \"billing.idempotency\""
)]
pub struct InvalidTableName {
    name: String,
}

/// A table name validated as the store accepts them: a lowercase identifier, optionally
/// qualified by a schema.
pub(crate) struct TableName<'a> {
    schema: Option<&'a str>,
    pub(super) name: &'a str,
}

impl<'a> TableName<'a> {
    pub(crate) fn parse(table: &'a str) -> Result<Self, InvalidTableName> {
        let (schema, name) = match table.split_once('.') {
            Some((schema, name)) => (Some(schema), name),
            None => (None, table),
        };
        if !schema.is_none_or(is_identifier) || !is_identifier(name) {
            return Err(InvalidTableName {
                name: table.to_owned(),
            });
        }
        Ok(TableName { schema, name })
    }

    /// `part` in the table's schema, quoted: a reserved word is then a valid name, and since
    /// only lowercase is accepted, the quoted name is the same table as the unquoted one in
    /// hand-written SQL.
    pub(crate) fn qualify(&self, part: &str) -> String {
        match self.schema {
            Some(schema) => format!("\"{schema}\".\"{part}\""),
            None => format!("\"{part}\""),
        }
    }

    /// The table itself, quoted.
    pub(crate) fn quoted(&self) -> String {
        self.qualify(self.name)
    }
}

pub(super) fn is_identifier(part: &str) -> bool {
    let mut bytes = part.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z' | b'_'))
        && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
        && part.len() <= MAX_TABLE_NAME
}
