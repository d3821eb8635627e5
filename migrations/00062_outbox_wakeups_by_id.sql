-- +goose Up

-- The wake-up step deletes the wake-ups it locked by their ids (issue 28:
-- long transactions).
--
-- `DELETE ... WHERE id IN (SELECT id ... ORDER BY id LIMIT n FOR UPDATE SKIP
-- LOCKED)` was planned as a hash semi join: the subquery walks the wake-ups'
-- primary key from its start to lock n rows, and the DELETE walked the whole
-- key a second time to find them. Deleted wake-ups stay in the key as dead
-- entries while any transaction on the server is older than them, so at the
-- end of a 5-minute hold (BenchmarkLongTransaction, 88,000 dead wake-ups)
-- each walk took about 0.2-0.3 s of a 1.1 s wake-up step. The ids now go
-- through an array: the DELETE probes the key once per locked id.

-- outbox_consume_wakeups: as in 00061, deleting by `id = ANY(ARRAY(...))`.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_consume_wakeups(max_wakeups integer) RETURNS bigint
LANGUAGE sql VOLATILE
-- Index probes only, whatever the statistics (a generic plan once chose a
-- sequential scan of the outbox for a one-row probe).
SET enable_seqscan = off
SET enable_bitmapscan = off AS $wake$
WITH consumed AS (
    DELETE FROM outbox_wakeups w
    WHERE w.id = ANY (ARRAY(SELECT id FROM outbox_wakeups ORDER BY id LIMIT max_wakeups FOR UPDATE SKIP LOCKED))
    RETURNING w.aggregate_type, w.aggregate_id
), agg AS (
    SELECT DISTINCT aggregate_type, aggregate_id FROM consumed
), upserted AS (
    INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, next_seq)
    SELECT a.aggregate_type, a.aggregate_id,
           coalesce((SELECT min(o.aggregate_seq) FROM outbox o
                     WHERE o.aggregate_type = a.aggregate_type AND o.aggregate_id = a.aggregate_id
                       AND o.state <> 'sent' AND o.state <> 'discarded'), 0)
    FROM agg a
    ORDER BY a.aggregate_type, a.aggregate_id
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
    SET wakes = h.wakes + 1, state = 'ready', due_at = now()
    -- A head that is not idle is only locked (see 00061): ON CONFLICT DO
    -- UPDATE locks the row whether or not WHERE holds.
    WHERE h.state = 'idle'
    RETURNING 1
)
SELECT count(*) FROM upserted
$wake$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_consume_wakeups(max_wakeups integer) RETURNS bigint
LANGUAGE sql VOLATILE
-- Index probes only, whatever the statistics (a generic plan once chose a
-- sequential scan of the outbox for a one-row probe).
SET enable_seqscan = off
SET enable_bitmapscan = off AS $wake$
WITH consumed AS (
    DELETE FROM outbox_wakeups w
    WHERE w.id IN (SELECT id FROM outbox_wakeups ORDER BY id LIMIT max_wakeups FOR UPDATE SKIP LOCKED)
    RETURNING w.aggregate_type, w.aggregate_id
), agg AS (
    SELECT DISTINCT aggregate_type, aggregate_id FROM consumed
), upserted AS (
    INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, next_seq)
    SELECT a.aggregate_type, a.aggregate_id,
           coalesce((SELECT min(o.aggregate_seq) FROM outbox o
                     WHERE o.aggregate_type = a.aggregate_type AND o.aggregate_id = a.aggregate_id
                       AND o.state <> 'sent' AND o.state <> 'discarded'), 0)
    FROM agg a
    ORDER BY a.aggregate_type, a.aggregate_id
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
    SET wakes = h.wakes + 1, state = 'ready', due_at = now()
    -- A head that is not idle is only locked (see above): ON CONFLICT DO
    -- UPDATE locks the row whether or not WHERE holds.
    WHERE h.state = 'idle'
    RETURNING 1
)
SELECT count(*) FROM upserted
$wake$;
-- +goose StatementEnd
