-- +goose Up

-- The watermark (issue 28): a published event's row is never written again.
--
-- Before: marking a run published rewrote every event row to 'sent'. The
-- state column is in two partial indexes' predicates, so each of those
-- updates was a new ~1 KB row version plus new entries in every index, and a
-- dead version for vacuum: about 15 µs of PostgreSQL CPU per event
-- (make bench: one aggregate draining alone, where head writes are
-- negligible), and room left free on every page (fillfactor 50, 00007) for
-- the claim's updates to stay HOT.
--
-- Now an event is sent when its head has moved past it: every event of an
-- aggregate below outbox_heads.next_seq is sent (or discarded, or 'sent' as
-- written before this migration). A mark advances the head only; an event's
-- row changes only when publishing it fails (attempts, last_error, dead),
-- which is rare. So:
--   * the outbox is insert-only: pages are filled (fillfactor 100);
--   * the two indexes on state go: outbox_pending_idx (the claim reads
--     heads, not pending events) and outbox_unsent_aggregate_idx, replaced
--     by a unique index on (aggregate_type, aggregate_id, aggregate_seq):
--     a head's run is the range from next_seq on, and the key also refuses
--     a sequence number used twice (which the watermark would otherwise
--     count as sent the moment it is written);
--   * bodies are compressed in the row (lz4 where the server has it).
-- Readers that need an event's state (stats, prune, replay, the operator
-- commands, tests) derive it from the head: the view outbox_events.
--
-- A head row must therefore outlive its aggregate's events: heads are never
-- deleted (idle heads are cheap: no index holds them but the primary key).
--
-- The unique key is named as the producer guard migration names it
-- (IF NOT EXISTS: whichever runs first builds it). On a large existing
-- outbox build it first without blocking writers:
--   CREATE UNIQUE INDEX CONCURRENTLY outbox_aggregate_seq_key
--       ON outbox (aggregate_type, aggregate_id, aggregate_seq);
CREATE UNIQUE INDEX IF NOT EXISTS outbox_aggregate_seq_key ON outbox (aggregate_type, aggregate_id, aggregate_seq);
DROP INDEX IF EXISTS outbox_unsent_aggregate_idx;
DROP INDEX IF EXISTS outbox_pending_idx;

-- Storage: rows are written once, so pages are filled; bodies (about 500
-- bytes of JSON in make bench) are compressed in the row: storage MAIN keeps
-- a compressed body in the heap row instead of moving it to the TOAST table
-- (one more row and index entry per event), and toast_tuple_target makes
-- PostgreSQL try compression on rows above 128 bytes instead of ~2 KB.
-- Measured (make bench, ~470-byte bodies): see docs/performance.md. Only
-- rows written from now on are affected.
ALTER TABLE outbox SET (fillfactor = 100, toast_tuple_target = 128);
ALTER TABLE outbox ALTER COLUMN body SET STORAGE MAIN;
-- lz4 decompresses several times faster than pglz (the claim reads every
-- body); servers built without it keep pglz.
-- +goose StatementBegin
DO $lz4$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_settings WHERE name = 'default_toast_compression' AND 'lz4' = ANY (enumvals)) THEN
        ALTER TABLE outbox ALTER COLUMN body SET COMPRESSION lz4;
    END IF;
END
$lz4$;
-- +goose StatementEnd

-- outbox_mark_runs: as in 00012, with three changes.
--   * The published events' rows are not written: moving the head to
--     next_seq is what marks them sent (sent_ids stays in the signature for
--     dispatchers of the previous version, and is ignored).
--   * A head with more events waiting is due now, not when its next event
--     was enqueued (below).
--   * Heads are not locked in a statement of their own before being
--     updated: the update takes the row locks (in key order: u is sorted
--     and drives the join, the order every writer of heads locks in) and
--     checks the token on the locked row; the failed event is written only
--     for runs whose head it recorded. One row lock less per run (make
--     bench: the mark's CPU per event at 2 events per aggregate fell ~20 %).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_mark_runs(token uuid, types text[], ids text[], seen_wakes bigint[], next_seqs bigint[],
                                 outcomes text[], delays_ms bigint[], errors text[], fail_ids bigint[], sent_ids bigint[])
