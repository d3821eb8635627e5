package outbox

// All SQL of the outbox package lives here. Every statement is a single
// parameterised statement (no session state, no prepared-statement reliance,
// no advisory locks), so it runs unchanged through RDS Proxy or pgbouncer in
// transaction mode.

// sqlReserveSeq bumps each aggregate's counter by the number of new events
// and returns the new last sequence. The upsert row-locks the aggregate until
// the caller commits: writers of one aggregate serialise, so sequence order is
// commit order and a dispatcher never sees N+1 committed before N.
const sqlReserveSeq = `
INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, last_seq)
SELECT t, i, n FROM unnest($1::text[], $2::text[], $3::bigint[]) AS u(t, i, n)
ON CONFLICT (aggregate_type, aggregate_id)
DO UPDATE SET last_seq = outbox_aggregates.last_seq + EXCLUDED.last_seq
RETURNING aggregate_type, aggregate_id, last_seq`

const sqlInsertEvents = `
INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq,
                    tenant_id, traceparent, occurred_at, body)
SELECT e, ty, at, ai, s, NULLIF(te, ''), NULLIF(tp, ''), o, b
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::bigint[],
            $6::text[], $7::text[], $8::timestamptz[], $9::bytea[]) AS u(e, ty, at, ai, s, te, tp, o, b)`

// sqlClaim is the dispatcher's claim: the SQL is the outbox_claim function in
// migrations/00006_outbox_claim_function.sql, which explains the ordering
// design and why a function (it pins the plan shape, so a claim reads
// O(batch) rows even with stale planner statistics).
//
// $1 batch size, $2 claim token, $3 lease in milliseconds, $4 keyset cursor
// (the last id this dispatcher claimed in the current sweep, 0 to start over).
const sqlClaim = `SELECT * FROM outbox_claim($1::bigint, $2::uuid, $3::bigint, $4::bigint)`

// sqlClaimFunction reads the claim function's body and settings, so
// diagnostics can EXPLAIN exactly what it runs.
const sqlClaimFunction = `
SELECT prosrc, coalesce(proconfig, '{}')
FROM pg_proc WHERE oid = 'outbox_claim(bigint, uuid, bigint, bigint)'::regprocedure`

// sqlMark records publish outcomes for a claimed batch in one statement. Only
// rows still holding this claim's token are touched: if the lease expired and
// another dispatcher re-claimed a row, that dispatcher owns the outcome.
//
// $1 ids, $2 outcomes ('sent'|'retry'|'dead'), $3 retry delay ms, $4 errors, $5 token.
const sqlMark = `
UPDATE outbox o
SET state = CASE u.outcome WHEN 'sent' THEN 'sent' WHEN 'dead' THEN 'dead' ELSE 'pending' END,
    sent_at = CASE WHEN u.outcome = 'sent' THEN now() END,
    next_attempt_at = CASE WHEN u.outcome = 'retry'
                           THEN now() + make_interval(secs => u.delay_ms / 1000.0)
                           ELSE now() END,
    last_error = COALESCE(NULLIF(u.err, ''), o.last_error),
    claim_token = NULL
FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[]) AS u(id, outcome, delay_ms, err)
WHERE o.id = u.id AND o.claim_token = $5`

// sqlMarkSent is sqlMark for the common case where every row was sent: one
// array parameter instead of four.
const sqlMarkSent = `
UPDATE outbox SET state = 'sent', sent_at = now(), next_attempt_at = now(), claim_token = NULL
WHERE id = ANY($1::bigint[]) AND claim_token = $2`

// sqlRawClaimAndMark is the benchmark's reference: one statement that claims
// and marks a batch, the fastest PostgreSQL can move rows out of pending.
const sqlRawClaimAndMark = `
UPDATE outbox SET state = 'sent', sent_at = now()
WHERE id IN (SELECT id FROM outbox WHERE state = 'pending' ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)`

// sqlStats reads the backlog figures operators and alarms watch.
const sqlStats = `
SELECT
    (SELECT count(*) FROM outbox WHERE state = 'pending'),
    (SELECT count(*) FROM outbox WHERE state = 'dead'),
    (SELECT count(DISTINCT (aggregate_type, aggregate_id)) FROM outbox WHERE state = 'dead'),
    (SELECT count(*) FROM outbox WHERE state = 'pending' AND claim_token IS NOT NULL AND next_attempt_at > now()),
    (SELECT extract(epoch FROM now() - created_at)::float8 FROM outbox WHERE state = 'pending' ORDER BY id LIMIT 1)`

// sqlPrune deletes up to $2 sent rows older than $1, oldest first.
const sqlPrune = `
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox WHERE state = 'sent' AND sent_at < $1 ORDER BY id LIMIT $2)`
