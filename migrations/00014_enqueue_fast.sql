-- +goose Up

-- Faster enqueue from SQL (issue 19): the same functions, signatures,
-- rules, errors and rows as 00013, with the work per event cut down.
--
-- 00013 checked each event in its own PL/pgSQL calls and read the JSON
-- array member by member, several times over. Now each entry point first
-- runs a quick check over all events in one statement: conditions that
-- hold for nearly every valid event and are cheap to test (no number near
-- the float64 limit, no more than 32 brackets, no ':' written as an
-- escape). Each condition implies the rule it stands for, so the quick
-- check never passes what the full one rejects. When it passes, the full
-- check is skipped; when it fails, 00013's full check runs as before and
-- either raises the exact error (same SQLSTATE, field and message) or finds
-- the events valid after all (the quick check was only unsure). A rule
-- changed later changes here too: each quick condition must still imply
-- its rule.
--
-- What the quick payload check rests on:
-- - jsonb refuses \u0000 and unpaired surrogate escapes, so a payload jsonb
--   accepts passes those rules;
-- - every object member has one ':' outside strings, and jsonb keeps one
--   member per name, writing every other string back with the same ':'
--   (unless an escape wrote one, \u003a): so a member name appears twice
--   exactly when jsonb's text has fewer ':' than the payload. A batch
--   array without escapes has its own members checked the same way;
-- - a value nests at most as deep as it has '[' and '{' characters.

-- fifobox_check_batch_shape raises the first shape problem of a JSON array
-- of envelopes (00013's check, unchanged): in event and member order, an
-- element that is not an object, a member twice, unknown, of the wrong JSON
-- type, or of the wrong form.
-- +goose StatementBegin
CREATE FUNCTION fifobox_check_batch_shape(events json) RETURNS void
LANGUAGE plpgsql STABLE AS $f$
DECLARE
    strs text[] := ARRAY['id', 'type', 'occurred_at', 'aggregate_type', 'aggregate_id', 'tenant_id',
                         'correlation_id', 'causation_id', 'traceparent', 'tracestate'];
    bad record;
BEGIN
    SELECT a.o - 1 AS idx, p.field, p.reason INTO bad
    FROM json_array_elements(events) WITH ORDINALITY AS a(e, o)
    CROSS JOIN LATERAL (
        SELECT 'envelope'::text AS field, 'is not a JSON object'::text AS reason, 0::bigint AS pos
        WHERE json_typeof(a.e) <> 'object'
        UNION ALL
        SELECT key, reason, pos FROM (
            SELECT m.key, m.pos, CASE
                WHEN count(*) OVER (PARTITION BY m.key) > 1 THEN 'appears twice'
                WHEN NOT (m.key = ANY (strs) OR m.key IN ('schema_version', 'payload'))
                    THEN 'is not an envelope field (the outbox writes v and sequence)'
                WHEN json_typeof(m.value) = 'null' OR m.key = 'payload' THEN NULL
                WHEN m.key = 'schema_version' THEN
                    CASE WHEN json_typeof(m.value) <> 'number' OR m.value::text !~ '^-?[0-9]{1,18}$'
                         THEN 'must be 1 to 2147483647' END
                WHEN json_typeof(m.value) <> 'string' THEN format('has JSON type %s, want string', json_typeof(m.value))
                WHEN m.key = 'occurred_at' AND m.value::text
                    !~ '^"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})"$'
                    THEN 'must be an RFC 3339 timestamp'
                END AS reason
            FROM json_each(CASE WHEN json_typeof(a.e) = 'object' THEN a.e END) WITH ORDINALITY AS m(key, value, pos)
        ) x WHERE reason IS NOT NULL
    ) p
    ORDER BY a.o, p.pos LIMIT 1;
    IF FOUND THEN
        PERFORM fifobox_raise_invalid(bad.idx::integer, ARRAY[bad.field, 'invalid', bad.reason]);
    END IF;
END
$f$;
-- +goose StatementEnd

-- fifobox_raise_bad_escapes raises, for a batch array holding an escape
-- PostgreSQL's JSON functions refuse (\u0000, an unpaired surrogate: they
-- fail with 22P05 / 22P02 wherever the array is read), the error
-- fifobox_enqueue would: the first invalid field, in Go's order, with its
-- reason. It marks each such escape with one they accept, reads the array,
-- puts the escapes back into the payloads and lets the per-event checks
-- raise. It returns only when the array has no such escape.
-- +goose StatementBegin
CREATE FUNCTION fifobox_raise_bad_escapes(events json, max_message_bytes integer) RETURNS void
LANGUAGE plpgsql AS $f$
DECLARE
    marked text;
    e json;
    idx integer := 0;
    ids text[] := '{}'; types text[] := '{}'; occurred timestamptz[] := '{}'; agg_types text[] := '{}';
    agg_ids text[] := '{}'; tenants text[] := '{}'; correlations text[] := '{}'; causations text[] := '{}';
    traceparents text[] := '{}'; tracestates text[] := '{}'; versions bigint[] := '{}'; payloads text[] := '{}';
    x record;