RETURNS bigint
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $mark$
WITH u AS MATERIALIZED (
    SELECT * FROM unnest(types, ids, seen_wakes, next_seqs, outcomes, delays_ms, errors, fail_ids)
        AS u(t, i, w, next_seq, outcome, delay_ms, err, fail_id)
    ORDER BY t, i
), heads AS (
    UPDATE outbox_heads h
    SET next_seq = u.next_seq,
        claim_token = NULL,
        state = CASE
            WHEN u.outcome = 'dead' THEN 'dead'
            WHEN u.outcome IN ('retry', 'released') THEN 'ready'
            WHEN h.wakes = u.w AND nxt.more IS NULL THEN 'idle'
            ELSE 'ready' END,
        -- A head with more to publish goes to the back of the due line
        -- (due now), behind every head already waiting: round robin. Before
        -- (00009), it was due when its next event was enqueued, so a few
        -- aggregates with old, deep backlogs stayed at the front and filled
        -- whole batches while everyone else waited (issue 28: the other
        -- aggregates at 0.45-0.52 x their rate).
        due_at = CASE WHEN u.outcome = 'retry' THEN now() + make_interval(secs => u.delay_ms / 1000.0)
                      ELSE now() END,
        retry_since = CASE WHEN u.outcome = 'retry' THEN coalesce(h.retry_since, now())
                           WHEN u.outcome = 'released' THEN h.retry_since END
    FROM u
    LEFT JOIN LATERAL (
        SELECT 1 AS more FROM outbox o
        WHERE o.aggregate_type = u.t AND o.aggregate_id = u.i
          AND o.aggregate_seq >= u.next_seq AND o.state <> 'sent' AND o.state <> 'discarded'
        LIMIT 1
    ) nxt ON true
    WHERE h.aggregate_type = u.t AND h.aggregate_id = u.i AND h.claim_token = token
    RETURNING u.outcome, u.err, u.fail_id
), failed AS (
    -- Only runs whose head this statement recorded (and holds locked):
    -- a run whose lease another claim took over is not this one's to fail.
    UPDATE outbox o
    SET attempts = o.attempts + 1,
        last_error = heads.err,
        state = CASE WHEN heads.outcome = 'dead' THEN 'dead' ELSE o.state END
    FROM heads
    WHERE heads.outcome IN ('retry', 'dead') AND o.id = heads.fail_id AND o.state = 'pending'
    RETURNING 1
)
SELECT count(*) FROM heads
$mark$;
-- +goose StatementEnd

-- outbox_rebuild_heads: as in 00009, but a head only ever moves forward:
-- events below an existing head's next_seq are sent, whatever their row
-- says, so the lowest unsent event is looked for from next_seq on.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_rebuild_heads() RETURNS bigint
LANGUAGE sql VOLATILE AS $rebuild$
WITH low AS (
    SELECT DISTINCT ON (o.aggregate_type, o.aggregate_id)
           o.aggregate_type, o.aggregate_id, o.aggregate_seq, o.state, o.next_attempt_at
    FROM outbox o
    LEFT JOIN outbox_heads h ON h.aggregate_type = o.aggregate_type AND h.aggregate_id = o.aggregate_id
    WHERE o.state IN ('pending', 'dead') AND o.aggregate_seq >= coalesce(h.next_seq, 0)
    ORDER BY o.aggregate_type, o.aggregate_id, o.aggregate_seq
), upserted AS (
    INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, next_seq, state, due_at)
    SELECT aggregate_type, aggregate_id, aggregate_seq,
           CASE WHEN state = 'dead' THEN 'dead' ELSE 'ready' END,
           next_attempt_at
    FROM low
    ORDER BY aggregate_type, aggregate_id
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
    SET next_seq = greatest(h.next_seq, EXCLUDED.next_seq), state = EXCLUDED.state,
        due_at = CASE WHEN h.state = 'ready' THEN h.due_at ELSE EXCLUDED.due_at END,
        wakes = h.wakes + 1
    WHERE h.claim_token IS NULL OR h.due_at <= now()
    RETURNING 1
)
SELECT count(*) FROM upserted
$rebuild$;
-- +goose StatementEnd

-- outbox_events: the outbox as operators and tests read it, each event with
-- its state derived from its head ('sent' below the watermark). attempts
-- counts the successful publish too, as the rows written before this
-- migration did; sent_at is only known for those rows (and discarded ones).
CREATE VIEW outbox_events AS
SELECT o.id, o.event_id, o.event_type, o.aggregate_type, o.aggregate_id, o.aggregate_seq, o.tenant_id,
       o.traceparent, o.occurred_at, o.body,
       CASE WHEN o.state = 'pending' AND o.aggregate_seq < h.next_seq THEN 'sent' ELSE o.state END AS state,
       o.attempts + (o.state = 'pending' AND o.aggregate_seq < h.next_seq)::integer AS attempts,
       o.next_attempt_at, o.claim_token, o.last_error, o.created_at, o.sent_at
FROM outbox o
LEFT JOIN outbox_heads h ON h.aggregate_type = o.aggregate_type AND h.aggregate_id = o.aggregate_id;

GRANT SELECT ON outbox_events TO fifobox_dispatcher, fifobox_operations;

-- +goose Down
DROP VIEW outbox_events;
ALTER TABLE outbox ALTER COLUMN body SET STORAGE EXTENDED;
ALTER TABLE outbox ALTER COLUMN body SET COMPRESSION default;
ALTER TABLE outbox RESET (toast_tuple_target);
ALTER TABLE outbox SET (fillfactor = 50);
-- Rows below each head's watermark become 'sent' again, as the previous
-- version expects.
UPDATE outbox o SET state = 'sent', attempts = o.attempts + 1
FROM outbox_heads h
WHERE h.aggregate_type = o.aggregate_type AND h.aggregate_id = o.aggregate_id
  AND o.state = 'pending' AND o.aggregate_seq < h.next_seq;
