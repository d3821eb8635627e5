package outbox

// All SQL of the outbox package lives here. Every statement is a single
// parameterised statement (no session state, no prepared-statement reliance,
// no advisory locks), so it runs unchanged through RDS Proxy or pgbouncer in
// transaction mode.

// sqlEnqueue writes events through fifobox_enqueue_events (migrations
// 00013, 00014; SECURITY DEFINER since 00038), the one implementation behind
// every enqueue path: it validates each event again (a producer's rights
// reach the outbox only through it or the insert trigger), reserves the
// sequences (aggregates in byte order, each counter row-locked until the
// caller commits, so sequence order is commit order), builds each body as
// envelope.Encode does and writes one wake-up per aggregate. One round trip.
//
// Per event: $1 id, $2 type, $3 occurred_at, $4 aggregate type, $5 aggregate
// id, $6 tenant, $7 correlation id, $8 causation id, $9 traceparent, $10
// tracestate, $11 schema version, $12 payload; $13 the message size limit.
const sqlEnqueue = `
SELECT count(*) FROM fifobox_enqueue_events($1::text[], $2::text[], $3::timestamptz[], $4::text[], $5::text[],
    $6::text[], $7::text[], $8::text[], $9::text[], $10::text[], $11::bigint[], $12::text[], $13::integer)`

// sqlClaim is the dispatcher's claim: outbox_claim_runs, defined with the
// design it rests on in migrations/00009_outbox_heads.sql (outbox_claim_heads
// is the claim query itself). It consumes wake-ups, then takes due heads in
// due order with a run of consecutive events each. Since migrations/00065
// the rows are not sorted (they come in claim order by the plan's
// structure); claim puts each run in sequence order itself.
//
// $1 most events, $2 most events per aggregate (run), $3 claim token, $4
// lease in milliseconds, $5 most wake-ups to consume.
const sqlClaim = `SELECT * FROM outbox_claim_runs($1::integer, $2::integer, $3::uuid, $4::bigint, $5::integer)`

// sqlClaimFunction reads the claim function's source (its query: claimQuery
// in explain.go) and settings, so diagnostics can EXPLAIN exactly what it
// runs.
const sqlClaimFunction = `
SELECT prosrc, coalesce(proconfig, '{}')
FROM pg_proc WHERE oid = 'outbox_claim_heads(integer, integer, uuid, bigint)'::regprocedure`

// sqlTruncateWakeups truncates the wake-up slot producers come back to
// next if it holds no live wake-up (outbox_truncate_wakeups,
// migrations/00064_outbox_wakeups_rotated.sql, which says why nothing is lost
// and no producer waits). Returns whether it truncated.
const sqlTruncateWakeups = `SELECT outbox_truncate_wakeups()`

// sqlExtendRun lengthens a claimed run when the batch has room
// (outbox_extend_run, migrations/00012_outbox_mark_by_id.sql): $1 type, $2
// id, $3 the run's last sequence, $4 most events to add, $5 the claim token.
const sqlExtendRun = `SELECT * FROM outbox_extend_run($1::text, $2::text, $3::bigint, $4::integer, $5::uuid)`

// sqlIdleHeads retires heads a claim found with nothing to publish
// (outbox_idle_heads). $1 types, $2 ids, $3 wakes seen by the claim.
const sqlIdleHeads = `SELECT outbox_idle_heads($1::text[], $2::text[], $3::bigint[])`

// sqlMark records a claim's outcomes, one row per run (outbox_mark_runs,
// the signature of migrations/00065). Only heads still holding the claim's
// token are touched.
//
// $1 token; per run: $2 types, $3 ids, $4 wakes seen by the claim, $5 the
// head's next sequence, $6 outcome ('sent'|'retry'|'dead'|'released'), $7
// retry delay ms, $8 error, $9 the failed event's row id (0 if none), $10
// whether the claim saw nothing unsent after the run (run.ended).
const sqlMark = `SELECT outbox_mark_runs($1::uuid, $2::text[], $3::text[], $4::bigint[], $5::bigint[],
    $6::text[], $7::bigint[], $8::text[], $9::bigint[], $10::boolean[])`

