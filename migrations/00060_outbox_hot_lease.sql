-- +goose Up

-- A claim's lease leaves the head's index entries alone (issue 28: database
-- cost per event).
--
-- Before, a claimed head kept its lease's end in due_at. due_at is the key
-- of outbox_heads_due_idx, so every claim's write of a head was a non-HOT
-- update: a new row version plus a new entry in the primary key and in the
-- due index, for every head of every batch (at 2 events per aggregate, one
-- head per 2 events). Now the lease's end is in lease_until, which no index
-- holds: the claim changes claim_token, lease_until and expired_leases
-- only, so PostgreSQL updates the head in place on its page (HOT: no index
-- entry, and page pruning reclaims the old version without vacuum).
-- Renewing a lease (outbox_extend_lease) is HOT too.
--
-- What it costs: a leased head keeps its place in the due index (its due_at
-- does not move while it is leased), so a claim steps over the heads other
-- batches hold (one heap probe each, filtered on claim_token/lease_until)
-- before it reaches claimable ones: at most the heads in flight (Workers x
-- heads per batch, per dispatcher), never the backlog behind them. The claim
-- reads the same outbox rows as before (1 per claimed event). Measured: see
-- docs/performance.md "Database cost per event".
--
-- A head is leased while claim_token is set and lease_until (for a head a
-- previous version claimed, which kept the lease in due_at: due_at) is in
-- the future. The mark, a release and the crash path (lease expiry) work as
-- before; a head whose lease ran out is claimed at its old due_at, ahead of
-- heads that became due since, where it was waiting before it was claimed.
ALTER TABLE outbox_heads ADD COLUMN lease_until timestamptz;

-- A HOT update needs room on the row's own page, and a claim updates heads
-- that became due together, which are mostly heads written together: whole
-- pages at once, before any old version on them is dead. At fillfactor 70
-- (00009) a page had room for about 40 % of its rows' new versions: a claim
-- of 500 heads at 2 events per aggregate made 35 % of its updates HOT.
-- At 40 every row of a page can get a new version (measured 100 % HOT), and
-- page pruning makes the room again for the next cycle. Heads are small
-- (one per aggregate): the table about doubles. Pages written from now on get it
-- (VACUUM FULL outbox_heads applies it to an existing table).
ALTER TABLE outbox_heads SET (fillfactor = 40);

-- outbox_claim_heads: as in 00009, but the lease goes to lease_until and
-- leased heads are skipped by a filter instead of by their due_at.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_claim_heads(max_events integer, max_run integer, token uuid, lease_ms bigint)
RETURNS TABLE (kind text, id bigint, event_id text, aggregate_type text, aggregate_id text, aggregate_seq bigint,
               event_type text, tenant_id text, traceparent text, attempts integer, body bytea,
               head_wakes bigint, retrying_ms bigint)
LANGUAGE sql VOLATILE
-- $1 max_events, $2 max_run, $3 token, $4 lease_ms (positional, so diagnostics can
-- EXPLAIN the body as it is: pkg/outbox/explain.go)
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $claim$
-- h has no LIMIT of its own: ev pulls heads one by one until it has $1
-- rows, so a head another claim leased a moment ago (skipped, or rejected
-- when PostgreSQL re-checks the updated row) does not use up a place.
WITH h AS MATERIALIZED (
    SELECT oh.aggregate_type, oh.aggregate_id, oh.next_seq, oh.wakes, oh.retry_since, oh.due_at
    FROM outbox_heads oh
    WHERE oh.state = 'ready' AND oh.due_at <= now()
      -- Not leased (a claimed head keeps its due_at: see the migration).
      AND (oh.claim_token IS NULL OR oh.lease_until IS NULL OR oh.lease_until <= now())
    ORDER BY oh.due_at
    FOR NO KEY UPDATE SKIP LOCKED
), ev AS MATERIALIZED (
    SELECT h.aggregate_type AS h_type, h.aggregate_id AS h_id, h.wakes AS h_wakes, h.due_at AS h_due,
           (extract(epoch FROM now() - h.retry_since) * 1000)::bigint AS h_retrying_ms,
           r.*
    FROM h
    LEFT JOIN LATERAL (
        SELECT o.id AS o_id, o.event_id AS o_event_id, o.aggregate_seq AS o_seq, o.state AS o_state,
               o.event_type AS o_type, o.tenant_id AS o_tenant, o.traceparent AS o_traceparent,
               o.attempts AS o_attempts, o.body AS o_body,
               row_number() OVER w AS rn,
               -- Still consecutive and pending from the run's first event?
               bool_and(o.state = 'pending') OVER w
                 AND o.aggregate_seq - first_value(o.aggregate_seq) OVER w = row_number() OVER w - 1 AS o_ok
        FROM outbox o
        WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
          AND o.aggregate_seq >= h.next_seq AND o.state <> 'sent' AND o.state <> 'discarded'
        WINDOW w AS (ORDER BY o.aggregate_seq)
        ORDER BY o.aggregate_seq
        LIMIT $2
    ) r ON true
    LIMIT $1
), claimed AS (
    UPDATE outbox_heads t
    SET claim_token = $3,
        lease_until = now() + make_interval(secs => $4 / 1000.0),
        expired_leases = t.expired_leases + (t.claim_token IS NOT NULL)::integer
    FROM (SELECT DISTINCT h_type, h_id FROM ev WHERE rn = 1 AND o_ok) k
    WHERE t.aggregate_type = k.h_type AND t.aggregate_id = k.h_id
    RETURNING 1
), parked AS (
    UPDATE outbox_heads t
    SET state = 'dead', next_seq = ev.o_seq, claim_token = NULL
    FROM ev
    WHERE ev.rn = 1 AND ev.o_state = 'dead' AND t.aggregate_type = ev.h_type AND t.aggregate_id = ev.h_id
    RETURNING 1
)
SELECT CASE WHEN ev.o_id IS NULL THEN 'empty' WHEN ev.o_ok THEN 'event' ELSE 'dead' END,
       ev.o_id, ev.o_event_id::text, ev.h_type, ev.h_id, ev.o_seq,
       ev.o_type, coalesce(ev.o_tenant, ''), coalesce(ev.o_traceparent, ''), ev.o_attempts, ev.o_body,
       ev.h_wakes, ev.h_retrying_ms
