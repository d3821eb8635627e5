-- +goose Up

-- Two changes for aggregates with deep backlogs (issue 14).
--
-- outbox_mark_runs (00009) marked the published events through a join the
-- planner could turn around: for each claimed aggregate it read every unsent
-- event of that aggregate by the aggregate index and matched them against
-- the published ids. Beside a deep backlog that read the whole backlog per
-- mark (51,000 rows and 45 ms for a 1,000-event batch beside a 50,000-event
-- aggregate; TestClaimAndMarkReadOnlyTheirEvents). Now the published events
-- are fetched by primary key first (a materialized CTE the planner cannot
-- rewrite into a scan by aggregate), and only then checked against the runs
-- this claim still owns. Same signature and outcome; only the plan changes.
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

-- outbox_extend_run lengthens a run the caller's claim holds (token) when
-- its batch has room left: up to max_events more consecutive pending events
-- of the aggregate after after_seq, in sequence order, stopping before any
-- event that is not pending or not consecutive (as outbox_claim_heads does).
-- A claim gives each aggregate at most max_run events, a fair share while
-- aggregates compete for the batch; alone, a hot aggregate would otherwise
-- pay a claim and a mark per max_run events (issue 14: one aggregate with a
-- deep backlog ahead of everyone). Read-only: the head's lease (claim token)
-- already keeps other dispatchers off the aggregate, and the mark records
-- the run's end as it does for any run. Nothing comes back if the token no
-- longer holds the head (its lease expired and another claim took it).
-- +goose StatementBegin
CREATE FUNCTION outbox_extend_run(agg_type text, agg_id text, after_seq bigint, max_events integer, token uuid)
RETURNS TABLE (id bigint, event_id text, aggregate_seq bigint, event_type text, tenant_id text, traceparent text,
               attempts integer, body bytea)
LANGUAGE sql STABLE
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $extend$
SELECT r.id, r.event_id::text, r.aggregate_seq, r.event_type, coalesce(r.tenant_id, ''), coalesce(r.traceparent, ''),
       r.attempts, r.body
FROM (
    SELECT o.id, o.event_id, o.aggregate_seq, o.event_type, o.tenant_id, o.traceparent, o.attempts, o.body,
           row_number() OVER w AS rn,
           bool_and(o.state = 'pending') OVER w AS ok
    FROM outbox o
    WHERE o.aggregate_type = agg_type AND o.aggregate_id = agg_id
      AND o.aggregate_seq > after_seq AND o.state <> 'sent' AND o.state <> 'discarded'
      AND EXISTS (SELECT 1 FROM outbox_heads h
                  WHERE h.aggregate_type = agg_type AND h.aggregate_id = agg_id AND h.claim_token = token)
    WINDOW w AS (ORDER BY o.aggregate_seq)
    ORDER BY o.aggregate_seq
    LIMIT max_events
) r
WHERE r.ok AND r.aggregate_seq = after_seq + r.rn
ORDER BY r.aggregate_seq
$extend$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION outbox_extend_run(text, text, bigint, integer, uuid);
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
), sent AS (
    UPDATE outbox o SET state = 'sent', sent_at = now(), attempts = o.attempts + 1
    FROM unnest(sent_ids) AS s(id)
    WHERE o.id = s.id AND o.state = 'pending'
      AND EXISTS (SELECT 1 FROM own WHERE own.t = o.aggregate_type AND own.i = o.aggregate_id)
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