BEGIN
    -- An escape counts only after an even run of backslashes ("\\u0000" is
    -- text, not an escape). \u0001\u0002 stands for \u0000, \u0001\u0003
    -- for an unpaired surrogate.
    marked := regexp_replace(events::text, '(?<!\\)((?:\\\\)*)\\u0000', '\1\\u0001\\u0002', 'g');
    marked := regexp_replace(marked, '(?<!\\)((?:\\\\)*)\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})',
        '\1\\u0001\\u0003', 'g');
    marked := regexp_replace(marked, '(?<!\\)((?:\\\\)*)(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}',
        '\1\\u0001\\u0003', 'g');
    IF marked = events::text THEN
        RETURN;
    END IF;
    PERFORM fifobox_check_batch_shape(marked::json);
    FOR e IN SELECT value FROM json_array_elements(marked::json) LOOP
        SELECT * INTO x FROM json_to_record(e) AS r(id text, type text, occurred_at text, aggregate_type text,
            aggregate_id text, tenant_id text, correlation_id text, causation_id text, traceparent text,
            tracestate text, schema_version bigint);
        BEGIN
            occurred := occurred || regexp_replace(x.occurred_at, '(\.[0-9]{6})[0-9]+', '\1')::timestamptz;
        EXCEPTION WHEN others THEN
            PERFORM fifobox_raise_invalid(idx, ARRAY['occurred_at', 'invalid', 'must be an RFC 3339 timestamp']);
        END;
        ids := ids || x.id; types := types || x.type; agg_types := agg_types || x.aggregate_type;
        agg_ids := agg_ids || x.aggregate_id; tenants := tenants || x.tenant_id;
        correlations := correlations || x.correlation_id; causations := causations || x.causation_id;
        traceparents := traceparents || x.traceparent; tracestates := tracestates || x.tracestate;
        versions := versions || x.schema_version;
        payloads := payloads || replace(replace((e -> 'payload')::text, '\u0001\u0002', '\u0000'), '\u0001\u0003', '\ud800');
        idx := idx + 1;
    END LOOP;
    PERFORM fifobox_enqueue_events(ids, types, occurred, agg_types, agg_ids, tenants, correlations,
        causations, traceparents, tracestates, versions, payloads, max_message_bytes);
    -- Not reached while the payload rules refuse those escapes; never let
    -- the batch through if they stop doing so.
    RAISE EXCEPTION USING ERRCODE = '22023', COLUMN = 'events',
        MESSAGE = 'enqueue: events: a string holds \u0000 or an unpaired surrogate escape, which PostgreSQL cannot store';
END
$f$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fifobox_enqueue_events(ids text[], types text[], occurred timestamptz[], agg_types text[], agg_ids text[],
    tenants text[], correlations text[], causations text[], traceparents text[], tracestates text[],
    schema_versions bigint[], payloads text[], max_message_bytes integer)
RETURNS TABLE (event_id uuid, sequence bigint)
LANGUAGE plpgsql VOLATILE AS $f$
#variable_conflict use_column
DECLARE
    n integer := cardinality(types);
    parsed jsonb[];        -- the payloads as jsonb; NULL if one is not JSON jsonb can hold
    all_plain boolean;     -- every event passed the quick check, and no id repeats
    problem text[];
    heads text[];          -- each event's body up to its sequence
    tails text[];          -- and after it
    sizes bigint[];        -- each message's size as Validate counts it
    seqs bigint[];
    dup_at bigint;
    dup_of bigint;
    payloads_json boolean;
