-- +goose Up

-- Retiring empty heads never waits for a head lock (issue 28).
--
-- outbox_idle_heads (00009) locked the heads it retires in key order and
-- waited for any head another statement held. It now runs after its batch
-- is published, beside the other workers' claims and marks, and the torture
-- test saw PostgreSQL break a deadlock between it and a claim's wake-up
-- step; the marks queued behind those locks ran out of MarkTimeout and
-- their runs were published again. Idling is bookkeeping: a head someone
-- else holds is skipped and stays ready, and the next claim that finds it
-- empty retires it then. A skipped head is never stranded (it stays
-- claimable), so skipping costs at most one empty claim.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_idle_heads(types text[], ids text[], seen_wakes bigint[]) RETURNS bigint
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off AS $idle$
WITH u AS (
    SELECT * FROM unnest(types, ids, seen_wakes) AS u(t, i, w)
), locked AS (
    SELECT h.aggregate_type, h.aggregate_id FROM outbox_heads h JOIN u ON h.aggregate_type = u.t AND h.aggregate_id = u.i
    ORDER BY h.aggregate_type, h.aggregate_id
    FOR NO KEY UPDATE OF h SKIP LOCKED
), idled AS (
    UPDATE outbox_heads h SET state = 'idle', claim_token = NULL
    FROM u, locked l
    WHERE h.aggregate_type = u.t AND h.aggregate_id = u.i
      AND l.aggregate_type = u.t AND l.aggregate_id = u.i
      AND h.state = 'ready' AND h.claim_token IS NULL AND h.wakes = u.w
      AND NOT EXISTS (SELECT 1 FROM outbox o
                      WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                        AND o.aggregate_seq >= h.next_seq AND o.state <> 'sent' AND o.state <> 'discarded')
    RETURNING 1
)
SELECT count(*) FROM idled
$idle$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_idle_heads(types text[], ids text[], seen_wakes bigint[]) RETURNS bigint
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off AS $idle$
WITH u AS (
    SELECT * FROM unnest(types, ids, seen_wakes) AS u(t, i, w)
), locked AS (
    SELECT h.aggregate_type, h.aggregate_id FROM outbox_heads h JOIN u ON h.aggregate_type = u.t AND h.aggregate_id = u.i
    ORDER BY h.aggregate_type, h.aggregate_id
    FOR NO KEY UPDATE OF h
), idled AS (
    UPDATE outbox_heads h SET state = 'idle', claim_token = NULL
    FROM u, locked l
    WHERE h.aggregate_type = u.t AND h.aggregate_id = u.i
      AND l.aggregate_type = u.t AND l.aggregate_id = u.i
      AND h.state = 'ready' AND h.claim_token IS NULL AND h.wakes = u.w
      AND NOT EXISTS (SELECT 1 FROM outbox o
                      WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                        AND o.aggregate_seq >= h.next_seq AND o.state <> 'sent' AND o.state <> 'discarded')
    RETURNING 1
)
SELECT count(*) FROM idled
$idle$;
-- +goose StatementEnd
