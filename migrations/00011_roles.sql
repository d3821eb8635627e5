-- +goose Up

-- Per-function database roles: each function may do its job and nothing
-- more (roles_test.go checks both halves against the real code paths). They
-- are group roles (NOLOGIN); the users functions log in as are members:
--   fifobox_producer    Enqueue (outbox.Enqueue, and fifobox_enqueue where
--                       present): insert events and wake-ups, reserve
--                       sequences. It can read no event and change none.
--   fifobox_dispatcher  the claim, the mark and the backlog gauges: read and
--                       mark events, keep the heads, consume wake-ups.
--   fifobox_consumer    the inbox and the demo's side-effect table; none of
--                       the outbox. Grant it your own side-effect tables.
--   fifobox_operations  status, dead list/requeue/discard, replay, prune,
--                       release holds, rebuild heads, the audit log.
-- The owner (the master user, or whoever runs the migrations) keeps DDL.
-- The functions log in as fifobox_dispatcher_fn, fifobox_consumer_fn and
-- fifobox_operations_fn; producers use their own service's user, granted
-- fifobox_producer.
-- docs/operations.md ("Database roles") maps each function's IAM database
-- user to its role.
--
-- Roles are cluster-wide and grants belong to this schema: a role is
-- created if missing (a concurrent migration of another schema may create
-- it first), then granted what it needs here.
-- +goose StatementBegin
DO $roles$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['fifobox_producer', 'fifobox_dispatcher', 'fifobox_consumer', 'fifobox_operations'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL; -- created meanwhile by a concurrent migration
            END;
        END IF;
    END LOOP;
    -- The users the functions log in as (infra/ maps each function's IAM
    -- database user to one): members of their role, no password. On RDS and
    -- Aurora, rds_iam makes them log in with IAM tokens only (through RDS
    -- Proxy's end-to-end IAM authentication).
    FOREACH r IN ARRAY ARRAY['fifobox_dispatcher', 'fifobox_consumer', 'fifobox_operations'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r || '_fn') THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I LOGIN IN ROLE %I', r || '_fn', r);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;
            END;
        END IF;
        IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rds_iam') THEN
            EXECUTE format('GRANT rds_iam TO %I', r || '_fn');
        END IF;
    END LOOP;
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO fifobox_producer, fifobox_dispatcher, fifobox_consumer, fifobox_operations',
                   current_schema());
    -- Identity columns draw from sequences: outbox ids (producer),
    -- inbox_held (consumer), redrive_audit (operations).
    EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA %I TO fifobox_producer, fifobox_consumer, fifobox_operations',
                   current_schema());
END
$roles$;
-- +goose StatementEnd

-- Producers: sqlReserveSeq upserts outbox_aggregates (SELECT for ON
-- CONFLICT ... RETURNING), sqlInsertEvents inserts events and wake-ups.
GRANT SELECT, INSERT, UPDATE ON outbox_aggregates TO fifobox_producer;
GRANT INSERT ON outbox, outbox_wakeups TO fifobox_producer;

-- Dispatcher: outbox_claim_runs, outbox_mark_runs, outbox_idle_heads,
-- outbox_extend_run and the stats (pkg/outbox/sql.go). It marks events
-- (state, sent_at, attempts, last_error) and never deletes one.
GRANT SELECT, UPDATE ON outbox TO fifobox_dispatcher;
GRANT SELECT, INSERT, UPDATE ON outbox_heads TO fifobox_dispatcher;
GRANT SELECT, UPDATE, DELETE ON outbox_wakeups TO fifobox_dispatcher; -- UPDATE: FOR UPDATE SKIP LOCKED
GRANT SELECT ON outbox_aggregates TO fifobox_dispatcher;

-- Consumer: the inbox transaction (pkg/inbox) and the demo read model.
GRANT SELECT, INSERT, DELETE ON inbox TO fifobox_consumer;
GRANT SELECT, INSERT, UPDATE, DELETE ON inbox_held TO fifobox_consumer; -- UPDATE: the hold upsert
GRANT SELECT, INSERT, UPDATE, DELETE ON orders_read_model TO fifobox_consumer;

-- Operations (pkg/redrive): reads everything it reports on; requeues,
-- discards and prunes events; rebuilds heads; prunes the inbox and releases
-- holds; writes the audit log.
GRANT SELECT, UPDATE, DELETE ON outbox TO fifobox_operations;
GRANT SELECT, INSERT, UPDATE ON outbox_heads TO fifobox_operations;
GRANT SELECT ON outbox_aggregates, outbox_wakeups TO fifobox_operations;
GRANT SELECT, DELETE ON inbox, inbox_held TO fifobox_operations;
GRANT SELECT, INSERT, UPDATE ON redrive_audit TO fifobox_operations;


-- +goose Down
-- The roles stay: they are cluster-wide, and other schemas or databases of
-- the cluster may use them. Their rights here go.
-- +goose StatementBegin
DO $revoke$
BEGIN
    EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA %I FROM fifobox_producer, fifobox_dispatcher, fifobox_consumer, fifobox_operations',
                   current_schema());
    EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA %I FROM fifobox_producer, fifobox_dispatcher, fifobox_consumer, fifobox_operations',
                   current_schema());
    EXECUTE format('REVOKE USAGE ON SCHEMA %I FROM fifobox_producer, fifobox_dispatcher, fifobox_consumer, fifobox_operations',
                   current_schema());
END
$revoke$;
-- +goose StatementEnd
