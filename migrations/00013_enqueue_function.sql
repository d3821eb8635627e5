-- +goose Up

-- Enqueue from SQL (issue 19): a producer in any language calls
-- fifobox_enqueue (one event, named arguments) or fifobox_enqueue_batch (a
-- JSON array of envelopes) inside its own business transaction, and gets
-- exactly what Go's outbox.Enqueue writes: the same validation with the same
-- limits and the same field named on error, the same sequence assignment and
-- locking, the same stored row and byte-for-byte the same body. Nothing is
-- written when any event is invalid. No session state (RDS Proxy and
-- pgbouncer in transaction mode work); SECURITY INVOKER, so the caller needs
-- fifobox_producer's rights and nothing more.
--
-- One definition of the rules: pkg/envelope (rules.go, envelope.go) is the
-- reference; pkg/envelope/testdata/validation.json lists the cases both must
-- agree on, and pkg/outbox/sqlenqueue_test.go runs that table and a fuzz
-- pair through both paths. Change a rule in both places, and add its case.
--
-- Errors: SQLSTATE 22004 (a required field is missing), 22023 (a field is
-- invalid) or 54000 (the message is too large), with the field's JSON name
-- as the error's column (node-postgres err.column, psycopg
-- e.diag.column_name) and the message Go's Enqueue would return, e.g.
-- "enqueue event 0: envelope: aggregate_id: field is invalid: ...".
-- Two inputs never reach these functions, because PostgreSQL's own type
-- input rejects them first (SQLSTATE 22021 and 22008): text that is not
-- valid UTF-8, and a timestamp outside PostgreSQL's range (year 300000).