// sqlMarkBefore65 is sqlMark through the signature of migrations/00063,
// for a schema not yet migrated to 00065: $10 the row ids of every
// published event (unused since 00030) instead of the claim's hint.
const sqlMarkBefore65 = `SELECT outbox_mark_runs($1::uuid, $2::text[], $3::text[], $4::bigint[], $5::bigint[],
    $6::text[], $7::bigint[], $8::text[], $9::bigint[], $10::bigint[])`

// sqlRawClaimAndMark is the benchmark's reference: one statement that claims
// and marks a batch, the fastest PostgreSQL can move rows out of pending
// (the benchmark gives it the partial index on pending ids it needs).
const sqlRawClaimAndMark = `
UPDATE outbox SET state = 'sent', sent_at = now()
WHERE id IN (SELECT id FROM outbox WHERE state = 'pending' ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)`

// sqlStats reads the backlog figures operators and alarms watch. Per-head
// counts come from the heads (O(aggregates with a backlog)), event counts
// from the sequence counters (last_seq - next_seq + 1 unsent events per head:
// every event below a head's next_seq is sent, migrations/00030).
// A head is backing off when it is unclaimed, not yet due and retrying.
// Aggregates whose wake-ups no claim has consumed yet (no head, or an idle
// one) are counted from their events (O(wake-ups waiting)).
const sqlStats = `
WITH active AS (
    SELECT h.aggregate_type, h.aggregate_id, h.state, h.next_seq, h.due_at, h.claim_token, h.retry_since,
           coalesce(h.lease_until, h.due_at) AS lease_end,
           greatest(a.last_seq - h.next_seq + 1, 0) AS unsent,
           (h.state = 'ready' AND h.claim_token IS NULL AND h.due_at > now() AND h.retry_since IS NOT NULL) AS backing_off
    FROM (SELECT * FROM outbox_heads WHERE state = 'ready'
          UNION ALL
          SELECT * FROM outbox_heads WHERE state = 'dead') h
    -- One primary-key probe per head (OFFSET 0 keeps the planner from
    -- turning it into a join that reads every aggregate).
    CROSS JOIN LATERAL (SELECT a.last_seq FROM outbox_aggregates a
                        WHERE a.aggregate_type = h.aggregate_type AND a.aggregate_id = h.aggregate_id OFFSET 0) a
), oldest AS (
    -- Each active head's first pending event (the head event, or the first
    -- one behind a dead head).
    SELECT h.state, h.backing_off, o.created_at
    FROM active h
    CROSS JOIN LATERAL (SELECT created_at FROM outbox o
                        WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                          AND o.aggregate_seq >= h.next_seq AND o.state = 'pending'
                        ORDER BY o.aggregate_seq LIMIT 1) o
), woken AS MATERIALIZED (
    SELECT w.aggregate_type, w.aggregate_id
    FROM (SELECT DISTINCT aggregate_type, aggregate_id FROM outbox_wakeups) w
    WHERE NOT EXISTS (SELECT 1 FROM outbox_heads h
                      WHERE h.aggregate_type = w.aggregate_type AND h.aggregate_id = w.aggregate_id AND h.state <> 'idle')
), woken_unsent AS (
    SELECT count(*) AS n, min(o.created_at) AS oldest
    FROM woken w
    CROSS JOIN LATERAL (SELECT o.created_at FROM outbox o
                        WHERE o.aggregate_type = w.aggregate_type AND o.aggregate_id = w.aggregate_id
                          AND o.aggregate_seq >= coalesce((SELECT h.next_seq FROM outbox_heads h
                                                           WHERE h.aggregate_type = w.aggregate_type
                                                             AND h.aggregate_id = w.aggregate_id), 0)
                          AND o.state = 'pending' OFFSET 0) o
), dead AS (
    SELECT count(*) AS n FROM outbox WHERE state = 'dead'
)
SELECT
    (SELECT coalesce(sum(unsent), 0)::bigint FROM active) + (SELECT n FROM woken_unsent) - (SELECT n FROM dead),
    (SELECT n FROM dead),
    (SELECT count(*) FROM active WHERE state = 'dead'),
    (SELECT count(*) FROM active WHERE state = 'ready' AND claim_token IS NOT NULL AND lease_end > now()),
    (SELECT extract(epoch FROM now() - least((SELECT min(created_at) FROM oldest), (SELECT oldest FROM woken_unsent)))::float8),
    (SELECT coalesce(sum(unsent), 0)::bigint FROM active WHERE state = 'ready' AND NOT backing_off) + (SELECT n FROM woken_unsent),
    (SELECT coalesce(sum(unsent), 0)::bigint FROM active WHERE backing_off),
    (SELECT coalesce(sum(unsent), 0)::bigint FROM active WHERE state = 'dead'),
    (SELECT count(*) FROM active WHERE state = 'ready' AND retry_since IS NOT NULL),
    (SELECT extract(epoch FROM now() - least((SELECT min(created_at) FROM oldest WHERE state = 'ready' AND NOT backing_off),
                                             (SELECT oldest FROM woken_unsent)))::float8),
    -- Stranded: events written around the enqueue path (an insert that set
    -- aggregate_seq itself, recorded by outbox_guard_insert in
    -- outbox_unannounced, migrations/00038) still unsent after
    -- StrandedAfter, and no claim reaches them: no ready or dead head at or
    -- below them (none, or idle) and no wake-up for their aggregate. An event
    -- below its head's next_seq is sent (00030). O(such events): repair-heads
    -- and RebuildHeads clear the record; one primary-key probe each.
    (SELECT count(*) FROM outbox_unannounced u
     WHERE u.created_at < now() - interval '` + strandedAfterSQL + `'
       AND EXISTS (SELECT 1 FROM outbox o WHERE o.id = u.event_row AND o.state = 'pending' OFFSET 0)
       AND NOT EXISTS (SELECT 1 FROM outbox_heads h
                       WHERE h.aggregate_type = u.aggregate_type AND h.aggregate_id = u.aggregate_id
                         AND (h.state IN ('ready', 'dead') OR h.next_seq > u.aggregate_seq)
                       OFFSET 0) -- a primary-key probe per event, never a join that reads every head
       AND (u.aggregate_type, u.aggregate_id) NOT IN (SELECT w.aggregate_type, w.aggregate_id FROM outbox_wakeups w))`