CREATE INDEX outbox_pending_idx ON outbox (id) WHERE state = 'pending';
CREATE INDEX outbox_unsent_aggregate_idx ON outbox (aggregate_type, aggregate_id, aggregate_seq) WHERE state <> 'sent';
-- The previous mark (00012) and rebuild (00009).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_mark_runs(token uuid, types text[], ids text[], seen_wakes bigint[], next_seqs bigint[],
                                 outcomes text[], delays_ms bigint[], errors text[], fail_ids bigint[], sent_ids bigint[])
RETURNS bigint
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $mark$
WITH u AS (
    SELECT * FROM unnest(types, ids, seen_wakes, next_seqs, outcomes, delays_ms, errors, fail_ids)
        AS u(t, i, w, next_seq, outcome, delay_ms, err, fail_id)
), own AS MATERIALIZED (
    SELECT u.* FROM outbox_heads h JOIN u ON h.aggregate_type = u.t AND h.aggregate_id = u.i
    WHERE h.claim_token = token
    ORDER BY h.aggregate_type, h.aggregate_id
    FOR NO KEY UPDATE OF h
), published AS MATERIALIZED (
    -- Each published event by its id (primary key), with its aggregate.
    SELECT o.id, o.aggregate_type AS t, o.aggregate_id AS i
    FROM unnest(sent_ids) AS s(id) JOIN outbox o ON o.id = s.id
), sent AS (
    UPDATE outbox o SET state = 'sent', sent_at = now(), attempts = o.attempts + 1
    FROM published p JOIN own ON own.t = p.t AND own.i = p.i
    WHERE o.id = p.id AND o.state = 'pending'
    RETURNING 1
), failed AS (
    UPDATE outbox o
    SET attempts = o.attempts + 1,
        last_error = own.err,
        state = CASE WHEN own.outcome = 'dead' THEN 'dead' ELSE o.state END
    FROM own
    WHERE own.outcome IN ('retry', 'dead') AND o.id = own.fail_id AND o.state = 'pending'
    RETURNING 1
), heads AS (
    UPDATE outbox_heads h
    SET next_seq = own.next_seq,
        claim_token = NULL,
        state = CASE
            WHEN own.outcome = 'dead' THEN 'dead'
            WHEN own.outcome IN ('retry', 'released') THEN 'ready'
            WHEN h.wakes = own.w AND nxt.created_at IS NULL THEN 'idle'
            ELSE 'ready' END,
        -- Due order is the age of the head's next event: an aggregate with
        -- an old backlog (a hot one) keeps its turn at the front, instead of
        -- queueing behind every head that became due since.
        due_at = CASE WHEN own.outcome = 'retry' THEN now() + make_interval(secs => own.delay_ms / 1000.0)
                      ELSE least(coalesce(nxt.created_at, now()), now()) END,
        retry_since = CASE WHEN own.outcome = 'retry' THEN coalesce(h.retry_since, now())
                           WHEN own.outcome = 'released' THEN h.retry_since END
    FROM own
    LEFT JOIN LATERAL (
        SELECT o.created_at FROM outbox o
        WHERE o.aggregate_type = own.t AND o.aggregate_id = own.i
          AND o.aggregate_seq >= own.next_seq AND o.state <> 'sent' AND o.state <> 'discarded'
        ORDER BY o.aggregate_seq LIMIT 1
    ) nxt ON true
    WHERE h.aggregate_type = own.t AND h.aggregate_id = own.i
    RETURNING 1
)
SELECT count(*) FROM heads
$mark$;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_rebuild_heads() RETURNS bigint
LANGUAGE sql VOLATILE AS $rebuild$
WITH low AS (
    SELECT DISTINCT ON (o.aggregate_type, o.aggregate_id)
           o.aggregate_type, o.aggregate_id, o.aggregate_seq, o.state, o.next_attempt_at, o.claim_token
    FROM outbox o
    WHERE o.state IN ('pending', 'dead')
    ORDER BY o.aggregate_type, o.aggregate_id, o.aggregate_seq
), upserted AS (
    INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, next_seq, state, due_at)
    SELECT aggregate_type, aggregate_id, aggregate_seq,
           CASE WHEN state = 'dead' THEN 'dead' ELSE 'ready' END,
           -- The previous version kept the schedule on the event: a lease's
           -- end while claimed (a dispatcher of that version keeps it until
           -- then), the backoff's end while retrying.
           next_attempt_at
    FROM low
    ORDER BY aggregate_type, aggregate_id
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
    SET next_seq = EXCLUDED.next_seq, state = EXCLUDED.state,
        due_at = CASE WHEN h.state = 'ready' THEN h.due_at ELSE EXCLUDED.due_at END,
        wakes = h.wakes + 1
    WHERE h.claim_token IS NULL OR h.due_at <= now()
    RETURNING 1
)
SELECT count(*) FROM upserted
$rebuild$;
-- +goose StatementEnd
