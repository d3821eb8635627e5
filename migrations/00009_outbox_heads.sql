-- +goose Up

-- The dispatcher claims from aggregate heads, not from events (issue 14).
--
-- Before: the claim walked pending events in id order and probed each for
-- being its aggregate's head, so every claim stepped over the events waiting
-- behind an in-flight, retrying or dead head (a 50,000-event aggregate slowed
-- everyone and itself published ~1 event/s), and an aggregate moved at most
-- one event per claim-publish-mark cycle.
--
-- Now: outbox_heads keeps one row per aggregate that has ever had an event
-- dispatched: next_seq (every event below it is sent or discarded), state,
-- and when the head is due. The claim reads due heads in due order (oldest
-- first: a hot aggregate gets its turn like everyone else, a parked one costs
-- nothing) and takes a run of consecutive events of each, so its cost is
-- O(batch) whatever waits behind a blocked head, and a backlogged aggregate
-- moves a run per cycle instead of one event.
--
-- Head states:
--   ready  due at due_at: claimable once due_at <= now(), oldest first.
--          Normally due_at is when the head's next event was enqueued, so
--          the claim serves the oldest waiting event's aggregate first. While
--          claimed it holds claim_token and due_at is the lease's end, so a
--          crashed dispatcher's run is claimed again after the lease. While
--          backing off after a failed publish, due_at is the retry time and
--          retry_since when the head event first failed.
--   idle   no unsent event at or after next_seq when last looked.
--   dead   next_seq is a dead event: the aggregate is parked (only it).
--
-- Producers never touch heads: Enqueue inserts a row into outbox_wakeups per
-- aggregate it writes to (insert-only, so it takes no lock the dispatcher
-- waits on and works the same under any isolation level). The claim consumes
-- wake-ups first: it creates missing heads and turns idle ones ready, and
-- bumps `wakes` on every head it touches. The dispatcher only turns a head
-- idle when `wakes` is what it was when the head was claimed and no unsent
-- event is visible: a wake-up consumed in between (its producer committed
-- after the marking statement's snapshot) changes `wakes`, and PostgreSQL
-- re-checks the updated row, so the head stays ready. A wake-up consumed
-- after the head went idle wakes it. Either way no committed event waits on
-- an idle head.
CREATE TABLE outbox_heads (
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    next_seq       bigint      NOT NULL,
    state          text        NOT NULL DEFAULT 'ready'
                               CHECK (state IN ('ready', 'idle', 'dead')),
    due_at         timestamptz NOT NULL DEFAULT now(),
    claim_token    uuid,
    wakes          bigint      NOT NULL DEFAULT 0,
    retry_since    timestamptz,
    -- Claims that found the previous claim's lease expired (a dispatcher
    -- crashed or overran): a diagnostic the crash tests read.
    expired_leases bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (aggregate_type, aggregate_id)
) WITH (fillfactor = 70);

-- The claim's poll: due heads in due order. Only ready heads are indexed, so
-- idle aggregates (most of them, most of the time) and parked ones cost the
-- claim nothing.
CREATE INDEX outbox_heads_due_idx ON outbox_heads (due_at) WHERE state = 'ready';
-- Parked aggregates, for the backlog figures and requeue.
CREATE INDEX outbox_heads_dead_idx ON outbox_heads (aggregate_type, aggregate_id) WHERE state = 'dead';

ALTER TABLE outbox_heads SET (
    autovacuum_vacuum_scale_factor  = 0,
    autovacuum_vacuum_threshold     = 5000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold    = 5000
);

-- One row per (producer transaction, aggregate written): "look at this
-- aggregate". Consumed, oldest first, by every claim.
CREATE TABLE outbox_wakeups (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL
);
ALTER TABLE outbox_wakeups SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000);

-- An event an operator discarded (it can never be published, e.g. SNS
-- rejects it): its aggregate moves on past it. Never published, pruned like
-- sent events.
ALTER TABLE outbox DROP CONSTRAINT outbox_state_check;
ALTER TABLE outbox ADD CONSTRAINT outbox_state_check
    CHECK (state IN ('pending', 'sent', 'dead', 'discarded')) NOT VALID;