// strandedAfterSQL is StrandedAfter as sqlStats writes it.
const strandedAfterSQL = "300 seconds"

// sqlPrune deletes sent (and discarded) events created (legacy 'sent' rows:
// sent) before $3 among the $2 rows after id $1, and returns how many it
// deleted, the last id it looked at (NULL: end of the table) and whether it
// saw a row younger than $3: outbox_prune (migrations/00038: the operations
// role has no DELETE on the outbox, so it cannot delete an event still to be
// published), whose statement says how.
const sqlPrune = `SELECT * FROM outbox_prune($1::bigint, $2::integer, $3::timestamptz)`

// sqlRequeueDead, sqlDiscardDead and sqlRebuildHeads are the operator's
// actions on dead events and heads (functions in migrations/00009;
// outbox_repair_heads, 00038, is outbox_rebuild_heads that also clears the
// record of events written around the enqueue path, now claimable).
// $1 event ids, $2 aggregate type (” for any), $3 since, $4 until, $5 reason.
const (
	sqlRequeueDead  = `SELECT outbox_requeue_dead($1::uuid[], $2::text, $3::timestamptz, $4::timestamptz)`
	sqlDiscardDead  = `SELECT outbox_discard_dead($1::uuid[], $2::text, $3::timestamptz, $4::timestamptz, $5::text)`
	sqlRebuildHeads = `SELECT outbox_repair_heads()`
)

// sqlExtendLease renews a batch's lease (outbox_extend_lease,
// migrations/00035_outbox_lease_renewal.sql): $1 token, $2 types, $3 ids,
// $4 lease in milliseconds. Returns how many heads the token still holds.
const sqlExtendLease = `SELECT outbox_extend_lease($1::uuid, $2::text[], $3::text[], $4::bigint)`

// sqlReleaseRuns gives a batch's heads back unrecorded, claimable at once
// (outbox_release_runs): $1 token, $2 types, $3 ids.
const sqlReleaseRuns = `SELECT outbox_release_runs($1::uuid, $2::text[], $3::text[])`

// sqlOldestTransaction reads the age in seconds of the oldest transaction
// holding back vacuum on the server, and whether every session was visible
// (fifobox_oldest_transaction, migrations/00035).
const sqlOldestTransaction = `SELECT age_seconds, sees_all FROM fifobox_oldest_transaction()`
