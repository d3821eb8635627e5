-- +goose Up

-- Less PostgreSQL CPU per claim and mark (issue 28: at 2 events per
-- aggregate the drain cost 14.7 us of PostgreSQL CPU per event against a
-- target of 15).
--
-- Where it went, measured with perf on the backends of a 100,000-event
-- drain over 50,000 aggregates (docs/performance.md "Claim and mark in
-- PL/pgSQL"): index descents 19 % (per aggregate: the claim's run, the
-- lease's key probe, the mark's key probe, the mark's look for more events,
-- the re-check), the mark's new key entry 7 %, parsing and planning 5.5 %
-- (outbox_claim_runs and outbox_claim_heads are SQL functions, parsed and
-- planned on every call; the mark planned a custom plan on every call), the
-- batch's sort with its bodies 3-4 %. This migration removes what does not
-- carry a guarantee:
--
--   * outbox_claim_heads runs its query (00060's, unchanged but for the
--     two points below) from PL/pgSQL with one generic plan per session
--     (plan_cache_mode = force_generic_plan), and outbox_claim_runs is
--     PL/pgSQL: no parse or plan per call. The plan is pinned as before by
--     the settings (no sequential or bitmap scans; now also no merge or hash
--     joins, as the mark since 00063): the due index in order, one range
--     scan of outbox_aggregate_seq_key per head, one key probe per leased
--     head. pkg/outbox/explain.go EXPLAINs this generic plan (a prepared
--     statement under the function's settings) and claim_plan_test.go holds
--     it to one row read per claimed event with fresh, stale and missing
--     statistics.
--   * The lease UPDATE joins each head's first row (rn = 1, one per head)
--     instead of a DISTINCT over them: no sort.
--   * The claim's rows are no longer sorted. They come in the order the
--     plan makes them: ev is a nested loop over h (materialized, in due
--     order) whose lateral side returns each run in sequence order, stored
--     in a materialized CTE and read back as stored. The dispatcher does not
--     rely on it: it groups rows by aggregate and sorts each run by sequence
--     (pkg/outbox/dispatcher.go claim), so a different row order could at
--     worst change which aggregate is published first, never a run's order.
--   * outbox_mark_runs gets a signature with `ended` (one per run: the claim,
--     or the run's last extension, read fewer events than it asked for, so
--     its snapshot held nothing unsent after the run) in place of the
--     published rows' ids (unused since 00030). The mark no longer probes
--     the outbox for more events per run: a run that ended and whose head
--     saw no wake-up since the claim goes idle, any other stays ready. The
--     idle decision is still made by 00061's re-check, unchanged: every head
--     the mark idles is looked at again in a statement whose snapshot
--     follows its lock, and made ready if an unsent event is visible, so the
--     hint cannot strand an event (00061's argument needs only that every
--     idled head passes the re-check). A wrong hint costs work, not
--     correctness: `ended` when more events exist (the batch's LIMIT cut the
--     last run, or a dead or failed event stopped it) makes the re-check
--     write the head ready again; not `ended` when nothing is left leaves
--     the head ready for the next claim to retire (outbox_idle_heads). The
--     watermark is untouched (next_seq moves exactly as before). Generic
--     plan: the token is compared through u (00063) and merge and hash joins
--     are off, so the plan is the runs-outer key probe whatever the
--     statistics.
--   * The 00063 signature stays as it is, for dispatchers of the previous
--     version during an upgrade (pkg/outbox/upgrade_claim_cost_test.go marks
--     a batch claimed before the upgrade through it).
--
-- Row versions per aggregate cycle are unchanged (the claim's lease, a HOT
-- update, and the mark's, which changes state or due_at and so is not HOT):
-- what went is CPU per statement, not writes. No data changes.

-- outbox_claim_heads: 00060's query from PL/pgSQL (see above).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_claim_heads(max_events integer, max_run integer, token uuid, lease_ms bigint)
RETURNS TABLE (kind text, id bigint, event_id text, aggregate_type text, aggregate_id text, aggregate_seq bigint,
               event_type text, tenant_id text, traceparent text, attempts integer, body bytea,
               head_wakes bigint, retrying_ms bigint)
LANGUAGE plpgsql VOLATILE
SET enable_bitmapscan = off
SET enable_seqscan = off
-- Probes, never a merge or hash join that reads every head (as the mark,
-- 00063).
SET enable_mergejoin = off
SET enable_hashjoin = off
-- One plan per session (see above); pkg/outbox/explain.go checks this plan.
SET plan_cache_mode = force_generic_plan
AS $claim$
#variable_conflict use_column
BEGIN
-- The query: $1 max_events, $2 max_run, $3 token, $4 lease_ms (positional,
-- so diagnostics can EXPLAIN it as it is: pkg/outbox/explain.go takes the
-- text from the next line's keywords to the last semicolon).
RETURN QUERY
-- h has no LIMIT of its own: ev pulls heads one by one until it has $1
-- rows, so a head another claim leased a moment ago (skipped, or rejected
-- when PostgreSQL re-checks the updated row) does not use up a place.
WITH h AS MATERIALIZED (
    SELECT oh.aggregate_type, oh.aggregate_id, oh.next_seq, oh.wakes, oh.retry_since, oh.due_at
    FROM outbox_heads oh
    WHERE oh.state = 'ready' AND oh.due_at <= now()
      -- Not leased (a claimed head keeps its due_at: 00060).
      AND (oh.claim_token IS NULL OR oh.lease_until IS NULL OR oh.lease_until <= now())
    ORDER BY oh.due_at
    FOR NO KEY UPDATE SKIP LOCKED
), ev AS MATERIALIZED (
    SELECT h.aggregate_type AS h_type, h.aggregate_id AS h_id, h.wakes AS h_wakes,
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
    -- One row per claimed head: its run's first event (rn = 1), so no
    -- DISTINCT (and no sort) is needed.
    UPDATE outbox_heads t
    SET claim_token = $3,
        lease_until = now() + make_interval(secs => $4 / 1000.0),
        expired_leases = t.expired_leases + (t.claim_token IS NOT NULL)::integer
    FROM ev
    WHERE ev.rn = 1 AND ev.o_ok AND t.aggregate_type = ev.h_type AND t.aggregate_id = ev.h_id
    RETURNING 1
), parked AS (
    UPDATE outbox_heads t
    SET state = 'dead', next_seq = ev.o_seq, claim_token = NULL
    FROM ev
    WHERE ev.rn = 1 AND ev.o_state = 'dead' AND t.aggregate_type = ev.h_type AND t.aggregate_id = ev.h_id
    RETURNING 1
)
-- In ev's order, unsorted (see above: the dispatcher orders each run).
SELECT CASE WHEN ev.o_id IS NULL THEN 'empty' WHEN ev.o_ok THEN 'event' ELSE 'dead' END,
       ev.o_id, ev.o_event_id::text, ev.h_type, ev.h_id, ev.o_seq,
       ev.o_type, coalesce(ev.o_tenant, ''), coalesce(ev.o_traceparent, ''), ev.o_attempts, ev.o_body,
       ev.h_wakes, ev.h_retrying_ms
FROM ev
WHERE ev.o_id IS NULL OR ev.o_ok OR (ev.rn = 1 AND ev.o_state = 'dead');
END
$claim$;
-- +goose StatementEnd

-- outbox_claim_runs: as in 00009, in PL/pgSQL (its two statements were
-- parsed and planned on every call).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_claim_runs(max_events integer, max_run integer, token uuid, lease_ms bigint, max_wakeups integer)
RETURNS TABLE (kind text, id bigint, event_id text, aggregate_type text, aggregate_id text, aggregate_seq bigint,
               event_type text, tenant_id text, traceparent text, attempts integer, body bytea,
               head_wakes bigint, retrying_ms bigint)
LANGUAGE plpgsql VOLATILE AS $run$
BEGIN
    PERFORM outbox_consume_wakeups(max_wakeups);
    RETURN QUERY SELECT * FROM outbox_claim_heads(max_events, max_run, token, lease_ms);
END
$run$;
-- +goose StatementEnd

-- outbox_mark_runs with the claim's hint (ended) in place of the published
-- rows' ids (unused since 00030). The 00063 signature stays, unchanged, for
-- dispatchers of an earlier version during an upgrade.
-- +goose StatementBegin
CREATE FUNCTION outbox_mark_runs(token uuid, types text[], ids text[], seen_wakes bigint[], next_seqs bigint[],
                                 outcomes text[], delays_ms bigint[], errors text[], fail_ids bigint[], ended boolean[])
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
-- Probes, never a merge or hash join that reads every head (00063).
SET enable_mergejoin = off
SET enable_hashjoin = off
-- One plan per session (see above).
SET plan_cache_mode = force_generic_plan
AS $mark$
DECLARE
    recorded bigint;
    idle_types text[];
    idle_ids text[];
    idle_next bigint[];
BEGIN
    WITH u AS MATERIALIZED (
        -- The token rides along as a column of u (00063).
        SELECT u.*, token AS tok
        FROM unnest(types, ids, seen_wakes, next_seqs, outcomes, delays_ms, errors, fail_ids, ended)
            AS u(t, i, w, next_seq, outcome, delay_ms, err, fail_id, e)
        ORDER BY t, i
    ), heads AS (
        UPDATE outbox_heads h
        SET next_seq = u.next_seq,
            claim_token = NULL,
            lease_until = NULL,
            state = CASE
                WHEN u.outcome = 'dead' THEN 'dead'
                WHEN u.outcome IN ('retry', 'released') THEN 'ready'
                -- The claim saw nothing after the run: idle, unless a
                -- wake-up came in since. The re-check below decides.
                WHEN h.wakes = u.w AND u.e THEN 'idle'
                ELSE 'ready' END,
            -- Round robin: a head with more to publish goes to the back of
            -- the due line (00060).
            due_at = CASE WHEN u.outcome = 'retry' THEN now() + make_interval(secs => u.delay_ms / 1000.0)
                          ELSE now() END,
            retry_since = CASE WHEN u.outcome = 'retry' THEN coalesce(h.retry_since, now())
                               WHEN u.outcome = 'released' THEN h.retry_since END
        FROM u
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
    -- is made ready again (00061). One probe of the outbox's key per idled
    -- head; a head is written again only if the race happened or the hint
    -- was wrong.
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

-- +goose Down
DROP FUNCTION outbox_mark_runs(uuid, text[], text[], bigint[], bigint[], text[], bigint[], text[], bigint[], boolean[]);
-- outbox_claim_runs as in 00009.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_claim_runs(max_events integer, max_run integer, token uuid, lease_ms bigint, max_wakeups integer)
RETURNS TABLE (kind text, id bigint, event_id text, aggregate_type text, aggregate_id text, aggregate_seq bigint,
               event_type text, tenant_id text, traceparent text, attempts integer, body bytea,
               head_wakes bigint, retrying_ms bigint)
LANGUAGE sql VOLATILE AS $run$
SELECT outbox_consume_wakeups(max_wakeups);
SELECT * FROM outbox_claim_heads(max_events, max_run, token, lease_ms);
$run$;
-- +goose StatementEnd
-- outbox_claim_heads as in 00060.
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