-- fifobox_json_string writes s as a JSON string the way Go's encoder does
-- with HTML escaping off: only " and \ escaped, and U+2028/U+2029 (Go
-- escapes those always). Control characters never get here: every field
-- that could hold one rejects it.
-- +goose StatementBegin
CREATE FUNCTION fifobox_json_string(s text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $f$
SELECT '"' || replace(replace(replace(replace(s, '\', '\\'), '"', '\"'), U&'\2028', '\u2028'), U&'\2029', '\u2029') || '"'
$f$;
-- +goose StatementEnd

-- fifobox_float64_ok: Go's strconv.ParseFloat(num, 64) succeeds (num is a
-- valid JSON number). It fails only on overflow, at 2^1024 - 2^970 and above
-- (halfway past the largest double rounds to infinity); underflow is 0 and
-- fine, which PostgreSQL's float8 input would reject, hence the arithmetic.
-- +goose StatementBegin
CREATE FUNCTION fifobox_float64_ok(num text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $f$
DECLARE
    m text[] := regexp_match(num, '^-?([0-9]+)(?:\.([0-9]+))?(?:[eE]([+-]?[0-9]+))?$');
    int_part text := ltrim(m[1], '0');
    frac text := coalesce(m[2], '');
    e numeric := coalesce(m[3], '0')::numeric;
    magnitude numeric; -- the decimal exponent: the value is below 10^magnitude
BEGIN
    IF int_part <> '' THEN
        magnitude := length(int_part) + e;
    ELSIF rtrim(frac, '0') <> '' THEN
        magnitude := e - (length(frac) - length(ltrim(frac, '0')));
    ELSE
        RETURN true; -- zero
    END IF;
    IF magnitude <= 308 THEN
        RETURN true; -- below 10^308 < the largest double
    ELSIF magnitude > 309 THEN
        RETURN false;
    END IF;
    RETURN abs(num::numeric) < power(2::numeric, 1024) - power(2::numeric, 970);
END
$f$;
-- +goose StatementEnd

-- fifobox_payload_problem returns why p breaks the payload rules
-- (envelope.checkPayload), as 'missing' or 'invalid' then ':' and the
-- reason, or NULL when p is a valid payload. is_json: the caller has
-- already parsed p as JSON (saves a subtransaction per event).
-- +goose StatementBegin
CREATE FUNCTION fifobox_payload_problem(p text, is_json boolean DEFAULT false) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $f$
DECLARE
    j json;
    bare text; -- p with every string emptied: what is left is structure and numbers
    brackets text;
    esc text[];
    high boolean := false;
    num text;
    members integer;
    jb_bare text;
    trimmed text;
BEGIN
    trimmed := btrim(p, E' \t\n\r');
    IF p IS NULL OR trimmed = '' THEN
        RETURN 'missing:';
    END IF;
    IF is_json THEN
        j := p::json; -- the caller parsed it already
    ELSE
        BEGIN
            j := p::json;
        EXCEPTION WHEN others THEN
            RETURN 'invalid:is not valid JSON';
        END;
    END IF;
    IF trimmed = 'null' THEN
        RETURN 'missing:is JSON null; use {} for an event without data';
    END IF;
    -- \u escapes: PostgreSQL's json type keeps \u0000 and unpaired
    -- surrogates; Go rejects both. Each match is the text since the last
    -- escape and the escape itself, so a pair's halves are adjacent when the
    -- gap is empty.
    IF strpos(p, '\') > 0 THEN
        FOR esc IN SELECT regexp_matches(p, '([^\\]*)\\(u[0-9a-fA-F]{4}|.)', 'g') LOOP
            IF high THEN
                IF esc[1] <> '' OR esc[2] !~* '^ud[c-f]' THEN
                    RETURN 'invalid:a string has an unpaired surrogate escape';
                END IF;
                high := false;
                CONTINUE;
            END IF;
            IF esc[2] ~* '^u0000$' THEN
                RETURN 'invalid:a string contains \u0000, which PostgreSQL jsonb and many consumers cannot store';
            ELSIF esc[2] ~* '^ud[c-f]' THEN
                RETURN 'invalid:a string has an unpaired surrogate escape';
            ELSIF esc[2] ~* '^ud[89ab]' THEN
                high := true;
            END IF;
        END LOOP;
        IF high THEN
            RETURN 'invalid:a string has an unpaired surrogate escape';
        END IF;
    END IF;
    bare := regexp_replace(p, '"(?:[^"\\]|\\.)*"', '""', 'g');
    -- Depth: peel innermost pairs; 32 rounds empty anything 32 deep or less.
    -- (32 openings or fewer cannot nest deeper than 32.)
    IF length(bare) - length(replace(replace(bare, '[', ''), '{', '')) > 32 THEN
        brackets := regexp_replace(bare, '[^][{}]', '', 'g');
        FOR i IN 1..32 LOOP
            EXIT WHEN brackets = '';
            brackets := regexp_replace(brackets, '\{\}|\[\]', '', 'g');
        END LOOP;
    ELSE
        brackets := '';
    END IF;
    IF brackets <> '' THEN
        RETURN 'invalid:nests deeper than 32 arrays and objects';
    END IF;
    -- Only a number with an exponent or over 308 digits can overflow.
    IF bare ~ '[0-9][eE]' OR length(bare) > 308 THEN
        FOR num IN SELECT (regexp_matches(bare, '-?[0-9][0-9.eE+-]*', 'g'))[1] LOOP
            IF NOT fifobox_float64_ok(num) THEN
                RETURN 'invalid:a number does not fit a 64-bit floating point value';
            END IF;
        END LOOP;
    END IF;
    -- Duplicate member names: jsonb keeps one member per name, so the
    -- payload has a duplicate exactly when jsonb has fewer members. Every
    -- member has one ':' outside strings, in either text.
    members := length(bare) - length(replace(bare, ':', ''));
    IF members > 1 THEN
        jb_bare := regexp_replace(j::jsonb::text, '"(?:[^"\\]|\\.)*"', '""', 'g');
    END IF;
    IF members > 1 AND members <> length(jb_bare) - length(replace(jb_bare, ':', '')) THEN
        RETURN 'invalid:an object has two members of the same name';
    END IF;
    RETURN NULL;
END
$f$;
-- +goose StatementEnd

-- fifobox_traceparent_ok: OpenTelemetry's W3C propagator extracts a valid
-- span context from tp (go.opentelemetry.io/otel/propagation, v1.47):
-- lower-case hex parts of 2-32-16-2, version not ff, version 00 with
-- nothing after the flags (a lone trailing '-' passes) and flags <= 03,
-- trace and span ids not all zero.
-- +goose StatementBegin
CREATE FUNCTION fifobox_traceparent_ok(tp text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $f$
DECLARE
    m text[] := regexp_match(tp, '^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$');
BEGIN
    RETURN m IS NOT NULL
       AND m[1] <> 'ff'
       AND (m[1] <> '00' OR (coalesce(m[5], '') IN ('', '-') AND m[4] IN ('00', '01', '02', '03')))
       AND m[2] <> repeat('0', 32)
       AND m[3] <> repeat('0', 16);
END
$f$;
-- +goose StatementEnd

-- fifobox_tracestate_ok: trace.ParseTraceState accepts ts (same module):
-- comma-separated members (empty ones skipped), at most 32, keys unique,
-- each key=value with the key's leading and the value's trailing blanks
-- trimmed.
-- +goose StatementBegin
CREATE FUNCTION fifobox_tracestate_ok(ts text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $f$
DECLARE
    member text;
    m text[];
    keys text[] := '{}';
BEGIN
    FOREACH member IN ARRAY string_to_array(ts, ',') LOOP
        CONTINUE WHEN member = '';
        m := regexp_match(member,
            '^[ \t]*([a-z][a-z0-9_*/-]{0,255}|[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13})='
            || '[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*$');
        IF m IS NULL OR m[1] = ANY (keys) THEN
            RETURN false;
        END IF;
        keys := keys || m[1];
        IF cardinality(keys) > 32 THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN true;
END
$f$;
-- +goose StatementEnd

-- fifobox_event_problem checks one event against envelope.Validate's rules
-- in its order and returns {field, kind, reason} for the first problem, or
-- NULL. Arguments are after defaulting (id, occurred_at and schema_version
-- are set).
-- +goose StatementBegin
CREATE FUNCTION fifobox_event_problem(id text, type text, occurred_at timestamptz, aggregate_type text, aggregate_id text,
    tenant_id text, correlation_id text, causation_id text, traceparent text, tracestate text, schema_version bigint,
    payload text, payload_is_json boolean DEFAULT false) RETURNS text[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $f$
DECLARE
    f text;
    v text;
    max_len integer;
    year numeric;
    problem text;
BEGIN
    -- The common case in one expression; anything it does not clear goes
    -- through the checks below, in Validate's order, for the exact error.
    IF id ~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$'
       AND octet_length(type) <= 256 AND type ~ '^[A-Za-z0-9._:/-]+$'
       AND occurred_at > timestamptz '0001-01-01 00:00:00+00' AND occurred_at < timestamptz '10000-01-01 00:00:00+00'
       AND octet_length(aggregate_type) <= 128 AND aggregate_type ~ '^[A-Za-z0-9._:/-]+$'
       AND octet_length(aggregate_id) <= 128 AND aggregate_id ~ '^[!-~]+$'
       AND (tenant_id IS NULL OR (char_length(tenant_id) <= 128 AND tenant_id !~ '[\x01-\x1f\x7f]'))
       AND coalesce(correlation_id, '') ~ '^[!-~]{0,128}$' AND coalesce(causation_id, '') ~ '^[!-~]{0,128}$'
       AND coalesce(traceparent, '') = '' AND coalesce(tracestate, '') = ''
       AND schema_version BETWEEN 1 AND 2147483647 THEN
        problem := fifobox_payload_problem(payload, payload_is_json);
        IF problem IS NULL THEN
            RETURN NULL;
        END IF;
        RETURN ARRAY['payload', split_part(problem, ':', 1), substr(problem, strpos(problem, ':') + 1)];
    END IF;
    IF id = '' THEN
        RETURN ARRAY['id', 'missing', ''];
    ELSIF octet_length(id) <> 36 OR id !~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$' THEN
        RETURN ARRAY['id', 'invalid', 'must be a UUID in canonical 8-4-4-4-12 form'];
    END IF;
    -- type and aggregate_type: letters, digits and . _ - : /
    FOREACH f IN ARRAY ARRAY['type', 'occurred_at', 'aggregate_type'] LOOP
        IF f = 'occurred_at' THEN
            -- Go's zero time counts as missing, as in envelope.Validate.
            IF occurred_at = timestamptz '0001-01-01 00:00:00+00' THEN
                RETURN ARRAY['occurred_at', 'missing', ''];
            END IF;
            year := extract(year FROM occurred_at AT TIME ZONE 'UTC');
            IF year < 0 THEN
                year := year + 1; -- 1 BC is Go's year 0
            END IF;
            IF year < 1 OR year > 9999 THEN
                RETURN ARRAY['occurred_at', 'invalid', format('year %s is outside 0001-9999 (UTC)', year)];
            END IF;
            CONTINUE;
        END IF;
        v := CASE f WHEN 'type' THEN type ELSE aggregate_type END;
        max_len := CASE f WHEN 'type' THEN 256 ELSE 128 END;
        IF v IS NULL OR v = '' THEN
            RETURN ARRAY[f, 'missing', ''];
        ELSIF octet_length(v) > max_len THEN
            RETURN ARRAY[f, 'invalid', format('is %s characters, at most %s allowed', octet_length(v), max_len)];
        ELSIF v !~ '^[A-Za-z0-9._:/-]+$' THEN
            RETURN ARRAY[f, 'invalid', 'has a character that is not a letter, digit or one of . _ - : /'];
        END IF;
    END LOOP;
    -- aggregate_id, correlation_id, causation_id: an SNS FIFO group id.
    FOREACH f IN ARRAY ARRAY['aggregate_id', 'tenant_id', 'correlation_id', 'causation_id'] LOOP
        IF f = 'tenant_id' THEN
            IF tenant_id IS NOT NULL AND tenant_id <> '' THEN
                IF char_length(tenant_id) > 128 THEN
                    RETURN ARRAY['tenant_id', 'invalid', 'is longer than 128 characters'];
                ELSIF tenant_id ~ '[\x01-\x1f\x7f]' THEN
                    RETURN ARRAY['tenant_id', 'invalid', 'contains a control character'];
                END IF;
            END IF;
            CONTINUE;
        END IF;
        v := CASE f WHEN 'aggregate_id' THEN aggregate_id WHEN 'correlation_id' THEN correlation_id ELSE causation_id END;
        IF v IS NULL OR v = '' THEN
            IF f = 'aggregate_id' THEN
                RETURN ARRAY[f, 'missing', ''];
            END IF;
        ELSIF octet_length(v) > 128 THEN
            RETURN ARRAY[f, 'invalid', format('is %s characters, at most 128 allowed', octet_length(v))];
        ELSIF v !~ '^[!-~]+$' THEN
            RETURN ARRAY[f, 'invalid', 'has a character that is not alphanumeric or punctuation'];
        END IF;
    END LOOP;
    IF traceparent <> '' AND NOT fifobox_traceparent_ok(traceparent) THEN
        RETURN ARRAY['traceparent', 'invalid', 'must be a W3C traceparent (00-<trace-id>-<span-id>-<flags>)'];
    END IF;
    IF tracestate <> '' THEN
        IF traceparent IS NULL OR traceparent = '' THEN
            RETURN ARRAY['tracestate', 'invalid', 'set without traceparent'];
        ELSIF NOT fifobox_tracestate_ok(tracestate) THEN
            RETURN ARRAY['tracestate', 'invalid', 'must be a W3C tracestate'];
        END IF;
    END IF;
    IF schema_version < 1 OR schema_version > 2147483647 THEN
        RETURN ARRAY['schema_version', 'invalid', 'must be 1 to 2147483647'];
    END IF;
    problem := fifobox_payload_problem(payload, payload_is_json);
    IF problem IS NOT NULL THEN
        RETURN ARRAY['payload', split_part(problem, ':', 1), substr(problem, strpos(problem, ':') + 1)];
    END IF;
    RETURN NULL;
END
$f$;
-- +goose StatementEnd

-- fifobox_raise_invalid raises the typed error for event idx's problem.
-- +goose StatementBegin
CREATE FUNCTION fifobox_raise_invalid(idx integer, problem text[]) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $f$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = CASE problem[2] WHEN 'missing' THEN '22004' WHEN 'too_large' THEN '54000' ELSE '22023' END,
        COLUMN = problem[1],
        MESSAGE = format('enqueue event %s: envelope: %s: %s%s', idx, problem[1],
            CASE problem[2] WHEN 'missing' THEN 'required field is missing'
                            WHEN 'too_large' THEN 'message is too large' ELSE 'field is invalid' END,
            CASE WHEN problem[3] <> '' THEN ': ' || problem[3] ELSE '' END);
END
$f$;
-- +goose StatementEnd

-- fifobox_uuidv7 is a time-ordered UUID (version 7), what envelope.New uses.
-- +goose StatementBegin
CREATE FUNCTION fifobox_uuidv7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $f$
SELECT encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3) FROM 1 FOR 6),
    52, 1), 53, 1), 'hex')::uuid
$f$;
-- +goose StatementEnd

-- fifobox_enqueue_events is the one implementation behind both entry
-- points: one element per event in each array, in the order given. It is
-- outbox.Writer.Enqueue in SQL.
-- +goose StatementBegin
CREATE FUNCTION fifobox_enqueue_events(ids text[], types text[], occurred timestamptz[], agg_types text[], agg_ids text[],
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

-- fifobox_enqueue enqueues one event. Names are the envelope's JSON names;
-- id defaults to a new UUIDv7, occurred_at to the clock, schema_version to
-- 1 (what envelope.New sets). payload is the JSON text.
-- +goose StatementBegin
CREATE FUNCTION fifobox_enqueue(aggregate_type text, aggregate_id text, type text, payload text,
    id text DEFAULT NULL, occurred_at timestamptz DEFAULT NULL, tenant_id text DEFAULT NULL,
    correlation_id text DEFAULT NULL, causation_id text DEFAULT NULL, traceparent text DEFAULT NULL,
    tracestate text DEFAULT NULL, schema_version bigint DEFAULT NULL, max_message_bytes integer DEFAULT 262144)
RETURNS TABLE (event_id uuid, sequence bigint)
LANGUAGE plpgsql VOLATILE AS $f$
BEGIN
    -- plpgsql rather than sql: its plans are cached for the session.
    RETURN QUERY SELECT * FROM fifobox_enqueue_events(ARRAY[$5], ARRAY[$3], ARRAY[$6], ARRAY[$1], ARRAY[$2], ARRAY[$7],
        ARRAY[$8], ARRAY[$9], ARRAY[$10], ARRAY[$11], ARRAY[$12], ARRAY[$4], $13);
END
$f$;
-- +goose StatementEnd

-- fifobox_enqueue_batch enqueues a JSON array of envelopes, in order, all or
-- nothing: each an object with the envelope's JSON names, payload a JSON
-- value (kept as written, then compacted) and occurred_at an RFC 3339
-- string (microsecond precision, PostgreSQL's; finer digits are dropped as
-- Go's driver drops them from the stored column). Absent or null members
-- take fifobox_enqueue's defaults; any other member is an error naming it
-- (v and sequence are the outbox's to write).
-- +goose StatementBegin
CREATE FUNCTION fifobox_enqueue_batch(events json, max_message_bytes integer DEFAULT 262144)
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

-- Producers call these; nobody else needs to (SECURITY INVOKER: the
-- caller's own rights on outbox, outbox_aggregates and outbox_wakeups apply).
REVOKE ALL ON FUNCTION fifobox_enqueue(text, text, text, text, text, timestamptz, text, text, text, text, text, bigint, integer),
    fifobox_enqueue_batch(json, integer),
    fifobox_enqueue_events(text[], text[], timestamptz[], text[], text[], text[], text[], text[], text[], text[], bigint[], text[], integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fifobox_enqueue(text, text, text, text, text, timestamptz, text, text, text, text, text, bigint, integer),
    fifobox_enqueue_batch(json, integer),
    fifobox_enqueue_events(text[], text[], timestamptz[], text[], text[], text[], text[], text[], text[], text[], bigint[], text[], integer)
    TO fifobox_producer;

-- +goose Down
DROP FUNCTION fifobox_enqueue_batch(json, integer);
DROP FUNCTION fifobox_enqueue(text, text, text, text, text, timestamptz, text, text, text, text, text, bigint, integer);
DROP FUNCTION fifobox_enqueue_events(text[], text[], timestamptz[], text[], text[], text[], text[], text[], text[], text[], bigint[], text[], integer);
DROP FUNCTION fifobox_uuidv7();
DROP FUNCTION fifobox_raise_invalid(integer, text[]);
DROP FUNCTION fifobox_event_problem(text, text, timestamptz, text, text, text, text, text, text, text, bigint, text, boolean);
DROP FUNCTION fifobox_tracestate_ok(text);
DROP FUNCTION fifobox_traceparent_ok(text);
DROP FUNCTION fifobox_payload_problem(text, boolean);
DROP FUNCTION fifobox_float64_ok(text);
DROP FUNCTION fifobox_json_string(text);
