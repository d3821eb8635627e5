-- +goose Up

-- The mark finds its heads one primary-key probe per run again (issue 28:
-- the parked shape, every head of a batch idled, at 0.65-0.79 x uniform).
--
-- Since 00061 the mark is plpgsql with custom plans, so its statement is
-- planned with the claim token as a constant. The heads' statistics say
-- claim_token is NULL on (nearly) every row, so `h.claim_token = token` was
-- estimated to match one head, and the planner read the whole primary key
-- of outbox_heads with that filter as the outer side of a nested loop whose
-- inner side scanned all of the batch's runs for every head it found: runs x
-- runs comparisons. Measured (EXPLAIN ANALYZE, 20,000 heads, a batch of
-- 1,000 runs of one event): 235 ms for the UPDATE, against 11 ms with 00053's
-- plan (the runs outer, one key probe each). At 5 events per aggregate a
-- batch has 200 runs and the square is 25 x smaller, so only shapes with many
-- short runs per batch paid it. The token now comes from the runs' side of
-- the join (a column of u): the condition is a join clause and the heads
-- are not estimated as one row on their own. Merge and hash joins are off in
-- the function: with the estimate fixed, the planner chose a merge join that
-- walked the heads' key from its start (16,000 of 20,000 entries for a batch
-- of 1,000), linear in the heads, where production has millions. Now it
-- probes the key once per run whatever the statistics say. Nothing else
-- changes.
--
-- outbox_idle_heads had the same plans (a batch of 1,000 empty heads over
-- 20,000: the lock statement a merge join walking 14,000 entries of the
-- heads' key, the decision a hash join over 17,000 entries of the due
-- index): it gets the same settings.

-- outbox_mark_runs: as in 00061; the token is compared through u.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_mark_runs(token uuid, types text[], ids text[], seen_wakes bigint[], next_seqs bigint[],
                                 outcomes text[], delays_ms bigint[], errors text[], fail_ids bigint[], sent_ids bigint[])
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
-- Probes, never a merge or hash join that reads every head (see above).
SET enable_mergejoin = off
SET enable_hashjoin = off
SET plan_cache_mode = force_custom_plan
AS $mark$
DECLARE
    recorded bigint;
    idle_types text[];
    idle_ids text[];
    idle_next bigint[];