FROM ev
WHERE ev.o_id IS NULL OR ev.o_ok OR (ev.rn = 1 AND ev.o_state = 'dead')
ORDER BY ev.h_due, ev.h_type, ev.h_id, ev.o_seq
$claim$;
-- +goose StatementEnd

-- outbox_mark_runs: as in 00030; it also clears lease_until.
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
        lease_until = NULL,
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

-- outbox_rebuild_heads: as in 00030; a head is claimed now while its lease
-- (lease_until, or due_at for a head a previous version claimed) runs.
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
    WHERE h.claim_token IS NULL OR coalesce(h.lease_until, h.due_at) <= now()
    RETURNING 1
)
SELECT count(*) FROM upserted
$rebuild$;
-- +goose StatementEnd

-- outbox_extend_lease and outbox_release_runs: as in 00035, on lease_until.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_extend_lease(token uuid, types text[], ids text[], lease_ms bigint) RETURNS bigint
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $extend$
WITH own AS MATERIALIZED (
    SELECT h.aggregate_type, h.aggregate_id
    FROM outbox_heads h JOIN unnest(types, ids) AS u(t, i) ON h.aggregate_type = u.t AND h.aggregate_id = u.i
    WHERE h.claim_token = token
    ORDER BY h.aggregate_type, h.aggregate_id
    FOR NO KEY UPDATE OF h
), extended AS (
    UPDATE outbox_heads h
    SET lease_until = greatest(coalesce(h.lease_until, h.due_at), now() + make_interval(secs => lease_ms / 1000.0))
    FROM own
    WHERE h.aggregate_type = own.aggregate_type AND h.aggregate_id = own.aggregate_id AND h.claim_token = token
    RETURNING 1
)
SELECT count(*) FROM extended
$extend$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_release_runs(token uuid, types text[], ids text[]) RETURNS bigint
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $release$
WITH own AS MATERIALIZED (
    SELECT h.aggregate_type, h.aggregate_id
    FROM outbox_heads h JOIN unnest(types, ids) AS u(t, i) ON h.aggregate_type = u.t AND h.aggregate_id = u.i
    WHERE h.claim_token = token
    ORDER BY h.aggregate_type, h.aggregate_id
    FOR NO KEY UPDATE OF h
), released AS (
    UPDATE outbox_heads h
    SET claim_token = NULL, lease_until = NULL, due_at = now()
    FROM own
    WHERE h.aggregate_type = own.aggregate_type AND h.aggregate_id = own.aggregate_id AND h.claim_token = token
    RETURNING 1
)
SELECT count(*) FROM released
$release$;
-- +goose StatementEnd

-- +goose Down
-- Heads leased now keep their lease in due_at, as the previous version reads it.
UPDATE outbox_heads SET due_at = lease_until WHERE claim_token IS NOT NULL AND lease_until IS NOT NULL;
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_claim_heads(max_events integer, max_run integer, token uuid, lease_ms bigint)
RETURNS TABLE (kind text, id bigint, event_id text, aggregate_type text, aggregate_id text, aggregate_seq bigint,
               event_type text, tenant_id text, traceparent text, attempts integer, body bytea,
               head_wakes bigint, retrying_ms bigint)