BEGIN
    IF max_message_bytes IS NULL OR max_message_bytes < 1 OR max_message_bytes > 262144 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', COLUMN = 'max_message_bytes',
            MESSAGE = format('enqueue: max_message_bytes %s: must be 1-262144 (the SNS message limit)', max_message_bytes);
    END IF;
    IF n IS NULL OR n = 0 THEN
        RETURN;
    END IF;
    FOR i IN 1..n LOOP
        ids[i] := coalesce(ids[i], fifobox_uuidv7()::text);
        occurred[i] := coalesce(occurred[i], clock_timestamp());
        schema_versions[i] := coalesce(schema_versions[i], 1);
    END LOOP;
    -- Parse every payload in one go (one subtransaction, not one each).
    BEGIN
        parsed := payloads::jsonb[];
    EXCEPTION WHEN others THEN
        parsed := NULL; -- not JSON, \u0000, a lone surrogate, or a number beyond numeric's range
    END;

    -- The bodies, field for field as envelope.Encode writes them (Go's
    -- json.Encoder, HTML escaping off, payload compacted), built once each
    -- (MATERIALIZED: inlined, each use would build them again); sized with
    -- the widest sequence, as Validate does before the outbox numbers the
    -- event, attributes as envelope.AttributesSize counts them; and the
    -- quick check.
    WITH body AS MATERIALIZED (
        SELECT u.*,
            -- id, type and aggregate_type need no escaping in any event that
            -- gets written: their rules allow no " or \.
            '{"v":1,"id":"' || id
            || '","type":"' || ty
            || '","occurred_at":"' || to_char(oc AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
            || coalesce('.' || nullif(rtrim(lpad((extract(microseconds FROM oc)::bigint % 1000000)::text, 6, '0'), '0'), ''), '')
            || 'Z","aggregate_type":"' || at
            || '","aggregate_id":' || fifobox_json_string(ai)
            || ',"sequence":' AS head,
            coalesce(',"tenant_id":' || fifobox_json_string(nullif(te, '')), '')
            || coalesce(',"correlation_id":' || fifobox_json_string(nullif(co, '')), '')
            || coalesce(',"causation_id":' || fifobox_json_string(nullif(ca, '')), '')
            || coalesce(',"traceparent":' || fifobox_json_string(nullif(tp, '')), '')
            || coalesce(',"tracestate":' || fifobox_json_string(nullif(tr, '')), '')
            || ',"schema_version":' || sv
            || ',"payload":' || CASE WHEN p ~ '[ \t\n\r]'
                                     THEN regexp_replace(p, '("(?:[^"\\]|\\.)*")|[ \t\n\r]+', '\1', 'g')
                                     ELSE p END || '}' AS tail
        FROM unnest(ids, types, occurred, agg_types, agg_ids, tenants, correlations, causations, traceparents,
                    tracestates, schema_versions, payloads, parsed)
            WITH ORDINALITY AS u(id, ty, oc, at, ai, te, co, ca, tp, tr, sv, p, jb, o)
        WHERE o <= n
        ORDER BY o -- the arrays below follow it (one sort, not one per array)
    ), sized AS (
        SELECT body.*, octet_length(head) + 19 + octet_length(tail)
            + 16 + octet_length(ty) + 20 + octet_length(at)
            + coalesce(15 + octet_length(nullif(te, '')), 0)
            + coalesce(17 + octet_length(nullif(tp, '')), 0) AS size
        FROM body
    )
    SELECT bool_and(coalesce(
            -- envelope.Validate's field rules where the common case is simple
            -- (fifobox_event_problem has them all); a UUID's 8-4-4-4-12 by
            -- lengths, as counted repeats are slow in PostgreSQL's regular
            -- expressions
            octet_length(id) = 36 AND id ~ '^[0-9a-fA-F]+-[0-9a-fA-F]+-[0-9a-fA-F]+-[0-9a-fA-F]+-[0-9a-fA-F]+$'
            AND substr(id, 9, 1) || substr(id, 14, 1) || substr(id, 19, 1) || substr(id, 24, 1) = '----'
            AND octet_length(ty) <= 256 AND ty ~ '^[A-Za-z0-9._:/-]+$'
            AND oc > timestamptz '0001-01-01 00:00:00+00' AND oc < timestamptz '10000-01-01 00:00:00+00'
            AND octet_length(at) <= 128 AND at ~ '^[A-Za-z0-9._:/-]+$'
            AND octet_length(ai) <= 128 AND ai ~ '^[!-~]+$'
            AND (te IS NULL OR (char_length(te) <= 128 AND te !~ '[\x01-\x1f\x7f]'))
            AND (co IS NULL OR (octet_length(co) <= 128 AND co ~ '^[!-~]*$'))
            AND (ca IS NULL OR (octet_length(ca) <= 128 AND ca ~ '^[!-~]*$'))
            AND (coalesce(tp, '') = '' OR fifobox_traceparent_ok(tp))
            AND (coalesce(tr, '') = '' OR (coalesce(tp, '') <> '' AND fifobox_tracestate_ok(tr)))
            AND sv BETWEEN 1 AND 2147483647
            -- the payload rules (fifobox_payload_problem): JSON jsonb can
            -- hold, not null, at most 32 deep, numbers within float64 (only
            -- one with an exponent or over 308 digits can be out), no member
            -- name twice
            AND jsonb_typeof(jb) <> 'null'
            AND octet_length(p) - octet_length(replace(replace(p, '[', ''), '{', '')) <= 32
            AND ((octet_length(p) <= 308 AND p !~ '[0-9][eE]')
                 OR NOT jb @? 'strict $.** ? (@.type() == "number" && (@ >= 1e308 || @ <= -1e308))')
            AND (strpos(p, '\') = 0 OR p !~ '\\u003[aA]')
            AND octet_length(p) - octet_length(replace(p, ':', '')) = octet_length(jb::text) - octet_length(replace(jb::text, ':', ''))
            AND size <= max_message_bytes, false))
           AND count(DISTINCT id) = count(*),
           array_agg(head), array_agg(tail), array_agg(size)
    INTO all_plain, heads, tails, sizes
    FROM sized;

    IF all_plain IS NOT TRUE THEN
        -- Something is wrong, or the quick check could not tell: check event
        -- by event in Validate's order, for the error Go's Enqueue returns.
        -- The first event whose id an earlier one has is reported when the
        -- loop reaches it.
        IF n > 1 THEN
            SELECT o, first_o INTO dup_at, dup_of
            FROM (SELECT o, min(o) OVER (PARTITION BY id) AS first_o
                  FROM unnest(ids) WITH ORDINALITY AS u(id, o) WHERE id IS NOT NULL) d
            WHERE o > first_o ORDER BY o LIMIT 1;
        END IF;
        -- Every payload JSON: saves fifobox_payload_problem a
        -- subtransaction per event.
        payloads_json := parsed IS NOT NULL;
        IF NOT payloads_json THEN
            BEGIN
                PERFORM payloads::json[];
                payloads_json := true;
            EXCEPTION WHEN others THEN
                payloads_json := false;
            END;
        END IF;
        FOR i IN 1..n LOOP
            problem := fifobox_event_problem(ids[i], types[i], occurred[i], agg_types[i], agg_ids[i], tenants[i],
                correlations[i], causations[i], traceparents[i], tracestates[i], schema_versions[i], payloads[i], payloads_json);
            IF problem IS NOT NULL THEN
                PERFORM fifobox_raise_invalid(i - 1, problem);
            END IF;
            IF sizes[i] > max_message_bytes THEN
                PERFORM fifobox_raise_invalid(i - 1, ARRAY['payload', 'too_large',
                    format('message would be %s bytes, limit is %s', sizes[i], max_message_bytes)]);
            END IF;
            IF i = dup_at THEN
                PERFORM fifobox_raise_invalid(i - 1, ARRAY['id', 'invalid', format('same id as event %s', dup_of - 1)]);
            END IF;
        END LOOP;
    END IF;

    -- Reserve sequence ranges as outbox.Enqueue does (sqlReserveSeq):
    -- aggregates in byte order, so Go and SQL writers lock them in the same
    -- order and cannot deadlock; the row lock holds until the caller
    -- commits, so sequence order is commit order.
    WITH per AS (
        SELECT t, a, count(*) AS cnt FROM unnest(agg_types, agg_ids) AS u(t, a) GROUP BY t, a
    ), reserved AS (
        INSERT INTO outbox_aggregates AS oa (aggregate_type, aggregate_id, last_seq)
        SELECT t, a, cnt FROM per ORDER BY t COLLATE "C", a COLLATE "C"
        ON CONFLICT (aggregate_type, aggregate_id)
        DO UPDATE SET last_seq = oa.last_seq + EXCLUDED.last_seq
        RETURNING oa.aggregate_type, oa.aggregate_id, oa.last_seq
    ), numbered AS (
        SELECT u.o, r.last_seq - per.cnt
               + row_number() OVER (PARTITION BY u.t, u.a ORDER BY u.o) AS seq
        FROM unnest(agg_types, agg_ids) WITH ORDINALITY AS u(t, a, o)
        JOIN reserved r ON r.aggregate_type = u.t AND r.aggregate_id = u.a
        JOIN per ON per.t = u.t AND per.a = u.a
    )
    SELECT array_agg(seq ORDER BY o) INTO seqs FROM numbered;

    -- The insert and one wake-up per aggregate, as sqlInsertEvents.
    WITH wake AS (
        INSERT INTO outbox_wakeups (aggregate_type, aggregate_id)
        SELECT DISTINCT t, a FROM unnest(agg_types, agg_ids) AS u(t, a)
    )
    INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq,
                        tenant_id, traceparent, occurred_at, body)
    SELECT e::uuid, ty, at, ai, s, nullif(te, ''), nullif(tp, ''), oc, convert_to(h || s || tl, 'UTF8')
    FROM unnest(ids, types, agg_types, agg_ids, seqs, tenants, traceparents, occurred, heads, tails)
        WITH ORDINALITY AS u(e, ty, at, ai, s, te, tp, oc, h, tl, o)
    ORDER BY o;
    -- Not RETURNING: that needs SELECT on outbox, which producers lack.
    RETURN QUERY SELECT e::uuid, s FROM unnest(ids, seqs) WITH ORDINALITY AS u(e, s, o) ORDER BY o;
END
$f$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fifobox_enqueue_batch(events json, max_message_bytes integer DEFAULT 262144)
RETURNS TABLE (event_id uuid, sequence bigint)
LANGUAGE plpgsql VOLATILE AS $f$
#variable_conflict use_column
DECLARE
    doc jsonb;
    doc_text text;
    plain boolean := false; -- the shape is right, found by the quick check
    forms_ok boolean;
    string_payloads boolean; -- some payload is a JSON string
    e json;
    idx integer := 0;
    ids text[]; types text[]; occurred timestamptz[]; agg_types text[]; agg_ids text[]; tenants text[];
    correlations text[]; causations text[]; traceparents text[]; tracestates text[]; versions bigint[]; payloads text[];
BEGIN
    IF events IS NULL OR json_typeof(events) <> 'array' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', COLUMN = 'events',
            MESSAGE = 'enqueue: events: must be a JSON array of envelopes';
    END IF;
    -- The quick shape check, for an array without escapes (an escaped
    -- occurred_at can only be judged as written, and json_to_recordset
    -- gives strings unescaped): every element an object of envelope members
    -- only, each once (counted as for payloads, see the top of this file),
    -- of the right JSON type. The forms of occurred_at and schema_version
    -- are checked as they are read, below.
    IF strpos(events::text, '\') = 0 THEN
        BEGIN
            doc := events::jsonb;
        EXCEPTION WHEN others THEN
            doc := NULL; -- a number beyond numeric's range
        END;
        doc_text := doc::text;
        plain := doc IS NOT NULL
            AND octet_length(events::text) - octet_length(replace(events::text, ':', ''))
                = octet_length(doc_text) - octet_length(replace(doc_text, ':', ''))
            AND NOT EXISTS (
                SELECT FROM jsonb_array_elements(doc) AS a(e)
                WHERE CASE WHEN jsonb_typeof(e) <> 'object' THEN true
                      ELSE e - ARRAY['id', 'type', 'occurred_at', 'aggregate_type', 'aggregate_id', 'tenant_id', 'correlation_id',
                                     'causation_id', 'traceparent', 'tracestate', 'schema_version', 'payload'] <> '{}'
                        OR jsonb_typeof(e -> 'schema_version') NOT IN ('number', 'null')
                        OR (e - ARRAY['schema_version', 'payload']) @? 'strict $.* ? (@.type() != "string" && @.type() != "null")'
                      END);
    END IF;
    IF NOT plain THEN
        -- PostgreSQL cannot read an array holding \u0000 or an unpaired
        -- surrogate at all: say which event and field, as fifobox_enqueue does.
        IF events::text ~ '\\u(0000|[dD][89a-fA-F])' THEN
            PERFORM fifobox_raise_bad_escapes(events, max_message_bytes);
        END IF;
        PERFORM fifobox_check_batch_shape(events);
    END IF;
    BEGIN
        -- One pass over the array. schema_version is read as text: a
        -- number's text as written, for its form. Microseconds are kept and
        -- finer digits dropped rather than rounded, as Go's driver stores them.
        WITH x AS MATERIALIZED (
            SELECT x.*,
                (x.occurred_at IS NULL
                 OR x.occurred_at ~ '^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})$')
                AND (x.schema_version IS NULL OR x.schema_version ~ '^-?[0-9]{1,18}$') AS form_ok
            FROM ROWS FROM (json_to_recordset(events) AS (id text, type text, occurred_at text, aggregate_type text,
                aggregate_id text, tenant_id text, correlation_id text, causation_id text, traceparent text, tracestate text,
                schema_version text, payload json))
                WITH ORDINALITY AS x(id, type, occurred_at, aggregate_type, aggregate_id, tenant_id, correlation_id,
                    causation_id, traceparent, tracestate, schema_version, payload, o)
            ORDER BY x.o -- the arrays below follow it
        )
        SELECT coalesce(array_agg(x.id), '{}'), coalesce(array_agg(x.type), '{}'),
               coalesce(array_agg(CASE WHEN x.form_ok THEN regexp_replace(x.occurred_at, '(\.[0-9]{6})[0-9]+', '\1')::timestamptz END), '{}'),
               coalesce(array_agg(x.aggregate_type), '{}'), coalesce(array_agg(x.aggregate_id), '{}'),
               coalesce(array_agg(x.tenant_id), '{}'), coalesce(array_agg(x.correlation_id), '{}'),
               coalesce(array_agg(x.causation_id), '{}'), coalesce(array_agg(x.traceparent), '{}'),
               coalesce(array_agg(x.tracestate), '{}'),
               coalesce(array_agg(CASE WHEN x.form_ok THEN x.schema_version::bigint END), '{}'),
               coalesce(array_agg(x.payload::text), '{}'),
               coalesce(bool_and(x.form_ok), true), coalesce(bool_or(json_typeof(x.payload) = 'string'), false)
        INTO ids, types, occurred, agg_types, agg_ids, tenants, correlations, causations, traceparents, tracestates,
             versions, payloads, forms_ok, string_payloads
        FROM x;
    EXCEPTION WHEN datetime_field_overflow OR invalid_datetime_format OR invalid_parameter_value THEN
        -- A well-formed occurred_at that is no date (2026-02-30): a shape
        -- problem comes first, then find whose date it is.
        PERFORM fifobox_check_batch_shape(events);
        FOR e IN SELECT value FROM json_array_elements(events) LOOP
            BEGIN
                PERFORM (e ->> 'occurred_at')::timestamptz;
            EXCEPTION WHEN others THEN
                PERFORM fifobox_raise_invalid(idx, ARRAY['occurred_at', 'invalid', 'must be an RFC 3339 timestamp']);
            END;
            idx := idx + 1;
        END LOOP;
        RAISE;
    END;
    IF NOT forms_ok THEN
        PERFORM fifobox_check_batch_shape(events); -- raises
    END IF;
    -- json_to_recordset turns a string payload's \u escapes into characters,
    -- and Go stores a payload as written: with escapes in the array (not
    -- plain) and a string payload among them, read the payloads again as
    -- written, in one more pass.
    IF NOT plain AND string_payloads THEN
        SELECT array_agg((a.e -> 'payload')::text ORDER BY a.o) INTO payloads
        FROM json_array_elements(events) WITH ORDINALITY AS a(e, o);
    END IF;
    RETURN QUERY SELECT * FROM fifobox_enqueue_events(ids, types, occurred, agg_types, agg_ids, tenants, correlations,
        causations, traceparents, tracestates, versions, payloads, max_message_bytes);
END
$f$;
-- +goose StatementEnd

-- +goose Down
-- 00013's definitions again.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fifobox_enqueue_events(ids text[], types text[], occurred timestamptz[], agg_types text[], agg_ids text[],
    tenants text[], correlations text[], causations text[], traceparents text[], tracestates text[],
    schema_versions bigint[], payloads text[], max_message_bytes integer)
RETURNS TABLE (event_id uuid, sequence bigint)
LANGUAGE plpgsql VOLATILE AS $f$
#variable_conflict use_column
DECLARE
    n integer := cardinality(types);
    problem text[];
    heads text[] := '{}';  -- each event's body up to its sequence
    tails text[] := '{}';  -- and after it
    seqs bigint[];
    sized bigint;
    dup_at bigint;
    dup_of bigint;
    payloads_json boolean;
    i integer;
BEGIN
    IF max_message_bytes IS NULL OR max_message_bytes < 1 OR max_message_bytes > 262144 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', COLUMN = 'max_message_bytes',
            MESSAGE = format('enqueue: max_message_bytes %s: must be 1-262144 (the SNS message limit)', max_message_bytes);
    END IF;
    IF n IS NULL OR n = 0 THEN
        RETURN;
    END IF;
    -- The first event whose id an earlier one has: reported when the loop
    -- reaches it, so errors come in the order Go's Enqueue finds them.
    IF n > 1 THEN
        SELECT o, first_o INTO dup_at, dup_of
        FROM (SELECT o, min(o) OVER (PARTITION BY id) AS first_o
              FROM unnest(ids) WITH ORDINALITY AS u(id, o) WHERE id IS NOT NULL) d
        WHERE o > first_o ORDER BY o LIMIT 1;
    END IF;
    -- Parse every payload in one go; only if one is not JSON does each get
    -- its own (slower) check, to say which.
    BEGIN
        PERFORM payloads::json[];
        payloads_json := true;
    EXCEPTION WHEN others THEN
        payloads_json := false;
    END;
    FOR i IN 1..n LOOP
        ids[i] := coalesce(ids[i], fifobox_uuidv7()::text);
        occurred[i] := coalesce(occurred[i], clock_timestamp());
        schema_versions[i] := coalesce(schema_versions[i], 1);
        problem := fifobox_event_problem(ids[i], types[i], occurred[i], agg_types[i], agg_ids[i], tenants[i],
            correlations[i], causations[i], traceparents[i], tracestates[i], schema_versions[i], payloads[i], payloads_json);
        IF problem IS NOT NULL THEN
            PERFORM fifobox_raise_invalid(i - 1, problem);
        END IF;
        -- The body, field for field as envelope.Encode writes it (Go's
        -- json.Encoder, HTML escaping off, payload compacted).
        heads[i] := '{"v":1,"id":' || fifobox_json_string(ids[i])
            || ',"type":' || fifobox_json_string(types[i])
            || ',"occurred_at":"' || to_char(occurred[i] AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
            || coalesce('.' || nullif(rtrim(lpad((extract(microseconds FROM occurred[i])::bigint % 1000000)::text, 6, '0'), '0'), ''), '')
            || 'Z","aggregate_type":' || fifobox_json_string(agg_types[i])
            || ',"aggregate_id":' || fifobox_json_string(agg_ids[i])
            || ',"sequence":';
        tails[i] := coalesce(',"tenant_id":' || fifobox_json_string(nullif(tenants[i], '')), '')
            || coalesce(',"correlation_id":' || fifobox_json_string(nullif(correlations[i], '')), '')
            || coalesce(',"causation_id":' || fifobox_json_string(nullif(causations[i], '')), '')
            || coalesce(',"traceparent":' || fifobox_json_string(nullif(traceparents[i], '')), '')
            || coalesce(',"tracestate":' || fifobox_json_string(nullif(tracestates[i], '')), '')
            || ',"schema_version":' || schema_versions[i]
            || ',"payload":' || CASE WHEN payloads[i] ~ '[ \t\n\r]'
                                     THEN regexp_replace(payloads[i], '("(?:[^"\\]|\\.)*")|[ \t\n\r]+', '\1', 'g')
                                     ELSE payloads[i] END || '}';
        -- Sized with the widest sequence, as Validate does before the outbox
        -- numbers the event; attributes as envelope.AttributesSize counts them.
        sized := octet_length(heads[i]) + 19 + octet_length(tails[i])
            + 16 + octet_length(types[i]) + 20 + octet_length(agg_types[i])
            + coalesce(15 + octet_length(nullif(tenants[i], '')), 0)
            + coalesce(17 + octet_length(nullif(traceparents[i], '')), 0);
        IF sized > max_message_bytes THEN
            PERFORM fifobox_raise_invalid(i - 1, ARRAY['payload', 'too_large',
                format('message would be %s bytes, limit is %s', sized, max_message_bytes)]);
        END IF;
        IF i = dup_at THEN
            PERFORM fifobox_raise_invalid(i - 1, ARRAY['id', 'invalid', format('same id as event %s', dup_of - 1)]);
        END IF;
    END LOOP;

    -- Reserve sequence ranges as outbox.Enqueue does (sqlReserveSeq):
    -- aggregates in byte order, so Go and SQL writers lock them in the same
    -- order and cannot deadlock; the row lock holds until the caller
    -- commits, so sequence order is commit order.
    WITH per AS (
        SELECT t, a, count(*) AS cnt FROM unnest(agg_types, agg_ids) AS u(t, a) GROUP BY t, a
    ), reserved AS (
        INSERT INTO outbox_aggregates AS oa (aggregate_type, aggregate_id, last_seq)
        SELECT t, a, cnt FROM per ORDER BY t COLLATE "C", a COLLATE "C"
        ON CONFLICT (aggregate_type, aggregate_id)
        DO UPDATE SET last_seq = oa.last_seq + EXCLUDED.last_seq
        RETURNING oa.aggregate_type, oa.aggregate_id, oa.last_seq
    ), numbered AS (
        SELECT u.o, r.last_seq - per.cnt
               + row_number() OVER (PARTITION BY u.t, u.a ORDER BY u.o) AS seq
        FROM unnest(agg_types, agg_ids) WITH ORDINALITY AS u(t, a, o)
        JOIN reserved r ON r.aggregate_type = u.t AND r.aggregate_id = u.a
        JOIN per ON per.t = u.t AND per.a = u.a
    )
    SELECT array_agg(seq ORDER BY o) INTO seqs FROM numbered;

    -- The insert and one wake-up per aggregate, as sqlInsertEvents.
    WITH wake AS (
        INSERT INTO outbox_wakeups (aggregate_type, aggregate_id)
        SELECT DISTINCT t, a FROM unnest(agg_types, agg_ids) AS u(t, a)
    )
    INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq,
                        tenant_id, traceparent, occurred_at, body)
    SELECT e::uuid, ty, at, ai, s, nullif(te, ''), nullif(tp, ''), oc, convert_to(h || s || tl, 'UTF8')
    FROM unnest(ids, types, agg_types, agg_ids, seqs, tenants, traceparents, occurred, heads, tails)
        WITH ORDINALITY AS u(e, ty, at, ai, s, te, tp, oc, h, tl, o)
    ORDER BY o;
    -- Not RETURNING: that needs SELECT on outbox, which producers lack.
    RETURN QUERY SELECT e::uuid, s FROM unnest(ids, seqs) WITH ORDINALITY AS u(e, s, o) ORDER BY o;
END
$f$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fifobox_enqueue_batch(events json, max_message_bytes integer DEFAULT 262144)
RETURNS TABLE (event_id uuid, sequence bigint)
LANGUAGE plpgsql VOLATILE AS $f$
#variable_conflict use_column
DECLARE
    strs text[] := ARRAY['id', 'type', 'occurred_at', 'aggregate_type', 'aggregate_id', 'tenant_id',
                         'correlation_id', 'causation_id', 'traceparent', 'tracestate'];
    bad record;
    e json;
    idx integer := 0;
    ids text[]; types text[]; occurred timestamptz[]; agg_types text[]; agg_ids text[]; tenants text[];
    correlations text[]; causations text[]; traceparents text[]; tracestates text[]; versions bigint[]; payloads text[];
BEGIN
    IF events IS NULL OR json_typeof(events) <> 'array' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', COLUMN = 'events',
            MESSAGE = 'enqueue: events: must be a JSON array of envelopes';
    END IF;
    -- The first shape problem, in event and member order: not an object;
    -- a member twice, unknown, of the wrong JSON type, or of the wrong form.
    SELECT a.o - 1 AS idx, p.field, p.reason INTO bad
    FROM json_array_elements(events) WITH ORDINALITY AS a(e, o)
    CROSS JOIN LATERAL (
        SELECT 'envelope'::text AS field, 'is not a JSON object'::text AS reason, 0::bigint AS pos
        WHERE json_typeof(a.e) <> 'object'
        UNION ALL
        SELECT key, reason, pos FROM (
            SELECT m.key, m.pos, CASE
                WHEN count(*) OVER (PARTITION BY m.key) > 1 THEN 'appears twice'
                WHEN NOT (m.key = ANY (strs) OR m.key IN ('schema_version', 'payload'))
                    THEN 'is not an envelope field (the outbox writes v and sequence)'
                WHEN json_typeof(m.value) = 'null' OR m.key = 'payload' THEN NULL
                WHEN m.key = 'schema_version' THEN
                    CASE WHEN json_typeof(m.value) <> 'number' OR m.value::text !~ '^-?[0-9]{1,18}$'
                         THEN 'must be 1 to 2147483647' END
                WHEN json_typeof(m.value) <> 'string' THEN format('has JSON type %s, want string', json_typeof(m.value))
                WHEN m.key = 'occurred_at' AND m.value::text
                    !~ '^"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})"$'
                    THEN 'must be an RFC 3339 timestamp'
                END AS reason
            FROM json_each(CASE WHEN json_typeof(a.e) = 'object' THEN a.e END) WITH ORDINALITY AS m(key, value, pos)
        ) x WHERE reason IS NOT NULL
    ) p
    ORDER BY a.o, p.pos LIMIT 1;
    IF FOUND THEN
        PERFORM fifobox_raise_invalid(bad.idx::integer, ARRAY[bad.field, 'invalid', bad.reason]);
    END IF;
    BEGIN
        -- One pass over the array. Microseconds are kept and finer digits
        -- dropped rather than rounded, as Go's driver stores them.
        SELECT coalesce(array_agg(x.id ORDER BY a.o), '{}'), coalesce(array_agg(x.type ORDER BY a.o), '{}'),
               coalesce(array_agg(regexp_replace(x.occurred_at, '(\.[0-9]{6})[0-9]+', '\1')::timestamptz ORDER BY a.o), '{}'),
               coalesce(array_agg(x.aggregate_type ORDER BY a.o), '{}'), coalesce(array_agg(x.aggregate_id ORDER BY a.o), '{}'),
               coalesce(array_agg(x.tenant_id ORDER BY a.o), '{}'), coalesce(array_agg(x.correlation_id ORDER BY a.o), '{}'),
               coalesce(array_agg(x.causation_id ORDER BY a.o), '{}'), coalesce(array_agg(x.traceparent ORDER BY a.o), '{}'),
               coalesce(array_agg(x.tracestate ORDER BY a.o), '{}'), coalesce(array_agg(x.schema_version ORDER BY a.o), '{}'),
               coalesce(array_agg(x.payload::text ORDER BY a.o), '{}')
        INTO ids, types, occurred, agg_types, agg_ids, tenants, correlations, causations, traceparents, tracestates,
             versions, payloads
        FROM json_array_elements(events) WITH ORDINALITY AS a(e, o),
             LATERAL json_to_record(a.e) AS x(id text, type text, occurred_at text, aggregate_type text, aggregate_id text,
                 tenant_id text, correlation_id text, causation_id text, traceparent text, tracestate text,
                 schema_version bigint, payload json);
    EXCEPTION WHEN datetime_field_overflow OR invalid_datetime_format OR invalid_parameter_value THEN
        -- A well-formed occurred_at that is no date (2026-02-30): find whose.
        FOR e IN SELECT value FROM json_array_elements(events) LOOP
            BEGIN
                PERFORM (e ->> 'occurred_at')::timestamptz;
            EXCEPTION WHEN others THEN
                PERFORM fifobox_raise_invalid(idx, ARRAY['occurred_at', 'invalid', 'must be an RFC 3339 timestamp']);
            END;
            idx := idx + 1;
        END LOOP;
        RAISE;
    END;
    RETURN QUERY SELECT * FROM fifobox_enqueue_events(ids, types, occurred, agg_types, agg_ids, tenants, correlations,
        causations, traceparents, tracestates, versions, payloads, max_message_bytes);
END
$f$;
-- +goose StatementEnd

DROP FUNCTION fifobox_check_batch_shape(json);
DROP FUNCTION fifobox_raise_bad_escapes(json, integer);