BEGIN
    WITH u AS MATERIALIZED (
        -- The token rides along as a column of u (see above).
        SELECT u.*, token AS tok
        FROM unnest(types, ids, seen_wakes, next_seqs, outcomes, delays_ms, errors, fail_ids)
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
        WHERE h.aggregate_type = u.t AND h.aggregate_id = u.i AND h.claim_token = u.tok
        RETURNING u.t, u.i, u.next_seq, h.state = 'idle' AS idled, u.outcome, u.err, u.fail_id
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
    SELECT count(*), array_agg(heads.t) FILTER (WHERE heads.idled), array_agg(heads.i) FILTER (WHERE heads.idled),
           array_agg(heads.next_seq) FILTER (WHERE heads.idled)
    INTO recorded, idle_types, idle_ids, idle_next
    FROM heads;
    -- The heads just idled, looked at again with a snapshot taken after
    -- their locks were granted (this statement's): one with an unsent event
    -- is made ready again (see above). One probe of the outbox's key per
    -- idled head; a head is written only if the race happened.
    -- (A LATERAL probe with LIMIT, not EXISTS: the planner turned EXISTS
    -- into a semi join that cost ~17 ms a call.)
    IF idle_types IS NOT NULL THEN
        SELECT array_agg(x.t), array_agg(x.i) INTO idle_types, idle_ids
        FROM unnest(idle_types, idle_ids, idle_next) AS x(t, i, s)
        CROSS JOIN LATERAL (SELECT 1 FROM outbox o
                            WHERE o.aggregate_type = x.t AND o.aggregate_id = x.i AND o.aggregate_seq >= x.s
                              AND o.state <> 'sent' AND o.state <> 'discarded'
                            LIMIT 1) e;
    END IF;
    IF idle_types IS NOT NULL THEN
        UPDATE outbox_heads h SET state = 'ready', due_at = now(), wakes = h.wakes + 1
        FROM unnest(idle_types, idle_ids) AS x(t, i)
        WHERE h.aggregate_type = x.t AND h.aggregate_id = x.i AND h.state = 'idle';
    END IF;
    RETURN recorded;
END
$mark$;
-- +goose StatementEnd

-- outbox_idle_heads: as in 00061, probes only.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_idle_heads(types text[], ids text[], seen_wakes bigint[]) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
-- Probes, never a merge or hash join that reads every head (see above).
SET enable_mergejoin = off
SET enable_hashjoin = off
SET plan_cache_mode = force_custom_plan AS $idle$
DECLARE
    lt text[];
    li text[];
    lw bigint[];
    n bigint;
BEGIN
    -- Lock first (never waiting: a head someone holds stays ready, 00053)...
    SELECT array_agg(l.aggregate_type), array_agg(l.aggregate_id), array_agg(l.w) INTO lt, li, lw
    FROM (SELECT h.aggregate_type, h.aggregate_id, u.w
          FROM outbox_heads h JOIN unnest(types, ids, seen_wakes) AS u(t, i, w)
            ON h.aggregate_type = u.t AND h.aggregate_id = u.i
          ORDER BY h.aggregate_type, h.aggregate_id
          FOR NO KEY UPDATE OF h SKIP LOCKED) l;
    IF lt IS NULL THEN
        RETURN 0;
    END IF;
    -- ...then decide on a snapshot taken after the locks were granted.
    WITH idled AS (
        UPDATE outbox_heads h SET state = 'idle', claim_token = NULL
        FROM unnest(lt, li, lw) AS u(t, i, w)
        WHERE h.aggregate_type = u.t AND h.aggregate_id = u.i
          AND h.state = 'ready' AND h.claim_token IS NULL AND h.wakes = u.w
          AND NOT EXISTS (SELECT 1 FROM outbox o
                          WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                            AND o.aggregate_seq >= h.next_seq AND o.state <> 'sent' AND o.state <> 'discarded')
        RETURNING 1
    )
    SELECT count(*) INTO n FROM idled;
    RETURN n;
END
$idle$;
-- +goose StatementEnd

-- +goose Down
-- outbox_mark_runs: as in 00061.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_mark_runs(token uuid, types text[], ids text[], seen_wakes bigint[], next_seqs bigint[],
                                 outcomes text[], delays_ms bigint[], errors text[], fail_ids bigint[], sent_ids bigint[])
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_custom_plan
AS $mark$
DECLARE
    recorded bigint;
    idle_types text[];
    idle_ids text[];
    idle_next bigint[];
BEGIN
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
        RETURNING u.t, u.i, u.next_seq, h.state = 'idle' AS idled, u.outcome, u.err, u.fail_id
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
    SELECT count(*), array_agg(heads.t) FILTER (WHERE heads.idled), array_agg(heads.i) FILTER (WHERE heads.idled),
           array_agg(heads.next_seq) FILTER (WHERE heads.idled)
    INTO recorded, idle_types, idle_ids, idle_next
    FROM heads;
    -- The heads just idled, looked at again with a snapshot taken after
    -- their locks were granted (this statement's): one with an unsent event
    -- is made ready again (see above). One probe of the outbox's key per
    -- idled head; a head is written only if the race happened.
    -- (A LATERAL probe with LIMIT, not EXISTS: the planner turned EXISTS
    -- into a semi join that cost ~17 ms a call.)
    IF idle_types IS NOT NULL THEN
        SELECT array_agg(x.t), array_agg(x.i) INTO idle_types, idle_ids
        FROM unnest(idle_types, idle_ids, idle_next) AS x(t, i, s)
        CROSS JOIN LATERAL (SELECT 1 FROM outbox o
                            WHERE o.aggregate_type = x.t AND o.aggregate_id = x.i AND o.aggregate_seq >= x.s
                              AND o.state <> 'sent' AND o.state <> 'discarded'
                            LIMIT 1) e;
    END IF;
    IF idle_types IS NOT NULL THEN
        UPDATE outbox_heads h SET state = 'ready', due_at = now(), wakes = h.wakes + 1
        FROM unnest(idle_types, idle_ids) AS x(t, i)
        WHERE h.aggregate_type = x.t AND h.aggregate_id = x.i AND h.state = 'idle';
    END IF;
    RETURN recorded;
END
$mark$;
-- +goose StatementEnd

-- outbox_idle_heads: as in 00061.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_idle_heads(types text[], ids text[], seen_wakes bigint[]) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_custom_plan AS $idle$
DECLARE
    lt text[];
    li text[];
    lw bigint[];
    n bigint;
BEGIN
    -- Lock first (never waiting: a head someone holds stays ready, 00053)...
    SELECT array_agg(l.aggregate_type), array_agg(l.aggregate_id), array_agg(l.w) INTO lt, li, lw
    FROM (SELECT h.aggregate_type, h.aggregate_id, u.w
          FROM outbox_heads h JOIN unnest(types, ids, seen_wakes) AS u(t, i, w)
            ON h.aggregate_type = u.t AND h.aggregate_id = u.i
          ORDER BY h.aggregate_type, h.aggregate_id
          FOR NO KEY UPDATE OF h SKIP LOCKED) l;
    IF lt IS NULL THEN
        RETURN 0;
    END IF;
    -- ...then decide on a snapshot taken after the locks were granted.
    WITH idled AS (
        UPDATE outbox_heads h SET state = 'idle', claim_token = NULL
        FROM unnest(lt, li, lw) AS u(t, i, w)
        WHERE h.aggregate_type = u.t AND h.aggregate_id = u.i
          AND h.state = 'ready' AND h.claim_token IS NULL AND h.wakes = u.w
          AND NOT EXISTS (SELECT 1 FROM outbox o
                          WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                            AND o.aggregate_seq >= h.next_seq AND o.state <> 'sent' AND o.state <> 'discarded')
        RETURNING 1
    )
    SELECT count(*) INTO n FROM idled;
    RETURN n;
END
$idle$;
-- +goose StatementEnd