LANGUAGE sql VOLATILE
-- $1 max_events, $2 max_run, $3 token, $4 lease_ms (positional, so diagnostics can
-- EXPLAIN the body as it is: pkg/outbox/explain.go)
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $claim$
-- h has no LIMIT of its own: ev pulls heads one by one until it has $1
-- rows, so a head another claim leased a moment ago (skipped, or rejected
-- when PostgreSQL re-checks the updated row) does not use up a place.
WITH h AS MATERIALIZED (
    SELECT oh.aggregate_type, oh.aggregate_id, oh.next_seq, oh.wakes, oh.retry_since, oh.due_at
    FROM outbox_heads oh
    WHERE oh.state = 'ready' AND oh.due_at <= now()
    ORDER BY oh.due_at
    FOR NO KEY UPDATE SKIP LOCKED
), ev AS MATERIALIZED (
    SELECT h.aggregate_type AS h_type, h.aggregate_id AS h_id, h.wakes AS h_wakes, h.due_at AS h_due,
           (extract(epoch FROM now() - h.retry_since) * 1000)::bigint AS h_retrying_ms,
           r.*
    FROM h
    LEFT JOIN LATERAL (
        SELECT o.id AS o_id, o.event_id AS o_event_id, o.aggregate_seq AS o_seq, o.state AS o_state,
               o.event_type AS o_type, o.tenant_id AS o_tenant, o.traceparent AS o_traceparent,
               o.attempts AS o_attempts, o.body AS o_body,
               row_number() OVER w AS rn,
               -- Still consecutive and pending from the run's first event?
               bool_and(o.state = 'pending') OVER w
                 AND o.aggregate_seq - first_value(o.aggregate_seq) OVER w = row_number() OVER w - 1 AS o_ok
        FROM outbox o
        WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
          AND o.aggregate_seq >= h.next_seq AND o.state <> 'sent' AND o.state <> 'discarded'
        WINDOW w AS (ORDER BY o.aggregate_seq)
        ORDER BY o.aggregate_seq
        LIMIT $2
    ) r ON true
    LIMIT $1
), claimed AS (
    UPDATE outbox_heads t
    SET claim_token = $3,
        due_at = now() + make_interval(secs => $4 / 1000.0),
        expired_leases = t.expired_leases + (t.claim_token IS NOT NULL)::integer
    FROM (SELECT DISTINCT h_type, h_id FROM ev WHERE rn = 1 AND o_ok) k
    WHERE t.aggregate_type = k.h_type AND t.aggregate_id = k.h_id
    RETURNING 1
), parked AS (
    UPDATE outbox_heads t
    SET state = 'dead', next_seq = ev.o_seq, claim_token = NULL
    FROM ev
    WHERE ev.rn = 1 AND ev.o_state = 'dead' AND t.aggregate_type = ev.h_type AND t.aggregate_id = ev.h_id
    RETURNING 1
)
SELECT CASE WHEN ev.o_id IS NULL THEN 'empty' WHEN ev.o_ok THEN 'event' ELSE 'dead' END,
       ev.o_id, ev.o_event_id::text, ev.h_type, ev.h_id, ev.o_seq,
       ev.o_type, coalesce(ev.o_tenant, ''), coalesce(ev.o_traceparent, ''), ev.o_attempts, ev.o_body,
       ev.h_wakes, ev.h_retrying_ms
FROM ev
WHERE ev.o_id IS NULL OR ev.o_ok OR (ev.rn = 1 AND ev.o_state = 'dead')
ORDER BY ev.h_due, ev.h_type, ev.h_id, ev.o_seq
$claim$;
-- +goose StatementEnd
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
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_extend_lease(token uuid, types text[], ids text[], lease_ms bigint) RETURNS bigint
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $extend$
WITH own AS MATERIALIZED (
    SELECT h.aggregate_type, h.aggregate_id
    FROM outbox_heads h JOIN unnest(types, ids) AS u(t, i) ON h.aggregate_type = u.t AND h.aggregate_id = u.i
    WHERE h.claim_token = token
    ORDER BY h.aggregate_type, h.aggregate_id
    FOR NO KEY UPDATE OF h
), extended AS (
    UPDATE outbox_heads h
    SET due_at = greatest(h.due_at, now() + make_interval(secs => lease_ms / 1000.0))
    FROM own
    WHERE h.aggregate_type = own.aggregate_type AND h.aggregate_id = own.aggregate_id AND h.claim_token = token
    RETURNING 1
)
SELECT count(*) FROM extended
$extend$;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_release_runs(token uuid, types text[], ids text[]) RETURNS bigint
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $release$
WITH own AS MATERIALIZED (
    SELECT h.aggregate_type, h.aggregate_id
    FROM outbox_heads h JOIN unnest(types, ids) AS u(t, i) ON h.aggregate_type = u.t AND h.aggregate_id = u.i
    WHERE h.claim_token = token
    ORDER BY h.aggregate_type, h.aggregate_id
    FOR NO KEY UPDATE OF h
), released AS (
    UPDATE outbox_heads h
    SET claim_token = NULL, due_at = now()
    FROM own
    WHERE h.aggregate_type = own.aggregate_type AND h.aggregate_id = own.aggregate_id AND h.claim_token = token
    RETURNING 1
)
SELECT count(*) FROM released
$release$;
-- +goose StatementEnd
ALTER TABLE outbox_heads DROP COLUMN lease_until;
ALTER TABLE outbox_heads SET (fillfactor = 70);