ALTER TABLE outbox VALIDATE CONSTRAINT outbox_state_check;

-- outbox_consume_wakeups turns up to max_wakeups wake-ups into heads: a new
-- aggregate gets a ready head at its lowest unsent event; an idle head
-- becomes ready, due now; every head touched gets wakes + 1 (see above).
-- Heads are written in key order, the order every writer of heads locks
-- them in, so two writers cannot deadlock.
-- +goose StatementBegin
CREATE FUNCTION outbox_consume_wakeups(max_wakeups integer) RETURNS bigint
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

-- outbox_claim_heads is the dispatcher's claim (pkg/outbox calls it through
-- outbox_claim_runs; sqlClaim in pkg/outbox/sql.go). It locks due ready heads
-- in due order (SKIP LOCKED: concurrent dispatchers take disjoint heads) and
-- takes from each a run of up to max_run consecutive pending events starting
-- at its lowest unsent event, max_events in all. Claimed heads get the
-- claim token and a lease (due_at = lease end). Rows come back in claim
-- order, each run in sequence order, with a kind:
--   'event' an event of a claimed run;
--   'empty' a locked head with no unsent event visible: the dispatcher asks
--           outbox_idle_heads to retire it (in a statement of its own, whose
--           snapshot follows this one's locks);
--   'dead'  the head's lowest unsent event is dead (written by an older
--           dispatcher or by hand): the head is parked here.
-- A run stops before any event that is not pending or not consecutive, so an
-- event is never published before every earlier one of its aggregate is sent.
--
-- The SET clauses pin the plan (the claim must read O(batch) rows whatever
-- the statistics say): the due index in order, one index range scan of
-- outbox_unsent_aggregate_idx per head.
-- +goose StatementBegin
CREATE FUNCTION outbox_claim_heads(max_events integer, max_run integer, token uuid, lease_ms bigint)
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

-- outbox_claim_runs is what the dispatcher calls: wake-ups first (so a head
-- they make ready is claimable at once), then the claim.
-- +goose StatementBegin
CREATE FUNCTION outbox_claim_runs(max_events integer, max_run integer, token uuid, lease_ms bigint, max_wakeups integer)
RETURNS TABLE (kind text, id bigint, event_id text, aggregate_type text, aggregate_id text, aggregate_seq bigint,
               event_type text, tenant_id text, traceparent text, attempts integer, body bytea,
               head_wakes bigint, retrying_ms bigint)
LANGUAGE sql VOLATILE AS $run$
SELECT outbox_consume_wakeups(max_wakeups);
SELECT * FROM outbox_claim_heads(max_events, max_run, token, lease_ms);
$run$;
-- +goose StatementEnd

-- outbox_idle_heads retires heads a claim found empty, unless a wake-up came
-- in since (wakes moved) or an unsent event is visible now.
-- +goose StatementBegin
CREATE FUNCTION outbox_idle_heads(types text[], ids text[], seen_wakes bigint[]) RETURNS bigint
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

