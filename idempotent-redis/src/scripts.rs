//! The Lua scripts the Redis store runs: each operation is one script, so that its checks and
//! writes happen atomically on the server; every script that sets an expiry checks it first.

use redis::Script;

use idempotent_core::limits;
use idempotent_core::session::MAX_SESSION_WINDOW;

// Every script that sets an expiry checks it before it writes anything: a Lua error does not
// undo the writes before it, so a `PEXPIRE` that failed after the `HSET` would leave a claim
// with no expiry, or a completed record with the lease's. `EXPIRY_MS` is replaced by the
// argument that holds the expiry, `MAX_MS` by the longest one (`limits`).
const CHECK_EXPIRY: &str = r"
local ms = tonumber(EXPIRY_MS)
if not ms or ms < 1 or ms > MAX_MS or ms ~= math.floor(ms) then
  return redis.error_reply('ERR idempotent: expiry out of range: ' .. tostring(EXPIRY_MS))
end
";

// The server's time in milliseconds, as `ms`.
const NOW_MS: &str = r"
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
";

// `ARGV[1]` fingerprint, `ARGV[2]` lease and `ARGV[3]` TTL in milliseconds, `ARGV[4]` the
// claimant. A record in flight whose lease (`l`, server milliseconds) ended is kept until the
// TTL it was claimed with: the same request takes it over and keeps its lifetime (`o`), its
// checkpoints (`k`) and its saved request (`r`), and another request is answered as by a
// record in flight (`{'i', fingerprint, 0}`: the key stays the first request's until the
// record expires); a claim that begins a new lifetime drops those (after its `HSET`, which is
// the write Redis refuses when it is out of memory, so a refused claim leaves the abandoned
// record whole).
const CLAIM: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 'f', 'p')
if rec[1] == 'c' then return {'c', rec[2], rec[3], redis.call('PTTL', KEYS[1])} end
if rec[1] and rec[1] ~= 'i' then return {'?', rec[1]} end
if rec[1] then
  local more = redis.call('HMGET', KEYS[1], 'l', 'o', 't', 'n')
  rec[4], rec[5], rec[6], rec[7] = more[1], more[2], more[3], more[4]
end
";

// The rest of the claim, once the server's time is read (a replay above does not need it).
const CLAIM_IN_TIME: &str = r"
if rec[1] == 'i' then
  local left
  if rec[4] then left = tonumber(rec[4]) - ms else left = redis.call('PTTL', KEYS[1]) end
  if left > 0 then
    -- The same claim sent again (the client resent it after a dropped connection): its own.
    if rec[7] == ARGV[4] then return {'claimed', rec[6], rec[5] or rec[6]} end
    return {'i', rec[2], left}
  end
end
-- `ARGV[5]` set: a resume, which only takes an abandoned claim of the same request over.
if ARGV[5] == '1' and not (rec[1] == 'i' and rec[2] == ARGV[1] and rec[5]) then return {'none'} end
-- An abandoned claim of another request (kept: the key has not expired): the key is that
-- request's for the record's whole life, so it is reported, nobody holding its lease, and
-- nothing changes.
if rec[1] == 'i' and rec[2] ~= ARGV[1] then return {'i', rec[2], 0} end
-- From the server's clock, and above the record's last token even if the clock stepped back.
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
if rec[6] and tonumber(rec[6]) and tonumber(rec[6]) >= micros then micros = tonumber(rec[6]) + 1 end
local token = string.format('%.0f', micros)
local lifetime = token
if rec[1] == 'i' and rec[2] == ARGV[1] and rec[5] then lifetime = rec[5] end
-- The operation's count of claims (`a`): one more for a takeover.
-- A record written before claims were counted stays uncounted (no `a`).
local attempts = '1'
if lifetime ~= token then
  local before = tonumber(redis.call('HGET', KEYS[1], 'a') or '')
  if before then attempts = string.format('%.0f', math.min(before, 2147483646) + 1) else attempts = nil end
