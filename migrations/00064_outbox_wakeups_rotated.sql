-- +goose Up

-- Consumed wake-ups are reclaimed by TRUNCATE, not left for vacuum (issue
-- 28: long transactions; PgQ rotates its event tables the same way).
--
-- Every claim deletes the wake-ups it consumed. While a transaction anywhere
-- on the server is older than them, vacuum and page pruning can remove none,
-- and the claim's walk of the wake-ups' key (oldest id first) steps over all
-- of them: at the end of a 5-minute hold at 300 events/s
-- (BenchmarkLongTransaction) 89,000 dead wake-ups and 128 ms a claim. TRUNCATE
-- removes a table's rows whatever the snapshots of other transactions, so
-- the wake-ups now live in three partitions used in turn, by time: a
-- producer's wake-up goes to slot floor(clock / 2 s) mod 3
-- (outbox_wakeup_slot, the column's default: the enqueue functions and the
-- insert trigger are unchanged), and outbox_truncate_wakeups, which the
-- dispatcher calls up to ten times a second in a statement of its own, truncates
-- the slot that producers left 2 s ago and come back to in 2 s, once it holds
-- no live wake-up. A claim walks the dead wake-ups of the last two slots
-- (4-6 s of traffic; more when a slot's truncation was missed, until its
-- next turn), however long a transaction stays open: 1,100-5,800 at the end
-- of that hold instead of 89,000.
--
-- Why no wake-up is lost: outbox_truncate_wakeups first takes the slot's
-- ACCESS EXCLUSIVE lock with NOWAIT, so it gets it only if no transaction
-- holds any lock on that partition: none has an uncommitted insert in it
-- (an insert holds ROW EXCLUSIVE until its transaction ends) or locked or
-- deleted wake-ups of it (a claim's FOR UPDATE and DELETE lock it too), and
-- none can start one until it commits. Then, in a statement whose snapshot
-- follows the lock (READ COMMITTED; under any other isolation it truncates
-- nothing), it looks for a wake-up in the slot: every wake-up the slot holds
-- is now either committed and visible, or dead. It truncates only if none is
-- visible, so what TRUNCATE removes is dead: consumed (the claim that
-- deleted it committed) or never committed. A producer that inserts into the
-- slot afterwards (a clock reading from before the slot's turn, or when the
-- slot comes round again) leaves a wake-up that claims read, as they read
-- every slot, oldest id first.
--
-- Why producers never wait: NOWAIT never queues, so nobody waits behind the
-- request; once granted, the lock is held for a TRUNCATE of a small table in
-- a statement of its own (milliseconds), and only while the slot is at
-- least 1 s from its producers' turn (it starts only in the first half of
-- the 2 s before). A producer locks only the slot of its clock reading, so
-- it would wait only if more than a second passed between its clock reading
-- and its insert, within one INSERT statement. Claims and the stats, which
-- read every slot, wait for those milliseconds. Claims run back to back, so
-- NOWAIT often fails: the dispatcher asks up to ten times a second, and a
-- slot missed is truncated when its turn comes again (6 s later).
--
-- Cost: one TRUNCATE of a small table every 2 s (new files for the
-- partition, its key and TOAST table: a catalog row version each); the
-- claim's walk of the key reads three small keys (a merge in id order)
-- instead of one large one, and its DELETE probes each wake-up's own slot.

-- The slot a wake-up inserted now goes to. The period (2 s) and the slot
-- count (3) are outbox_truncate_wakeups' too.
-- +goose StatementBegin
CREATE FUNCTION outbox_wakeup_slot() RETURNS smallint
LANGUAGE sql VOLATILE PARALLEL SAFE AS $slot$
SELECT (floor(extract(epoch FROM clock_timestamp()) / 2)::bigint % 3)::smallint
$slot$;
-- +goose StatementEnd

