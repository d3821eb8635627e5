-- +goose Up

-- Only the enqueue path writes events (issue 27, item 1). Before this
-- migration fifobox_producer could update outbox_aggregates and insert any
-- outbox column: it could rewind another aggregate's last_seq (the next
-- event then reused a sequence and was never published), insert a 'dead'
-- or 'sent' row, and an INSERT INTO outbox by anything but Enqueue (a
-- hand-written producer, a data fix, a restore script, a bulk load) wrote
-- no wake-up and was never published, silently.
--
-- Now:
--   * (aggregate_type, aggregate_id, aggregate_seq) is unique: no sequence
--     is ever used twice, whoever writes.
--   * Producers have no right on outbox_aggregates or outbox_wakeups, and
--     may insert only an event's own columns into outbox (not its sequence,
--     state, attempts, lease or timestamps).
--   * outbox.Enqueue, fifobox_enqueue and fifobox_enqueue_batch all go
--     through fifobox_enqueue_events, which now calls fifobox_enqueue_rows,
--     its former body as SECURITY DEFINER: it validates, reserves the
--     sequences, builds the bodies and writes the wake-ups with the owner's
--     rights, and nothing else can.
--   * Any other insert that leaves aggregate_seq unset (every producer's
--     direct INSERT, and the owner's) goes through outbox_guard_insert, a
--     BEFORE INSERT trigger: it validates the event as Enqueue does, takes
--     the aggregate's next sequence (row-locking the counter until commit,
--     so sequence order is commit order), rewrites the body as Enqueue
--     writes it, with that sequence, and writes the wake-up. Such an event
--     is published like any other, in order. The condition on the trigger
--     keeps it off the enqueue functions' path, which assigns sequences
--     itself.
--   * Only an insert that sets aggregate_seq itself (the table owner,
--     e.g. a restore that keeps sequences) skips all of this. The trigger
--     records such a row in outbox_unannounced (fifobox_enqueue_rows, which
--     sets fifobox.writer, is not recorded): one still unsent and
--     unreachable after 5 minutes counts as stranded in `fifobox status`
--     and the OutboxStrandedEvents alarm (sqlStats in pkg/outbox/sql.go:
--     O(recorded rows), as the outbox has no index on unsent events since
--     00030), and `fifobox repair-heads` (outbox_repair_heads) makes it
--     claimable and clears the record.
--
-- The other roles (00011) lose what their job does not need:
--   fifobox_dispatcher may update only the columns a mark writes (state,
--     sent_at, attempts, last_error and the old claim's lease columns): it
--     can no longer rewrite an event's body, id, aggregate or sequence.
--   fifobox_operations no longer updates or deletes events directly:
--     requeue, discard and prune are SECURITY DEFINER functions that touch
--     only dead events (requeue, discard) or sent and discarded ones
--     (prune), so it can neither rewrite a body nor delete or mark sent an
--     event that is still to be published.
--   fifobox_consumer has no right on any outbox table (unchanged).
--
-- Upgrading: producers that log in as fifobox_producer must run a fifobox
-- library whose Enqueue calls fifobox_enqueue_events (this version) before
-- this migration runs; the previous Enqueue wrote outbox_aggregates itself
-- and is refused from here on. The new Enqueue works before and after it
-- (TestEnqueueAcrossTheGuardMigration). SQL producers are unaffected.
--
-- Every SECURITY DEFINER function here runs with search_path pinned to the
-- schema the migration runs in (and pg_temp last), so a caller's
-- search_path cannot substitute its own tables or functions.

-- The same name and definition as any other migration that creates it.
CREATE UNIQUE INDEX IF NOT EXISTS outbox_aggregate_seq_key ON outbox (aggregate_type, aggregate_id, aggregate_seq);

-- outbox_guard_insert makes an event inserted without a sequence what
-- Enqueue would have written (a row inserted with one, by the owner, is
-- only recorded in outbox_unannounced, below). The body must be the event's envelope, a
-- JSON object with the envelope's members (as fifobox_enqueue_batch takes
-- them; v, if present, must be 1, and sequence is ignored: the outbox
-- assigns it, as Go's Enqueue ignores Envelope.Sequence). A column left out
-- of the INSERT is taken from the body; a column given must agree with it.
-- Errors are Enqueue's (SQLSTATE 22004, 22023, 54000 naming the field).
-- +goose StatementBegin
CREATE FUNCTION outbox_guard_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $f$
DECLARE
    doc json;
    stripped json;
    id text;
    typ text;
    occurred timestamptz;
    agg_type text;
    agg_id text;
    tenant text;
    tp text;
    payload text;
    sv bigint;
    problem text[];
    head text;
    tail text;
    sized bigint;
    seq bigint;
BEGIN
    IF NEW.aggregate_seq IS NOT NULL THEN
        -- Written around the enqueue path (only the owner can set it):
        -- kept as written, and recorded for the stranded figure.
        INSERT INTO outbox_unannounced (event_row, aggregate_type, aggregate_id, aggregate_seq, created_at)
        VALUES (NEW.id, NEW.aggregate_type, NEW.aggregate_id, NEW.aggregate_seq, coalesce(NEW.created_at, now()))
        ON CONFLICT (event_row) DO NOTHING;
        RETURN NEW;
    END IF;
    BEGIN
        doc := convert_from(NEW.body, 'UTF8')::json;
    EXCEPTION WHEN others THEN
        doc := NULL;
    END;
    IF doc IS NULL OR json_typeof(doc) <> 'object' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', COLUMN = 'body',
            MESSAGE = 'outbox insert: body: must be the event''s envelope, a JSON object in UTF-8';
    END IF;
    IF doc -> 'v' IS NOT NULL AND json_typeof(doc -> 'v') <> 'null' AND (doc ->> 'v') <> '1' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', COLUMN = 'v',
            MESSAGE = 'outbox insert: body: v: field is invalid: must be 1';
    END IF;
    -- The envelope's own members, as fifobox_enqueue_batch checks them.
    SELECT coalesce(json_object_agg(m.key, m.value ORDER BY m.o), '{}'::json) INTO stripped
    FROM json_each(doc) WITH ORDINALITY AS m(key, value, o)
    WHERE m.key NOT IN ('v', 'sequence');
    PERFORM fifobox_check_batch_shape(json_build_array(stripped));

    id := coalesce(stripped ->> 'id', NEW.event_id::text);
    typ := coalesce(stripped ->> 'type', NEW.event_type);
    agg_type := coalesce(stripped ->> 'aggregate_type', NEW.aggregate_type);
    agg_id := coalesce(stripped ->> 'aggregate_id', NEW.aggregate_id);
    tenant := coalesce(stripped ->> 'tenant_id', NEW.tenant_id);
    tp := coalesce(stripped ->> 'traceparent', NEW.traceparent);
    sv := coalesce((stripped ->> 'schema_version')::bigint, 1);
    payload := (stripped -> 'payload')::text;
    IF stripped ->> 'occurred_at' IS NULL THEN
        occurred := NEW.occurred_at;
    ELSE
        BEGIN
            -- Microseconds kept, finer digits dropped, as Enqueue stores them.
            occurred := regexp_replace(stripped ->> 'occurred_at', '(\.[0-9]{6})[0-9]+', '\1')::timestamptz;
        EXCEPTION WHEN others THEN
            PERFORM fifobox_raise_invalid(0, ARRAY['occurred_at', 'invalid', 'must be an RFC 3339 timestamp']);
        END;
    END IF;
    problem := fifobox_event_problem(coalesce(id, ''), typ, coalesce(occurred, timestamptz '0001-01-01 00:00:00+00'),
        agg_type, agg_id, tenant, stripped ->> 'correlation_id', stripped ->> 'causation_id', tp,
        stripped ->> 'tracestate', sv, payload);
    IF problem IS NOT NULL THEN
        PERFORM fifobox_raise_invalid(0, problem);
    END IF;
    -- A column given must say what the body says: the row is what the
    -- dispatcher routes by (group id, attributes), the body what consumers read.
    IF NEW.event_id IS DISTINCT FROM NULL AND NEW.event_id <> id::uuid THEN
        problem := ARRAY['id', 'event_id'];
    ELSIF NEW.event_type IS NOT NULL AND NEW.event_type <> typ THEN
        problem := ARRAY['type', 'event_type'];
    ELSIF NEW.aggregate_type IS NOT NULL AND NEW.aggregate_type <> agg_type THEN
        problem := ARRAY['aggregate_type', 'aggregate_type'];
    ELSIF NEW.aggregate_id IS NOT NULL AND NEW.aggregate_id <> agg_id THEN
        problem := ARRAY['aggregate_id', 'aggregate_id'];
    ELSIF NEW.occurred_at IS NOT NULL AND NEW.occurred_at <> occurred THEN
        problem := ARRAY['occurred_at', 'occurred_at'];
    ELSIF coalesce(NEW.tenant_id, '') <> coalesce(tenant, '') THEN
        problem := ARRAY['tenant_id', 'tenant_id'];
    ELSIF coalesce(NEW.traceparent, '') <> coalesce(tp, '') THEN
        problem := ARRAY['traceparent', 'traceparent'];
    END IF;
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22023', COLUMN = problem[2],
            MESSAGE = format('outbox insert: %s: the column and the body''s %s differ', problem[2], problem[1]);
    END IF;

    -- The body as envelope.Encode writes it (fifobox_enqueue_events builds
    -- it the same way), sized as Validate sizes it.
    head := '{"v":1,"id":' || fifobox_json_string(id)
        || ',"type":' || fifobox_json_string(typ)
        || ',"occurred_at":"' || to_char(occurred AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
        || coalesce('.' || nullif(rtrim(lpad((extract(microseconds FROM occurred)::bigint % 1000000)::text, 6, '0'), '0'), ''), '')
        || 'Z","aggregate_type":' || fifobox_json_string(agg_type)
        || ',"aggregate_id":' || fifobox_json_string(agg_id)
        || ',"sequence":';
    tail := coalesce(',"tenant_id":' || fifobox_json_string(nullif(tenant, '')), '')
        || coalesce(',"correlation_id":' || fifobox_json_string(nullif(stripped ->> 'correlation_id', '')), '')
        || coalesce(',"causation_id":' || fifobox_json_string(nullif(stripped ->> 'causation_id', '')), '')
        || coalesce(',"traceparent":' || fifobox_json_string(nullif(tp, '')), '')
        || coalesce(',"tracestate":' || fifobox_json_string(nullif(stripped ->> 'tracestate', '')), '')
        || ',"schema_version":' || sv
        || ',"payload":' || CASE WHEN payload ~ '[ \t\n\r]'
                                 THEN regexp_replace(payload, '("(?:[^"\\]|\\.)*")|[ \t\n\r]+', '\1', 'g')
                                 ELSE payload END || '}';
    sized := octet_length(head) + 19 + octet_length(tail)
        + 16 + octet_length(typ) + 20 + octet_length(agg_type)
        + coalesce(15 + octet_length(nullif(tenant, '')), 0)
        + coalesce(17 + octet_length(nullif(tp, '')), 0);
    IF sized > 262144 THEN
        PERFORM fifobox_raise_invalid(0, ARRAY['payload', 'too_large',
            format('message would be %s bytes, limit is %s', sized, 262144)]);
    END IF;

    -- The next sequence: the upsert row-locks the aggregate's counter until
    -- commit, as Enqueue's reservation does.
    INSERT INTO outbox_aggregates AS oa (aggregate_type, aggregate_id, last_seq)
    VALUES (agg_type, agg_id, 1)
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = oa.last_seq + 1
    RETURNING oa.last_seq INTO seq;
    INSERT INTO outbox_wakeups (aggregate_type, aggregate_id) VALUES (agg_type, agg_id);

    NEW.event_id := id::uuid;
    NEW.event_type := typ;
    NEW.aggregate_type := agg_type;
    NEW.aggregate_id := agg_id;
    NEW.aggregate_seq := seq;
    NEW.tenant_id := nullif(tenant, '');
    NEW.traceparent := nullif(tp, '');
    NEW.occurred_at := occurred;
    NEW.body := convert_to(head || seq || tail, 'UTF8');
    RETURN NEW;
END
$f$;
-- +goose StatementEnd

-- Rows written with aggregate_seq set, other than by the enqueue functions:
-- what the stranded figure looks at (see above). Rows, not aggregates: a
-- restore's events each get one; outbox_repair_heads empties it.
CREATE TABLE outbox_unannounced (
    event_row      bigint      PRIMARY KEY, -- outbox.id
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    aggregate_seq  bigint      NOT NULL,
    created_at     timestamptz NOT NULL
);
GRANT SELECT ON outbox_unannounced TO fifobox_dispatcher, fifobox_operations;

-- The enqueue functions say who they are (fifobox.writer, set for their
-- call only: see the DO block below), so the trigger stays off their path.
CREATE TRIGGER outbox_guard_insert BEFORE INSERT ON outbox
    FOR EACH ROW WHEN (NEW.aggregate_seq IS NULL OR current_setting('fifobox.writer', true) IS DISTINCT FROM 'enqueue')
    EXECUTE FUNCTION outbox_guard_insert();

-- outbox_repair_heads is outbox_rebuild_heads (every aggregate with an
-- unsent event gets a head at its lowest one; safe while dispatchers run)
-- that also clears the record of rows written around the enqueue path,
-- claimable from now on. What `fifobox repair-heads` and
-- outbox.RebuildHeads run.
-- +goose StatementBegin
CREATE FUNCTION outbox_repair_heads() RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER AS $repair$
DECLARE
    n bigint;
BEGIN
    n := outbox_rebuild_heads();
    DELETE FROM outbox_unannounced;
    RETURN n;
END
$repair$;
-- +goose StatementEnd

-- outbox_prune is the prune statement of pkg/outbox (migrations/00030's
-- watermark: an event is sent when below its head's next_seq) as a
-- function, because the operations role that runs it has no DELETE on the
-- outbox: among the max_rows rows after id after_id it deletes the sent and
-- discarded ones created (legacy 'sent' rows: sent) before cutoff, and
-- returns how many, the last id it looked at (NULL: end of the table) and
-- whether it saw a row younger than cutoff (ids grow with time: nothing
-- further is old enough). One primary-key probe of outbox_heads per row.
-- +goose StatementBegin
CREATE FUNCTION outbox_prune(after_id bigint, max_rows integer, cutoff timestamptz)
RETURNS TABLE (deleted bigint, last_id bigint, young boolean)
LANGUAGE sql VOLATILE SECURITY DEFINER AS $prune$
WITH w AS MATERIALIZED (
    SELECT o.id, o.state, o.aggregate_type, o.aggregate_id, o.aggregate_seq, o.created_at, o.sent_at
    FROM outbox o WHERE o.id > after_id ORDER BY o.id LIMIT max_rows
), del AS (
    DELETE FROM outbox d USING w
    WHERE d.id = w.id
      AND CASE WHEN w.state IN ('sent', 'discarded') THEN coalesce(w.sent_at, w.created_at) < cutoff
               WHEN w.state = 'pending' THEN w.created_at < cutoff
                    AND w.aggregate_seq < (SELECT h.next_seq FROM outbox_heads h
                                           WHERE h.aggregate_type = w.aggregate_type AND h.aggregate_id = w.aggregate_id)
               ELSE false END
    RETURNING 1
)
SELECT (SELECT count(*) FROM del), (SELECT max(id) FROM w),
       coalesce((SELECT bool_or(CASE WHEN state IN ('sent', 'discarded') THEN coalesce(sent_at, created_at) ELSE created_at END >= cutoff)
                 FROM w), false)
$prune$;
-- +goose StatementEnd

-- fifobox_enqueue_rows is fifobox_enqueue_events (00013, 00014) run with
-- the owner's rights: the same body, copied from the catalog, as a SECURITY
-- DEFINER function whose search_path is this schema and then pg_temp (a
-- caller's temporary table named outbox_aggregates or outbox must not stand
-- in for fifobox's). fifobox_enqueue_events becomes a wrapper that calls it,
-- so every entry point (Go's Enqueue, fifobox_enqueue, fifobox_enqueue_batch)
-- keeps its name and signature; settings later migrations put on the entry
-- points (00052's search_path) leave this one alone.
-- +goose StatementBegin
DO $rows$
DECLARE
    f record;
BEGIN
    SELECT p.oid, pg_get_function_arguments(p.oid) AS args, pg_get_function_result(p.oid) AS result, p.prosrc
    INTO f
    FROM pg_proc p
    WHERE p.pronamespace = current_schema()::regnamespace AND p.proname = 'fifobox_enqueue_events';
    EXECUTE format($create$CREATE FUNCTION %I.fifobox_enqueue_rows(%s) RETURNS %s
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = %I, pg_temp SET fifobox.writer = 'enqueue'
        AS %L$create$, current_schema(), f.args, f.result, current_schema(), f.prosrc);
    EXECUTE format($wrap$CREATE OR REPLACE FUNCTION %I.fifobox_enqueue_events(%s) RETURNS %s
        LANGUAGE plpgsql VOLATILE AS $body$
BEGIN
    RETURN QUERY SELECT * FROM fifobox_enqueue_rows(ids, types, occurred, agg_types, agg_ids, tenants, correlations,
        causations, traceparents, tracestates, schema_versions, payloads, max_message_bytes);
END
$body$$wrap$, current_schema(), f.args, f.result);
    EXECUTE format('REVOKE ALL ON FUNCTION %I.fifobox_enqueue_rows(%s) FROM PUBLIC', current_schema(),
                   pg_get_function_identity_arguments(f.oid));
    EXECUTE format('GRANT EXECUTE ON FUNCTION %I.fifobox_enqueue_rows(%s) TO fifobox_producer', current_schema(),
                   pg_get_function_identity_arguments(f.oid));
END
$rows$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $guard$
DECLARE
    f regprocedure;
BEGIN
    -- Pin each SECURITY DEFINER function's search_path to this schema.
    -- outbox_requeue_dead and outbox_discard_dead (00009) become SECURITY
    -- DEFINER too; they are found by name so that a later signature (another
    -- migration's CREATE OR REPLACE) is covered as well.
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace
               AND p.proname IN ('outbox_guard_insert', 'outbox_prune', 'outbox_repair_heads',
                                 'outbox_requeue_dead', 'outbox_discard_dead') LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace
               AND p.proname IN ('outbox_requeue_dead', 'outbox_discard_dead', 'outbox_prune', 'outbox_repair_heads') LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO fifobox_operations', f);
    END LOOP;
END
$guard$;
-- +goose StatementEnd

-- Producers: an event's own columns only (the trigger or the enqueue
-- functions do the rest).
REVOKE ALL ON outbox_aggregates FROM fifobox_producer;
REVOKE INSERT ON outbox, outbox_wakeups FROM fifobox_producer;
GRANT INSERT (event_id, event_type, aggregate_type, aggregate_id, tenant_id, traceparent, occurred_at, body)
    ON outbox TO fifobox_producer;

-- Dispatcher: the columns a mark writes (and 00006's lease columns).
REVOKE UPDATE ON outbox FROM fifobox_dispatcher;
GRANT UPDATE (state, sent_at, attempts, last_error, claim_token, next_attempt_at) ON outbox TO fifobox_dispatcher;

-- Operations: through outbox_requeue_dead, outbox_discard_dead, outbox_prune
-- and outbox_repair_heads.
REVOKE UPDATE, DELETE ON outbox FROM fifobox_operations;

-- +goose Down
GRANT UPDATE, DELETE ON outbox TO fifobox_operations;
REVOKE UPDATE (state, sent_at, attempts, last_error, claim_token, next_attempt_at) ON outbox FROM fifobox_dispatcher;
GRANT UPDATE ON outbox TO fifobox_dispatcher;
REVOKE INSERT (event_id, event_type, aggregate_type, aggregate_id, tenant_id, traceparent, occurred_at, body)
    ON outbox FROM fifobox_producer;
GRANT SELECT, INSERT, UPDATE ON outbox_aggregates TO fifobox_producer;
GRANT INSERT ON outbox, outbox_wakeups TO fifobox_producer;
-- +goose StatementBegin
DO $unguard$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace
               AND p.proname IN ('outbox_requeue_dead', 'outbox_discard_dead') LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY INVOKER RESET ALL', f);
    END LOOP;
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace
               AND p.proname IN ('outbox_requeue_dead', 'outbox_discard_dead') LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', f);
    END LOOP;
END
$unguard$;
-- +goose StatementEnd
-- fifobox_enqueue_events gets its body back (later migrations' settings on
-- it were reset by their own Down, which ran first).
-- +goose StatementBegin
DO $rows$
DECLARE
    f record;
BEGIN
    SELECT p.oid, pg_get_function_arguments(p.oid) AS args, pg_get_function_result(p.oid) AS result, p.prosrc
    INTO f
    FROM pg_proc p
    WHERE p.pronamespace = current_schema()::regnamespace AND p.proname = 'fifobox_enqueue_rows';
    EXECUTE format('CREATE OR REPLACE FUNCTION %I.fifobox_enqueue_events(%s) RETURNS %s LANGUAGE plpgsql VOLATILE AS %L',
                   current_schema(), f.args, f.result, f.prosrc);
    EXECUTE format('DROP FUNCTION %s', f.oid::regprocedure);
END
$rows$;
-- +goose StatementEnd
DROP FUNCTION outbox_prune(bigint, integer, timestamptz);
DROP FUNCTION outbox_repair_heads();
DROP TRIGGER outbox_guard_insert ON outbox;
DROP FUNCTION outbox_guard_insert();
DROP TABLE outbox_unannounced;
-- The unique index stays: another migration may have created it, and
-- nothing written under it breaks without it.
