-- +goose Up

-- outbox_claim is the dispatcher's claim query (pkg/outbox calls it; see
-- sqlClaim in pkg/outbox/sql.go). It takes, in id order, pending rows that are
-- due and are the head of their aggregate: no earlier event of the same
-- aggregate is unsent (pending, claimed, retrying or dead). Claiming stamps a
-- claim token and leases the row by pushing next_attempt_at to the lease end;
-- the row stays 'pending', so the next event of its aggregate stays blocked
-- until this one is marked sent. A crashed dispatcher's rows become due again
-- when the lease ends.
--
-- Why a function: its SET clauses pin the plan shape for this one statement
-- (no session state is left behind; RDS Proxy sees a plain SELECT). The claim
-- must read O(batch) rows whatever the planner's statistics say. Measured
-- failures without this, on a 20,000-event burst:
--   * stats taken while a handful of events were pending: the planner sorted
--     a bitmap scan of every pending row for each claim (40 ms per claim,
--     growing with the backlog);
--   * stats taken while nothing was pending: the head check became an
--     anti-join that scanned every unsent row per candidate (4.7 s per claim).
-- The head check is therefore a correlated subquery (OFFSET 0 keeps it from
-- being flattened into a join: one index probe per candidate), and the scan
-- is the partial index in id order (bitmap scans and sorts disabled).
--
-- after_id is a keyset cursor: the scan starts after the last row this
-- dispatcher claimed, so consecutive claims do not re-read rows in flight.
-- Correctness never depends on it, only the number of rows a claim reads.
CREATE FUNCTION outbox_claim(batch_size bigint, claim_token uuid, lease_ms bigint, after_id bigint)
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

-- +goose Down
DROP FUNCTION outbox_claim(bigint, uuid, bigint, bigint);