-- The wake-ups waiting now move to the new table in one statement; the old
-- table goes. The migration takes the old table's ACCESS EXCLUSIVE lock:
-- producers wait for it, as for any migration that rewrites a table.
LOCK TABLE outbox_wakeups IN ACCESS EXCLUSIVE MODE;
ALTER TABLE outbox_wakeups RENAME TO outbox_wakeups_00063;
CREATE SEQUENCE outbox_wakeup_ids AS bigint;
CREATE TABLE outbox_wakeups (
    id             bigint   NOT NULL DEFAULT nextval('outbox_wakeup_ids'),
    aggregate_type text     NOT NULL,
    aggregate_id   text     NOT NULL,
    slot           smallint NOT NULL DEFAULT outbox_wakeup_slot(),
    PRIMARY KEY (id, slot)
) PARTITION BY LIST (slot);
ALTER SEQUENCE outbox_wakeup_ids OWNED BY outbox_wakeups.id;
CREATE TABLE outbox_wakeups_0 PARTITION OF outbox_wakeups FOR VALUES IN (0);
CREATE TABLE outbox_wakeups_1 PARTITION OF outbox_wakeups FOR VALUES IN (1);
CREATE TABLE outbox_wakeups_2 PARTITION OF outbox_wakeups FOR VALUES IN (2);
ALTER TABLE outbox_wakeups_0 SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000);
ALTER TABLE outbox_wakeups_1 SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000);
ALTER TABLE outbox_wakeups_2 SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000);
INSERT INTO outbox_wakeups (id, aggregate_type, aggregate_id)
SELECT id, aggregate_type, aggregate_id FROM outbox_wakeups_00063 ORDER BY id;
SELECT setval('outbox_wakeup_ids', coalesce((SELECT max(id) FROM outbox_wakeups_00063), 0) + 1, false);
DROP TABLE outbox_wakeups_00063;

-- Rights as the table had them (00011, 00038): the dispatcher consumes, the
-- operations role reads; producers write only through the enqueue functions
-- and the insert trigger (SECURITY DEFINER). Reads and writes through the
-- parent check the parent's rights only; nobody gets a right on a slot.
GRANT SELECT, UPDATE, DELETE ON outbox_wakeups TO fifobox_dispatcher; -- UPDATE: FOR UPDATE SKIP LOCKED
GRANT SELECT ON outbox_wakeups TO fifobox_operations;

-- outbox_consume_wakeups: as in 00062, but the DELETE names each locked
-- wake-up's slot, so it probes that slot's key only (by id alone it probed
-- all three), and in PL/pgSQL: a SQL function's statement is planned on
-- every call, and planning three partitions and three DELETEs added 1-2 µs
-- of PostgreSQL CPU per event to the drain (BenchmarkDispatchSkew); PL/pgSQL
-- keeps the plan for the session.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_consume_wakeups(max_wakeups integer) RETURNS bigint
LANGUAGE plpgsql VOLATILE
-- Index probes only, whatever the statistics (a generic plan once chose a
-- sequential scan of the outbox for a one-row probe).
SET enable_seqscan = off
SET enable_bitmapscan = off AS $wake$
DECLARE
    woken bigint;
