-- +goose Up

-- Short, renewed leases and the oldest open transaction (issue 28).
--
-- A claimed head keeps its lease in outbox_heads.due_at (with claim_token).
-- The lease used to be 60 s, so the runs of a dispatcher that crashed or lost
-- its connection waited a minute before another claim took them, and a batch
-- whose mark timed out stayed claimed just as long. Now the lease is short
-- (8 s by default) and a live dispatcher renews it while its batch publishes
-- and records its outcomes (outbox_extend_lease), and gives its runs back at
-- once when it cannot record their outcomes (outbox_release_runs). Both take
-- the batch's heads by key (one primary-key probe each, no scan of the heads
-- for a token) and touch only heads that still hold the batch's claim token:
-- a run whose lease ran out and was claimed again belongs to the new claim.
-- Heads are locked in key order, the order every writer of heads uses.

-- outbox_extend_lease moves the lease of the caller's heads to lease_ms from
-- now (never earlier than it was). Returns how many heads it still held.
-- +goose StatementBegin
CREATE FUNCTION outbox_extend_lease(token uuid, types text[], ids text[], lease_ms bigint) RETURNS bigint
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

-- outbox_release_runs gives the caller's heads back unrecorded: claimable
-- again now, at the same next event, so their runs are published again (the
-- events published before the release go out twice; SNS FIFO and the inbox
-- drop the copies by event id). What a dispatcher does when it cannot record
-- a batch's outcomes, instead of leaving its runs to the lease. Returns how
-- many heads it still held.
-- +goose StatementBegin
CREATE FUNCTION outbox_release_runs(token uuid, types text[], ids text[]) RETURNS bigint
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

-- fifobox_oldest_transaction reports how long the oldest transaction that
-- holds back vacuum has been open on the server: any session, of any
-- database of the cluster, with a transaction id or a snapshot (backend_xid
-- or backend_xmin), except the caller's own and autovacuum workers (vacuum
-- ignores their horizon). While it lasts, vacuum cannot remove the dead row
-- versions the outbox leaves on every event, in every database of the
-- cluster: the dispatcher reports it (OldestTransactionAgeSeconds) and
-- `fifobox status` shows it.
--
-- Other roles' sessions show no xact_start in pg_stat_activity unless the
-- reader has pg_read_all_stats. Rather than grant the dispatcher that role
-- (it would also read every session's query text), this function runs as its
-- owner (SECURITY DEFINER) and returns two figures only: the age, and whether
-- the owner sees every session (superuser or pg_read_all_stats; on RDS and
-- Aurora the master user has it through rds_superuser). If it does not, the
-- age covers only the owner's own sessions, and sees_all says so.
-- +goose StatementBegin
CREATE FUNCTION fifobox_oldest_transaction(OUT age_seconds double precision, OUT sees_all boolean)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $oldest$
SELECT coalesce(extract(epoch FROM clock_timestamp() - min(a.xact_start)), 0)::double precision,
       pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')
FROM pg_stat_activity a
WHERE a.pid <> pg_backend_pid()
  AND (a.backend_xid IS NOT NULL OR a.backend_xmin IS NOT NULL)
  AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
  AND a.xact_start IS NOT NULL
$oldest$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fifobox_oldest_transaction() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fifobox_oldest_transaction() TO fifobox_dispatcher, fifobox_operations;

-- +goose Down
DROP FUNCTION fifobox_oldest_transaction();
DROP FUNCTION outbox_release_runs(uuid, text[], text[]);
DROP FUNCTION outbox_extend_lease(uuid, text[], text[], bigint);
