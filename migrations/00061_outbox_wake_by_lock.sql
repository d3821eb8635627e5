-- +goose Up

-- Consuming a wake-up for a head that is already ready writes no row
-- version (issue 28: long transactions).
--
-- Before, the claim's wake-up step bumped `wakes` on every head a wake-up
-- named, so each event left a new version of its aggregate's head. While a
-- transaction anywhere on the server stays open, vacuum and page pruning
-- can remove none of them, and every later lookup of the head (the upsert's
-- conflict check, the claim, the mark) walks them all: with a transaction
-- held 5 minutes at 300 events/s over 100 aggregates, claims and marks
-- slowed until commit-to-publish p99 reached seconds. Now the wake-up step
-- updates a head only to wake an idle one; a head that is not idle is
-- locked (ON CONFLICT DO UPDATE ... WHERE locks the conflicting row whether
-- or not WHERE holds; a lock writes no new version).
--
-- What the bump was for: a mark or outbox_idle_heads deciding "no unsent
-- event" on a snapshot taken before a producer committed, while that
-- producer's wake-up is consumed concurrently (its head still ready, so the
-- wake-up step leaves it as it is): the head would go idle with an event
-- waiting and no wake-up left. The bump made the deciding UPDATE re-check
-- the row (EvalPlanQual) and see `wakes` moved. Without it the decision is
-- made in a statement whose snapshot is taken after the head's lock is
-- granted:
--   * outbox_idle_heads locks the heads (SKIP LOCKED) in one statement and
--     decides in the next;
--   * outbox_mark_runs records runs in one statement, as before, and then,
--     in a second statement, looks again at the heads it made idle (still
--     locked by it) and makes any with an unsent event ready again.
-- Why no event is stranded: the producer P commits its event E and wake-up
-- W before the consumer C can see W; C locks head H (the upsert) before it
-- commits. Let D be the deciding statement (the re-check or the idle
-- statement) and L the lock it runs under (the mark's update or the idle
-- lock statement, both earlier in D's transaction):
--   * C locked H before L: L waited for C's commit (or skipped H: idle),
--     so D's snapshot follows C's commit and therefore P's: D sees E and H
--     stays (or is made) ready;
--   * L locked H before C: C waits for L's transaction to commit, and then
--     ON CONFLICT looks at H's newest version: idle, so C wakes it.
-- Either way E's head is ready after both commit. pkg/outbox's
-- TestWakeRacesIdleDecision drives the race; the torture test runs it at
-- scale.

-- outbox_consume_wakeups: as in 00009; only an idle head is written.
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

-- outbox_mark_runs: as in 00060 (the same statement records the runs), then
-- the re-check of the heads it idled.
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

-- outbox_idle_heads: as in 00053, split into the lock and the decision.
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
    SET wakes  = h.wakes + 1,
        state  = CASE WHEN h.state = 'idle' THEN 'ready' ELSE h.state END,
        due_at = CASE WHEN h.state = 'idle' THEN now() ELSE h.due_at END
    RETURNING 1
)
SELECT count(*) FROM upserted
$wake$;
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