end
-- `ARGV[6]`: the key's label, kept for the record's lifetime ('' for none). One `HSET`
-- writes every field.
local label = lifetime == token and ARGV[6] and ARGV[6] ~= ''
local fields = {'s', 'i', 'f', ARGV[1], 't', token, 'o', lifetime,
  'l', string.format('%.0f', ms + tonumber(ARGV[2])), 'n', ARGV[4],
  'x', '0', 'z', string.format('%.0f', ms)}
if attempts then fields[#fields + 1] = 'a'; fields[#fields + 1] = attempts end
if label then fields[#fields + 1] = 'b'; fields[#fields + 1] = ARGV[6] end
redis.call('HSET', KEYS[1], unpack(fields))
-- A new lifetime over a record that was there drops what the record held; a key that had
-- none (most claims) has nothing to drop.
if lifetime == token and rec[1] then
  drop_steps()
  if label then
    redis.call('HDEL', KEYS[1], 'r', 'w')
  else
    redis.call('HDEL', KEYS[1], 'r', 'w', 'b')
  end
end
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[2]), tonumber(ARGV[3])))
return {'claimed', token, lifetime}
";

// Whether the record is in flight with token `ARGV[1]` and a lease that has not ended, as
// `owned`.
const OWNED: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't', 'l')
local owned = rec[1] == 'i' and rec[2] == ARGV[1] and (not rec[3] or tonumber(rec[3]) > ms)
";

// A completion repeated by the owner whose completion landed (its reply was lost, or it
// retries with the 'not retained' record) finds its own token on the completed record and
// succeeds, changing nothing; with `ARGV[4]` set (replicas required) it writes the token
// again for `WAIT` to cover. The completed record drops the operation's checkpoints and
// request; `2` says it had a request (its member of the index of saved requests can go).
const COMPLETE: &str = r"
if owned then
  local had = redis.call('HEXISTS', KEYS[1], 'r')
  redis.call('HSET', KEYS[1], 's', 'c', 'p', ARGV[2], 'z', string.format('%.0f', ms))
  drop_steps()
  redis.call('HDEL', KEYS[1], 'l', 'n', 'r')
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1 + had
end
if rec[1] == 'c' and rec[2] == ARGV[1] then
  if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 't', ARGV[1]) end
  return 1
end
return 0
";

// Ends the lease now (`l` is the server's time, so the time since tells how long the record
// has been abandoned); the record is kept for the next claim of the same request to take
// over. Replies `0` (not the caller's), or the lease's end and whether the record holds a
// request (whose member of the index of saved requests then gets that end as its score), and
// the digits of its request's owner (`w`, choosing the index; '' for none).
const RELEASE: &str = r"
if not owned then return 0 end
local ended = string.format('%.0f', ms)
redis.call('HSET', KEYS[1], 'l', ended, 'x', '1')
return {ended, redis.call('HEXISTS', KEYS[1], 'r'), redis.call('HGET', KEYS[1], 'w') or ''}
";

// Whether the record is still claimed with token `ARGV[1]`; if so, writes the token again
// (changing nothing), a write for `WAIT` to cover that reaches the replicas after the claim.
const CONFIRM: &str = r"
if not owned then return 0 end
redis.call('HSET', KEYS[1], 't', ARGV[1])
return 1
";

const RENEW: &str = r"
if not owned then return 0 end
redis.call('HSET', KEYS[1], 'l', string.format('%.0f', ms + tonumber(ARGV[2])))
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
";

// Whether the record is completed with token `ARGV[1]` (the owner's completion landed and its
// retry was refused for want of memory); with `ARGV[2]` set (replicas required), writes the
// token again for `WAIT` to cover.
const COMPLETED: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'c' or rec[2] ~= ARGV[1] then return 0 end
if ARGV[2] == '1' then redis.call('HSET', KEYS[1], 't', ARGV[1]) end
return 1
";