-- outbox_mark_runs records a claim's outcomes in one statement. Per run (one
-- aggregate): the events published (sent_ids, all runs together) become
-- sent; the event that failed (fail_id) gets its attempt and error, and
-- becomes dead if outcome is 'dead'; the head moves to next_seq and becomes
--   dead      outcome 'dead' (the aggregate is parked);
--   ready     due after the backoff (outcome 'retry'), or due now (outcome
--             'released': the run was cut short unpublished, e.g. at the
--             batch's time limit), or due now with more events waiting;
--   idle      everything published, nothing unsent visible, and no wake-up
--             consumed since the claim (wakes unchanged).
-- Only heads still holding this claim's token are touched: a run whose lease
-- expired and was claimed again belongs to the new claim. Returns how many
-- runs were recorded.
-- +goose StatementBegin
CREATE FUNCTION outbox_mark_runs(token uuid, types text[], ids text[], seen_wakes bigint[], next_seqs bigint[],
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

-- outbox_rebuild_heads (re)derives heads from the outbox: every aggregate
-- with an unsent event gets a head at its lowest unsent event (dead if that
-- event is dead), due when that event was due. It runs here to take over an
-- existing backlog, and an operator may run it to repair heads written by
-- hand (`fifobox repair-heads`). It never moves a head that is claimed now,
-- so it is safe while dispatchers run.
-- +goose StatementBegin
CREATE FUNCTION outbox_rebuild_heads() RETURNS bigint
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

-- outbox_requeue_dead and outbox_discard_dead are the operator's actions on
-- dead events (pkg/outbox RequeueDead and DiscardDead; audited by
-- pkg/redrive). Both select dead events by ids, or by aggregate type and
-- created_at range, lock the affected heads first (in key order, like every
-- writer of heads) and then:
--   requeue: the events become pending again (attempts reset) and their
--            heads ready at them, due now: the aggregate resumes in order;
--   discard: the events become 'discarded' (never published; pruned like
--            sent events) and their heads ready, due now: the aggregate
--            resumes after them (a claim skips discarded events).
-- +goose StatementBegin
CREATE FUNCTION outbox_select_dead(event_ids uuid[], agg_type text, since timestamptz, until timestamptz)
RETURNS SETOF bigint LANGUAGE sql STABLE AS $select$
SELECT o.id FROM outbox o
WHERE o.state = 'dead'
  AND (cardinality(event_ids) = 0 OR o.event_id = ANY(event_ids))
  AND (agg_type = '' OR o.aggregate_type = agg_type)
  AND (since IS NULL OR o.created_at >= since)
  AND (until IS NULL OR o.created_at < until)
$select$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION outbox_lock_dead_heads(event_ids uuid[], agg_type text, since timestamptz, until timestamptz)
RETURNS bigint LANGUAGE sql VOLATILE AS $lock$
SELECT count(*) FROM (
    SELECT 1 FROM outbox_heads h
    WHERE (h.aggregate_type, h.aggregate_id) IN (
        SELECT o.aggregate_type, o.aggregate_id FROM outbox o
        WHERE o.id IN (SELECT outbox_select_dead(event_ids, agg_type, since, until)))
    ORDER BY h.aggregate_type, h.aggregate_id
    FOR NO KEY UPDATE OF h) locked
$lock$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION outbox_requeue_dead(event_ids uuid[], agg_type text, since timestamptz, until timestamptz)
RETURNS bigint LANGUAGE sql VOLATILE AS $requeue$
SELECT outbox_lock_dead_heads(event_ids, agg_type, since, until);
WITH ev AS (
    UPDATE outbox o SET state = 'pending', attempts = 0
    WHERE o.id IN (SELECT outbox_select_dead(event_ids, agg_type, since, until)) AND o.state = 'dead'
    RETURNING o.aggregate_type, o.aggregate_id, o.aggregate_seq
), heads AS (
    INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, next_seq)
    SELECT aggregate_type, aggregate_id, min(aggregate_seq) FROM ev GROUP BY 1, 2 ORDER BY 1, 2
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
    SET state = 'ready', due_at = now(), claim_token = NULL, retry_since = NULL, wakes = h.wakes + 1,
        next_seq = least(h.next_seq, EXCLUDED.next_seq)
    RETURNING 1
)
SELECT count(*) FROM ev;
$requeue$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION outbox_discard_dead(event_ids uuid[], agg_type text, since timestamptz, until timestamptz, reason text)
RETURNS bigint LANGUAGE sql VOLATILE AS $discard$
SELECT outbox_lock_dead_heads(event_ids, agg_type, since, until);
WITH ev AS (
    UPDATE outbox o
    SET state = 'discarded', sent_at = now(),
        last_error = left(coalesce(o.last_error || ' | ', '') || 'discarded: ' || reason, 1000)
    WHERE o.id IN (SELECT outbox_select_dead(event_ids, agg_type, since, until)) AND o.state = 'dead'
    RETURNING o.aggregate_type, o.aggregate_id
), heads AS (
    UPDATE outbox_heads h
    SET state = 'ready', due_at = now(), claim_token = NULL, retry_since = NULL, wakes = h.wakes + 1
    FROM (SELECT DISTINCT aggregate_type, aggregate_id FROM ev) e
    WHERE h.aggregate_type = e.aggregate_type AND h.aggregate_id = e.aggregate_id
    RETURNING 1
)
SELECT count(*) FROM ev;
$discard$;
-- +goose StatementEnd

SELECT outbox_rebuild_heads();

-- The previous claim (00006) takes events by scanning them; a dispatcher of
-- the previous version still running during the upgrade would claim beside
-- the heads. Its body is replaced by one that claims nothing: such a
-- dispatcher finishes the batch in hand (its marks still work: the heads
-- above tolerate events sent under them) and then idles until it is replaced.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_claim(batch_size bigint, claim_token uuid, lease_ms bigint, after_id bigint)
RETURNS TABLE (id bigint, event_id text, aggregate_type text, aggregate_id text, aggregate_seq bigint,
               event_type text, tenant_id text, traceparent text, attempts integer, body bytea)
LANGUAGE sql VOLATILE AS $noop$
SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::bigint, NULL::text, NULL::text, NULL::text,
       NULL::integer, NULL::bytea
WHERE false
$noop$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION outbox_discard_dead(uuid[], text, timestamptz, timestamptz, text);
DROP FUNCTION outbox_requeue_dead(uuid[], text, timestamptz, timestamptz);
DROP FUNCTION outbox_lock_dead_heads(uuid[], text, timestamptz, timestamptz);
DROP FUNCTION outbox_select_dead(uuid[], text, timestamptz, timestamptz);
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_claim(batch_size bigint, claim_token uuid, lease_ms bigint, after_id bigint)
RETURNS TABLE (id bigint, event_id text, aggregate_type text, aggregate_id text, aggregate_seq bigint,
               event_type text, tenant_id text, traceparent text, attempts integer, body bytea)
LANGUAGE sql VOLATILE
SET enable_bitmapscan = off
SET enable_sort = off
AS $claim$
WITH heads AS (
    SELECT o.id
    FROM outbox o
    WHERE o.state = 'pending'
      AND o.id > $4
      AND o.next_attempt_at <= now()
      AND NOT EXISTS (
          SELECT 1 FROM outbox p
          WHERE p.aggregate_type = o.aggregate_type
            AND p.aggregate_id = o.aggregate_id
            AND p.aggregate_seq < o.aggregate_seq
            AND p.state <> 'sent'
          OFFSET 0)
    ORDER BY o.id
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED
)
UPDATE outbox t
SET attempts = t.attempts + 1,
    claim_token = $2,
    next_attempt_at = now() + make_interval(secs => $3 / 1000.0)
FROM heads
WHERE t.id = heads.id
RETURNING t.id, t.event_id::text, t.aggregate_type, t.aggregate_id, t.aggregate_seq,
          t.event_type, coalesce(t.tenant_id, ''), coalesce(t.traceparent, ''), t.attempts, t.body
$claim$;
-- +goose StatementEnd
DROP FUNCTION outbox_rebuild_heads();
DROP FUNCTION outbox_mark_runs(uuid, text[], text[], bigint[], bigint[], text[], bigint[], text[], bigint[], bigint[]);
DROP FUNCTION outbox_idle_heads(text[], text[], bigint[]);
DROP FUNCTION outbox_claim_runs(integer, integer, uuid, bigint, integer);
DROP FUNCTION outbox_claim_heads(integer, integer, uuid, bigint);
DROP FUNCTION outbox_consume_wakeups(integer);
DROP TABLE outbox_wakeups;
DROP TABLE outbox_heads;
ALTER TABLE outbox DROP CONSTRAINT outbox_state_check;
ALTER TABLE outbox ADD CONSTRAINT outbox_state_check CHECK (state IN ('pending', 'sent', 'dead'));