BEGIN
    WITH locked AS MATERIALIZED (
        SELECT w.id, w.slot FROM outbox_wakeups w ORDER BY w.id LIMIT max_wakeups FOR UPDATE SKIP LOCKED
    ), consumed AS (
        -- A constant slot per DELETE: each is planned on its partition alone.
        DELETE FROM outbox_wakeups w WHERE w.slot = 0 AND w.id = ANY (ARRAY(SELECT l.id FROM locked l WHERE l.slot = 0))
        RETURNING w.aggregate_type, w.aggregate_id
    ), consumed1 AS (
        DELETE FROM outbox_wakeups w WHERE w.slot = 1 AND w.id = ANY (ARRAY(SELECT l.id FROM locked l WHERE l.slot = 1))
        RETURNING w.aggregate_type, w.aggregate_id
    ), consumed2 AS (
        DELETE FROM outbox_wakeups w WHERE w.slot = 2 AND w.id = ANY (ARRAY(SELECT l.id FROM locked l WHERE l.slot = 2))
        RETURNING w.aggregate_type, w.aggregate_id
    ), agg AS (
        SELECT c.aggregate_type, c.aggregate_id FROM consumed c
        UNION
        SELECT c.aggregate_type, c.aggregate_id FROM consumed1 c
        UNION
        SELECT c.aggregate_type, c.aggregate_id FROM consumed2 c
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
    SELECT count(*) INTO woken FROM upserted;
    RETURN woken;
END
$wake$;
-- +goose StatementEnd

-- outbox_truncate_wakeups truncates the slot producers come back to next,
-- if nothing can be lost (see above), and says whether it did. SECURITY
-- DEFINER: the dispatcher gets no TRUNCATE right on any table.
-- +goose StatementBegin
CREATE FUNCTION outbox_truncate_wakeups() RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER AS $truncate$
DECLARE
    -- Seconds into the current slot's 2 s, and the slot after it.
    at double precision := extract(epoch FROM clock_timestamp());
    into_slot double precision := at - floor(at / 2) * 2;
    target smallint := ((floor(at / 2)::bigint + 1) % 3)::smallint;
    part text := 'outbox_wakeups_' || target;
BEGIN
    -- Producers start on the target 2 s - into_slot from now: leave it 1 s.
    IF into_slot > 1 OR current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN false;
    END IF;
    -- Already truncated and nothing written since: no new files needed.
    IF pg_relation_size(part::regclass) = 0 THEN
        RETURN false;
    END IF;
    BEGIN
        -- NOWAIT: a lock request that waited would hold up every claim
        -- (they read all slots) until it was granted.
        EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE NOWAIT', part);
    EXCEPTION WHEN lock_not_available THEN
        RETURN false; -- someone holds it: a later call tries again
    END;
    -- A snapshot taken now sees every wake-up the slot will ever hold from
    -- before the lock. (Another dispatcher may have truncated it while this
    -- one waited: then there is nothing to do.)
    IF pg_relation_size(part::regclass) = 0 OR EXISTS (SELECT 1 FROM outbox_wakeups WHERE slot = target) THEN
        RETURN false; -- not consumed yet: it stays until it is
    END IF;
    EXECUTE format('TRUNCATE %I', part);
    RETURN true;
END
$truncate$;
-- +goose StatementEnd
-- +goose StatementBegin
DO $definer$
BEGIN
    EXECUTE format('ALTER FUNCTION %I.outbox_truncate_wakeups() SET search_path = %I, pg_temp',
                   current_schema(), current_schema());
END
$definer$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION outbox_truncate_wakeups() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_truncate_wakeups() TO fifobox_dispatcher;

-- +goose Down
LOCK TABLE outbox_wakeups IN ACCESS EXCLUSIVE MODE;
DROP FUNCTION outbox_truncate_wakeups();
ALTER TABLE outbox_wakeups RENAME TO outbox_wakeups_00064;
CREATE TABLE outbox_wakeups (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL
);
ALTER TABLE outbox_wakeups SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000);
INSERT INTO outbox_wakeups (id, aggregate_type, aggregate_id) OVERRIDING SYSTEM VALUE
SELECT id, aggregate_type, aggregate_id FROM outbox_wakeups_00064 ORDER BY id;
SELECT setval(pg_get_serial_sequence('outbox_wakeups', 'id'),
              coalesce((SELECT max(id) FROM outbox_wakeups_00064), 0) + 1, false);
DROP TABLE outbox_wakeups_00064;
DROP FUNCTION outbox_wakeup_slot();
GRANT SELECT, UPDATE, DELETE ON outbox_wakeups TO fifobox_dispatcher;
GRANT SELECT ON outbox_wakeups TO fifobox_operations;
-- outbox_consume_wakeups as in 00062.
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
    WHERE h.state = 'idle'
    RETURNING 1
)
SELECT count(*) FROM upserted
$wake$;
-- +goose StatementEnd