// Ends the lease of the claim made by claimant `ARGV[1]` after its caller stopped waiting
// for the reply (see `Unanswered`).
const GIVE_BACK: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 'n', 'l')
if rec[1] ~= 'i' or rec[2] ~= ARGV[1] or not rec[3] or tonumber(rec[3]) <= ms then
  return 0
end
redis.call('HSET', KEYS[1], 'l', string.format('%.0f', ms), 'x', '1')
return 1
";

// The checkpoints of a record are chunks in fields of their own, so that saving one is
// constant work whatever came before (rewriting one field would copy every earlier step's
// bytes again, quadratic in an operation's steps): `k` holds the first entry, `kn` how many
// came after it, in `k1` to `k<kn>` in order (a record written before chunks has everything
// in `k`, which reads the same). `drop_steps()` removes them all: by their count, or, when `kn`
// is damaged (not a count, or past the record's fields), found by name, so that it can neither
// leave chunks behind nor loop; `LOAD_STEPS` calls such a record corrupt.
const STEP_CHUNKS: &str = r"
local function drop_steps()
  local count = redis.call('HGET', KEYS[1], 'kn')
  local names = {'k', 'kn'}
  if count then
    local n = tonumber(count)
    if n and n >= 0 and n == math.floor(n) and n < redis.call('HLEN', KEYS[1]) then
      for i = 1, n do names[#names + 1] = 'k' .. i end
    else
      for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
        if string.match(field, '^k%d+$') then names[#names + 1] = field end
      end
    end
  end
  for first = 1, #names, 1000 do
    redis.call('HDEL', KEYS[1], unpack(names, first, math.min(#names, first + 999)))
  end
end
";

// Appends `ARGV[2]` to the checkpoints of the record held with token `ARGV[1]`.
const SAVE_STEP: &str = r"
if not owned then return 0 end
if redis.call('HSETNX', KEYS[1], 'k', ARGV[2]) == 0 then
  local n = redis.call('HINCRBY', KEYS[1], 'kn', 1)
  redis.call('HSET', KEYS[1], 'k' .. n, ARGV[2])
end
return 1
";

// The checkpoints of the record held with token `ARGV[1]`: `{'ok', chunk...}` (its chunks in
// order, none when it has no checkpoints; joined by the caller, which is cheaper than joining
// them here), or `0`; `{'?', what}` when a chunk is missing or the count is not a number.
const LOAD_STEPS: &str = r"
if not owned then return 0 end
local n = tonumber(redis.call('HGET', KEYS[1], 'kn') or '0')
if not n or n < 0 or n ~= math.floor(n) or n >= redis.call('HLEN', KEYS[1]) then
  return {'?', 'kn'}
end
local names = {'k'}
for i = 1, n do names[#names + 1] = 'k' .. i end
local reply = {'ok'}
for first = 1, #names, 1000 do
  local last = math.min(#names, first + 999)
  local chunks = redis.call('HMGET', KEYS[1], unpack(names, first, last))
  for i = 1, last - first + 1 do
    if chunks[i] then
      reply[#reply + 1] = chunks[i]
    elseif n > 0 then
      return {'?', names[first + i - 1]}
    end
  end
end
return reply
";

// Keeps `ARGV[2]` as the request (`r`) of the record held with token `ARGV[1]`, and `ARGV[3]`
// as the digits of its owner (`w`, '' for none: which index it is in); replies `{lease end}`
// (the score of its member in the index of saved requests), or `0`.
const SAVE_REQUEST: &str = r"
if not owned then return 0 end
redis.call('HSET', KEYS[1], 'r', ARGV[2], 'w', ARGV[3] or '')
return {rec[3] or string.format('%.0f', ms)}
";

// What `CheckpointStore::abandoned` needs of one record, read in one step with the server's time:
// `{now, state, fingerprint, lease end, has a request (1 or 0), request}`, '' for a field
// the record lacks.
const PEEK: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 'f', 'l', 'r')
local has = 0
if rec[4] then has = 1 end
return {ms, rec[1] or '', rec[2] or '', rec[3] or '', has, rec[4] or ''}
";

// The index of saved requests (`KEYS[1]`, a sorted set: member the record's name without the
// prefix, score at most its lease's end): `{now, members}`, up to `ARGV[2]` members, lowest
// score first, whose score is at most the server's time less `ARGV[1]` milliseconds, each
// followed by its score.
const CANDIDATES: &str = r"
local found = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf',
  string.format('%.0f', ms - tonumber(ARGV[1])), 'WITHSCORES', 'LIMIT', 0, ARGV[2])
return {ms, found}
";

// Tidies the index (`KEYS[1]`) after `CANDIDATES`: `ARGV` in threes, a member, the score it
// was read with and its new score ('' to remove it). A member whose score changed since (a
// request saved again, a release) is left as it is.
const TIDY: &str = r"
for i = 1, #ARGV, 3 do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    if ARGV[i + 2] == '' then
      redis.call('ZREM', KEYS[1], ARGV[i])
    else
      redis.call('ZADD', KEYS[1], 'XX', ARGV[i + 2], ARGV[i])
    end
  end
end
return 1
";

// Adds member `ARGV[2]` to the index of saved requests (`KEYS[1]`) with score `ARGV[1]`, or,
// when that is empty, the server's time in milliseconds.
const INDEX: &str = r"
local score = ARGV[1]
if score == '' then score = string.format('%.0f', ms) end
return redis.call('ZADD', KEYS[1], score, ARGV[2])
";

// The session gate (`SessionStore::open_session`) on the session's record `KEYS[1]`, a hash of `e`
// (the epoch), `a` (the acknowledged mark) and `h` (the highest number admitted): `ARGV[1]`
// seq, `ARGV[2]` ack, `ARGV[3]` window, `ARGV[4]` idle in milliseconds. The rules are
// `SessionState::gate`'s. Request `s`'s record is `KEYS[1] .. ':' .. epoch .. ':' .. s`: the
// same hash tag, so the same Cluster slot. A new session's epoch is the server's `TIME` in
// microseconds, as a claim's token. Numbers are decimal strings below 2^53, exact in Lua.
//
// Under `maxmemory` a script's first write decides whether it may write at all: a start's
// first write is the `HSET` (refused, nothing written); a known session's is the `PEXPIRE` of
// its record, which is allowed, so a session in use keeps acknowledging (and freeing) while
// the store refuses new sessions and new claims.
const SESSION: &str = r"
local function count(s)
  if type(s) ~= 'string' or #s > 16 or not string.match(s, '^%d+$') then return nil end
  local n = tonumber(s)
  if n > 9007199254740991 then return nil end
  return n
end
local function decimal(n) return string.format('%.0f', n) end
-- `n` in decimal, as `s` (the digits `count` read `n` from) when `decimal` would write the
-- same, so that the gate does not format again a number it was given.
local function digits(s, n)
  if #s == 1 or string.byte(s) ~= 48 then return s end
  return decimal(n)
end
local seq, ack, window, idle = count(ARGV[1]), count(ARGV[2]), count(ARGV[3]), tonumber(ARGV[4])
if not seq or not ack or not window then
  return redis.error_reply('ERR idempotent: session request out of range')
end
local rec = redis.call('HMGET', KEYS[1], 'e', 'a', 'h')
local known = rec[1] or rec[2] or rec[3]
local epoch, mark, high, epoch_digits
if known then
  epoch, mark, high = count(rec[1]), count(rec[2]), count(rec[3])
  if not epoch then return {'?', 'epoch'} end
  if not mark then return {'?', 'ack'} end
  -- The window keeps `high` within MAX_WINDOW of the mark: the loops below are that short.
  if not high or high > mark + MAX_WINDOW then return {'?', 'high'} end
  epoch_digits = digits(rec[1], epoch)
  redis.call('PEXPIRE', KEYS[1], idle)
else
  if redis.call('EXISTS', KEYS[1]) == 1 then return {'?', 'fields'} end
  if ack > 0 then return {'expired'} end
  local now = redis.call('TIME')
  epoch, mark, high = tonumber(now[1]) * 1000000 + tonumber(now[2]), 0, 0
  epoch_digits = decimal(epoch)
end
local old_high, to = high, math.max(mark, ack)
local reply
if seq <= to then
  reply = {'ack', decimal(to)}
elseif seq > to + window then
  reply = {'window', decimal(to)}
else
  reply = {'open', epoch_digits}
  high = math.max(high, seq)
end
-- A number the request sent is written as it sent it; a known session's record gets only
-- the fields that moved, unless its epoch is not in the store's own form (written by hand):
-- other scripts name records from the epoch as stored, so it is then written again.
local function written(n)
  if n == ack then return digits(ARGV[2], n) end
  if n == seq then return digits(ARGV[1], n) end
  return decimal(n)
end
if not known or (epoch_digits ~= rec[1] and (to ~= mark or high ~= old_high)) then
  redis.call('HSET', KEYS[1], 'e', epoch_digits, 'a', written(to), 'h', written(high))
elseif to ~= mark and high ~= old_high then
  redis.call('HSET', KEYS[1], 'a', written(to), 'h', written(high))
elseif to ~= mark then
  redis.call('HSET', KEYS[1], 'a', written(to))
elseif high ~= old_high then
  redis.call('HSET', KEYS[1], 'h', written(high))
end
if not known then redis.call('PEXPIRE', KEYS[1], idle) end
-- After the mark: a step cut short (a record moved away in a resharding) has refused the
-- numbers whose records it did not get to drop, which expire by themselves.
local base = KEYS[1] .. ':' .. epoch_digits .. ':'
for s = mark + 1, math.min(to, old_high) do
  redis.call('DEL', base .. written(s))
end
-- An answer with less than the idle time left gets one and a half, so each is rewritten once
-- per half idle time at most, not on every request, and still outlives its session.
local longer = math.min(idle + math.floor(idle / 2), MAX_MS)
for s = to + 1, old_high do
  local left = redis.call('PTTL', base .. decimal(s))
  if left >= 0 and left < idle then redis.call('PEXPIRE', base .. decimal(s), longer) end
end
return reply
";

/// `SessionStore::claim_in_session` as one script on the session's record `KEYS[1]`: the gate
/// (`SESSION`, its arguments moved to `ARGV[7]` to `ARGV[10]`) and, when it admits the request,
/// the claim (`CLAIM` and `CLAIM_IN_TIME` with `ARGV[1]` to `ARGV[6]`, the TTL being the idle
/// time) of the request's record `KEYS[1] .. ':' .. epoch .. ':' .. seq`, in the same Cluster
/// slot. Atomic: no other request's `ack` comes between the gate and the claim, so the claim
/// never finds an answer dropped under it. Replies the gate's refusal as `SESSION` does, or
/// `{'open', epoch, claim reply}`. Every expiry is checked before anything is written.
fn session_claim_source() -> String {
    let gate = SESSION
        .replace("MAX_WINDOW", &MAX_SESSION_WINDOW.to_string())
        .replace("MAX_MS", &MAX_EXPIRY_MS.to_string())
        .replace("ARGV[4]", "ARGV[10]")
        .replace("ARGV[3]", "ARGV[9]")
        .replace("ARGV[2]", "ARGV[8]")
        .replace("ARGV[1]", "ARGV[7]");
    let (gate, end) = gate
        .rsplit_once("return reply")
        .expect("the gate's script ends with its reply");
    assert!(end.trim().is_empty(), "the gate's reply is its last word");
    let claim = |part: &str| part.replace("KEYS[1]", "CK");
    checked_source(
        &[2, 3, 10],
        &[
            "local CK\n",
            &claim(STEP_CHUNKS),
            gate,
            "if reply[1] ~= 'open' then return reply end\nCK = base .. written(seq)\n",
            "local function claim()\n",
            &claim(CLAIM),
            NOW_MS,
            &claim(CLAIM_IN_TIME),
            "end\nreturn {'open', epoch_digits, claim()}\n",
        ],
    )
}

/// `part`, a script on one record `KEYS[1]`, on a session's request instead: `KEYS[1]` is the
/// session's record and `seq` (a Lua expression) the request's number, whose record is found
/// through the session's epoch (the script answers `0` when the session has none).
fn in_session(part: &str, seq: &str) -> String {
    format!(
        "local epoch = redis.call('HGET', KEYS[1], 'e')\n\
         if not epoch then return 0 end\n\
         local CK = KEYS[1] .. ':' .. epoch .. ':' .. {seq}\n{}",
        part.replace("KEYS[1]", "CK")
    )
}

/// `parts` (with [`NOW_MS`] before the first part that reads the server's time), with the
/// expiries in `expiries` (argument numbers) checked before anything.
fn checked(expiries: &[usize], parts: &[&str]) -> Script {
    Script::new(&checked_source(expiries, parts))
}

/// Like [`checked`], for a script that must run when Redis is out of memory (`maxmemory`
/// reached, policy `noeviction`): it only rewrites a field in place (a lease's end, its
/// token) or ends a lease, so a running claim keeps its lease, can be given up, and
/// recognises its own completed record while the store refuses new data. Redis 7 runs
/// flagged scripts only; earlier versions refuse them.
fn checked_in_oom(expiries: &[usize], parts: &[&str]) -> Script {
    Script::new(&format!(
        "#!lua flags=allow-oom\n{}",
        checked_source(expiries, parts)
    ))
}

/// Where in a script's parts its expiry checks go, when not first: after parts that only
/// read (a replay returns before it, and pays for no check).
const EXPIRY_CHECKS: &str = "--[[ the expiry checks ]]";

/// The source of [`checked`]'s script.
fn checked_source(expiries: &[usize], parts: &[&str]) -> String {
    let checks: String = expiries
        .iter()
        .map(|arg| {
            CHECK_EXPIRY
                .replace("EXPIRY_MS", &format!("ARGV[{arg}]"))
                .replace("MAX_MS", &MAX_EXPIRY_MS.to_string())
        })
        .collect();
    let placed = parts.contains(&EXPIRY_CHECKS);
    let mut source = if placed {
        String::new()
    } else {
        checks.clone()
    };
    for part in parts {
        if *part == EXPIRY_CHECKS {
            source.push_str(&checks);
        } else {
            source.push_str(part);
        }
    }
    source
}

/// The longest expiry sent to Redis, in milliseconds: the longest TTL or lease.
pub(super) const MAX_EXPIRY_MS: u64 = {
    let max = if limits::MAX_TTL.as_millis() > limits::MAX_LEASE.as_millis() {
        limits::MAX_TTL
    } else {
        limits::MAX_LEASE
    };
    max.as_secs() * 1000 + max.subsec_millis() as u64
};

// What an operator reads of a record (`InspectStore::inspect`), with the server's time:
// `{'absent'}` for no record (or a session's own), else `{'ok', now, PTTL, state,
// fingerprint, token, lease end, released, attempts, since, label?, payload?, request?,
// checkpoint chunks...}`, where `label?`, `payload?` and `request?` are `{}` (absent) or a
// one-element array. Checkpoint chunks are read as `LOAD_STEPS` reads them; a damaged count
// reads as none.
const INSPECT: &str = r"
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return {'absent'} end
local rec = redis.call('HMGET', KEYS[1], 's', 'f', 't', 'l', 'x', 'a', 'z', 'b', 'p', 'r')
if rec[1] ~= 'i' and rec[1] ~= 'c' then return {'absent'} end
local function opt(v) if v then return {v} end return {} end
local reply = {'ok', ms, redis.call('PTTL', KEYS[1]), rec[1], rec[2] or '', rec[3] or '',
  rec[4] or '', rec[5] or '', rec[6] or '', rec[7] or '', opt(rec[8]), opt(rec[9]), opt(rec[10])}
local n = tonumber(redis.call('HGET', KEYS[1], 'kn') or '0')
if n and n >= 0 and n == math.floor(n) and n < redis.call('HLEN', KEYS[1]) then
  local names = {'k'}
  for i = 1, n do names[#names + 1] = 'k' .. i end
  for first = 1, #names, 1000 do
    local last = math.min(#names, first + 999)
    local chunks = redis.call('HMGET', KEYS[1], unpack(names, first, last))
    for i = 1, last - first + 1 do
      if chunks[i] then reply[#reply + 1] = chunks[i] end
    end
  end
end
return reply
";

// A repair (`InspectStore::repair`) of the record `KEYS[1]`: `ARGV[1]` the token read,
// `ARGV[2]` `release`, `give_up` or `forget`, `ARGV[3]` '1' to force, `ARGV[4]` a give-up's
// payload, `ARGV[5]` its TTL in milliseconds (checked first; any valid one otherwise). Replies
// `{'absent'}`, `{'moved', token}`, `{'live', milliseconds left}`, `{'completed'}` or
// `{'done'}`. A give-up's token is drawn as a claim's: from the server's clock, above the
// record's.
const REPAIR: &str = r"
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return {'absent'} end
local rec = redis.call('HMGET', KEYS[1], 's', 't', 'l', 'x')
if rec[1] ~= 'i' and rec[1] ~= 'c' then return {'absent'} end
if rec[2] ~= ARGV[1] then return {'moved', rec[2] or ''} end
local left = 0
if rec[1] == 'i' then
  if rec[3] and tonumber(rec[3]) then left = tonumber(rec[3]) - ms else left = redis.call('PTTL', KEYS[1]) end
end
if left > 0 and ARGV[3] ~= '1' then return {'live', left} end
if ARGV[2] == 'forget' then
  redis.call('DEL', KEYS[1])
  return {'done'}
end
if rec[1] == 'c' then return {'completed'} end
-- A release ends a live lease whatever the flag says (a record an older release took over
-- keeps it); replies the lease's end and the digits of its request's owner when the record
-- holds a request (its member of the index of saved requests then gets that end as score).
if ARGV[2] == 'release' then
  if rec[4] ~= '1' or left > 0 then
    local ended = rec[3] or string.format('%.0f', ms)
    if left > 0 then ended = string.format('%.0f', ms) end
    redis.call('HSET', KEYS[1], 'l', ended, 'x', '1')
    if redis.call('HEXISTS', KEYS[1], 'r') == 1 then
      return {'done', ended, redis.call('HGET', KEYS[1], 'w') or ''}
    end
  end
  return {'done'}
end
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
if tonumber(rec[2]) and tonumber(rec[2]) >= micros then micros = tonumber(rec[2]) + 1 end
redis.call('HSET', KEYS[1], 's', 'c', 'p', ARGV[4], 't', string.format('%.0f', micros),
  'z', string.format('%.0f', ms), 'x', '0')
drop_steps()
redis.call('HDEL', KEYS[1], 'l', 'n', 'r')
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {'done'}
";

// A session's state (`InspectStore::session_state`): `{epoch, ack, high}` as stored, or `{}`.
const SESSION_STATE: &str = r"
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return {} end
local rec = redis.call('HMGET', KEYS[1], 'e', 'a', 'h')
if not rec[1] then return {} end
return {rec[1], rec[2] or '', rec[3] or ''}
";

pub(super) struct Scripts {
    pub(super) claim: Script,
    pub(super) complete: Script,
    pub(super) release: Script,
    pub(super) renew: Script,
    pub(super) confirm: Script,
    pub(super) give_back: Script,
    pub(super) completed: Script,
    pub(super) session: Script,
    pub(super) session_claim: Script,
    pub(super) session_give_back: Script,
    pub(super) save_step: Script,
    pub(super) load_steps: Script,
    pub(super) save_request: Script,
    pub(super) peek: Script,
    pub(super) candidates: Script,
    pub(super) tidy: Script,
    pub(super) index: Script,
    pub(super) inspect: Script,
    pub(super) repair: Script,
    pub(super) session_state: Script,
}

pub(super) fn scripts() -> &'static Scripts {
    static SCRIPTS: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(|| Scripts {
        claim: checked(
            &[2, 3],
            &[STEP_CHUNKS, CLAIM, EXPIRY_CHECKS, NOW_MS, CLAIM_IN_TIME],
        ),
        complete: checked(&[3], &[STEP_CHUNKS, NOW_MS, OWNED, COMPLETE]),
        release: checked_in_oom(&[], &[NOW_MS, OWNED, RELEASE]),
        renew: checked_in_oom(&[2], &[NOW_MS, OWNED, RENEW]),
        confirm: checked(&[], &[NOW_MS, OWNED, CONFIRM]),
        give_back: checked_in_oom(&[], &[NOW_MS, GIVE_BACK]),
        completed: checked_in_oom(&[], &[COMPLETED]),
        session: checked(
            &[4],
            &[&SESSION
                .replace("MAX_WINDOW", &MAX_SESSION_WINDOW.to_string())
                .replace("MAX_MS", &MAX_EXPIRY_MS.to_string())],
        ),
        // Flagged (with no flags), so that Redis refuses it whole when it is out of memory
        // (`maxmemory` reached, policy `noeviction`), as it refuses a claim: unflagged, a known
        // session's `PEXPIRE` would be its first write, which Redis allows, and every write
        // after it would be allowed too, the claim's among them. The store then makes the gate
        // and the claim as two scripts (see `RedisStore::claim_in_session`).
        session_claim: Script::new(&format!("#!lua\n{}", session_claim_source())),
        session_give_back: checked_in_oom(&[], &[NOW_MS, &in_session(GIVE_BACK, "ARGV[2]")]),
        save_step: checked(&[], &[NOW_MS, OWNED, SAVE_STEP]),
        // Reads: they run when Redis is full too (a resumed attempt finds its checkpoints).
        load_steps: checked_in_oom(&[], &[NOW_MS, OWNED, LOAD_STEPS]),
        save_request: checked(&[], &[NOW_MS, OWNED, SAVE_REQUEST]),
        peek: checked_in_oom(&[], &[NOW_MS, PEEK]),
        candidates: checked_in_oom(&[], &[NOW_MS, CANDIDATES]),
        // Only removes members or moves their scores.
        tidy: checked_in_oom(&[], &[TIDY]),
        index: checked(&[], &[NOW_MS, INDEX]),
        inspect: checked_in_oom(&[], &[NOW_MS, INSPECT]),
        repair: checked(&[5], &[STEP_CHUNKS, NOW_MS, REPAIR]),
        session_state: checked_in_oom(&[], &[SESSION_STATE]),
    })
}

/// The claim and completion scripts' source, as sent (see
/// `RedisStore::claim_and_complete_scripts`).
pub(super) fn claim_and_complete_sources() -> [String; 2] {
    [
        checked_source(
            &[2, 3],
            &[STEP_CHUNKS, CLAIM, EXPIRY_CHECKS, NOW_MS, CLAIM_IN_TIME],
        ),
        checked_source(&[3], &[STEP_CHUNKS, NOW_MS, OWNED, COMPLETE]),
    ]
}
